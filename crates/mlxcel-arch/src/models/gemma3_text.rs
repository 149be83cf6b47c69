//! Gemma 3 (text): Gemma 2's layout with per-head `(1 + w)` qk-norms instead of soft-capping,
//! a sliding pattern (`layer_types`, else every `sliding_window_pattern`-th layer global), and a
//! local rope base (`rope_local_base_freq`, unscaled) on sliding layers.

use serde::Deserialize;

use super::common::CommonArgs;
use super::gemma::{sandwich_spec, GemmaArgs};
use super::transformer::{DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::Result;

fn default_pattern() -> usize {
    6
}

fn default_local_base() -> f64 {
    10000.0
}

/// The `config.json` keys of Gemma 3 (text) (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// The Gemma 2/3 keys (soft-capping, query scale, activation).
    #[serde(flatten)]
    pub gemma: GemmaArgs,
    /// `sliding_window_pattern`, used when `layer_types` is absent: every this-many-th layer is
    /// global, the others slide; default 6.
    #[serde(default = "default_pattern")]
    pub sliding_window_pattern: usize,
    /// `rope_local_base_freq`: the (unscaled) rope base of sliding layers; default `10000`.
    #[serde(default = "default_local_base")]
    pub rope_local_base_freq: f64,
}

/// The Gemma 3 (text) decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let args = self;
        let c = &args.common;
        let mut spec = sandwich_spec(c, &args.gemma)?;
        spec.qk_norm = QkNormSpec::PerHead;
        let pattern = args.sliding_window_pattern.max(1);
        spec.windows = c.windows(|i| (i + 1) % pattern != 0)?;
        for (rope, window) in spec.rope.iter_mut().zip(&spec.windows) {
            if let (Some(rope), Some(_)) = (rope, window) {
                rope.base = args.rope_local_base_freq;
                rope.scaling = None;
            }
        }
        Ok(spec)
    }
}
