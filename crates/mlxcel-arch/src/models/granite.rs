//! Granite (IBM): llama with scalings — embeddings times `embedding_multiplier`, each block's
//! output times `residual_multiplier` before its residual add, attention scores times
//! `attention_multiplier` (instead of `1/sqrt(head_dim)`), logits divided by `logits_scaling`.

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::{ModelError, Result};

fn one() -> f64 {
    1.0
}

/// The `config.json` keys of Granite (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `embedding_multiplier`: multiplies the input embeddings; default 1.
    #[serde(default = "one")]
    pub embedding_multiplier: f64,
    /// `residual_multiplier`: multiplies each block's output before its residual add; default 1.
    #[serde(default = "one")]
    pub residual_multiplier: f64,
    /// `attention_multiplier`: the attention score scale (instead of `1/sqrt(head_dim)`); default 1.
    #[serde(default = "one")]
    pub attention_multiplier: f64,
    /// `logits_scaling`: divides the output logits (finite, non-zero); default 1.
    #[serde(default = "one")]
    pub logits_scaling: f64,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `mlp_bias`: biases on the MLP projections; default false.
    #[serde(default)]
    pub mlp_bias: bool,
}

/// The Granite decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        if !(self.logits_scaling.is_finite() && self.logits_scaling != 0.0) {
            return Err(ModelError::Config(format!(
                "logits_scaling must be a finite non-zero number, found {}",
                self.logits_scaling
            )));
        }
        let mut spec = base_spec(c, false, "silu")?;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        spec.mlp_bias = self.mlp_bias;
        spec.attn_scale = self.attention_multiplier as f32;
        spec.embed_scale = Some(self.embedding_multiplier).filter(|m| *m != 1.0);
        spec.residual_scale = Some(self.residual_multiplier).filter(|m| *m != 1.0);
        spec.logit_scale = Some(1.0 / self.logits_scaling).filter(|m| *m != 1.0);
        Ok(spec)
    }
}
