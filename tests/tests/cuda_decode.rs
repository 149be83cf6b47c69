//! mlxcel's CUDA decode step (`MLXCEL_CUDA_DECODE`) against the MLX graph it replaces: the same
//! quantized or dense model loaded twice in bf16 and in f16, once per path, fed the same tokens
//! across a prompt fed one position at a time, decode steps, a cache growth step and prefix
//! reuse (a second prompt that rewinds the caches, after which the step writes over rows the
//! first turn left behind). Both paths' logits are measured against a float32 replay of the same
//! tokens on MLX's CPU: the step may be no further from it than the graph is, plus a share of
//! the dtype's rounding (each step's distances printed).
//!
//! Needs MLX's CUDA backend and a GPU: `#[ignore]`d here; on the GPU machine run the test binary
//! with `--ignored` and `MLXCEL_FIXTURES_DIR` (xtask/bench/gpu_probe.sh decode does).
//! Its own test binary, because the installed policy is process-wide.

use mlxcel_arch::generate::{argmax_token, Session};
use mlxcel_core::{Dtype, RuntimePolicy};
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::{decode_step_census, floats, max_abs_diff, model_dir};

/// How far the CUDA step may be from the float32 reference, beyond the graph's own distance
/// from it: both paths round every activation to the dtype (bf16: 8 bits of mantissa, f16: 11)
/// in different places and orders, the step keeps more of its sums in float32, so it must be
/// no worse than the graph by more than this share of the largest logit. A defect (a row of
/// the cache, a rope angle or a head off) moves the logits by tens of percent.
fn slack(dtype: Dtype) -> f32 {
    if dtype == Dtype::Float16 {
        2e-3
    } else {
        1.5e-2
    }
}

/// Under the environment's policy (so that a GPU probe can test the step's variants, e.g.
/// `MLXCEL_CUDA_DECODE_GEMV` or `MLXCEL_CUDA_DECODE_TC`), the step on or off.
fn load(dir: &std::path::Path, engine: bool, dtype: Dtype) -> Loaded {
    let from_env = RuntimePolicy::from_env().expect("the MLXCEL_* variables parse");
    load_under(
        dir,
        dtype,
        RuntimePolicy {
            cuda_decode: engine,
            ..from_env
        },
    )
}

/// The fixture in `dir` in `dtype`, loaded (and run) under `policy`.
fn load_under(dir: &std::path::Path, dtype: Dtype, policy: RuntimePolicy) -> Loaded {
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

/// One prompt and the decode steps after it, as fed to both GPU paths, with each path's
/// logits after the prompt and after each step.
struct Turn {
    prompt: Vec<u32>,
    tokens: Vec<u32>,
    graph: Vec<Vec<f32>>,
    engine: Vec<Vec<f32>>,
}

/// Runs both sessions through `prompt` (prefill in `chunk`s, reusing what they hold) and `steps`
/// decode steps, both fed the graph's greedy token.
fn run_both(
    name: &str,
    graph: &mut Session,
    engine: &mut Session,
    prompt: &[u32],
    chunk: Option<usize>,
    steps: usize,
) -> Turn {
    let (reused_g, mut lg) = graph.prefill(prompt, chunk).unwrap();
    let (reused_e, mut le) = engine.prefill(prompt, chunk).unwrap();
    assert_eq!(reused_g, reused_e, "{name}: reused prefix");
    let mut turn = Turn {
        prompt: prompt.to_vec(),
        tokens: Vec::new(),
        graph: Vec::new(),
        engine: Vec::new(),
    };
    // Entry 0 holds the prefills' logits (a second prompt's prefill reads the rows the engine's
    // steps wrote), then each decode step's.
    for step in 0..=steps {
        if step > 0 {
            let token = argmax_token(&lg).unwrap();
            turn.tokens.push(token);
            lg = graph.step(token).unwrap();
            le = engine.step(token).unwrap();
        }
        let (g, e) = (floats(&lg), floats(&le));
        assert!(
            e.iter().all(|v| v.is_finite()),
            "{name}: step {step} logits are not finite"
        );
        turn.graph.push(g);
        turn.engine.push(e);
    }
    turn
}

/// The float32 logits of `turns` replayed on MLX's CPU (the reference both GPU paths are
/// measured against: MLX's CUDA float32 matmuls run in TF32, ../shared/device/README.md).
fn reference(dir: &std::path::Path, turns: &[Turn]) -> Vec<Vec<Vec<f32>>> {
    mlxcel_core::set_default_device(mlxcel_core::Device::Cpu).unwrap();
    let model = load(dir, false, Dtype::Float32);
    let mut session = Session::new(&model.model);
    let logits = turns
        .iter()
        .map(|turn| {
            let (_, first) = session.prefill(&turn.prompt, None).unwrap();
            let mut out = vec![floats(&first)];
            for &token in &turn.tokens {
                out.push(floats(&session.step(token).unwrap()));
            }
            out
        })
        .collect();
    drop(session);
    drop(model);
    mlxcel_core::set_default_device(mlxcel_core::Device::Gpu).unwrap();
    logits
}

/// Per model and dtype: the largest distance from the float32 reference of the graph and of
/// the CUDA step, and between the two, each as a share of the largest reference logit.
#[derive(Clone, Copy, Default)]
struct Distances {
    graph: f32,
    engine: f32,
    between: f32,
}

fn check_model(name: &str, dtype: Dtype, prompt: &[u32], steps: usize) -> Distances {
    check_dir(name, &model_dir(name), dtype, prompt, steps)
}

/// `check_model` on the model in `dir`, called `name`.
fn check_dir(
    name: &str,
    dir: &std::path::Path,
    dtype: Dtype,
    prompt: &[u32],
    steps: usize,
) -> Distances {
    let graph = load(dir, false, dtype);
    let engine = load(dir, true, dtype);
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
    let first = run_both(name, &mut sg, &mut se, prompt, Some(1), steps);
    let mut again = prompt[..prompt.len() - 3].to_vec();
    again.extend(prompt.iter().rev().take(7));
    let second = run_both(name, &mut sg, &mut se, &again, Some(1), steps);
    drop((sg, se));
    let turns = [first, second];
    let reference = reference(dir, &turns);
    let mut worst = Distances::default();
    let mut lines = Vec::new();
    for (turn, want) in turns.iter().zip(&reference) {
        let mut line = Vec::new();
        for ((g, e), r) in turn.graph.iter().zip(&turn.engine).zip(want) {
            let scale = r.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            let d = Distances {
                graph: max_abs_diff(g, r).0 / scale,
                engine: max_abs_diff(e, r).0 / scale,
                between: max_abs_diff(e, g).0 / scale,
            };
            line.push(format!("{:.1e}/{:.1e}", d.graph, d.engine));
            worst.graph = worst.graph.max(d.graph);
            worst.engine = worst.engine.max(d.engine);
            worst.between = worst.between.max(d.between);
        }
        lines.push(line.join(" "));
    }
    eprintln!(
        "{name} {}: per step, graph/step distance from float32: {}",
        dtype.name(),
        lines.join(" | ")
    );
    worst
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
fn cuda_step_matches_the_graph_on_llama_qwen_and_moe_fixtures() {
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
            // Routed experts (decode_moe.cu): renormalised softmax routing, 4-bit experts with
            // an 8-bit router (qwen3_moe), group 32 (mixtral), dense experts cast at load.
            "qwen3_moe-affine4-g64",
            "mixtral-affine4-g32",
            "qwen3_moe",
            "mixtral",
        ] {
            let d = check_model(name, dtype, &prompt(250, 500), 12);
            worst.push((name.to_string(), dtype, d));
        }
        // Models made on the GPU machine (`MLXCEL_DECODE_TEST_MODELS`, comma-separated folders:
        // gpu_probe.sh decode passes make_random_model.py's llama-wide, whose rows are long
        // and whose matrices tall, which the fixtures' are not).
        let extra = std::env::var("MLXCEL_DECODE_TEST_MODELS").unwrap_or_default();
        for dir in extra.split(',').filter(|d| !d.is_empty()) {
            let dir = std::path::Path::new(dir);
            let name = dir.file_name().map_or(dir.display().to_string(), |n| {
                n.to_string_lossy().into_owned()
            });
            let d = check_dir(&name, dir, dtype, &prompt(250, 500), 12);
            worst.push((name, dtype, d));
        }
    }
    for (name, dtype, d) in &worst {
        let (dtype, d) = (*dtype, *d);
        eprintln!(
            "{name} {}: max |Δ| logits from float32, graph {:.2e}, CUDA step {:.2e}; \
             between them {:.2e} (of the largest)",
            dtype.name(),
            d.graph,
            d.engine,
            d.between
        );
    }
    // Overlapped launches (on by default) must have been taken on a GPU that has them (a
    // Hopper's driver builds programmatic edges), not fallen back from.
    let overlap = RuntimePolicy::from_env().unwrap().cuda_decode_overlap
        && mlxcel_core::cuda_decode::programmatic_launch_available().unwrap();
    let overlapped = mlxcel_core::cuda_decode::overlapped_decoders();
    eprintln!("MLXCEL_CUDA_DECODE_OVERLAP {overlap}: {overlapped} steps built overlapped");
    assert_eq!(
        overlapped > 0,
        overlap,
        "overlapped launches as the policy asks"
    );
    for (name, dtype, d) in worst {
        let allowed = 1.5 * d.graph + slack(dtype);
        assert!(
            d.engine <= allowed,
            "{name} {}: the CUDA step is {:.2e} of the largest logit from float32, the graph \
             {:.2e} (allowed {allowed:.2e})",
            dtype.name(),
            d.engine,
            d.graph
        );
    }
}

/// MoE prefill's routed-expert products on mlxcel's `qmm_gather` (`MLXCEL_CUDA_GATHER`) against
/// the path it replaces: one prompt of 300 positions prefilled in one chunk, its (token,
/// expert) rows sorted by expert, with the kernel on and with the expert stacks dequantized for
/// MLX's gathered matmul (`MLXCEL_DEQUANT_ROWS=256`: every projection of the prompt, experts
/// included, then runs as a dense GEMM, so no MLX quantized GEMM is compiled). Both are measured
/// against the float32 replay on MLX's CPU, as the decode step is. The two must differ (the
/// kernel ran: it keeps the integer codes and float32 sums where the other path rounds the
/// weights to the dtype) and the kernel may be no further from float32 than the dequantized
/// path, plus the dtype's slack.
#[test]
#[ignore = "needs MLX's CUDA backend and a GPU (xtask/bench/gpu_probe.sh gather)"]
fn moe_prefill_on_qmm_gather_matches_the_dequantized_path() {
    assert!(on_gpu(), "MLX's default device is not a GPU");
    let tokens = prompt(300, 500);
    let mut failures = Vec::new();
    for dtype in [Dtype::Float16, Dtype::Bfloat16] {
        for name in ["qwen3_moe-affine4-g64", "mixtral-affine4-g32"] {
            let dir = model_dir(name);
            let model = load(&dir, false, dtype);
            let before = mlxcel_core::policy::current();
            let prefill = |gather: bool| {
                let policy = RuntimePolicy {
                    cuda_gather: gather,
                    dequant_rows: Some(256),
                    ..before.clone()
                };
                mlxcel_core::policy::install(&policy).unwrap();
                let mut session = Session::new(&model.model);
                let (_, logits) = session.prefill(&tokens, None).unwrap();
                floats(&logits)
            };
            let on = prefill(true);
            let off = prefill(false);
            mlxcel_core::policy::install(&before).unwrap();
            drop(model);
            let turn = Turn {
                prompt: tokens.clone(),
                tokens: Vec::new(),
                graph: vec![off.clone()],
                engine: vec![on.clone()],
            };
            let want = &reference(&dir, &[turn])[0][0];
            let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            let d_on = max_abs_diff(&on, want).0 / scale;
            let d_off = max_abs_diff(&off, want).0 / scale;
            let between = max_abs_diff(&on, &off).0 / scale;
            eprintln!(
                "{name} {}: prefill logits from float32, qmm_gather {d_on:.2e}, dequantized \
                 {d_off:.2e}; between them {between:.2e} (of the largest)",
                dtype.name()
            );
            let allowed = 1.5 * d_off + slack(dtype);
            if !(on.iter().all(|v| v.is_finite()) && between > 0.0 && d_on <= allowed) {
                failures.push(format!(
                    "{name} {}: qmm_gather {d_on:.2e} from float32 (allowed {allowed:.2e}), \
                     {between:.2e} from the dequantized path (0 = the kernel did not run)",
                    dtype.name()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The prompt-side variants that are off by default, each against the path it replaces:
/// mlxcel's `heads_rope` kernel (`MLXCEL_CUDA_PREFILL_ROPE`: the fused projection put into
/// heads with queries and keys rotated, one launch per layer) against MLX's rope on each
/// operand, the residual adds folded into the dequantized GEMMs
/// (`MLXCEL_PREFILL_FOLD_RESIDUAL`: cuBLAS's epilogue) against separate adds, and the MoE
/// router as one kernel (`MLXCEL_CUDA_ROUTER`) against MLX's graph of it. A 300-position
/// prompt prefilled in chunks of 128 (rotations from positions 0, 128 and 256, the caches
/// growing under them), then 8 decode steps on the CUDA step, which read the keys and values
/// the prefill wrote. Each variant's greedy ids must be the default path's and its logits as
/// close to the float32 replay on MLX's CPU, plus the dtype's slack. Llama-style attention
/// (quantized, dense, MoE), q/k/v biases (qwen2), routed experts (mixtral, qwen3_moe), and
/// per-head q/k norms before the rope (qwen3, qwen3_moe: `heads_norm_rope`).
#[test]
#[ignore = "needs MLX's CUDA backend and a GPU (xtask/bench/gpu_ab.sh prefill)"]
fn prefill_variants_match_the_default_path() {
    assert!(on_gpu(), "MLX's default device is not a GPU");
    let tokens = prompt(300, 500);
    let mut failures = Vec::new();
    type Variant = fn(&mut RuntimePolicy);
    let variants: [(&str, Variant); 3] = [
        ("heads_rope", |p| p.cuda_prefill_rope = true),
        ("folded residual", |p| p.prefill_fold_residual = true),
        ("router kernel", |p| p.cuda_router = true),
    ];
    for dtype in [Dtype::Float16, Dtype::Bfloat16] {
        for name in [
            "llama-affine4-g64",
            "llama",
            "qwen2",
            "mixtral-affine4-g32",
            "qwen3_moe-affine4-g64",
            "qwen3",
        ] {
            let dir = model_dir(name);
            let model = load(&dir, true, dtype);
            let before = mlxcel_core::policy::current();
            // The prompt (every projection dequantized for a dense GEMM, so no MLX quantized
            // GEMM compiles), then 8 steps fed `feed` (the default path's greedy ids) or its own.
            let run = |variant: Option<Variant>, feed: &[u32]| -> (Vec<u32>, Vec<Vec<f32>>) {
                let mut policy = RuntimePolicy {
                    dequant_rows: Some(16),
                    ..before.clone()
                };
                if let Some(change) = variant {
                    change(&mut policy);
                }
                mlxcel_core::policy::install(&policy).unwrap();
                let mut session = Session::new(&model.model);
                let (_, mut last) = session.prefill(&tokens, Some(128)).unwrap();
                let (mut ids, mut logits) = (Vec::new(), vec![floats(&last)]);
                for step in 0..8 {
                    let own = argmax_token(&last).unwrap();
                    ids.push(own);
                    last = session
                        .step(feed.get(step).copied().unwrap_or(own))
                        .unwrap();
                    logits.push(floats(&last));
                }
                (ids, logits)
            };
            let (ids, logits) = run(None, &[]);
            let runs: Vec<_> = variants
                .iter()
                .map(|(label, change)| (*label, run(Some(*change), &ids)))
                .collect();
            mlxcel_core::policy::install(&before).unwrap();
            drop(model);
            let turn = Turn {
                prompt: tokens.clone(),
                tokens: ids.clone(),
                graph: logits,
                engine: Vec::new(),
            };
            let want = reference(&dir, std::slice::from_ref(&turn)).remove(0);
            let distance = |logits: &[Vec<f32>], from: &[Vec<f32>]| {
                logits
                    .iter()
                    .zip(from)
                    .zip(&want)
                    .map(|((l, f), r)| {
                        max_abs_diff(l, f).0 / r.iter().fold(1.0f32, |s, v| s.max(v.abs()))
                    })
                    .fold(0f32, f32::max)
            };
            let d_default = distance(&turn.graph, &want);
            for (label, (variant_ids, variant_logits)) in runs {
                let d = distance(&variant_logits, &want);
                let between = distance(&variant_logits, &turn.graph);
                eprintln!(
                    "{name} {}: logits from float32, default {d_default:.2e}, {label} {d:.2e}; \
                     between them {between:.2e} (of the largest); greedy ids {}",
                    dtype.name(),
                    if variant_ids == ids {
                        "equal"
                    } else {
                        "DIFFER"
                    }
                );
                let allowed = 1.5 * d_default + slack(dtype);
                let finite = variant_logits.iter().flatten().all(|v| v.is_finite());
                if !(finite && d <= allowed && variant_ids == ids) {
                    failures.push(format!(
                        "{name} {} {label}: {d:.2e} from float32 (allowed {allowed:.2e}), ids \
                         {variant_ids:?} against {ids:?}",
                        dtype.name()
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Checkpoint tensors read straight into device memory (`MLXCEL_CUDA_LOAD=1`: pinned staging
/// buffers and driver copies, cpp/cuda_load.cc) make the same model as MLX's copy into unified
/// memory: the same bytes, so bit-equal logits over a prompt and decode steps, on quantized,
/// dense and MoE fixtures in bf16 (dense ones cast after the read), each tensor read from
/// whatever byte offset its file puts it at.
#[test]
#[ignore = "needs MLX's CUDA backend and a GPU (xtask/bench/gpu_probe.sh load)"]
fn tensors_read_into_device_memory_make_the_same_model() {
    assert!(on_gpu(), "MLX's default device is not a GPU");
    let tokens = prompt(40, 500);
    for name in [
        "llama-affine4-g64",
        "qwen3",
        "qwen3_moe-affine4-g64",
        "mixtral",
    ] {
        let dir = model_dir(name);
        let logits = |device_load: bool| {
            let policy = RuntimePolicy {
                cuda_load: device_load,
                ..RuntimePolicy::default()
            };
            let model = load_under(&dir, Dtype::Bfloat16, policy);
            let mut session = Session::new(&model.model);
            let (_, mut last) = session.prefill(&tokens, Some(1)).unwrap();
            let mut out = vec![floats(&last)];
            for _ in 0..8 {
                last = session.step(argmax_token(&last).unwrap()).unwrap();
                out.push(floats(&last));
            }
            out
        };
        let (mapped, device) = (logits(false), logits(true));
        for (step, (m, d)) in mapped.iter().zip(&device).enumerate() {
            assert!(
                m.iter()
                    .map(|v| v.to_bits())
                    .eq(d.iter().map(|v| v.to_bits())),
                "{name}: step {step}: logits differ (max |Δ| {:.2e})",
                max_abs_diff(m, d).0
            );
        }
        eprintln!("{name}: {} steps bit-equal", mapped.len());
    }
}
