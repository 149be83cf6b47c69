//! Cohere 2 (Command R7B, Command A): Cohere's parallel blocks, bias-free LayerNorm, interleaved
//! rope and logit scale, plus sliding-window layers (`layer_types`, else every
//! `sliding_window_pattern`-th layer full). Only the sliding layers apply rope; the full layers
//! use no positional encoding.

use serde::Deserialize;

use super::cohere;
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::{ModelError, Result};

/// transformers' `Cohere2Config.sliding_window` default.
const DEFAULT_SLIDING_WINDOW: usize = 4096;

fn default_sliding_window_pattern() -> usize {
    4
}

/// The `config.json` keys of Cohere 2 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The Cohere keys (and through them the common ones).
    #[serde(flatten)]
    pub cohere: cohere::Args,
    /// `sliding_window_pattern`, used when `layer_types` is absent: every this-many-th layer is
    /// full, the others slide; default 4.
    #[serde(default = "default_sliding_window_pattern")]
    pub sliding_window_pattern: usize,
}

/// The Cohere 2 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let p = self.sliding_window_pattern;
        if p == 0 {
            return Err(ModelError::Config(
                "sliding_window_pattern = 0: expected a positive integer".into(),
            ));
        }
        let mut c = self.cohere.common.clone();
        c.sliding_window.get_or_insert(DEFAULT_SLIDING_WINDOW);
        // transformers fixes the head width to hidden / heads, whatever `head_dim` says.
        c.head_dim = None;
        let mut cohere = self.cohere.clone();
        cohere.common = c.clone();
        let mut spec = cohere.spec()?;
        spec.windows = c.windows(|i| (i + 1) % p != 0)?;
        for (rope, window) in spec.rope.iter_mut().zip(&spec.windows) {
            if window.is_none() {
                *rope = None;
            }
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::common::test_spec;
    use serde_json::json;

    fn spec(extra: serde_json::Value) -> Result<DecoderSpec> {
        test_spec::<Args>("cohere2", extra)
    }

    #[test]
    fn hub_pattern_nope_full_layers_and_a_bad_pattern() {
        let s = spec(json!({"sliding_window_pattern": 2, "sliding_window": 8})).unwrap();
        assert_eq!(s.windows, [Some(8), None, Some(8), None]);
        let ropes: Vec<bool> = s.rope.iter().map(Option::is_some).collect();
        assert_eq!(ropes, [true, false, true, false]);
        assert!(s.rope[0].as_ref().unwrap().traditional);
        let err = spec(json!({"sliding_window_pattern": 0}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("sliding_window_pattern = 0"), "{err}");
    }
}
