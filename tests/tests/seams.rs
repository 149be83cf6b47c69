//! The model-layer seams, each on real fixtures: the seven architectures built on them against
//! transformers (the bound: max |Δ| ≤ max(2e-4, 2e-5 · max |logit|); greedy ids with
//! prefill chunks 1/3/16), configs in both key styles, input embeddings with explicit positions,
//! a decoder mounted under a tensor prefix, the model's own cache size per token, and runtime
//! errors that are not reported as config problems.

use mlxcel_arch::config::sanitize_config_json;
use mlxcel_arch::generate::{greedy, prefill};
use mlxcel_arch::{load_config_backed, BuildOptions, LoadedModel, ModelType};
use mlxcel_core::{Array, Dtype, Materialization, WeightMap};
use mlxcel_loading::{load_model, LanguageModel, LoadOptions};
use mlxcel_tests::{copy_fixture, logits_for, max_abs_diff, model_dir, reference};
use serde_json::Value;

const SEVEN: [&str; 7] = [
    "deepseek_v3",
    "deepseek_v2",
    "cohere",
    "granite",
    "glm4",
    "exaone4",
    "starcoder2",
];

fn options() -> LoadOptions {
    LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    }
}

fn ids(tokens: &[u32]) -> Array {
    let v: Vec<i32> = tokens.iter().map(|t| *t as i32).collect();
    Array::from_slice(&v, &[1, v.len() as i32]).unwrap()
}

#[test]
fn seven_architectures_match_transformers() {
    for name in SEVEN {
        let r = reference(name);
        let loaded =
            load_model(model_dir(name), &options()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = logits_for(&loaded.model, &r.prompt_ids);
        let biggest = r.logits.iter().fold(0f32, |m, v| m.max(v.abs()));
        let bound = 2e-4f32.max(2e-5 * biggest);
        let (diff, at) = max_abs_diff(&got, &r.logits);
        assert!(
            diff <= bound,
            "{name}: max |Δlogit| {diff:.2e} > {bound:.2e} at {at}"
        );
        for chunk in [Some(1), Some(3), Some(16), None] {
            let out = greedy(
                &loaded.model,
                &r.prompt_ids,
                r.greedy_ids.len(),
                chunk,
                |_| false,
            )
            .unwrap();
            assert_eq!(
                out, r.greedy_ids,
                "{name}: greedy with prefill chunk {chunk:?}"
            );
        }
        eprintln!("{name}: {diff:.2e} (bound {bound:.2e})");
    }
}

/// Rewrites a fixture's config in one key style only: `hub` keeps `rope_theta`/`rope_scaling`/
/// `torch_dtype` and top-level `partial_rotary_factor`; otherwise only transformers 5's
/// `rope_parameters`/`dtype`.
fn restyle(config: &Value, hub: bool, scaling: Option<&Value>) -> Value {
    let mut c = config.as_object().unwrap().clone();
    let theta = c
        .get("rope_theta")
        .cloned()
        .or_else(|| {
            c.get("rope_parameters")
                .and_then(|p| p.get("rope_theta"))
                .cloned()
        })
        .unwrap();
    let partial = c.get("partial_rotary_factor").cloned();
    for key in [
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "torch_dtype",
        "dtype",
    ] {
        c.remove(key);
    }
    if hub {
        c.insert("rope_theta".into(), theta);
        c.insert(
            "rope_scaling".into(),
            scaling.cloned().unwrap_or(Value::Null),
        );
        if let Some(p) = partial {
            c.insert("partial_rotary_factor".into(), p);
        }
        c.insert("torch_dtype".into(), "float32".into());
    } else {
        let mut rope = serde_json::Map::new();
        rope.insert("rope_theta".into(), theta);
        match scaling {
            Some(Value::Object(s)) => {
                for (k, v) in s {
                    if k != "type" {
                        rope.insert(k.clone(), v.clone());
                    }
                }
                rope.insert(
                    "rope_type".into(),
                    s.get("type")
                        .or_else(|| s.get("rope_type"))
                        .cloned()
                        .unwrap(),
                );
            }
            _ => {
                rope.insert("rope_type".into(), "default".into());
            }
        }
        if let Some(p) = partial {
            rope.insert("partial_rotary_factor".into(), p);
        }
        c.insert("rope_parameters".into(), Value::Object(rope));
        c.insert("dtype".into(), "float32".into());
    }
    Value::Object(c)
}

fn logits_with_config(name: &str, config: &Value) -> Vec<f32> {
    let dir = copy_fixture(name);
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    let loaded = load_model(dir.path(), &options()).unwrap_or_else(|e| panic!("{name}: {e}"));
    logits_for(&loaded.model, &reference(name).prompt_ids)
}

#[test]
fn both_config_key_styles_give_the_same_model() {
    for name in SEVEN {
        let text = std::fs::read_to_string(model_dir(name).join("config.json")).unwrap();
        let config: Value = serde_json::from_str(&text).unwrap();
        let want = reference(name).logits;
        for hub in [true, false] {
            let got = logits_with_config(name, &restyle(&config, hub, None));
            let (d, _) = max_abs_diff(&got, &want);
            assert!(d <= 1e-3, "{name} (hub style {hub}): {d:.2e}");
        }
    }
    // Real DeepSeek V3 checkpoints carry yarn scaling with `mscale`/`mscale_all_dim` (hub style:
    // `rope_scaling` with the old `type` key); both spellings must give one model, and the
    // scaling must change it (the softmax scale grows by mscale²).
    let text = std::fs::read_to_string(model_dir("deepseek_v3").join("config.json")).unwrap();
    let config: Value = serde_json::from_str(&text).unwrap();
    let yarn: Value = serde_json::json!({
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64, "type": "yarn"
    });
    let hub = logits_with_config("deepseek_v3", &restyle(&config, true, Some(&yarn)));
    let v5 = logits_with_config("deepseek_v3", &restyle(&config, false, Some(&yarn)));
    let (d, _) = max_abs_diff(&hub, &v5);
    assert!(d <= 1e-6, "yarn in both styles differs by {d:.2e}");
    let (moved, _) = max_abs_diff(&hub, &reference("deepseek_v3").logits);
    assert!(moved > 1e-2, "yarn scaling had no effect ({moved:.2e})");
}

#[test]
fn input_embeddings_with_explicit_positions_equal_token_ids() {
    for name in ["llama", "deepseek_v3", "gemma3_text", "exaone4"] {
        let r = reference(name);
        let loaded = load_model(model_dir(name), &options()).unwrap();
        let model = &loaded.model;
        let want = logits_for(model, &r.prompt_ids);
        // Two chunks: the first from its embeddings at positions 0..k, the second at k..n.
        let k = 17;
        let mut caches = model.make_caches();
        let mut got = Vec::new();
        for (start, piece) in [(0, &r.prompt_ids[..k]), (k, &r.prompt_ids[k..])] {
            let h = model.embed(&ids(piece)).unwrap();
            let pos: Vec<i32> = (start..start + piece.len()).map(|p| p as i32).collect();
            let pos = Array::from_slice(&pos, &[pos.len() as i32]).unwrap();
            let logits = model
                .forward_embeddings(&h, Some(&pos), &mut caches, false)
                .unwrap();
            got.extend(logits.to_vec::<f32>().unwrap());
        }
        // The explicit-position rope is computed with element-wise ops instead of MLX's fused
        // kernel: float32 rounding of the angles, relative to the logits' size.
        let biggest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (d, _) = max_abs_diff(&got, &want);
        let bound = 1e-4f32.max(1e-5 * biggest);
        assert!(
            d <= bound,
            "{name}: embeddings + positions differ by {d:.2e} > {bound:.2e}"
        );
    }
}

#[test]
fn a_decoder_builds_under_any_tensor_prefix() {
    // Architectures without checkpoint rewrites (sanitisers address the canonical root names;
    // a tower loader hands them its own map).
    for (name, model_type) in [
        ("llama", ModelType::Llama),
        ("gemma3_text", ModelType::Gemma3Text),
    ] {
        let dir = model_dir(name);
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let config = sanitize_config_json(serde_json::from_str(&text).unwrap());
        let mut weights = WeightMap::open(&dir).unwrap();
        weights.rename_prefix("", "language_model.").unwrap();
        let build = BuildOptions {
            prefix: "language_model".into(),
            quant: None,
            dtype: Dtype::Float32,
            materialization: Materialization::Eager,
            stream: None,
            external_ple: None,
            fuse_projections: false,
            transform: None,
            runtime_adapters: None,
            parallelism: None,
            mtp: false,
        };
        let model = match load_config_backed(model_type, &config, weights, &build) {
            Ok(LoadedModel::Generation(m)) => m,
            Ok(other) => panic!("{name}: loaded as {:?}", other.kind()),
            Err(e) => panic!("{name}: {e}"),
        };
        let r = reference(name);
        let (d, _) = max_abs_diff(&logits_for(&model, &r.prompt_ids), &r.logits);
        assert!(d <= 1e-3, "{name} under a prefix: {d:.2e}");
    }
}

#[test]
fn latent_attention_caches_a_fraction_of_full_attention() {
    let est = |name: &str| {
        let dir = model_dir(name);
        let config = mlxcel_loading::read_config(&dir).unwrap();
        mlxcel_loading::memory::estimate(&dir, &config, Dtype::Float32, 1024, 512).unwrap()
    };
    // deepseek_v3: 2 layers of (kv_lora_rank 32 + rope 8) float32 values per position.
    let mla = est("deepseek_v3");
    assert_eq!(mla.kv_bytes_per_token, 2 * (32 + 8) * 4);
    assert_eq!(mla.kv_cache, 1024 * 2 * (32 + 8) * 4);
    // Expanded, the same layers would keep keys (nope 16 + rope 8) and values (16) per head.
    let expanded = 2 * 4 * (24 + 16) * 4;
    assert!(expanded >= 4 * mla.kv_bytes_per_token);
    // A built model reports the same figure.
    let loaded = load_model(model_dir("deepseek_v3"), &options()).unwrap();
    assert_eq!(
        loaded.model.cache_bytes_per_token(Dtype::Float32),
        mla.kv_bytes_per_token
    );
    // Grouped-query attention: 2 · kv_heads · head_dim; sliding layers hold window + chunk.
    let llama = est("llama");
    assert_eq!(llama.kv_bytes_per_token, 2 * (2 * 2 * 16) * 4);
    let gemma2 = est("gemma2");
    let per_layer = gemma2.kv_bytes_per_token / 2;
    assert_eq!(gemma2.kv_cache, per_layer * (8 + 512) + per_layer * 1024);
}

#[test]
fn runtime_errors_are_not_config_errors() {
    let loaded = load_model(model_dir("llama"), &options()).unwrap();
    let model = &loaded.model;
    let mut caches = model.make_caches();
    let empty = prefill(model, &[], &mut caches, None)
        .unwrap_err()
        .to_string();
    assert_eq!(empty, "cannot prefill an empty prompt");
    let vocab = model.vocab_size() as u32;
    let outside = prefill(model, &[1, vocab], &mut caches, None)
        .unwrap_err()
        .to_string();
    assert!(
        outside.contains(&format!("token id {vocab} at position 1")) && !outside.contains("config"),
        "{outside}"
    );
    // The raw forward pass refuses ids outside the table instead of reading past it.
    let err = model
        .forward(&ids(&[1, vocab + 7]), &mut model.make_caches())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("token id {} at position 1", vocab + 7)),
        "{err}"
    );
    let negative = Array::from_slice(&[-1i32], &[1, 1]).unwrap();
    assert!(model.forward(&negative, &mut model.make_caches()).is_err());
    // A cache of the wrong kind is refused by name.
    let latent = load_model(model_dir("deepseek_v2"), &options()).unwrap();
    let err = latent
        .model
        .forward(&ids(&[1, 2]), &mut model.make_caches())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("latent attention layer was given a standard KV cache"),
        "{err}"
    );
}

#[test]
fn the_registry_claims_adapters_only_where_fused_adapters_load() {
    // Fused LoRA adapters load on every generation type (dense checkpoints; quantized bases and
    // expert adapters are refused when applied) but vision-language ones (the seed: VLM rows
    // refuse adapters with their own message); encoders take none.
    const { assert!(mlxcel_arch::ADAPTERS_AVAILABLE) };
    for t in ModelType::ALL {
        let generation = t.descriptor().kind == mlxcel_arch::ModelKind::Generation
            && t.descriptor().directory_route != mlxcel_arch::DirectoryRoute::Vlm;
        assert_eq!(
            mlxcel_arch::adapter_support(*t).is_ok(),
            generation,
            "{}",
            t.name()
        );
    }
}

/// The load's phases are each measured and add up to its wall time; the warm-up step's share is
/// zero when it is off and positive when it runs.
#[test]
fn load_phases_add_up_to_the_load_time() {
    for warm_up in [false, true] {
        let loaded = load_model(
            model_dir("llama"),
            &LoadOptions {
                warm_up: Some(warm_up),
                ..options()
            },
        )
        .expect("the llama fixture loads");
        let p = loaded.load_phases;
        let sum = p.prepare + p.build + p.warm_up + p.tokenizer;
        for (name, v) in [
            ("prepare", p.prepare),
            ("build", p.build),
            ("warm_up", p.warm_up),
            ("tokenizer", p.tokenizer),
        ] {
            assert!(v >= 0.0, "{name}: {v}");
        }
        assert!(p.build > 0.0 && p.tokenizer > 0.0, "{p:?}");
        assert!(
            (sum - loaded.load_seconds).abs() <= 0.01 * loaded.load_seconds + 1e-3,
            "phases {p:?} add up to {sum}, the load took {}",
            loaded.load_seconds
        );
        assert_eq!(p.warm_up > 0.0, warm_up, "warm-up {warm_up}: {p:?}");
    }
}
