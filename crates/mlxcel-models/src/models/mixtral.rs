//! Mixtral: llama attention, every feed-forward block a softmax-routed mixture of experts
//! (`block_sparse_moe`, experts `w1`/`w3`/`w2` = gate/up/down, top-k weights renormalised).

use mlxcel_core::WeightMap;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, MoeArgs};
use super::transformer::{Decoder, Transformer};
use crate::model::Architecture;
use crate::sanitize::stack_experts;
use crate::weights::ModelWeights;
use crate::Result;

#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    #[serde(flatten)]
    pub common: CommonArgs,
    #[serde(flatten)]
    pub moe: MoeArgs,
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
                args.moe.num_experts as usize,
                &[("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")],
            )?;
        }
        Ok(())
    }

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Self> {
        let c = &args.common;
        let mut spec = base_spec(c, false, "silu")?;
        // Mixtral always renormalises the kept weights.
        args.moe.apply(&mut spec, c.intermediate()?, true, None);
        spec.ffn_prefix = "block_sparse_moe";
        spec.windows = c.windows(|_| c.sliding_window.is_some())?;
        Ok(Transformer::new(Decoder::build(&spec, w)?))
    }
}
