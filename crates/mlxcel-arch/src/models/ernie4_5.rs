//! ERNIE 4.5 (dense): llama with interleaved rope, optional biases on every projection
//! (`use_bias`), a head width of its own (`head_dim`, default 128) and tied embeddings by default.

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::Result;

fn default_rms_norm_eps() -> f32 {
    1e-5
}

/// transformers' `Ernie4_5Config.head_dim` default.
const DEFAULT_HEAD_DIM: i32 = 128;

/// The `config.json` keys of ERNIE 4.5 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `head_dim`: width of one head; default 128 (not `hidden_size / num_attention_heads`).
    /// A named field, so it is read here rather than by [`CommonArgs`].
    #[serde(default)]
    pub head_dim: Option<i32>,
    /// `rms_norm_eps`: the RMSNorms' epsilon; default `1e-5`.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f32,
    /// `use_bias`: biases on the attention and MLP projections; default false.
    #[serde(default)]
    pub use_bias: bool,
}

/// The ERNIE 4.5 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let mut c = self.common.clone();
        c.head_dim = Some(self.head_dim.unwrap_or(DEFAULT_HEAD_DIM));
        let mut spec = base_spec(&c, true, "silu")?;
        spec.eps = self.rms_norm_eps;
        spec.qkv_bias = self.use_bias;
        spec.o_bias = self.use_bias;
        spec.mlp_bias = self.use_bias;
        for rope in spec.rope.iter_mut().flatten() {
            rope.traditional = true;
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::common::test_spec;
    use serde_json::json;

    #[test]
    fn defaults() {
        let s = test_spec::<Args>("ernie4_5", json!({})).unwrap();
        assert_eq!((s.head_dim, s.eps), (128, 1e-5));
        assert!(s.rope[0].as_ref().unwrap().traditional && s.tie_word_embeddings);
    }
}
