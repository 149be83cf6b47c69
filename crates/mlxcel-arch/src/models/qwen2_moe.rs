//! Qwen2-MoE: Qwen2 attention; sparse layers route over experts and add a shared expert gated
//! by `sigmoid(shared_expert_gate(x))`; `mlp_only_layers` and `decoder_sparse_step` choose
//! which layers are sparse.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, MoeArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::sanitize::stack_mlp_experts;
use crate::Result;

/// The `config.json` keys of Qwen2-MoE (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// The mixture-of-experts keys (`num_experts`, `num_experts_per_tok`, ...).
    #[serde(flatten)]
    pub moe: MoeArgs,
    /// `shared_expert_intermediate_size`: width of the sigmoid-gated shared expert; absent: no
    /// shared expert.
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<i32>,
}

/// The Qwen2-MoE decoder: the shared [`Transformer`] configured by [`Args`].
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
        spec.qkv_bias = true;
        let moe = &args.moe;
        moe.apply(
            &mut spec,
            moe.expert_intermediate(c)?,
            moe.norm_topk_prob,
            args.shared_expert_intermediate_size,
        );
        Ok(spec)
    }
}
