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

/// GGUFs written by llama.cpp's own `convert_hf_to_gguf.py` (make_gguf.py `--stage arches`)
/// from the tiny fixtures: the import undoes llama.cpp's layout (Gemma's `1 + w` norms, stacked
/// experts, fused Phi-3 projections, llama's permuted q/k for Mistral) and maps the metadata
/// (softcaps, sliding windows and patterns, experts, partial rotary), so the logits match the
/// transformers reference of the model the GGUF came from.
///
/// Mistral is converted by llama.cpp as a `llama` GGUF, which has no sliding window: the
/// fixture's window of 8 is lost in the file (llama.cpp itself attends to everything). So the
/// first 8 positions, where the window changes nothing, must match transformers, and the later
/// ones differ (pinned, so a change in either side is seen).
#[test]
fn llama_cpp_converted_architectures_match_transformers() {
    let window = 8;
    let dir = convert("mistral");
    let loaded = load_model(dir.path(), &options()).unwrap();
    let r = reference("mistral");
    let got = logits_for(&loaded.model, &r.prompt_ids);
    assert!(r.prompt_ids.len() > window);
    let inside = window * r.vocab;
    let scale = r.logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    let rel_inside = max_abs_diff(&got[..inside], &r.logits[..inside]).0 / scale;
    let rel_after = max_abs_diff(&got[inside..], &r.logits[inside..]).0 / scale;
    eprintln!(
        "mistral: relative logit error {rel_inside:.2e} within the window, {rel_after:.2e} after"
    );
    assert!(
        rel_inside <= 1e-4,
        "mistral within the window: {rel_inside:.2e}"
    );
    assert!(rel_after > 1e-2, "mistral past the window: {rel_after:.2e}");

    for name in [
        "mixtral",
        "deepseek_v2",
        "qwen2_moe",
        "qwen3_moe",
        "gemma",
        "gemma3_text",
        "phi3",
    ] {
        let dir = convert(name);
        let loaded = load_model(dir.path(), &options()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let r = reference(name);
        let rel = relative_diff(&logits_for(&loaded.model, &r.prompt_ids), &r);
        eprintln!("{name}: relative logit error {rel:.2e}");
        assert!(rel <= 1e-4, "{name}: relative logit error {rel:.2e}");
        assert_greedy_ids(&loaded.model, &r, name);
    }
}

/// llama.cpp's Gemma 2 converter drops `lm_head` (real Gemma 2 models tie it): the GGUF of the
/// gemma2 fixture (untied) has the embedding as its head, so its reference is transformers' run
/// of the fixture with the head tied (`gguf/gemma2-tied.safetensors`). Softcaps, the sliding
/// window on layer 0, the sandwich norms stored as `1 + w` and the attention scale all count.
#[test]
fn llama_cpp_converted_gemma2_matches_transformers_with_its_tied_head() {
    let bytes = std::fs::read(fixtures_dir().join("gguf/gemma2-tied.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let read = |n: &str| st.tensor(n).unwrap().data().to_vec();
    let ids: Vec<u32> = read("prompt_ids")
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
        .collect();
    let want: Vec<f32> = read("logits")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert!(ids.len() > 8, "the prompt passes the sliding window");
    let dir = convert("gemma2");
    let loaded = load_model(dir.path(), &options()).unwrap();
    let got = logits_for(&loaded.model, &ids);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let rel = max_abs_diff(&got, &want).0 / scale;
    eprintln!("gemma2 (tied head): relative logit error {rel:.2e}");
    assert!(rel <= 1e-4, "gemma2: relative logit error {rel:.2e}");
}

/// Llama 3's rope scaling reaches a GGUF only as the factor table `rope_freqs.weight` (llama.cpp's
/// converter, make_gguf.py `--stage arches`, on the `llama-rope-llama3` fixture: factor 8,
/// frequency factors 1 and 4, 64 original positions of 256). The import recovers the fixture's
/// own `rope_scaling` from the table, so the logits match transformers; without it they do not.
#[test]
fn llama3_rope_factors_become_rope_scaling_again() {
    let name = "llama-rope-llama3";
    let dir = convert(name);
    let config_path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(mlxcel_tests::model_dir(name).join("config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["rope_scaling"], fixture["rope_scaling"]);

    let r = reference(name);
    let loaded = load_model(dir.path(), &options()).unwrap();
    let rel = relative_diff(&logits_for(&loaded.model, &r.prompt_ids), &r);
    eprintln!("{name}: relative logit error {rel:.2e}");
    assert!(rel <= 1e-4, "{name}: relative logit error {rel:.2e}");
    assert_greedy_ids(&loaded.model, &r, name);

    config["rope_scaling"] = serde_json::Value::Null;
    std::fs::write(&config_path, config.to_string()).unwrap();
    let unscaled = load_model(dir.path(), &options()).unwrap();
    let rel_unscaled = relative_diff(&logits_for(&unscaled.model, &r.prompt_ids), &r);
    eprintln!("{name} without rope scaling: relative logit error {rel_unscaled:.2e}");
    assert!(
        rel_unscaled > 1e-2,
        "{name} without rope scaling: {rel_unscaled:.2e}"
    );
}

/// A factor table no llama3 parameters reproduce (the fixture's one smoothed factor, 2.44226,
/// moved by 1e-5 relative) is refused naming the tensor, and nothing is written.
#[test]
fn perturbed_llama3_rope_factors_are_refused() {
    let mut bytes = std::fs::read(gguf("llama-rope-llama3")).unwrap();
    let smoothed = 2.442_259_6f32.to_le_bytes();
    let at: Vec<usize> = bytes
        .windows(4)
        .enumerate()
        .filter(|(_, w)| *w == smoothed)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(at.len(), 1, "the smoothed factor occurs once in the file");
    bytes[at[0]..at[0] + 4].copy_from_slice(&(2.442_259_6f32 * (1.0 + 1e-5)).to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("perturbed.gguf");
    std::fs::write(&path, bytes).unwrap();
    let out = dir.path().join("out");
    let err = import_gguf(&path, &out, &mut |_, _, _| {}).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("rope_freqs.weight") && msg.contains("reproduces"),
        "{msg}"
    );
    assert!(!out.join("config.json").exists());
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
/// The affine 8-bit (group 32) folder `q` with every quantized tensor dequantized exactly and
/// written back densely in f32 (config without `quantization`): the dense weights, how many were
/// quantized, and the folder.
fn dequantized_copy(q: &std::path::Path) -> (HashMap<String, Array>, usize, tempfile::TempDir) {
    let w = WeightMap::open(q).unwrap();
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
    let d = tempfile::tempdir().unwrap();
    let tensors: Vec<(String, Array)> = dense.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    mlxcel_core::weights::save_safetensors(d.path().join("model.safetensors"), &tensors, None)
        .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(q.join("config.json")).unwrap()).unwrap();
    let obj = config.as_object_mut().unwrap();
    obj.remove("quantization");
    obj.remove("quantization_config");
    obj.insert("torch_dtype".into(), "float32".into());
    std::fs::write(d.path().join("config.json"), config.to_string()).unwrap();
    (dense, quantized, d)
}

#[test]
fn q8_0_gguf_is_exact_against_its_dequantized_weights() {
    let q = convert("qwen3-q8_0");
    let (dense, quantized, d) = dequantized_copy(q.path());
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

/// `gguf/quant/llama256-<type>.gguf`: one 256-wide llama quantized by llama.cpp's own
/// `llama_model_quantize` (`pure`: every matrix, the embedding too, in the one type), and
/// `reference.safetensors`: transformers' float64 logits on the GGUF's weights as
/// `gguf.quants.dequantize` decodes them (`transformers.<type>`), and llama.cpp's own logits
/// (`llama_cpp.<type>`).
struct QuantReference {
    prompt: Vec<u32>,
    tensors: HashMap<String, Vec<f32>>,
}

fn quant_reference() -> QuantReference {
    let bytes = std::fs::read(fixtures_dir().join("gguf/quant/reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let words = |n: &str| -> Vec<[u8; 4]> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| [b[0], b[1], b[2], b[3]])
            .collect()
    };
    let prompt = words("prompt_ids")
        .into_iter()
        .map(|b| i32::from_le_bytes(b) as u32)
        .collect();
    let tensors = st
        .names()
        .into_iter()
        .filter(|n| *n != "prompt_ids")
        .map(|n| {
            let v = words(n).into_iter().map(f32::from_le_bytes).collect();
            (n.to_string(), v)
        })
        .collect();
    QuantReference { prompt, tensors }
}

/// Converts `llama256-<ty>.gguf`; returns the import report and the relative logit errors
/// against transformers on the dequantized weights and against llama.cpp.
fn quant_case(r: &QuantReference, ty: &str) -> (mlxcel_quant::gguf::ImportReport, f32, f32) {
    let out = tempfile::tempdir().unwrap();
    let path = fixtures_dir().join(format!("gguf/quant/llama256-{ty}.gguf"));
    let report =
        import_gguf(&path, out.path(), &mut |_, _, _| {}).unwrap_or_else(|e| panic!("{ty}: {e}"));
    let loaded = load_model(out.path(), &options()).unwrap_or_else(|e| panic!("{ty}: {e}"));
    let got = logits_for(&loaded.model, &r.prompt);
    let rel = |want: &[f32]| {
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        max_abs_diff(&got, want).0 / scale
    };
    let vs_transformers = rel(&r.tensors[&format!("transformers.{ty}")]);
    let vs_llama_cpp = rel(&r.tensors[&format!("llama_cpp.{ty}")]);
    eprintln!(
        "{ty}: relative logit error {vs_transformers:.2e} vs transformers on the dequantized \
         weights, {vs_llama_cpp:.2e} vs llama.cpp"
    );
    (report, vs_transformers, vs_llama_cpp)
}

/// llama.cpp computes its matrix products on activations quantized to 8 bits (and keeps an f16
/// KV cache), so its logits sit a few percent away from the exact product of the same weights:
/// measured 2.7e-2 (Q8_0) to 8.9e-2 (Q5_0) against transformers' float64 forward. mlxcel is
/// held to the same band around llama.cpp.
const LLAMA_CPP_BAND: f32 = 0.12;

/// The types MLX's affine format holds exactly: every matrix is repacked (no dense fallback, no
/// re-quantization) and the logits equal transformers' on the GGUF's dequantized weights.
#[test]
fn lossless_quant_types_match_their_dequantized_weights() {
    let r = quant_reference();
    for (ty, bits) in [
        ("q4_0", 4),
        ("q4_1", 4),
        ("q5_0", 5),
        ("q5_1", 5),
        ("q8_0", 8),
        ("q4_k", 4),
        ("q5_k", 5),
    ] {
        let (report, rel, rel_cpp) = quant_case(&r, ty);
        let matrices: Vec<_> = report
            .tensors
            .iter()
            .filter(|t| t.affine.is_some())
            .collect();
        assert_eq!(
            matrices.len(),
            8,
            "{ty}: 7 linears + the embedding are MLX affine"
        );
        for t in matrices {
            assert_eq!(t.affine, Some((bits, 32)), "{ty}: {}", t.gguf_name);
            assert!(
                t.requantized.is_none(),
                "{ty}: {} was re-quantized",
                t.gguf_name
            );
        }
        assert!(rel <= 1e-4, "{ty}: relative logit error {rel:.2e}");
        assert!(
            rel_cpp <= LLAMA_CPP_BAND,
            "{ty} vs llama.cpp: {rel_cpp:.2e}"
        );
    }
}

/// Q2_K, Q3_K and Q6_K (16-weight sub-blocks, no MLX group size for them) are re-quantized to
/// affine 8-bit: the import reports the added weight error (measured 3.3e-3 to 3.6e-3 of max
/// |w|, within 1/255 of a group's range / 2), and the logits move by as much as llama.cpp's own
/// 8-bit activations move them on this sensitive random model (measured 4.4e-2 to 7.7e-2, vs
/// 5.9e-2 to 8.2e-2 between llama.cpp and transformers): both inside the llama.cpp band.
#[test]
fn requantized_k_types_report_their_error() {
    let r = quant_reference();
    for (ty, bits, weight_bound, logit_bound) in [
        ("q2_k", 8, 0.004, LLAMA_CPP_BAND),
        ("q3_k", 8, 0.004, LLAMA_CPP_BAND),
        ("q6_k", 8, 0.004, LLAMA_CPP_BAND),
    ] {
        let (report, rel, rel_cpp) = quant_case(&r, ty);
        let worst = report
            .tensors
            .iter()
            .filter(|t| t.affine.is_some())
            .map(|t| {
                assert_eq!(t.affine, Some((bits, 32)), "{ty}: {}", t.gguf_name);
                t.requantized.expect("re-quantized").relative()
            })
            .fold(0f32, f32::max);
        eprintln!("{ty}: worst re-quantization error {worst:.2e} of max |w|");
        assert!(worst > 0.0 && worst <= weight_bound, "{ty}: {worst:.2e}");
        // Half a step of an 8-bit grid over a group's range (at most 2·max|w|).
        assert!(worst <= 1.0 / 255.0 * 1.0001, "{ty}: {worst:.2e}");
        assert!(
            rel > 1e-5 && rel <= logit_bound,
            "{ty}: relative logit error {rel:.2e}"
        );
        assert!(
            rel_cpp <= LLAMA_CPP_BAND,
            "{ty} vs llama.cpp: {rel_cpp:.2e}"
        );
    }
}

/// `gguf/tokenizer-<pre>.gguf`: the shared BPE vocabulary under each `tokenizer.ggml.pre`
/// llama.cpp splits differently (its legacy `default`, `gpt-2`, `llama-bpe`, `qwen2`, `smollm`),
/// and `tokenizer-spm.gguf`, a SentencePiece (`llama`) vocabulary with byte fallback written by
/// llama.cpp's converter (and `tokenizer-spm-no-prefix.gguf`, the same with
/// `add_space_prefix = false` as Gemma's files have); the rebuilt `tokenizer.json` must give llama.cpp's ids (`gguf/tokenizers.json`, from
/// llama-cpp-python 0.3.36) on English, Korean, emoji (ZWJ, flags), code, whitespace runs,
/// ChatML special tokens and a long text.
#[test]
fn rebuilt_tokenizers_match_llama_cpp_ids() {
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures_dir().join("gguf/tokenizers.json")).unwrap(),
    )
    .unwrap();
    let texts = golden["texts"].as_array().unwrap();
    let pres = golden["ids"].as_object().unwrap();
    assert_eq!(pres.len(), 7);
    for (pre, per_text) in pres {
        let g = mlxcel_quant::gguf::GgufFile::open(
            fixtures_dir().join(format!("gguf/tokenizer-{pre}.gguf")),
        )
        .unwrap();
        let files = mlxcel_quant::gguf::build_tokenizer_files(&g, 256).unwrap();
        let tok = tokenizers::Tokenizer::from_bytes(files.tokenizer.to_string()).unwrap();
        for (text, want) in texts.iter().zip(per_text.as_array().unwrap()) {
            let text = text.as_str().unwrap();
            let want: Vec<u32> = want
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let got = tok.encode(text, false).unwrap().get_ids().to_vec();
            assert_eq!(got, want, "pre `{pre}`: {text:?}");
        }
    }
}

/// Quantized stacked experts (`qwen3_moe-q8_0.gguf`, every matrix Q8_0 by llama.cpp): each
/// `[experts, out, in]` tensor becomes `switch_mlp` planes `[experts, out, in/4]` whose MLX
/// dequantization equals the GGUF's decode value for value, and the quantized folder gives the
/// logits of its own dequantized copy (only the kernels differ). (Against the f32 reference the
/// error is 2.4e-1: Q8_0 rounding flips some top-2 expert choices on this random model.)
#[test]
fn quantized_stacked_experts_keep_their_layout() {
    use mlxcel_quant::gguf::{blocks, GgmlType, GgufFile};
    let out = convert("qwen3_moe-q8_0");
    let g = GgufFile::open(gguf("qwen3_moe-q8_0")).unwrap();
    let w = WeightMap::open(out.path()).unwrap();
    let mut checked = 0;
    for layer in 0..2 {
        for (part, hf) in [
            ("ffn_gate_exps", "gate_proj"),
            ("ffn_up_exps", "up_proj"),
            ("ffn_down_exps", "down_proj"),
        ] {
            let info = g.tensor(&format!("blk.{layer}.{part}.weight")).unwrap();
            assert_eq!(info.ggml_type, GgmlType::Q8_0);
            let want = blocks::dequantize(GgmlType::Q8_0, g.tensor_data(info).unwrap()).unwrap();
            let pre = format!("model.layers.{layer}.mlp.switch_mlp.{hf}");
            let q = w.get(&format!("{pre}.weight")).unwrap();
            let (e, o, i) = (info.ne[2] as i32, info.ne[1] as i32, info.ne[0] as i32);
            assert_eq!(q.shape(), vec![e, o, i / 4]);
            let f = |s: &str| w.get_as(&format!("{pre}.{s}"), Dtype::Float32).unwrap();
            let got = ops::dequantize(
                &q,
                &f("scales"),
                Some(&f("biases")),
                ops::QuantSpec::affine(32, 8),
                Some(Dtype::Float32),
            )
            .unwrap();
            assert_eq!(got.shape(), vec![e, o, i]);
            assert_eq!(got.to_vec::<f32>().unwrap(), want, "{pre}");
            checked += 1;
        }
    }
    assert_eq!(checked, 6);
    let (_, quantized, dense) = dequantized_copy(out.path());
    assert_eq!(
        quantized,
        4 * 2 + 3 * 2 + 2,
        "attention, experts, embedding and head"
    );
    let r = reference("qwen3_moe");
    let ql = logits_for(
        &load_model(out.path(), &options()).unwrap().model,
        &r.prompt_ids,
    );
    let dl = logits_for(
        &load_model(dense.path(), &options()).unwrap().model,
        &r.prompt_ids,
    );
    let scale = dl.iter().fold(0f32, |m, v| m.max(v.abs()));
    let rel = max_abs_diff(&ql, &dl).0 / scale;
    eprintln!("qwen3_moe Q8_0: quantized vs dequantized relative logit error {rel:.2e}");
    assert!(rel <= 1e-4, "qwen3_moe Q8_0: {rel:.2e}");
}

/// A cached conversion is reused only when it was written by this importer: one stamped by
/// another version (or not at all, as before the stamp) is converted again.
#[test]
fn cached_conversions_of_another_importer_are_redone() {
    use mlxcel_quant::gguf::{convert_gguf_cached, IMPORT_FORMAT};
    let cache = tempfile::tempdir().unwrap();
    let run = || convert_gguf_cached(&gguf("qwen3"), cache.path(), &mut |_, _, _| {}).unwrap();
    let first = run();
    assert!(first.converted && first.report.is_some());
    let stamp = first.folder.join(".mlxcel-import");
    assert_eq!(
        std::fs::read_to_string(&stamp).unwrap().trim(),
        IMPORT_FORMAT
    );
    assert!(!run().converted, "same importer: reused");
    std::fs::write(&stamp, "mlxcel-gguf-import 1\n").unwrap();
    assert!(run().converted, "another importer's conversion is redone");
    std::fs::remove_file(&stamp).unwrap();
    let again = run();
    assert!(again.converted, "an unstamped conversion is redone");
    assert_eq!(again.folder, first.folder);
    assert!(!run().converted);
}
