//! `cargo xtask bench --lora`: the decode cost of a runtime (unfused) LoRA adapter on the CPU,
//! as a ratio measured in one run. SmolLM2-135M-Instruct 4-bit (`cargo xtask fetch-models`)
//! with and without a deterministic random rank-16 mlx-lm adapter on every attention and MLP
//! projection (q/k/v/o, gate/up/down of all layers; over the quantized base `--adapter` stays
//! unfused, so every projection adds its low-rank term at runtime). Fresh process per run, base
//! and adapter runs alternating, greedy, seeded prompt ids. The target (issue 19) is ≤ 15% slower
//! decode; the report gives the ratio of medians and the median of adjacent-pair ratios (the
//! steadier figure on a shared machine: a pair shares the machine's momentary load).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use mlxcel_core::Array;
use serde_json::Value;

use super::stats::{self, median, Sample};
use super::{proc, prompt_ids, vocab_of};

/// Rank of the benchmark adapter.
pub const RANK: usize = 16;
/// Its LoRA scale.
const SCALE: f64 = 2.0;
/// The most decode speed the adapter may cost (issue 19).
const TARGET_COST: f64 = 0.15;

/// A deterministic stream of standard normals (splitmix64 + Box-Muller): the adapter's bytes
/// depend only on the seed and the model's shapes.
struct Normals(u64);

impl Normals {
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn take(&mut self, n: usize, std: f64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u, v) = (self.uniform(), self.uniform());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * std) as f32
            })
            .collect()
    }
}

/// Writes (once) an mlx-lm adapter for the Llama-type `model`: rank [`RANK`] on q/k/v/o and
/// gate/up/down of every layer, `lora_a` ~ N(0, 1/in), `lora_b` ~ N(0, 0.01) (small enough that
/// greedy decoding stays sensible, large enough to change it). Returns its folder.
pub fn ensure_adapter(bench: &Path, model: &Path) -> Result<PathBuf> {
    let name = model
        .file_name()
        .context("model folder has no name")?
        .to_string_lossy();
    let out = bench.join(format!("lora{RANK}-{name}"));
    if out.join("adapters.safetensors").is_file() && out.join("adapter_config.json").is_file() {
        return Ok(out);
    }
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(model.join("config.json"))?)?;
    let get = |k: &str| {
        cfg.get(k)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .with_context(|| format!("{}: config.json has no `{k}`", model.display()))
    };
    let (hidden, inter, heads, layers) = (
        get("hidden_size")?,
        get("intermediate_size")?,
        get("num_attention_heads")?,
        get("num_hidden_layers")?,
    );
    let kv = get("num_key_value_heads").unwrap_or(heads);
    let head_dim = get("head_dim").unwrap_or(hidden / heads);
    let modules = [
        ("self_attn.q_proj", hidden, heads * head_dim),
        ("self_attn.k_proj", hidden, kv * head_dim),
        ("self_attn.v_proj", hidden, kv * head_dim),
        ("self_attn.o_proj", heads * head_dim, hidden),
        ("mlp.gate_proj", hidden, inter),
        ("mlp.up_proj", hidden, inter),
        ("mlp.down_proj", inter, hidden),
    ];
    let mut normals = Normals(0);
    let mut tensors = Vec::new();
    for layer in 0..layers {
        for (module, n_in, n_out) in modules {
            let prefix = format!("model.layers.{layer}.{module}");
            let a = normals.take(n_in * RANK, (n_in as f64).powf(-0.5));
            let b = normals.take(RANK * n_out, 0.01);
            tensors.push((
                format!("{prefix}.lora_a"),
                Array::from_slice(&a, &[n_in as i32, RANK as i32])?,
            ));
            tensors.push((
                format!("{prefix}.lora_b"),
                Array::from_slice(&b, &[RANK as i32, n_out as i32])?,
            ));
        }
    }
    std::fs::create_dir_all(&out)?;
    mlxcel_core::weights::save_safetensors(out.join("adapters.safetensors"), &tensors, None)?;
    let keys: Vec<&str> = modules.iter().map(|m| m.0).collect();
    let config = serde_json::json!({
        "fine_tune_type": "lora",
        "num_layers": layers,
        "lora_parameters": {"rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": keys},
    });
    std::fs::write(
        out.join("adapter_config.json"),
        serde_json::to_string_pretty(&config)? + "\n",
    )?;
    Ok(out)
}

/// The measured runs of one side.
struct Side {
    samples: Vec<Sample>,
}

impl Side {
    fn decode(&self) -> Vec<f64> {
        self.samples.iter().map(|s| s.decode_tps).collect()
    }
    fn prefill(&self) -> Vec<f64> {
        self.samples.iter().map(|s| s.prefill_tps).collect()
    }
}

/// Runs the comparison (`runs` pairs, `prompt` prompt tokens, `new` decoded tokens) and
/// returns the markdown report.
pub fn run(
    logs: &Path,
    bench: &Path,
    bin: &Path,
    model: &Path,
    runs: usize,
    prompt: usize,
    new: usize,
) -> Result<String> {
    let adapter = ensure_adapter(bench, model)?;
    let ids = prompt_ids(prompt, vocab_of(model)?, 7);
    let ids = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let mut base = Side {
        samples: Vec::new(),
    };
    let mut lora = Side {
        samples: Vec::new(),
    };
    for run in 0..runs {
        for (side, with_adapter) in [(&mut base, false), (&mut lora, true)] {
            let tag = format!(
                "lora-{}-{run}",
                if with_adapter { "adapter" } else { "base" }
            );
            let mut cmd = Command::new(bin);
            cmd.arg("generate").arg("--model").arg(model);
            if with_adapter {
                cmd.arg("--adapter").arg(&adapter);
            }
            cmd.args([
                "--quiet",
                "--print-ids",
                "--ignore-eos",
                "--stats-json",
                "--force",
            ])
            .arg("--prompt-ids")
            .arg(&ids)
            .arg("--max-new")
            .arg(new.to_string());
            let done = proc::run(cmd, logs, &tag)?;
            let s = stats::parse_stats(&done.stderr)
                .with_context(|| format!("{tag}: no stats line on stderr"))?;
            if s.generated_tokens as usize != new {
                bail!(
                    "{tag}: generated {} tokens, expected {new}",
                    s.generated_tokens
                );
            }
            eprintln!(
                "  {tag}: prefill {:.2} tok/s decode {:.2} tok/s",
                s.prefill_tps, s.decode_tps
            );
            side.samples.push(s);
        }
    }
    let (bd, ld) = (base.decode(), lora.decode());
    let (mb, ml) = (
        median(&bd).unwrap_or(f64::NAN),
        median(&ld).unwrap_or(f64::NAN),
    );
    let pairs: Vec<f64> = bd.iter().zip(&ld).map(|(b, l)| l / b).collect();
    let mp = median(&pairs).unwrap_or(f64::NAN);
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let cost = |r: f64| (1.0 - r) * 100.0;
    let verdict = if 1.0 - mp <= TARGET_COST && 1.0 - ml / mb <= TARGET_COST {
        "within"
    } else {
        "NOT within"
    };
    let mut md = String::new();
    md.push_str(&format!(
        "Runtime LoRA decode cost: {} with a rank-{RANK} adapter (scale {SCALE}) on q/k/v/o/gate/up/down of every layer, unfused over the quantized base; {runs} alternating pairs of fresh processes, {prompt}-token prompt, {new} new tokens, greedy.\n\n",
        model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    ));
    md.push_str(
        "| side | decode tok/s (runs) | median decode | median prefill |\n|---|---|---:|---:|\n",
    );
    for (name, side) in [("base", &base), ("rank-16 runtime adapter", &lora)] {
        md.push_str(&format!(
            "| {name} | {} | {:.2} | {:.1} |\n",
            list(&side.decode()),
            median(&side.decode()).unwrap_or(f64::NAN),
            median(&side.prefill()).unwrap_or(f64::NAN),
        ));
    }
    md.push_str(&format!(
        "\nadapter / base decode: ratio of medians **{:.3}** ({:+.1}% cost), median of adjacent-pair ratios **{mp:.3}** ({:+.1}% cost; pairs: {}). Target: at most {:.0}% cost: {verdict}.\n",
        ml / mb,
        cost(ml / mb),
        cost(mp),
        list(&pairs),
        TARGET_COST * 100.0,
    ));
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normals_are_seeded_and_standard() {
        let a = Normals(0).take(20000, 1.0);
        assert_eq!(a, Normals(0).take(20000, 1.0));
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / a.len() as f64;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
    }
}
