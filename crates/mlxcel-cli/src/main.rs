//! `mlxcel`: the command-line interface. Argument parsing and printing only; everything else goes
//! through the library crates' public API. Vision-language models take images with
//! `generate --image FILE` (repeatable), `logits --image FILE` (the prompt ids hold the image
//! placeholder once per image) and a `/image PATH` line in `chat`.

mod convert;
mod embed;
mod generate;
mod inspect;
mod launch;
mod npy;
mod rerank;

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use mlxcel_loading::{load_model, LanguageModel, LoadOptions};

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
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// One forward pass over token ids; writes float32 logits `[seq, vocab]` as NumPy .npy.
    Logits {
        #[arg(long)]
        model: PathBuf,
        /// Comma-separated token ids. With --image, the model's image placeholder (Gemma 3:
        /// `<start_of_image>`) once per image, expanded as the model's processor expands it.
        #[arg(long, value_delimiter = ',', required = true)]
        prompt_ids: Vec<u32>,
        /// An image for the prompt's next placeholder (PNG, JPEG or WebP; repeatable, in order).
        #[arg(long, value_name = "FILE")]
        image: Vec<PathBuf>,
        #[arg(long)]
        out: PathBuf,
        /// Weight-surgery YAML applied at load (default: `MLXCEL_SURGERY`).
        #[arg(long, value_name = "FILE")]
        surgery: Option<PathBuf>,
        /// LoRA adapter folder: fused into dense base weights at load; over a quantized base
        /// kept unfused (runtime) unless --lora-fuse.
        #[arg(long, value_name = "DIR")]
        adapter: Option<PathBuf>,
        /// Fuse --adapter into a quantized base too (dequantize, add, requantize).
        #[arg(long, requires = "adapter")]
        lora_fuse: bool,
    },
    /// Describe a checkpoint: type, routes, parameters, dtype and quantization mix by role, bytes.
    Inspect {
        model: PathBuf,
        /// Also print the memory a run would need (weights by role, KV cache, transient).
        #[arg(long)]
        estimate_memory: bool,
        /// Context length for --estimate-memory's KV cache.
        #[arg(long, default_value_t = 4096)]
        max_context: u64,
        /// Also load with this weight-surgery YAML and report each rule's edit.
        #[arg(long, value_name = "FILE")]
        surgery: Option<PathBuf>,
        /// Also load with this LoRA adapter and report how it was applied.
        #[arg(long, value_name = "DIR")]
        adapter: Option<PathBuf>,
        /// With --adapter: fuse into a quantized base (dequantize, add, requantize).
        #[arg(long, requires = "adapter")]
        lora_fuse: bool,
    },
    /// Print the model registry.
    Arch,
    /// Convert a GGUF (--gguf FILE), or quantize a float HuggingFace checkpoint (--hf DIR -q),
    /// into an MLX checkpoint folder.
    Convert(convert::ConvertFlags),
    /// Generate text from a prompt; text to stdout, statistics to stderr.
    Generate(generate::GenerateFlags),
    /// Embed texts with an embedding model (one vector per text, in input order).
    Embed(embed::EmbedFlags),
    /// Score documents against a query with a cross-encoder (JSON lines, in input order).
    Rerank(rerank::RerankFlags),
    /// Interactive chat keeping the session (and its caches) between turns.
    Chat(generate::RunFlags),
    /// Serve the model over an OpenAI-compatible HTTP API, with a web chat page at `/`.
    Serve {
        /// Model folder (default: the SmolLM2 that `cargo xtask fetch-models` installs).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Address to listen on (loopback by default; 0.0.0.0 exposes it to the network).
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Require `Authorization: Bearer KEY` on every endpoint but /health and the page.
        #[arg(long)]
        api_key: Option<String>,
        /// Requests that may wait while `--parallel` are generated (one more gets a 429).
        #[arg(long, default_value_t = 16)]
        max_queue: usize,
        /// Generations run at once, batched: each decode step advances all of them in one
        /// forward pass.
        #[arg(long, default_value_t = 8)]
        parallel: usize,
        /// Conversations whose caches are kept for prefix reuse.
        #[arg(long, default_value_t = 4)]
        sessions: usize,
        /// LoRA adapters, repeatable. `NAME=DIR`: a runtime adapter, kept unfused and selected
        /// per request (`"model": "NAME"` or the `adapter` field; see the README). `DIR`: one
        /// adapter applied to every request (fused into a dense base; over a quantized base
        /// kept unfused unless --lora-fuse).
        #[arg(long, value_name = "[NAME=]DIR")]
        adapter: Vec<String>,
        /// Fuse the unnamed --adapter into a quantized base too (dequantize, add, requantize).
        #[arg(long)]
        lora_fuse: bool,
        /// Weight-surgery YAML applied at load (default: `MLXCEL_SURGERY`).
        #[arg(long, value_name = "FILE")]
        surgery: Option<PathBuf>,
        /// Embedding model folder (BERT, XLM-RoBERTa, ModernBERT) served at /v1/embeddings.
        #[arg(long, value_name = "DIR")]
        embedding_model: Option<PathBuf>,
        /// Reranker folder (a cross-encoder) served at /v1/rerank.
        #[arg(long, value_name = "DIR")]
        reranker_model: Option<PathBuf>,
        /// The --reranker-model is a generative reranker (Qwen3-Reranker, yes/no scoring).
        #[arg(long, requires = "reranker_model")]
        generative_reranker: bool,
    },
    /// Run a command (`generate`, `chat`, `logits`) as N processes sharing one model: tensor
    /// or pipeline parallelism over MLX's distributed layer (`-- COMMAND ...` follows).
    Launch(launch::LaunchFlags),
    /// Write (or with --verify, check) the expert-stream layout of an MoE model, so its routed
    /// experts can stream from disk.
    PrepareExpertStream {
        #[arg(long)]
        model: PathBuf,
        /// Check the layout's sizes and hashes without loading the model.
        #[arg(long)]
        verify: bool,
    },
    /// Write (or with --verify, check) the external view of a model's per-layer-embedding
    /// table (Gemma 3n): `ple-store.json` (mlx-vlm's manifest v2, with SHA-256s), the row file
    /// when quantizing, and `ple_storage` in config.json, so the table stays on disk.
    PrepareExternalPle {
        #[arg(long)]
        model: PathBuf,
        /// `affine4`: rows quantized to MLX affine 4-bit, groups of 32, in `ple-q4.rows`
        /// (default: rows as the checkpoint stores them, read in place).
        #[arg(long)]
        quantize: Option<String>,
        /// Check the manifest, the row files' SHA-256s and every row against the checkpoint.
        #[arg(long)]
        verify: bool,
    },
}

/// Output piped into a program that stops reading (`mlxcel arch | head`) ends mlxcel quietly, as
/// it ends `cat`: Rust ignores SIGPIPE, which would turn the closed pipe into a panic in
/// `println!`.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: resetting a signal's disposition to its default at startup, before any threads.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> std::process::ExitCode {
    restore_sigpipe();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", error_chain(&error));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line each, leaving out a cause whose text the message
/// before it already contains: library errors often display their source inline (a folder
/// followed by the tensor at fault) and also expose it as the source.
fn error_chain(error: &anyhow::Error) -> String {
    let mut shown = error.to_string();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !shown.contains(&text) {
            shown.push_str("\n  caused by: ");
            shown.push_str(&text);
        }
    }
    shown
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if cli.version {
        println!("mlxcel {}", env!("CARGO_PKG_VERSION"));
        println!("MLX {}", mlxcel_core::mlx_version()?);
        println!("default device: {}", mlxcel_core::default_device()?);
        return Ok(());
    }
    // The runtime variables (`MLXCEL_*`), parsed once and strictly: an invalid value is an
    // error naming the variable. Loads take the installed policy.
    mlxcel_core::policy::install(&mlxcel_core::RuntimePolicy::from_env()?)?;
    match cli.command {
        None => println!("mlxcel {}: run `mlxcel --help`", env!("CARGO_PKG_VERSION")),
        Some(Command::Logits {
            model,
            prompt_ids,
            image,
            out,
            surgery,
            adapter,
            lora_fuse,
        }) => logits(
            &model,
            &prompt_ids,
            &image,
            &out,
            surgery,
            adapter,
            lora_fuse,
        )?,
        Some(Command::Inspect {
            model,
            estimate_memory,
            max_context,
            surgery,
            adapter,
            lora_fuse,
        }) => {
            inspect::run(&model)?;
            if surgery.is_some() || adapter.is_some() {
                inspect::edits(&model, surgery, adapter, lora_fuse)?;
            }
            if estimate_memory {
                if max_context == 0 {
                    bail!("--max-context 0: must be at least 1 token");
                }
                generate::estimate_for(&model, max_context)?;
            }
        }
        Some(Command::Arch) => inspect::print_registry(),
        Some(Command::Convert(flags)) => convert::run(flags)?,
        Some(Command::Generate(flags)) => generate::generate(flags)?,
        Some(Command::Chat(flags)) => generate::chat(flags)?,
        Some(Command::Serve {
            model,
            host,
            port,
            api_key,
            max_queue,
            parallel,
            sessions,
            adapter,
            lora_fuse,
            surgery,
            embedding_model,
            reranker_model,
            generative_reranker,
        }) => {
            let model = match model {
                // A .gguf is converted once into the cache, as for generate/chat.
                Some(m) => convert::resolve_gguf(&m, false)?,
                None => generate::default_model()?,
            };
            let mut builder =
                mlxcel_models::Model::load(&model).policy(mlxcel_core::policy::current());
            let mut fused = None;
            for spec in adapter {
                match spec.split_once('=') {
                    Some((name, dir)) if !name.is_empty() && !name.contains('/') => {
                        builder = builder.runtime_adapter(name, dir);
                    }
                    _ if fused.is_some() => {
                        bail!("--adapter {spec}: only one unnamed adapter (DIR); name the others (NAME=DIR)")
                    }
                    _ => fused = Some(spec),
                }
            }
            if let Some(dir) = fused {
                builder = builder.adapter(dir);
            } else if lora_fuse {
                bail!("--lora-fuse applies to an unnamed --adapter DIR");
            }
            if lora_fuse {
                builder = builder.lora_fuse();
            }
            if let Some(s) = surgery {
                builder = builder.surgery(s);
            }
            let loaded = builder.build()?;
            for edit in &loaded.info().weight_edits {
                eprintln!("[serve] {edit}");
            }
            let embedder = match embedding_model {
                Some(dir) => {
                    let e = mlxcel_models::Embedder::load(&dir)
                        .policy(mlxcel_core::policy::current())
                        .build()
                        .with_context(|| {
                            format!("loading the embedding model {}", dir.display())
                        })?;
                    eprintln!(
                        "[serve] embeddings: {} ({}, {} dimensions) loaded in {:.2}s",
                        e.info().folder.display(),
                        e.info().model_type.name(),
                        e.info().dimensions,
                        e.info().load_seconds
                    );
                    Some(e)
                }
                None => None,
            };
            let reranker = match reranker_model {
                Some(dir) => Some(load_reranker(&dir, generative_reranker)?),
                None => None,
            };
            let config = mlxcel_server::ServerConfig {
                embedder,
                reranker,
                api_key,
                max_queue,
                parallel: parallel.max(1),
                sessions: sessions.max(1),
                ..Default::default()
            };
            let info = loaded.info();
            eprintln!(
                "[serve] {} ({}) loaded in {:.2}s; listening on http://{host}:{port}/ (chat page at /, API at /v1)",
                info.folder.display(),
                info.model_type.name(),
                info.load_seconds
            );
            mlxcel_server::run(loaded, config, (host.as_str(), port))
                .with_context(|| format!("serving on {host}:{port}"))?;
        }
        Some(Command::Embed(flags)) => embed::run(flags)?,
        Some(Command::Launch(flags)) => launch::run(flags)?,
        Some(Command::Rerank(flags)) => rerank::run(flags)?,
        Some(Command::PrepareExpertStream { model, verify }) => {
            prepare_expert_stream(&model, verify)?
        }
        Some(Command::PrepareExternalPle {
            model,
            quantize,
            verify,
        }) => prepare_external_ple(&model, quantize.as_deref(), verify)?,
    }
    Ok(())
}

fn load_reranker(
    dir: &std::path::Path,
    generative: bool,
) -> anyhow::Result<mlxcel_models::Reranker> {
    let mut builder = mlxcel_models::Reranker::load(dir).policy(mlxcel_core::policy::current());
    if generative {
        builder = builder.generative();
    }
    let r = builder
        .build()
        .with_context(|| format!("loading the reranker {}", dir.display()))?;
    eprintln!(
        "[serve] reranker: {} ({}, {:?}) loaded in {:.2}s",
        r.info().folder.display(),
        r.info().model_type.name(),
        r.info().activation,
        r.info().load_seconds
    );
    Ok(r)
}

fn prepare_external_ple(
    model: &std::path::Path,
    quantize: Option<&str>,
    verify: bool,
) -> anyhow::Result<()> {
    use mlxcel_stream::ple::PrepareQuant;
    let quant = match quantize {
        None => PrepareQuant::AsStored,
        Some("affine4") => PrepareQuant::Affine4,
        Some(other) => anyhow::bail!("--quantize {other}: expected affine4"),
    };
    if verify && quantize.is_some() {
        anyhow::bail!("--verify checks the view as written: drop --quantize");
    }
    let layout = if verify {
        mlxcel_loading::ple::verify_external_ple(model)?
    } else {
        let layout = mlxcel_loading::ple::prepare_external_ple(model, quant, |done, total| {
            eprint!("\r[prepare-external-ple] row {done}/{total}");
        })?;
        eprintln!();
        layout
    };
    println!(
        "{} {}: {} rows × {} ({}), {:.1} MiB in {}",
        if verify { "verified" } else { "prepared" },
        layout.manifest_path.display(),
        layout.row_count,
        layout.row_width,
        layout.format.describe(),
        layout.table_bytes() as f64 / (1 << 20) as f64,
        layout
            .files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

fn prepare_expert_stream(model: &std::path::Path, verify: bool) -> anyhow::Result<()> {
    let folder = mlxcel_loading::resolve_model_dir(model)?;
    let manifest = if verify {
        mlxcel_loading::stream::verify_expert_stream(&folder)?
    } else {
        mlxcel_loading::stream::prepare_expert_stream(&folder, |done, total| {
            eprint!("\r[prepare-expert-stream] layer {done}/{total}");
        })?
    };
    eprintln!();
    let bytes = manifest.total_expert_bytes();
    println!(
        "{} {} MoE layers, {} experts each, {:.1} MiB of experts in {}",
        if verify { "verified" } else { "prepared" },
        manifest.layers.len(),
        manifest.layers.first().map_or(0, |l| l.experts),
        bytes as f64 / (1 << 20) as f64,
        folder.join(mlxcel_stream::STREAM_DIR).display()
    );
    Ok(())
}

fn logits(
    model: &std::path::Path,
    ids: &[u32],
    images: &[PathBuf],
    out: &std::path::Path,
    surgery: Option<PathBuf>,
    adapter: Option<PathBuf>,
    lora_fuse: bool,
) -> anyhow::Result<()> {
    let options = LoadOptions {
        // The image placeholder's expansion is tokenised text.
        skip_tokenizer: images.is_empty(),
        policy: Some(mlxcel_core::policy::current()),
        surgery,
        adapter,
        lora_fuse,
        parallelism: launch::parallelism_from_env()?,
        ..Default::default()
    };
    let loaded = load_model(model, &options)?;
    let vocab = loaded.model.vocab_size();
    if let Some(bad) = ids.iter().find(|t| **t as usize >= vocab) {
        bail!("--prompt-ids: token {bad} is outside the vocabulary of {vocab}");
    }
    let prepared = generate::prepare_images(&loaded, images)?;
    let ids = loaded.expand_image_tokens_for(ids, &prepared)?;
    let ids = ids.as_slice();
    let inputs: Vec<_> = prepared.iter().flat_map(|i| i.inputs.clone()).collect();
    let logits = loaded
        .multimodal_logits(ids, &inputs)?
        .astype(mlxcel_core::Dtype::Float32)?;
    let values = logits.to_vec::<f32>()?;
    if let Some(i) = values.iter().position(|v| v.is_nan()) {
        bail!(
            "the model produced NaN logits at prompt position {} (token {}): the checkpoint's weights give non-finite activations",
            i / vocab.max(1),
            ids.get(i / vocab.max(1)).copied().unwrap_or(0)
        );
    }
    if !launch::writes_outputs() {
        return Ok(());
    }
    npy::write_f32(out, &[ids.len(), vocab], &values)
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "wrote {} x {} logits to {}",
        ids.len(),
        vocab,
        out.display()
    );
    // With streamed experts, say so: the logits are meant to equal resident ones bit for bit,
    // and a comparison is only worth something if the experts really came from the arena.
    if let Some((plan, stats)) = &loaded.expert_stream {
        eprintln!("{}\n{}", plan.describe(), stats.borrow().describe());
    }
    Ok(())
}
