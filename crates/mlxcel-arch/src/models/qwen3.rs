//! Qwen3: llama with per-head RMSNorm on queries and keys (and optional attention bias).

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::Result;

/// The `config.json` keys of Qwen3 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `use_sliding_window`: every layer slides over `sliding_window` (unless `layer_types`
    /// says otherwise); default false.
    #[serde(default)]
    pub use_sliding_window: bool,
}

/// The Qwen3 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let args = self;
        let c = &args.common;
        let mut spec = base_spec(c, true, "silu")?;
        spec.qkv_bias = args.attention_bias;
        spec.o_bias = args.attention_bias;
        spec.qk_norm = QkNormSpec::PerHead;
        if args.use_sliding_window {
            spec.windows = c.windows(|_| true)?;
        }
        Ok(spec)
    }
}
