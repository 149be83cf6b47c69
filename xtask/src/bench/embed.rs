//! `cargo xtask bench --embeddings`: sentences per second of `mlxcel embed` against
//! sentence-transformers on torch (CPU), on all-MiniLM-L6-v2 (from `cargo xtask fetch-models`),
//! the same texts (a seeded mix of short and long sentences) in batches of 32, in the same run.
//!
//! The sentence-transformers side runs `xtask/bench/st_embed_bench.py` with
//! `MLXCEL_BENCH_ST_PYTHON`, else the bench venv (`target/bench/venv`), into which torch (from
//! PyPI), transformers and sentence-transformers are installed on demand the first time (a few GB
//! with torch's CUDA libraries; it says so). Runs alternate between the engines;
//! the table reports medians and the ratio mlxcel / sentence-transformers.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::proc;
use super::stats::median;

/// Pinned like the fixture venv (tests/fixtures/requirements.txt).
const ST_PINS: [&str; 3] = [
    "sentence-transformers==6.2.0",
    "transformers==5.24.0",
    "tokenizers==0.23.3",
];
const TORCH_PIN: &str = "torch==2.15.0";
const BATCH: usize = 32;
const TEXTS: usize = 1024;

/// Words the benchmark texts are drawn from.
const WORDS: &[&str] = &[
    "the",
    "model",
    "reads",
    "every",
    "token",
    "of",
    "a",
    "sentence",
    "and",
    "writes",
    "one",
    "vector",
    "river",
    "valley",
    "meets",
    "sea",
    "at",
    "old",
    "harbour",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "weights",
    "are",
    "mapped",
    "from",
    "disk",
    "attention",
    "layers",
    "compute",
    "hidden",
    "states",
    "embedding",
    "search",
    "query",
    "document",
    "retrieval",
    "benchmark",
    "language",
    "capital",
    "France",
    "Paris",
    "guitar",
    "music",
];

/// `TEXTS` seeded sentences of 3 to ~120 words (most short, some long; a few pass the
/// model's 256-token limit and are truncated, as in real corpora).
fn texts(seed: u64) -> Vec<String> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    let mut next = move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        x >> 33
    };
    (0..TEXTS)
        .map(|_| {
            // Mixed lengths: 70% short (3-20 words), 25% medium (20-60), 5% long (60-120).
            let r = next() % 100;
            let n = match r {
                0..=69 => 3 + next() % 18,
                70..=94 => 20 + next() % 41,
                _ => 60 + next() % 61,
            };
            let words: Vec<&str> = (0..n)
                .map(|_| WORDS[(next() % WORDS.len() as u64) as usize])
                .collect();
            let mut s = words.join(" ");
            s.push('.');
            s
        })
        .collect()
}

/// The sentence-transformers Python: `MLXCEL_BENCH_ST_PYTHON`, else the bench venv's, with
/// torch and sentence-transformers installed on demand.
fn st_python(venv_python: &Path) -> Result<PathBuf> {
    if let Some(py) = std::env::var_os("MLXCEL_BENCH_ST_PYTHON") {
        return Ok(PathBuf::from(py));
    }
    let check = || {
        Command::new(venv_python)
            .args(["-c", "import torch, sentence_transformers"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    if check() {
        return Ok(venv_python.to_path_buf());
    }
    eprintln!(
        "bench: installing {TORCH_PIN} and {} from PyPI into the bench venv \
         (a one-time download of a few GB; set MLXCEL_BENCH_ST_PYTHON to use another Python)",
        ST_PINS.join(" ")
    );
    let pip = |args: &[&str]| -> Result<()> {
        let ok = Command::new(venv_python)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args(args)
            .status()
            .context("running pip install")?
            .success();
        if !ok {
            bail!("pip install {} failed", args.join(" "));
        }
        Ok(())
    };
    // From PyPI like every other package (the only Python registry this project uses); its
    // Linux wheel brings CUDA libraries it does not need here, which only costs disk.
    pip(&[TORCH_PIN])?;
    pip(&ST_PINS)?;
    if !check() {
        bail!("torch / sentence-transformers still not importable after installing them");
    }
    Ok(venv_python.to_path_buf())
}

/// The last JSON object line of `stderr`.
fn stats_line(stderr: &str) -> Option<Value> {
    stderr
        .lines()
        .rev()
        .filter(|l| l.trim_start().starts_with('{'))
        .find_map(|l| serde_json::from_str(l).ok())
}

/// Runs the comparison and returns its markdown table.
pub fn run(
    root: &Path,
    bench: &Path,
    logs: &Path,
    bin: &Path,
    venv_python: &Path,
    runs: usize,
) -> Result<String> {
    let model = crate::fetch::cache_dir()?
        .join("models")
        .join("all-MiniLM-L6-v2");
    if !model.join("config.json").is_file() {
        bail!(
            "{} is missing: run `cargo xtask fetch-models`",
            model.display()
        );
    }
    let py = st_python(venv_python)?;
    let script = root.join("xtask").join("bench").join("st_embed_bench.py");
    let file = bench.join("embed_texts.txt");
    let all = texts(7);
    std::fs::write(&file, all.join("\n") + "\n")
        .with_context(|| format!("writing {}", file.display()))?;
    let npy = bench.join("embed_mlxcel.npy");
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    let mut min_cosine = f64::NAN;
    let mut torch = String::new();
    for run in 0..runs.max(1) {
        let mut cmd = Command::new(bin);
        cmd.arg("embed")
            .arg("--model")
            .arg(&model)
            .arg("--file")
            .arg(&file)
            .args(["--batch-size", &BATCH.to_string(), "--format", "npy"])
            .arg("--out")
            .arg(&npy)
            .arg("--stats-json");
        let done = proc::run(cmd, logs, &format!("embed-mlxcel-{run}"))?;
        let s = stats_line(&done.stderr).context("mlxcel embed: no stats line on stderr")?;
        let rate = s["texts"].as_f64().unwrap_or(0.0) / s["embed_s"].as_f64().unwrap_or(f64::NAN);
        eprintln!("  embed-mlxcel-{run}: {rate:.1} sentences/s");
        ours.push(rate);

        let mut cmd = Command::new(&py);
        cmd.arg(&script)
            .arg(&model)
            .arg(&file)
            .args(["--batch-size", &BATCH.to_string()])
            .arg("--compare")
            .arg(&npy);
        let done = proc::run(cmd, logs, &format!("embed-st-{run}"))?;
        let s = stats_line(&done.stderr).context("st_embed_bench.py: no stats line on stderr")?;
        let rate = s["texts"].as_f64().unwrap_or(0.0) / s["embed_s"].as_f64().unwrap_or(f64::NAN);
        eprintln!("  embed-st-{run}: {rate:.1} sentences/s");
        theirs.push(rate);
        min_cosine = s["min_cosine"].as_f64().unwrap_or(f64::NAN);
        torch = format!(
            "torch {} ({} threads)",
            s["torch_version"].as_str().unwrap_or("?"),
            s["torch_threads"]
        );
    }
    let (a, b) = (median(&ours), median(&theirs));
    let ratio = match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".into(),
    };
    let f = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.1}"));
    Ok(format!(
        "Embeddings: all-MiniLM-L6-v2, {TEXTS} seeded sentences of 3–120 words, batches of {BATCH}, \
         {} runs per engine (medians; load excluded; no warm-up on either side); \
         sentence-transformers on {torch}. Smallest cosine between the engines' vectors: {min_cosine:.6}.\n\n\
         | engine | sentences/s |\n|---|---|\n| mlxcel | {} |\n| sentence-transformers (torch CPU) | {} |\n| ratio mlxcel / sentence-transformers | {ratio} |\n",
        runs.max(1),
        f(a),
        f(b)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_seeded_and_mixed_in_length() {
        let a = texts(7);
        assert_eq!(a, texts(7));
        assert_eq!(a.len(), TEXTS);
        let words: Vec<usize> = a.iter().map(|t| t.split(' ').count()).collect();
        assert!(words.iter().any(|&n| n < 10) && words.iter().any(|&n| n > 60));
    }
}
