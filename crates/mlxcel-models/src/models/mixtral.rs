//! Mixtral: llama attention, every feed-forward block a softmax-routed mixture of experts
//! (`block_sparse_moe`, experts `w1`/`w3`/`w2` = gate/up/down, top-k weights renormalised).

use mlxcel_core::WeightMap;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{Decoder, FfnSpec, MoeSpec, Transformer};
use crate::model::Architecture;
use crate::nn::RouterScoring;
use crate::sanitize::stack_experts;
use crate::weights::ModelWeights;
use crate::Result;

#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    #[serde(flatten)]
    pub common: CommonArgs,
    pub num_local_experts: i32,
    pub num_experts_per_tok: i32,
}

pub type Model = Transformer<Args>;

impl Architecture for Model {
    type Args = Args;

    fn sanitize(args: &Args, weights: &mut WeightMap) -> Result<()> {
        for i in 0..args.common.num_hidden_layers {
            stack_experts(
                weights,
                &format!("model.layers.{i}.block_sparse_moe"),
                "experts",
                args.num_local_experts as usize,
                &[("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")],
            )?;
        }
        Ok(())
    }

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Self> {
        let c = &args.common;
        let mut spec = base_spec(c, false, "silu")?;
        let moe = MoeSpec {
            experts: args.num_local_experts,
            top_k: args.num_experts_per_tok,
            intermediate: c.intermediate()?,
            scoring: RouterScoring::Softmax,
            normalize: true,
            shared_intermediate: None,
        };
        spec.ffn = vec![FfnSpec::Moe(moe); c.num_hidden_layers];
        spec.ffn_prefix = "block_sparse_moe";
        spec.windows = c.windows(|_| c.sliding_window.is_some())?;
        Ok(Transformer::new(Decoder::build(&spec, w)?))
    }
}
