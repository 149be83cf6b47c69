//! `cargo xtask`: project tasks (repacking checkpoints, fetching models, benchmarks).

use clap::{Parser, Subcommand};

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
    }
    Ok(())
}
