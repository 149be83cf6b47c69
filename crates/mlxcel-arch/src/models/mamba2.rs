//! Mamba-2: a stack of multi-head SSD mixers (grouped `B`/`C`, scalar decay per head, gated
//! RMSNorm before the output projection), no attention or feed-forward blocks. Same
//! `backbone.*` checkpoint layout as Mamba (see [`super::mamba`]).

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::mamba::{inner_width, mixer_only_spec, sanitize_backbone};
use super::transformer::{DecoderArgs, DecoderSpec, Mamba2Spec, MixerSpec, Transformer};
use crate::nn::ssm::{GatedNorm, Mamba2Dims};
use crate::{ModelError, Result};

fn yes() -> bool {
    true
}
fn two() -> f64 {
    2.0
}
fn four() -> i32 {
    4
}
fn default_chunk() -> i32 {
    256
}
fn default_eps() -> f32 {
    1e-5
}
fn one() -> i32 {
    1
}

/// The `config.json` keys of Mamba-2 (transformers' `Mamba2Config`).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// `hidden_size`: the model width.
    pub hidden_size: i32,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `vocab_size`.
    pub vocab_size: i32,
    /// `num_heads`: SSD heads (required).
    pub num_heads: i32,
    /// `head_dim`: channels per head (required).
    pub head_dim: i32,
    /// `state_size`: state features (required).
    pub state_size: i32,
    /// `n_groups`: groups of heads sharing one `B` and `C`; default 1.
    #[serde(default = "one")]
    pub n_groups: i32,
    /// `expand`: inner width = `expand · hidden_size`; default 2.
    #[serde(default = "two")]
    pub expand: f64,
    /// `conv_kernel`: width of the causal convolution; default 4.
    #[serde(default = "four")]
    pub conv_kernel: i32,
    /// `chunk_size`: positions per SSD chunk during prefill; default 256.
    #[serde(default = "default_chunk")]
    pub chunk_size: i32,
    /// `use_bias`: biases on `in_proj`/`out_proj`; default false.
    #[serde(default)]
    pub use_bias: bool,
    /// `use_conv_bias`: a bias on the convolution; default true.
    #[serde(default = "yes")]
    pub use_conv_bias: bool,
    /// `layer_norm_epsilon`: every norm's epsilon (the gated one too); default 1e-5.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f32,
    /// `time_step_limit`: `[min, max]` clamp of the time step; default `[0, inf]`.
    #[serde(default)]
    pub time_step_limit: Option<Vec<f64>>,
    /// `tie_word_embeddings`: default false.
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

/// The Mamba-2 model: the shared decoder with a Mamba-2 mixer in every layer.
pub type Model = Transformer<Args>;

/// `(min, max)` of a `time_step_limit` list.
pub(crate) fn dt_limit(limit: Option<&[f64]>) -> Result<(f64, f64)> {
    match limit {
        None => Ok((0.0, f64::INFINITY)),
        Some([lo, hi]) if lo <= hi => Ok((*lo, *hi)),
        Some(other) => Err(ModelError::Config(format!(
            "time_step_limit = {other:?}: must be [min, max] with min <= max"
        ))),
    }
}

/// Checks the positive integer widths of an SSM config.
pub(crate) fn check_positive(values: &[(&str, i32)]) -> Result<()> {
    for (key, v) in values {
        if *v <= 0 {
            return Err(ModelError::Config(format!("{key} = {v}: must be positive")));
        }
    }
    Ok(())
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        sanitize_backbone(weights, self.num_hidden_layers)
    }

    fn spec(&self) -> Result<DecoderSpec> {
        check_positive(&[
            ("num_heads", self.num_heads),
            ("head_dim", self.head_dim),
            ("state_size", self.state_size),
            ("n_groups", self.n_groups),
            ("conv_kernel", self.conv_kernel),
            ("chunk_size", self.chunk_size),
        ])?;
        let dims = Mamba2Dims {
            inner: inner_width(self.expand, self.hidden_size, "expand")?,
            heads: self.num_heads,
            head_dim: self.head_dim,
            groups: self.n_groups,
            state: self.state_size,
            chunk: self.chunk_size,
        };
        let mixer = MixerSpec::Mamba2(Mamba2Spec {
            dims,
            conv_kernel: self.conv_kernel,
            conv_bias: self.use_conv_bias,
            proj_bias: self.use_bias,
            norm_eps: self.layer_norm_epsilon,
            gated_norm: GatedNorm::GateThenNorm,
            dt_limit: dt_limit(self.time_step_limit.as_deref())?,
        });
        Ok(mixer_only_spec(
            self.vocab_size,
            self.hidden_size,
            self.layer_norm_epsilon,
            self.tie_word_embeddings,
            vec![mixer; self.num_hidden_layers],
        ))
    }
}
