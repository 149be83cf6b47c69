//! `cargo xtask bench --external-ple`: the Gemma-3n-E2B-shaped model (4-bit g32) with its
//! per-layer-embedding table resident against the same checkpoint with the table on disk
//! (`prepare-external-ple`: the manifest indexes the checkpoint's own bytes, so both runs
//! compute the same logits), in each `MLXCEL_PLE_IO` mode with the default 0.5 GiB row cache.
//! One fresh `mlxcel generate` process per run (peak RSS is the process's own), configurations
//! alternating.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use mlxcel_stream::ple::PrepareQuant;

use super::proc;
use super::stats::{median, parse_stats, Sample};

/// The external view of `model` beside it: the checkpoint hard-linked (no copy), `config.json`
/// copied, then `prepare-external-ple` (in place, rows as stored).
fn external_view(model: &Path) -> Result<PathBuf> {
    let name = model
        .file_name()
        .context("model folder has no name")?
        .to_string_lossy();
    let view = model.with_file_name(format!("{name}-external-ple"));
    if view.join("ple-store.json").is_file() {
        return Ok(view);
    }
    if view.exists() {
        std::fs::remove_dir_all(&view).with_context(|| format!("{}", view.display()))?;
    }
    std::fs::create_dir_all(&view)?;
    std::fs::hard_link(
        model.join("model.safetensors"),
        view.join("model.safetensors"),
    )
    .with_context(|| format!("hard-linking the checkpoint into {}", view.display()))?;
    std::fs::copy(model.join("config.json"), view.join("config.json"))?;
    eprintln!("bench: prepare-external-ple {}", view.display());
    mlxcel_loading::ple::prepare_external_ple(&view, PrepareQuant::AsStored, |_, _| {})?;
    Ok(view)
}

struct Config {
    label: &'static str,
    external: bool,
    io: Option<&'static str>,
}

/// Runs `runs` rounds of the configurations; returns the Markdown table.
pub fn run(
    bin: &Path,
    logs: &Path,
    model: &Path,
    prompt: &[u32],
    new_tokens: usize,
    runs: usize,
) -> Result<String> {
    let view = external_view(model)?;
    let config = mlxcel_loading::read_config(&view)?;
    let (_, table_bytes) =
        mlxcel_loading::ple::footprint(&view, &config, &mlxcel_core::RuntimePolicy::default())?
            .context("the view has no external table")?;
    let configs = [
        Config {
            label: "resident",
            external: false,
            io: None,
        },
        Config {
            label: "on disk, mmap, 0.5 GiB cache",
            external: true,
            io: Some("mmap"),
        },
        Config {
            label: "on disk, direct, 0.5 GiB cache",
            external: true,
            io: Some("direct"),
        },
        Config {
            label: "on disk, ram",
            external: true,
            io: Some("ram"),
        },
    ];
    let ids = prompt
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut samples: Vec<Vec<Sample>> = configs.iter().map(|_| Vec::new()).collect();
    let mut outputs: Vec<String> = vec![String::new(); configs.len()];
    for round in 0..runs {
        for (i, c) in configs.iter().enumerate() {
            let mut cmd = Command::new(bin);
            cmd.arg("generate")
                .arg("--model")
                .arg(if c.external { &view } else { model })
                .args([
                    "--quiet",
                    "--print-ids",
                    "--ignore-eos",
                    "--stats-json",
                    "--force",
                    "--prompt-ids",
                    &ids,
                    "--max-new",
                    &new_tokens.to_string(),
                ]);
            cmd.env_remove("MLXCEL_PLE_CACHE_BYTES");
            match c.io {
                Some(io) => cmd.env("MLXCEL_PLE_IO", io),
                None => cmd.env_remove("MLXCEL_PLE_IO"),
            };
            let tag = format!("external-ple-{i}-{round}");
            let done = proc::run(cmd, logs, &tag)?;
            let mut s = parse_stats(&done.stderr)
                .with_context(|| format!("{tag}: no stats line on stderr"))?;
            if s.peak_rss_bytes == 0 {
                s.peak_rss_bytes = done.max_rss_bytes;
            }
            eprintln!(
                "  {}: load {:.2}s prefill {:.2} tok/s decode {:.2} tok/s rss {:.0} MiB",
                c.label,
                s.load_s,
                s.prefill_tps,
                s.decode_tps,
                s.peak_rss_bytes as f64 / (1u64 << 20) as f64
            );
            outputs[i] = done.stdout.trim().to_string();
            samples[i].push(s);
        }
    }
    if outputs.iter().any(|o| *o != outputs[0]) {
        bail!("greedy ids differ between the resident and the external table: {outputs:?}");
    }
    let med =
        |i: usize, f: fn(&Sample) -> f64| median(&samples[i].iter().map(f).collect::<Vec<_>>());
    let rss = |i: usize| med(i, |s| s.peak_rss_bytes as f64).unwrap_or(0.0);
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let resident_decode = med(0, |s| s.decode_tps);
    let mut table = format!(
        "Per-layer-embedding table: {:.0} MiB on disk (affine 4-bit g32). Prompt {} tokens, {} new, {runs} runs per configuration (medians); greedy ids identical in every configuration.\n\n| configuration | load s | prefill tok/s | decode tok/s | decode vs resident | peak RSS MiB | RSS below resident MiB |\n|---|---:|---:|---:|---:|---:|---:|\n",
        mib(table_bytes as f64),
        prompt.len(),
        new_tokens
    );
    for (i, c) in configs.iter().enumerate() {
        let decode = med(i, |s| s.decode_tps);
        let ratio = match (decode, resident_decode) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.1}%", 100.0 * a / b),
            _ => "–".into(),
        };
        table.push_str(&format!(
            "| {} | {:.2} | {:.2} | {:.2} | {ratio} | {:.0} | {} |\n",
            c.label,
            med(i, |s| s.load_s).unwrap_or(0.0),
            med(i, |s| s.prefill_tps).unwrap_or(0.0),
            decode.unwrap_or(0.0),
            mib(rss(i)),
            mib(rss(0) - rss(i)).round() as i64,
        ));
    }
    Ok(table)
}
