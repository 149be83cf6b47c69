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

/// The `config.json` keys of Cohere (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `logit_scale`: multiplies the output logits; default `0.0625`.
    #[serde(default = "default_logit_scale")]
    pub logit_scale: f64,
    /// `layer_norm_eps`: the LayerNorms' epsilon; default `1e-5`.
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f32,
    /// `use_qk_norm`: per-head LayerNorm (weights per head) on queries and keys; default false.
    #[serde(default)]
    pub use_qk_norm: bool,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
}

/// The Cohere decoder: the shared [`Transformer`] configured by [`Args`].
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
