//! `cargo xtask bench --llama-cpp`: mlxcel against llama.cpp on the same weights, on the CPU.
//!
//! llama.cpp is `llama-cpp-python` (built natively at install, as pip builds it from its sdist)
//! reading a GGUF through `xtask/bench/llama_cpp_bench.py`; mlxcel reads its lossless MLX import
//! of the same file (`cargo xtask fetch-models` imports SmolLM2-135M-Instruct's Q4_1 GGUF: Q4_1 →
//! affine 4-bit, the Q8_0 tied embedding → affine 8-bit). Both get the same prompt ids, token
//! counts and thread count (`--threads`, default 2: `MLXCEL_CPU_THREADS` and llama.cpp's
//! `n_threads`/`n_threads_batch`). Runs alternate between the engines — mlxcel with its CPU decode
//! engine, the same with int8 activations (`MLXCEL_CPU_ACTIVATIONS=q8`), mlxcel with
//! `MLXCEL_CPU_DECODE=0` (the MLX graph: the "before"), llama.cpp — and the
//! table gives medians, ratios against llama.cpp, the greedy ids' agreement (reported, not
//! failed: llama.cpp quantizes activations to 8 bits, so near-ties can flip) and the machine's
//! load average before and after (the machine may be shared; ratios of the same run hold up
//! better than absolute numbers).
//!
//! Models: SmolLM2-135M-Instruct (128/32 and 512/128) and a Llama-3.2-1B-shaped model with random
//! weights (the same lengths; see [`llama_1b_gguf`]).
//!
//! The Python is `MLXCEL_BENCH_LLAMA_CPP_PYTHON`, else the bench venv (`target/bench/venv`),
//! where `llama-cpp-python==0.3.36` (a native build: minutes) and `gguf` are installed on first
//! use.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::stats::{self, fmt, fmt_ratio, ratio, summarize, Sample};
use super::{prompt_ids, Paths};

const LLAMA_CPP_PIN: &str = "llama-cpp-python==0.3.36";

/// Writes the 1B-class GGUF (`make_gguf_1b.py`); pure Python.
const GGUF_PIN: &str = "gguf==0.19.0";

const LLAMA_CPP_X86_CMAKE_ARGS: &str = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
     -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
     -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF \
     -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// mlxcel as shipped: the CPU decode engine on.
    Mlxcel,
    /// mlxcel's CPU decode engine with `MLXCEL_CPU_ACTIVATIONS=q8`: decode products on int8
    /// activations, the arithmetic llama.cpp's quantized dot products use.
    MlxcelInt8,
    /// mlxcel with `MLXCEL_CPU_DECODE=0`: every decode step an MLX graph.
    MlxcelGraph,
    LlamaCpp,
}

impl Engine {
    const ALL: [Engine; 4] = [
        Engine::Mlxcel,
        Engine::MlxcelInt8,
        Engine::MlxcelGraph,
        Engine::LlamaCpp,
    ];
    fn label(self) -> &'static str {
        match self {
            Engine::Mlxcel => "mlxcel",
            Engine::MlxcelInt8 => "mlxcel, int8 activations",
            Engine::MlxcelGraph => "mlxcel, MLX graph decode",
            Engine::LlamaCpp => "llama.cpp",
        }
    }
}

/// One model both engines read: the GGUF and mlxcel's import of it, and the (prompt, new)
/// lengths to run.
pub struct Weights {
    pub name: &'static str,
    pub gguf: PathBuf,
    pub mlx: PathBuf,
    pub vocab: u64,
    pub lengths: Vec<(usize, usize)>,
}

/// The 1B-class case: a Llama-3.2-1B-shaped GGUF with random Q4_1 layers and a Q8_0 embedding
/// (`xtask/bench/make_gguf_1b.py`, written with the `gguf` package, SmolLM2's tokenizer), and
/// mlxcel's lossless import of it (`mlxcel convert --gguf`), both made once under
/// target/bench/models. `vocab` is left 0 for the caller to read from the import.
pub fn llama_1b_gguf(p: &Paths, py: &Path, bin: &Path, tokenizer_gguf: &Path) -> Result<Weights> {
    let gguf = p.models.join("llama-1b-shape-q4_1.gguf");
    let mlx = p.models.join("llama-1b-shape-q4_1-mlx");
    std::fs::create_dir_all(&p.models)?;
    if !gguf.is_file() {
        eprintln!("bench: writing {}", gguf.display());
        let script = p.root.join("xtask").join("bench").join("make_gguf_1b.py");
        let partial = gguf.with_extension("gguf.partial");
        let ok = Command::new(py)
            .arg(&script)
            .arg(tokenizer_gguf)
            .arg(&partial)
            .status()
            .context("running make_gguf_1b.py")?
            .success();
        if !ok {
            bail!("make_gguf_1b.py failed");
        }
        std::fs::rename(&partial, &gguf)?;
    }
    if !mlx.join("config.json").is_file() {
        let _ = std::fs::remove_dir_all(&mlx);
        let ok = Command::new(bin)
            .args(["convert", "--gguf"])
            .arg(&gguf)
            .arg("--out")
            .arg(&mlx)
            .status()
            .context("running mlxcel convert")?
            .success();
        if !ok {
            bail!("mlxcel convert --gguf {} failed", gguf.display());
        }
    }
    Ok(Weights {
        name: "Llama-1B-shape Q4_1",
        gguf,
        mlx,
        vocab: 0,
        lengths: Vec::new(),
    })
}

/// The Python that imports `llama_cpp` (installing the pinned package into `venv_python`'s venv
/// when it is the bench venv's and lacks it).
pub fn python(venv_python: impl FnOnce() -> Result<PathBuf>) -> Result<PathBuf> {
    if let Some(py) = std::env::var_os("MLXCEL_BENCH_LLAMA_CPP_PYTHON") {
        return Ok(PathBuf::from(py));
    }
    let py = venv_python()?;
    let has = |py: &Path| {
        Command::new(py)
            .args(["-c", "import llama_cpp, numpy, gguf"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    if !has(&py) {
        eprintln!("bench: installing {LLAMA_CPP_PIN} (native build) into the bench venv");
        let mut pip = Command::new(&py);
        // ggml's AMX matmul (in a native build wherever the CPU reports AMX) crashed with SIGSEGV
        // in `ggml_backend_amx_mul_mat` on the first matmul on the Sapphire-Rapids-class VM of
        // 2026-12-02, so llama.cpp is built for the x86-64 features it uses besides AMX
        // (AVX-512 with VNNI/VBMI/BF16, AVX2, FMA, F16C); `GGML_AMX_*=OFF` alone does not stop
        // `GGML_NATIVE` from enabling it. `CMAKE_ARGS` set by the caller wins (other CPUs).
        if std::env::var_os("CMAKE_ARGS").is_none() && cfg!(target_arch = "x86_64") {
            pip.env("CMAKE_ARGS", LLAMA_CPP_X86_CMAKE_ARGS);
        }
        let ok = pip
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
            .args([LLAMA_CPP_PIN, "numpy", GGUF_PIN])
            .status()
            .context("running pip install")?
            .success();
        if !ok || !has(&py) {
            bail!("pip install {LLAMA_CPP_PIN} into {} failed", py.display());
        }
    }
    Ok(py)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

struct Row {
    weights: String,
    prompt: usize,
    new: usize,
    per_engine: Vec<(Engine, stats::Summary)>,
    agreement: String,
}

/// Runs every (weights, lengths) pair `runs` times per engine, alternating; returns the
/// markdown table.
pub fn run(
    p: &Paths,
    bin: &Path,
    py: &Path,
    models: &[Weights],
    runs: usize,
    threads: usize,
) -> Result<String> {
    let script = p
        .root
        .join("xtask")
        .join("bench")
        .join("llama_cpp_bench.py");
    let load_before = loadavg();
    let started = std::time::Instant::now();
    let mut rows = Vec::new();
    for w in models {
        for &(prompt, new) in &w.lengths {
            let ids = prompt_ids(prompt, w.vocab, 7);
            let ids = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
            let mut samples: Vec<(Engine, Vec<Sample>)> =
                Engine::ALL.iter().map(|e| (*e, Vec::new())).collect();
            let mut first_ids: Vec<(Engine, String)> = Vec::new();
            for run in 0..runs {
                for (i, engine) in Engine::ALL.iter().enumerate() {
                    let mut cmd = match engine {
                        Engine::Mlxcel | Engine::MlxcelInt8 | Engine::MlxcelGraph => {
                            let mut c = Command::new(bin);
                            c.arg("generate").arg("--model").arg(&w.mlx).args([
                                "--quiet",
                                "--print-ids",
                                "--ignore-eos",
                                "--stats-json",
                                "--force",
                            ]);
                            c.env("MLXCEL_CPU_THREADS", threads.to_string());
                            c.env(
                                "MLXCEL_CPU_DECODE",
                                if *engine == Engine::MlxcelGraph {
                                    "0"
                                } else {
                                    "1"
                                },
                            );
                            c.env(
                                "MLXCEL_CPU_ACTIVATIONS",
                                if *engine == Engine::MlxcelInt8 {
                                    "q8"
                                } else {
                                    "f32"
                                },
                            );
                            c
                        }
                        Engine::LlamaCpp => {
                            let mut c = Command::new(py);
                            c.arg(&script).arg(&w.gguf).arg("--print-ids");
                            c.args(["--threads", &threads.to_string()]);
                            c
                        }
                    };
                    cmd.arg("--prompt-ids")
                        .arg(&ids)
                        .arg("--max-new")
                        .arg(new.to_string());
                    let tag = format!(
                        "llama_cpp-{}-{prompt}-{new}-{}-{run}",
                        w.name,
                        engine.label().replace([' ', ',', '.'], "_")
                    );
                    let done = super::proc::run(cmd, &p.logs, &tag)?;
                    let mut s = stats::parse_stats(&done.stderr)
                        .with_context(|| format!("{tag}: no stats line on stderr"))?;
                    if s.peak_rss_bytes == 0 {
                        s.peak_rss_bytes = done.max_rss_bytes;
                    }
                    eprintln!(
                        "  {tag}: prefill {:.1} tok/s decode {:.1} tok/s (load avg {})",
                        s.prefill_tps,
                        s.decode_tps,
                        loadavg()
                    );
                    if s.generated_tokens as usize != new {
                        bail!(
                            "{tag}: generated {} tokens, expected {new}",
                            s.generated_tokens
                        );
                    }
                    if run == 0 {
                        first_ids.push((*engine, done.stdout.trim().to_string()));
                    }
                    samples[i].1.push(s);
                }
            }
            let get = |e: Engine| {
                first_ids
                    .iter()
                    .find(|o| o.0 == e)
                    .map(|o| o.1.split(',').map(str::to_string).collect::<Vec<_>>())
                    .unwrap_or_default()
            };
            let agree =
                |a: &[String], b: &[String]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
            let (ours, int8, graph, theirs) = (
                get(Engine::Mlxcel),
                get(Engine::MlxcelInt8),
                get(Engine::MlxcelGraph),
                get(Engine::LlamaCpp),
            );
            let agreement = format!(
                "greedy ids, identical for the first n of {new}: engine = graph {}; mlxcel = llama.cpp {}; int8 activations = mlxcel {}, = llama.cpp {}",
                agree(&ours, &graph),
                agree(&ours, &theirs),
                agree(&int8, &ours),
                agree(&int8, &theirs)
            );
            rows.push(Row {
                weights: w.name.to_string(),
                prompt,
                new,
                per_engine: samples
                    .into_iter()
                    .map(|(e, s)| (e, summarize(&s)))
                    .collect(),
                agreement,
            });
        }
    }
    let mut s = format!(
        "Command: `cargo xtask bench --llama-cpp --runs {runs} --threads {threads}` ({:.0} s); {} cores; load average (1/5/15 min) {load_before} before, {} after.\n\n",
        started.elapsed().as_secs_f64(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        loadavg()
    );
    s.push_str("| weights | prompt/new | engine | prefill tok/s | decode tok/s | prefill vs llama.cpp | decode vs llama.cpp | peak RSS MiB |\n");
    s.push_str("|---|---|---|---:|---:|---:|---:|---:|\n");
    for r in &rows {
        let base = r
            .per_engine
            .iter()
            .find(|(e, _)| *e == Engine::LlamaCpp)
            .map(|(_, s)| s.clone())
            .unwrap_or_default();
        for (e, sum) in &r.per_engine {
            s.push_str(&format!(
                "| {} | {}/{} | {} | {} | {} | {} | {} | {} |\n",
                r.weights,
                r.prompt,
                r.new,
                e.label(),
                fmt(sum.prefill_tps, 1),
                fmt(sum.decode_tps, 1),
                fmt_ratio(ratio(sum.prefill_tps, base.prefill_tps)),
                fmt_ratio(ratio(sum.decode_tps, base.decode_tps)),
                fmt(sum.peak_rss_mib, 0),
            ));
        }
    }
    s.push('\n');
    for r in &rows {
        s.push_str(&format!(
            "- {} {}/{}: {}\n",
            r.weights, r.prompt, r.new, r.agreement
        ));
    }
    Ok(s)
}
