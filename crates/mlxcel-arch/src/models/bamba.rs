//! Bamba (IBM): Mamba-2 layers with a few attention layers among them (`attn_layer_indices`),
//! every layer followed by a dense gated MLP. Attention uses rope on half of each head
//! (`partial_rotary_factor` 0.5, which transformers hard-codes for Bamba).
//!
//! Checkpoint names: `mamba` → `mixer`, `feed_forward` → `mlp`, `pre_ff_layernorm` →
//! `post_attention_layernorm`, `final_layernorm` → `norm`.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::mamba2::{check_positive, dt_limit};
use super::transformer::{DecoderArgs, DecoderSpec, Mamba2Spec, MixerSpec, Transformer};
use crate::nn::ssm::{GatedNorm, Mamba2Dims};
use crate::sanitize::{conv_weights_to_torch_layout, rename_in_layers};
use crate::{ModelError, Result};

fn yes() -> bool {
    true
}
fn default_heads() -> i32 {
    128
}
fn default_state() -> i32 {
    256
}
fn four() -> i32 {
    4
}
fn two() -> i32 {
    2
}
fn one() -> i32 {
    1
}
fn default_chunk() -> i32 {
    256
}

/// The `config.json` keys of Bamba (transformers' `BambaConfig`).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, heads, `rms_norm_eps`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `attn_layer_indices`: the layers that attend; the others are Mamba-2 layers.
    #[serde(default)]
    pub attn_layer_indices: Option<Vec<usize>>,
    /// `mamba_n_heads`: default 128.
    #[serde(default = "default_heads")]
    pub mamba_n_heads: i32,
    /// `mamba_d_head`: an integer or `"auto"` (`mamba_expand · hidden_size / mamba_n_heads`).
    #[serde(default)]
    pub mamba_d_head: Option<serde_json::Value>,
    /// `mamba_n_groups`: default 1.
    #[serde(default = "one")]
    pub mamba_n_groups: i32,
    /// `mamba_d_state`: default 256.
    #[serde(default = "default_state")]
    pub mamba_d_state: i32,
    /// `mamba_d_conv`: default 4.
    #[serde(default = "four")]
    pub mamba_d_conv: i32,
    /// `mamba_expand`: default 2.
    #[serde(default = "two")]
    pub mamba_expand: i32,
    /// `mamba_chunk_size`: default 256.
    #[serde(default = "default_chunk")]
    pub mamba_chunk_size: i32,
    /// `mamba_conv_bias`: default true.
    #[serde(default = "yes")]
    pub mamba_conv_bias: bool,
    /// `mamba_proj_bias`: default false.
    #[serde(default)]
    pub mamba_proj_bias: bool,
    /// `time_step_limit`: default `[0, inf]`.
    #[serde(default)]
    pub time_step_limit: Option<Vec<f64>>,
    /// `attention_bias`: biases on q/k/v/o; default false.
    #[serde(default)]
    pub attention_bias: bool,
    /// `mlp_bias`: biases on the MLP; default false.
    #[serde(default)]
    pub mlp_bias: bool,
}

/// The Bamba model: the shared decoder with per-layer attention or Mamba-2 mixers.
pub type Model = Transformer<Args>;

impl Args {
    fn head_dim(&self) -> Result<i32> {
        let inner = self.mamba_expand * self.common.hidden_size;
        match &self.mamba_d_head {
            None | Some(serde_json::Value::Null) => Ok(inner / self.mamba_n_heads.max(1)),
            Some(serde_json::Value::String(s)) if s == "auto" => {
                Ok(inner / self.mamba_n_heads.max(1))
            }
            Some(v) => v
                .as_i64()
                .filter(|d| *d > 0 && *d <= i32::MAX as i64)
                .map(|d| d as i32)
                .ok_or_else(|| {
                    ModelError::Config(format!(
                        "mamba_d_head = {v}: must be a positive integer or \"auto\""
                    ))
                }),
        }
    }
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        weights.rename_prefix("model.final_layernorm.", "model.norm.")?;
        rename_in_layers(
            weights,
            self.common.num_hidden_layers,
            &[
                ("mamba", "mixer"),
                ("feed_forward", "mlp"),
                ("pre_ff_layernorm", "post_attention_layernorm"),
            ],
        )?;
        conv_weights_to_torch_layout(weights)
    }

    fn spec(&self) -> Result<DecoderSpec> {
        check_positive(&[
            ("mamba_n_heads", self.mamba_n_heads),
            ("mamba_n_groups", self.mamba_n_groups),
            ("mamba_d_state", self.mamba_d_state),
            ("mamba_d_conv", self.mamba_d_conv),
            ("mamba_expand", self.mamba_expand),
            ("mamba_chunk_size", self.mamba_chunk_size),
        ])?;
        let mut common = self.common.clone();
        // transformers hard-codes half-rotary attention for Bamba.
        common.partial_rotary_factor.get_or_insert(0.5);
        let mut spec = base_spec(&common, false, "silu")?;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        spec.mlp_bias = self.mlp_bias;
        let mamba = MixerSpec::Mamba2(Mamba2Spec {
            dims: Mamba2Dims {
                inner: self.mamba_expand * common.hidden_size,
                heads: self.mamba_n_heads,
                head_dim: self.head_dim()?,
                groups: self.mamba_n_groups,
                state: self.mamba_d_state,
                chunk: self.mamba_chunk_size,
            },
            conv_kernel: self.mamba_d_conv,
            conv_bias: self.mamba_conv_bias,
            proj_bias: self.mamba_proj_bias,
            norm_eps: common.rms_norm_eps,
            gated_norm: GatedNorm::GateThenNorm,
            dt_limit: dt_limit(self.time_step_limit.as_deref())?,
        });
        let attention = self.attn_layer_indices.clone().unwrap_or_default();
        for i in 0..common.num_hidden_layers {
            if !attention.contains(&i) {
                spec.mixers[i] = mamba.clone();
                spec.rope[i] = None;
            }
        }
        Ok(spec)
    }
}
