//! OLMoE: RMSNorm over the full query and key projections (before splitting heads) and a
//! softmax-routed mixture of experts on every layer.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, MoeArgs};
use super::transformer::{DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::sanitize::stack_mlp_experts;
use crate::{ModelError, Result};

#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    #[serde(flatten)]
    pub common: CommonArgs,
    #[serde(flatten)]
    pub moe: MoeArgs,
    #[serde(default)]
    pub clip_qkv: Option<f64>,
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
