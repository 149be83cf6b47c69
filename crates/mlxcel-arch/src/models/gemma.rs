//! Gemma: `(1 + w)` RMSNorms, embeddings scaled by `sqrt(hidden)`, tanh-GELU MLPs, tied head.

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{BlockTopology, DecoderArgs, DecoderSpec, Transformer};
use crate::nn::{Activation, NormKind};
use crate::{ModelError, Result};

/// The `config.json` keys of Gemma (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `hidden_activation`: the MLP activation, preferred over `hidden_act`; default
    /// `gelu_pytorch_tanh`.
    #[serde(default)]
    pub hidden_activation: Option<String>,
}

/// The Gemma-family settings on top of a base spec (shared by Gemma 2 and 3).
pub(crate) fn gemma_spec(c: &CommonArgs, hidden_activation: Option<&str>) -> Result<DecoderSpec> {
    let mut spec = base_spec(c, true, "gelu_pytorch_tanh")?;
    spec.norm = NormKind::RmsOffset;
    spec.embed_scale = Some((c.hidden_size as f64).sqrt());
    // transformers' Gemma MLPs use `hidden_activation` when set, else `hidden_act`.
    if let Some(name) = hidden_activation {
        spec.act = Activation::from_name(name)
            .ok_or_else(|| ModelError::Unsupported(format!("hidden_activation `{name}`")))?;
    }
    Ok(spec)
}

/// The Gemma 2/3 config fields beyond [`CommonArgs`].
#[derive(Debug, Clone, Deserialize)]
pub struct GemmaArgs {
    /// `hidden_activation`: the MLP activation, preferred over `hidden_act`; default
    /// `gelu_pytorch_tanh`.
    #[serde(default)]
    pub hidden_activation: Option<String>,
    /// `query_pre_attn_scalar`: attention scores are scaled by its `-1/2` power; default
    /// `head_dim`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// `attn_logit_softcapping`: `tanh(s / cap) * cap` on attention scores; absent: off.
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// `final_logit_softcapping`: the same on the output logits; absent: off.
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
}

/// Gemma 2/3's layout: sandwich norms, queries scaled by `query_pre_attn_scalar^-1/2`,
/// optional soft-capping of attention scores and final logits.
pub(crate) fn sandwich_spec(c: &CommonArgs, g: &GemmaArgs) -> Result<DecoderSpec> {
    let mut spec = gemma_spec(c, g.hidden_activation.as_deref())?;
    spec.topology = BlockTopology::Sandwich;
    spec.attn_scale = g
        .query_pre_attn_scalar
        .unwrap_or(c.head_dim() as f64)
        .powf(-0.5) as f32;
    spec.attn_softcap = g.attn_logit_softcapping.map(|v| v as f32);
    spec.final_softcap = g.final_logit_softcapping;
    Ok(spec)
}

/// The Gemma decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn spec(&self) -> Result<DecoderSpec> {
        let args = self;
        let spec = gemma_spec(&args.common, args.hidden_activation.as_deref())?;
        Ok(spec)
    }
}
