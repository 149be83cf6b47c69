//! Load-time weight surgery (`LoadOptions::surgery`): each op against the same edit made by hand
//! on a copy of the checkpoint (logits within 1e-6), and every failure mode by its message.

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
    let dir = tempfile::tempdir().unwrap();
    let src = model_dir(FIXTURE);
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

#[test]
fn prune_matches_by_hand() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "model.layers.1.mlp.down_proj.weight"; // [64, 128]
    check_op(
        tmp.path(),
        &format!("- op: prune\n  glob: '{name}'\n  rows: [0, 5]\n  cols: [3, 127]\n"),
        |w| {
            edit_each(w, &[name], |_, a| {
                let mut v = a.to_vec::<f32>().unwrap();
                for r in 0..64usize {
                    for c in 0..128usize {
                        if r == 0 || r == 5 || c == 3 || c == 127 {
                            v[r * 128 + c] = 0.0;
                        }
                    }
                }
                Array::from_slice(&v, &[64, 128]).unwrap()
            })
        },
        1,
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
            "- op: prune\n  glob: 'model.norm.weight'\n  rows: [64]\n".into(),
            vec!["rule 1 (prune", "index 64 is out of range"],
        ),
        (
            "- op: prune\n  glob: 'model.norm.weight'\n  cols: [1]\n".into(),
            vec!["rule 1 (prune", "needs a 2-D tensor"],
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
    let before: Vec<Vec<f32>> = ["model.norm.weight", "lm_head.weight"]
        .iter()
        .map(|n| w.get(n).unwrap().to_vec::<f32>().unwrap())
        .collect();
    let err = surgery.apply(&mut w).unwrap_err().to_string();
    assert_has(&err, &["rule 3", "matches no tensor"]);
    for (n, b) in ["model.norm.weight", "lm_head.weight"].iter().zip(&before) {
        assert_eq!(
            &w.get(n).unwrap().to_vec::<f32>().unwrap(),
            b,
            "{n} changed"
        );
        assert!(w.info(n).unwrap().file.is_some(), "{n} was replaced");
    }
}

#[test]
fn quantized_targets_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
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
        .apply(&mut w)
        .unwrap_err()
        .to_string();
    assert_has(
        &err,
        &[
            "rule 1 (scale `layer.weight`)",
            "quantized",
            "not supported yet",
        ],
    );
    // Through the pipeline on a quantized fixture too.
    let path = write_yaml(
        tmp.path(),
        "- op: scale\n  glob: 'model.layers.0.self_attn.q_proj.weight'\n  factor: 2\n",
    );
    let err = match load(&model_dir("llama-affine4-g64"), Some(path)) {
        Ok(_) => panic!("accepted"),
        Err(e) => e.to_string(),
    };
    assert_has(&err, &["rule 1", "quantized"]);
}
