//! Phi-3: fused `qkv_proj` and `gate_up_proj`, partial rotary, longrope scaling, optional
//! sliding window on every layer.

use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{Decoder, Transformer};
use crate::model::Architecture;
use crate::weights::ModelWeights;
use crate::Result;

#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    #[serde(flatten)]
    pub common: CommonArgs,
    #[serde(default)]
    pub original_max_position_embeddings: Option<i64>,
}

pub type Model = Transformer<Args>;

impl Architecture for Model {
    type Args = Args;

    fn build(args: &Args, w: &mut ModelWeights) -> Result<Self> {
        let c = &args.common;
        let mut spec = base_spec(c, false, "silu")?;
        spec.fused_qkv = true;
        spec.fused_gate_up = true;
        // Longrope needs the pre-training context; older configs keep it at the top level.
        if let (Some(scaling), Some(orig)) = (
            c.rope_scaling.as_ref(),
            args.original_max_position_embeddings,
        ) {
            let mut s = scaling.clone();
            if let Some(obj) = s.as_object_mut() {
                obj.entry("original_max_position_embeddings")
                    .or_insert(orig.into());
            }
            for r in spec.rope.iter_mut() {
                r.scaling = Some(s.clone());
            }
        }
        spec.windows = c.windows(|_| c.sliding_window.is_some())?;
        Ok(Transformer::new(Decoder::build(&spec, w)?))
    }
}
