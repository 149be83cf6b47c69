//! q/k/v and gate/up projections fused into one layer each at load (`fuse_projections`, the GPU
//! default) must compute what the layers as stored compute, must actually fuse where the
//! layers share a format, and must leave layers of different formats apart.

use mlxcel_core::Array;
use mlxcel_loading::{load_model, LanguageModel, LoadOptions, Loaded};
use mlxcel_tests::{assert_greedy_ids, logits_for, max_abs_diff, model_dir, reference};

fn load(name: &str, fuse: bool) -> Loaded {
    load_model(
        model_dir(name),
        &LoadOptions {
            skip_tokenizer: true,
            fuse_projections: Some(fuse),
            // The census counts a decode step's graph nodes; the CPU decode engine (unfused
            // layers only) would replace that graph. Every load here uses the same policy.
            policy: Some(mlxcel_core::RuntimePolicy {
                cpu_decode: false,
                ..mlxcel_core::RuntimePolicy::default()
            }),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Matmul arrays (dense or quantized) in the graph of one decode step after `prompt`.
fn matmuls_per_step(loaded: &Loaded, prompt: &[u32]) -> usize {
    let ids: Vec<i32> = prompt.iter().map(|t| *t as i32).collect();
    let mut caches = loaded.model.make_caches();
    let prefill = Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap();
    loaded
        .model
        .forward(&prefill, &mut caches)
        .unwrap()
        .eval()
        .unwrap();
    let step = Array::from_slice(&ids[..1], &[1, 1]).unwrap();
    let logits = loaded.model.forward(&step, &mut caches).unwrap();
    mlxcel_core::ops::graph_census([&logits])
        .unwrap()
        .iter()
        .filter(|(name, _)| name.contains("Matmul") || name == "MlxcelCpuLinear")
        .map(|(_, n)| n)
        .sum()
}

/// Loads `name` fused and as stored, checks both compute the same logits and the fused model
/// the reference's greedy ids, and returns how many matmuls per decode step fusing saved.
fn fused_against_stored(name: &str) -> usize {
    let r = reference(name);
    let fused = load(name, true);
    let stored = load(name, false);
    let got = logits_for(&fused.model, &r.prompt_ids);
    let want = logits_for(&stored.model, &r.prompt_ids);
    let (diff, at) = max_abs_diff(&got, &want);
    assert!(
        diff <= 1e-5,
        "{name}: fused logits differ by {diff:.2e} at {at}"
    );
    assert_greedy_ids(&fused.model, &r, name);
    let (f, s) = (
        matmuls_per_step(&fused, &r.prompt_ids),
        matmuls_per_step(&stored, &r.prompt_ids),
    );
    assert!(f <= s, "{name}: {s} matmuls stored, {f} fused");
    s - f
}

#[test]
fn fused_projections_compute_what_the_stored_layers_compute() {
    // (fixture, matmuls per layer and decode step the fusion must save)
    for (name, saved) in [
        ("llama", 3),             // dense f32: q/k/v -> 1 and gate/up -> 1
        ("qwen2", 3),             // q/k/v with biases
        ("qwen3", 3),             // per-head qk-norm after the fused split
        ("olmoe", 2),             // full-width qk-norm; MoE layers (q/k/v only)
        ("gemma", 3),             // GELU gate
        ("phi3", 3),              // stored fused, split at load, fused back
        ("llama-affine4-g64", 3), // quantized planes concatenated
        ("llama-mxfp4", 3),       // no biases plane
        ("qwen3-affine4-g64", 3),
    ] {
        let config = std::fs::read_to_string(model_dir(name).join("config.json")).unwrap();
        let config: serde_json::Value = serde_json::from_str(&config).unwrap();
        let layers = config["num_hidden_layers"]
            .as_u64()
            .expect("num_hidden_layers") as usize;
        assert_eq!(
            fused_against_stored(name),
            saved * layers,
            "{name}: matmuls saved"
        );
    }
}

#[test]
fn layers_stored_in_different_formats_stay_apart() {
    // Mixed precision: layer 0 stores all projections at 3 bits (q/k/v and gate/up fuse);
    // layer 1 stores v_proj at 6 bits (q/k/v stay apart) and gate/up at 3 (they fuse).
    assert_eq!(fused_against_stored("llama-mixed_3_6"), 2 + 1 + 1);
}
