//! GPT-J: parallel blocks (attention and MLP read one LayerNorm, `ln_1`), bias-free attention
//! projections, a plain `fc_in` → GELU → `fc_out` MLP with biases, rope on the first
//! `rotary_dim` features of each head with interleaved pairs, and an output head with a bias.
//! Hub checkpoints keep GPT-2-style names (`transformer.wte`, `transformer.h.{i}.attn.*`,
//! `ln_f`; mlx-lm conversions `model.*`) and GPT-2-style config keys (`n_embd`, `n_layer`,
//! `n_head`, `n_inner`, `n_positions`, `activation_function`, `layer_norm_epsilon`).

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;
use serde_json::Value;

use super::common::{base_spec, parse_with_aliases, plain_ffn, CommonArgs};
use super::transformer::{BlockTopology, DecoderArgs, DecoderSpec, Transformer};
use crate::nn::NormKind;
use crate::sanitize::rename_in_layers;
use crate::{ModelError, Result};

/// `GPTJConfig.attribute_map` and the GPT-2 spellings of the other common keys.
const KEY_ALIASES: [(&str, &str); 6] = [
    ("n_embd", "hidden_size"),
    ("n_layer", "num_hidden_layers"),
    ("n_head", "num_attention_heads"),
    ("n_positions", "max_position_embeddings"),
    ("n_inner", "intermediate_size"),
    ("activation_function", "hidden_act"),
];

fn default_layer_norm_epsilon() -> f32 {
    1e-5
}

fn default_rotary_dim() -> Option<i32> {
    Some(64)
}

/// The `config.json` keys of GPT-J (read after [`crate::config::sanitize_config_json`]; the
/// GPT-2 spellings are accepted for the common keys).
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "Value")]
pub struct Args {
    /// The keys every decoder shares (`hidden_size` from `n_embd`, ...).
    pub common: CommonArgs,
    /// `layer_norm_epsilon`: the LayerNorms' epsilon; default `1e-5`.
    pub layer_norm_epsilon: f32,
    /// `rotary_dim`: rotated features of each head; default 64.
    pub rotary_dim: Option<i32>,
}

/// [`Args`] as the JSON spells it, after the aliases are resolved.
#[derive(Deserialize)]
struct Keys {
    #[serde(flatten)]
    common: CommonArgs,
    #[serde(default = "default_layer_norm_epsilon")]
    layer_norm_epsilon: f32,
    #[serde(default = "default_rotary_dim")]
    rotary_dim: Option<i32>,
}

impl TryFrom<Value> for Args {
    type Error = serde_json::Error;

    fn try_from(config: Value) -> std::result::Result<Args, serde_json::Error> {
        let keys: Keys = parse_with_aliases(config, &KEY_ALIASES)?;
        Ok(Args {
            common: keys.common,
            layer_norm_epsilon: keys.layer_norm_epsilon,
            rotary_dim: keys.rotary_dim,
        })
    }
}

/// The GPT-J decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let n = self.common.num_hidden_layers;
        for root in ["transformer", "model"] {
            weights.rename_prefix(&format!("{root}.wte."), "model.embed_tokens.")?;
            weights.rename_prefix(&format!("{root}.ln_f."), "model.norm.")?;
            for i in 0..n {
                // The causal-mask buffers older exporters saved.
                for buffer in ["attn.bias", "attn.masked_bias"] {
                    weights.remove(&format!("{root}.h.{i}.{buffer}"));
                }
                weights.rename_prefix(&format!("{root}.h.{i}."), &format!("model.layers.{i}."))?;
            }
        }
        rename_in_layers(
            weights,
            n,
            &[
                ("attn", "self_attn"),
                ("self_attn.out_proj", "self_attn.o_proj"),
                ("ln_1", "input_layernorm"),
                ("mlp.fc_in", "mlp.up_proj"),
                ("mlp.fc_out", "mlp.down_proj"),
            ],
        )
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let mut c = self.common.clone();
        // Keys and values have every head (transformers reads no `num_key_value_heads`).
        c.num_key_value_heads = None;
        // `n_inner` null means four times the width.
        if c.intermediate_size.is_none() {
            let four = c.hidden_size.checked_mul(4).ok_or_else(|| {
                ModelError::Config(format!("n_embd = {}: 4 × n_embd overflows", c.hidden_size))
            })?;
            c.intermediate_size = Some(four);
        }
        let head_dim = c.head_dim();
        let rotary_dim = self.rotary_dim.unwrap_or(head_dim);
        if rotary_dim <= 0 || rotary_dim > head_dim || rotary_dim % 2 != 0 {
            return Err(ModelError::Config(format!(
                "rotary_dim = {rotary_dim}: expected an even width of at most the head's {head_dim}"
            )));
        }
        let mut spec = base_spec(&c, false, "gelu_new")?;
        spec.topology = BlockTopology::Parallel;
        spec.norm = NormKind::Layer;
        spec.eps = self.layer_norm_epsilon;
        spec.mlp_bias = true;
        spec.lm_head_bias = true;
        for rope in spec.rope.iter_mut().flatten() {
            rope.dims = rotary_dim;
            rope.traditional = true;
        }
        spec.ffn = plain_ffn(&c)?;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::transformer::FfnSpec;
    use serde_json::json;

    fn spec(extra: Value) -> Result<DecoderSpec> {
        let mut hub = json!({"model_type": "gptj", "vocab_size": 64, "n_embd": 32, "n_layer": 2,
            "n_head": 2, "n_inner": null, "rotary_dim": 8, "n_positions": 256});
        if let (Some(obj), Value::Object(extra)) = (hub.as_object_mut(), extra) {
            obj.extend(extra);
        }
        let args: Args = serde_json::from_value(crate::config::sanitize_config_json(hub)).unwrap();
        args.spec()
    }

    #[test]
    fn gpt2_key_names_and_defaults() {
        let s = spec(json!({})).unwrap();
        assert_eq!((s.hidden, s.heads, s.kv_heads, s.layers()), (32, 2, 2, 2));
        assert!(
            matches!(s.ffn[0], FfnSpec::Plain { intermediate: 128 }),
            "n_inner null: 4 × n_embd"
        );
        let rope = s.rope[0].as_ref().unwrap();
        assert_eq!((rope.dims, rope.traditional), (8, true));
        assert!(s.lm_head_bias && s.mlp_bias && !s.qkv_bias && !s.o_bias);
        // transformers' GPT-J has no grouped-query attention: the key is ignored.
        assert_eq!(spec(json!({"num_key_value_heads": 1})).unwrap().kv_heads, 2);
        let err = spec(json!({"rotary_dim": 32})).unwrap_err().to_string();
        assert!(err.contains("rotary_dim = 32"), "{err}");
        // The aliased keys are validated like the canonical ones (no division by zero heads).
        let zero_heads = json!({"model_type": "gptj", "vocab_size": 64, "n_embd": 32,
            "n_layer": 2, "n_head": 0});
        let err = serde_json::from_value::<Args>(zero_heads)
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_attention_heads"), "{err}");
    }
}
