//! Phi (Phi-1, Phi-1.5, Phi-2): parallel blocks (attention and MLP read one LayerNorm of the
//! input), LayerNorms and projections with biases, partial rotary (default half of each head),
//! a plain `fc1` → GELU → `fc2` MLP, optional per-head LayerNorm on queries and keys, and an
//! output head with a bias. Checkpoint names (`self_attn.dense`, `mlp.fc1`/`fc2`,
//! `q_layernorm`/`k_layernorm`, `model.final_layernorm`) are renamed to the canonical ones.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, plain_ffn, CommonArgs};
use super::transformer::{BlockTopology, DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::nn::NormKind;
use crate::sanitize::rename_in_layers;
use crate::Result;

fn default_layer_norm_eps() -> f32 {
    1e-5
}

/// transformers' `PhiConfig` default `partial_rotary_factor`.
const DEFAULT_PARTIAL_ROTARY_FACTOR: f64 = 0.5;

/// The `config.json` keys of Phi (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `layer_norm_eps`: the LayerNorms' epsilon; default `1e-5`.
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f32,
    /// `qk_layernorm`: a LayerNorm (shared by the heads) on each query and key head; default
    /// false.
    #[serde(default)]
    pub qk_layernorm: bool,
}

/// The Phi decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        weights.rename_prefix("model.final_layernorm.", "model.norm.")?;
        // A tied head keeps its own bias: transformers saves `lm_head.bias` without
        // `lm_head.weight`. The head then reads the embedding table's planes (the same arrays,
        // no copy) next to that bias.
        let tied = self.common.tie_word_embeddings.unwrap_or(false);
        if tied && weights.contains("lm_head.bias") && !weights.contains("lm_head.weight") {
            for plane in ["weight", "scales", "biases"] {
                let name = format!("model.embed_tokens.{plane}");
                if weights.contains(&name) {
                    let table = weights.get(&name)?;
                    weights.insert(format!("lm_head.{plane}"), table)?;
                }
            }
        }
        rename_in_layers(
            weights,
            self.common.num_hidden_layers,
            &[
                ("self_attn.dense", "self_attn.o_proj"),
                ("self_attn.q_layernorm", "self_attn.q_norm"),
                ("self_attn.k_layernorm", "self_attn.k_norm"),
                ("mlp.fc1", "mlp.up_proj"),
                ("mlp.fc2", "mlp.down_proj"),
            ],
        )
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let mut c = self.common.clone();
        c.partial_rotary_factor
            .get_or_insert(DEFAULT_PARTIAL_ROTARY_FACTOR);
        let mut spec = base_spec(&c, false, "gelu_new")?;
        spec.topology = BlockTopology::Parallel;
        spec.norm = NormKind::Layer;
        spec.eps = self.layer_norm_eps;
        spec.qkv_bias = true;
        spec.o_bias = true;
        spec.mlp_bias = true;
        spec.lm_head_bias = true;
        if self.qk_layernorm {
            spec.qk_norm = QkNormSpec::PerHead;
        }
        spec.ffn = plain_ffn(&c)?;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::common::test_spec;
    use serde_json::json;

    fn spec(extra: serde_json::Value) -> DecoderSpec {
        test_spec::<Args>("phi", extra).unwrap()
    }

    #[test]
    fn partial_rotary_defaults_to_transformers_half_not_mlx_lm_0_4() {
        // transformers' PhiConfig defaults partial_rotary_factor to 0.5; mlx-lm's phi to 0.4.
        // transformers is the reference: 8 of the 16 channels rotate.
        let s = spec(json!({}));
        assert_eq!(s.rope[0].as_ref().unwrap().dims, 8);
        let s = spec(json!({"partial_rotary_factor": 0.4}));
        assert_eq!(s.rope[0].as_ref().unwrap().dims, 6);
        assert!(s.lm_head_bias && s.qkv_bias && s.o_bias && s.mlp_bias);
        assert_eq!(s.topology, BlockTopology::Parallel);
        assert_eq!(s.qk_norm, QkNormSpec::None);
        assert_eq!(
            spec(json!({"qk_layernorm": true})).qk_norm,
            QkNormSpec::PerHead
        );
    }
}
