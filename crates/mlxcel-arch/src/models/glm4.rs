//! GLM-4 (0414): sandwich blocks whose norms have their own names (`post_self_attn_layernorm`
//! after attention, `post_attention_layernorm` before the MLP, `post_mlp_layernorm` after it;
//! renamed to the canonical sandwich names at load), a fused `gate_up_proj` (split at load),
//! q/k/v biases, and interleaved rope on part of each head (`partial_rotary_factor`).

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::{base_spec, CommonArgs};
use super::transformer::{BlockTopology, DecoderArgs, DecoderSpec, Transformer};
use crate::sanitize::{rename_in_layers, split_rows};
use crate::Result;

/// The `config.json` keys of GLM-4 (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    #[serde(flatten)]
    pub common: CommonArgs,
    /// `attention_bias`: biases on the q/k/v projections; default false.
    #[serde(default)]
    pub attention_bias: bool,
}

/// The GLM-4 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let c = &self.common;
        let layers = c.num_hidden_layers;
        // GLM's pre-MLP norm is called `post_attention_layernorm`: free that name first.
        rename_in_layers(
            weights,
            layers,
            &[
                ("post_attention_layernorm", "pre_feedforward_layernorm"),
                ("post_self_attn_layernorm", "post_attention_layernorm"),
                ("post_mlp_layernorm", "post_feedforward_layernorm"),
            ],
        )?;
        let inter = c.intermediate()?;
        for i in 0..layers {
            let mlp = format!("model.layers.{i}.mlp");
            split_rows(
                weights,
                &format!("{mlp}.gate_up_proj"),
                &[
                    (&format!("{mlp}.gate_proj"), inter),
                    (&format!("{mlp}.up_proj"), inter),
                ],
            )?;
        }
        Ok(())
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let mut spec = base_spec(&self.common, false, "silu")?;
        spec.topology = BlockTopology::Sandwich;
        spec.qkv_bias = self.attention_bias;
        for rope in spec.rope.iter_mut().flatten() {
            rope.traditional = true;
        }
        Ok(spec)
    }
}
