//! `mlxcel convert`: a GGUF, or a float HuggingFace checkpoint quantized by a recipe, into an
//! MLX checkpoint folder; and the one-time conversion behind `--model FILE.gguf`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

/// Flags of `mlxcel convert`.
#[derive(Args, Debug)]
pub struct ConvertFlags {
    /// A llama.cpp GGUF file to import (llama/mistral/mixtral, qwen2, qwen3, qwen2moe, qwen3moe, gemma,
    /// gemma2, gemma3, phi3, deepseek2; F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K losslessly,
    /// Q2_K/Q3_K/Q6_K re-quantized to 8-bit with the error printed).
    #[arg(long, conflicts_with = "hf")]
    pub gguf: Option<PathBuf>,
    /// A float (f32/bf16/f16) HuggingFace checkpoint folder to quantize (needs -q).
    #[arg(long)]
    pub hf: Option<PathBuf>,
    /// Output folder (must not exist or be empty).
    #[arg(long)]
    pub out: PathBuf,
    /// Quantize (--hf): affine with --bits/--group-size, or by --recipe.
    #[arg(short = 'q', long)]
    pub quantize: bool,
    /// Bits per weight for affine quantization (2, 3, 4, 5, 6, 8).
    #[arg(long, conflicts_with = "recipe")]
    pub bits: Option<u32>,
    /// Group size for affine quantization (32, 64, 128).
    #[arg(long, conflicts_with = "recipe")]
    pub group_size: Option<u32>,
    /// A built-in recipe (affine4-g64, mxfp4, mixed_3_6, ...) or a YAML recipe file.
    #[arg(long)]
    pub recipe: Option<String>,
    /// With --hf (any checkpoint, quantized or not): write an early-exit draft model for
    /// `--draft-model` instead: the first N layers with the model's own embedding, final norm
    /// and head (same tokenizer by construction).
    #[arg(long, value_name = "N", conflicts_with_all = ["gguf", "quantize", "recipe", "bits", "group_size"])]
    pub early_exit: Option<usize>,
    /// No progress bar or report.
    #[arg(long)]
    pub quiet: bool,
}

/// A progress bar over `total` steps when stderr is a terminal and not `quiet`; hidden otherwise.
fn progress_bar(quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(0);
    if let Ok(style) = ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}") {
        b.set_style(style);
    }
    b
}

fn check_out(out: &Path) -> anyhow::Result<()> {
    if out.exists() {
        let empty = std::fs::read_dir(out)
            .with_context(|| format!("reading {}", out.display()))?
            .next()
            .is_none();
        if !empty {
            bail!(
                "{}: the output folder exists and is not empty",
                out.display()
            );
        }
    }
    Ok(())
}

/// Runs `mlxcel convert`.
pub fn run(flags: ConvertFlags) -> anyhow::Result<()> {
    match (&flags.gguf, &flags.hf) {
        (Some(gguf), None) => {
            if flags.quantize || flags.recipe.is_some() || flags.bits.is_some() {
                bail!(
                    "--gguf imports the file's own quantization: -q/--bits/--recipe apply to --hf"
                );
            }
            check_out(&flags.out)?;
            let bar = progress_bar(flags.quiet);
            let report =
                mlxcel_quant::gguf::import_gguf(gguf, &flags.out, &mut |done, total, name| {
                    bar.set_length(total as u64);
                    bar.set_position(done as u64);
                    bar.set_message(name.to_string());
                })?;
            bar.finish_and_clear();
            // Said even with --quiet: the checkpoint is not an exact copy of the GGUF.
            for note in report.requantization_notes() {
                eprintln!("{note}");
            }
            if !flags.quiet {
                let affine = report.tensors.iter().filter(|t| t.affine.is_some()).count();
                eprintln!(
                    "imported {} tensors ({affine} as MLX affine) from {} into {}",
                    report.tensors.len(),
                    gguf.display(),
                    flags.out.display()
                );
            }
            Ok(())
        }
        (None, Some(hf)) if flags.early_exit.is_some() => {
            let layers = flags.early_exit.unwrap_or(0);
            check_out(&flags.out)?;
            mlxcel_loading::speculative::write_early_exit_draft(hf, &flags.out, layers)?;
            if !flags.quiet {
                eprintln!(
                    "wrote the first {layers} layers of {} as a draft model into {}",
                    hf.display(),
                    flags.out.display()
                );
            }
            Ok(())
        }
        (None, Some(hf)) => {
            if !flags.quantize {
                bail!(
                    "--hf needs -q (with --bits/--group-size or --recipe): nothing else to convert"
                );
            }
            let recipe = match (&flags.recipe, flags.bits, flags.group_size) {
                (Some(r), _, _) => r.clone(),
                (None, bits, group) => {
                    format!("affine{}-g{}", bits.unwrap_or(4), group.unwrap_or(64))
                }
            };
            check_out(&flags.out)?;
            let report = mlxcel_loading::repack::repack(&mlxcel_loading::repack::RepackOptions {
                quiet: flags.quiet || !std::io::stderr().is_terminal(),
                ..mlxcel_loading::repack::RepackOptions::new(hf, &flags.out, &recipe)
            })?;
            if !flags.quiet {
                report.print();
            }
            Ok(())
        }
        _ => bail!("give exactly one of --gguf FILE or --hf DIR"),
    }
}

/// `model` itself, or for a `.gguf` file its conversion in `<cache>/gguf/<sha256 prefix>/`
/// (converted on first use, said on stderr).
pub fn resolve_gguf(model: &Path, quiet: bool) -> anyhow::Result<PathBuf> {
    let is_gguf = model.is_file()
        && model
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if !is_gguf {
        return Ok(model.to_path_buf());
    }
    let cache = mlxcel_core::cache_dir()
        .context("no cache folder to convert the GGUF into: set MLXCEL_CACHE_DIR or HOME")?;
    let bar = progress_bar(quiet);
    let key_note = model.display().to_string();
    let result = mlxcel_quant::gguf::convert_gguf_cached(model, &cache, &mut |done, total, _| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    for note in result.report.iter().flat_map(|r| r.requantization_notes()) {
        eprintln!("{note}");
    }
    if result.converted {
        eprintln!(
            "[converted {key_note} once into {} (reused next time)]",
            result.folder.display()
        );
    } else if !quiet {
        eprintln!(
            "[using the conversion of {key_note} in {}]",
            result.folder.display()
        );
    }
    Ok(result.folder)
}
