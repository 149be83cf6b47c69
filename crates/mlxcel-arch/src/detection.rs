//! Detection: from a sanitised `config.json` to the task kind and the registered [`ModelType`].
//! Nothing falls back to a default: an unknown or unsupported checkpoint is an error that says
//! what was found.

use serde_json::Value;

use crate::registry::{ModelKind, ModelType, DESCRIPTORS};
use crate::{ModelError, Result};

/// Encoder families whose checkpoints embed (or, with a classification head, rerank) text.
const ENCODER_TYPES: &[&str] = &[
    "bert",
    "xlm-roberta",
    "roberta",
    "modernbert",
    "nomic_bert",
    "distilbert",
    "electra",
];

/// Model types whose configs can describe a vision-language model.
const VLM_TYPES: &[&str] = &[
    "gemma3",
    "qwen2_vl",
    "qwen2_5_vl",
    "llava",
    "mistral3",
    "idefics3",
    "smolvlm",
    "paligemma",
    "mllama",
];

fn architectures(config: &Value) -> Vec<&str> {
    config
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// Which task a checkpoint serves. `has_sentence_transformers_modules` is whether the folder
/// holds a sentence-transformers `modules.json`.
pub fn detect_kind(config: &Value, has_sentence_transformers_modules: bool) -> ModelKind {
    let archs = architectures(config);
    if archs
        .iter()
        .any(|a| a.ends_with("ForSequenceClassification"))
    {
        return ModelKind::Reranker;
    }
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("");
    // A sentence-transformers folder embeds even when its config names a causal LM
    // (Qwen3-Embedding keeps `Qwen3ForCausalLM`); so does a decoder configured bidirectional
    // (EmbeddingGemma's `use_bidirectional_attention`).
    let bidirectional = config
        .get("use_bidirectional_attention")
        .and_then(Value::as_bool)
        == Some(true);
    if ENCODER_TYPES.contains(&model_type) || has_sentence_transformers_modules || bidirectional {
        return ModelKind::Embedding;
    }
    ModelKind::Generation
}

/// Whether a config of a VLM-capable type is really text-only: `language_model_only: true`
/// (wins even when vision weights are present), `vision_config` absent, null or empty, or no
/// vision-tower tensors in the checkpoint.
pub fn is_text_only(config: &Value, has_vision_weights: bool) -> bool {
    if config.get("language_model_only").and_then(Value::as_bool) == Some(true) {
        return true;
    }
    let no_vision_config = match config.get("vision_config") {
        None | Some(Value::Null) => true,
        Some(Value::Object(o)) => o.is_empty(),
        Some(_) => false,
    };
    no_vision_config || !has_vision_weights
}

/// Maps the config of a cross-encoder (kind `Reranker`, see [`detect_kind`]) to its registered
/// type, by the `*ForSequenceClassification` entry of `architectures` (a cross-encoder shares its
/// backbone's `model_type`). An architecture without a reranker row is refused naming it.
pub fn get_reranker_type(config: &Value) -> Result<ModelType> {
    let archs = architectures(config);
    let Some(arch) = archs
        .iter()
        .find(|a| a.ends_with("ForSequenceClassification"))
    else {
        return Err(ModelError::Unsupported(format!(
            "architectures = {archs:?}: not a cross-encoder (no `*ForSequenceClassification` entry)"
        )));
    };
    match ModelType::from_model_type(arch) {
        Some(t) if t.descriptor().kind == ModelKind::Reranker => Ok(t),
        _ => {
            let supported: Vec<&str> = DESCRIPTORS
                .iter()
                .filter(|d| d.kind == ModelKind::Reranker)
                .flat_map(|d| d.names.iter().copied())
                .collect();
            Err(ModelError::Unsupported(format!(
                "architecture `{arch}` is not a supported reranker (supported: {})",
                supported.join(", ")
            )))
        }
    }
}

/// Maps `config.json` to a registered model type.
pub fn get_model_type(config: &Value, has_vision_weights: bool) -> Result<ModelType> {
    let model_type = match config.get("model_type") {
        Some(Value::String(t)) => t.as_str(),
        Some(other) => {
            return Err(ModelError::Config(format!(
                "model_type = {other}: wrong type: must be a string"
            )))
        }
        None => return Err(ModelError::Config("missing field `model_type`".into())),
    };
    if let Some(t) = ModelType::from_model_type(model_type) {
        return Ok(t);
    }
    if VLM_TYPES.contains(&model_type) {
        let what = if is_text_only(config, has_vision_weights) {
            "its text-only form (nested `text_config`, `language_model.*` weights)"
        } else {
            "vision-language checkpoints"
        };
        return Err(ModelError::Unsupported(format!(
            "model_type `{model_type}`: {what} are not supported yet"
        )));
    }
    if model_type == "hunyuan" {
        // The older `hunyuan` type names both variants: MoE when it has more than one expert
        // (`num_experts` a number, or a per-layer list), else dense.
        let moe = match config.get("num_experts") {
            None => false,
            Some(Value::Array(per_layer)) => per_layer.iter().any(|e| e.as_i64() > Some(1)),
            Some(n) => match n.as_i64() {
                Some(n) => n > 1,
                None => {
                    return Err(ModelError::Config(format!(
                        "num_experts = {n}: wrong type: must be an integer"
                    )))
                }
            },
        };
        return Ok(if moe {
            ModelType::HunyuanMoe
        } else {
            ModelType::HunyuanDense
        });
    }
    let supported: Vec<&str> = DESCRIPTORS
        .iter()
        .flat_map(|d| d.names.iter().copied())
        .collect();
    Err(ModelError::Unsupported(format!(
        "model_type `{model_type}` is not a supported architecture (supported: {})",
        supported.join(", ")
    )))
}
