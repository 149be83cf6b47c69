//! EXAONE 3.0 / 3.5 (`exaone`): the Llama decoder under its own names. Hub configs spell
//! `num_layers`, `layer_norm_epsilon` and `activation_function` (transformers' `attribute_map`),
//! and the weights sit under `transformer.*`: `wte`, `h.{i}.attn.attention.{q,k,v,out}_proj`,
//! `ln_1`/`ln_2`, `mlp.c_fc_0`/`c_fc_1`/`c_proj`, `ln_f` — rewritten here to the canonical
//! layout (the renames of transformers' conversion mapping).

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;
use serde_json::Value;

use super::llama;
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::Result;

/// The EXAONE config keys, after renaming hub spellings to the classic ones.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "Value")]
pub struct Args {
    /// The Llama keys (`attention_bias`, `mlp_bias` and the shared ones).
    pub llama: llama::Args,
}

/// EXAONE's config spellings and the classic keys they stand for.
const KEY_ALIASES: &[(&str, &str)] = &[
    ("num_layers", "num_hidden_layers"),
    ("layer_norm_epsilon", "rms_norm_eps"),
    ("activation_function", "hidden_act"),
];

impl TryFrom<Value> for Args {
    type Error = serde_json::Error;

    fn try_from(mut config: Value) -> std::result::Result<Args, serde_json::Error> {
        if let Value::Object(obj) = &mut config {
            for (alias, key) in KEY_ALIASES {
                if let Some(v) = obj.remove(*alias) {
                    obj.entry(key.to_string()).or_insert(v);
                }
            }
        }
        Ok(Args {
            llama: serde_json::from_value(config)?,
        })
    }
}

/// The EXAONE 3 decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

/// The hub layout's names (prefix renames, applied in order) and the canonical ones.
const RENAMES: &[(&str, &str)] = &[
    ("attn.attention.out_proj", "self_attn.o_proj"),
    ("attn.attention", "self_attn"),
    ("ln_1", "input_layernorm"),
    ("ln_2", "post_attention_layernorm"),
    ("mlp.c_fc_0", "mlp.gate_proj"),
    ("mlp.c_fc_1", "mlp.up_proj"),
    ("mlp.c_proj", "mlp.down_proj"),
];

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, quant: Option<&QuantConfig>) -> Result<()> {
        weights.rename_prefix("transformer.wte.", "model.embed_tokens.")?;
        weights.rename_prefix("transformer.ln_f.", "model.norm.")?;
        weights.rename_prefix("transformer.h.", "model.layers.")?;
        let n = self.llama.common.num_hidden_layers;
        crate::sanitize::rename_in_layers(weights, n, RENAMES)?;
        self.llama.sanitize(weights, quant)
    }

    fn spec(&self) -> Result<DecoderSpec> {
        self.llama.spec()
    }
}
