//! OLMoE: RMSNorm over the full query and key projections (before splitting heads) and a
//! softmax-routed mixture of experts on every layer.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, MoeArgs};
use super::transformer::{DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::sanitize::stack_mlp_experts;
use crate::{ModelError, Result};

/// The `config.json` keys of OLMoE (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// The mixture-of-experts keys (`num_experts`, `num_experts_per_tok`, ...).
    #[serde(flatten)]
    pub moe: MoeArgs,
    /// `clip_qkv`: clamp q/k/v to `±clip`; not supported (a set value is an error).
    #[serde(default)]
    pub clip_qkv: Option<f64>,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
}

/// The OLMoE decoder: the shared [`Transformer`] configured by [`Args`].
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
        if let Some(clip) = args.clip_qkv {
            return Err(ModelError::Unsupported(format!("olmoe clip_qkv = {clip}")));
        }
        let c = &args.common;
        let mut spec = base_spec(c, false, "silu")?;
        spec.qkv_bias = args.attention_bias;
        spec.o_bias = args.attention_bias;
        spec.qk_norm = QkNormSpec::Full;
        // OLMoE's experts are `intermediate_size` wide and every layer is sparse.
        args.moe
            .apply(&mut spec, c.intermediate()?, args.moe.norm_topk_prob, None);
        Ok(spec)
    }
}
