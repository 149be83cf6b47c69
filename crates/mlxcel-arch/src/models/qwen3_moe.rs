//! Qwen3-MoE: Qwen3 attention (per-head qk-norm) with softmax-routed experts, no shared expert,
//! `norm_topk_prob` renormalisation.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, MoeArgs};
use super::transformer::{DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::sanitize::stack_mlp_experts;
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

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let args = self;
        stack_mlp_experts(
            weights,
            args.common.num_hidden_layers,
            args.moe.num_experts as usize,
        )
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let args = self;
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
        Ok(spec)
    }
}
