//! `cargo xtask bench --expert-stream`: routed-expert streaming on the ~1 GB Qwen3-MoE shape —
//! resident against streamed with LRU and LFU slot arenas of a quarter and a half of the experts
//! — in one process per configuration's load, measuring hit rate, bytes read, read time and
//! tokens per second.

use std::path::Path;

use anyhow::Result;
use mlxcel_arch::generate::Session;
use mlxcel_loading::stream::prepare_expert_stream;
use mlxcel_loading::{generate_text, load_model, GenerateRequest, LoadOptions};
use mlxcel_stream::{manifest, CachePolicy, StreamConfig, StreamMode};

/// Runs the comparison on the MoE checkpoint in `model`; returns the Markdown table.
pub fn compare_policies(model: &Path, prompt: &[u32], new_tokens: usize) -> Result<String> {
    if manifest::open(model)?.is_none() {
        eprintln!("bench: preparing the expert stream of {}", model.display());
        prepare_expert_stream(model, |_, _| {})?;
    }
    let (_, m) = manifest::open(model)?.expect("prepared above");
    let experts = m.layers.first().map_or(0, |l| l.experts);
    let per_slot: u64 = m.layers.iter().map(|l| l.expert_stride).sum();
    let mut configs = vec![(
        "resident".to_string(),
        StreamConfig {
            mode: StreamMode::Off,
            ..Default::default()
        },
    )];
    for share in [4usize, 2] {
        for policy in [CachePolicy::Lru, CachePolicy::Lfu] {
            let slots = (experts / share).max(1);
            configs.push((
                format!("streamed {policy:?}, {slots}/{experts} slots"),
                StreamConfig {
                    mode: StreamMode::On,
                    arena_bytes: Some(per_slot * slots as u64),
                    policy,
                },
            ));
        }
    }
    let mut table = String::from(
        "| configuration | load s | prefill tok/s | decode tok/s | hit rate | MiB read | read s |\n|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for (label, stream) in configs {
        let loaded = load_model(
            model,
            &LoadOptions {
                skip_tokenizer: true,
                stream: Some(stream),
                ..Default::default()
            },
        )?;
        let mut session = Session::new(&loaded.model);
        let request = GenerateRequest {
            max_new_tokens: new_tokens,
            ..Default::default()
        };
        let (_, stats) = generate_text(&mut session, None, prompt, &request, |_| {}, |_| {})?;
        let (hit, mib, read_s) = match &loaded.expert_stream {
            Some((_, s)) => {
                let s = s.borrow();
                (
                    format!("{:.1}%", 100.0 * s.hit_rate()),
                    format!("{:.0}", s.bytes_read as f64 / (1 << 20) as f64),
                    format!("{:.2}", s.read_seconds),
                )
            }
            None => ("–".into(), "–".into(), "–".into()),
        };
        let row = format!(
            "| {label} | {:.2} | {:.2} | {:.2} | {hit} | {mib} | {read_s} |\n",
            loaded.load_seconds,
            stats.prefill_tokens_per_second(),
            stats.decode_tokens_per_second()
        );
        eprint!("{row}");
        table.push_str(&row);
    }
    Ok(table)
}
