//! RecurrentGemma (Griffin): pre-norm residual blocks whose temporal block is, by
//! `block_types` (cycled over the layers, default recurrent, recurrent, attention), Griffin's
//! RG-LRU recurrent block ([`crate::nn::griffin`]) or local sliding-window attention
//! (`attention_window_size`, rope on half of each head, a biased output projection), each
//! followed by a biased gated tanh-GELU MLP of `intermediate_size / 2`. Gemma's `(1 + w)`
//! RMSNorms, embeddings scaled by `sqrt(hidden)` rounded to bfloat16 (transformers keeps the
//! normaliser in bfloat16), logits soft-capped at `logits_soft_cap`, tied head.
//!
//! Checkpoint names: `temporal_pre_norm` → `input_layernorm`, `channel_pre_norm` →
//! `post_attention_layernorm`, `mlp_block` → `mlp`, `temporal_block` → `self_attn` or `mixer`
//! (whose `conv_1d` → `conv1d`), `final_norm` → `norm`.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::mamba2::check_positive;
use super::transformer::{DecoderArgs, DecoderSpec, FfnSpec, MixerSpec, RgLruSpec, Transformer};
use crate::nn::{Activation, NormKind};
use crate::sanitize::{conv_weights_to_torch_layout, rename_in_layers};
use crate::{ModelError, Result};

fn yes() -> bool {
    true
}
fn four() -> i32 {
    4
}
fn window() -> usize {
    2048
}
fn soft_cap() -> f64 {
    30.0
}
fn tanh_gelu() -> String {
    "gelu_pytorch_tanh".into()
}

/// The `config.json` keys of RecurrentGemma (transformers' `RecurrentGemmaConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, heads, `rms_norm_eps`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `block_types` (alias `_block_types`): `recurrent` / `attention`, cycled over the layers.
    #[serde(default, alias = "_block_types")]
    pub block_types: Option<Vec<String>>,
    /// `lru_width`: the recurrence's width; default `hidden_size`.
    #[serde(default)]
    pub lru_width: Option<i32>,
    /// `attention_window_size`: keys each attention query sees (its own included).
    #[serde(default = "window")]
    pub attention_window_size: usize,
    /// `conv1d_width`: the recurrent block's convolution width.
    #[serde(default = "four")]
    pub conv1d_width: i32,
    /// `logits_soft_cap`: `tanh(logits / cap) · cap`.
    #[serde(default = "soft_cap")]
    pub logits_soft_cap: f64,
    /// `hidden_activation`: the MLP's and the recurrent block's gate activation.
    #[serde(default = "tanh_gelu")]
    pub hidden_activation: String,
    /// `attention_bias`: biases on q/k/v (the output projection always has one).
    #[serde(default)]
    pub attention_bias: bool,
    /// `embeddings_scale_by_sqrt_dim` (mlx-lm's key): scale the embeddings; default true.
    #[serde(default = "yes")]
    pub embeddings_scale_by_sqrt_dim: bool,
}

/// The RecurrentGemma model: the shared decoder with RG-LRU and local-attention layers.
pub type Model = Transformer<Args>;

/// `x` rounded to the nearest bfloat16 (ties to even), as transformers stores the embedding
/// normaliser.
fn round_to_bf16(x: f64) -> f64 {
    let bits = (x as f32).to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(rounded) as f64
}

impl Args {
    /// Per layer: whether it is recurrent (else local attention).
    fn recurrent_layers(&self) -> Result<Vec<bool>> {
        let types = self
            .block_types
            .clone()
            .unwrap_or_else(|| vec!["recurrent".into(), "recurrent".into(), "attention".into()]);
        if types.is_empty() {
            return Err(ModelError::Config("block_types is empty".into()));
        }
        (0..self.common.num_hidden_layers)
            .map(|i| match types[i % types.len()].as_str() {
                "recurrent" => Ok(true),
                "attention" => Ok(false),
                other => Err(ModelError::Config(format!(
                    "block_types: unknown block {other:?} (expected recurrent or attention)"
                ))),
            })
            .collect()
    }
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        weights.rename_prefix("model.final_norm.", "model.norm.")?;
        rename_in_layers(
            weights,
            self.common.num_hidden_layers,
            &[
                ("temporal_pre_norm", "input_layernorm"),
                ("channel_pre_norm", "post_attention_layernorm"),
                ("mlp_block", "mlp"),
            ],
        )?;
        for (i, recurrent) in self.recurrent_layers()?.into_iter().enumerate() {
            let layer = format!("model.layers.{i}");
            let scope = if recurrent { "mixer" } else { "self_attn" };
            weights.rename_prefix(
                &format!("{layer}.temporal_block."),
                &format!("{layer}.{scope}."),
            )?;
            weights.rename_prefix(
                &format!("{layer}.mixer.conv_1d."),
                &format!("{layer}.mixer.conv1d."),
            )?;
        }
        conv_weights_to_torch_layout(weights)
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.common;
        check_positive(&[
            ("num_attention_heads", c.num_attention_heads),
            ("conv1d_width", self.conv1d_width),
        ])?;
        if self.attention_window_size == 0 {
            return Err(ModelError::Config(
                "attention_window_size = 0: must be positive".into(),
            ));
        }
        let mut common = c.clone();
        // transformers derives the head width and defaults half-rotary attention.
        common.head_dim = Some(c.hidden_size / c.num_attention_heads);
        common.partial_rotary_factor.get_or_insert(0.5);
        let mut spec = base_spec(&common, true, "gelu_pytorch_tanh")?;
        spec.act = Activation::from_name(&self.hidden_activation).ok_or_else(|| {
            ModelError::Unsupported(format!("hidden_activation `{}`", self.hidden_activation))
        })?;
        spec.norm = NormKind::RmsOffset;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = true;
        spec.mlp_bias = true;
        if self.embeddings_scale_by_sqrt_dim {
            spec.embed_scale = Some(round_to_bf16((c.hidden_size as f64).sqrt()));
        }
        spec.final_softcap = Some(self.logits_soft_cap);
        let intermediate = common.intermediate()? / 2;
        let rg_lru = MixerSpec::RgLru(RgLruSpec {
            width: self.lru_width.unwrap_or(c.hidden_size),
            heads: c.num_attention_heads,
            conv_kernel: self.conv1d_width,
        });
        for (i, recurrent) in self.recurrent_layers()?.into_iter().enumerate() {
            spec.ffn[i] = FfnSpec::Dense { intermediate };
            if recurrent {
                spec.mixers[i] = rg_lru.clone();
                spec.rope[i] = None;
            } else {
                spec.windows[i] = Some(self.attention_window_size);
            }
        }
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_normaliser_is_rounded_like_bfloat16() {
        // sqrt(32) = 5.65685..: bfloat16 keeps 8 significant bits.
        assert_eq!(round_to_bf16(32f64.sqrt()), 5.65625);
        assert_eq!(round_to_bf16(2560f64.sqrt()), 50.5);
        assert_eq!(round_to_bf16(4.0), 4.0);
    }

    #[test]
    fn block_types_cycle_over_the_layers() {
        let args: Args = serde_json::from_value(serde_json::json!({
            "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
            "vocab_size": 512, "intermediate_size": 96, "attention_window_size": 8,
            "_block_types": ["recurrent", "attention"],
        }))
        .unwrap();
        let s = args.spec().unwrap();
        assert!(matches!(s.mixers[0], MixerSpec::RgLru(_)));
        assert!(matches!(s.mixers[3], MixerSpec::Attention));
        assert_eq!(s.windows[3], Some(8));
        assert!(matches!(s.ffn[0], FfnSpec::Dense { intermediate: 48 }));
    }
}
