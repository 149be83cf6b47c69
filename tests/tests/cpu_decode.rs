//! mlxcel's CPU decode engine (`MLXCEL_CPU_DECODE`, on by default) against the MLX
//! graph it replaces: the same model loaded twice, once per path, must give the same decode-step
//! logits (within 1e-3, printed) and the same greedy ids, across chunked prefill, decode steps,
//! growing caches and prefix reuse (a second prompt that rewinds the caches). Its own test binary,
//! because the installed policy is process-wide.

use mlxcel_arch::generate::{argmax_token, Session};
use mlxcel_arch::LanguageModel;
use mlxcel_core::RuntimePolicy;
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::{decode_step_census, floats, max_abs_diff, model_dir, reference};

const TOLERANCE: f32 = 1e-3;

/// Loads install their policy process-wide and the engine is chosen while building: one load
/// at a time, so tests running side by side do not build under each other's policy.
static LOADING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn load(dir: &std::path::Path, engine: bool) -> Loaded {
    let _one = LOADING.lock().unwrap_or_else(|e| e.into_inner());
    let policy = RuntimePolicy {
        cpu_decode: engine,
        ..RuntimePolicy::default()
    };
    load_model(
        dir,
        &LoadOptions {
            skip_tokenizer: true,
            policy: Some(policy),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Whether a decode step of `model` builds no MLX graph (the engine computed it).
fn engine_serves_decode(model: &dyn LanguageModel) -> bool {
    decode_step_census(model)
        .iter()
        .map(|(_, n)| n)
        .sum::<usize>()
        == 0
}

/// Runs both sessions through `prompt` (prefill in `chunk`s, reusing what they hold) and
/// `steps` greedy decode steps; returns the largest logit difference and checks the ids agree.
fn run_both(
    name: &str,
    graph: &mut Session,
    engine: &mut Session,
    prompt: &[u32],
    chunk: Option<usize>,
    steps: usize,
) -> (f32, Vec<u32>) {
    let (reused_g, lg) = graph.prefill(prompt, chunk).unwrap();
    let (reused_e, le) = engine.prefill(prompt, chunk).unwrap();
    assert_eq!(reused_g, reused_e, "{name}: reused prefix");
    let (mut worst, _) = max_abs_diff(&floats(&le), &floats(&lg));
    let mut ids = Vec::new();
    let (mut lg, mut le) = (lg, le);
    for step in 0..steps {
        let (tg, te) = (argmax_token(&lg).unwrap(), argmax_token(&le).unwrap());
        assert_eq!(tg, te, "{name}: greedy id at step {step}");
        ids.push(te);
        lg = graph.step(tg).unwrap();
        le = engine.step(te).unwrap();
        let (d, at) = max_abs_diff(&floats(&le), &floats(&lg));
        assert!(
            d <= TOLERANCE,
            "{name}: decode step {step} logits differ by {d:.2e} at {at}"
        );
        worst = worst.max(d);
    }
    (worst, ids)
}

/// The checks on one model folder; `prompt` long enough to cross a cache growth step when
/// `long`.
fn check_model(name: &str, dir: &std::path::Path, prompt: &[u32], steps: usize) -> f32 {
    let graph = load(dir, false);
    let engine = load(dir, true);
    assert!(
        !engine_serves_decode(&graph.model),
        "{name}: the graph load must not use the engine"
    );
    assert!(
        engine_serves_decode(&engine.model),
        "{name}: the decode engine does not cover this model"
    );
    let mut sg = Session::new(&graph.model);
    let mut se = Session::new(&engine.model);
    // Chunked prefill, then decode.
    let (d1, _) = run_both(name, &mut sg, &mut se, prompt, Some(5), steps);
    // A second prompt sharing all but the last three prompt tokens: both sessions rewind and
    // reuse the prefix, the engine then writes over rows the first turn left behind.
    let mut second = prompt[..prompt.len() - 3].to_vec();
    second.extend(prompt.iter().rev().take(7));
    let (d2, _) = run_both(name, &mut sg, &mut se, &second, None, steps);
    assert!(
        se.tokens().len() > second.len(),
        "{name}: the second turn decoded"
    );
    d1.max(d2)
}

#[test]
fn engine_matches_the_graph_on_dense_fixtures() {
    for name in [
        "llama",
        "llama-affine4-g32",
        "llama-affine4-g64",
        "llama-affine8-g64",
        "llama-rope-linear",
        "llama-rope-llama3",
        "qwen2",
        "qwen3",
        "qwen3-affine4-g64",
    ] {
        let r = reference(name);
        let d = check_model(name, &model_dir(name), &r.prompt_ids, 12);
        eprintln!("{name}: engine vs graph max |Δ| logits {d:.2e}");
        // And the engine's greedy ids are the reference's (transformers / mlx-lm goldens).
        let engine = load(&model_dir(name), true);
        mlxcel_tests::assert_greedy_ids(&engine.model, &r, name);
    }
}

#[test]
fn engine_leaves_other_models_to_the_graph() {
    // Sandwich norms and soft-capping, NoPE layers, a state-space stack, MoE, LayerNorm: not the engine's.
    for name in ["gemma2", "smollm3", "mamba", "qwen3_moe", "phi"] {
        let loaded = load(&model_dir(name), true);
        assert!(
            !engine_serves_decode(&loaded.model),
            "{name}: the engine must not claim this model"
        );
    }
}

#[test]
fn engine_matches_the_graph_on_smollm2() {
    let Some(dir) = mlxcel_tests::fetched_smollm2() else {
        return;
    };
    // Seeded ids past the special tokens, as `cargo xtask bench` draws them; 300 positions
    // cross the caches' 256-row growth step during decode.
    let mut x: u64 = 7;
    let prompt: Vec<u32> = (0..250)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (1000 + (x >> 33) % 31000) as u32
        })
        .collect();
    let d = check_model("SmolLM2-135M", &dir, &prompt, 16);
    eprintln!("SmolLM2-135M: engine vs graph max |Δ| logits {d:.2e}");
}

/// A conversation asked the same prompt twice: the second turn rewinds its caches to the
/// prompt and decodes again, and must give the first turn's tokens, with the engine on and off.
/// (The engine once wrote rows into caches split from a decode batch, which are strided views
/// of the batch's buffers, as if they were dense: the second turn's tokens were wrong.)
fn rewound_turn(engine: bool) -> (Vec<u32>, Vec<u32>) {
    use mlxcel_models::{Generation, Model, Prompt};
    let policy = RuntimePolicy {
        cpu_decode: engine,
        ..RuntimePolicy::default()
    };
    let model = Model::load(model_dir("llama"))
        .policy(policy)
        .build()
        .unwrap();
    let ids = reference("llama").prompt_ids[..10].to_vec();
    let greedy = || Generation {
        max_new_tokens: Some(12),
        extra_eos_token_ids: vec![],
        ..Generation::default()
    };
    let mut session = model.session();
    let mut turn = || -> Vec<u32> {
        session
            .generate(Prompt::Ids(ids.clone()), greedy())
            .unwrap()
            .flat_map(|p| p.unwrap().tokens)
            .collect()
    };
    let first = turn();
    (first, turn())
}

#[test]
fn a_rewound_conversation_decodes_as_a_fresh_one() {
    let (first, second) = rewound_turn(false);
    assert_eq!(first, second);
}

#[test]
fn a_rewound_conversation_decodes_as_a_fresh_one_on_the_engine() {
    let (first, second) = rewound_turn(true);
    assert_eq!(first, second);
}
