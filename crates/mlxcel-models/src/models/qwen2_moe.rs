//! Qwen2-MoE: Qwen2 attention; sparse layers route over experts and add a shared expert gated
//! by `sigmoid(shared_expert_gate(x))`; `mlp_only_layers` and `decoder_sparse_step` choose
//! which layers are sparse.

use mlxcel_core::WeightMap;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{Decoder, FfnSpec, MoeSpec, Transformer};
use crate::model::Architecture;
use crate::nn::RouterScoring;
use crate::sanitize::stack_mlp_experts;
use crate::weights::ModelWeights;
use crate::Result;

fn one() -> usize {
    1
}

#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    #[serde(flatten)]
    pub common: CommonArgs,
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub moe_intermediate_size: i32,
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<i32>,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
}

/// Whether layer `i` is a mixture-of-experts layer (transformers' rule).
pub(crate) fn is_sparse(i: usize, mlp_only: &[usize], step: usize) -> bool {
    !mlp_only.contains(&i) && step > 0 && (i + 1) % step == 0
}

pub type Model = Transformer<Args>;

impl Architecture for Model {
    type Args = Args;

    fn sanitize(args: &Args, weights: &mut WeightMap) -> Result<()> {
        stack_mlp_experts(
            weights,
            args.common.num_hidden_layers,
            args.num_experts as usize,
        )
    }

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Self> {
        let c = &args.common;
        let mut spec = base_spec(c, false, "silu")?;
        spec.qkv_bias = true;
        let moe = MoeSpec {
            experts: args.num_experts,
            top_k: args.num_experts_per_tok,
            intermediate: args.moe_intermediate_size,
            scoring: RouterScoring::Softmax,
            normalize: args.norm_topk_prob,
            shared_intermediate: args.shared_expert_intermediate_size,
        };
        for (i, ffn) in spec.ffn.iter_mut().enumerate() {
            if is_sparse(i, &args.mlp_only_layers, args.decoder_sparse_step) {
                *ffn = FfnSpec::Moe(moe.clone());
            }
        }
        Ok(Transformer::new(Decoder::build(&spec, w)?))
    }
}
