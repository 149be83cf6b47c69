//! OLMo 3: OLMo 2 with sliding-window layers (`layer_types`, else three sliding layers then one
//! full). `rope_scaling` (YaRN in the long-context checkpoints) applies to the full-attention
//! layers only; the sliding layers keep plain rope.

use serde::Deserialize;

use super::olmo2::{self, olmo2_spec};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::Result;

/// transformers' `Olmo3Config.sliding_window` default.
const DEFAULT_SLIDING_WINDOW: usize = 4096;

/// The `config.json` keys of OLMo 3 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The OLMo 2 keys (and through them the common ones).
    #[serde(flatten)]
    pub olmo: olmo2::Args,
    /// `rope_local_base_freq` (from `rope_parameters.sliding_attention.rope_theta` after
    /// sanitising): the sliding layers' rotary base; default `rope_theta`.
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
}

/// The OLMo 3 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let mut c = self.olmo.common.clone();
        c.sliding_window.get_or_insert(DEFAULT_SLIDING_WINDOW);
        let mut spec = olmo2_spec(&self.olmo)?;
        spec.windows = c.windows(|i| (i + 1) % 4 != 0)?;
        let mut local = c.rope();
        local.scaling = None;
        local.base = self.rope_local_base_freq.unwrap_or(c.rope_theta);
        for (rope, window) in spec.rope.iter_mut().zip(&spec.windows) {
            if window.is_some() {
                *rope = Some(local.clone());
            }
        }
        Ok(spec)
    }
}
