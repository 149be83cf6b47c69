//! Qwen2: llama with biases on the q/k/v projections; sliding windows only with
//! `use_sliding_window` (on layers from `max_window_layers` up), or as `layer_types` says.

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::Result;

/// The `config.json` keys of Qwen2 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `use_sliding_window`: enable `sliding_window` (ignored otherwise); default false.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// `max_window_layers`: with `use_sliding_window`, layers from this index up slide; default
    /// `num_hidden_layers` (none).
    #[serde(default)]
    pub max_window_layers: Option<usize>,
}

/// The Qwen2 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let args = self;
        let c = &args.common;
        let mut spec = base_spec(c, false, "silu")?;
        spec.qkv_bias = true;
        let first_window = args.max_window_layers.unwrap_or(c.num_hidden_layers);
        spec.windows = if args.use_sliding_window {
            c.windows(|i| i >= first_window)?
        } else {
            vec![None; c.num_hidden_layers]
        };
        Ok(spec)
    }
}
