//! EXAONE 3.x (3.0, 3.5, Deep): llama blocks under GPT-2-style names (`transformer.wte`,
//! `transformer.h.{i}.attn.attention.{q,k,v,out}_proj`, `ln_1`/`ln_2`, `mlp.c_fc_0`/`c_fc_1`/
//! `c_proj`, `transformer.ln_f`), renamed to the canonical layout at load. The hub configs spell
//! three keys their own way (`num_layers`, `layer_norm_epsilon`, `activation_function`), and the
//! rope base defaults to 500000.

use mlxcel_core::WeightMap;
use mlxcel_quant::QuantConfig;
use serde::Deserialize;
use serde_json::Value;

use super::common::{base_spec, parse_with_aliases, CommonArgs};
use super::transformer::{DecoderArgs, DecoderSpec, Transformer};
use crate::sanitize::rename_in_layers;
use crate::Result;

fn default_rms_norm_eps() -> f32 {
    1e-5
}

/// transformers' `ExaoneConfig.default_theta`.
const DEFAULT_ROPE_THETA: f64 = 500_000.0;

/// `ExaoneConfig.attribute_map`: the hub's key → the canonical one.
const KEY_ALIASES: [(&str, &str); 3] = [
    ("num_layers", "num_hidden_layers"),
    ("layer_norm_epsilon", "rms_norm_eps"),
    ("activation_function", "hidden_act"),
];

/// The `config.json` keys of EXAONE 3.x (read after [`crate::config::sanitize_config_json`];
/// the hub's aliases are accepted for the canonical keys).
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "Value")]
pub struct Args {
    /// The keys every decoder shares (`hidden_size`, `num_hidden_layers`, rope, ...).
    pub common: CommonArgs,
    /// `rms_norm_eps` (`layer_norm_epsilon`): the RMSNorms' epsilon; default `1e-5`.
    pub rms_norm_eps: f32,
    /// `attention_bias`: biases on the q/k/v and output projections; default false.
    pub attention_bias: bool,
    /// `mlp_bias`: biases on the MLP projections; default false.
    pub mlp_bias: bool,
}

/// [`Args`] as the JSON spells it, after the aliases are resolved.
#[derive(Deserialize)]
struct Keys {
    #[serde(flatten)]
    common: CommonArgs,
    /// Read here, not by [`CommonArgs`], to tell it apart from an absent key.
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default = "default_rms_norm_eps")]
    rms_norm_eps: f32,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
}

impl TryFrom<Value> for Args {
    type Error = serde_json::Error;

    fn try_from(config: Value) -> std::result::Result<Args, serde_json::Error> {
        let mut keys: Keys = parse_with_aliases(config, &KEY_ALIASES)?;
        keys.common.rope_theta = keys.rope_theta.unwrap_or(DEFAULT_ROPE_THETA);
        Ok(Args {
            common: keys.common,
            rms_norm_eps: keys.rms_norm_eps,
            attention_bias: keys.attention_bias,
            mlp_bias: keys.mlp_bias,
        })
    }
}

/// The EXAONE 3.x decoder: the shared [`Transformer`] configured by [`Args`].
pub type Model = Transformer<Args>;

impl DecoderArgs for Args {
    fn sanitize(&self, weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        let n = self.common.num_hidden_layers;
        weights.rename_prefix("transformer.wte.", "model.embed_tokens.")?;
        weights.rename_prefix("transformer.ln_f.", "model.norm.")?;
        for i in 0..n {
            weights.rename_prefix(
                &format!("transformer.h.{i}."),
                &format!("model.layers.{i}."),
            )?;
        }
        rename_in_layers(
            weights,
            n,
            &[
                ("attn.attention", "self_attn"),
                ("self_attn.out_proj", "self_attn.o_proj"),
                ("ln_1", "input_layernorm"),
                ("ln_2", "post_attention_layernorm"),
                ("mlp.c_fc_0", "mlp.gate_proj"),
                ("mlp.c_fc_1", "mlp.up_proj"),
                ("mlp.c_proj", "mlp.down_proj"),
            ],
        )
    }

    fn spec(&self) -> Result<DecoderSpec> {
        let mut spec = base_spec(&self.common, false, "silu")?;
        spec.eps = self.rms_norm_eps;
        spec.qkv_bias = self.attention_bias;
        spec.o_bias = self.attention_bias;
        spec.mlp_bias = self.mlp_bias;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hub_key_aliases_and_rope_default() {
        let hub = json!({"model_type": "exaone", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_layers": 3, "num_attention_heads": 2,
            "layer_norm_epsilon": 1e-6, "activation_function": "silu"});
        let args: Args =
            serde_json::from_value(crate::config::sanitize_config_json(hub.clone())).unwrap();
        let s = args.spec().unwrap();
        assert_eq!((s.layers(), s.eps), (3, 1e-6));
        assert_eq!(s.rope[0].as_ref().unwrap().base, 500_000.0);
        let mut bad = hub;
        bad["activation_function"] = "swiglu".into();
        let args: Args = serde_json::from_value(bad).unwrap();
        let err = args.spec().unwrap_err().to_string();
        assert!(err.contains("hidden_act `swiglu`"), "{err}");
        let err = serde_json::from_value::<Args>(json!({"hidden_size": 32})).unwrap_err();
        assert!(err.to_string().contains("num_hidden_layers"), "{err}");
    }
}
