//! OLMo 3: OLMo 2 with sliding-window layers (`layer_types`, else three sliding layers then one
//! full). `rope_scaling` (YaRN in the long-context checkpoints) applies to the full-attention
//! layers only; the sliding layers keep plain rope.

use serde::Deserialize;
use serde_json::Value;

use super::olmo2::{self, olmo2_spec};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::{ModelError, Result};

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
    /// `rope_parameters` (transformers 5), read only to refuse a scaled rope on the sliding
    /// layers (`sliding_attention.rope_type` other than `default`), which no checkpoint uses.
    #[serde(default)]
    pub rope_parameters: Option<Value>,
}

/// The OLMo 3 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let sliding_type = self
            .rope_parameters
            .as_ref()
            .and_then(|r| r.get("sliding_attention"))
            .and_then(|r| r.get("rope_type"))
            .and_then(Value::as_str);
        if let Some(t) = sliding_type.filter(|t| *t != "default") {
            return Err(ModelError::Unsupported(format!(
                "rope_parameters.sliding_attention.rope_type `{t}` (OLMo 3's sliding layers use plain rope)"
            )));
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::common::test_spec;
    use serde_json::json;

    #[test]
    fn default_pattern_scaling_on_full_layers_only_and_clip_qkv_refused() {
        let yarn = json!({"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}});
        let s = test_spec::<Args>("olmo3", yarn).unwrap();
        assert_eq!(s.windows, [Some(4096), Some(4096), Some(4096), None]);
        assert_eq!(s.eps, 1e-5, "OLMo's rms_norm_eps default");
        assert_eq!(
            test_spec::<Args>("olmo3", json!({"rms_norm_eps": 1e-6}))
                .unwrap()
                .eps,
            1e-6,
            "a given rms_norm_eps is read"
        );
        let scaled: Vec<bool> = s
            .rope
            .iter()
            .map(|r| r.as_ref().unwrap().scaling.is_some())
            .collect();
        assert_eq!(scaled, [false, false, false, true]);
        let err = test_spec::<Args>("olmo3", json!({"clip_qkv": 8.0}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("clip_qkv = 8"), "{err}");
        let scaled_sliding = json!({"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}});
        let err = test_spec::<Args>("olmo3", scaled_sliding)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rope_parameters.sliding_attention.rope_type `linear`"),
            "{err}"
        );
    }
}
