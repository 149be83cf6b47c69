//! Qwen3-MoE: Qwen3 attention (per-head qk-norm) with softmax-routed experts, no shared expert,
//! `norm_topk_prob` renormalisation.

use mlxcel_core::WeightMap;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, MoeArgs};
use super::transformer::{Decoder, QkNormSpec, Transformer};
use crate::model::Architecture;
use crate::sanitize::stack_mlp_experts;
use crate::weights::ModelWeights;
use crate::Result;

#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    #[serde(flatten)]
    pub common: CommonArgs,
    #[serde(flatten)]
    pub moe: MoeArgs,
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
            args.moe.num_experts as usize,
        )
    }

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Self> {
        let c = &args.common;
        let mut spec = base_spec(c, false, "silu")?;
        spec.qkv_bias = args.attention_bias;
        spec.o_bias = args.attention_bias;
        spec.qk_norm = QkNormSpec::PerHead;
        args.moe.apply(
            &mut spec,
            args.moe.expert_intermediate(c)?,
            args.moe.norm_topk_prob,
            None,
        );
        Ok(Transformer::new(Decoder::build(&spec, w)?))
    }
}
