//! Gemma 2: Gemma plus sandwich norms, logit soft-capping (attention and final), query scaling
//! by `query_pre_attn_scalar`, and alternating sliding/global layers.

use serde::Deserialize;

use super::common::CommonArgs;
use super::gemma::gemma_spec;
use super::transformer::{Decoder, Transformer};
use crate::model::Architecture;
use crate::weights::ModelWeights;
use crate::Result;

#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    #[serde(flatten)]
    pub common: CommonArgs,
    #[serde(default)]
    pub hidden_activation: Option<String>,
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
}

pub type Model = Transformer<Args>;

impl Architecture for Model {
    type Args = Args;

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Self> {
        let c = &args.common;
        let mut spec = gemma_spec(c, args.hidden_activation.as_deref())?;
        spec.sandwich_norms = true;
        spec.attn_scale = args
            .query_pre_attn_scalar
            .unwrap_or(c.head_dim() as f64)
            .powf(-0.5) as f32;
        spec.attn_softcap = args.attn_logit_softcapping.map(|v| v as f32);
        spec.final_softcap = args.final_logit_softcapping;
        // Without `layer_types`: even layers slide, odd layers are global.
        spec.windows = c.windows(|i| i % 2 == 0)?;
        Ok(Transformer::new(Decoder::build(&spec, w)?))
    }
}
