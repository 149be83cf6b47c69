//! Phi-3: fused `qkv_proj` and `gate_up_proj` (split at load), partial rotary, longrope scaling, optional
//! sliding window on every layer.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::sanitize::split_rows;
use crate::Result;

/// The `config.json` keys of Phi-3 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `original_max_position_embeddings`: the pre-training context longrope scaling needs,
    /// when the config keeps it at the top level rather than in `rope_scaling`.
    #[serde(default)]
    pub original_max_position_embeddings: Option<i64>,
}

/// The Phi-3 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    /// Splits the fused `qkv_proj` and `gate_up_proj` into the canonical projections (rows are
    /// independent, so quantized planes split the same way); GPUs fuse them back at load.
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let c = &self.common;
        let (q, kv) = (
            c.num_attention_heads * c.head_dim(),
            c.kv_heads() * c.head_dim(),
        );
        let inter = c.intermediate()?;
        for i in 0..c.num_hidden_layers {
            let layer = format!("model.layers.{i}");
            split_rows(
                weights,
                &format!("{layer}.self_attn.qkv_proj"),
                &[
                    (&format!("{layer}.self_attn.q_proj"), q),
                    (&format!("{layer}.self_attn.k_proj"), kv),
                    (&format!("{layer}.self_attn.v_proj"), kv),
                ],
            )?;
            split_rows(
                weights,
                &format!("{layer}.mlp.gate_up_proj"),
                &[
                    (&format!("{layer}.mlp.gate_proj"), inter),
                    (&format!("{layer}.mlp.up_proj"), inter),
                ],
            )?;
        }
        Ok(())
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let args = self;
        let c = &args.common;
        let mut spec = base_spec(c, false, "silu")?;
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
            for r in spec.rope.iter_mut().flatten() {
                r.scaling = Some(s.clone());
            }
        }
        spec.windows = c.windows(|_| c.sliding_window.is_some())?;
        Ok(spec)
    }
}
