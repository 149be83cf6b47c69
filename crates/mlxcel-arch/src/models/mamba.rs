//! Mamba (Mamba-1) and Falcon-Mamba: a stack of selective state-space mixers without
//! attention or feed-forward blocks. Falcon-Mamba is the same network with weightless RMS norms
//! on the time-step input, `B` and `C` (`mixer_rms_eps`), chosen by the config.
//!
//! Checkpoints keep everything under `backbone.` (`embeddings`, `layers.{i}.{norm,mixer}`,
//! `norm_f`); `sanitize` renames it to the decoder's canonical layout and brings MLX-layout
//! convolution weights to PyTorch's.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;
use serde_json::Value;

use super::transformer::{
    BcdtNormSpec, BlockTopology, DecoderArgs, DecoderSpec, FfnSpec, MambaSpec, MixerSpec,
    QkNormSpec, Transformer,
};
use crate::nn::ssm::MambaDims;
use crate::nn::{Activation, NormKind};
use crate::sanitize::conv_weights_to_torch_layout;
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
fn sixteen() -> i32 {
    16
}
fn default_eps() -> f32 {
    1e-5
}

/// The `config.json` keys of Mamba and Falcon-Mamba (transformers' `MambaConfig`; the named
/// loader first translates the original `state-spaces` spelling, see
/// [`crate::nonstandard::load_mamba`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// `model_type`: `mamba` or `falcon_mamba`.
    pub model_type: String,
    /// `hidden_size`: the model width.
    pub hidden_size: i32,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `vocab_size`.
    pub vocab_size: i32,
    /// `state_size`: state features per channel; default 16.
    #[serde(default = "sixteen")]
    pub state_size: i32,
    /// `expand`: inner width = `expand · hidden_size`; default 2.
    #[serde(default = "two")]
    pub expand: f64,
    /// `conv_kernel`: width of the causal convolution; default 4.
    #[serde(default = "four")]
    pub conv_kernel: i32,
    /// `time_step_rank`: an integer or `"auto"` (`ceil(hidden_size / 16)`, the default).
    #[serde(default)]
    pub time_step_rank: Option<Value>,
    /// `use_bias`: biases on `in_proj`/`out_proj`; default false.
    #[serde(default)]
    pub use_bias: bool,
    /// `use_conv_bias`: a bias on the convolution; default true.
    #[serde(default = "yes")]
    pub use_conv_bias: bool,
    /// `layer_norm_epsilon`: the block and final norms' epsilon; default 1e-5.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f32,
    /// `tie_word_embeddings`: default true.
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// `mixer_rms_eps`: epsilon of Falcon-Mamba's dt/B/C norms; default 1e-6.
    #[serde(default)]
    pub mixer_rms_eps: Option<f32>,
    /// `use_bcdt_rms`: normalise dt, B and C before the scan; default: whether `model_type`
    /// is `falcon_mamba`.
    #[serde(default)]
    pub use_bcdt_rms: Option<bool>,
}

/// The Mamba / Falcon-Mamba model: the shared decoder with a Mamba mixer in every layer.
pub type Model = Transformer<Args>;

/// A rank given as an integer or `"auto"` (`ceil(hidden / 16)`), as Mamba configs write it.
pub(crate) fn rank_or_auto(value: Option<&Value>, hidden: i32, key: &str) -> Result<i32> {
    match value {
        None | Some(Value::Null) => Ok((hidden + 15) / 16),
        Some(Value::String(s)) if s == "auto" => Ok((hidden + 15) / 16),
        Some(v) => match v.as_i64() {
            Some(r) if r > 0 && r <= i32::MAX as i64 => Ok(r as i32),
            _ => Err(ModelError::Config(format!(
                "{key} = {v}: must be a positive integer or \"auto\""
            ))),
        },
    }
}

/// The inner width `expand · hidden`, checked.
pub(crate) fn inner_width(expand: f64, hidden: i32, key: &str) -> Result<i32> {
    let inner = expand * hidden as f64;
    if !(inner >= 1.0 && inner <= i32::MAX as f64 && inner.fract() == 0.0) {
        return Err(ModelError::Config(format!(
            "{key} = {expand}: expand × hidden_size must be a positive integer"
        )));
    }
    Ok(inner as i32)
}

/// A stack of `mixers` state-space layers without feed-forward blocks, RMSNorm'd; the
/// attention fields are unused.
pub(crate) fn mixer_only_spec(
    vocab: i32,
    hidden: i32,
    eps: f32,
    tie: bool,
    mixers: Vec<MixerSpec>,
) -> DecoderSpec {
    let n = mixers.len();
    DecoderSpec {
        vocab,
        hidden,
        heads: 1,
        kv_heads: 1,
        head_dim: hidden,
        norm: NormKind::Rms,
        eps,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        qk_norm: QkNormSpec::None,
        attn_scale: 1.0,
        attn_softcap: None,
        attn_sinks: false,
        attn_output_gate: false,
        act: Activation::Silu,
        topology: BlockTopology::MixerOnly,
        mixers,
        rope: vec![None; n],
        windows: vec![None; n],
        ffn: vec![FfnSpec::None; n],
        query_scales: vec![None; n],
        chunks: vec![None; n],
        block_scales: vec![super::transformer::BlockScales::ONE; n],
        embed_scale: None,
        residual_scale: None,
        logit_scale: None,
        final_softcap: None,
        tie_word_embeddings: tie,
        lm_head_bias: false,
        mtp: None,
    }
}

/// Renames the `backbone.*` layout of Mamba-family checkpoints (`embeddings` — `embedding` in
/// older ones —, `layers.{i}.norm`, `layers.{i}.mixer`, `norm_f`) to the canonical one, and
/// brings MLX-layout convolution weights to PyTorch's.
pub(crate) fn sanitize_backbone(weights: &mut WeightMap, layers: usize) -> Result<()> {
    weights.rename_prefix("backbone.embeddings.", "model.embed_tokens.")?;
    weights.rename_prefix("backbone.embedding.", "model.embed_tokens.")?;
    weights.rename_prefix("backbone.norm_f.", "model.norm.")?;
    for i in 0..layers {
        weights.rename_prefix(
            &format!("backbone.layers.{i}.norm."),
            &format!("model.layers.{i}.input_layernorm."),
        )?;
        weights.rename_prefix(
            &format!("backbone.layers.{i}.mixer."),
            &format!("model.layers.{i}.mixer."),
        )?;
    }
    conv_weights_to_torch_layout(weights)
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        sanitize_backbone(weights, self.num_hidden_layers)
    }

    fn spec(&self) -> Result<DecoderSpec> {
        super::mamba2::check_positive(&[
            ("state_size", self.state_size),
            ("conv_kernel", self.conv_kernel),
        ])?;
        let dims = MambaDims {
            inner: inner_width(self.expand, self.hidden_size, "expand")?,
            state: self.state_size,
            dt_rank: rank_or_auto(
                self.time_step_rank.as_ref(),
                self.hidden_size,
                "time_step_rank",
            )?,
        };
        let falcon = self.model_type == "falcon_mamba";
        let bcdt_norms = self.use_bcdt_rms.unwrap_or(falcon).then(|| BcdtNormSpec {
            weighted: false,
            eps: self.mixer_rms_eps.unwrap_or(1e-6),
        });
        let mixer = MixerSpec::Mamba(MambaSpec {
            dims,
            conv_kernel: self.conv_kernel,
            conv_bias: self.use_conv_bias,
            proj_bias: self.use_bias,
            bcdt_norms,
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
