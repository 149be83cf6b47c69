//! Load-time weight surgery (`LoadOptions::surgery`): each tensor op against the same edit made
//! by hand on a copy of the checkpoint (logits within 1e-6), each structural prune against numpy
//! and transformers (`surgery/prune-reference.*`, made by `make_prune.py`), and every failure
//! mode by its message.

use std::path::{Path, PathBuf};

use mlxcel_core::{Array, Dtype, RuntimePolicy, WeightMap};
use mlxcel_loading::surgery::Surgery;
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::{logits_for, max_abs_diff, model_dir, reference};

const FIXTURE: &str = "llama";

fn load(folder: &Path, surgery: Option<PathBuf>) -> mlxcel_loading::Result<Loaded> {
    load_model(
        folder,
        &LoadOptions {
            skip_tokenizer: true,
            policy: Some(RuntimePolicy::default()),
            surgery,
            ..Default::default()
        },
    )
}

fn prompt() -> Vec<u32> {
    reference(FIXTURE).prompt_ids
}

fn random(shape: &[i32], seed: u64) -> Array {
    let key = mlxcel_core::ops::random::key(seed).unwrap();
    mlxcel_core::ops::random::uniform(shape, Dtype::Float32, &key)
        .unwrap()
        .add_scalar(-0.5)
        .unwrap()
}

/// The fixture with its tensors edited by `edit`, written to a temporary model folder.
fn edited_checkpoint(edit: impl FnOnce(&mut WeightMap)) -> tempfile::TempDir {
    edited_fixture(FIXTURE, edit)
}

/// [`edited_checkpoint`] of the fixture `name`.
fn edited_fixture(name: &str, edit: impl FnOnce(&mut WeightMap)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = model_dir(name);
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let mut w = WeightMap::open(&src).unwrap();
    edit(&mut w);
    let names: Vec<String> = w.names().map(str::to_string).collect();
    let tensors: Vec<(String, Array)> = names
        .into_iter()
        .map(|n| {
            let a = w.get(&n).unwrap();
            (n, a)
        })
        .collect();
    mlxcel_core::weights::save_safetensors(dir.path().join("model.safetensors"), &tensors, None)
        .unwrap();
    dir
}

/// Writes `yaml` as `surgery.yaml` in `dir` and returns its path.
fn write_yaml(dir: &Path, yaml: &str) -> PathBuf {
    let path = dir.join("surgery.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Loads the fixture with `yaml` applied and the hand-edited checkpoint without surgery; their
/// logits must agree within 1e-6 and differ from the unedited model's.
fn check_op(yaml_dir: &Path, yaml: &str, edit: impl FnOnce(&mut WeightMap), rules: usize) {
    let ids = prompt();
    let path = write_yaml(yaml_dir, yaml);
    let with = load(&model_dir(FIXTURE), Some(path)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        with.surgery_applied.len(),
        rules,
        "{:?}",
        with.surgery_applied
    );
    let got = logits_for(&with.model, &ids);
    let by_hand = edited_checkpoint(edit);
    let want = logits_for(&load(by_hand.path(), None).unwrap().model, &ids);
    let (diff, at) = max_abs_diff(&got, &want);
    assert!(diff <= 1e-6, "surgery vs by hand: max |Δ| {diff} at {at}");
    let base = logits_for(&load(&model_dir(FIXTURE), None).unwrap().model, &ids);
    let (moved, _) = max_abs_diff(&got, &base);
    assert!(
        moved > 1e-4,
        "the surgery did not change the logits ({moved})"
    );
}

fn edit_each(w: &mut WeightMap, names: &[&str], f: impl Fn(&str, Array) -> Array) {
    for n in names {
        let a = w.get(n).unwrap();
        w.insert(*n, f(n, a)).unwrap();
    }
}

#[test]
fn scale_matches_by_hand() {
    let tmp = tempfile::tempdir().unwrap();
    check_op(
        tmp.path(),
        "- op: scale\n  target: 'model\\.layers\\.0\\.mlp\\..*_proj\\.weight'\n  factor: 0.5\n",
        |w| {
            edit_each(
                w,
                &[
                    "model.layers.0.mlp.gate_proj.weight",
                    "model.layers.0.mlp.up_proj.weight",
                    "model.layers.0.mlp.down_proj.weight",
                ],
                |_, a| a.mul_scalar(0.5).unwrap(),
            )
        },
        1,
    );
}

#[test]
fn add_value_and_file_match_by_hand() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "model.layers.1.self_attn.o_proj.weight";
    let delta = random(&[64, 64], 3);
    mlxcel_core::weights::save_safetensors(
        tmp.path().join("delta.safetensors"),
        &[(name.to_string(), delta.clone())],
        None,
    )
    .unwrap();
    check_op(
        tmp.path(),
        &format!(
            "- op: add\n  glob: 'model.norm.weight'\n  value: 0.25\n- op: add\n  glob: '{name}'\n  file: delta.safetensors\n"
        ),
        |w| {
            edit_each(w, &["model.norm.weight"], |_, a| a.add_scalar(0.25).unwrap());
            edit_each(w, &[name], |_, a| a.add(&delta).unwrap());
        },
        2,
    );
}

/// One structural prune case of `surgery/prune-reference.json` (made by `make_prune.py`).
struct PruneCase {
    name: String,
    fixture: String,
    yaml: String,
    config: serde_json::Map<String, serde_json::Value>,
    n_tensors: usize,
    tensors: serde_json::Map<String, serde_json::Value>,
    logits: Vec<f32>,
}

fn prune_cases() -> Vec<PruneCase> {
    let dir = mlxcel_tests::fixtures_dir().join("surgery");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("prune-reference.json")).unwrap())
            .unwrap();
    let logits = WeightMap::open_file(dir.join("prune-reference.safetensors")).unwrap();
    json.as_object()
        .unwrap()
        .iter()
        .map(|(name, c)| PruneCase {
            name: name.clone(),
            fixture: c["fixture"].as_str().unwrap().to_string(),
            yaml: c["yaml"].as_str().unwrap().to_string(),
            config: c["config"].as_object().unwrap().clone(),
            n_tensors: c["n_tensors"].as_u64().unwrap() as usize,
            tensors: c["tensors"].as_object().unwrap().clone(),
            logits: logits
                .get(&format!("{name}.logits"))
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
        })
        .collect()
}

/// The shape, sum and position-weighted sum `make_prune.py` records for each tensor (f64).
fn checksum(a: &Array) -> (Vec<i32>, f64, f64) {
    let v = a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    let n = v.len() as f64;
    let sum = v.iter().map(|&x| x as f64).sum();
    let wsum = v
        .iter()
        .enumerate()
        .map(|(i, &x)| x as f64 * (i as f64 / n))
        .sum();
    (a.shape(), sum, wsum)
}

/// Each structural prune (heads under GQA, MLP channels, layers with `layer_types`, and all
/// three in one pipeline): the pruned tensors against the same prune done with numpy, the
/// updated config against the numpy-side config, and the pruned model's logits against
/// transformers running the numpy-pruned checkpoint.
#[test]
fn prune_matches_numpy_and_transformers() {
    for case in prune_cases() {
        let tmp = tempfile::tempdir().unwrap();
        let path = write_yaml(tmp.path(), &case.yaml);
        let folder = model_dir(&case.fixture);

        // Tensor by tensor on the checkpoint.
        let mut w = WeightMap::open(&folder).unwrap();
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap())
                .unwrap();
        Surgery::load(&path)
            .unwrap()
            .apply(&mut w, &mut config, None)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(
            w.names().count(),
            case.n_tensors,
            "{}: tensor count",
            case.name
        );
        for (name, want) in &case.tensors {
            let (shape, sum, wsum) = checksum(&w.get(name).unwrap());
            let want_shape: Vec<i32> = want["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_i64().unwrap() as i32)
                .collect();
            assert_eq!(shape, want_shape, "{}: {name} shape", case.name);
            for (got, key) in [(sum, "sum"), (wsum, "wsum")] {
                let want = want[key].as_f64().unwrap();
                assert!(
                    (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "{}: {name} {key} {got} vs numpy {want}",
                    case.name
                );
            }
        }
        for (key, want) in &case.config {
            assert_eq!(&config[key], want, "{}: config `{key}`", case.name);
        }

        // The pruned model through the pipeline, against transformers.
        let loaded = load(&folder, Some(path)).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        for (key, want) in &case.config {
            assert_eq!(
                &loaded.config[key], want,
                "{}: Loaded::config `{key}`",
                case.name
            );
        }
        let ids = reference(&case.fixture).prompt_ids;
        let got = logits_for(&loaded.model, &ids);
        let (diff, at) = max_abs_diff(&got, &case.logits);
        assert!(
            diff <= 1e-4,
            "{}: pruned model vs transformers: max |Δ| {diff:.2e} at {at}",
            case.name
        );
        println!("{}: max |Δ| vs transformers {diff:.2e}", case.name);
        // It decodes with its own (pruned) caches: greedy continues from transformers' argmax.
        let vocab = case.logits.len() / ids.len();
        let last = &case.logits[case.logits.len() - vocab..];
        let argmax = (0..vocab)
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap() as u32;
        let out = mlxcel_arch::generate::greedy(&loaded.model, &ids, 4, None, |_| false).unwrap();
        assert_eq!(out.len(), 4, "{}", case.name);
        assert_eq!(out[0], argmax, "{}: first greedy token", case.name);
    }
}

/// Prunes that cannot keep the model consistent are refused, naming the rule and target.
#[test]
fn impossible_prunes_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let cases: Vec<(&str, &str, Vec<&str>)> = vec![
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.layers.*.self_attn'\n  heads: [1]\n",
            vec![
                "rule 1 (prune `model.layers.*.self_attn`)",
                "heads [1] split key/value group 0 (query heads 0..=1 share one key/value head): prune whole groups",
            ],
        ),
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.layers.0.self_attn'\n  heads: [0, 1]\n",
            vec![
                "rule 1 (prune `model.layers.0.self_attn`)",
                "matches 1 module(s) (model.layers.0.self_attn) but the model has 2 layers: config.json has one `num_attention_heads` for every layer",
            ],
        ),
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.layers.*.self_attn'\n  heads: [0, 1, 2, 3]\n",
            vec!["rule 1 (prune", "it would remove every head (all 4)"],
        ),
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.layers.*.self_attn'\n  heads: [4]\n",
            vec!["rule 1 (prune", "head index 4 is out of range (there are 4)"],
        ),
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.layers.*.mlp'\n  rows: [3, 3]\n",
            vec!["rule 1 (prune", "MLP channel index 3 is listed twice"],
        ),
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.layers.*.mlp'\n  heads: [0, 1]\n",
            vec![
                "rule 1 (prune `model.layers.*.mlp`)",
                "`model.layers.0.mlp` is not an attention module",
                "no `model.layers.0.mlp.q_proj.weight`",
            ],
        ),
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.layers.*'\n  layers: [0]\n",
            vec!["rule 1 (prune `model.layers.*`)", "give the layer list itself"],
        ),
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.layers'\n  layers: [0, 1]\n",
            vec!["rule 1 (prune `model.layers`)", "it would remove every layer (all 2)"],
        ),
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.nothing'\n  layers: [0]\n",
            vec!["rule 1 (prune `model.nothing`)", "matches no module"],
        ),
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.layers.1.mlp.down_proj.weight'\n  cols: [1]\n",
            vec!["rule 1 (prune", "`cols` alone cannot keep the model's shapes consistent"],
        ),
        (
            FIXTURE,
            "- op: prune\n  glob: 'model.layers.*.mlp'\n  rows: [1]\n  heads: [0]\n",
            vec!["rule 1 (prune", "needs exactly one non-empty list of `heads`, `rows`"],
        ),
        (
            "gemma3_text",
            "- op: prune\n  glob: 'model.layers'\n  layers: [0]\n",
            vec![
                "rule 1 (prune `model.layers`)",
                "config.json's `sliding_window_pattern` places layers by position",
            ],
        ),
        (
            "llama-affine4-g64",
            "- op: prune\n  glob: 'model.layers.*.self_attn'\n  heads: [2, 3]\n",
            vec![
                "rule 1 (prune",
                "is quantized (it has a `.scales` sibling): surgery on quantized weights is not supported yet",
            ],
        ),
    ];
    for (fixture, yaml, parts) in cases {
        let path = write_yaml(t, yaml);
        let msg = match load(&model_dir(fixture), Some(path)) {
            Ok(_) => panic!("{fixture}: {yaml:?} was accepted"),
            Err(e) => e.to_string(),
        };
        assert_has(&msg, &parts);
    }
}

/// A structural prune with unfused adapters (attached by name and shape) is refused.
#[test]
fn a_prune_refuses_runtime_adapters() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write_yaml(
        tmp.path(),
        "- op: prune\n  glob: 'model.layers'\n  layers: [1]\n",
    );
    let err = match load_model(
        model_dir(FIXTURE),
        &LoadOptions {
            skip_tokenizer: true,
            policy: Some(RuntimePolicy::default()),
            surgery: Some(path),
            runtime_adapters: vec![(
                "a".to_string(),
                mlxcel_tests::fixtures_dir().join("adapters/llama-lora-mlx"),
            )],
            ..Default::default()
        },
    ) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    assert_has(
        &err,
        &["prunes structure, which cannot be combined with unfused (runtime) adapters"],
    );
}

#[test]
fn replace_matches_by_hand() {
    let tmp = tempfile::tempdir().unwrap();
    let other = random(&[512, 64], 5);
    mlxcel_core::weights::save_safetensors(
        tmp.path().join("head.safetensors"),
        &[("new_head".to_string(), other.clone())],
        None,
    )
    .unwrap();
    check_op(
        tmp.path(),
        "- op: replace\n  glob: 'lm_head.weight'\n  file: head.safetensors\n  tensor: new_head\n",
        |w| w.insert("lm_head.weight", other).unwrap(),
        1,
    );
}

#[test]
fn interpolate_matches_by_hand() {
    let tmp = tempfile::tempdir().unwrap();
    // The other checkpoint: the fixture with every attention projection perturbed.
    let names = |w: &WeightMap| -> Vec<String> {
        w.names()
            .filter(|n| n.contains(".self_attn.") && n.ends_with(".weight"))
            .map(str::to_string)
            .collect()
    };
    let other = edited_checkpoint(|w| {
        for (i, n) in names(w).iter().enumerate() {
            let a = w.get(n).unwrap();
            let noisy = a.add(&random(&a.shape(), 100 + i as u64)).unwrap();
            w.insert(n.clone(), noisy).unwrap();
        }
    });
    let theirs = WeightMap::open(other.path()).unwrap();
    check_op(
        tmp.path(),
        &format!(
            "- op: interpolate\n  glob: 'model.layers.*.self_attn.*.weight'\n  checkpoint: {}\n  t: 0.25\n",
            other.path().display()
        ),
        |w| {
            for n in names(w) {
                let a = w.get(&n).unwrap();
                let b = theirs.get(&n).unwrap();
                let mixed = a
                    .mul_scalar(0.75)
                    .unwrap()
                    .add(&b.mul_scalar(0.25).unwrap())
                    .unwrap();
                w.insert(n, mixed).unwrap();
            }
        },
        1,
    );
}

#[test]
fn policy_variable_selects_a_surgery_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write_yaml(
        tmp.path(),
        "- op: scale\n  glob: 'model.norm.weight'\n  factor: 2\n",
    );
    let policy =
        RuntimePolicy::from_vars(|v| (v == "MLXCEL_SURGERY").then(|| path.display().to_string()))
            .unwrap();
    let loaded = load_model(
        model_dir(FIXTURE),
        &LoadOptions {
            skip_tokenizer: true,
            policy: Some(policy),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(loaded.surgery_applied.len(), 1);
    let err = RuntimePolicy::from_vars(|v| {
        (v == "MLXCEL_SURGERY").then(|| "/no/such/surgery.yaml".to_string())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("MLXCEL_SURGERY"), "{err}");
}

/// The load error for `yaml` (written next to any extra files in `tmp`).
fn load_error(tmp: &Path, yaml: &str) -> String {
    let path = write_yaml(tmp, yaml);
    match load(&model_dir(FIXTURE), Some(path)) {
        Ok(_) => panic!("surgery {yaml:?} was accepted"),
        Err(e) => e.to_string(),
    }
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "`{p}` not in: {msg}");
    }
}

#[test]
fn failures_name_the_rule_op_and_target() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    mlxcel_core::weights::save_safetensors(
        t.join("bad.safetensors"),
        &[
            ("lm_head.weight".to_string(), random(&[512, 32], 1)),
            (
                "model.norm.weight".to_string(),
                random(&[64], 1).astype(Dtype::Float16).unwrap(),
            ),
        ],
        None,
    )
    .unwrap();
    let ok = "- op: scale\n  glob: 'model.norm.weight'\n  factor: 2\n";
    let cases: Vec<(String, Vec<&str>)> = vec![
        (
            format!("{ok}- op: scale\n  target: 'nothing\\..*'\n  factor: 2\n"),
            vec!["rule 2 (scale `nothing\\..*`)", "matches no tensor"],
        ),
        (
            "- op: replace\n  glob: 'lm_head.weight'\n  file: bad.safetensors\n".into(),
            vec![
                "rule 1 (replace `lm_head.weight`)",
                "shape mismatch",
                "[512, 32]",
            ],
        ),
        (
            "- op: replace\n  glob: 'model.norm.weight'\n  file: bad.safetensors\n".into(),
            vec![
                "rule 1 (replace `model.norm.weight`)",
                "dtype mismatch",
                "float16",
            ],
        ),
        (
            "- op: add\n  glob: 'model.norm.weight'\n  file: missing.safetensors\n".into(),
            vec![
                "rule 1 (add `model.norm.weight`)",
                "missing.safetensors",
                "does not exist",
            ],
        ),
        (
            "- op: interpolate\n  glob: 'model.norm.weight'\n  checkpoint: nowhere\n  t: 0.5\n"
                .into(),
            vec!["rule 1 (interpolate", "does not exist"],
        ),
        (
            format!("{ok}- op: scale\n  glob: 'model.layers.0.*'\n  factor: 1e39\n"),
            vec!["rule 2 (scale `model.layers.0.*`)", "not finite"],
        ),
        (
            "- op: explode\n  glob: 'x'\n".into(),
            vec!["rule 1 (explode `x`)", "unknown op"],
        ),
        (
            "- op: scale\n  glob: 'x'\n  target: 'x'\n  factor: 1\n".into(),
            vec!["rule 1", "exactly one of `target`"],
        ),
        (
            "- op: scale\n  glob: 'x'\n  t: 1\n".into(),
            vec!["rule 1 (scale `x`)", "field `t` does not apply"],
        ),
        (
            "- op: scale\n  glob: 'x'\n  facter: 1\n".into(),
            vec!["surgery.yaml", "facter"],
        ),
    ];
    for (yaml, parts) in cases {
        let msg = load_error(t, &yaml);
        assert_has(&msg, &parts);
    }
}

#[test]
fn a_failed_surgery_changes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write_yaml(
        tmp.path(),
        "- op: scale\n  glob: 'model.norm.weight'\n  factor: 2\n- op: add\n  glob: 'lm_head.weight'\n  value: 1\n- op: scale\n  glob: 'no.such.*'\n  factor: 2\n",
    );
    let surgery = Surgery::load(&path).unwrap();
    let mut w = WeightMap::open(model_dir(FIXTURE)).unwrap();
    let mut config = serde_json::json!({"num_hidden_layers": 2});
    let before: Vec<Vec<f32>> = ["model.norm.weight", "lm_head.weight"]
        .iter()
        .map(|n| w.get(n).unwrap().to_vec::<f32>().unwrap())
        .collect();
    let err = surgery
        .apply(&mut w, &mut config, None)
        .unwrap_err()
        .to_string();
    assert_has(&err, &["rule 3", "matches no tensor"]);
    for (n, b) in ["model.norm.weight", "lm_head.weight"].iter().zip(&before) {
        assert_eq!(
            &w.get(n).unwrap().to_vec::<f32>().unwrap(),
            b,
            "{n} changed"
        );
        assert!(w.info(n).unwrap().file.is_some(), "{n} was replaced");
    }

    // A prune that succeeded before a later rule failed: no tensor removed or renamed, and the
    // config keeps its layer count.
    let path = write_yaml(
        tmp.path(),
        "- op: prune\n  glob: 'model.layers'\n  layers: [0]\n- op: scale\n  glob: 'model.layers.1.*'\n  factor: 2\n",
    );
    let names: Vec<String> = w.names().map(str::to_string).collect();
    let err = Surgery::load(&path)
        .unwrap()
        .apply(&mut w, &mut config, None)
        .unwrap_err()
        .to_string();
    assert_has(
        &err,
        &["rule 2 (scale `model.layers.1.*`)", "matches no tensor"],
    );
    assert_eq!(w.names().map(str::to_string).collect::<Vec<_>>(), names);
    assert_eq!(config, serde_json::json!({"num_hidden_layers": 2}));
}

/// A quantized target is dequantized, edited and requantized at its own bits and group size
/// (its planes follow it, also when the pattern matches them): the same logits as the same
/// three steps done by hand on the checkpoint, and the report says so. Without a quantization
/// config for it, or a rule matching only planes, it is an error; prune refuses quantized
/// modules (see `impossible_prunes_are_refused`).
#[test]
fn quantized_targets_are_dequantized_edited_and_requantized() {
    let fixture = "llama-affine4-g64";
    let tmp = tempfile::tempdir().unwrap();
    let path = write_yaml(
        tmp.path(),
        "- op: scale\n  glob: 'model.layers.0.self_attn.q_proj.*'\n  factor: 0.5\n",
    );
    let with = load(&model_dir(fixture), Some(path)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        with.surgery_applied,
        ["surgery rule 1: scale `model.layers.0.self_attn.q_proj.*` on 1 tensor (1 quantized: dequantized, edited and requantized at the layer's own affine 4-bit g64)"]
    );
    let module = "model.layers.0.self_attn.q_proj";
    let by_hand = edited_fixture(fixture, |w| {
        let spec = mlxcel_core::ops::QuantSpec::affine(64, 4);
        let (weight, scales, biases) = (
            w.get(&format!("{module}.weight")).unwrap(),
            w.get(&format!("{module}.scales")).unwrap(),
            w.get(&format!("{module}.biases")).unwrap(),
        );
        let dtype = scales.dtype().unwrap();
        let edited = mlxcel_core::ops::dequantize(
            &weight,
            &scales,
            Some(&biases),
            spec,
            Some(Dtype::Float32),
        )
        .and_then(|d| d.mul_scalar(0.5))
        .and_then(|d| d.quantize(spec))
        .unwrap();
        w.insert(format!("{module}.weight"), edited.weight).unwrap();
        w.insert(
            format!("{module}.scales"),
            edited.scales.astype(dtype).unwrap(),
        )
        .unwrap();
        w.insert(
            format!("{module}.biases"),
            edited.biases.unwrap().astype(dtype).unwrap(),
        )
        .unwrap();
    });
    std::fs::remove_file(by_hand.path().join("model.safetensors.index.json")).ok();
    let ids = reference(fixture).prompt_ids;
    let got = logits_for(&with.model, &ids);
    let want = logits_for(&load(by_hand.path(), None).unwrap().model, &ids);
    let (diff, at) = max_abs_diff(&got, &want);
    assert!(diff <= 1e-6, "surgery vs by hand: max |Δ| {diff} at {at}");
    let base = logits_for(&load(&model_dir(fixture), None).unwrap().model, &ids);
    assert!(
        max_abs_diff(&got, &base).0 > 1e-3,
        "the edit did not change the logits"
    );

    let path = write_yaml(
        tmp.path(),
        "- op: scale\n  glob: 'model.layers.0.self_attn.q_proj.scales'\n  factor: 2\n",
    );
    let err = match load(&model_dir(fixture), Some(path)) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    assert_has(
        &err,
        &[
            "rule 1 (scale `model.layers.0.self_attn.q_proj.scales`)",
            "matches only quantization planes (`model.layers.0.self_attn.q_proj.scales`, ...): target the `.weight` they quantize",
        ],
    );

    // Planes without a quantization config for them.
    let path = write_yaml(
        tmp.path(),
        "- op: scale\n  glob: 'layer.weight'\n  factor: 2\n",
    );
    let mut w = WeightMap::empty(tmp.path());
    w.insert(
        "layer.weight",
        Array::from_slice(&[1u32, 2, 3, 4], &[2, 2]).unwrap(),
    )
    .unwrap();
    w.insert("layer.scales", random(&[2, 1], 1)).unwrap();
    let err = Surgery::load(&path)
        .unwrap()
        .apply(&mut w, &mut serde_json::json!({}), None)
        .unwrap_err()
        .to_string();
    assert_has(
        &err,
        &[
            "rule 1 (scale `layer.weight`)",
            "`layer.weight` has `layer.scales` but config.json does not quantize it",
        ],
    );
}

/// `scale`, `add` (a value and a tensor from a file), `replace` and `interpolate` against the
/// same edits done with numpy (`make_surgery_ops.py`): each edited tensor's checksum, and the
/// edited model's logits against transformers running the numpy-edited checkpoint.
#[test]
fn element_wise_ops_match_numpy_and_transformers() {
    let dir = mlxcel_tests::fixtures_dir().join("surgery");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("ops-reference.json")).unwrap())
            .unwrap();
    let goldens = WeightMap::open_file(dir.join("ops-reference.safetensors")).unwrap();
    let ids = prompt();
    let cases = json.as_object().unwrap();
    assert_eq!(cases.len(), 4);
    for (case, c) in cases {
        // The YAML names its inputs under `ops/`, relative to itself.
        let tmp = tempfile::tempdir().unwrap();
        let ops = tmp.path().join("ops");
        std::fs::create_dir_all(ops.join("other")).unwrap();
        for f in [
            "delta.safetensors",
            "head.safetensors",
            "other/model.safetensors",
        ] {
            std::fs::copy(dir.join("ops").join(f), ops.join(f)).unwrap();
        }
        let path = write_yaml(tmp.path(), c["yaml"].as_str().unwrap());
        let folder = model_dir(FIXTURE);
        let mut w = WeightMap::open(&folder).unwrap();
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap())
                .unwrap();
        Surgery::load(&path)
            .unwrap()
            .apply(&mut w, &mut config, None)
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        let tensors = c["tensors"].as_object().unwrap();
        assert!(!tensors.is_empty(), "{case}");
        for (name, want) in tensors {
            let (shape, sum, wsum) = checksum(&w.get(name).unwrap());
            let want_shape: Vec<i32> = want["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_i64().unwrap() as i32)
                .collect();
            assert_eq!(shape, want_shape, "{case}: {name} shape");
            for (got, key) in [(sum, "sum"), (wsum, "wsum")] {
                let want = want[key].as_f64().unwrap();
                assert!(
                    (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "{case}: {name} {key} {got} vs numpy {want}"
                );
            }
        }
        let loaded = load(&folder, Some(path)).unwrap_or_else(|e| panic!("{case}: {e}"));
        let got = logits_for(&loaded.model, &ids);
        let want = goldens
            .get(&format!("{case}.logits"))
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let (diff, at) = max_abs_diff(&got, &want);
        // The parity suite's float32 bound (tests/tests/parity.rs): rounding grows with the
        // logits' scale.
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let bound = 1e-4f32.max(5e-5 * scale);
        assert!(
            diff <= bound,
            "{case}: edited model vs transformers: max |Δ| {diff:.2e} at {at} (bound {bound:.2e})"
        );
        println!("{case}: max |Δ| vs transformers {diff:.2e}");
    }
}
