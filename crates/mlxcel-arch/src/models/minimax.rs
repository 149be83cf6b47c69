//! MiniMax-Text-01 (`minimax`): lightning attention (linear attention with a per-head decay,
//! [`crate::nn::LightningAttention`]) on most layers and softmax attention on the others
//! (`layer_types`, hub: `attn_type_list` with 1 = softmax), Mixtral's experts on every layer, and
//! blocks whose residual is the *normed* input, both branches scaled per layer kind
//! (`full_attn_alpha_factor` / `linear_attn_*` / `mlp_*`, hub: `layernorm_*_alpha/beta`).

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;

use super::common::base_spec;
use super::mixtral;
use super::transformer::{
    BlockScales, BlockTopology, DecoderArgs, DecoderSpec, LightningSpec, MixerSpec, Transformer,
};
use crate::nn::lightning_slopes;
use crate::{ModelError, Result};

fn one() -> f64 {
    1.0
}

fn default_block() -> i32 {
    256
}

/// The `config.json` keys of MiniMax (read after [`crate::config::sanitize_config_json`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Args {
    /// Mixtral's keys: the shared ones and the experts'.
    #[serde(flatten)]
    pub mixtral: mixtral::Args,
    /// `attn_type_list` (hub checkpoints, used without `layer_types`): per layer 0 (lightning)
    /// or 1 (softmax attention).
    #[serde(default)]
    pub attn_type_list: Option<Vec<u8>>,
    /// `block_size`: positions per closed-form block of a lightning prefill; default 256.
    #[serde(default = "default_block")]
    pub block_size: i32,
    /// `full_attn_alpha_factor` (hub: `layernorm_full_attention_alpha`); default 1.
    #[serde(default = "one", alias = "layernorm_full_attention_alpha")]
    pub full_attn_alpha_factor: f64,
    /// `full_attn_beta_factor` (hub: `layernorm_full_attention_beta`); default 1.
    #[serde(default = "one", alias = "layernorm_full_attention_beta")]
    pub full_attn_beta_factor: f64,
    /// `linear_attn_alpha_factor` (hub: `layernorm_linear_attention_alpha`); default 1.
    #[serde(default = "one", alias = "layernorm_linear_attention_alpha")]
    pub linear_attn_alpha_factor: f64,
    /// `linear_attn_beta_factor` (hub: `layernorm_linear_attention_beta`); default 1.
    #[serde(default = "one", alias = "layernorm_linear_attention_beta")]
    pub linear_attn_beta_factor: f64,
    /// `mlp_alpha_factor` (hub: `layernorm_mlp_alpha`); default 1.
    #[serde(default = "one", alias = "layernorm_mlp_alpha")]
    pub mlp_alpha_factor: f64,
    /// `mlp_beta_factor` (hub: `layernorm_mlp_beta`); default 1.
    #[serde(default = "one", alias = "layernorm_mlp_beta")]
    pub mlp_beta_factor: f64,
}

/// The MiniMax decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl Args {
    /// Per layer: whether it is lightning (linear) attention.
    fn linear_layers(&self) -> Result<Vec<bool>> {
        let n = self.mixtral.common.num_hidden_layers;
        let common = &self.mixtral.common;
        let layer_types = common.layer_type_flags("linear_attention", "full_attention")?;
        let layers: Vec<bool> = match (layer_types, &self.attn_type_list) {
            (Some(linear), _) => linear,
            (None, Some(list)) => list.iter().map(|t| *t == 0).collect(),
            // transformers' default: layer 0 softmax, then alternating.
            (None, None) => (0..n).map(|i| (i + 1) % 2 == 0).collect(),
        };
        if layers.len() != n {
            return Err(ModelError::Config(format!(
                "layer_types / attn_type_list has {} entries for {n} layers",
                layers.len()
            )));
        }
        Ok(layers)
    }
}

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, quant: Option<&QuantConfig>) -> Result<()> {
        // Buffers transformers derives from the config (recomputed here).
        let derived: Vec<String> = weights
            .names()
            .filter(|n| {
                ["slope_rate", "query_decay", "key_decay", "diagonal_decay"]
                    .iter()
                    .any(|b| n.ends_with(&format!("self_attn.{b}")))
            })
            .map(str::to_string)
            .collect();
        for name in derived {
            weights.remove(&name);
        }
        self.mixtral.sanitize(weights, quant)
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let c = &self.mixtral.common;
        let n = c.num_hidden_layers;
        let mut spec = base_spec(c, false, "silu")?;
        // Mixtral's experts always renormalise the kept weights.
        self.mixtral
            .moe
            .apply(&mut spec, c.intermediate()?, true, None);
        if self.block_size <= 0 {
            return Err(ModelError::Config(format!(
                "block_size = {}: must be positive",
                self.block_size
            )));
        }
        spec.topology = BlockTopology::NormedResidual;
        for (i, linear) in self.linear_layers()?.into_iter().enumerate() {
            if linear {
                spec.mixers[i] = MixerSpec::Lightning(LightningSpec {
                    heads: c.num_attention_heads,
                    head_dim: c.head_dim(),
                    block: self.block_size,
                    slopes: lightning_slopes(c.num_attention_heads, i, n),
                });
                spec.rope[i] = None;
            } else {
                spec.windows[i] = c.sliding_window;
            }
            let (alpha, beta) = if linear {
                (self.linear_attn_alpha_factor, self.linear_attn_beta_factor)
            } else {
                (self.full_attn_alpha_factor, self.full_attn_beta_factor)
            };
            spec.block_scales[i] = BlockScales {
                mixer_residual: alpha,
                mixer_out: beta,
                ffn_residual: self.mlp_alpha_factor,
                ffn_out: self.mlp_beta_factor,
            };
        }
        Ok(spec)
    }
}
