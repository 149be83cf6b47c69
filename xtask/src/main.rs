//! `cargo xtask`: project tasks (repacking checkpoints, fetching models, benchmarks).

use clap::{Parser, Subcommand};

mod bench;
mod fetch;

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
        Command::FetchModels { quiet } => {
            for dir in fetch::fetch_models(quiet)? {
                println!("{}", dir.display());
            }
        }
        Command::Bench(args) => bench::bench(args)?,
    }
    Ok(())
}
