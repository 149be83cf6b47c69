//! Seed-OSS (ByteDance): llama with biases on the q/k/v projections (`attention_bias`, default
//! true), optionally on the output projection (`attention_out_bias`) and the MLP (`mlp_bias`),
//! and a head width of its own (`head_dim`, default 128).

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::Result;

fn yes() -> bool {
    true
}

/// transformers' `SeedOssConfig.head_dim` default.
const DEFAULT_HEAD_DIM: i32 = 128;

/// The `config.json` keys of Seed-OSS (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `head_dim`: width of one head; default 128 (not `hidden_size / num_attention_heads`).
    /// A named field, so it is read here rather than by [`CommonArgs`].
    #[serde(default)]
    pub head_dim: Option<i32>,
    /// `attention_bias`: biases on the q/k/v projections; default true.
    #[serde(default = "yes")]
    pub attention_bias: bool,
    /// `attention_out_bias`: a bias on the output projection; default false.
    #[serde(default)]
    pub attention_out_bias: bool,
    /// `mlp_bias`: biases on the MLP projections; default false.
    #[serde(default)]
    pub mlp_bias: bool,
}

/// The Seed-OSS decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let mut c = self.common.clone();
        c.head_dim = Some(self.head_dim.unwrap_or(DEFAULT_HEAD_DIM));
        let mut spec = base_spec(&c, false, "silu")?;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_out_bias;
        spec.mlp_bias = self.mlp_bias;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::common::test_spec;
    use serde_json::json;

    #[test]
    fn head_dim_and_bias_defaults() {
        let s = test_spec::<Args>("seed_oss", json!({})).unwrap();
        assert_eq!(s.head_dim, 128, "transformers' default, not hidden / heads");
        assert!(s.qkv_bias && !s.o_bias && !s.mlp_bias);
    }
}
