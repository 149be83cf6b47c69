//! Llama 1–3 and Mistral (one architecture: Mistral adds a sliding window on every layer).
//! Rope scaling (linear, dynamic, llama3, yarn) comes from `rope_scaling`.

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::Result;

/// The `config.json` keys of Llama / Mistral (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `mlp_bias`: biases on the MLP projections; default false.
    #[serde(default)]
    pub mlp_bias: bool,
}

/// The Llama / Mistral decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let args = self;
        let c = &args.common;
        let mut spec = base_spec(c, false, "silu")?;
        spec.qkv_bias = args.attention_bias;
        spec.o_bias = args.attention_bias;
        spec.mlp_bias = args.mlp_bias;
        // Mistral's `sliding_window` applies to every layer unless `layer_types` says otherwise.
        spec.windows = c.windows(|_| c.sliding_window.is_some())?;
        Ok(spec)
    }
}
