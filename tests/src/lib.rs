//! Workspace-level integration tests, and the dev-only helpers that load a golden fixture and
//! its references (see `tests/fixtures/README.md` for how they were made).

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde_json::Value;

/// `tests/fixtures/`, or `MLXCEL_FIXTURES_DIR` (test binaries carried to another machine).
pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os("MLXCEL_FIXTURES_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures"),
    }
}

/// The folder of one tiny model fixture.
pub fn model_dir(name: &str) -> PathBuf {
    fixtures_dir().join("models").join(name)
}

/// A copy of a fixture folder (files only) in a temporary folder a test may edit.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temporary folder");
    for entry in std::fs::read_dir(model_dir(name)).expect("fixture folder") {
        let path = entry.expect("fixture entry").path();
        if path.is_file() {
            std::fs::copy(&path, dir.path().join(path.file_name().expect("file name")))
                .expect("copy");
        }
    }
    dir
}

/// One row of `models/index.json`.
#[derive(Debug, Clone)]
pub struct FixtureEntry {
    pub name: String,
    pub model_type: String,
    /// `f32-transformers` or `quantized-mlx-lm`.
    pub kind: String,
    pub margin: f64,
}

pub fn fixture_index() -> Vec<FixtureEntry> {
    let path = fixtures_dir().join("models/index.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: Value = serde_json::from_str(&text).expect("index.json is valid JSON");
    json["fixtures"]
        .as_array()
        .expect("index.json has a fixtures array")
        .iter()
        .map(|f| FixtureEntry {
            name: f["name"].as_str().unwrap_or_default().to_string(),
            model_type: f["model_type"].as_str().unwrap_or_default().to_string(),
            kind: f["kind"].as_str().unwrap_or_default().to_string(),
            margin: f["margin"].as_f64().unwrap_or(0.0),
        })
        .collect()
}

/// A fixture's reference outputs.
#[derive(Debug, Clone)]
pub struct Reference {
    pub prompt_ids: Vec<u32>,
    /// `[prompt_len, vocab]`, row-major.
    pub logits: Vec<f32>,
    pub vocab: usize,
    pub greedy_ids: Vec<u32>,
    pub meta: Value,
    /// For f32 transformers fixtures (`exact.safetensors`): the float64 forward's logits and
    /// the max |transformers f32 − float64| error, i.e. the reference's own float32 noise.
    pub exact: Option<(Vec<f32>, f32)>,
}

fn read_f32(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("reference tensor {name}: {e}"));
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn read_i32(st: &SafeTensors, name: &str) -> Vec<i32> {
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("reference tensor {name}: {e}"));
    t.data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

pub fn reference(name: &str) -> Reference {
    let dir = model_dir(name);
    let bytes = std::fs::read(dir.join("reference.safetensors")).expect("reference.safetensors");
    let st = SafeTensors::deserialize(&bytes).expect("valid reference.safetensors");
    let vocab = st.tensor("logits").expect("logits").shape()[1];
    let logits = read_f32(&st, "logits");
    let exact = std::fs::read(dir.join("exact.safetensors"))
        .ok()
        .map(|bytes| {
            let st = SafeTensors::deserialize(&bytes).expect("valid exact.safetensors");
            (
                read_f32(&st, "logits_f64"),
                read_f32(&st, "reference_error")[0],
            )
        });
    let meta = std::fs::read_to_string(dir.join("reference.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null);
    Reference {
        prompt_ids: read_i32(&st, "prompt_ids")
            .into_iter()
            .map(|v| v as u32)
            .collect(),
        logits,
        vocab,
        greedy_ids: read_i32(&st, "greedy_ids")
            .into_iter()
            .map(|v| v as u32)
            .collect(),
        meta,
        exact,
    }
}

/// All-position logits `[len, vocab]` (row-major) of one forward pass over `ids` with fresh caches.
pub fn logits_for(model: &dyn mlxcel_arch::LanguageModel, ids: &[u32]) -> Vec<f32> {
    let input: Vec<i32> = ids.iter().map(|t| *t as i32).collect();
    let tokens =
        mlxcel_core::Array::from_slice(&input, &[1, input.len() as i32]).expect("token array");
    let mut caches = model.make_caches();
    model
        .forward(&tokens, &mut caches)
        .expect("forward")
        .to_vec::<f32>()
        .expect("f32 logits")
}

/// The primitives of one decode step's graph (`(name, count)`) after a three-token prompt, the
/// token embedded and evaluated first: empty when the CPU decode engine computed it, the CUDA
/// step's one array when that did. The step is evaluated before returning.
pub fn decode_step_census(model: &dyn mlxcel_arch::LanguageModel) -> Vec<(String, usize)> {
    use mlxcel_core::Array;
    let mut caches = model.make_caches();
    let prompt = Array::from_slice(&[1i32, 2, 3], &[1, 3]).unwrap();
    model
        .forward_last(&prompt, &mut caches)
        .unwrap()
        .eval()
        .unwrap();
    let token = Array::from_slice(&[4i32], &[1, 1]).unwrap();
    let embedded = model.embed(&token).unwrap();
    embedded.eval().unwrap();
    let logits = model
        .forward_embeddings(&embedded, None, &mut caches, true)
        .unwrap();
    let census = mlxcel_core::ops::graph_census([&logits]).unwrap();
    logits.eval().unwrap();
    census
}

/// An array's values as float32, flattened (logits of any float dtype, for comparing).
pub fn floats(a: &mlxcel_core::Array) -> Vec<f32> {
    a.astype(mlxcel_core::Dtype::Float32)
        .unwrap()
        .reshape(&[-1])
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
}

/// Largest absolute difference and where it is.
pub fn max_abs_diff(got: &[f32], want: &[f32]) -> (f32, usize) {
    assert_eq!(got.len(), want.len(), "logit counts differ");
    got.iter()
        .zip(want)
        .enumerate()
        .map(|(i, (g, w))| ((g - w).abs(), i))
        .fold((0.0, 0), |best, cur| {
            if cur.0 > best.0 || cur.0.is_nan() {
                cur
            } else {
                best
            }
        })
}

/// Loads fixture `name` with default options (no tokenizer) and checks it against its
/// reference: prefill logits within `tolerance`, greedy ids equal.
pub fn assert_matches_reference(name: &str, tolerance: f32) {
    assert_matches_reference_with(name, tolerance, None);
}

/// [`assert_matches_reference`] loading under `policy` (`None`: the environment's), for tests
/// that switch a kernel path (kernel paths, dequantized prefill).
pub fn assert_matches_reference_with(
    name: &str,
    tolerance: f32,
    policy: Option<mlxcel_core::RuntimePolicy>,
) {
    use mlxcel_loading::{load_model, LoadOptions};
    let r = reference(name);
    let loaded = load_model(
        model_dir(name),
        &LoadOptions {
            skip_tokenizer: true,
            policy,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    let got = logits_for(&loaded.model, &r.prompt_ids);
    let (diff, at) = max_abs_diff(&got, &r.logits);
    assert!(
        diff <= tolerance,
        "{name}: prefill logits differ by {diff:.2e} at {at}"
    );
    assert_greedy_ids(&loaded.model, &r, name);
}

/// Greedy decoding of `model` from the reference's prompt gives the reference's ids.
pub fn assert_greedy_ids(model: &dyn mlxcel_arch::LanguageModel, r: &Reference, name: &str) {
    let out =
        mlxcel_arch::generate::greedy(model, &r.prompt_ids, r.greedy_ids.len(), None, |_| false)
            .unwrap();
    assert_eq!(
        out, r.greedy_ids,
        "{name}: greedy ids against the reference"
    );
}

/// Loads the model in `dir` without its tokenizer (the logits tests need none), panicking with
/// the folder and the error.
pub fn load_without_tokenizer(dir: impl AsRef<Path>) -> mlxcel_loading::Loaded {
    let dir = dir.as_ref();
    let options = mlxcel_loading::LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    };
    mlxcel_loading::load_model(dir, &options).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// The largest |Δ| between the prefill logits of the model in `dir` (loaded without its
/// tokenizer) and fixture `name`'s reference: for checkpoints rewritten from a fixture, which
/// must still give its logits (or, for a switched-off feature, must not).
pub fn distance_to_reference(dir: impl AsRef<Path>, name: &str) -> f32 {
    let loaded = load_without_tokenizer(dir);
    let r = reference(name);
    max_abs_diff(&logits_for(&loaded.model, &r.prompt_ids), &r.logits).0
}

/// mlxcel's logits for fixture `name` against transformers' (its reference) and against
/// mlx-lm's ([`mlx_lm_logits`]), for the fixtures where the two references disagree:
/// (distance to transformers, distance to mlx-lm).
pub fn distances_to_transformers_and_mlx_lm(name: &str) -> (f32, f32) {
    let loaded = load_without_tokenizer(model_dir(name));
    let r = reference(name);
    let got = logits_for(&loaded.model, &r.prompt_ids);
    (
        max_abs_diff(&got, &r.logits).0,
        max_abs_diff(&got, &mlx_lm_logits(name)).0,
    )
}

/// mlx-lm's logits `[prompt_len, vocab]` (row-major) for fixture `name`, from
/// `mlx_lm_logits.safetensors` (written by `generate.py --stage mlx-lm-diffs` for the fixtures
/// where mlx-lm and transformers disagree).
pub fn mlx_lm_logits(name: &str) -> Vec<f32> {
    let path = model_dir(name).join("mlx_lm_logits.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).expect("valid mlx_lm_logits.safetensors");
    read_f32(&st, "logits")
}

/// `dir/config.json`.
pub fn read_config(dir: &Path) -> Value {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("config.json is valid JSON")
}

/// Writes `config` as `dir/config.json` (a [`copy_fixture`] folder).
pub fn write_config(dir: &Path, config: &Value) {
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config.json");
}

/// Rewrites `dir/config.json` (a [`copy_fixture`] folder) through `edit`.
pub fn edit_config(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let mut config = read_config(dir);
    edit(&mut config);
    write_config(dir, &config);
}

/// The real SmolLM2-135M-Instruct 4-bit folder that `cargo xtask fetch-models` writes, or
/// `None` after printing a `skip:` line when it has not been fetched (tests on it then pass
/// without running).
pub fn fetched_smollm2() -> Option<PathBuf> {
    let folder = mlxcel_core::cache_dir()
        .unwrap_or_default()
        .join("models/SmolLM2-135M-Instruct-4bit");
    if folder.join("config.json").is_file() {
        return Some(folder);
    }
    println!(
        "skip: {} missing (run `cargo xtask fetch-models`)",
        folder.display()
    );
    None
}
