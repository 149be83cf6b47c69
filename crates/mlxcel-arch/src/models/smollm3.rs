//! SmolLM3: llama with NoPE layers — `no_rope_layers[i]` is 1 where layer `i` applies rope and
//! 0 where it uses no positional encoding (default: every `no_rope_layer_interval`-th layer is
//! NoPE) — tied embeddings, and optional sliding windows on the NoPE layers.

use serde::Deserialize;

use super::common::{base_spec, no_rope_flags, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::{ModelError, Result};

fn default_no_rope_layer_interval() -> usize {
    4
}

/// The `config.json` keys of SmolLM3 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `no_rope_layers`: per layer, 1 = rope, 0 = no positional encoding; default from
    /// `no_rope_layer_interval`.
    #[serde(default)]
    pub no_rope_layers: Option<Vec<u8>>,
    /// `no_rope_layer_interval`: without `no_rope_layers`, every this-many-th layer is NoPE;
    /// default 4.
    #[serde(default = "default_no_rope_layer_interval")]
    pub no_rope_layer_interval: usize,
    /// `use_sliding_window`: the NoPE layers (or `layer_types`' sliding ones) slide over
    /// `sliding_window`; default false.
    #[serde(default)]
    pub use_sliding_window: bool,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `mlp_bias`: biases on the MLP projections; default false.
    #[serde(default)]
    pub mlp_bias: bool,
}

/// The SmolLM3 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl Args {
    /// Per layer: whether it applies rope (entries other than 0 and 1 are refused).
    fn rope_layers(&self) -> Result<Vec<bool>> {
        no_rope_flags(
            &self.common,
            self.no_rope_layers.as_deref(),
            self.no_rope_layer_interval,
        )?
        .into_iter()
        .map(|f| match f {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(ModelError::Config(format!(
                "no_rope_layers entry {other}: expected 0 (NoPE) or 1 (rope)"
            ))),
        })
        .collect()
    }
}

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        let mut spec = base_spec(c, true, "silu")?;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        spec.mlp_bias = self.mlp_bias;
        let rope_layers = self.rope_layers()?;
        for (rope, uses_rope) in spec.rope.iter_mut().zip(&rope_layers) {
            if !uses_rope {
                *rope = None;
            }
        }
        // transformers: without `layer_types`, the NoPE layers slide when sliding is enabled;
        // with `use_sliding_window` false no layer slides, whatever `layer_types` says.
        if self.use_sliding_window && c.sliding_window.is_some() {
            spec.windows = c.windows(|i| !rope_layers[i])?;
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
        test_spec::<Args>("smollm3", extra)
    }

    #[test]
    fn nope_layers_and_their_errors() {
        // Default: every fourth layer has no rope.
        let s = spec(json!({})).unwrap();
        let ropes: Vec<bool> = s.rope.iter().map(Option::is_some).collect();
        assert_eq!(ropes, [true, true, true, false]);
        assert!(s.tie_word_embeddings && s.windows.iter().all(Option::is_none));
        let s = spec(json!({"no_rope_layers": [0, 1, 1, 0], "use_sliding_window": true, "sliding_window": 8}))
            .unwrap();
        assert_eq!(
            s.rope.iter().map(Option::is_some).collect::<Vec<_>>(),
            [false, true, true, false]
        );
        assert_eq!(s.windows, [Some(8), None, None, Some(8)]);
        let err = spec(json!({"no_rope_layers": [1, 0]}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no_rope_layers has 2 entries for 4 layers"),
            "{err}"
        );
        let err = spec(json!({"no_rope_layers": [1, 2, 1, 1]}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no_rope_layers entry 2"), "{err}");
        let err = spec(json!({"no_rope_layer_interval": 0}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no_rope_layer_interval = 0: must be positive"),
            "{err}"
        );
    }
}
