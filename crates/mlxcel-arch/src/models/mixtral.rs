//! Mixtral: llama attention, every feed-forward block a softmax-routed mixture of experts
//! (`block_sparse_moe`, renamed `mlp` at load; experts `w1`/`w3`/`w2` = gate/up/down, top-k weights renormalised).

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs, MoeArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::sanitize::stack_experts;
use crate::Result;

/// The `config.json` keys of Mixtral (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// The mixture-of-experts keys (`num_experts`, `num_experts_per_tok`, ...).
    #[serde(flatten)]
    pub moe: MoeArgs,
}

/// The Mixtral decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let args = self;
        for i in 0..args.common.num_hidden_layers {
            // The canonical feed-forward scope is `mlp` (MLX conversions keep Mixtral's name).
            let layer = format!("model.layers.{i}");
            weights.rename_prefix(
                &format!("{layer}.block_sparse_moe."),
                &format!("{layer}.mlp."),
            )?;
            stack_experts(
                weights,
                &format!("{layer}.mlp"),
                "experts",
                args.moe.num_experts as usize,
                &[("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")],
            )?;
        }
        Ok(())
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let args = self;
        let c = &args.common;
        let mut spec = base_spec(c, false, "silu")?;
        // Mixtral always renormalises the kept weights.
        args.moe.apply(&mut spec, c.intermediate()?, true, None);
        spec.windows = c.windows(|_| c.sliding_window.is_some())?;
        Ok(spec)
    }
}
