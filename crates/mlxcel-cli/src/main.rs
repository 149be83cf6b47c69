//! `mlxcel`: the command-line interface. Argument parsing and printing only; everything else goes
//! through the library crates' public API.

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "mlxcel",
    about = "Load and run LLM checkpoints on MLX",
    disable_version_flag = true
)]
struct Cli {
    /// Print mlxcel's and MLX's versions and the default device.
    #[arg(long, short = 'V')]
    version: bool,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if cli.version {
        let device = mlxcel_core::default_device()?;
        println!("mlxcel {}", env!("CARGO_PKG_VERSION"));
        println!("MLX {}", mlxcel_core::mlx_version()?);
        println!("default device: {device}");
        return Ok(());
    }
    println!("mlxcel {}: run `mlxcel --help`", env!("CARGO_PKG_VERSION"));
    Ok(())
}
