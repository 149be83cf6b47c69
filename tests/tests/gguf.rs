//! GGUF import against the golden fixtures: `tests/fixtures/gguf/*.gguf` (written by
//! `tests/fixtures/make_gguf.py` from the tiny f32 models) are converted with
//! `mlxcel_quant::gguf::import_gguf` and the converted folders' logits and greedy ids are
//! checked against the transformers references of the models they came from.

use std::collections::HashMap;
use std::path::PathBuf;

use mlxcel_core::{ops, Array, Dtype, WeightMap};
use mlxcel_loading::{load_model, LoadOptions};
use mlxcel_quant::gguf::import_gguf;
use mlxcel_tests::{
    assert_greedy_ids, fixtures_dir, logits_for, max_abs_diff, reference, Reference,
};

fn gguf(name: &str) -> PathBuf {
    fixtures_dir().join("gguf").join(format!("{name}.gguf"))
}

fn convert(name: &str) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    import_gguf(&gguf(name), out.path(), &mut |_, _, _| {})
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    out
}

fn options() -> LoadOptions {
    LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    }
}

/// Max |Δ| over the reference's logits, relative to its largest |logit|.
fn relative_diff(got: &[f32], r: &Reference) -> f32 {
    let scale = r.logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    max_abs_diff(got, &r.logits).0 / scale
}

#[test]
fn f32_ggufs_match_transformers() {
    for name in ["llama", "qwen2", "qwen3"] {
        let dir = convert(name);
        let loaded = load_model(dir.path(), &options()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let r = reference(name);
        let rel = relative_diff(&logits_for(&loaded.model, &r.prompt_ids), &r);
        assert!(rel <= 1e-4, "{name}: relative logit error {rel:.2e}");
        assert_greedy_ids(&loaded.model, &r, name);
    }
}

#[test]
fn converted_folder_is_a_full_checkpoint() {
    let dir = convert("qwen3");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["model_type"], "qwen3");
    assert_eq!(config["head_dim"], 32);
    assert_eq!(config["tie_word_embeddings"], true);
    // The tokenizer rebuilt from `tokenizer.ggml.*` encodes as the fixture's own does.
    let loaded = load_model(dir.path(), &LoadOptions::default()).unwrap();
    let tok = loaded.tokenizer.expect("tokenizer");
    let want = load_model(mlxcel_tests::model_dir("qwen3"), &LoadOptions::default())
        .unwrap()
        .tokenizer
        .expect("fixture tokenizer");
    let text = "<|im_start|>user\nThe quick brown fox, 42 times.<|im_end|>";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(ids, want.encode(text, false).unwrap());
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
}

/// The Q8_0 GGUF is imported as MLX affine 8-bit (group 32) planes. Their exact dequantization,
/// written back densely in f32, must give the same logits as the quantized folder (only the
/// kernel differs: `quantized_matmul` vs a dense matmul), to the f32 tolerance, and the same
/// greedy ids. Each dequantized weight must be within Q8_0's rounding of the original f32
/// weight: with d = max|block|/127, q = round(w/d) and d stored as f16 (relative error
/// ≤ 2^-11), |w − q·d16| ≤ d/2 + 127·d·2^-11 < 0.57·max|tensor|/127. Against the
/// f32 reference logits the bound is only a sanity check: this random tiny model (init range
/// 0.4, so saturated activations) turns that rounding into ~5e-2 relative logit error, so
/// 0.15 fails only on gross errors (a wrong scale, a dropped plane: errors of O(1)).
#[test]
fn q8_0_gguf_is_exact_against_its_dequantized_weights() {
    let q = convert("qwen3-q8_0");
    let w = WeightMap::open(q.path()).unwrap();
    let mut dense: HashMap<String, Array> = HashMap::new();
    let mut quantized = 0;
    for name in w.names().map(str::to_string).collect::<Vec<_>>() {
        if name.ends_with(".scales") || name.ends_with(".biases") {
            continue;
        }
        let module = name.strip_suffix(".weight").unwrap_or(&name);
        let arr = w.get(&name).unwrap();
        let arr = if w.contains(&format!("{module}.scales")) {
            quantized += 1;
            let f = |s: &str| w.get_as(&format!("{module}.{s}"), Dtype::Float32).unwrap();
            ops::dequantize(
                &arr,
                &f("scales"),
                Some(&f("biases")),
                ops::QuantSpec::affine(32, 8),
                Some(Dtype::Float32),
            )
            .unwrap()
        } else {
            arr.astype(Dtype::Float32).unwrap()
        };
        dense.insert(name, arr);
    }
    assert_eq!(quantized, 15, "7 linears × 2 layers + the embedding");
    let original = WeightMap::open(mlxcel_tests::model_dir("qwen3")).unwrap();
    for (name, arr) in &dense {
        let want = original
            .get_as(name, Dtype::Float32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let got = arr.to_vec::<f32>().unwrap();
        let bound = want.iter().fold(0f32, |m, v| m.max(v.abs())) * 0.57 / 127.0;
        let (diff, at) = max_abs_diff(&got, &want);
        assert!(
            diff <= bound,
            "{name}: |Δ| {diff:.2e} at {at} > {bound:.2e}"
        );
    }
    let d = tempfile::tempdir().unwrap();
    let tensors: Vec<(String, Array)> = dense.into_iter().collect();
    mlxcel_core::weights::save_safetensors(d.path().join("model.safetensors"), &tensors, None)
        .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(q.path().join("config.json")).unwrap())
            .unwrap();
    let obj = config.as_object_mut().unwrap();
    obj.remove("quantization");
    obj.remove("quantization_config");
    obj.insert("torch_dtype".into(), "float32".into());
    std::fs::write(d.path().join("config.json"), config.to_string()).unwrap();

    let r = reference("qwen3");
    let qm = load_model(q.path(), &options()).unwrap();
    let dm = load_model(d.path(), &options()).unwrap();
    let ql = logits_for(&qm.model, &r.prompt_ids);
    let dl = logits_for(&dm.model, &r.prompt_ids);
    let scale = dl.iter().fold(0f32, |m, v| m.max(v.abs()));
    let rel = max_abs_diff(&ql, &dl).0 / scale;
    assert!(rel <= 1e-4, "quantized vs dequantized: {rel:.2e}");
    let rel = relative_diff(&ql, &r);
    assert!(rel <= 0.15, "Q8_0 vs the f32 reference: {rel:.2e}");
    // Greedy ids of the two folders agree.
    let g = |m: &dyn mlxcel_arch::LanguageModel| {
        mlxcel_arch::generate::greedy(m, &r.prompt_ids, r.greedy_ids.len(), None, |_| false)
            .unwrap()
    };
    assert_eq!(g(&qm.model), g(&dm.model));
}
