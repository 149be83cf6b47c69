//! Qwen2: llama with biases on the q/k/v projections; sliding windows only with
//! `use_sliding_window` (on layers from `max_window_layers` up), or as `layer_types` says.

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::Result;

#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    #[serde(flatten)]
    pub common: CommonArgs,
    #[serde(default)]
    pub use_sliding_window: bool,
    #[serde(default)]
    pub max_window_layers: Option<usize>,
}

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
