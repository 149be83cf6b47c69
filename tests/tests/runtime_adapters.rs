//! Runtime (unfused) LoRA adapters (`LoadOptions::runtime_adapters`, `Loaded::select_adapters`):
//! several adapters on one loaded base, switched and blended without reloading, each against
//! mlx-lm's float32 CPU logits with the same adapter (`tests/fixtures/make_adapters.py`): the
//! runtime output, the fused output and mlx-lm agree (≤ 1e-4); weight 0 is the base exactly; a
//! blend matches the numpy-fused blend run by mlx-lm; over the MLX-quantized llama fixture the
//! runtime adapter matches mlx-lm's QLoRA inference (≤ 1e-3).

use std::path::{Path, PathBuf};

use mlxcel_arch::nn::lora::AdapterMix;
use mlxcel_core::RuntimePolicy;
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::{fixtures_dir, logits_for, max_abs_diff, model_dir};
use safetensors::SafeTensors;

fn adapter_dir(name: &str) -> PathBuf {
    fixtures_dir().join("adapters").join(name)
}

fn options() -> LoadOptions {
    LoadOptions {
        skip_tokenizer: true,
        policy: Some(RuntimePolicy::default()),
        ..Default::default()
    }
}

/// The llama fixture with adapters `a` (llama-lora-mlx) and `b` (llama-lora-mlx-b) registered.
fn load_both() -> Loaded {
    load_model(
        model_dir("llama"),
        &LoadOptions {
            runtime_adapters: vec![
                ("a".into(), adapter_dir("llama-lora-mlx")),
                ("b".into(), adapter_dir("llama-lora-mlx-b")),
            ],
            ..options()
        },
    )
    .unwrap()
}

/// `(prompt ids, logits)` of a reference file.
fn reference(path: &Path) -> (Vec<u32>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = st
        .tensor("prompt_ids")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let logits = floats(&st, "logits");
    (ids, logits)
}

fn floats(st: &SafeTensors, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// `bound`, or the parity suite's float32 allowance for large logits (5e-5 · max |logit|,
/// see tests/tests/parity.rs) when that is larger: rounding grows with the logits' scale.
fn assert_close(got: &[f32], want: &[f32], bound: f32, what: &str) {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let bound = bound.max(5e-5 * scale);
    let (diff, at) = max_abs_diff(got, want);
    assert!(
        diff <= bound,
        "{what}: max |Δ| {diff} at {at} (bound {bound})"
    );
    eprintln!("{what}: max |Δ| {diff:.3e}");
}

#[test]
fn runtime_adapter_equals_fused_and_mlx_lm() {
    let (ids, want) = reference(&adapter_dir("llama-lora-mlx").join("reference.safetensors"));
    let loaded = load_both();
    assert_eq!(loaded.adapter_names(), ["a", "b"]);
    assert!(
        loaded
            .surgery_applied
            .iter()
            .any(|l| l.contains("runtime adapter `b`") && l.contains("8 linear layers")),
        "{:?}",
        loaded.surgery_applied
    );
    loaded.select_adapters(&AdapterMix::single("a")).unwrap();
    let runtime = logits_for(&loaded.model, &ids);
    assert_close(&runtime, &want, 1e-4, "runtime vs mlx-lm");

    let fused = load_model(
        model_dir("llama"),
        &LoadOptions {
            adapter: Some(adapter_dir("llama-lora-mlx")),
            ..options()
        },
    )
    .unwrap();
    assert_close(
        &runtime,
        &logits_for(&fused.model, &ids),
        1e-4,
        "runtime vs fused",
    );

    // The PEFT layout of the same A/B gives the same runtime output.
    let peft = load_model(
        model_dir("llama"),
        &LoadOptions {
            runtime_adapters: vec![("p".into(), adapter_dir("llama-lora-peft"))],
            ..options()
        },
    )
    .unwrap();
    peft.select_adapters(&AdapterMix::single("p")).unwrap();
    assert_close(
        &logits_for(&peft.model, &ids),
        &runtime,
        1e-5,
        "PEFT vs mlx-lm layout, runtime",
    );

    // Above, each adapted layer's term rides in the CPU kernel's node; with the kernel off
    // (MLXCEL_CPU_KERNELS=0) it is built from MLX ops, as on a GPU: the same logits.
    let policy =
        RuntimePolicy::from_vars(|v| (v == "MLXCEL_CPU_KERNELS").then(|| "0".to_string())).unwrap();
    let graph = load_model(
        model_dir("llama"),
        &LoadOptions {
            runtime_adapters: vec![("a".into(), adapter_dir("llama-lora-mlx"))],
            policy: Some(policy),
            ..options()
        },
    )
    .unwrap();
    graph.select_adapters(&AdapterMix::single("a")).unwrap();
    let graph = logits_for(&graph.model, &ids);
    assert_close(&graph, &want, 1e-4, "runtime from MLX ops vs mlx-lm");
    assert_close(
        &graph,
        &runtime,
        1e-4,
        "runtime from MLX ops vs in the kernel",
    );
}

#[test]
fn no_adapter_or_weight_zero_is_the_base_exactly() {
    let (ids, _) = reference(&adapter_dir("llama-lora-mlx").join("reference.safetensors"));
    let base = load_model(model_dir("llama"), &options()).unwrap();
    let want = logits_for(&base.model, &ids);
    let loaded = load_both();
    // Nothing is active after loading.
    assert_eq!(loaded.active_adapters(), AdapterMix::none());
    assert_eq!(logits_for(&loaded.model, &ids), want);
    loaded.select_adapters(&AdapterMix::single("a")).unwrap();
    assert_ne!(logits_for(&loaded.model, &ids), want);
    loaded
        .select_adapters(&AdapterMix::blend([("a", 0.0), ("b", 0.0)]))
        .unwrap();
    assert_eq!(logits_for(&loaded.model, &ids), want, "weight 0");
    loaded.select_adapters(&AdapterMix::none()).unwrap();
    assert_eq!(logits_for(&loaded.model, &ids), want, "deselected");
}

#[test]
fn switching_adapters_gives_each_its_own_output() {
    let (ids, want_a) = reference(&adapter_dir("llama-lora-mlx").join("reference.safetensors"));
    let (_, want_b) = reference(&adapter_dir("llama-lora-mlx-b").join("reference.safetensors"));
    let (diff, _) = max_abs_diff(&want_a, &want_b);
    assert!(diff > 1e-2, "the two adapters barely differ ({diff})");
    let loaded = load_both();
    for (name, want) in [("a", &want_a), ("b", &want_b), ("a", &want_a)] {
        loaded.select_adapters(&AdapterMix::single(name)).unwrap();
        assert_close(
            &logits_for(&loaded.model, &ids),
            want,
            1e-4,
            &format!("adapter {name} vs mlx-lm"),
        );
    }
}

#[test]
fn blend_matches_the_numpy_fused_blend() {
    let path = fixtures_dir()
        .join("adapters")
        .join("blend-reference.safetensors");
    let (ids, want) = reference(&path);
    let bytes = std::fs::read(&path).unwrap();
    let weights = floats(&SafeTensors::deserialize(&bytes).unwrap(), "weights");
    let loaded = load_both();
    loaded
        .select_adapters(&AdapterMix::blend([("a", weights[0]), ("b", weights[1])]))
        .unwrap();
    assert_close(&logits_for(&loaded.model, &ids), &want, 1e-4, "blend");
}

#[test]
fn quantized_base_keeps_the_adapter_unfused_and_matches_qlora() {
    let (ids, want) =
        reference(&adapter_dir("llama-lora-mlx").join("reference-affine4-g64.safetensors"));
    let loaded = load_model(
        model_dir("llama-affine4-g64"),
        &LoadOptions {
            adapter: Some(adapter_dir("llama-lora-mlx")),
            ..options()
        },
    )
    .unwrap();
    assert_eq!(loaded.surgery_applied.len(), 1);
    assert!(
        loaded.surgery_applied[0].contains("kept unfused")
            && loaded.surgery_applied[0].contains("--lora-fuse"),
        "{:?}",
        loaded.surgery_applied
    );
    assert_eq!(
        loaded.active_adapters(),
        AdapterMix::single(LoadOptions::DEFAULT_ADAPTER)
    );
    let got = logits_for(&loaded.model, &ids);
    assert_close(
        &got,
        &want,
        1e-3,
        "runtime over affine4-g64 vs mlx-lm QLoRA",
    );
    // The adapter matters on this base too.
    loaded.select_adapters(&AdapterMix::none()).unwrap();
    let (moved, _) = max_abs_diff(&logits_for(&loaded.model, &ids), &want);
    assert!(
        moved > 1e-2,
        "the adapter barely changes the logits ({moved})"
    );
}

#[test]
fn bad_selections_and_mismatched_runtime_adapters_are_refused() {
    let loaded = load_both();
    let err = |mix: AdapterMix| loaded.select_adapters(&mix).unwrap_err().to_string();
    let msg = err(AdapterMix::single("c"));
    assert!(
        msg.contains("no runtime adapter named `c`") && msg.contains("a, b"),
        "{msg}"
    );
    let msg = err(AdapterMix::blend([("a", 1.0), ("a", 0.5)]));
    assert!(msg.contains("appears twice"), "{msg}");
    let msg = err(AdapterMix::weighted("a", f32::NAN));
    assert!(msg.contains("not finite"), "{msg}");
    // A refused selection changes nothing.
    assert_eq!(loaded.active_adapters(), AdapterMix::none());

    // An adapter for a model of other widths is refused at load, naming file and tensors.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("adapter_config.json"),
        r#"{"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 4, "scale": 2.0}}"#,
    )
    .unwrap();
    let key = mlxcel_core::ops::random::key(1).unwrap();
    let uniform = |shape: &[i32]| {
        mlxcel_core::ops::random::uniform(shape, mlxcel_core::Dtype::Float32, &key).unwrap()
    };
    mlxcel_core::weights::save_safetensors(
        tmp.path().join("adapters.safetensors"),
        &[
            (
                "model.layers.0.self_attn.q_proj.lora_a".to_string(),
                uniform(&[32, 4]),
            ),
            (
                "model.layers.0.self_attn.q_proj.lora_b".to_string(),
                uniform(&[4, 64]),
            ),
        ],
        None,
    )
    .unwrap();
    let msg = load_model(
        model_dir("llama"),
        &LoadOptions {
            runtime_adapters: vec![("x".into(), tmp.path().to_path_buf())],
            ..options()
        },
    )
    .unwrap_err()
    .to_string();
    for p in [
        "adapters.safetensors",
        "model.layers.0.self_attn.q_proj.lora_a",
        "does not fit",
    ] {
        assert!(msg.contains(p), "`{p}` not in: {msg}");
    }

    // A module no linear layer reads.
    std::fs::remove_file(tmp.path().join("adapters.safetensors")).unwrap();
    mlxcel_core::weights::save_safetensors(
        tmp.path().join("adapters.safetensors"),
        &[
            (
                "model.layers.9.self_attn.q_proj.lora_a".to_string(),
                uniform(&[64, 4]),
            ),
            (
                "model.layers.9.self_attn.q_proj.lora_b".to_string(),
                uniform(&[4, 64]),
            ),
        ],
        None,
    )
    .unwrap();
    let msg = load_model(
        model_dir("llama"),
        &LoadOptions {
            runtime_adapters: vec![("x".into(), tmp.path().to_path_buf())],
            ..options()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("model.layers.9.self_attn.q_proj") && msg.contains("not a linear layer"),
        "{msg}"
    );
}

/// Greedy ids of one generation.
fn greedy(stream: mlxcel_models::Result<mlxcel_models::TokenStream>) -> Vec<u32> {
    stream
        .unwrap()
        .flat_map(|piece| piece.unwrap().tokens)
        .collect()
}

/// The facade: adapters registered with `ModelBuilder::runtime_adapter`, chosen per request
/// (`Generation::adapters`, `Model::logits_with_adapters`); one session switching adapters
/// between two requests gets each adapter's own output (its caches are not reused across mixes).
#[test]
fn facade_selects_adapters_per_request() {
    use mlxcel_models::{AdapterMix, Generation, Model, Prompt};
    let (ids, want_a) = reference(&adapter_dir("llama-lora-mlx").join("reference.safetensors"));
    let (_, want_b) = reference(&adapter_dir("llama-lora-mlx-b").join("reference.safetensors"));
    let model = Model::load(model_dir("llama"))
        .without_tokenizer()
        .runtime_adapter("a", adapter_dir("llama-lora-mlx"))
        .runtime_adapter("b", adapter_dir("llama-lora-mlx-b"))
        .build()
        .unwrap();
    assert_eq!(model.info().adapters, ["a", "b"]);
    assert_eq!(model.info().default_adapters, AdapterMix::none());
    let vocab = model.info().vocab_size;
    let last = |all: &[f32]| all[all.len() - vocab..].to_vec();
    for (name, want) in [("a", &want_a), ("b", &want_b)] {
        let got = model
            .logits_with_adapters(&ids, &AdapterMix::single(name))
            .unwrap();
        assert_close(&got, &last(want), 1e-4, &format!("facade {name}"));
    }
    let base = Model::load(model_dir("llama"))
        .without_tokenizer()
        .build()
        .unwrap();
    assert_eq!(
        model.logits(&ids).unwrap(),
        base.logits(&ids).unwrap(),
        "no adapter by default"
    );

    let request = |mix: &str| Generation {
        max_new_tokens: Some(8),
        adapters: Some(AdapterMix::single(mix)),
        ..Generation::default()
    };
    let fresh_a = greedy(model.generate(Prompt::Ids(ids.clone()), request("a")));
    let fresh_b = greedy(model.generate(Prompt::Ids(ids.clone()), request("b")));
    assert_ne!(fresh_a, fresh_b, "the adapters give the same greedy ids");
    let mut session = model.session();
    assert_eq!(
        greedy(session.generate(Prompt::Ids(ids.clone()), request("a"))),
        fresh_a
    );
    assert_eq!(
        greedy(session.generate(Prompt::Ids(ids.clone()), request("b"))),
        fresh_b,
        "the second request reused caches of the first adapter"
    );

    let err = model
        .logits_with_adapters(&ids, &AdapterMix::single("c"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no runtime adapter named `c`"), "{err}");
}

/// The logits of `ids` with `adapter` fused at load and kept unfused (runtime, selected).
fn fused_and_runtime(adapter: &str, ids: &[u32]) -> (Vec<f32>, Vec<f32>, Vec<String>) {
    fused_and_runtime_on("llama", adapter, ids)
}

/// [`fused_and_runtime`] on the fixture `model`.
fn fused_and_runtime_on(
    model: &str,
    adapter: &str,
    ids: &[u32],
) -> (Vec<f32>, Vec<f32>, Vec<String>) {
    let fused = load_model(
        model_dir(model),
        &LoadOptions {
            adapter: Some(adapter_dir(adapter)),
            ..options()
        },
    )
    .unwrap();
    let runtime = load_model(
        model_dir(model),
        &LoadOptions {
            runtime_adapters: vec![("x".into(), adapter_dir(adapter))],
            ..options()
        },
    )
    .unwrap();
    runtime.select_adapters(&AdapterMix::single("x")).unwrap();
    (
        logits_for(&fused.model, ids),
        logits_for(&runtime.model, ids),
        fused.surgery_applied,
    )
}

/// DoRA in mlx-lm's layout (`fine_tune_type: dora`, magnitude `m`), fused and at runtime,
/// against mlx-lm's `DoRALinear` (≤ 2e-4, as the PEFT DoRA check below: 1e-5 of the largest
/// logit, 21.9; the fused weight `m (W + BA) / |W + BA|` rounds differently from mlx-lm's
/// rescaled outputs, and the prompt's 40 rows run as the CPU kernel's many-row GEMM).
#[test]
fn mlx_lm_dora_matches_mlx_lm() {
    let (ids, want) = reference(&adapter_dir("llama-dora-mlx").join("reference.safetensors"));
    let (fused, runtime, report) = fused_and_runtime("llama-dora-mlx", &ids);
    assert!(report[0].contains("mlx-lm DoRA"), "{report:?}");
    assert_close(&fused, &want, 2e-4, "mlx-lm DoRA fused vs mlx-lm");
    assert_close(&runtime, &want, 2e-4, "mlx-lm DoRA runtime vs mlx-lm");
}

/// PEFT adapters made by peft on the transformers model (per-module `rank_pattern` and
/// `alpha_pattern`; and the same with `use_dora`), fused and at runtime, against transformers'
/// logits after peft's `merge_and_unload` (≤ 2e-4).
#[test]
fn peft_adapters_match_transformers_merge_and_unload() {
    for name in ["llama-lora-peft-hf", "llama-dora-peft-hf"] {
        let (ids, want) = reference(&adapter_dir(name).join("reference.safetensors"));
        let (fused, runtime, _) = fused_and_runtime(name, &ids);
        assert_close(
            &fused,
            &want,
            2e-4,
            &format!("{name} fused vs transformers"),
        );
        assert_close(
            &runtime,
            &want,
            2e-4,
            &format!("{name} runtime vs transformers"),
        );
    }
}

/// LoRA on token embeddings and output heads (`make_embed_adapters.py`), fused and at runtime:
/// mlx-lm's `LoRAEmbedding` + `LoRALinear` on the untied `lm_head` (and q_proj) against mlx-lm;
/// `LoRAEmbedding` on a tied table, which the output head (`as_linear`) shares, against mlx-lm;
/// PEFT's `lora_embedding_A/B` + `lm_head` against transformers after `merge_and_unload`.
/// Weight 0 is the base exactly, and the adapters move the logits.
#[test]
fn embedding_and_head_adapters_match_mlx_lm_and_peft() {
    for (model, name, layers, bound) in [
        ("llama", "llama-embed-lora-mlx", 4, 1e-4),
        ("qwen3", "qwen3-tied-embed-lora-mlx", 3, 1e-4),
        ("llama", "llama-embed-lora-peft-hf", 4, 2e-4),
    ] {
        let (ids, want) = reference(&adapter_dir(name).join("reference.safetensors"));
        let (fused, runtime, report) = fused_and_runtime_on(model, name, &ids);
        assert!(
            report[0].contains(&format!("fused into {layers} layers")),
            "{name}: {report:?}"
        );
        assert_close(&fused, &want, bound, &format!("{name} fused"));
        assert_close(&runtime, &want, bound, &format!("{name} runtime"));

        let loaded = load_model(
            model_dir(model),
            &LoadOptions {
                runtime_adapters: vec![("x".into(), adapter_dir(name))],
                ..options()
            },
        )
        .unwrap();
        let base = logits_for(
            &load_model(model_dir(model), &options()).unwrap().model,
            &ids,
        );
        loaded
            .select_adapters(&AdapterMix::weighted("x", 0.0))
            .unwrap();
        assert_eq!(logits_for(&loaded.model, &ids), base, "{name}: weight 0");
        let (moved, _) = max_abs_diff(&base, &want);
        assert!(
            moved > 1e-2,
            "{name}: the adapter barely moves the logits ({moved})"
        );
    }
}

/// A DoRA adapter rescales whole output rows, so it is never blended; alone, weight 0 is still
/// the base exactly.
#[test]
fn dora_is_not_blended() {
    let (ids, _) = reference(&adapter_dir("llama-dora-mlx").join("reference.safetensors"));
    let loaded = load_model(
        model_dir("llama"),
        &LoadOptions {
            runtime_adapters: vec![
                ("d".into(), adapter_dir("llama-dora-mlx")),
                ("a".into(), adapter_dir("llama-lora-mlx")),
            ],
            ..options()
        },
    )
    .unwrap();
    let msg = loaded
        .select_adapters(&AdapterMix::blend([("d", 1.0), ("a", 0.5)]))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("`d` is DoRA") && msg.contains("blended"),
        "{msg}"
    );
    let base = logits_for(&loaded.model, &ids);
    loaded
        .select_adapters(&AdapterMix::blend([("d", 0.0), ("a", 0.0)]))
        .unwrap();
    assert_eq!(logits_for(&loaded.model, &ids), base);
}

/// mlx-lm's `LoRASwitchLinear` on the stacked experts of the qwen3_moe fixture (plus q_proj),
/// fused (`W[e] += scale·B[e]·A[e]`) and at runtime (gathered low-rank products), against
/// mlx-lm (≤ 1e-4).
#[test]
fn moe_expert_adapters_match_mlx_lm() {
    let dir = adapter_dir("qwen3_moe-lora-mlx");
    let (ids, want) = reference(&dir.join("reference.safetensors"));
    let fused = load_model(
        model_dir("qwen3_moe"),
        &LoadOptions {
            adapter: Some(dir.clone()),
            ..options()
        },
    )
    .unwrap();
    assert!(
        fused.surgery_applied[0].contains("fused into 8 layers"),
        "{:?}",
        fused.surgery_applied
    );
    assert_close(
        &logits_for(&fused.model, &ids),
        &want,
        1e-4,
        "MoE adapter fused vs mlx-lm",
    );
    let runtime = load_model(
        model_dir("qwen3_moe"),
        &LoadOptions {
            runtime_adapters: vec![("moe".into(), dir)],
            ..options()
        },
    )
    .unwrap();
    let base = logits_for(&runtime.model, &ids);
    runtime.select_adapters(&AdapterMix::single("moe")).unwrap();
    let got = logits_for(&runtime.model, &ids);
    assert_close(&got, &want, 1e-4, "MoE adapter runtime vs mlx-lm");
    // The last position again as a one-token decode step over the cached prefix (the
    // decode-sized, unsorted expert path).
    use mlxcel_arch::LanguageModel;
    let tokens = |ids: &[u32]| {
        let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        mlxcel_core::Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap()
    };
    let mut caches = runtime.model.make_caches();
    let n = ids.len();
    runtime
        .model
        .forward(&tokens(&ids[..n - 1]), &mut caches)
        .unwrap();
    let step = runtime
        .model
        .forward(&tokens(&ids[n - 1..]), &mut caches)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_close(
        &step,
        &want[want.len() - step.len()..],
        1e-4,
        "MoE adapter runtime decode step vs mlx-lm",
    );
    let (moved, _) = max_abs_diff(&base, &want);
    assert!(
        moved > 1e-2,
        "the adapter barely changes the logits ({moved})"
    );
}

/// An mlx-lm adapter folder with a random rank-2 pair (uniform in ±0.1, scale 1.5) on each of
/// `modules`, whose `[out, in]` shapes are given.
fn write_mlx_adapter(dir: &Path, modules: &[(String, [i32; 2])]) {
    let mut tensors = Vec::new();
    for (i, (module, [out, inp])) in modules.iter().enumerate() {
        for (j, (suffix, shape)) in [("lora_a", [*inp, 2]), ("lora_b", [2, *out])]
            .into_iter()
            .enumerate()
        {
            let key = mlxcel_core::ops::random::key(1000 + (2 * i + j) as u64).unwrap();
            let a = mlxcel_core::ops::random::uniform(&shape, mlxcel_core::Dtype::Float32, &key)
                .and_then(|a| a.add_scalar(-0.5))
                .and_then(|a| a.mul_scalar(0.2))
                .unwrap();
            tensors.push((format!("{module}.{suffix}"), a));
        }
    }
    mlxcel_core::weights::save_safetensors(dir.join("adapters.safetensors"), &tensors, None)
        .unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        r#"{"fine_tune_type": "lora", "lora_parameters": {"rank": 2, "scale": 1.5}}"#,
    )
    .unwrap();
}

/// Every registered decoder fixture takes runtime adapters on its layers' projections: an
/// adapter on every 2-D weight inside its layers (sanitised names; the ones the model does not
/// build as linear layers, named by the load's error, are left out and listed) gives the same
/// logits unfused as fused into the weights (within 1e-4 of the largest logit: float32 rounding
/// of two summation orders, carried through every adapted layer), weight 0 gives the base
/// exactly, and attention and MLP projections are among those adapted wherever the model has
/// them.
#[test]
fn every_decoder_takes_runtime_adapters_on_its_projections() {
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures_dir().join("models/index.json")).unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for fixture in index["fixtures"].as_array().unwrap() {
        if fixture["kind"] != "f32-transformers" {
            continue;
        }
        let name = fixture["name"].as_str().unwrap();
        let dir = model_dir(name);
        let config = mlxcel_loading::read_config(&dir).unwrap();
        let raw = mlxcel_core::WeightMap::open(&dir).unwrap();
        let weights = mlxcel_arch::detection::get_model_type(&config, false)
            .and_then(|t| mlxcel_arch::sanitized_weights(t, &config, raw))
            .unwrap_or_else(|_| mlxcel_core::WeightMap::open(&dir).unwrap());
        let layer = layer_markers();
        let mut modules: Vec<(String, [i32; 2])> = weights
            .names()
            .filter(|n| layer.iter().any(|l| n.contains(l)) && n.ends_with(".weight"))
            .filter_map(|n| {
                let info = weights.info(n)?;
                (info.shape.len() == 2 && info.dtype.is_float()).then(|| {
                    (
                        n.trim_end_matches(".weight").to_string(),
                        [info.shape[0], info.shape[1]],
                    )
                })
            })
            .filter(|(n, _)| !n.contains("norm") && !n.contains("embed"))
            .collect();
        let mut left_out = Vec::new();
        let tmp = tempfile::tempdir().unwrap();
        let runtime = loop {
            write_mlx_adapter(tmp.path(), &modules);
            match load_model(
                &dir,
                &LoadOptions {
                    runtime_adapters: vec![("x".into(), tmp.path().to_path_buf())],
                    ..options()
                },
            ) {
                Ok(l) => break l,
                Err(e) => {
                    let msg = e.to_string();
                    let Some(cut) = msg.find("` is not a linear layer") else {
                        panic!("{name}: {msg}");
                    };
                    let module = msg[..cut].rsplit('`').next().unwrap().to_string();
                    assert!(modules.iter().any(|m| m.0 == module), "{name}: {msg}");
                    modules.retain(|m| m.0 != module);
                    left_out.push(module);
                }
            }
        };
        assert!(!modules.is_empty(), "{name}: no projection takes adapters");
        let has = |words: &[&str], list: &[String]| {
            list.iter().any(|m| words.iter().any(|w| m.contains(w)))
        };
        let adapted: Vec<String> = modules.iter().map(|m| m.0.clone()).collect();
        for words in [
            &["attn", "attention"][..],
            &["mlp", "feed_forward", "ffn"][..],
        ] {
            let present = has(words, &adapted) || has(words, &left_out);
            assert!(
                !present || has(words, &adapted),
                "{name}: none of the {words:?} projections takes adapters (left out: {left_out:?})"
            );
        }
        let ids = mlxcel_tests::reference(name).prompt_ids;
        let base = logits_for(&load_model(&dir, &options()).unwrap().model, &ids);
        runtime.select_adapters(&AdapterMix::single("x")).unwrap();
        let unfused = logits_for(&runtime.model, &ids);
        let fused = load_model(
            &dir,
            &LoadOptions {
                adapter: Some(tmp.path().to_path_buf()),
                ..options()
            },
        )
        .unwrap_or_else(|e| panic!("{name}: fused: {e}"));
        let fused = logits_for(&fused.model, &ids);
        let scale = fused.iter().fold(1f32, |m, v| m.max(v.abs()));
        let (diff, at) = max_abs_diff(&unfused, &fused);
        assert!(
            diff <= 1e-4 * scale,
            "{name}: runtime vs fused max |Δ| {diff:.2e} at {at} (max |logit| {scale})"
        );
        let (moved, _) = max_abs_diff(&unfused, &base);
        assert!(
            moved > 1e-3,
            "{name}: the adapter does not move the logits ({moved})"
        );
        runtime
            .select_adapters(&AdapterMix::weighted("x", 0.0))
            .unwrap();
        // Weight 0 is the base model up to float rounding: two passes of the same model on
        // the CPU may sum in another order (seen once in CI at 4e-6 relative, under load).
        let (off, at) = max_abs_diff(&logits_for(&runtime.model, &ids), &base);
        assert!(
            off <= 1e-5 * scale,
            "{name}: weight 0 moves the logits by {off:.2e} at {at}"
        );
        eprintln!(
            "{name}: {} projections adapted, runtime vs fused {diff:.1e}; left out: {left_out:?}",
            adapted.len()
        );
        checked += 1;
    }
    assert!(checked >= 50, "only {checked} decoder fixtures");
}

/// Substrings that put a tensor inside a decoder's layer stack.
fn layer_markers() -> [&'static str; 3] {
    [".layers.", ".h.", ".blocks."]
}
