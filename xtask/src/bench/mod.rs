//! `cargo xtask bench`: mlxcel against mlx-lm on the same checkpoints, prompts and token counts.
//!
//! Every measurement is one fresh process: `mlxcel generate --prompt-ids .. --max-new N
//! --print-ids --ignore-eos --stats-json` on one side, `xtask/bench/mlx_lm_bench.py` (in a venv
//! under `target/bench/venv`) on the other, in two configurations: the checkpoint's dtype as
//! mlx-lm loads it, and float32 compute (what mlxcel does on the CPU). Runs alternate between the
//! engines; the table reports medians and ratios mlxcel / mlx-lm. See docs/performance.md.

mod embed;
mod external_ple;
mod llama_cpp;
mod lora;
mod proc;
mod serve;
mod stats;
mod stream;
pub mod synth;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use mlxcel_core::ops::QuantSpec;
use serde_json::{json, Value};

use stats::{fmt, fmt_ratio, ratio, summarize, Sample, Summary};

const MLX_PINS: [&str; 3] = ["mlx==0.32.4", "mlx-cpu==0.32.4", "mlx-lm==0.32.2"];

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// A smaller plan (SmolLM2 4-bit and the 1B-shaped 4-bit, short lengths): a few minutes.
    #[arg(long)]
    quick: bool,
    /// Only cases whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Runs per engine (overrides the plan's counts).
    #[arg(long)]
    runs: Option<usize>,
    /// Print the plan and exit.
    #[arg(long)]
    dry_run: bool,
    /// Instead of the plan: routed-expert streaming on the MoE shape with skewed and uniform
    /// routers, resident against arenas of 10% and 25% of the experts read in each
    /// `MLXCEL_EXPERT_IO` mode, and the disk's sequential read floor (writes
    /// target/bench/expert_stream.md).
    #[arg(long)]
    expert_stream: bool,
    /// With `--expert-stream`: the Qwen3-30B-A3B shape (~17 GB at 4-bit, skewed routing only;
    /// generating it takes ~17 GB of disk, and preparing its stream as much again) instead of
    /// the ~1 GB shape.
    #[arg(long, requires = "expert_stream")]
    large: bool,
    /// Instead of the plan: the Gemma-3n-E2B-shaped 4-bit model with its per-layer-embedding
    /// table resident against on disk (`prepare-external-ple`) in each `MLXCEL_PLE_IO` mode
    /// (writes target/bench/external_ple.md).
    #[arg(long)]
    external_ple: bool,
    /// Instead of the plan: sentences/s of `mlxcel embed` against sentence-transformers (torch,
    /// CPU) on all-MiniLM-L6-v2, batches of 32 (writes target/bench/embeddings.md; installs
    /// torch into the bench venv on first use).
    #[arg(long)]
    embeddings: bool,
    /// Instead of the plan: aggregate decode tok/s of `mlxcel serve` against `mlx_lm.server`
    /// with 1 and 8 concurrent clients on SmolLM2 4-bit (continuous batching; writes
    /// target/bench/serve.md).
    #[arg(long)]
    serve: bool,
    /// Instead of the plan: mlxcel against llama.cpp (llama-cpp-python) on the same weights,
    /// SmolLM2-135M Q4_1 at 128/32 and 512/128 (writes target/bench/llama_cpp.md; installs
    /// llama-cpp-python into the bench venv on first use).
    #[arg(long)]
    llama_cpp: bool,
    /// Threads of both engines in `--llama-cpp` (default 2).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Instead of the plan: decode tok/s of SmolLM2 4-bit with and without a rank-16 runtime
    /// LoRA adapter on every projection, both in this process in alternating short rounds
    /// (default 30, 32-token prompt, 32 new tokens), and the cost as a ratio (writes
    /// target/bench/lora.md).
    #[arg(long)]
    lora: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Mlxcel,
    /// mlx-lm in float32 compute (float parameters cast after loading).
    MlxLmF32,
    /// mlx-lm out of the box (the checkpoint's dtype).
    MlxLm,
}

impl Engine {
    fn label(self) -> &'static str {
        match self {
            Engine::Mlxcel => "mlxcel",
            Engine::MlxLmF32 => "mlx-lm f32",
            Engine::MlxLm => "mlx-lm (checkpoint dtype)",
        }
    }
    fn key(self) -> &'static str {
        match self {
            Engine::Mlxcel => "mlxcel",
            Engine::MlxLmF32 => "mlx_lm_f32",
            Engine::MlxLm => "mlx_lm",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModelId {
    Smol4,
    Smol8,
    Llama1bBf16,
    Llama1b4,
    Qwen3Moe4,
    Qwen3Moe4Uniform,
    Qwen3Moe4Skewed,
    Qwen3Moe30bA3bSkewed,
    Mamba2Q4,
    JambaQ4,
    Qwen3NextQ4,
    Gemma3nE2bQ4,
}

impl ModelId {
    fn dir_name(self) -> &'static str {
        match self {
            ModelId::Smol4 => "SmolLM2-135M-Instruct-4bit",
            ModelId::Smol8 => "SmolLM2-135M-Instruct-8bit-g64",
            ModelId::Llama1bBf16 => "synthetic-llama3.2-1b-bf16",
            ModelId::Llama1b4 => "synthetic-llama3.2-1b-4bit-g64",
            ModelId::Qwen3Moe4 => "synthetic-qwen3moe-1gb-4bit-g64",
            ModelId::Qwen3Moe4Uniform => "synthetic-qwen3moe-1gb-4bit-g64-uniform-routing",
            ModelId::Qwen3Moe4Skewed => "synthetic-qwen3moe-1gb-4bit-g64-skewed-routing",
            ModelId::Qwen3Moe30bA3bSkewed => "synthetic-qwen3-30b-a3b-4bit-g64-skewed-routing",
            ModelId::Mamba2Q4 => "synthetic-mamba2-130m-4bit-g64",
            ModelId::JambaQ4 => "synthetic-jamba-mini-4bit-g64",
            ModelId::Qwen3NextQ4 => "synthetic-qwen3next-mini-4bit-g64",
            ModelId::Gemma3nE2bQ4 => "synthetic-gemma3n-e2b-4bit-g32",
        }
    }
}

/// One row group of the table: a model, lengths, and how many runs each engine gets
/// (0 = skipped, with the reason in `note`).
#[derive(Debug, Clone)]
struct Case {
    name: &'static str,
    model: ModelId,
    prompt: usize,
    new: usize,
    runs: [(Engine, usize); 3],
    note: &'static str,
}

fn case(
    name: &'static str,
    model: ModelId,
    prompt: usize,
    new: usize,
    runs: [usize; 3],
    note: &'static str,
) -> Case {
    Case {
        name,
        model,
        prompt,
        new,
        runs: [
            (Engine::Mlxcel, runs[0]),
            (Engine::MlxLm, runs[1]),
            (Engine::MlxLmF32, runs[2]),
        ],
        note,
    }
}

/// The plans, sized for MLX's scalar single-threaded Linux CPU backend on a 2-core machine
/// (SmolLM2-135M 4-bit runs at single-digit tok/s; the 1B shapes about ten times slower).
fn plan(quick: bool) -> Vec<Case> {
    use ModelId::*;
    if quick {
        return vec![
            case("smollm2-135m-4bit", Smol4, 128, 32, [1, 1, 1], ""),
            case(
                "llama-1b-shape-4bit",
                Llama1b4,
                32,
                8,
                [1, 0, 1],
                "short lengths; mlx-lm checkpoint dtype skipped (bf16 emulated on CPU, slower than f32)",
            ),
        ];
    }
    vec![
        case(
            "smollm2-135m-4bit",
            Smol4,
            512,
            128,
            [3, 1, 3],
            "mlx-lm checkpoint dtype: 1 run (time)",
        ),
        case("smollm2-135m-8bit", Smol8, 128, 32, [1, 1, 1], "short lengths (time)"),
        case(
            "llama-1b-shape-4bit",
            Llama1b4,
            32,
            8,
            [1, 0, 1],
            "short lengths; mlx-lm checkpoint dtype skipped (bf16 emulated on CPU)",
        ),
        case(
            "llama-1b-shape-bf16",
            Llama1bBf16,
            32,
            8,
            [1, 0, 1],
            "short lengths; mlx-lm checkpoint dtype skipped (bf16 matmuls emulated on CPU: far slower)",
        ),
        case(
            "qwen3moe-1gb-shape-4bit",
            Qwen3Moe4,
            32,
            8,
            [1, 0, 1],
            "short lengths; mlx-lm checkpoint dtype skipped (bf16 gather_qmm emulated on CPU: minutes per run)",
        ),
        case(
            "mamba2-130m-shape-4bit",
            Mamba2Q4,
            256,
            32,
            [1, 0, 1],
            "state-space (SSD) stack; mlx-lm checkpoint dtype skipped (bf16 emulated on CPU)",
        ),
        case(
            "jamba-mini-shape-4bit",
            JambaQ4,
            128,
            16,
            [1, 0, 1],
            "7 Mamba + 1 attention layer, MoE on odd layers; mlx-lm checkpoint dtype skipped (bf16 emulated on CPU)",
        ),
        case(
            "qwen3_next-mini-shape-4bit",
            Qwen3NextQ4,
            128,
            16,
            [1, 0, 1],
            "6 gated-DeltaNet + 2 gated-attention layers, 32 experts top-4 + shared on every layer; mlx-lm checkpoint dtype skipped (bf16 emulated on CPU)",
        ),
    ]
}

struct Paths {
    root: PathBuf,
    bench: PathBuf,
    models: PathBuf,
    logs: PathBuf,
}

fn paths() -> Result<Paths> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("xtask has no parent folder")?
        .to_path_buf();
    let bench = root.join("target").join("bench");
    let p = Paths {
        models: bench.join("models"),
        logs: bench.join("logs"),
        bench,
        root,
    };
    for d in [&p.bench, &p.models, &p.logs] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    Ok(p)
}

/// The mlx-lm Python: `MLXCEL_BENCH_PYTHON`, else `target/bench/venv` (created with the pinned
/// packages when missing).
fn python(p: &Paths) -> Result<PathBuf> {
    if let Some(py) = std::env::var_os("MLXCEL_BENCH_PYTHON") {
        return Ok(PathBuf::from(py));
    }
    let venv = p.bench.join("venv");
    let py = venv.join("bin").join("python");
    let check = |py: &Path| {
        Command::new(py)
            .args(["-c", "import mlx.core, mlx_lm"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    if py.is_file() && check(&py) {
        return Ok(py);
    }
    eprintln!(
        "bench: creating {} with {}",
        venv.display(),
        MLX_PINS.join(" ")
    );
    let host = std::env::var("MLXCEL_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&host)
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .with_context(|| format!("running {host} -m venv"))?
        .success();
    if !ok {
        bail!("{host} -m venv {} failed", venv.display());
    }
    let ok = Command::new(&py)
        .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
        .args(MLX_PINS)
        .status()
        .context("running pip install")?
        .success();
    if !ok || !check(&py) {
        bail!(
            "pip install {} into {} failed",
            MLX_PINS.join(" "),
            venv.display()
        );
    }
    Ok(py)
}

/// Builds (if needed) and returns the release `mlxcel` binary.
fn mlxcel_binary(p: &Paths) -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let ok = Command::new(&cargo)
        .current_dir(&p.root)
        .args(["build", "--release", "--quiet", "-p", "mlxcel-cli"])
        .status()
        .context("running cargo build")?
        .success();
    if !ok {
        bail!("cargo build --release -p mlxcel-cli failed");
    }
    let bin = p.root.join("target").join("release").join("mlxcel");
    if !bin.is_file() {
        bail!("no {} after the build", bin.display());
    }
    Ok(bin)
}

/// The model folder, made when missing.
fn ensure_model(p: &Paths, id: ModelId) -> Result<PathBuf> {
    let smol = crate::fetch::cache_dir()?
        .join("models")
        .join(ModelId::Smol4.dir_name());
    if id == ModelId::Smol4 {
        if !smol.join("config.json").is_file() {
            bail!(
                "{} is missing: run `cargo xtask fetch-models`",
                smol.display()
            );
        }
        return Ok(smol);
    }
    let dest = p.models.join(id.dir_name());
    if dest.join("config.json").is_file() && dest.join("model.safetensors").is_file() {
        return Ok(dest);
    }
    let started = Instant::now();
    eprintln!("bench: making {}", dest.display());
    let q4 = Some(QuantSpec::affine(64, 4));
    let mut progress = |i: usize, n: usize| {
        if i % 16 == 0 {
            eprint!("\r  tensor {i}/{n}");
        }
    };
    match id {
        ModelId::Smol4 => unreachable!("handled above"),
        ModelId::Smol8 => {
            let smol = ensure_model(p, ModelId::Smol4)?;
            synth::requantize(&smol, &dest, QuantSpec::affine(64, 8))?;
        }
        ModelId::Llama1bBf16
        | ModelId::Llama1b4
        | ModelId::Qwen3Moe4
        | ModelId::Qwen3Moe4Uniform
        | ModelId::Qwen3Moe4Skewed
        | ModelId::Qwen3Moe30bA3bSkewed
        | ModelId::Mamba2Q4
        | ModelId::JambaQ4
        | ModelId::Qwen3NextQ4
        | ModelId::Gemma3nE2bQ4 => {
            let (m, seed) = match id {
                ModelId::Gemma3nE2bQ4 => (synth::gemma3n_e2b(Some(QuantSpec::affine(32, 4))), 6),
                ModelId::Llama1bBf16 => (synth::llama_1b(None), 1),
                ModelId::Llama1b4 => (synth::llama_1b(q4), 1),
                ModelId::Mamba2Q4 => (synth::mamba2(q4), 3),
                ModelId::JambaQ4 => (synth::jamba(q4), 4),
                ModelId::Qwen3NextQ4 => (synth::qwen3_next(q4), 5),
                // The same seed: the three differ in their embedding and routers only.
                ModelId::Qwen3Moe4Uniform => (synth::qwen3_moe(q4, synth::Routing::Uniform), 2),
                ModelId::Qwen3Moe4Skewed => (synth::qwen3_moe(q4, synth::Routing::Skewed), 2),
                ModelId::Qwen3Moe30bA3bSkewed => {
                    (synth::qwen3_30b_a3b(q4, synth::Routing::Skewed), 2)
                }
                _ => (synth::qwen3_moe(q4, synth::Routing::Random), 2),
            };
            eprintln!(
                "  {:.2} GB of random weights (seed {seed})",
                m.nbytes() as f64 / 1e9
            );
            m.write(&dest, seed, &mut progress)?;
        }
    }
    eprintln!("\r  done in {:.0}s", started.elapsed().as_secs_f64());
    Ok(dest)
}

/// Seeded prompt ids in `[1000, min(vocab, 32000))`, clear of the usual special-token ranges.
fn prompt_ids(n: usize, vocab: u64, seed: u64) -> Vec<u32> {
    let hi = vocab.min(32000);
    let span = hi.saturating_sub(1000).max(1);
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (1000 + (x >> 33) % span) as u32
        })
        .collect()
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    Ok(files)
}

/// The load floor: seconds to read every safetensors byte from the page cache into one buffer
/// (after a warm-up read), median of three; and the byte count.
fn load_floor(dir: &Path) -> Result<(f64, u64)> {
    let files = safetensors_files(dir)?;
    let total: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    let mut buf = vec![0u8; total as usize];
    let read_all = |buf: &mut [u8]| -> Result<f64> {
        let t = Instant::now();
        let mut at = 0usize;
        for f in &files {
            let mut file = std::fs::File::open(f)?;
            let len = file.metadata()?.len() as usize;
            file.read_exact(&mut buf[at..at + len])?;
            at += len;
        }
        Ok(t.elapsed().as_secs_f64())
    };
    read_all(&mut buf)?;
    let times = [
        read_all(&mut buf)?,
        read_all(&mut buf)?,
        read_all(&mut buf)?,
    ];
    Ok((stats::median(&times).unwrap_or(f64::NAN), total))
}

fn vocab_of(dir: &Path) -> Result<u64> {
    let text = std::fs::read_to_string(dir.join("config.json"))?;
    let v: Value = serde_json::from_str(&text)?;
    v.get("vocab_size")
        .and_then(Value::as_u64)
        .with_context(|| format!("{}: no vocab_size", dir.display()))
}

fn hardware(py: &Path) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_gib = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map(|kib| kib / (1u64 << 20) as f64);
    let mlx_lm = Command::new(py)
        .args([
            "-c",
            "import importlib.metadata as m; print(m.version('mlx-lm'))",
        ])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let git = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    json!({
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "memory_gib": mem_gib,
        "mlx_version": mlxcel_core::mlx_version().unwrap_or_default(),
        "device": mlxcel_core::default_device().map(|d| format!("{d:?}")).unwrap_or_default(),
        "mlx_lm_version": mlx_lm,
        "git": git,
    })
}

struct CaseResult {
    case: Case,
    floor_s: f64,
    bytes: u64,
    per_engine: Vec<(Engine, Summary, Vec<Sample>)>,
    mismatch: Option<String>,
}

fn command_for(
    engine: Engine,
    bin: &Path,
    py: &Path,
    script: &Path,
    model: &Path,
    ids: &str,
    new: usize,
) -> Command {
    let mut cmd = match engine {
        Engine::Mlxcel => {
            let mut c = Command::new(bin);
            c.arg("generate").arg("--model").arg(model);
            c.args([
                "--quiet",
                "--print-ids",
                "--ignore-eos",
                "--stats-json",
                "--force",
            ]);
            c
        }
        Engine::MlxLm | Engine::MlxLmF32 => {
            let mut c = Command::new(py);
            c.arg(script).arg(model).arg("--print-ids");
            if engine == Engine::MlxLmF32 {
                c.args(["--dtype", "f32"]);
            }
            c
        }
    };
    cmd.arg("--prompt-ids")
        .arg(ids)
        .arg("--max-new")
        .arg(new.to_string());
    cmd
}

pub fn bench(args: BenchArgs) -> Result<()> {
    let p = paths()?;
    if args.expert_stream {
        let models = if args.large {
            vec![("skewed", ensure_model(&p, ModelId::Qwen3Moe30bA3bSkewed)?)]
        } else {
            vec![
                ("skewed", ensure_model(&p, ModelId::Qwen3Moe4Skewed)?),
                ("uniform", ensure_model(&p, ModelId::Qwen3Moe4Uniform)?),
            ]
        };
        let prompt = prompt_ids(32, 32000, 7);
        let table = stream::compare(&models, &prompt, 64)?;
        let out = p.bench.join(if args.large {
            "expert_stream_large.md"
        } else {
            "expert_stream.md"
        });
        std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
        println!("{table}");
        return Ok(());
    }
    if args.external_ple {
        let model = ensure_model(&p, ModelId::Gemma3nE2bQ4)?;
        let bin = mlxcel_binary(&p)?;
        let prompt = prompt_ids(32, 262_144, 7);
        let table = external_ple::run(&bin, &p.logs, &model, &prompt, 16, args.runs.unwrap_or(2))?;
        let out = p.bench.join("external_ple.md");
        std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
        println!("{table}");
        return Ok(());
    }
    if args.serve {
        let model = ensure_model(&p, ModelId::Smol4)?;
        let bin = mlxcel_binary(&p)?;
        let py = python(&p)?;
        let table = serve::run(&p.logs, &bin, &py, &model, args.runs.unwrap_or(3))?;
        let out = p.bench.join("serve.md");
        std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
        println!("{table}");
        return Ok(());
    }
    if args.llama_cpp {
        let smol = ensure_model(&p, ModelId::Smol4)?;
        let gguf = crate::fetch::cache_dir()?
            .join("downloads")
            .join("SmolLM2-135M-Instruct.Q4_1.gguf");
        if !gguf.is_file() {
            bail!(
                "{} is missing: run `cargo xtask fetch-models`",
                gguf.display()
            );
        }
        let py = llama_cpp::python(|| python(&p))?;
        let bin = mlxcel_binary(&p)?;
        let one_b = llama_cpp::llama_1b_gguf(&p, &py, &bin, &gguf)?;
        let models = vec![
            llama_cpp::Weights {
                name: "SmolLM2-135M Q4_1",
                gguf,
                vocab: vocab_of(&smol)?,
                mlx: smol,
                lengths: vec![(128, 32), (512, 128)],
            },
            llama_cpp::Weights {
                vocab: vocab_of(&one_b.mlx)?,
                lengths: vec![(128, 32), (512, 128)],
                ..one_b
            },
        ];
        let table = llama_cpp::run(&p, &bin, &py, &models, args.runs.unwrap_or(3), args.threads)?;
        let out = p.bench.join("llama_cpp.md");
        std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
        println!("{table}");
        return Ok(());
    }
    if args.lora {
        let model = ensure_model(&p, ModelId::Smol4)?;
        let table = lora::run(&p.bench, &model, args.runs.unwrap_or(30), 32, 32)?;
        let out = p.bench.join("lora.md");
        std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
        println!("{table}");
        return Ok(());
    }
    if args.embeddings {
        let bin = mlxcel_binary(&p)?;
        // With MLXCEL_BENCH_ST_PYTHON set the bench venv is not needed (nor made).
        let py = match std::env::var_os("MLXCEL_BENCH_ST_PYTHON") {
            Some(py) => PathBuf::from(py),
            None => python(&p)?,
        };
        let table = embed::run(
            &p.root,
            &p.bench,
            &p.logs,
            &bin,
            &py,
            args.runs.unwrap_or(3),
        )?;
        let out = p.bench.join("embeddings.md");
        std::fs::write(&out, &table).with_context(|| format!("writing {}", out.display()))?;
        println!("{table}");
        return Ok(());
    }
    let mut cases = plan(args.quick);
    if let Some(only) = &args.only {
        cases.retain(|c| c.name.contains(only.as_str()));
        if cases.is_empty() {
            bail!("--only {only}: no case matches");
        }
    }
    if let Some(n) = args.runs {
        for c in &mut cases {
            for r in &mut c.runs {
                if r.1 > 0 {
                    r.1 = n;
                }
            }
        }
    }
    for c in &cases {
        let runs: Vec<String> = c
            .runs
            .iter()
            .map(|(e, n)| format!("{} ×{n}", e.label()))
            .collect();
        eprintln!(
            "bench: {} prompt {} new {}: {}",
            c.name,
            c.prompt,
            c.new,
            runs.join(", ")
        );
    }
    if args.dry_run {
        return Ok(());
    }
    let started = Instant::now();
    let bin = mlxcel_binary(&p)?;
    let py = python(&p)?;
    let script = p.root.join("xtask").join("bench").join("mlx_lm_bench.py");
    let hw = hardware(&py);
    let mut results = Vec::new();
    for c in cases {
        let model = ensure_model(&p, c.model)?;
        let (floor_s, bytes) = load_floor(&model)?;
        let ids = prompt_ids(c.prompt, vocab_of(&model)?, 7);
        let ids = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let mut samples: Vec<(Engine, Vec<Sample>)> =
            c.runs.iter().map(|(e, _)| (*e, Vec::new())).collect();
        let mut outputs: Vec<(Engine, String)> = Vec::new();
        let max_runs = c.runs.iter().map(|r| r.1).max().unwrap_or(0);
        // Alternate: mlxcel, mlx-lm, mlx-lm f32, mlxcel, ...
        for run in 0..max_runs {
            for (i, (engine, n)) in c.runs.iter().enumerate() {
                if run >= *n {
                    continue;
                }
                let tag = format!("{}-{}-{run}", c.name, engine.key());
                let cmd = command_for(*engine, &bin, &py, &script, &model, &ids, c.new);
                let done = proc::run(cmd, &p.logs, &tag)?;
                let mut s = stats::parse_stats(&done.stderr)
                    .with_context(|| format!("{tag}: no stats line on stderr"))?;
                // The child's own VmHWM; wait4's ru_maxrss also counts this process's RSS at
                // the fork (Linux carries the old mm's high-water mark across execve), so it is
                // only a fallback.
                if s.peak_rss_bytes == 0 {
                    s.peak_rss_bytes = done.max_rss_bytes;
                }
                eprintln!(
                    "  {tag}: load {:.2}s prefill {:.2} tok/s decode {:.2} tok/s rss {:.0} MiB ({:.0}s wall)",
                    s.load_s,
                    s.prefill_tps,
                    s.decode_tps,
                    s.peak_rss_bytes as f64 / (1u64 << 20) as f64,
                    done.wall_s
                );
                if s.generated_tokens as usize != c.new {
                    bail!(
                        "{tag}: generated {} tokens, expected {}",
                        s.generated_tokens,
                        c.new
                    );
                }
                outputs.push((*engine, done.stdout.trim().to_string()));
                samples[i].1.push(s);
            }
        }
        // Greedy ids of the same precision should agree; report (not fail) when they don't.
        let first = |e: Engine| outputs.iter().find(|o| o.0 == e).map(|o| o.1.clone());
        let mismatch = match (first(Engine::Mlxcel), first(Engine::MlxLmF32)) {
            (Some(a), Some(b)) if a != b => {
                let same = a
                    .split(',')
                    .zip(b.split(','))
                    .take_while(|(x, y)| x == y)
                    .count();
                Some(format!(
                    "greedy ids of mlxcel and mlx-lm f32 agree for {same} of {} tokens",
                    c.new
                ))
            }
            _ => None,
        };
        let per_engine = samples
            .into_iter()
            .map(|(e, s)| (e, summarize(&s), s))
            .collect();
        results.push(CaseResult {
            case: c,
            floor_s,
            bytes,
            per_engine,
            mismatch,
        });
    }
    let elapsed = started.elapsed().as_secs_f64();
    let command = format!(
        "cargo xtask bench{}{}{}",
        if args.quick { " --quick" } else { "" },
        args.only
            .as_ref()
            .map(|o| format!(" --only {o}"))
            .unwrap_or_default(),
        args.runs
            .map(|n| format!(" --runs {n}"))
            .unwrap_or_default()
    );
    let md = markdown(&results, &hw, &command, elapsed);
    println!("{md}");
    std::fs::write(p.bench.join("results.md"), &md)?;
    std::fs::write(
        p.bench.join("results.json"),
        serde_json::to_string_pretty(&to_json(&results, &hw, &command, elapsed))?,
    )?;
    eprintln!(
        "bench: wrote {} and {}",
        p.bench.join("results.md").display(),
        p.bench.join("results.json").display()
    );
    Ok(())
}

fn summary_of(r: &CaseResult, e: Engine) -> Option<&Summary> {
    r.per_engine
        .iter()
        .find(|x| x.0 == e && x.1.runs > 0)
        .map(|x| &x.1)
}

fn markdown(results: &[CaseResult], hw: &Value, command: &str, elapsed: f64) -> String {
    let mut s = String::new();
    let g = |k: &str| {
        hw.get(k)
            .map(|v| v.to_string().trim_matches('"').to_string())
            .unwrap_or_default()
    };
    s.push_str(&format!(
        "Command: `{command}` ({elapsed:.0} s). Hardware: {}, {} cores, {:.1} GiB; MLX {} ({}), mlx-lm {}; commit {}.\n\n",
        g("cpu"),
        g("cores"),
        hw.get("memory_gib").and_then(Value::as_f64).unwrap_or(0.0),
        g("mlx_version"),
        g("device"),
        g("mlx_lm_version"),
        g("git"),
    ));
    s.push_str("| case | prompt/new | engine | runs | load s | load floor s | prefill tok/s | decode tok/s | peak RSS MiB |\n");
    s.push_str("|---|---|---|---:|---:|---:|---:|---:|---:|\n");
    for r in results {
        for (e, sum, _) in &r.per_engine {
            let c = &r.case;
            if sum.runs == 0 {
                s.push_str(&format!(
                    "| {} | {}/{} | {} | 0 | skipped | | | | |\n",
                    c.name,
                    c.prompt,
                    c.new,
                    e.label()
                ));
                continue;
            }
            s.push_str(&format!(
                "| {} | {}/{} | {} | {} | {} | {:.3} ({:.0} MB) | {} | {} | {} |\n",
                c.name,
                c.prompt,
                c.new,
                e.label(),
                sum.runs,
                fmt(sum.load_s, 2),
                r.floor_s,
                r.bytes as f64 / 1e6,
                fmt(sum.prefill_tps, 2),
                fmt(sum.decode_tps, 2),
                fmt(sum.peak_rss_mib, 0),
            ));
        }
    }
    s.push_str("\nRatios mlxcel / mlx-lm (medians; >1 is mlxcel faster for tok/s, slower for load and larger for RSS):\n\n");
    s.push_str("| case | against | load | prefill | decode | peak RSS | notes |\n");
    s.push_str("|---|---|---:|---:|---:|---:|---|\n");
    for r in results {
        let Some(ours) = summary_of(r, Engine::Mlxcel) else {
            continue;
        };
        let mut notes = r.case.note.to_string();
        if let Some(m) = &r.mismatch {
            notes = if notes.is_empty() {
                m.clone()
            } else {
                format!("{notes}; {m}")
            };
        }
        for e in [Engine::MlxLmF32, Engine::MlxLm] {
            let Some(theirs) = summary_of(r, e) else {
                s.push_str(&format!(
                    "| {} | {} | skipped | | | | {notes} |\n",
                    r.case.name,
                    e.label()
                ));
                continue;
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {notes} |\n",
                r.case.name,
                e.label(),
                fmt_ratio(ratio(ours.load_s, theirs.load_s)),
                fmt_ratio(ratio(ours.prefill_tps, theirs.prefill_tps)),
                fmt_ratio(ratio(ours.decode_tps, theirs.decode_tps)),
                fmt_ratio(ratio(ours.peak_rss_mib, theirs.peak_rss_mib)),
            ));
        }
    }
    s
}

fn to_json(results: &[CaseResult], hw: &Value, command: &str, elapsed: f64) -> Value {
    let cases: Vec<Value> = results
        .iter()
        .map(|r| {
            let engines: serde_json::Map<String, Value> = r
                .per_engine
                .iter()
                .map(|(e, sum, samples)| {
                    let raw: Vec<Value> = samples
                        .iter()
                        .map(|s| {
                            json!({"load_s": s.load_s, "prefill_tps": s.prefill_tps,
                                   "decode_tps": s.decode_tps, "peak_rss_bytes": s.peak_rss_bytes,
                                   "dtype": s.dtype, "device": s.device})
                        })
                        .collect();
                    (e.key().to_string(), json!({"median": sum, "samples": raw}))
                })
                .collect();
            json!({
                "name": r.case.name,
                "model": r.case.model.dir_name(),
                "prompt_tokens": r.case.prompt,
                "new_tokens": r.case.new,
                "weight_bytes": r.bytes,
                "load_floor_s": r.floor_s,
                "engines": engines,
                "note": r.case.note,
                "greedy_mismatch": r.mismatch,
            })
        })
        .collect();
    json!({"command": command, "elapsed_s": elapsed, "hardware": hw, "cases": cases})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_ids_are_seeded_and_in_range() {
        let a = prompt_ids(64, 49152, 7);
        assert_eq!(a, prompt_ids(64, 49152, 7));
        assert!(a.iter().all(|t| (1000..32000).contains(t)));
        assert!(prompt_ids(16, 5000, 7)
            .iter()
            .all(|t| (1000..5000).contains(t)));
    }
}
