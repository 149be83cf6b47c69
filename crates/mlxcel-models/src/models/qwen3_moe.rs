//! Qwen3-MoE: Qwen3 attention (per-head qk-norm) with softmax-routed experts, no shared expert,
//! `norm_topk_prob` renormalisation.

use mlxcel_core::WeightMap;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::qwen2_moe::is_sparse;
use super::transformer::{Decoder, FfnSpec, MoeSpec, QkNormSpec, Transformer};
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
    pub norm_topk_prob: bool,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default)]
    pub attention_bias: bool,
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
        spec.qkv_bias = args.attention_bias;
        spec.o_bias = args.attention_bias;
        spec.qk_norm = QkNormSpec::PerHead;
        let moe = MoeSpec {
            experts: args.num_experts,
            top_k: args.num_experts_per_tok,
            intermediate: args.moe_intermediate_size,
            scoring: RouterScoring::Softmax,
            normalize: args.norm_topk_prob,
            shared_intermediate: None,
        };
        for (i, ffn) in spec.ffn.iter_mut().enumerate() {
            if is_sparse(i, &args.mlp_only_layers, args.decoder_sparse_step) {
                *ffn = FfnSpec::Moe(moe.clone());
            }
        }
        Ok(Transformer::new(Decoder::build(&spec, w)?))
    }
}
