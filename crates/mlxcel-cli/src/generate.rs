//! `mlxcel generate` and `mlxcel chat`: flags in, text out (stdout), statistics to stderr.

use std::io::{BufRead, Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use mlxcel_arch::sampling::SamplingParams;
use mlxcel_loading::memory::estimate;
use mlxcel_loading::{
    generate_text, load_model, GenerateRequest, GenerationStats, LanguageModel, LoadOptions,
    Loaded, Message,
};

/// Flags shared by `generate` and `chat`.
#[derive(Args, Debug, Clone)]
pub struct RunFlags {
    /// Model folder (default: the SmolLM2 that `cargo xtask fetch-models` installs).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Weight-surgery YAML applied at load (default: `MLXCEL_SURGERY`); see the README.
    #[arg(long, value_name = "FILE")]
    pub surgery: Option<PathBuf>,
    /// LoRA adapter folder (mlx-lm or PEFT): fused into dense base weights at load; over a
    /// quantized base kept unfused (runtime) unless --lora-fuse.
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// Fuse --adapter into a quantized base too: dequantize, add, requantize at each layer's
    /// own bits and group size.
    #[arg(long, requires = "adapter")]
    pub lora_fuse: bool,
    /// System message (with --messages, --user or in chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 1024)]
    pub max_new: usize,
    /// Refuse prompts longer than this many tokens (and size --estimate-memory's KV cache).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop before this text (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Prefill the prompt in chunks of this many tokens.
    #[arg(long)]
    pub prefill_chunk: Option<usize>,
    /// No statistics on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Print the memory estimate and exit.
    #[arg(long)]
    pub estimate_memory: bool,
    /// Run even when the estimate exceeds the device's memory.
    #[arg(long)]
    pub force: bool,
    /// Speculative decoding: a smaller model sharing the tokenizer proposes tokens that the
    /// model checks in one pass (greedy output unchanged; text prompts only). Not yet faster
    /// than plain decoding: see docs/performance.md.
    #[arg(long, value_name = "DIR")]
    pub draft_model: Option<PathBuf>,
    /// Self-speculative decoding: `mtp` drafts with the multi-token-prediction layers the
    /// checkpoint ships (DeepSeek-V3, GLM-4.5), loaded only with this flag; the model checks
    /// the drafts in one pass (output unchanged; text prompts only).
    #[arg(
        long,
        value_enum,
        value_name = "METHOD",
        conflicts_with = "draft_model"
    )]
    pub speculative: Option<SpeculativeMethod>,
    /// Tokens proposed per round: by the draft model (default 4), or by the MTP layers in
    /// turn (default: one per MTP layer).
    #[arg(long)]
    pub draft_tokens: Option<usize>,
    /// Benchmarks only: random weights made on the device (from this seed) instead of the
    /// checkpoint's bytes, e.g. a header-only sparse checkpoint of a shape no disk holds.
    #[arg(long, hide = true, value_name = "SEED")]
    pub random_weights: Option<u64>,
}

#[derive(Args, Debug)]
pub struct GenerateFlags {
    #[command(flatten)]
    pub run: RunFlags,
    /// Raw completion of this text (no chat template).
    #[arg(long, conflicts_with_all = ["messages", "user", "prompt_ids"])]
    pub prompt: Option<String>,
    /// A JSON array of {role, content} messages (a file, or - for stdin); the chat template applies.
    #[arg(long, conflicts_with_all = ["user", "prompt_ids"])]
    pub messages: Option<String>,
    /// One user message (the chat template applies).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub user: Option<String>,
    /// Comma-separated prompt token ids (machine use).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// An image (PNG, JPEG or WebP; repeatable, in order) for a vision-language model: put
    /// before the --user text (or the last user message of --messages); with --prompt or
    /// --prompt-ids the prompt holds the model's image placeholder once per image.
    #[arg(long, value_name = "FILE")]
    pub image: Vec<PathBuf>,
    /// Print the generated ids, comma-separated, on stdout instead of text.
    #[arg(long)]
    pub print_ids: bool,
    /// Print one JSON line of measurements on stderr (for `cargo xtask bench`).
    #[arg(long, hide = true)]
    pub stats_json: bool,
    /// Do not stop at end-of-sequence ids (benchmarks generate a fixed count).
    #[arg(long, hide = true)]
    pub ignore_eos: bool,
    /// Run the same generation this many times in the process, each from empty caches, with
    /// a stats line per run (benchmarks: the later runs show steady-state speed, without
    /// first-use costs such as GPU kernel loading).
    #[arg(long, hide = true, default_value_t = 1)]
    pub repeat: usize,
}

pub fn default_model() -> anyhow::Result<PathBuf> {
    let cache = mlxcel_core::cache_dir().context("neither MLXCEL_CACHE_DIR nor HOME is set")?;
    let path = cache.join("models/SmolLM2-135M-Instruct-4bit");
    if !path.join("config.json").is_file() {
        bail!("no --model given and the default model is not installed at {}: run `cargo xtask fetch-models`", path.display());
    }
    Ok(path)
}

fn sampling(flags: &RunFlags) -> SamplingParams {
    SamplingParams {
        temperature: flags.temperature,
        top_k: flags.top_k,
        top_p: flags.top_p,
        min_p: flags.min_p,
        repetition_penalty: flags.repetition_penalty,
        seed: flags.seed,
        ..Default::default()
    }
}

/// Range checks of the flags, before anything is loaded; the error names the flag.
fn check_flags(flags: &RunFlags) -> anyhow::Result<()> {
    if let Err(e) = sampling(flags).validate() {
        bail!("--{} {}: {}", e.field.replace('_', "-"), e.value, e.reason);
    }
    if flags.prefill_chunk == Some(0) {
        bail!("--prefill-chunk 0: must be at least 1 token");
    }
    if flags.max_context == Some(0) {
        bail!("--max-context 0: must be at least 1 token");
    }
    match flags.draft_tokens {
        Some(0) => bail!("--draft-tokens 0: at least 1 token must be proposed a round"),
        Some(_) if flags.draft_model.is_none() && flags.speculative.is_none() => {
            bail!("--draft-tokens needs --draft-model DIR or --speculative mtp")
        }
        _ => {}
    }
    Ok(())
}

/// Tokens a draft model proposes per round without `--draft-tokens`.
const DEFAULT_DRAFT_TOKENS: usize = 4;

/// Where speculative decoding's proposals come from (`--speculative`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpeculativeMethod {
    /// The checkpoint's multi-token-prediction layers.
    Mtp,
}

/// How a generation proposes tokens: not at all, by a draft model, or by the model's MTP
/// layers; with the tokens proposed per round.
#[derive(Clone, Copy)]
enum Speculator<'a> {
    None,
    Draft(&'a Loaded, usize),
    Mtp(usize),
}

impl<'a> Speculator<'a> {
    /// The speculator the flags ask for (`draft`: the loaded `--draft-model`).
    fn of(flags: &RunFlags, loaded: &Loaded, draft: Option<&'a Loaded>) -> Speculator<'a> {
        match (draft, flags.speculative) {
            (Some(d), _) => {
                Speculator::Draft(d, flags.draft_tokens.unwrap_or(DEFAULT_DRAFT_TOKENS))
            }
            (None, Some(SpeculativeMethod::Mtp)) => Speculator::Mtp(
                flags
                    .draft_tokens
                    .unwrap_or_else(|| loaded.model.mtp().map_or(1, |m| m.mtp_layers())),
            ),
            (None, None) => Speculator::None,
        }
    }
}

/// The `--draft-model`, loaded like the model (same runtime policy; no adapter or surgery),
/// after checking it shares the model's tokenizer.
fn load_draft(flags: &RunFlags, loaded: &Loaded) -> anyhow::Result<Option<Loaded>> {
    let Some(path) = &flags.draft_model else {
        return Ok(None);
    };
    let path = crate::convert::resolve_gguf(path, flags.quiet)?;
    let options = LoadOptions {
        skip_tokenizer: loaded.tokenizer.is_none(),
        policy: Some(mlxcel_core::policy::current()),
        ..Default::default()
    };
    let draft =
        load_model(&path, &options).with_context(|| format!("--draft-model {}", path.display()))?;
    match (&loaded.tokenizer, &draft.tokenizer) {
        (Some(m), Some(d)) => mlxcel_loading::check_draft_tokenizer(
            (&loaded.folder, m),
            (&draft.folder, d),
        )?,
        // Token ids in, ids out (--prompt-ids --print-ids) loads no tokenizer: the ids must
        // at least index the same vocabulary.
        _ if loaded.model.vocab_size() != draft.model.vocab_size() => bail!(
            "--draft-model {}: its vocabulary has {} ids and the model's {}; a draft must share the model's tokenizer",
            draft.folder.display(),
            draft.model.vocab_size(),
            loaded.model.vocab_size()
        ),
        _ if !flags.quiet => eprintln!(
            "[no tokenizers loaded to compare: the draft's token ids are taken to be the model's]"
        ),
        _ => {}
    }
    if !flags.quiet {
        eprintln!(
            "[draft {} ({}) loaded in {:.2}s, {} tokens a round]",
            draft.folder.display(),
            draft.model_type.name(),
            draft.load_seconds,
            flags.draft_tokens.unwrap_or(DEFAULT_DRAFT_TOKENS)
        );
    }
    Ok(Some(draft))
}

/// One generation in `session`, speculative when `speculator` says so.
fn run_generation(
    session: &mut mlxcel_arch::generate::Session<'_>,
    speculator: Speculator<'_>,
    tokenizer: Option<&mlxcel_loading::Tokenizer>,
    prompt: &[u32],
    req: &GenerateRequest,
    on_text: impl FnMut(&str),
) -> anyhow::Result<(Vec<u32>, GenerationStats)> {
    Ok(match speculator {
        Speculator::Draft(draft, tokens) => {
            let mut draft_session = draft.session();
            mlxcel_loading::generate_text_speculative(
                session,
                mlxcel_loading::Draft {
                    session: &mut draft_session,
                    tokens,
                },
                tokenizer,
                prompt,
                req,
                Default::default(),
                on_text,
                |_, _| {},
            )?
        }
        Speculator::Mtp(tokens) => mlxcel_loading::generate_text_mtp(
            session,
            tokens,
            tokenizer,
            prompt,
            req,
            Default::default(),
            on_text,
            |_, _| {},
        )?,
        Speculator::None => generate_text(session, tokenizer, prompt, req, on_text, |_| {})?,
    })
}

fn load(flags: &RunFlags, need_tokenizer: bool) -> anyhow::Result<Option<Loaded>> {
    check_flags(flags)?;
    let model = match &flags.model {
        Some(m) => crate::convert::resolve_gguf(m, flags.quiet)?,
        None => default_model()?,
    };
    if flags.estimate_memory || !flags.force {
        let folder = mlxcel_loading::resolve_model_dir(&model)?;
        let config = mlxcel_loading::read_config(&folder)?;
        let dtype = mlxcel_loading::compute_dtype(&config)?;
        let context = flags.max_context.unwrap_or(4096) as u64;
        // Under `mlxcel launch`, this rank's part.
        let est = mlxcel_loading::memory::estimate_rank(
            &folder,
            &config,
            dtype,
            context,
            flags.prefill_chunk.unwrap_or(512) as u64,
            &crate::launch::rank_part_from_env(),
        )?;
        if flags.estimate_memory {
            print_estimate(&est, context);
            return Ok(None);
        }
        if !est.fits() {
            bail!(
                "the run needs about {:.2} GiB ({:.2} GiB weights, {:.2} GiB KV cache for {context} tokens) but the {} has {:.2} GiB; use --force to run anyway",
                gib(est.total()),
                gib(est.weight_bytes()),
                gib(est.kv_cache),
                est.device,
                gib(est.available.unwrap_or(0))
            );
        }
    }
    let options = LoadOptions {
        skip_tokenizer: !need_tokenizer,
        // Parsed and installed once in `main`.
        policy: Some(mlxcel_core::policy::current()),
        surgery: flags.surgery.clone(),
        adapter: flags.adapter.clone(),
        lora_fuse: flags.lora_fuse,
        // This rank's part when `mlxcel launch` started the process.
        parallelism: crate::launch::parallelism_from_env()?,
        random_weights: flags.random_weights,
        mtp: flags.speculative == Some(SpeculativeMethod::Mtp),
        ..Default::default()
    };
    let loaded = load_model(&model, &options)?;
    if !flags.quiet {
        eprintln!(
            "[loaded {} ({}) in {:.2}s]",
            loaded.folder.display(),
            loaded.model_type.name(),
            loaded.load_seconds
        );
        for line in &loaded.surgery_applied {
            eprintln!("[{line}]");
        }
    }
    if let (false, Some((plan, _))) = (flags.quiet, &loaded.expert_stream) {
        eprintln!("{}", plan.describe());
    }
    if let (false, Some(plan)) = (flags.quiet, &loaded.external_ple) {
        eprintln!("{}", plan.describe());
    }
    Ok(Some(loaded))
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// `--estimate-memory` for `inspect`: a run of `context` tokens with 512-token prefill chunks.
pub fn estimate_for(model: &std::path::Path, context: u64) -> anyhow::Result<()> {
    let folder = mlxcel_loading::resolve_model_dir(model)?;
    let config = mlxcel_loading::read_config(&folder)?;
    let dtype = mlxcel_loading::compute_dtype(&config)?;
    println!();
    print_estimate(&estimate(&folder, &config, dtype, context, 512)?, context);
    Ok(())
}

pub fn print_estimate(est: &mlxcel_loading::memory::MemoryEstimate, context: u64) {
    println!("{:<16} {:<10} {:>12}", "role", "dtype", "bytes");
    for ((role, dtype), bytes) in &est.weights {
        println!("{role:<16} {dtype:<10} {bytes:>12}");
    }
    println!(
        "weights          {:>23} ({:.3} GiB)",
        est.weight_bytes(),
        gib(est.weight_bytes())
    );
    println!(
        "kv cache         {:>23} ({:.3} GiB, {context} tokens, {} bytes per token)",
        est.kv_cache,
        gib(est.kv_cache),
        est.kv_bytes_per_token
    );
    println!(
        "transient        {:>23} ({:.3} GiB)",
        est.transient,
        gib(est.transient)
    );
    if est.expert_arena > 0 {
        println!(
            "expert arena     {:>23} ({:.3} GiB, streamed routed experts)",
            est.expert_arena,
            gib(est.expert_arena)
        );
    }
    if est.vision_tower_lazy > 0 {
        println!(
            "vision tower     {:>23} ({:.3} GiB, lazy: on disk until the first image, not in the total)",
            est.vision_tower_lazy,
            gib(est.vision_tower_lazy)
        );
    }
    if est.ple_rows > 0 {
        println!(
            "ple rows         {:>23} ({:.3} GiB, external per-layer-embedding table: its row cache, or the table with MLXCEL_PLE_IO=ram)",
            est.ple_rows,
            gib(est.ple_rows)
        );
    }
    println!(
        "total            {:>23} ({:.3} GiB)",
        est.total(),
        gib(est.total())
    );
    match est.available {
        Some(a) => println!(
            "{} memory      {:>23} ({:.3} GiB): {}",
            est.device,
            a,
            gib(a),
            if est.fits() { "fits" } else { "does NOT fit" }
        ),
        None => println!("{} memory unknown", est.device),
    }
}

fn read_messages(source: &str) -> anyhow::Result<Vec<Message>> {
    let text = if source == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s)?;
        s
    } else {
        std::fs::read_to_string(source).with_context(|| format!("--messages {source}"))?
    };
    serde_json::from_str(&text).with_context(|| {
        format!("--messages {source}: expected a JSON array of {{\"role\", \"content\"}} objects")
    })
}

fn print_stats(stats: &GenerationStats, loaded: &Loaded, quiet: bool) {
    if quiet {
        return;
    }
    if let Some((_, s)) = &loaded.expert_stream {
        eprintln!("\n{}", s.borrow().describe());
    }
    if let Some(plan) = &loaded.external_ple {
        eprintln!("\n{}", plan.stats.borrow().describe());
    }
    let peak = mlxcel_core::memory::peak_bytes().unwrap_or(0);
    eprintln!(
        "\n[prompt {} tokens ({} reused), prefill {:.1} tok/s, decode {} tokens at {:.1} tok/s, peak memory {:.1} MiB, finish {:?}]",
        stats.prompt_tokens,
        stats.reused_tokens,
        stats.prefill_tokens_per_second(),
        stats.generated_tokens,
        stats.decode_tokens_per_second(),
        peak as f64 / (1 << 20) as f64,
        stats.finish
    );
    if let Some(s) = &stats.speculation {
        eprintln!(
            "[speculative: {} rounds, {:.2} tokens a round, {} of {} drafted tokens accepted ({:.1}%); per round {:.2} ms building the graph, {:.2} ms evaluating it]",
            s.rounds,
            s.tokens_per_round(),
            s.accepted,
            s.proposed,
            100.0 * s.acceptance_rate(),
            1e3 * s.build_seconds / s.rounds.max(1) as f64,
            1e3 * s.eval_seconds / s.rounds.max(1) as f64,
        );
    }
}

fn request(flags: &RunFlags, loaded: &Loaded) -> GenerateRequest {
    GenerateRequest {
        max_new_tokens: flags.max_new,
        sampling: sampling(flags),
        stop: flags.stop.clone(),
        eos_token_ids: loaded.eos_token_ids.clone(),
        prefill_chunk: flags.prefill_chunk,
        ..GenerateRequest::default()
    }
}

fn check_context(flags: &RunFlags, tokens: usize) -> anyhow::Result<()> {
    if let Some(max) = flags.max_context {
        if tokens > max {
            bail!("the prompt has {tokens} tokens, more than --max-context {max}");
        }
    }
    Ok(())
}

/// Reads and preprocesses `paths` for `loaded` (the seed's error when it has no vision tower;
/// a file that cannot be read or decoded is named).
pub fn prepare_images(
    loaded: &Loaded,
    paths: &[PathBuf],
) -> anyhow::Result<Vec<mlxcel_loading::vision::PreparedImage>> {
    if paths.is_empty() {
        return Ok(Vec::new());
    }
    if loaded.vision.is_none() {
        return Err(
            mlxcel_arch::vision::no_vision_tower(&loaded.folder.display().to_string()).into(),
        );
    }
    paths
        .iter()
        .map(|path| {
            let image = mlxcel_loading::image::load_image(path)?;
            Ok(loaded.prepare_for_prompt(&image)?)
        })
        .collect()
}

/// The model inputs of `images`, in prompt order.
fn inputs(
    images: &[mlxcel_loading::vision::PreparedImage],
) -> Vec<mlxcel_arch::vision::ImageInput> {
    images
        .iter()
        .flat_map(|i| i.inputs.iter().cloned())
        .collect()
}

/// The chat template over `messages` (whose text holds one image placeholder per image), with
/// the placeholders expanded as the model's processor does, tokenised.
fn templated(
    loaded: &Loaded,
    messages: &[Message],
    images: &[mlxcel_loading::vision::PreparedImage],
) -> anyhow::Result<Vec<u32>> {
    let template = loaded.chat_template.as_ref().with_context(|| {
        format!(
            "{} has no chat template; use --prompt for raw completion",
            loaded.folder.display()
        )
    })?;
    let text = loaded.expand_prompt_text_for(&template.render(messages, true)?, images)?;
    let tokenizer = loaded
        .tokenizer
        .as_ref()
        .context("model has no tokenizer")?;
    Ok(tokenizer.encode(&text, false)?)
}

pub fn generate(flags: GenerateFlags) -> anyhow::Result<()> {
    let run = &flags.run;
    let need_tokenizer = flags.prompt_ids.is_none() || !flags.print_ids;
    // Image placeholders are expanded through the tokenizer.
    let need_tokenizer = need_tokenizer || !flags.image.is_empty();
    let Some(loaded) = load(run, need_tokenizer)? else {
        return Ok(());
    };
    let draft = load_draft(run, &loaded)?;
    let images = prepare_images(&loaded, &flags.image)?;
    let n = images.len();
    let mut messages = Vec::new();
    if let Some(system) = &run.system {
        messages.push(Message::new("system", system));
    }
    let prompt: Vec<u32> = if let Some(ids) = &flags.prompt_ids {
        let vocab = loaded.model.vocab_size();
        if let Some(bad) = ids.iter().find(|t| **t as usize >= vocab) {
            bail!("--prompt-ids: token {bad} is outside the vocabulary of {vocab}");
        }
        loaded.expand_image_tokens_for(ids, &images)?
    } else if let Some(text) = &flags.prompt {
        if run.system.is_some() {
            bail!("--system applies to chat prompts (--messages or --user), not to --prompt");
        }
        loaded
            .tokenizer
            .as_ref()
            .context("model has no tokenizer")?
            .encode(&loaded.expand_prompt_text_for(text, &images)?, true)?
    } else if let Some(source) = &flags.messages {
        messages.extend(read_messages(source)?);
        if n > 0 {
            let last = messages
                .iter_mut()
                .rev()
                .find(|m| m.role == "user")
                .context("--image needs a user message in --messages")?;
            last.content = loaded.user_content_with_images(&last.content, n)?;
        }
        templated(&loaded, &messages, &images)?
    } else if let Some(user) = &flags.user {
        messages.push(Message::new(
            "user",
            &loaded.user_content_with_images(user, n)?,
        ));
        templated(&loaded, &messages, &images)?
    } else {
        bail!("give a prompt: --prompt TEXT, --user TEXT, --messages FILE|- or --prompt-ids 1,2,3");
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    check_context(run, prompt.len())?;
    let tokenizer = if flags.print_ids {
        None
    } else {
        loaded.tokenizer.as_ref()
    };
    let mut stdout = std::io::stdout();
    let mut req = request(run, &loaded);
    req.images = inputs(&images);
    if flags.ignore_eos {
        req.eos_token_ids.clear();
    }
    for _ in 0..flags.repeat.max(1) {
        let mut session = loaded.session();
        let (ids, stats) = run_generation(
            &mut session,
            Speculator::of(run, &loaded, draft.as_ref()),
            tokenizer,
            &prompt,
            &req,
            |text| {
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            },
        )?;
        if flags.print_ids {
            println!(
                "{}",
                ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
            );
        } else {
            println!();
        }
        print_stats(&stats, &loaded, run.quiet);
        if flags.stats_json {
            print_stats_json(&loaded, &stats);
        }
    }
    Ok(())
}

/// The measurements `cargo xtask bench` reads (same keys as xtask/bench/mlx_lm_bench.py).
fn print_stats_json(loaded: &Loaded, stats: &GenerationStats) {
    let vmhwm = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?.to_owned();
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map(|kib| kib * 1024);
    let device_reads = mlxcel_core::weights::device_reads();
    let mut json = serde_json::json!({
        "engine": "mlxcel",
        "dtype": loaded.dtype.to_string(),
        "device": mlxcel_core::default_device().map(|d| format!("{d:?}")).unwrap_or_default(),
        "mlx_version": mlxcel_core::mlx_version().unwrap_or_default(),
        "load_s": loaded.load_seconds,
        "load_phases_s": {
            "prepare": loaded.load_phases.prepare,
            "build": loaded.load_phases.build,
            "warm_up": loaded.load_phases.warm_up,
            "tokenizer": loaded.load_phases.tokenizer,
        },
        // Tensors read straight into device memory (a GPU load), and the time those reads took.
        "device_reads": {
            "tensors": device_reads.tensors,
            "bytes": device_reads.bytes,
            "s": device_reads.seconds,
        },
        // mlxcel's CUDA kernels compiled in this process so far (load and this request).
        "kernel_compile_s": mlxcel_core::cuda_kernels::compile_seconds(),
        // CUDA decode steps built with overlapped launches (MLXCEL_CUDA_DECODE_OVERLAP).
        "cuda_decode_overlapped": mlxcel_core::cuda_decode::overlapped_decoders(),
        "prompt_tokens": stats.prompt_tokens,
        "prefill_s": stats.prefill_seconds,
        "prefill_tps": stats.prefill_tokens_per_second(),
        "generated_tokens": stats.generated_tokens,
        "decode_s": stats.decode_seconds,
        "decode_graph_s": stats.decode_graph_seconds,
        "decode_dispatch_s": stats.decode_dispatch_seconds,
        "decode_step_arrays": stats.decode_step_census.iter().map(|(_, n)| n).sum::<usize>(),
        "decode_step_census": stats.decode_step_census.iter()
            .map(|(name, n)| format!("{name} {n}")).collect::<Vec<_>>(),
        "decode_tps": stats.decode_tokens_per_second(),
        "peak_mlx_bytes": mlxcel_core::memory::peak_bytes().unwrap_or(0),
        // Dense copies of quantized layers kept for prefill (MLXCEL_PREFILL_DENSE_BYTES).
        "prefill_dense_bytes": mlxcel_arch::nn::prefill_dense_bytes_kept(),
        "vmhwm_bytes": vmhwm,
    });
    // Fields present only when their feature ran.
    if let Some(s) = stats.speculation {
        json["draft_rounds"] = s.rounds.into();
        json["draft_proposed"] = s.proposed.into();
        json["draft_accepted"] = s.accepted.into();
        json["draft_build_s"] = s.build_seconds.into();
        json["draft_eval_s"] = s.eval_seconds.into();
    }
    if let Some((plan, s)) = &loaded.expert_stream {
        let s = s.borrow();
        json["expert_stream"] = serde_json::json!({
            "slots_per_layer": plan.slots_per_layer,
            "arena_bytes": plan.arena_bytes(),
            "hits": s.hits,
            "misses": s.misses,
            "hit_rate": s.hit_rate(),
            "bytes_read": s.bytes_read,
            "read_s": s.read_seconds,
            "read_gbps": s.read_gb_per_second(),
            "wait_s": s.wait_seconds,
            "prefetched": s.prefetched,
            "prefetch_used": s.prefetch_used,
            "io": s.io.map(|io| io.name()),
            "reuse": s.reuse_rate(),
            "top_decile_share": s.top_decile_share(),
        });
    }
    eprintln!("{json}");
}

/// Interactive chat: one line per user turn; the session's caches carry over, and each turn's
/// prompt (the whole conversation re-rendered as text) reuses the prefix they hold. A line
/// `/image PATH` attaches an image to the next user turn (vision-language models); the
/// conversation's images stay part of every later prompt (and of the reused prefix's identity).
pub fn chat(flags: RunFlags) -> anyhow::Result<()> {
    let Some(loaded) = load(&flags, true)? else {
        return Ok(());
    };
    let draft = load_draft(&flags, &loaded)?;
    let tokenizer = loaded
        .tokenizer
        .as_ref()
        .context("model has no tokenizer")?;
    let mut messages = Vec::new();
    if let Some(system) = &flags.system {
        messages.push(Message::new("system", system));
    }
    let mut session = loaded.session();
    let mut images = Vec::new();
    let mut pending = 0;
    let stdin = std::io::stdin();
    let interactive = std::io::IsTerminal::is_terminal(&stdin);
    loop {
        if interactive {
            eprint!("> ");
        }
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.is_empty() {
            continue;
        }
        if let Some(path) = line.strip_prefix("/image ") {
            match prepare_images(&loaded, &[PathBuf::from(path.trim())]) {
                Ok(mut image) => {
                    images.append(&mut image);
                    pending += 1;
                    eprintln!("[image {} attached to the next message]", images.len());
                }
                Err(e) => eprintln!("error: {e:#}"),
            }
            continue;
        }
        messages.push(Message::new(
            "user",
            &loaded.user_content_with_images(line, pending)?,
        ));
        pending = 0;
        let prompt = templated(&loaded, &messages, &images)?;
        check_context(&flags, prompt.len())?;
        let mut reply = String::new();
        let mut stdout = std::io::stdout();
        let mut req = request(&flags, &loaded);
        req.images = inputs(&images);
        let (_, stats) = run_generation(
            &mut session,
            Speculator::of(&flags, &loaded, draft.as_ref()),
            Some(tokenizer),
            &prompt,
            &req,
            |text| {
                reply.push_str(text);
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            },
        )?;
        println!();
        print_stats(&stats, &loaded, flags.quiet);
        messages.push(Message::new("assistant", reply.trim()));
    }
    Ok(())
}
