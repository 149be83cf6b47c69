//! Bad checkpoints fail with the exact message that names the field or tensor at fault, and
//! configs written the way real hub checkpoints and mlx-community conversions write them load.

use std::fs;
use std::path::Path;

use mlxcel_core::weights::save_safetensors;
use mlxcel_core::{Array, WeightMap};
use mlxcel_loading::{load_model, LoadOptions};
use mlxcel_tests::copy_fixture;
use serde_json::Value;

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut config: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    edit(config.as_object_mut().unwrap());
    fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

/// Rewrites model.safetensors through `edit` on its tensors.
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Array)>)) {
    let map = WeightMap::open(dir).unwrap();
    let mut tensors: Vec<(String, Array)> = map
        .names()
        .map(|n| (n.to_string(), map.get(n).unwrap()))
        .collect();
    drop(map);
    edit(&mut tensors);
    // One shard now: an index naming the old tensors would be stale.
    let _ = fs::remove_file(dir.join("model.safetensors.index.json"));
    save_safetensors(dir.join("model.safetensors"), &tensors, None).unwrap();
}

fn load_error(dir: &Path) -> String {
    let options = LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    };
    match load_model(dir, &options) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unknown_model_type() {
    let dir = copy_fixture("llama");
    edit_config(dir.path(), |c| {
        c.insert("model_type".into(), "llamazing".into());
    });
    let err = load_error(dir.path());
    assert_eq!(
        err,
        format!(
            "{}: unsupported: model_type `llamazing` is not a supported architecture (supported: {})",
            dir.path().display(),
            mlxcel_arch::DESCRIPTORS
                .iter()
                .flat_map(|d| d.names.iter().copied())
                .collect::<Vec<_>>()
                .join(", ")
        )
    );
}

#[test]
fn missing_model_type_and_missing_required_field() {
    let dir = copy_fixture("qwen3");
    edit_config(dir.path(), |c| {
        c.remove("model_type");
    });
    assert_eq!(
        load_error(dir.path()),
        format!(
            "{}: config.json: missing field `model_type`",
            dir.path().display()
        )
    );
    let dir = copy_fixture("qwen3");
    edit_config(dir.path(), |c| {
        c.remove("hidden_size");
    });
    assert_eq!(
        load_error(dir.path()),
        format!(
            "{}: config.json: missing field `hidden_size`",
            dir.path().display()
        )
    );
}

#[test]
fn tensor_of_the_wrong_shape() {
    let dir = copy_fixture("llama");
    edit_weights(dir.path(), |t| {
        let entry = t
            .iter_mut()
            .find(|(n, _)| n == "model.layers.1.self_attn.k_proj.weight")
            .unwrap();
        entry.1 = mlxcel_core::ops::zeros(&[16, 64], mlxcel_core::Dtype::Float32).unwrap();
    });
    assert_eq!(
        load_error(dir.path()),
        format!(
            "{}: tensor `model.layers.1.self_attn.k_proj.weight` has shape [16, 64], expected [32, 64]",
            dir.path().display()
        )
    );
}

#[test]
fn missing_tensor() {
    let dir = copy_fixture("llama");
    edit_weights(dir.path(), |t| {
        t.retain(|(n, _)| n != "model.layers.0.mlp.up_proj.weight")
    });
    assert_eq!(
        load_error(dir.path()),
        format!(
            "{}: missing tensor `model.layers.0.mlp.up_proj.weight`",
            dir.path().display()
        )
    );
}

#[test]
fn extra_unexpected_tensor() {
    let dir = copy_fixture("llama");
    edit_weights(dir.path(), |t| {
        t.push((
            "model.layers.0.self_attn.q_norm.weight".into(),
            mlxcel_core::ops::ones(&[16], mlxcel_core::Dtype::Float32).unwrap(),
        ));
    });
    assert_eq!(
        load_error(dir.path()),
        format!(
            "{}: unexpected tensors not used by Llama: `model.layers.0.self_attn.q_norm.weight`",
            dir.path().display()
        )
    );
}

#[test]
fn untied_config_without_lm_head() {
    let dir = copy_fixture("llama");
    edit_weights(dir.path(), |t| t.retain(|(n, _)| n != "lm_head.weight"));
    assert_eq!(
        load_error(dir.path()),
        format!("{}: missing tensor `lm_head.weight`", dir.path().display())
    );
    // The same checkpoint declared tied loads, using the embedding as the head.
    edit_config(dir.path(), |c| {
        c.insert("tie_word_embeddings".into(), true.into());
    });
    load_model(
        dir.path(),
        &LoadOptions {
            skip_tokenizer: true,
            ..Default::default()
        },
    )
    .unwrap();
}

#[test]
fn embedding_and_vlm_checkpoints_are_not_mistaken_for_text_models() {
    let dir = copy_fixture("llama");
    edit_config(dir.path(), |c| {
        c.insert("model_type".into(), "bert".into());
    });
    assert!(load_error(dir.path()).contains("an embedding checkpoint"));
    edit_config(dir.path(), |c| {
        c.insert("model_type".into(), "llama".into());
        c.insert(
            "architectures".into(),
            serde_json::json!(["LlamaForSequenceClassification"]),
        );
    });
    let err = load_error(dir.path());
    assert!(
        err.contains("a cross-encoder (reranker) checkpoint")
            && err.contains("load_reranker_model"),
        "{err}"
    );
    edit_config(dir.path(), |c| {
        c.insert("model_type".into(), "gemma3".into());
        c.insert(
            "architectures".into(),
            serde_json::json!(["Gemma3ForConditionalGeneration"]),
        );
        c.insert(
            "vision_config".into(),
            serde_json::json!({"hidden_size": 32}),
        );
    });
    let err = load_error(dir.path());
    assert!(err.contains("`gemma3`"), "{err}");
}

#[test]
fn quantized_layout_errors_name_the_tensor() {
    let dir = copy_fixture("llama-affine4-g64");
    edit_weights(dir.path(), |t| {
        let entry = t
            .iter_mut()
            .find(|(n, _)| n == "model.layers.0.self_attn.q_proj.scales")
            .unwrap();
        entry.1 = mlxcel_core::ops::zeros(&[64, 3], mlxcel_core::Dtype::Float32).unwrap();
    });
    let err = load_error(dir.path());
    assert!(
        err.contains("`model.layers.0.self_attn.q_proj.weight`"),
        "{err}"
    );
    let dir = copy_fixture("llama-affine4-g64");
    edit_weights(dir.path(), |t| {
        t.retain(|(n, _)| n != "model.layers.0.mlp.down_proj.biases")
    });
    let err = load_error(dir.path());
    assert!(
        err.contains("`model.layers.0.mlp.down_proj.weight`") && err.contains("no `.biases`"),
        "{err}"
    );
}

#[test]
fn hub_style_configs_load() {
    // mlx-community conversions and hub checkpoints: `rope_scaling: null`, `torch_dtype` only,
    // `head_dim: null`, and extra keys the architecture does not read.
    let dir = copy_fixture("llama");
    edit_config(dir.path(), |c| {
        let theta = c["rope_parameters"]["rope_theta"].clone();
        c.remove("rope_parameters");
        c.remove("dtype");
        c.insert("rope_theta".into(), theta);
        c.insert("rope_scaling".into(), Value::Null);
        c.insert("torch_dtype".into(), "float32".into());
        c.insert("head_dim".into(), Value::Null);
        c.insert("some_future_key".into(), serde_json::json!({"x": 1}));
    });
    let loaded = load_model(
        dir.path(),
        &LoadOptions {
            skip_tokenizer: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(loaded.model_type, mlxcel_loading::ModelType::Llama);
    // A folder path given as a file inside it resolves to the folder.
    load_model(
        dir.path().join("config.json"),
        &LoadOptions {
            skip_tokenizer: true,
            ..Default::default()
        },
    )
    .unwrap();
}

/// A runtime policy parsed from `pairs` as `RuntimePolicy::from_env` parses the environment.
fn policy_from(pairs: &[(&str, &str)]) -> mlxcel_core::Result<mlxcel_core::RuntimePolicy> {
    mlxcel_core::RuntimePolicy::from_vars(|name| {
        pairs
            .iter()
            .find(|(var, _)| *var == name)
            .map(|(_, value)| value.to_string())
    })
}

/// Loads the llama fixture under the policy of `pairs`, failing as `load_model` does when
/// `LoadOptions::policy` is `None` and the environment holds an invalid variable.
fn load_under(pairs: &[(&str, &str)]) -> mlxcel_loading::Result<mlxcel_loading::Loaded> {
    let options = LoadOptions {
        skip_tokenizer: true,
        policy: Some(policy_from(pairs)?),
        ..Default::default()
    };
    load_model(mlxcel_tests::model_dir("llama"), &options)
}

#[test]
fn an_invalid_runtime_variable_is_a_load_error_naming_it() {
    for (var, value, expected) in [
        (
            "MLXCEL_DEQUANT_ROWS",
            "lots",
            "MLXCEL_DEQUANT_ROWS=lots: expected a number of rows (0 = never)",
        ),
        (
            "MLXCEL_WEIGHT_MATERIALIZATION",
            "sometimes",
            "MLXCEL_WEIGHT_MATERIALIZATION=sometimes: expected `eager` or `lazy`",
        ),
        (
            "MLXCEL_CPU_KERNELS",
            "yes",
            "MLXCEL_CPU_KERNELS=yes: expected 1 (on) or 0 (off)",
        ),
    ] {
        match load_under(&[(var, value)]) {
            Ok(_) => panic!("{var}={value} should fail the load"),
            Err(e) => assert_eq!(e.to_string(), expected),
        }
    }
    // Valid values load (load-level switches only: the installed policy is process-wide and
    // other tests of this binary load concurrently).
    let loaded = load_under(&[
        ("MLXCEL_WEIGHT_MATERIALIZATION", "lazy"),
        ("MLXCEL_FUSE_PROJECTIONS", "0"),
        ("MLXCEL_WARM_UP", "0"),
    ])
    .unwrap();
    assert_eq!(loaded.model_type, mlxcel_loading::ModelType::Llama);
}

#[test]
fn load_options_overrides_win_over_the_policy() {
    let policy = policy_from(&[
        ("MLXCEL_WEIGHT_MATERIALIZATION", "lazy"),
        ("MLXCEL_FUSE_PROJECTIONS", "1"),
        ("MLXCEL_EXPERT_STREAM", "0"),
        ("MLXCEL_DEQUANT_ROWS", "7"),
    ])
    .unwrap();
    let options = LoadOptions {
        policy: Some(policy),
        materialization: Some(mlxcel_core::Materialization::Eager),
        fuse_projections: Some(false),
        warm_up: Some(true),
        stream: Some(mlxcel_stream::StreamConfig {
            mode: mlxcel_stream::StreamMode::On,
            arena_bytes: Some(1 << 20),
            policy: mlxcel_stream::CachePolicy::Lru,
            io: mlxcel_stream::ExpertIo::Dontneed,
            prefetch: false,
            in_place: false,
        }),
        ..Default::default()
    };
    let got = options.runtime_policy().unwrap();
    assert_eq!(
        got.weight_materialization,
        mlxcel_core::Materialization::Eager
    );
    assert_eq!(got.fuse_projections, Some(false));
    assert_eq!(got.warm_up, Some(true));
    assert_eq!(got.expert_stream, mlxcel_stream::StreamMode::On);
    assert_eq!(got.expert_arena_bytes, Some(1 << 20));
    assert_eq!(got.expert_cache_policy, mlxcel_stream::CachePolicy::Lru);
    assert_eq!(got.expert_io, mlxcel_stream::ExpertIo::Dontneed);
    assert!(!got.expert_prefetch);
    assert!(!got.expert_in_place);
    // Fields without an override keep the policy's.
    assert_eq!(got.dequant_rows, Some(7));
}
