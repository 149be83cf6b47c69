//! mlxcel's CUDA decode step (`MLXCEL_CUDA_DECODE`) against the MLX graph it replaces: the same
//! quantized or dense model loaded twice in bf16 and in f16, once per path, fed the same tokens,
//! must give the same logits within the dtype's rounding (printed per step), across a prompt fed
//! one position at a time, decode steps, a cache growth step and prefix reuse (a second prompt
//! that rewinds the caches, after which the step writes over rows the first turn left behind).
//!
//! Needs MLX's CUDA backend and a GPU: `#[ignore]`d here; on the GPU machine run the test binary
//! with `--ignored` and `MLXCEL_FIXTURES_DIR` (xtask/bench/gpu_probe.sh decode does).
//! Its own test binary, because the installed policy is process-wide.

use mlxcel_arch::generate::{argmax_token, Session};
use mlxcel_core::{Array, Dtype, RuntimePolicy};
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::{decode_step_census, max_abs_diff, model_dir};

/// Largest logit difference allowed, as a share of the largest logit (at least 1), by
/// activation dtype: both paths round every activation to it (bf16: 8 bits of mantissa, f16: 11),
/// in different places and orders.
fn tolerance(dtype: Dtype) -> f32 {
    if dtype == Dtype::Float16 {
        0.006
    } else {
        0.04
    }
}

fn load(dir: &std::path::Path, engine: bool, dtype: Dtype) -> Loaded {
    let policy = RuntimePolicy {
        cuda_decode: engine,
        ..RuntimePolicy::default()
    };
    load_model(
        dir,
        &LoadOptions {
            skip_tokenizer: true,
            dtype: Some(dtype),
            policy: Some(policy),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn row(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32)
        .unwrap()
        .reshape(&[-1])
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
}

/// Runs both sessions through `prompt` (prefill in `chunk`s, reusing what they hold) and `steps`
/// decode steps, both fed the graph's greedy token; returns each step's largest logit difference
/// relative to the largest logit (step 0: the prefills').
fn run_both(
    name: &str,
    graph: &mut Session,
    engine: &mut Session,
    prompt: &[u32],
    chunk: Option<usize>,
    steps: usize,
) -> Vec<f32> {
    let (reused_g, mut lg) = graph.prefill(prompt, chunk).unwrap();
    let (reused_e, mut le) = engine.prefill(prompt, chunk).unwrap();
    assert_eq!(reused_g, reused_e, "{name}: reused prefix");
    let mut diffs = Vec::new();
    // Step 0 compares the prefills' logits (a second prompt's prefill reads the rows the
    // engine's steps wrote), then each decode step's.
    for step in 0..=steps {
        if step > 0 {
            let token = argmax_token(&lg).unwrap();
            lg = graph.step(token).unwrap();
            le = engine.step(token).unwrap();
        }
        let (g, e) = (row(&lg), row(&le));
        let scale = g.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let (d, _) = max_abs_diff(&e, &g);
        assert!(d.is_finite(), "{name}: step {step} logits are not finite");
        diffs.push(d / scale);
    }
    diffs
}

/// The largest relative logit difference over both prompts of `name` in `dtype` (per-step
/// differences printed).
fn check_model(name: &str, dtype: Dtype, prompt: &[u32], steps: usize) -> f32 {
    let dir = model_dir(name);
    let graph = load(&dir, false, dtype);
    let engine = load(&dir, true, dtype);
    let on_graph = decode_step_census(&graph.model);
    let on_engine = decode_step_census(&engine.model);
    assert!(
        !on_graph.iter().any(|(p, _)| p == "CudaDecodeStep"),
        "{name}: the graph load must not use the CUDA step: {on_graph:?}"
    );
    assert_eq!(
        on_engine,
        [("CudaDecodeStep".to_string(), 1)],
        "{name}: a decode step must be the CUDA step alone"
    );
    let mut sg = Session::new(&graph.model);
    let mut se = Session::new(&engine.model);
    // Prompts go in one position at a time: each path then writes every cache row itself (the
    // engine's rows are read back by its later steps), and no prefill runs MLX's CUTLASS
    // quantized GEMM, which compiles for 13-75 s per new shape on its first use (and is wrong
    // for K = 64: ../shared/device/README.md).
    let d1 = run_both(name, &mut sg, &mut se, prompt, Some(1), steps);
    let mut second = prompt[..prompt.len() - 3].to_vec();
    second.extend(prompt.iter().rev().take(7));
    let d2 = run_both(name, &mut sg, &mut se, &second, Some(1), steps);
    let show = |d: &[f32]| {
        d.iter()
            .map(|v| format!("{v:.1e}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    eprintln!(
        "{name} {}: per step {} | {}",
        dtype.name(),
        show(&d1),
        show(&d2)
    );
    d1.into_iter().chain(d2).fold(0.0, f32::max)
}

/// Seeded ids below `vocab`.
fn prompt(n: usize, vocab: u32) -> Vec<u32> {
    let mut x: u64 = 7;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % u64::from(vocab)) as u32
        })
        .collect()
}

fn on_gpu() -> bool {
    mlxcel_core::default_device().ok() == Some(mlxcel_core::Device::Gpu)
}

#[test]
#[ignore = "needs MLX's CUDA backend and a GPU (xtask/bench/gpu_probe.sh decode)"]
fn cuda_step_matches_the_graph_on_llama_and_qwen_fixtures() {
    assert!(on_gpu(), "MLX's default device is not a GPU");
    // 250 prompt positions and 12 steps cross the caches' 256-row growth step.
    let mut worst = Vec::new();
    // f16 first: its rounding is ~8x finer than bf16's, so it tells a defect from rounding.
    for dtype in [Dtype::Float16, Dtype::Bfloat16] {
        for name in [
            "llama-affine4-g32",
            "llama-affine4-g64",
            "llama-affine8-g64",
            "qwen3-affine4-g64",
            // Dense weights (cast at load), q/k/v biases (qwen2), per-head q/k norms (qwen3).
            "llama",
            "qwen2",
            "qwen3",
        ] {
            let d = check_model(name, dtype, &prompt(250, 500), 12);
            worst.push((name, dtype, d));
        }
    }
    for &(name, dtype, d) in &worst {
        eprintln!(
            "{name} {}: CUDA step vs graph max |Δ| logits {d:.2e} of the largest",
            dtype.name()
        );
    }
    for (name, dtype, d) in worst {
        assert!(
            d <= tolerance(dtype),
            "{name} {}: logits differ by {d:.2e} of the largest (allowed {:.1e})",
            dtype.name(),
            tolerance(dtype)
        );
    }
}
