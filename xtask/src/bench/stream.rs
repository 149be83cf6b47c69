//! `cargo xtask bench --expert-stream`: routed-expert streaming on the ~1 GB Qwen3-MoE shape,
//! with skewed and uniform routers (see [`super::synth::Routing`]): resident decode against
//! streamed decode at arenas of 10% and 25% of the routed experts, each read with every
//! `MLXCEL_EXPERT_IO` mode, in one process (one load per configuration), measuring decode speed,
//! hit rate, bytes read, read time and bandwidth, and the routing's reuse and skew; plus the
//! disk's sequential `O_DIRECT` read bandwidth, the floor the reads are compared with.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use mlxcel_arch::generate::Session;
use mlxcel_loading::stream::prepare_expert_stream;
use mlxcel_loading::{generate_text, load_model, GenerateRequest, LoadOptions};
use mlxcel_stream::io::{self as sio, AlignedBuf};
use mlxcel_stream::{manifest, CachePolicy, ExpertIo, StreamConfig, StreamMode};

/// The arenas measured, as a share of a layer's routed experts (never fewer slots than top-k).
const ARENA_SHARES: [usize; 2] = [10, 25];

/// Bytes per read of the floor measurement: large enough that per-call costs vanish.
const FLOOR_CHUNK: usize = 4 << 20;

/// Sequential `O_DIRECT` read bandwidth (GB/s) over `files`, read whole in [`FLOOR_CHUNK`]
/// pieces by `threads` threads (thread `t` takes every `threads`-th piece, so the disk sees
/// `threads` requests in flight over a sequential sweep, as the engine's reader threads do).
fn read_floor(files: &[PathBuf], threads: usize) -> Result<f64> {
    let mut pieces = Vec::new();
    let mut opened = Vec::new();
    for path in files {
        let len = std::fs::metadata(path)
            .with_context(|| format!("{}", path.display()))?
            .len();
        opened.push(sio::open_direct(path)?);
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(FLOOR_CHUNK as u64) as usize;
            pieces.push((opened.len() - 1, at, n));
            at += n as u64;
        }
    }
    let total: u64 = pieces.iter().map(|p| p.2 as u64).sum();
    let started = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|t| {
                let (pieces, opened) = (&pieces, &opened);
                scope.spawn(move || -> Result<()> {
                    let mut buf = AlignedBuf::zeroed(FLOOR_CHUNK);
                    for (file, at, n) in pieces.iter().skip(t).step_by(threads.max(1)) {
                        sio::read_direct_span(&opened[*file], &files[*file], *at, *n, &mut buf)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| anyhow::bail!("reader panicked"))
            })
            .collect()
    });
    for r in results {
        r?;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64() / 1e9)
}

/// One measured configuration.
struct Measured {
    decode: f64,
    prefill: f64,
    stats: Option<mlxcel_stream::StreamStats>,
}

fn measure(model: &Path, stream: StreamConfig, prompt: &[u32], new: usize) -> Result<Measured> {
    let loaded = load_model(
        model,
        &LoadOptions {
            skip_tokenizer: true,
            stream: Some(stream),
            ..Default::default()
        },
    )?;
    let mut session = Session::new(&loaded.model);
    // Sampled, not greedy: a random model's greedy continuation soon repeats one token, whose
    // identical hidden states would route identically and flatter every cache. With a fixed
    // seed every configuration generates the same tokens (streamed logits are the resident
    // ones, bit for bit).
    let request = GenerateRequest {
        max_new_tokens: new,
        sampling: mlxcel_arch::sampling::SamplingParams {
            temperature: 1.0,
            seed: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let (_, stats) = generate_text(&mut session, None, prompt, &request, |_| {}, |_| {})?;
    Ok(Measured {
        decode: stats.decode_tokens_per_second(),
        prefill: stats.prefill_tokens_per_second(),
        stats: loaded
            .expert_stream
            .as_ref()
            .map(|(_, s)| s.borrow().clone()),
    })
}

/// Runs the comparison on `models` (`(routing label, checkpoint)`); returns the report
/// (floor, then the Markdown table).
pub fn compare(models: &[(&str, PathBuf)], prompt: &[u32], new_tokens: usize) -> Result<String> {
    let threads = sio::read_threads();
    let mut report = String::new();
    let mut floor_n = 0.0;
    let mut table = String::from(
        "| routing | configuration | decode tok/s | % of resident | prefill tok/s | hit rate | MiB read | read s | read GB/s | % of floor | waited s | read ahead (used) | reuse | top-10% share |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (i, (routing, model)) in models.iter().enumerate() {
        if manifest::open(model)?.is_none() {
            eprintln!("bench: preparing the expert stream of {}", model.display());
            prepare_expert_stream(model, |_, _| {})?;
        }
        let (dir, m) = manifest::open(model)?.context("prepared above")?;
        if i == 0 {
            let files: Vec<PathBuf> = m.layers.iter().map(|l| dir.join(&l.file)).collect();
            let one = read_floor(&files, 1)?;
            floor_n = read_floor(&files, threads)?;
            let line = format!(
                "Disk floor (sequential O_DIRECT reads of the {} stream files, {:.0} MiB, {} MiB pieces): {one:.2} GB/s with 1 thread, {floor_n:.2} GB/s with {threads} threads (the engine's MLXCEL_EXPERT_READ_THREADS).\n\n",
                files.len(),
                m.total_expert_bytes() as f64 / (1 << 20) as f64,
                FLOOR_CHUNK >> 20,
            );
            eprint!("{line}");
            report.push_str(&line);
        }
        let experts = m.layers.first().map_or(0, |l| l.experts);
        let top_k = mlxcel_loading::read_config(model)?["num_experts_per_tok"]
            .as_u64()
            .unwrap_or(1) as usize;
        let per_slot: u64 = m.layers.iter().map(|l| l.expert_stride).sum();
        let off = StreamConfig {
            mode: StreamMode::Off,
            ..Default::default()
        };
        // Resident before and after the streamed runs: on a shared machine the mean of the two
        // is a fairer base than either.
        let before = measure(model, off.clone(), prompt, new_tokens)?;
        let mut rows = Vec::new();
        for share in ARENA_SHARES {
            let slots = (experts * share).div_ceil(100).max(top_k).min(experts);
            // Each IO mode reading ahead (the default), and direct reads without it.
            for (io, prefetch) in [
                (ExpertIo::Direct, true),
                (ExpertIo::Direct, false),
                (ExpertIo::Dontneed, true),
                (ExpertIo::Cached, true),
            ] {
                let stream = StreamConfig {
                    mode: StreamMode::On,
                    arena_bytes: Some(per_slot * slots as u64),
                    policy: CachePolicy::Lfu,
                    io,
                    prefetch,
                    in_place: true,
                };
                let r = measure(model, stream, prompt, new_tokens)?;
                eprintln!(
                    "  {routing} {share}% {}{}: decode {:.2} tok/s",
                    io.name(),
                    if prefetch { "" } else { ", no read-ahead" },
                    r.decode
                );
                rows.push((share, slots, prefetch, r));
            }
        }
        let after = measure(model, off, prompt, new_tokens)?;
        let base = (before.decode + after.decode) / 2.0;
        for (label, r) in [("resident (before)", &before), ("resident (after)", &after)] {
            let row = format!(
                "| {routing} | {label} | {:.2} | {:.0}% | {:.2} | – | – | – | – | – | – | – | – | – |\n",
                r.decode,
                100.0 * r.decode / base.max(1e-9),
                r.prefill
            );
            eprint!("{row}");
            table.push_str(&row);
        }
        for (share, slots, prefetch, r) in rows {
            let s = r.stats.as_ref().context("streaming was on")?;
            let row = format!(
                "| {routing} | {share}% arena ({slots}/{experts} slots), {}{} | {:.2} | {:.0}% | {:.2} | {:.1}% | {:.0} | {:.2} | {:.2} | {:.0}% | {:.2} | {} ({:.0}%) | {:.1}% | {:.1}% |\n",
                s.io.map_or("-", ExpertIo::name),
                if prefetch { "" } else { ", no read-ahead" },
                r.decode,
                100.0 * r.decode / base.max(1e-9),
                r.prefill,
                100.0 * s.hit_rate(),
                s.bytes_read as f64 / (1 << 20) as f64,
                s.read_seconds,
                s.read_gb_per_second(),
                100.0 * s.read_gb_per_second() / floor_n.max(1e-9),
                s.wait_seconds,
                s.prefetched,
                100.0 * s.prefetch_accuracy(),
                100.0 * s.reuse_rate(),
                100.0 * s.top_decile_share(),
            );
            eprint!("{row}");
            table.push_str(&row);
        }
    }
    report.push_str(&table);
    Ok(report)
}
