//! Fused LoRA adapters (`LoadOptions::adapter`): an mlx-lm adapter made by mlx-lm itself
//! (`tests/fixtures/make_adapters.py`) against mlx-lm's float32 CPU logits with the adapter
//! (≤ 1e-4); the same A/B in PEFT's layout must give the same fused model; mismatched adapters
//! are refused naming the file and tensor.

use std::path::{Path, PathBuf};

use mlxcel_core::{Array, Dtype, RuntimePolicy};
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::{fixtures_dir, logits_for, max_abs_diff, model_dir};
use safetensors::SafeTensors;

fn adapter_dir(name: &str) -> PathBuf {
    fixtures_dir().join("adapters").join(name)
}

fn load(model: &Path, adapter: &Path) -> mlxcel_loading::Result<Loaded> {
    load_model(
        model,
        &LoadOptions {
            skip_tokenizer: true,
            policy: Some(RuntimePolicy::default()),
            adapter: Some(adapter.to_path_buf()),
            ..Default::default()
        },
    )
}

fn mlx_lm_reference() -> (Vec<u32>, Vec<f32>) {
    let bytes = std::fs::read(adapter_dir("llama-lora-mlx").join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = st
        .tensor("prompt_ids")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let logits = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (ids, logits)
}

#[test]
fn mlx_lm_adapter_matches_mlx_lm() {
    let (ids, want) = mlx_lm_reference();
    let loaded = load(&model_dir("llama"), &adapter_dir("llama-lora-mlx")).unwrap();
    assert_eq!(
        loaded.surgery_applied.len(),
        1,
        "{:?}",
        loaded.surgery_applied
    );
    assert!(
        loaded.surgery_applied[0].contains("fused into 8 layers"),
        "{:?}",
        loaded.surgery_applied
    );
    let got = logits_for(&loaded.model, &ids);
    let (diff, at) = max_abs_diff(&got, &want);
    assert!(diff <= 1e-4, "fused vs mlx-lm: max |Δ| {diff} at {at}");
    // The adapter matters: the base model is far from the reference.
    let base = load_model(
        model_dir("llama"),
        &LoadOptions {
            skip_tokenizer: true,
            policy: Some(RuntimePolicy::default()),
            ..Default::default()
        },
    )
    .unwrap();
    let (moved, _) = max_abs_diff(&logits_for(&base.model, &ids), &want);
    assert!(
        moved > 1e-2,
        "the adapter barely changes the logits ({moved})"
    );
}

#[test]
fn peft_layout_gives_the_same_fused_model() {
    let (ids, want) = mlx_lm_reference();
    let mlx = load(&model_dir("llama"), &adapter_dir("llama-lora-mlx")).unwrap();
    let peft = load(&model_dir("llama"), &adapter_dir("llama-lora-peft")).unwrap();
    assert!(peft.surgery_applied[0].contains("PEFT"));
    let a = logits_for(&mlx.model, &ids);
    let b = logits_for(&peft.model, &ids);
    let (diff, at) = max_abs_diff(&a, &b);
    assert!(
        diff <= 1e-5,
        "PEFT vs mlx-lm layout: max |Δ| {diff} at {at}"
    );
    let (diff, _) = max_abs_diff(&b, &want);
    assert!(diff <= 1e-4, "PEFT vs mlx-lm reference: {diff}");
}

/// An mlx-lm adapter folder holding `tensors`.
fn write_adapter(dir: &Path, tensors: &[(&str, &[i32])], config: &str) {
    std::fs::write(dir.join("adapter_config.json"), config).unwrap();
    let key = mlxcel_core::ops::random::key(1).unwrap();
    let tensors: Vec<(String, Array)> = tensors
        .iter()
        .map(|(n, s)| {
            (
                n.to_string(),
                mlxcel_core::ops::random::uniform(s, Dtype::Float32, &key).unwrap(),
            )
        })
        .collect();
    mlxcel_core::weights::save_safetensors(dir.join("adapters.safetensors"), &tensors, None)
        .unwrap();
}

const MLX_CONFIG: &str = r#"{"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0}}"#;

fn error(model: &str, adapter: &Path) -> String {
    match load(&model_dir(model), adapter) {
        Ok(_) => panic!("adapter {} accepted on {model}", adapter.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn mismatched_adapters_are_refused_naming_file_and_tensor() {
    // Wrong input width for q_proj (an adapter for another model).
    let tmp = tempfile::tempdir().unwrap();
    write_adapter(
        tmp.path(),
        &[
            ("model.layers.0.self_attn.q_proj.lora_a", &[32, 4]),
            ("model.layers.0.self_attn.q_proj.lora_b", &[4, 64]),
        ],
        MLX_CONFIG,
    );
    let msg = error("llama", tmp.path());
    for p in [
        "adapters.safetensors",
        "model.layers.0.self_attn.q_proj.lora_a",
        "[64, 64]",
    ] {
        assert!(msg.contains(p), "`{p}` not in: {msg}");
    }

    // A module the model does not have.
    let tmp = tempfile::tempdir().unwrap();
    write_adapter(
        tmp.path(),
        &[
            ("model.layers.7.self_attn.q_proj.lora_a", &[64, 4]),
            ("model.layers.7.self_attn.q_proj.lora_b", &[4, 64]),
        ],
        MLX_CONFIG,
    );
    let msg = error("llama", tmp.path());
    assert!(
        msg.contains("model.layers.7.self_attn.q_proj.weight") && msg.contains("does not have"),
        "{msg}"
    );

    // A lone A.
    let tmp = tempfile::tempdir().unwrap();
    write_adapter(
        tmp.path(),
        &[("model.layers.0.self_attn.q_proj.lora_a", &[64, 4])],
        MLX_CONFIG,
    );
    let msg = error("llama", tmp.path());
    assert!(msg.contains("has no B tensor"), "{msg}");

    // DoRA without its magnitude vector.
    let tmp = tempfile::tempdir().unwrap();
    write_adapter(
        tmp.path(),
        &[
            ("model.layers.0.self_attn.q_proj.lora_a", &[64, 4]),
            ("model.layers.0.self_attn.q_proj.lora_b", &[4, 64]),
        ],
        &MLX_CONFIG.replace("\"lora\"", "\"dora\""),
    );
    let msg = error("llama", tmp.path());
    assert!(
        msg.contains("DoRA module `model.layers.0.self_attn.q_proj` has no magnitude tensor")
            && msg.contains("adapters.safetensors"),
        "{msg}"
    );

    // A magnitude of the wrong length.
    let tmp = tempfile::tempdir().unwrap();
    write_adapter(
        tmp.path(),
        &[
            ("model.layers.0.self_attn.q_proj.lora_a", &[64, 4]),
            ("model.layers.0.self_attn.q_proj.lora_b", &[4, 64]),
            ("model.layers.0.self_attn.q_proj.m", &[32]),
        ],
        &MLX_CONFIG.replace("\"lora\"", "\"dora\""),
    );
    let msg = error("llama", tmp.path());
    assert!(
        msg.contains("magnitude `model.layers.0.self_attn.q_proj.m` has shape [32], expected [64]"),
        "{msg}"
    );

    // An embedding adapter for another vocabulary.
    let tmp = tempfile::tempdir().unwrap();
    write_adapter(
        tmp.path(),
        &[
            ("model.embed_tokens.lora_a", &[500, 4]),
            ("model.embed_tokens.lora_b", &[4, 64]),
        ],
        MLX_CONFIG,
    );
    let msg = error("llama", tmp.path());
    for p in [
        "adapters.safetensors",
        "model.embed_tokens.lora_a",
        "`model.embed_tokens.weight` is [512, 64] (an adapter for another model?)",
    ] {
        assert!(msg.contains(p), "`{p}` not in: {msg}");
    }

    // DoRA on an embedding table.
    let tmp = tempfile::tempdir().unwrap();
    write_adapter(
        tmp.path(),
        &[
            ("model.embed_tokens.lora_a", &[512, 4]),
            ("model.embed_tokens.lora_b", &[4, 64]),
            ("model.embed_tokens.m", &[64]),
        ],
        &MLX_CONFIG.replace("\"lora\"", "\"dora\""),
    );
    let msg = error("llama", tmp.path());
    assert!(
        msg.contains("`model.embed_tokens`: DoRA on an embedding table is not supported"),
        "{msg}"
    );

    // PEFT's saved copy of the base embedding (`save_embedding_layers`).
    let tmp = tempfile::tempdir().unwrap();
    write_adapter(
        tmp.path(),
        &[
            (
                "base_model.model.model.embed_tokens.lora_embedding_A",
                &[4, 512],
            ),
            (
                "base_model.model.model.embed_tokens.lora_embedding_B",
                &[64, 4],
            ),
            (
                "base_model.model.model.embed_tokens.base_layer.weight",
                &[512, 64],
            ),
        ],
        r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["embed_tokens"]}"#,
    );
    std::fs::rename(
        tmp.path().join("adapters.safetensors"),
        tmp.path().join("adapter_model.safetensors"),
    )
    .unwrap();
    let msg = error("llama", tmp.path());
    assert!(
        msg.contains("adapter_model.safetensors")
            && msg.contains("`base_model.model.model.embed_tokens.base_layer.weight` is a saved copy of a base layer")
            && msg.contains("save_embedding_layers=False"),
        "{msg}"
    );
}

/// `lora_fuse` on a quantized base: each adapted layer dequantized, the delta added and
/// requantized at its own bits and group size, against mlx-lm's `fuse(dequantize=False)` of the
/// same adapter on the same quantized fixture. Without it the adapter stays unfused (see
/// `runtime_adapters.rs`).
#[test]
fn lora_fuse_requantizes_a_quantized_base_like_mlx_lm() {
    let path = adapter_dir("llama-lora-mlx").join("reference-affine4-g64-fused.safetensors");
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want: Vec<f32> = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let (ids, _) = mlx_lm_reference();
    let loaded = load_model(
        model_dir("llama-affine4-g64"),
        &LoadOptions {
            skip_tokenizer: true,
            policy: Some(RuntimePolicy::default()),
            adapter: Some(adapter_dir("llama-lora-mlx")),
            lora_fuse: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(loaded.adapters.is_none());
    assert!(
        loaded.surgery_applied[0]
            .contains("fused into 8 layers (dequantized, added and requantized at the layers' own affine 4-bit g64)"),
        "{:?}",
        loaded.surgery_applied
    );
    let got = logits_for(&loaded.model, &ids);
    let (diff, at) = max_abs_diff(&got, &want);
    eprintln!("requantized fuse vs mlx-lm: max |Δ| {diff:.3e}");
    assert!(
        diff <= 1e-3,
        "requantized fuse vs mlx-lm: max |Δ| {diff} at {at}"
    );
}

/// The facade's `ModelBuilder::adapter` fuses the same adapter as `LoadOptions::adapter`: the
/// same next-token logits, listed in `ModelInfo::weight_edits`, different from the base model.
#[test]
fn facade_adapter_matches_the_library_path() {
    let (ids, _) = mlx_lm_reference();
    let loaded = load(&model_dir("llama"), &adapter_dir("llama-lora-mlx")).unwrap();
    let model = mlxcel_models::Model::load(model_dir("llama"))
        .without_tokenizer()
        .adapter(adapter_dir("llama-lora-mlx"))
        .build()
        .unwrap();
    let all = logits_for(&loaded.model, &ids);
    let want = &all[all.len() - model.info().vocab_size..];
    assert_eq!(model.info().weight_edits, loaded.surgery_applied);
    let got = model.logits(&ids).unwrap();
    let (diff, at) = max_abs_diff(&got, want);
    // The library path computes logits for every prompt position (the CPU kernel's many-row
    // GEMM), the facade for the last one only (its row kernel): float32 rounding of two
    // summation orders, far below the adapter's own effect (> 1e-2, checked below).
    assert!(
        diff <= 1e-5,
        "facade vs library adapter: max |Δ| {diff} at {at}"
    );

    let base = mlxcel_models::Model::load(model_dir("llama"))
        .without_tokenizer()
        .build()
        .unwrap();
    assert!(base.info().weight_edits.is_empty());
    let (moved, _) = max_abs_diff(&base.logits(&ids).unwrap(), want);
    assert!(
        moved > 1e-2,
        "the adapter barely changes the logits ({moved})"
    );
}

/// Vision-language types refuse adapters, fused or unfused, with the registry row's reason,
/// before anything is loaded.
#[test]
fn vision_language_models_refuse_adapters_with_the_registry_reason() {
    for vlm in ["gemma3", "llava"] {
        let dir = fixtures_dir().join("vision").join(vlm);
        let model_type = mlxcel_arch::detection::get_model_type(
            &mlxcel_loading::read_config(&dir).unwrap(),
            true,
        )
        .unwrap();
        let reason = mlxcel_arch::adapter_support(model_type).unwrap_err();
        assert_eq!(reason, "vision-language models take no adapters");
        for options in [
            LoadOptions {
                adapter: Some(adapter_dir("llama-lora-mlx")),
                ..Default::default()
            },
            LoadOptions {
                runtime_adapters: vec![("a".into(), adapter_dir("llama-lora-mlx"))],
                ..Default::default()
            },
        ] {
            let err = match load_model(
                &dir,
                &LoadOptions {
                    skip_tokenizer: true,
                    policy: Some(RuntimePolicy::default()),
                    ..options
                },
            ) {
                Ok(_) => panic!("{vlm}: an adapter was accepted"),
                Err(e) => e.to_string(),
            };
            assert!(
                err.contains(&format!(
                    "cannot be applied to {}: {reason}",
                    model_type.name()
                )),
                "{vlm}: {err}"
            );
        }
    }
}
