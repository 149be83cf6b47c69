//! The `Nonstandard` directory route: model families whose folders do not fit the
//! config-backed pattern, each with a named loader of its own (see the seed's loading spec).
//! Today these are the state-space and hybrid families, whose configs come in more than one
//! spelling and whose layers keep recurrent state instead of keys and values:
//!
//! - Mamba and Falcon-Mamba (one [`ModelType::Mamba`]) by [`load_mamba`];
//! - Mamba-2 by [`load_mamba2`];
//! - Jamba (attention and Mamba layers interleaved, MoE on some) by [`load_jamba`];
//! - Bamba (Mamba-2 layers with a few attention layers) by [`load_bamba`];
//! - Qwen3-Next (gated DeltaNet linear attention with gated full attention every few layers,
//!   MoE with a shared expert) by [`load_qwen3_next`];
//! - Qwen3.5 and Qwen3.5-MoE (the same hybrid; their vision-language configs and checkpoints
//!   read for the text decoder) by [`load_qwen3_5`];
//! - RWKV-7 (attention-free; fla-hub's and mlx-lm's layouts) by [`load_rwkv7`];
//! - Gemma 3n (`gemma3n_text`, and the text decoder of a `gemma3n` checkpoint loaded text only)
//!   by [`load_gemma3n`].
//! - Nemotron-H (single-branch layers: Mamba-2, attention, relu² MLP or MoE) by
//!   [`load_nemotron_h`];
//! - RecurrentGemma (Griffin's RG-LRU layers with local attention) by
//!   [`load_recurrent_gemma`];
//! - Falcon-H1 (attention and Mamba-2 side by side in every layer, muP multipliers) by
//!   [`load_falcon_h1`].
//!
//! Each loader normalises its family's config, then builds through
//! [`crate::registry::build_architecture`] (the architecture's sanitiser, the load-time weight
//! transform, unused-tensor check and materialisation, as for every other model).

use mlxcel_core::WeightMap;
use serde_json::{Map, Value};

use crate::models::{
    bamba, falcon_h1, gemma3n, jamba, mamba, mamba2, nemotron_h, qwen3_5, qwen3_next,
    recurrent_gemma, rwkv7,
};
use crate::registry::{build_architecture, BuildOptions, GenerationModel, LoadedModel};
use crate::{ModelError, ModelType, Result};

/// Builds `model_type` (whose registry row routes it here) with its family's named loader.
pub fn load_nonstandard(
    model_type: ModelType,
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    match model_type {
        ModelType::Mamba => load_mamba(config, weights, options),
        ModelType::Mamba2 => load_mamba2(config, weights, options),
        ModelType::Jamba => load_jamba(config, weights, options),
        ModelType::Bamba => load_bamba(config, weights, options),
        ModelType::Qwen3Next => load_qwen3_next(config, weights, options),
        ModelType::Qwen3_5 => load_qwen3_5(config, weights, options),
        ModelType::Rwkv7 => load_rwkv7(config, weights, options),
        ModelType::Gemma3n => load_gemma3n(config, weights, options),
        ModelType::NemotronH => load_nemotron_h(config, weights, options),
        ModelType::RecurrentGemma => load_recurrent_gemma(config, weights, options),
        ModelType::FalconH1 => load_falcon_h1(config, weights, options),
        other => Err(ModelError::Unsupported(format!(
            "{} has no loader on the Nonstandard route",
            other.name()
        ))),
    }
}

/// The original `state-spaces/mamba` config keys (`d_model`, `n_layer`, `ssm_cfg`,
/// `pad_vocab_size_multiple`, as mlx-lm also accepts them) rewritten as transformers' ones; a
/// config already in transformers' spelling is returned as is.
pub fn mamba_config(config: &Value) -> Result<Value> {
    let Some(obj) = config.as_object() else {
        return Err(ModelError::Config("config.json is not an object".into()));
    };
    if obj.contains_key("hidden_size") || !obj.contains_key("d_model") {
        return Ok(config.clone());
    }
    let mut out: Map<String, Value> = obj.clone();
    for (from, to) in [
        ("d_model", "hidden_size"),
        ("n_layer", "num_hidden_layers"),
        ("tie_embeddings", "tie_word_embeddings"),
    ] {
        if let Some(v) = out.remove(from) {
            out.entry(to.to_string()).or_insert(v);
        }
    }
    if let Some(Value::Object(ssm)) = out.remove("ssm_cfg") {
        for (from, to) in [
            ("d_state", "state_size"),
            ("d_conv", "conv_kernel"),
            ("expand", "expand"),
            ("dt_rank", "time_step_rank"),
            ("conv_bias", "use_conv_bias"),
            ("bias", "use_bias"),
        ] {
            if let Some(v) = ssm.get(from) {
                out.entry(to.to_string()).or_insert(v.clone());
            }
        }
    }
    // The embedding table is padded to a multiple of `pad_vocab_size_multiple`.
    if let (Some(vocab), Some(multiple)) = (
        out.get("vocab_size").and_then(Value::as_u64),
        out.get("pad_vocab_size_multiple").and_then(Value::as_u64),
    ) {
        if multiple > 0 {
            let padded = vocab.div_ceil(multiple) * multiple;
            out.insert("vocab_size".into(), Value::from(padded));
        }
    }
    Ok(Value::Object(out))
}

/// Mamba and Falcon-Mamba (Falcon-Mamba's dt/B/C norms come from its config), from either
/// config spelling ([`mamba_config`]).
pub fn load_mamba(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    let config = mamba_config(config)?;
    let model = build_architecture::<mamba::Model>("Mamba", &config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::Mamba(Box::new(
        model,
    ))))
}

/// Mamba-2.
pub fn load_mamba2(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    let model = build_architecture::<mamba2::Model>("Mamba2", config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::Mamba2(Box::new(
        model,
    ))))
}

/// Jamba.
pub fn load_jamba(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    let model = build_architecture::<jamba::Model>("Jamba", config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::Jamba(Box::new(
        model,
    ))))
}

/// Bamba.
pub fn load_bamba(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    let model = build_architecture::<bamba::Model>("Bamba", config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::Bamba(Box::new(
        model,
    ))))
}

/// Qwen3-Next, from transformers' checkpoints (zero-centred norms, per-expert tensors) or
/// mlx-lm's conversions (see [`qwen3_next`]).
pub fn load_qwen3_next(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    let model = build_architecture::<qwen3_next::Model>("Qwen3Next", config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::Qwen3Next(
        Box::new(model),
    )))
}

/// The text config of a Qwen3.5 checkpoint (see [`text_config`]).
pub fn qwen3_5_text_config(config: &Value) -> Result<Value> {
    text_config(config)
}

/// The text config of a checkpoint that may be a multimodal one: its `text_config` (with the
/// top level's `tie_word_embeddings` where the text config lacks it, normalised like any
/// config.json), or a text-only config as it is.
pub fn text_config(config: &Value) -> Result<Value> {
    let Some(obj) = config.as_object() else {
        return Err(ModelError::Config("config.json is not an object".into()));
    };
    let Some(text) = obj.get("text_config") else {
        return Ok(config.clone());
    };
    let Some(text) = text.as_object() else {
        return Err(ModelError::Config("text_config is not an object".into()));
    };
    let mut out: Map<String, Value> = text.clone();
    if let Some(tie) = obj.get("tie_word_embeddings") {
        out.entry("tie_word_embeddings").or_insert(tie.clone());
    }
    Ok(crate::config::sanitize_config_json(Value::Object(out)))
}

/// Qwen3.5 and Qwen3.5-MoE text decoders, from text-only or vision-language checkpoints (see
/// [`qwen3_5`]).
pub fn load_qwen3_5(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    let config = qwen3_5_text_config(config)?;
    let model = build_architecture::<qwen3_5::Model>("Qwen3_5", &config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::Qwen3_5(Box::new(
        model,
    ))))
}

/// RWKV-7, from fla-hub's layout or mlx-lm's (see [`rwkv7`]).
pub fn load_rwkv7(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    let model = build_architecture::<rwkv7::Model>("Rwkv7", config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::Rwkv7(Box::new(
        model,
    ))))
}

/// Gemma 3n's text decoder, from a `gemma3n_text` config or a `gemma3n` one's `text_config`
/// (see [`gemma3n`]); a full checkpoint's vision and audio towers are left out. The model
/// records that it was loaded without them ([`gemma3n::Model`] has no tower to take an image).
pub fn load_gemma3n(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    // `gemma3n::Args` reads a multimodal config's `text_config` itself.
    let model = build_architecture::<gemma3n::Model>("Gemma3n", config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::Gemma3n(Box::new(
        model,
    ))))
}

/// Nemotron-H, from transformers' `layers_block_type` configs or the older
/// `hybrid_override_pattern` ones (see [`nemotron_h`]).
pub fn load_nemotron_h(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    let model = build_architecture::<nemotron_h::Model>("NemotronH", config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::NemotronH(
        Box::new(model),
    )))
}

/// RecurrentGemma (Griffin), as transformers and mlx-lm store it (see [`recurrent_gemma`]).
pub fn load_recurrent_gemma(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    let model =
        build_architecture::<recurrent_gemma::Model>("RecurrentGemma", config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::RecurrentGemma(
        Box::new(model),
    )))
}

/// Falcon-H1, from transformers' layout or mlx-lm's folded one (see [`falcon_h1`]).
pub fn load_falcon_h1(
    config: &Value,
    weights: WeightMap,
    options: &BuildOptions,
) -> Result<LoadedModel> {
    let model = build_architecture::<falcon_h1::Model>("FalconH1", config, weights, options)?;
    Ok(LoadedModel::Generation(GenerationModel::FalconH1(
        Box::new(model),
    )))
}
