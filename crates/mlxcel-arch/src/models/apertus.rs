//! Apertus (Swiss AI): llama attention with per-head RMSNorm on queries and keys, and a plain
//! `up_proj` → xIELU → `down_proj` MLP whose activation has learned per-layer parameters
//! (`mlp.act_fn.{alpha_p,alpha_n,beta,eps}`). The block norms are named
//! `attention_layernorm` / `feedforward_layernorm` (renamed to the canonical pre-norm names).

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, plain_ffn, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::nn::{Activation, XIeluParams};
use crate::sanitize::rename_in_layers;
use crate::{ModelError, Result};

fn default_rms_norm_eps() -> f32 {
    1e-5
}

/// The `config.json` keys of Apertus (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `rms_norm_eps`: the RMSNorms' epsilon; default `1e-5`.
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f32,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `qk_norm` (hub configs; transformers ignores it and always normalises): only `true`.
    #[serde(default)]
    pub qk_norm: Option<bool>,
    /// `post_norm` (hub configs; transformers has pre-norm blocks only): only `false`.
    #[serde(default)]
    pub post_norm: Option<bool>,
    /// `mlp_bias` (hub configs; transformers' MLP has no biases): only `false`.
    #[serde(default)]
    pub mlp_bias: Option<bool>,
}

/// The Apertus decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    /// Renames the block norms, and gives the one-value xIELU parameters the shape `[1]`
    /// (transformers stores `alpha_*` as `[1]` and `beta`/`eps` as `[]`; mlx-lm squeezes all).
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let n = self.common.num_hidden_layers;
        rename_in_layers(
            weights,
            n,
            &[
                ("attention_layernorm", "input_layernorm"),
                ("feedforward_layernorm", "post_attention_layernorm"),
            ],
        )?;
        for i in 0..n {
            for p in ["alpha_p", "alpha_n", "beta", "eps"] {
                let name = format!("model.layers.{i}.mlp.act_fn.{p}");
                if weights.info(&name).is_some_and(|t| t.shape.is_empty()) {
                    let v = weights.take(&name)?;
                    weights.insert(name, v.reshape(&[1])?)?;
                }
            }
        }
        Ok(())
    }

    fn spec(&self) -> Result<DecoderSpec> {
        for (key, value, supported) in [
            ("qk_norm", self.qk_norm, true),
            ("post_norm", self.post_norm, false),
            ("mlp_bias", self.mlp_bias, false),
        ] {
            if value.is_some_and(|v| v != supported) {
                return Err(ModelError::Unsupported(format!(
                    "apertus {key} = {}: transformers' Apertus has {key} = {supported} only",
                    !supported
                )));
            }
        }
        let mut c = self.common.clone();
        let xielu = c.hidden_act.as_deref().is_none_or(|a| a == "xielu");
        if xielu {
            // Any name base_spec knows; the activation is replaced below.
            c.hidden_act = Some("silu".into());
        }
        let mut spec = base_spec(&c, false, "silu")?;
        if xielu {
            // Placeholder values: each layer's MLP reads its own parameters at build.
            spec.act = Activation::XIelu(XIeluParams::from_stored(0.0, 0.0, 0.5, -1e-6));
        }
        spec.eps = self.rms_norm_eps;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        spec.qk_norm = QkNormSpec::PerHead;
        spec.ffn = plain_ffn(&c)?;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::common::test_spec;
    use serde_json::json;

    #[test]
    fn hub_keys_transformers_ignores_are_checked() {
        let hub =
            json!({"hidden_act": "xielu", "qk_norm": true, "post_norm": false, "mlp_bias": false});
        let s = test_spec::<Args>("apertus", hub).unwrap();
        assert!(matches!(s.act, Activation::XIelu(_)));
        assert_eq!(s.qk_norm, QkNormSpec::PerHead);
        let err = test_spec::<Args>("apertus", json!({"post_norm": true}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("post_norm = true"), "{err}");
    }
}
