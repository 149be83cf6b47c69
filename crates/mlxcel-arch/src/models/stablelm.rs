//! StableLM (StableLM-2, StableLM-3B-4E1T, StableCode): LayerNorms with biases, partial rotary
//! (default a quarter of each head), optional q/k/v biases (`use_qkv_bias`), optional per-head
//! LayerNorms on queries and keys (`qk_layernorm`: one bias-free LayerNorm per head, stored as
//! `q_layernorm.norms.{h}`), and optionally parallel blocks (`use_parallel_residual`: attention
//! and MLP both read `input_layernorm`).

use mlxcel_core::{ops, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{BlockTopology, DecoderArgs, DecoderSpec, QkNormSpec, Transformer};
use crate::nn::NormKind;
use crate::{ModelError, Result};

fn default_layer_norm_eps() -> f32 {
    1e-5
}

/// transformers' `StableLmConfig` default `partial_rotary_factor`.
const DEFAULT_PARTIAL_ROTARY_FACTOR: f64 = 0.25;

/// The `config.json` keys of StableLM (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `layer_norm_eps`: the LayerNorms' epsilon; default `1e-5`.
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f32,
    /// `use_qkv_bias`: biases on the q/k/v projections; default false.
    #[serde(default)]
    pub use_qkv_bias: bool,
    /// `qk_layernorm`: a LayerNorm per head on queries and keys; default false.
    #[serde(default)]
    pub qk_layernorm: bool,
    /// `use_parallel_residual`: attention and MLP in parallel on one norm; default false.
    #[serde(default)]
    pub use_parallel_residual: bool,
}

/// The StableLM decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

/// Stacks the per-head norms `{attn}.{from}.norms.{h}.weight`, `h < heads`, into one
/// `{attn}.{to}.weight` `[heads, head_dim]`. Absent norms are left alone.
fn stack_head_norms(
    weights: &mut WeightMap,
    attn: &str,
    from: &str,
    to: &str,
    heads: i32,
) -> Result<()> {
    let name = |h: i32| format!("{attn}.{from}.norms.{h}.weight");
    if !weights.contains(&name(0)) {
        return Ok(());
    }
    let mut parts = Vec::with_capacity(heads as usize);
    for h in 0..heads {
        if !weights.contains(&name(h)) {
            return Err(ModelError::MissingTensor(name(h)));
        }
        parts.push(weights.take(&name(h))?);
    }
    weights.insert(format!("{attn}.{to}.weight"), ops::stack(&parts, 0)?)?;
    Ok(())
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let c = &self.common;
        for i in 0..c.num_hidden_layers {
            let attn = format!("model.layers.{i}.self_attn");
            stack_head_norms(
                weights,
                &attn,
                "q_layernorm",
                "q_norm",
                c.num_attention_heads,
            )?;
            stack_head_norms(weights, &attn, "k_layernorm", "k_norm", c.kv_heads())?;
        }
        Ok(())
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let mut c = self.common.clone();
        c.partial_rotary_factor
            .get_or_insert(DEFAULT_PARTIAL_ROTARY_FACTOR);
        let mut spec = base_spec(&c, false, "silu")?;
        spec.norm = NormKind::Layer;
        spec.eps = self.layer_norm_eps;
        spec.qkv_bias = self.use_qkv_bias;
        if self.qk_layernorm {
            spec.qk_norm = QkNormSpec::PerHeadWeights;
        }
        if self.use_parallel_residual {
            spec.topology = BlockTopology::Parallel;
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
    fn defaults_and_parallel_residual() {
        let s = test_spec::<Args>("stablelm", json!({})).unwrap();
        assert_eq!(
            s.rope[0].as_ref().unwrap().dims,
            4,
            "partial_rotary_factor 0.25"
        );
        assert_eq!(s.topology, BlockTopology::PreNorm);
        assert_eq!((s.qkv_bias, s.qk_norm), (false, QkNormSpec::None));
        let s = test_spec::<Args>(
            "stablelm",
            json!({"use_parallel_residual": true, "qk_layernorm": true, "use_qkv_bias": true}),
        )
        .unwrap();
        assert_eq!(s.topology, BlockTopology::Parallel);
        assert_eq!((s.qkv_bias, s.qk_norm), (true, QkNormSpec::PerHeadWeights));
    }
}
