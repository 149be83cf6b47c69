//! Cohere (Command-R): parallel blocks (attention and MLP read the same bias-free LayerNorm of
//! the input), interleaved rope, optional per-head LayerNorm on queries and keys (weights per
//! head), logits multiplied by `logit_scale`, tied embeddings.

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{BlockTopology, DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::nn::NormKind;
use crate::Result;

fn default_logit_scale() -> f64 {
    0.0625
}

fn default_layer_norm_eps() -> f32 {
    1e-5
}

#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    #[serde(flatten)]
    pub common: CommonArgs,
    #[serde(default = "default_logit_scale")]
    pub logit_scale: f64,
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f32,
    #[serde(default)]
    pub use_qk_norm: bool,
    #[serde(default)]
    pub attention_bias: bool,
}

pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        let mut spec = base_spec(c, true, "silu")?;
        spec.topology = BlockTopology::Parallel;
        spec.norm = NormKind::Layer;
        spec.eps = self.layer_norm_eps;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        if self.use_qk_norm {
            spec.qk_norm = QkNormSpec::PerHeadWeights;
        }
        for rope in spec.rope.iter_mut().flatten() {
            rope.traditional = true;
        }
        spec.logit_scale = Some(self.logit_scale);
        Ok(spec)
    }
}
