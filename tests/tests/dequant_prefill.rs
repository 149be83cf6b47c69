//! The GPU prefill path (quantized layers dequantized and run as dense GEMMs from
//! `MLXCEL_DEQUANT_ROWS` rows, here a `RuntimePolicy` given to the loads) forced on here: it
//! must give the quantized kernels' results, and its dense copies kept between prompts
//! (`MLXCEL_PREFILL_DENSE_BYTES`) must give the transient copies' results. Its own test binary,
//! because the installed policy is process-wide (the tests below take turns).

use std::sync::Mutex;

use mlxcel_arch::nn::prefill_dense_bytes_kept;
use mlxcel_arch::LanguageModel;
use mlxcel_core::RuntimePolicy;
use mlxcel_loading::{load_model, LoadOptions};
use mlxcel_tests::{assert_matches_reference_with, logits_for, model_dir, reference};

/// The installed policy is process-wide: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn prefill_policy(dense_bytes: u64) -> RuntimePolicy {
    RuntimePolicy {
        dequant_rows: Some(2),
        prefill_dense_bytes: Some(dense_bytes),
        ..RuntimePolicy::default()
    }
}

#[test]
fn dequantized_prefill_matches_the_quantized_reference() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let policy = prefill_policy(0);
    mlxcel_core::policy::install(&policy).unwrap();
    assert_eq!(mlxcel_arch::nn::dequantize_rows_threshold(), 2);
    for name in [
        "llama-affine4-g64",
        "llama-mxfp4",
        "llama-nvfp4",
        "qwen3-affine4-g64",
        "llama-mixed_3_6",
        "qwen3_moe-affine4-g64",
        "mixtral-affine4-g32",
    ] {
        assert_matches_reference_with(name, 1e-3, Some(policy.clone()));
        assert_eq!(mlxcel_arch::nn::dequantize_rows_threshold(), 2);
    }
}

/// Prefill logits of fixture `name` for two prompts in a row under a dense-copy budget of
/// `dense_bytes`, and the bytes kept after them (the model is dropped before returning).
fn two_prefills(name: &str, dense_bytes: u64) -> (Vec<f32>, Vec<f32>, u64) {
    let loaded = load_model(
        model_dir(name),
        &LoadOptions {
            skip_tokenizer: true,
            policy: Some(prefill_policy(dense_bytes)),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    let ids = reference(name).prompt_ids;
    let first = logits_for(&loaded.model, &ids);
    let second = logits_for(&loaded.model, &ids);
    (first, second, prefill_dense_bytes_kept())
}

#[test]
fn kept_dense_copies_give_the_transient_copies_logits_within_their_budget() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for name in [
        "llama-affine4-g64",
        "llama-mixed_3_6",
        "qwen3_moe-affine4-g64",
    ] {
        assert_eq!(prefill_dense_bytes_kept(), 0, "{name}: bytes left kept");
        let (transient, again, kept) = two_prefills(name, 0);
        assert_eq!(kept, 0, "{name}: a zero budget keeps nothing");
        assert_eq!(transient, again, "{name}: transient copies vary");

        // Every quantized layer prefill reaches is kept, and the second prompt runs on them.
        let (first, second, all) = two_prefills(name, u64::MAX / 2);
        assert!(all > 0, "{name}: nothing kept");
        assert_eq!(first, transient, "{name}: the first prompt under a budget");
        assert_eq!(second, transient, "{name}: the prompt on the kept copies");
        assert_eq!(
            prefill_dense_bytes_kept(),
            0,
            "{name}: a dropped model's copies"
        );

        // Half the budget keeps some layers, never past it; the others dequantize per prompt.
        let (first, second, some) = two_prefills(name, all / 2);
        assert!(some > 0 && some <= all / 2, "{name}: {some} of {all} kept");
        assert_eq!(first, transient, "{name}: first prompt, half the budget");
        assert_eq!(second, transient, "{name}: second prompt, half the budget");
        assert_eq!(
            prefill_dense_bytes_kept(),
            0,
            "{name}: a dropped model's copies"
        );
    }
}

/// Fixture `name` loaded under `policy`.
fn load_under(name: &str, policy: RuntimePolicy) -> mlxcel_loading::Loaded {
    load_model(
        model_dir(name),
        &LoadOptions {
            skip_tokenizer: true,
            policy: Some(policy),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Prefill logits of fixture `name`'s reference prompt on `model`, and how many nodes of
/// primitive `counted` their graph holds.
fn prompt_logits(model: &dyn LanguageModel, name: &str, counted: &str) -> (Vec<f32>, usize) {
    let ids: Vec<i32> = reference(name)
        .prompt_ids
        .iter()
        .map(|&t| t as i32)
        .collect();
    let tokens = mlxcel_core::Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap();
    let mut caches = model.make_caches();
    let logits = model.forward(&tokens, &mut caches).unwrap();
    let nodes = mlxcel_core::ops::graph_census([&logits])
        .unwrap()
        .into_iter()
        .filter(|(primitive, _)| primitive == counted)
        .map(|(_, n)| n)
        .sum();
    (logits.to_vec::<f32>().unwrap(), nodes)
}

/// Prefill logits of fixture `name` under `policy`, and how many `AddMM` nodes their graph
/// holds (residual adds folded into a GEMM).
fn prefill_logits(name: &str, policy: RuntimePolicy) -> (Vec<f32>, usize) {
    let loaded = load_under(name, policy);
    prompt_logits(&loaded.model, name, "AddMM")
}

/// Kept copies are held transposed, as the GEMM reads them: a later prompt's graph has one
/// `Transpose` node fewer per kept layer (on a GPU, MLX spends host time on every node).
#[test]
fn kept_copies_leave_the_transposes_out_of_later_prompts() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let name = "llama-affine4-g64";
    let loaded = load_under(name, prefill_policy(u64::MAX / 2));
    let (first, first_transposes) = prompt_logits(&loaded.model, name, "Transpose");
    let (second, later_transposes) = prompt_logits(&loaded.model, name, "Transpose");
    assert_eq!(first, second);
    // Seven projections a layer (the CPU load keeps q/k/v and gate/up apart) and the head.
    let config = std::fs::read_to_string(model_dir(name).join("config.json")).unwrap();
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
    assert_eq!(
        first_transposes - later_transposes,
        7 * layers + 1,
        "Transpose nodes: first prompt {first_transposes}, later {later_transposes}"
    );
}

/// The residual adds folded into the prompt's dequantized GEMMs (`MLXCEL_PREFILL_FOLD_RESIDUAL`:
/// MLX's `addmm`) match the quantized reference as the separate adds do, and the separate
/// adds' logits within float32 rounding (on the CPU, BLAS adds the residual to the rounded
/// product, so they come out equal). Every layer folds two adds (attention's output, the
/// MLP's down projection), a MoE layer one (its experts' sum is added apart).
#[test]
fn residual_folded_into_the_prompt_gemm_matches_the_separate_add() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let folded = RuntimePolicy {
        prefill_fold_residual: true,
        ..prefill_policy(0)
    };
    for (name, per_layer) in [
        ("llama-affine4-g64", 2),
        ("qwen3-affine4-g64", 2),
        ("mixtral-affine4-g32", 1),
    ] {
        assert_matches_reference_with(name, 1e-3, Some(folded.clone()));
        let (apart, none) = prefill_logits(name, prefill_policy(0));
        let (fused, folds) = prefill_logits(name, folded.clone());
        let config = std::fs::read_to_string(model_dir(name).join("config.json")).unwrap();
        let config: serde_json::Value = serde_json::from_str(&config).unwrap();
        let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
        assert_eq!(none, 0, "{name}: AddMM nodes with the fold off");
        assert_eq!(
            folds,
            per_layer * layers,
            "{name}: AddMM nodes ({layers} layers)"
        );
        let scale = apart.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let (diff, _) = mlxcel_tests::max_abs_diff(&fused, &apart);
        assert!(
            diff <= 1e-5 * scale,
            "{name}: folded residual {diff:e} from the separate adds"
        );
    }
}
