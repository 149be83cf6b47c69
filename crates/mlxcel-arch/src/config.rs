//! `config.json` sanitising: real checkpoints spell the same facts in several ways (hub
//! checkpoints: `rope_theta`, `rope_scaling`, `num_experts`, `torch_dtype`; transformers 5:
//! `rope_parameters`, `num_local_experts`, `dtype`, tagged floats). [`sanitize_config_json`]
//! rewrites the raw JSON so that both spellings are present and every architecture's `ModelArgs`
//! can read the classic keys.

use serde_json::{Map, Value};

/// Normalises a raw `config.json` (see the module docs). Applied before deserialising.
///
/// - tagged floats `{"__float__": "Infinity"}` become numbers (`±f64::MAX` for infinities;
///   NaN stays the string `"NaN"`, which validation refuses where a number is needed);
/// - keys whose value is `null` are removed, so architecture defaults apply;
/// - `rope_parameters` (flat, or per layer type `{"full_attention": .., "sliding_attention": ..}`)
///   fills in `rope_theta`, `rope_scaling` (when not the default rope), `rope_local_base_freq`
///   and `partial_rotary_factor`, unless the classic keys are present;
/// - `num_local_experts` and `num_experts`, `dtype` and `torch_dtype` fill each other in.
///
/// Nested `text_config` objects are sanitised the same way.
///
/// ```
/// use mlxcel_arch::config::sanitize_config_json;
/// use serde_json::json;
///
/// // A transformers 5 config: rope in `rope_parameters`, a null key, `dtype`.
/// let raw = json!({
///     "model_type": "llama",
///     "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0},
///     "sliding_window": null,
///     "dtype": "bfloat16",
/// });
/// let config = sanitize_config_json(raw);
/// assert_eq!(config["rope_theta"], 500000.0);
/// assert_eq!(config["rope_scaling"]["rope_type"], "llama3");
/// assert_eq!(config["rope_scaling"]["factor"], 8.0);
/// assert!(config.get("sliding_window").is_none()); // the architecture default applies
/// assert_eq!(config["torch_dtype"], "bfloat16");
/// ```
pub fn sanitize_config_json(mut config: Value) -> Value {
    untag_floats(&mut config);
    if let Value::Object(obj) = &mut config {
        sanitize_object(obj);
        if let Some(Value::Object(text)) = obj.get_mut("text_config") {
            sanitize_object(text);
        }
    }
    config
}

fn untag_floats(value: &mut Value) {
    match value {
        Value::Object(obj) => {
            if obj.len() == 1 {
                if let Some(Value::String(tag)) = obj.get("__float__") {
                    *value = match tag.as_str() {
                        "Infinity" | "inf" => Value::from(f64::MAX),
                        "-Infinity" | "-inf" => Value::from(f64::MIN),
                        // NaN (and an unreadable tag) stays a string: a key that must be a
                        // number then fails validation naming it, instead of silently taking
                        // its default.
                        other => other
                            .parse::<f64>()
                            .ok()
                            .filter(|v| v.is_finite())
                            .map(Value::from)
                            .unwrap_or_else(|| Value::String(other.to_string())),
                    };
                    return;
                }
            }
            obj.values_mut().for_each(untag_floats);
        }
        Value::Array(items) => items.iter_mut().for_each(untag_floats),
        _ => {}
    }
}

fn fill(obj: &mut Map<String, Value>, key: &str, value: Option<Value>) {
    if let Some(v) = value {
        if !v.is_null() && !obj.contains_key(key) {
            obj.insert(key.to_string(), v);
        }
    }
}

fn sanitize_object(obj: &mut Map<String, Value>) {
    obj.retain(|_, v| !v.is_null());
    if let Some(Value::Object(rope)) = obj.get("rope_parameters").cloned() {
        let per_layer =
            rope.contains_key("full_attention") || rope.contains_key("sliding_attention");
        let (global, local) = if per_layer {
            (
                rope.get("full_attention")
                    .and_then(Value::as_object)
                    .cloned(),
                rope.get("sliding_attention")
                    .and_then(Value::as_object)
                    .cloned(),
            )
        } else {
            (Some(rope.clone()), None)
        };
        if let Some(g) = global {
            fill(obj, "rope_theta", g.get("rope_theta").cloned());
            fill(
                obj,
                "partial_rotary_factor",
                g.get("partial_rotary_factor").cloned(),
            );
            let kind = g
                .get("rope_type")
                .or_else(|| g.get("type"))
                .and_then(Value::as_str);
            if kind.is_some_and(|k| k != "default") {
                let mut scaling = g.clone();
                scaling.remove("rope_theta");
                scaling.remove("partial_rotary_factor");
                if let Some(k) = kind {
                    scaling.insert("type".into(), Value::from(k));
                    scaling.insert("rope_type".into(), Value::from(k));
                }
                fill(obj, "rope_scaling", Some(Value::Object(scaling)));
            }
        }
        if let Some(l) = local {
            fill(obj, "rope_local_base_freq", l.get("rope_theta").cloned());
        }
    }
    // Classic `rope_scaling` with only `rope_type` (or only `type`): give it both spellings.
    if let Some(Value::Object(scaling)) = obj.get_mut("rope_scaling") {
        let kind = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .cloned();
        if let Some(k) = kind {
            scaling.entry("type").or_insert_with(|| k.clone());
            scaling.entry("rope_type").or_insert(k);
        }
    }
    let experts = obj
        .get("num_experts")
        .or_else(|| obj.get("num_local_experts"))
        .cloned();
    fill(obj, "num_experts", experts.clone());
    fill(obj, "num_local_experts", experts);
    let dtype = obj.get("torch_dtype").or_else(|| obj.get("dtype")).cloned();
    fill(obj, "torch_dtype", dtype.clone());
    fill(obj, "dtype", dtype);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn both_key_styles_end_up_present() {
        let v5 = json!({
            "model_type": "llama", "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0},
            "num_local_experts": 8, "dtype": "bfloat16", "head_dim": null,
            "final_logit_softcapping": {"__float__": "Infinity"}
        });
        let s = sanitize_config_json(v5);
        assert_eq!(s["rope_theta"], json!(500000.0));
        assert_eq!(s["rope_scaling"]["type"], json!("llama3"));
        assert_eq!(s["rope_scaling"]["factor"], json!(8.0));
        assert_eq!(s["num_experts"], json!(8));
        assert_eq!(s["torch_dtype"], json!("bfloat16"));
        assert!(s.get("head_dim").is_none(), "nulls removed");
        assert_eq!(s["final_logit_softcapping"], json!(f64::MAX));

        let hub = json!({"rope_theta": 1e6, "rope_scaling": null, "torch_dtype": "float16", "num_experts": 4});
        let s = sanitize_config_json(hub);
        assert_eq!(s["rope_theta"], json!(1e6));
        assert!(s.get("rope_scaling").is_none());
        assert_eq!(s["dtype"], json!("float16"));
        assert_eq!(s["num_local_experts"], json!(4));

        // Classic keys win over rope_parameters when both are present.
        let both = json!({"rope_theta": 10.0, "rope_parameters": {"rope_theta": 20.0, "rope_type": "default"}});
        assert_eq!(sanitize_config_json(both)["rope_theta"], json!(10.0));

        let gemma3 = json!({"rope_parameters": {
            "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
            "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}});
        let s = sanitize_config_json(gemma3);
        assert_eq!(s["rope_theta"], json!(1e6));
        assert_eq!(s["rope_local_base_freq"], json!(1e4));
        assert_eq!(s["rope_scaling"]["type"], json!("linear"));
    }
}
