//! Gemma: `(1 + w)` RMSNorms, embeddings scaled by `sqrt(hidden)`, tanh-GELU MLPs, tied head.

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{Decoder, DecoderSpec, Transformer};
use crate::model::Architecture;
use crate::nn::{Activation, NormKind};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    #[serde(flatten)]
    pub common: CommonArgs,
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

pub type Model = Transformer<Args>;

impl Architecture for Model {
    type Args = Args;

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Self> {
        let spec = gemma_spec(&args.common, args.hidden_activation.as_deref())?;
        Ok(Transformer::new(Decoder::build(&spec, w)?))
    }
}
