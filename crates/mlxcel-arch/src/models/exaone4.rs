//! EXAONE 4: post-norm blocks (`post_attention_layernorm` after attention and
//! `post_feedforward_layernorm` after the MLP, no input norms), per-head RMSNorm on queries and
//! keys, and a local/global layer pattern (`layer_types`, else `sliding_window_pattern` such as
//! `"LLLG"`). When the model has sliding layers, its global layers use no positional encoding.

use serde::Deserialize;
use serde_json::Value;

use super::common::{base_spec, CommonArgs};
use super::transformer::{BlockTopology, DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::{ModelError, Result};

/// The `config.json` keys of EXAONE 4 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `sliding_window_pattern`, used when `layer_types` is absent: a string of `L` (local, sliding) and `G` (global) repeated over the layers, or an
    /// integer `p` (every `p`-th layer global).
    #[serde(default)]
    pub sliding_window_pattern: Option<Value>,
}

/// The EXAONE 4 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl Args {
    /// Whether layer `i` slides, when the config has no `layer_types`.
    fn slides(&self, i: usize) -> Result<bool> {
        if self.common.sliding_window.is_none() {
            return Ok(false);
        }
        match &self.sliding_window_pattern {
            None => Ok(true),
            Some(Value::String(p)) if !p.is_empty() && p.chars().all(|c| c == 'L' || c == 'G') => {
                Ok(p.as_bytes()[i % p.len()] == b'L')
            }
            Some(Value::Number(n)) if n.as_u64().is_some_and(|p| p > 0) => {
                let p = n.as_u64().unwrap_or(1) as usize;
                Ok((i + 1) % p != 0)
            }
            Some(other) => Err(ModelError::Config(format!(
                "sliding_window_pattern {other}: expected a string of L and G or a positive integer"
            ))),
        }
    }
}

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        let mut spec = base_spec(c, false, "silu")?;
        spec.topology = BlockTopology::PostNorm;
        spec.qk_norm = QkNormSpec::PerHead;
        let slides = (0..c.num_hidden_layers)
            .map(|i| self.slides(i))
            .collect::<Result<Vec<bool>>>()?;
        spec.windows = c.windows(|i| slides[i])?;
        if spec.windows.iter().any(Option::is_some) {
            for (rope, window) in spec.rope.iter_mut().zip(&spec.windows) {
                if window.is_none() {
                    *rope = None;
                }
            }
        }
        Ok(spec)
    }
}
