//! `config.json` validation: every number an architecture reads is checked for type and range
//! before use, so a bad checkpoint fails with an error naming the key and its value
//! (`config.json: rms_norm_eps = 0: must be positive and finite`) instead of a crash or a
//! silently wrong model. [`validate_config`] runs in the generated loader for every
//! architecture (see `registry::parse_args`); architectures add their own checks in `spec()`.

use serde_json::{Map, Value};

use crate::{ModelError, Result};

/// What a key's value must be.
#[derive(Debug, Clone, Copy)]
enum Rule {
    /// An integer in `1..=max`.
    PosInt(u64),
    /// An integer in `0..=max`.
    NonNegInt(u64),
    /// A finite number `> 0` (representable as a positive `f32` when `f32` is set).
    PosFloat { f32: bool },
    /// A finite number.
    Finite,
    /// A finite non-zero number.
    NonZero,
    /// A number in `(0, 1]`.
    Unit,
    /// `true` or `false`.
    Bool,
    /// A string.
    Str,
    /// A list of strings.
    StrList,
    /// A list of non-negative integers.
    IntList,
    /// An integer in `1..=max`, or a list of them (a per-layer value, Hunyuan).
    PosIntOrList(u64),
}

const DIM: u64 = 1 << 24;
const HEADS: u64 = 1 << 16;
const LAYERS: u64 = 1 << 16;
const I32: u64 = i32::MAX as u64;

/// Top-level keys and their rules (absent keys are not checked here: the architecture's
/// defaults or its "missing field" error apply).
const RULES: &[(&str, Rule)] = &[
    ("hidden_size", Rule::PosInt(DIM)),
    ("num_hidden_layers", Rule::PosInt(LAYERS)),
    ("num_attention_heads", Rule::PosInt(HEADS)),
    ("num_key_value_heads", Rule::PosInt(HEADS)),
    ("head_dim", Rule::PosInt(HEADS)),
    // One per layer in Gemma 3n's configs.
    ("intermediate_size", Rule::PosIntOrList(DIM)),
    ("moe_intermediate_size", Rule::PosIntOrList(DIM)),
    ("moe_topk", Rule::PosIntOrList(HEADS)),
    ("num_shared_expert", Rule::PosIntOrList(HEADS)),
    ("shared_expert_intermediate_size", Rule::PosInt(DIM)),
    ("vocab_size", Rule::PosInt(I32)),
    ("max_position_embeddings", Rule::PosInt(I32)),
    ("original_max_position_embeddings", Rule::PosInt(I32)),
    ("sliding_window", Rule::NonNegInt(I32)),
    ("num_local_experts", Rule::PosInt(HEADS)),
    ("num_experts", Rule::PosInt(HEADS)),
    ("n_routed_experts", Rule::PosInt(HEADS)),
    ("num_experts_per_tok", Rule::PosInt(HEADS)),
    ("n_shared_experts", Rule::NonNegInt(HEADS)),
    ("decoder_sparse_step", Rule::PosInt(LAYERS)),
    ("moe_layer_freq", Rule::PosInt(LAYERS)),
    ("first_k_dense_replace", Rule::NonNegInt(LAYERS)),
    ("mlp_only_layers", Rule::IntList),
    ("kv_lora_rank", Rule::PosInt(DIM)),
    ("q_lora_rank", Rule::PosInt(DIM)),
    ("qk_nope_head_dim", Rule::PosInt(HEADS)),
    ("qk_rope_head_dim", Rule::PosInt(HEADS)),
    ("v_head_dim", Rule::PosInt(HEADS)),
    ("n_group", Rule::PosInt(HEADS)),
    ("topk_group", Rule::PosInt(HEADS)),
    ("rms_norm_eps", Rule::PosFloat { f32: true }),
    ("layer_norm_eps", Rule::PosFloat { f32: true }),
    ("layer_norm_epsilon", Rule::PosFloat { f32: true }),
    ("norm_epsilon", Rule::PosFloat { f32: true }),
    ("norm_eps", Rule::PosFloat { f32: true }),
    ("rope_theta", Rule::PosFloat { f32: false }),
    ("rope_local_base_freq", Rule::PosFloat { f32: false }),
    ("partial_rotary_factor", Rule::Unit),
    ("attn_logit_softcapping", Rule::PosFloat { f32: true }),
    ("final_logit_softcapping", Rule::PosFloat { f32: false }),
    ("query_pre_attn_scalar", Rule::PosFloat { f32: true }),
    ("routed_scaling_factor", Rule::PosFloat { f32: true }),
    ("embedding_multiplier", Rule::Finite),
    ("residual_multiplier", Rule::Finite),
    ("attention_multiplier", Rule::Finite),
    ("logit_scale", Rule::Finite),
    ("logits_scaling", Rule::NonZero),
    ("tie_word_embeddings", Rule::Bool),
    ("attention_bias", Rule::Bool),
    ("mlp_bias", Rule::Bool),
    ("use_bias", Rule::Bool),
    ("use_qk_norm", Rule::Bool),
    ("norm_topk_prob", Rule::Bool),
    ("rope_interleave", Rule::Bool),
    ("hidden_act", Rule::Str),
    ("hidden_activation", Rule::Str),
    ("topk_method", Rule::Str),
    ("layer_types", Rule::StrList),
];

/// Rules for the numbers of `rope_scaling` (and `rope_parameters`).
const ROPE_RULES: &[(&str, Rule)] = &[
    ("factor", Rule::PosFloat { f32: false }),
    ("rope_theta", Rule::PosFloat { f32: false }),
    ("partial_rotary_factor", Rule::Unit),
    ("original_max_position_embeddings", Rule::PosInt(I32)),
    ("low_freq_factor", Rule::PosFloat { f32: false }),
    ("high_freq_factor", Rule::PosFloat { f32: false }),
    ("beta_fast", Rule::Finite),
    ("beta_slow", Rule::Finite),
    ("mscale", Rule::Finite),
    ("mscale_all_dim", Rule::Finite),
    ("attention_factor", Rule::Finite),
    ("extrapolation_factor", Rule::Finite),
    ("rope_type", Rule::Str),
    ("type", Rule::Str),
];

fn err(key: &str, value: &Value, what: &str) -> ModelError {
    ModelError::Config(format!("{key} = {value}: {what}"))
}

fn check(key: &str, value: &Value, rule: Rule) -> Result<()> {
    let int = |min: u64, max: u64| -> Result<()> {
        let what = if min == 0 {
            "must be a non-negative integer"
        } else {
            "must be a positive integer"
        };
        match value {
            Value::Number(n) => match n.as_u64() {
                Some(v) if v >= min && v <= max => Ok(()),
                Some(v) if v >= min => Err(err(key, value, &format!("must be at most {max}"))),
                _ => Err(err(key, value, what)),
            },
            _ => Err(err(key, value, &format!("wrong type: {what}"))),
        }
    };
    let number = || -> Result<f64> {
        value
            .as_f64()
            .ok_or_else(|| err(key, value, "wrong type: must be a number"))
    };
    match rule {
        Rule::PosInt(max) => int(1, max),
        Rule::NonNegInt(max) => int(0, max),
        Rule::PosFloat { f32 } => {
            let v = number()?;
            // f64::MAX stands for a tagged `Infinity` after sanitising.
            let finite = v.is_finite() && v.abs() < f64::MAX;
            let fits = !f32 || ((v as f32) > 0.0 && (v as f32).is_finite());
            if finite && v > 0.0 && fits {
                Ok(())
            } else {
                Err(err(key, value, "must be positive and finite"))
            }
        }
        Rule::Finite => {
            let v = number()?;
            if v.is_finite() && v.abs() < f64::MAX {
                Ok(())
            } else {
                Err(err(key, value, "must be finite"))
            }
        }
        Rule::NonZero => {
            let v = number()?;
            if v.is_finite() && v.abs() < f64::MAX && v != 0.0 {
                Ok(())
            } else {
                Err(err(key, value, "must be finite and non-zero"))
            }
        }
        Rule::Unit => {
            let v = number()?;
            if v > 0.0 && v <= 1.0 {
                Ok(())
            } else {
                Err(err(key, value, "must be in (0, 1]"))
            }
        }
        Rule::Bool => match value {
            Value::Bool(_) => Ok(()),
            _ => Err(err(key, value, "wrong type: must be true or false")),
        },
        Rule::Str => match value {
            Value::String(_) => Ok(()),
            _ => Err(err(key, value, "wrong type: must be a string")),
        },
        Rule::StrList => match value {
            Value::Array(items) if items.iter().all(Value::is_string) => Ok(()),
            _ => Err(err(key, value, "wrong type: must be a list of strings")),
        },
        Rule::PosIntOrList(max) => match value {
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    check(&format!("{key}[{i}]"), item, Rule::PosInt(max))?;
                }
                Ok(())
            }
            _ => int(1, max),
        },
        Rule::IntList => match value {
            Value::Array(items) if items.iter().all(|v| v.as_u64().is_some()) => Ok(()),
            _ => Err(err(
                key,
                value,
                "wrong type: must be a list of non-negative integers",
            )),
        },
    }
}

fn apply(obj: &Map<String, Value>, prefix: &str, rules: &[(&str, Rule)]) -> Result<()> {
    for (key, rule) in rules {
        if let Some(value) = obj.get(*key) {
            if value.is_null() {
                continue;
            }
            check(&format!("{prefix}{key}"), value, *rule)?;
        }
    }
    Ok(())
}

fn int(obj: &Map<String, Value>, key: &str) -> Option<u64> {
    obj.get(key).and_then(Value::as_u64)
}

/// The rope-scaling block `name` (its numbers, and llama3's frequency band).
fn check_rope_block(name: &str, block: &Map<String, Value>) -> Result<()> {
    apply(block, &format!("{name}."), ROPE_RULES)?;
    for key in ["long_factor", "short_factor"] {
        if let Some(v) = block.get(key) {
            let ok = match v {
                Value::Array(items) => items
                    .iter()
                    .all(|x| x.as_f64().is_some_and(|f| f.is_finite() && f > 0.0)),
                _ => false,
            };
            if !ok {
                return Err(err(
                    &format!("{name}.{key}"),
                    v,
                    "must be a list of positive finite numbers",
                ));
            }
        }
    }
    let low = block.get("low_freq_factor").and_then(Value::as_f64);
    let high = block.get("high_freq_factor").and_then(Value::as_f64);
    if let (Some(low), Some(high)) = (low, high) {
        if high <= low {
            return Err(ModelError::Config(format!(
                "{name}.high_freq_factor = {high}: must be greater than low_freq_factor = {low}"
            )));
        }
    }
    Ok(())
}

/// Checks the types and ranges of every known key of a sanitised `config.json` object, and the
/// relations between them (kv heads divide heads, experts per token ≤ experts, ...).
pub fn validate_config(config: &Value) -> Result<()> {
    let obj = config
        .as_object()
        .ok_or_else(|| ModelError::Config("expected a JSON object".into()))?;
    if let Some(t) = obj.get("model_type") {
        if !t.is_string() {
            return Err(err("model_type", t, "wrong type: must be a string"));
        }
    }
    apply(obj, "", RULES)?;
    for name in ["rope_scaling", "rope_parameters"] {
        match obj.get(name) {
            None | Some(Value::Null) => {}
            Some(Value::Object(block)) => {
                check_rope_block(name, block)?;
                for (sub, v) in block {
                    if let Value::Object(inner) = v {
                        check_rope_block(&format!("{name}.{sub}"), inner)?;
                    }
                }
            }
            Some(other) => return Err(err(name, other, "wrong type: must be an object")),
        }
    }
    if let (Some(heads), Some(kv)) = (
        int(obj, "num_attention_heads"),
        int(obj, "num_key_value_heads"),
    ) {
        if heads % kv != 0 {
            return Err(ModelError::Config(format!(
                "num_key_value_heads = {kv}: must divide num_attention_heads = {heads}"
            )));
        }
    }
    if let (Some(hidden), Some(heads)) = (int(obj, "hidden_size"), int(obj, "num_attention_heads"))
    {
        match int(obj, "head_dim") {
            Some(head_dim) => {
                if heads * head_dim > DIM {
                    return Err(ModelError::Config(format!(
                        "num_attention_heads × head_dim = {heads} × {head_dim}: must be at most {DIM}"
                    )));
                }
            }
            None => {
                if hidden % heads != 0 && !obj.contains_key("kv_lora_rank") {
                    return Err(ModelError::Config(format!(
                        "hidden_size = {hidden}: must be divisible by num_attention_heads = {heads} (or set head_dim)"
                    )));
                }
            }
        }
    }
    let experts = int(obj, "num_experts").or_else(|| int(obj, "n_routed_experts"));
    if let (Some(experts), Some(k)) = (experts, int(obj, "num_experts_per_tok")) {
        if k > experts {
            return Err(ModelError::Config(format!(
                "num_experts_per_tok = {k}: must be at most the number of experts ({experts})"
            )));
        }
    }
    if let Some(experts) = int(obj, "n_routed_experts") {
        let groups = int(obj, "n_group").unwrap_or(1);
        let keep = int(obj, "topk_group").unwrap_or(1);
        if experts % groups != 0 {
            return Err(ModelError::Config(format!(
                "n_group = {groups}: must divide n_routed_experts = {experts}"
            )));
        }
        if keep > groups {
            return Err(ModelError::Config(format!(
                "topk_group = {keep}: must be at most n_group = {groups}"
            )));
        }
        if let Some(k) = int(obj, "num_experts_per_tok") {
            if k > keep * (experts / groups) {
                return Err(ModelError::Config(format!(
                    "num_experts_per_tok = {k}: more than the {} experts of topk_group = {keep} groups",
                    keep * (experts / groups)
                )));
            }
        }
    }
    if let Some(pattern) = obj.get("sliding_window_pattern") {
        let ok = match pattern {
            Value::Number(n) => n.as_u64().is_some_and(|p| p > 0),
            Value::String(s) => !s.is_empty() && s.chars().all(|c| c == 'L' || c == 'G'),
            _ => false,
        };
        if !ok {
            return Err(err(
                "sliding_window_pattern",
                pattern,
                "must be a positive integer or a string of L and G",
            ));
        }
    }
    Ok(())
}

/// Names the key of `config` at fault in a deserialisation error `error` (serde's messages for
/// flattened structs often lack it): the key whose removal changes the outcome.
pub fn locate_serde_error<A: serde::de::DeserializeOwned>(config: &Value, error: &str) -> String {
    if error.starts_with("missing field") {
        return error.to_string();
    }
    if let Value::Object(obj) = config {
        for (key, value) in obj {
            let mut without = obj.clone();
            without.remove(key);
            let outcome =
                serde_json::from_value::<A>(Value::Object(without)).map_err(|e| e.to_string());
            if outcome.as_ref().err().map(String::as_str) != Some(error) {
                let shown: String = value.to_string().chars().take(80).collect();
                return format!("{key} = {shown}: {error}");
            }
        }
    }
    error.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
               "intermediate_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0})
    }

    fn with(key: &str, value: Value) -> String {
        let mut c = base();
        c[key] = value;
        match validate_config(&c) {
            Ok(()) => String::new(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn bad_values_name_the_key() {
        assert_eq!(validate_config(&base()).ok(), Some(()));
        assert_eq!(
            with("rms_norm_eps", json!(0)),
            "config.json: rms_norm_eps = 0: must be positive and finite"
        );
        assert!(with("rms_norm_eps", json!(1e-300)).contains("rms_norm_eps"));
        assert!(with("rope_theta", json!(-1.0)).contains("rope_theta = -1.0"));
        assert!(with("hidden_size", json!("64")).contains("hidden_size = \"64\": wrong type"));
        assert!(with("num_key_value_heads", json!(3)).contains("must divide"));
        assert!(with("num_key_value_heads", json!(0)).contains("num_key_value_heads = 0"));
        assert!(with("vocab_size", json!(0)).contains("vocab_size = 0"));
        assert!(with("num_hidden_layers", json!(1u64 << 40)).contains("at most"));
        assert!(with("partial_rotary_factor", json!(1.5)).contains("(0, 1]"));
        assert!(with("model_type", json!(42)).contains("model_type = 42: wrong type"));
        assert!(
            with("rope_scaling", json!({"type": "linear", "factor": 0.0}))
                .contains("rope_scaling.factor = 0.0")
        );
        assert!(with("final_logit_softcapping", json!(f64::MAX)).contains("finite"));
        let mut c = base();
        c["num_experts"] = json!(4);
        c["num_experts_per_tok"] = json!(5);
        assert!(validate_config(&c)
            .unwrap_err()
            .to_string()
            .contains("num_experts_per_tok = 5"));
    }
}
