//! GPT-NeoX (Pythia, GPT-NeoX-20B, RedPajama-INCITE): LayerNorms with biases, one fused
//! `query_key_value` projection whose rows interleave the heads (`[head][q|k|v][head_dim]`),
//! biases on every projection, partial rotary (`rotary_pct`, default a quarter), a plain GELU MLP
//! and, by default, parallel blocks with two norms
//! (`h += attention(input_layernorm(h)) + mlp(post_attention_layernorm(h))`).
//!
//! Hub checkpoints keep their tensors under `gpt_neox.*` (output head `embed_out`), mlx-lm
//! conversions under `model.h.*`, `model.embed_in`, `model.embed_out`; both are renamed to the
//! canonical layout and the fused projection is split per head.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, plain_ffn, CommonArgs};
use super::transformer::{BlockTopology, DecoderArgs, DecoderSpec, Transformer};
use crate::nn::NormKind;
use crate::sanitize::rename_in_layers;
use crate::{ModelError, Result};

fn default_layer_norm_eps() -> f32 {
    1e-5
}

fn yes() -> bool {
    true
}

/// transformers' `GPTNeoXConfig` default `rotary_pct` / `partial_rotary_factor`.
const DEFAULT_ROTARY_PCT: f64 = 0.25;

/// The `config.json` keys of GPT-NeoX (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `layer_norm_eps`: the LayerNorms' epsilon; default `1e-5`.
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f32,
    /// `use_parallel_residual`: attention and MLP in parallel, each on its own norm; default
    /// true.
    #[serde(default = "yes")]
    pub use_parallel_residual: bool,
    /// `attention_bias`: biases on `query_key_value` and `dense`; default true.
    #[serde(default = "yes")]
    pub attention_bias: bool,
    /// `rotary_pct`: the hub checkpoints' name of `partial_rotary_factor`; default 0.25.
    #[serde(default)]
    pub rotary_pct: Option<f64>,
    /// `rotary_emb_base`: the hub checkpoints' name of `rope_theta` (which wins when present).
    #[serde(default)]
    pub rotary_emb_base: Option<f64>,
    /// `rope_theta` (or `rope_parameters.rope_theta`): read here, not by [`CommonArgs`], to
    /// tell it apart from an absent key; default `rotary_emb_base`, else 10000.
    #[serde(default)]
    pub rope_theta: Option<f64>,
}

/// The GPT-NeoX decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

/// Splits the head-interleaved `{attn}.query_key_value` (rows `[heads, 3, head_dim]`) into
/// `q_proj`, `k_proj` and `v_proj`, for every stored plane (rows are independent, so quantized
/// planes split the same way). A checkpoint without it is left as it is.
fn split_interleaved_qkv(
    weights: &mut WeightMap,
    attn: &str,
    heads: i32,
    head_dim: i32,
) -> Result<()> {
    let fused = format!("{attn}.query_key_value");
    for plane in ["weight", "scales", "biases", "bias"] {
        let name = format!("{fused}.{plane}");
        if !weights.contains(&name) {
            continue;
        }
        let t = weights.take(&name)?;
        let shape = t.shape();
        if shape.first() != Some(&(3 * heads * head_dim)) {
            return Err(ModelError::Shape {
                tensor: name,
                found: shape,
                expected: vec![3 * heads * head_dim],
            });
        }
        let rest = &shape[1..];
        let grouped: Vec<i32> = [heads, 3, head_dim].iter().chain(rest).copied().collect();
        let split: Vec<i32> = [heads * head_dim].iter().chain(rest).copied().collect();
        let t = t.reshape(&grouped)?;
        for (k, to) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
            let k = k as i32;
            let part = t.slice_axis(1, k, k + 1)?.reshape(&split)?;
            weights.insert(format!("{attn}.{to}.{plane}"), part)?;
        }
    }
    Ok(())
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let c = &self.common;
        let n = c.num_hidden_layers;
        for (from, to) in [
            ("gpt_neox.embed_in.", "model.embed_tokens."),
            ("model.embed_in.", "model.embed_tokens."),
            ("gpt_neox.final_layer_norm.", "model.norm."),
            ("model.final_layer_norm.", "model.norm."),
            ("model.embed_out.", "lm_head."),
            ("embed_out.", "lm_head."),
        ] {
            weights.rename_prefix(from, to)?;
        }
        for i in 0..n {
            for layers in ["gpt_neox.layers", "model.h"] {
                // Causal-mask and rotary buffers some exporters saved.
                for buffer in [
                    "attention.bias",
                    "attention.masked_bias",
                    "attention.rotary_emb.inv_freq",
                ] {
                    weights.remove(&format!("{layers}.{i}.{buffer}"));
                }
                weights.rename_prefix(&format!("{layers}.{i}."), &format!("model.layers.{i}."))?;
            }
        }
        rename_in_layers(
            weights,
            n,
            &[
                ("attention", "self_attn"),
                ("self_attn.dense", "self_attn.o_proj"),
                ("mlp.dense_h_to_4h", "mlp.up_proj"),
                ("mlp.dense_4h_to_h", "mlp.down_proj"),
            ],
        )?;
        for i in 0..n {
            let attn = format!("model.layers.{i}.self_attn");
            split_interleaved_qkv(weights, &attn, c.num_attention_heads, c.head_dim())?;
        }
        Ok(())
    }

    fn spec(&self) -> Result<DecoderSpec> {
        if let Some(pct) = self.rotary_pct.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(ModelError::Config(format!(
                "rotary_pct = {pct}: must be in (0, 1]"
            )));
        }
        let mut c = self.common.clone();
        if c.partial_rotary_factor.is_none() {
            c.partial_rotary_factor = Some(self.rotary_pct.unwrap_or(DEFAULT_ROTARY_PCT));
        }
        c.rope_theta = self
            .rope_theta
            .or(self.rotary_emb_base)
            .unwrap_or(c.rope_theta);
        let mut spec = base_spec(&c, false, "gelu")?;
        spec.norm = NormKind::Layer;
        spec.eps = self.layer_norm_eps;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        spec.mlp_bias = true;
        spec.topology = if self.use_parallel_residual {
            BlockTopology::ParallelTwoNorms
        } else {
            BlockTopology::PreNorm
        };
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
        test_spec::<Args>("gpt_neox", extra).unwrap()
    }

    #[test]
    fn hub_rope_keys_and_defaults() {
        // Pythia-style config: rotary_pct and rotary_emb_base, no rope_theta.
        let s = spec(json!({"rotary_pct": 0.5, "rotary_emb_base": 20000}));
        let rope = s.rope[0].as_ref().unwrap();
        assert_eq!((rope.dims, rope.base), (8, 20000.0));
        assert_eq!(s.topology, BlockTopology::ParallelTwoNorms);
        // transformers' defaults: a quarter of each head, base 10000.
        let rope = spec(json!({})).rope[0].clone().unwrap();
        assert_eq!((rope.dims, rope.base), (4, 10000.0));
        // rope_parameters (transformers 5) wins over the hub keys.
        let s = spec(json!({"rotary_pct": 0.5, "rotary_emb_base": 20000,
            "rope_parameters": {"rope_type": "default", "rope_theta": 30000.0, "partial_rotary_factor": 1.0}}));
        let rope = s.rope[0].as_ref().unwrap();
        assert_eq!((rope.dims, rope.base), (16, 30000.0));
        let err = test_spec::<Args>("gpt_neox", json!({"rotary_pct": 2.0}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("rotary_pct = 2: must be in (0, 1]"), "{err}");
        let s = spec(json!({"use_parallel_residual": false, "attention_bias": false}));
        assert_eq!(s.topology, BlockTopology::PreNorm);
        assert!(!s.qkv_bias && !s.o_bias && s.mlp_bias);
    }
}
