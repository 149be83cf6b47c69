//! The special detection and routing cases of the seed: Mistral 3's `Mistral3Dynamic` route (the
//! nested `text_config.model_type` picks the Ministral 3 tower or the Llama fallback; vision
//! weights present or absent), Ministral 3's query scaling, and the text-only detection of
//! Gemma 3 configs (`vision_config: null`, `language_model_only`). Logit parity of the fixtures
//! themselves is in `parity.rs`.

use mlxcel_arch::detection::{get_model_type, is_text_only};
use mlxcel_arch::models::mistral3;
use mlxcel_arch::{DirectoryRoute, GenerationModel, ModelType};
use mlxcel_loading::{load_model, LoadOptions};
use mlxcel_tests::{
    copy_fixture, distance_to_reference, logits_for, max_abs_diff, model_dir, read_config,
    reference, write_config,
};
use serde_json::{json, Value};

fn options() -> LoadOptions {
    LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    }
}

#[test]
fn mistral3_routes_by_the_nested_text_config() {
    assert_eq!(
        ModelType::Mistral3.descriptor().directory_route,
        DirectoryRoute::Mistral3Dynamic
    );
    // With the vision tower and projector in the checkpoint: text_config.model_type ministral3,
    // and the Pixtral tower built (lazily; see mistral3_vl.rs).
    let loaded = load_model(model_dir("mistral3"), &options()).unwrap();
    assert_eq!(loaded.model_type, ModelType::Mistral3);
    assert!(
        matches!(&loaded.model, GenerationModel::Mistral3(m) if matches!(m.text_tower(), mistral3::Text::Ministral3(_)) && m.tower().is_some()),
        "text_config.model_type ministral3 builds the Ministral 3 tower"
    );
    assert!(
        loaded.surgery_applied.is_empty(),
        "{:?}",
        loaded.surgery_applied
    );
    // Loaded text-only (`language_model_only`), the left-out tensors are reported, not
    // refused as unexpected.
    let dir = copy_fixture("mistral3");
    let mut config = read_config(dir.path());
    config["language_model_only"] = json!(true);
    write_config(dir.path(), &config);
    let loaded = load_model(dir.path(), &options()).unwrap();
    assert!(
        matches!(&loaded.model, GenerationModel::Mistral3(m) if m.tower().is_none()),
        "language_model_only loads the text tower alone"
    );
    let report = loaded.surgery_applied.join("\n");
    assert!(
        report.contains("text-only load: 15 vision-tower and projector tensors left out"),
        "{report}"
    );

    // Without vision weights: text_config.model_type mistral falls back to Llama.
    let loaded = load_model(model_dir("mistral3-mistral-text"), &options()).unwrap();
    assert_eq!(loaded.model_type, ModelType::Mistral3);
    assert!(
        matches!(&loaded.model, GenerationModel::Mistral3(m) if matches!(m.text_tower(), mistral3::Text::Llama(_)) && m.tower().is_none()),
        "text_config.model_type mistral builds the Llama fallback"
    );
    assert!(
        loaded.surgery_applied.is_empty(),
        "{:?}",
        loaded.surgery_applied
    );
}

#[test]
fn mistral3_without_text_model_type_falls_back_to_llama() {
    // transformers' Mistral3Config defaults its text_config to MistralConfig.
    let dir = copy_fixture("mistral3-mistral-text");
    let mut config = read_config(dir.path());
    config["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("model_type");
    write_config(dir.path(), &config);
    let loaded = load_model(dir.path(), &options()).unwrap();
    let r = reference("mistral3-mistral-text");
    let ids: Vec<u32> = r.prompt_ids.clone();
    let (d, _) = max_abs_diff(&logits_for(&loaded.model, &ids), &r.logits);
    assert!(d < 1e-3, "fallback tower differs from the reference by {d}");
}

#[test]
fn mistral3_refuses_an_unknown_text_tower_naming_the_field() {
    let dir = copy_fixture("mistral3");
    let mut config = read_config(dir.path());
    config["text_config"]["model_type"] = json!("mistral4");
    write_config(dir.path(), &config);
    let err = load_model(dir.path(), &options()).unwrap_err().to_string();
    assert!(err.contains("text_config.model_type"), "{err}");
    assert!(err.contains("mistral4"), "{err}");
}

#[test]
fn mistral3_ties_the_head_by_the_outer_config_as_transformers_does() {
    // The fixture has no lm_head, `text_config.tie_word_embeddings: false` and no outer key
    // (transformers' default: true). transformers ties the head to the embeddings (its
    // reference, which parity.rs matches); mlx-lm 0.32.2 reads the text_config's false and
    // refuses the checkpoint ("Missing 1 parameters: language_model.lm_head.weight").
    let config = read_config(&model_dir("mistral3-mistral-text"));
    assert_eq!(config["text_config"]["tie_word_embeddings"], json!(false));
    assert_eq!(config["tie_word_embeddings"], json!(true));
    // An explicit outer `false` with no lm_head is a missing tensor, named.
    let dir = copy_fixture("mistral3-mistral-text");
    let mut config = read_config(dir.path());
    config["tie_word_embeddings"] = json!(false);
    write_config(dir.path(), &config);
    let err = load_model(dir.path(), &options()).unwrap_err().to_string();
    assert!(err.contains("lm_head.weight"), "{err}");
}

#[test]
fn ministral3_query_scaling_is_exercised_and_required() {
    // Without the scaling (beta 0) the fixture's logits move far off the reference: the
    // parity test's agreement depends on it.
    let dir = copy_fixture("ministral3");
    let mut config = read_config(dir.path());
    config["rope_parameters"]["llama_4_scaling_beta"] = json!(0.0);
    write_config(dir.path(), &config);
    let loaded = load_model(dir.path(), &options()).unwrap();
    let r = reference("ministral3");
    let (d, _) = max_abs_diff(&logits_for(&loaded.model, &r.prompt_ids), &r.logits);
    assert!(d > 0.05, "beta 0 changed the logits by only {d}");

    // Missing: an error naming the field.
    let mut config = read_config(&model_dir("ministral3"));
    config["rope_parameters"]
        .as_object_mut()
        .unwrap()
        .remove("llama_4_scaling_beta");
    write_config(dir.path(), &config);
    let err = load_model(dir.path(), &options()).unwrap_err().to_string();
    assert!(
        err.contains("rope_parameters.llama_4_scaling_beta"),
        "{err}"
    );
}

/// A Gemma 3 config as the hub ships it (google/gemma-3-4b-it, trimmed to the keys detection
/// reads and a few of the text tower's).
fn gemma3_hub_config() -> Value {
    json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "intermediate_size": 4304,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 16,
            "num_hidden_layers": 27,
            "patch_size": 14,
            "vision_use_head": false
        }
    })
}

#[test]
fn gemma3_text_only_detection() {
    let vlm = gemma3_hub_config();
    assert!(
        !is_text_only(&vlm, true),
        "a VLM config with vision weights"
    );
    assert!(is_text_only(&vlm, false), "vision weights absent");

    // `vision_config: null` (text-only exports): text-only even when tensors look visual.
    let mut null_vision = vlm.clone();
    null_vision["vision_config"] = Value::Null;
    assert!(is_text_only(&null_vision, true));
    let mut empty_vision = vlm.clone();
    empty_vision["vision_config"] = json!({});
    assert!(is_text_only(&empty_vision, true));

    // `language_model_only: true` wins even with a vision config and vision weights.
    let mut lm_only = vlm.clone();
    lm_only["language_model_only"] = json!(true);
    assert!(is_text_only(&lm_only, true));
    lm_only["language_model_only"] = json!(false);
    assert!(!is_text_only(&lm_only, true));

    // Both forms map to the Gemma3 row (the `Vlm` route), which applies the rules at load
    // (tests/tests/vision.rs loads each form).
    for config in [&vlm, &null_vision, &empty_vision, &lm_only] {
        assert_eq!(get_model_type(config, true).unwrap(), ModelType::Gemma3);
    }
}

#[test]
fn ministral3_reads_the_hub_key_style() {
    // The same checkpoint with its config in the classic spelling: `rope_theta` and a
    // `rope_scaling` of type yarn carrying Ministral 3's scaling keys.
    let dir = copy_fixture("ministral3");
    let mut config = read_config(dir.path());
    let obj = config.as_object_mut().unwrap();
    let Some(Value::Object(mut rope)) = obj.remove("rope_parameters") else {
        panic!("ministral3 fixture has rope_parameters")
    };
    obj.insert("rope_theta".into(), rope.remove("rope_theta").unwrap());
    let kind = rope.remove("rope_type").unwrap();
    rope.insert("type".into(), kind);
    obj.insert("rope_scaling".into(), Value::Object(rope));
    obj.insert("torch_dtype".into(), obj["dtype"].clone());
    obj.remove("dtype");
    write_config(dir.path(), &config);
    let loaded = load_model(dir.path(), &options()).unwrap();
    let r = reference("ministral3");
    let (d, _) = max_abs_diff(&logits_for(&loaded.model, &r.prompt_ids), &r.logits);
    assert!(d < 2e-4, "hub key style differs from the reference by {d}");
}

/// A copy of fixture `name` whose `model.safetensors` keeps only the tensors `keep` accepts.
fn fixture_without(name: &str, keep: impl Fn(&str) -> bool) -> tempfile::TempDir {
    let dir = copy_fixture(name);
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| keep(n)).collect();
    let out = safetensors::serialize(kept, &None).unwrap();
    std::fs::write(&path, out).unwrap();
    dir
}

#[test]
fn exaone_moe_leaves_its_mtp_block_out_and_reads_the_correction_bias() {
    // The MTP block is in the fixture (transformers ignores it too); it is neither built nor
    // an unexpected tensor, and the memory estimate does not count it.
    let names: Vec<String> = {
        let bytes = std::fs::read(model_dir("exaone_moe").join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.names().into_iter().cloned().collect()
    };
    let mtp: Vec<&String> = names.iter().filter(|n| n.starts_with("mtp.")).collect();
    assert_eq!(mtp.len(), 6, "{names:?}");
    assert_eq!(
        mlxcel_loading::memory::tensor_role("mtp.fc.weight"),
        "mtp (unused)"
    );
    let loaded = load_model(model_dir("exaone_moe"), &options()).unwrap();
    assert_eq!(loaded.model_type, ModelType::ExaoneMoe);

    // The (random) router correction bias, at the hub's place `mlp.e_score_correction_bias`,
    // is read: without it the load fails naming it.
    let dir = fixture_without("exaone_moe", |n| !n.ends_with("e_score_correction_bias"));
    let err = load_model(dir.path(), &options()).unwrap_err().to_string();
    assert!(err.contains("e_score_correction_bias"), "{err}");
}

#[test]
fn llama4_features_are_each_exercised_by_the_fixture() {
    // Each switch changes the fixture's logits far beyond the parity tolerance, so parity.rs
    // depends on every one of them being right.
    for (key, value) in [
        ("attention_chunk_size", json!(1000)),
        ("attn_temperature_tuning", json!(false)),
        ("use_qk_norm", json!(false)),
        ("no_rope_layers", json!([1, 1, 1, 1])),
    ] {
        let dir = copy_fixture("llama4_text");
        let mut config = read_config(dir.path());
        config[key] = value;
        if key == "no_rope_layers" {
            config["layer_types"] = json!([
                "chunked_attention",
                "chunked_attention",
                "chunked_attention",
                "chunked_attention"
            ]);
        }
        write_config(dir.path(), &config);
        let d = distance_to_reference(dir.path(), "llama4_text");
        assert!(d > 0.05, "{key}: changed the logits by only {d}");
    }
    // An unknown layer type is refused naming the field.
    let dir = copy_fixture("llama4_text");
    let mut config = read_config(dir.path());
    config["layer_types"][0] = json!("sliding_attention");
    write_config(dir.path(), &config);
    let err = load_model(dir.path(), &options()).unwrap_err().to_string();
    assert!(
        err.contains("layer_types") && err.contains("sliding_attention"),
        "{err}"
    );
}

#[test]
fn llama4_nested_checkpoint_loads_its_text_model() {
    // The llama4_text fixture as a `llama4` (Llama4ForConditionalGeneration) checkpoint: the
    // config nested in `text_config`, the weights under `language_model.`, and vision tensors
    // that the text-only load leaves out.
    let dir = copy_fixture("llama4_text");
    let text = read_config(dir.path());
    let nested = json!({
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text,
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 8},
    });
    write_config(dir.path(), &nested);
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let vision = [0f32; 8];
    let vision_bytes: Vec<u8> = vision.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (format!("language_model.{n}"), t))
        .collect();
    tensors.push((
        "vision_model.patch_embedding.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![8], &vision_bytes)
            .unwrap(),
    ));
    let out = safetensors::serialize(tensors, &None).unwrap();
    std::fs::write(&path, out).unwrap();
    let loaded = load_model(dir.path(), &options()).unwrap();
    assert_eq!(loaded.model_type, ModelType::Llama4);
    let d = distance_to_reference(dir.path(), "llama4_text");
    assert!(d < 2e-4, "nested llama4 differs from the reference by {d}");
}

#[test]
fn exaone_reads_both_key_spellings() {
    // The fixture's config uses EXAONE's hub aliases; transformers' canonical keys load the same.
    let config = read_config(&model_dir("exaone"));
    assert!(config.get("num_layers").is_some() && config.get("num_hidden_layers").is_none());
    let dir = copy_fixture("exaone");
    let mut config = read_config(dir.path());
    let obj = config.as_object_mut().unwrap();
    for (alias, key) in [
        ("num_layers", "num_hidden_layers"),
        ("layer_norm_epsilon", "rms_norm_eps"),
        ("activation_function", "hidden_act"),
    ] {
        let v = obj.remove(alias).unwrap();
        obj.insert(key.into(), v);
    }
    write_config(dir.path(), &config);
    let d = distance_to_reference(dir.path(), "exaone");
    assert!(d < 2e-4, "canonical keys differ from the reference by {d}");
}

#[test]
fn minimax_block_size_is_exact_and_its_factors_are_exercised() {
    // The lightning prefill's blocks are a closed form of the recurrence: any block size gives
    // the same logits (the fixture's 16 splits the prompt in three; 5 and 64 differently).
    for block in [5, 64] {
        let dir = copy_fixture("minimax");
        let mut config = read_config(dir.path());
        config["block_size"] = json!(block);
        write_config(dir.path(), &config);
        let d = distance_to_reference(dir.path(), "minimax");
        assert!(d < 1e-3, "block_size {block}: {d} from the reference");
    }
    // The per-kind residual factors each matter.
    for key in [
        "full_attn_alpha_factor",
        "linear_attn_beta_factor",
        "mlp_alpha_factor",
    ] {
        let dir = copy_fixture("minimax");
        let mut config = read_config(dir.path());
        config[key] = json!(1.0);
        write_config(dir.path(), &config);
        let d = distance_to_reference(dir.path(), "minimax");
        assert!(d > 0.05, "{key} = 1 changed the logits by only {d}");
    }
}

#[test]
fn minimax_reads_the_hub_key_spelling() {
    // MiniMax-Text-01's hub config: `attn_type_list` (1 = softmax attention) instead of
    // `layer_types`, and `layernorm_*_alpha/beta` for the factors.
    let dir = copy_fixture("minimax");
    let mut config = read_config(dir.path());
    let obj = config.as_object_mut().unwrap();
    let types = obj.remove("layer_types").unwrap();
    let list: Vec<u8> = types
        .as_array()
        .unwrap()
        .iter()
        .map(|t| u8::from(t == "full_attention"))
        .collect();
    obj.insert("attn_type_list".into(), json!(list));
    for (key, hub) in [
        ("full_attn_alpha_factor", "layernorm_full_attention_alpha"),
        ("full_attn_beta_factor", "layernorm_full_attention_beta"),
        (
            "linear_attn_alpha_factor",
            "layernorm_linear_attention_alpha",
        ),
        ("linear_attn_beta_factor", "layernorm_linear_attention_beta"),
        ("mlp_alpha_factor", "layernorm_mlp_alpha"),
        ("mlp_beta_factor", "layernorm_mlp_beta"),
    ] {
        let v = obj.remove(key).unwrap();
        obj.insert(hub.into(), v);
    }
    write_config(dir.path(), &config);
    let d = distance_to_reference(dir.path(), "minimax");
    assert!(d < 1e-3, "hub spelling differs from the reference by {d}");
}
