//! `cargo xtask`: project tasks (repacking checkpoints, fetching models, benchmarks).

use clap::{Parser, Subcommand};

mod bench;
mod fetch;
mod repack;
mod staging;

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print where MLX was found and which version is loaded.
    MlxInfo,
    /// Download the real checkpoints the parity tests use (SmolLM2-135M-Instruct from its GGUF,
    /// imported losslessly to MLX 4-bit; all-MiniLM-L6-v2) into `~/.cache/mlxcel/models`.
    FetchModels {
        /// No progress or status lines.
        #[arg(long)]
        quiet: bool,
    },
    /// Quantize a float (f32/bf16/f16) HuggingFace checkpoint by a recipe into an MLX checkpoint.
    Repack {
        /// Source checkpoint folder.
        #[arg(long)]
        model: std::path::PathBuf,
        /// Output folder (must not exist or be empty).
        #[arg(long)]
        out: std::path::PathBuf,
        /// A built-in recipe (affine4-g64, mxfp4, mixed_3_6, moe-role, ...) or a YAML file.
        #[arg(long)]
        recipe: String,
        /// Importance vectors from `cargo xtask importance`.
        #[arg(long)]
        importance: Option<std::path::PathBuf>,
        /// Maximum shard size in GiB.
        #[arg(long, default_value_t = 2.0)]
        shard_gb: f64,
        /// No progress bar or report.
        #[arg(long)]
        quiet: bool,
    },
    /// Measure per-input-channel mean squared activations of every linear over calibration
    /// prompts (for `repack --importance`).
    Importance {
        /// Source (float) checkpoint folder.
        #[arg(long)]
        model: std::path::PathBuf,
        /// Output safetensors file.
        #[arg(long)]
        out: std::path::PathBuf,
        /// Prompts, one per line (default: built-in six-language prompts).
        #[arg(long)]
        prompts: Option<std::path::PathBuf>,
    },
    /// Print a synthetic benchmark model's plan (config and tensor shapes, JSON) for building
    /// it where there is no Rust toolchain (`xtask/bench/make_plan_model.py` on the GPU machine).
    SynthPlan {
        /// mamba2 | jamba | qwen3_next | llama-1b | qwen3-moe
        model: String,
        /// Affine bits (group 64); omit for bfloat16.
        #[arg(long)]
        bits: Option<i32>,
    },
    /// Benchmark mlxcel against mlx-lm (load, prefill, decode, peak RSS); writes
    /// target/bench/results.{md,json}.
    Bench(bench::BenchArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::MlxInfo => {
            println!(
                "MLX {} from {}",
                mlxcel_core::mlx_version()?,
                mlxcel_core::MLX_LIB_DIR
            );
        }
        Command::SynthPlan { model, bits } => {
            let quant = bits.map(|b| mlxcel_core::ops::QuantSpec::affine(64, b));
            let synthetic = match model.as_str() {
                "mamba2" => bench::synth::mamba2(quant),
                "jamba" => bench::synth::jamba(quant),
                "qwen3_next" => bench::synth::qwen3_next(quant),
                "llama-1b" => bench::synth::llama_1b(quant),
                "qwen3-moe" => bench::synth::qwen3_moe(quant, bench::synth::Routing::Random),
                other => anyhow::bail!("no synthetic model {other:?}"),
            };
            println!("{}", serde_json::to_string(&synthetic.plan())?);
        }
        Command::FetchModels { quiet } => {
            for dir in fetch::fetch_models(quiet)? {
                println!("{}", dir.display());
            }
        }
        Command::Repack {
            model,
            out,
            recipe,
            importance,
            shard_gb,
            quiet,
        } => {
            let report = repack::repack(&repack::RepackOptions {
                model,
                out,
                recipe,
                importance,
                shard_bytes: (shard_gb * (1u64 << 30) as f64) as u64,
                quiet,
            })?;
            if !quiet {
                report.print();
            }
        }
        Command::Importance {
            model,
            out,
            prompts,
        } => {
            let prompts = repack::read_prompts(prompts.as_deref())?;
            let imp = repack::calibrate(&model, &prompts)?;
            repack::write_importance(&out, &imp)?;
            eprintln!(
                "{} importance vectors written to {}",
                imp.len(),
                out.display()
            );
        }
        Command::Bench(args) => bench::bench(args)?,
    }
    Ok(())
}
