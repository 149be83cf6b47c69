//! # mlxcel-models
//!
//! Load a model folder (HuggingFace safetensors or an MLX-quantized checkpoint) and run it on
//! Apple's MLX — on Metal, CUDA or the CPU — from one crate:
//!
//! ```no_run
//! use mlxcel_models::{Message, Model};
//!
//! let model = Model::load("~/.cache/mlxcel/models/SmolLM2-135M-Instruct-4bit").build()?;
//! let mut chat = model.session();
//! let reply = chat.generate(vec![Message::user("What is the capital of France?")], Default::default())?;
//! for piece in reply {
//!     print!("{}", piece?.text);
//! }
//! # Ok::<(), mlxcel_models::Error>(())
//! ```
//!
//! ## Threads
//!
//! A [`Model`] is a cheap, cloneable handle that is `Send + Sync`: share it with `Arc`-free
//! clones across threads, move it into `std::thread::spawn` or `tokio::task::spawn_blocking`.
//! MLX's arrays and its lazily evaluated graphs are not safe to use from several threads at once,
//! so all MLX state of a model — its weights, the caches of its sessions — lives on one worker
//! thread that the handle talks to over a channel. Requests from several threads are served
//! together: each prefills its prompt in turn, then every running generation advances one
//! token per step, in one batched forward pass for the models that allow it (attention-only
//! decoders: the projections read the weights once for the whole batch; others step each
//! generation in turn), so eight concurrent streams cost far less than eight times one
//! ([`Model::batch_stats`]). A [`Session`] keeps its conversation's caches on the worker
//! between requests, so a follow-up reuses the common prefix.
//!
//! ## Streaming and cancellation
//!
//! [`Model::generate`] and [`Session::generate`] return a [`TokenStream`]: an iterator of
//! [`Piece`]s (and, with the `async` feature, a `futures_core::Stream` through
//! `TokenStream::into_async`). [`TokenStream::cancel`] (or a [`CancelHandle`] taken from it, or
//! dropping the stream) stops generation after the current token; [`TokenStream::finish`] gives
//! the statistics once it has ended.
//!
//! ## Embeddings
//!
//! [`Embedder`] loads an embedding checkpoint (BERT, XLM-RoBERTa, ModernBERT, or a decoder
//! embedder such as Qwen3-Embedding, with its sentence-transformers modules) on a worker thread the same way; `embed(&[&str])` returns one
//! vector per text, in input order. [`Model::load`] on such a folder is an error pointing here.
//!
//! ## Reranking
//!
//! [`Reranker`] loads a cross-encoder (`BertForSequenceClassification`,
//! `XLMRobertaForSequenceClassification`, `ModernBertForSequenceClassification`) the same way;
//! `score(query, &[&str])` returns one relevance score per document, in input order;
//! `Reranker::load(dir).generative()` scores with a generator the Qwen3-Reranker way.
//!
//! ## Lower layers
//!
//! The loading pipeline ([`loading`], crate `mlxcel-loading`) and the model layer ([`arch`],
//! crate `mlxcel-arch`: the registry, architectures, caches, `LanguageModel`) are re-exported for
//! programs that need them; their types are single-threaded.

#![warn(missing_docs)]

mod batch;
mod embedder;
mod reranker;
mod worker;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use mlxcel_arch::generate::SessionState;
use mlxcel_arch::sampling::SamplingParams;
use mlxcel_arch::LanguageModel;
use mlxcel_loading::{GenerateRequest, LoadOptions, Loaded};

use worker::Worker;

pub use batch::BatchStats;
pub use embedder::{Embedder, EmbedderBuilder, EmbedderInfo, Overflow};
pub use mlxcel_arch as arch;
pub use mlxcel_arch::nn::lora::AdapterMix;
pub use mlxcel_core::{Device, Dtype, RuntimePolicy};
pub use mlxcel_loading as loading;
pub use mlxcel_loading::image::{decode_image, image_dimensions, load_image, RgbImage};
pub use mlxcel_loading::{
    EmbedOptions, FinishReason, GenerationStats, LogitsProcessor, Message, ModelType,
    RerankOptions, ScoreActivation, TokenBytes, TokenLogprob, ToolCallFormat,
};
pub use reranker::{Reranker, RerankerBuilder, RerankerInfo};

/// Errors of the high-level API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Loading the model folder failed (the message names the file, tensor or field).
    #[error(transparent)]
    Load(#[from] mlxcel_loading::LoadError),
    /// Running the model failed.
    #[error(transparent)]
    Model(#[from] mlxcel_arch::ModelError),
    /// MLX itself reported an error.
    #[error(transparent)]
    Mlx(#[from] mlxcel_core::Error),
    /// A request the model cannot serve (bad ids, no chat template, ...).
    #[error("{0}")]
    Invalid(String),
    /// The model's worker thread stopped (it panicked, or the process is shutting down).
    #[error("the model's worker thread has stopped")]
    WorkerGone,
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What to feed the model.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A conversation, rendered with the model's chat template (generation prompt appended) and
    /// encoded without adding special tokens (the template writes them).
    Messages(Vec<Message>),
    /// A conversation and the tools the model may call, rendered with the model's chat
    /// template given `tools` (see [`Model::chat_text_with_tools`]).
    MessagesWithTools {
        /// The conversation.
        messages: Vec<Message>,
        /// OpenAI-style tool declarations:
        /// `{"type": "function", "function": {"name", "description", "parameters"}}`.
        tools: Vec<serde_json::Value>,
    },
    /// Raw text for completion, encoded with the tokenizer's special-token post-processing.
    Text(String),
    /// Token ids as they are.
    Ids(Vec<u32>),
}

impl From<Vec<Message>> for Prompt {
    fn from(messages: Vec<Message>) -> Prompt {
        Prompt::Messages(messages)
    }
}

impl From<&str> for Prompt {
    fn from(text: &str) -> Prompt {
        Prompt::Text(text.to_string())
    }
}

impl From<Vec<u32>> for Prompt {
    fn from(ids: Vec<u32>) -> Prompt {
        Prompt::Ids(ids)
    }
}

/// How tokens are chosen. The default is greedy decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// 0 picks the most likely token (greedy); higher values flatten the distribution.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probabilities reach `top_p` (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0: none).
    pub min_p: f32,
    /// Divide the logits of recently seen tokens by this (1: off).
    pub repetition_penalty: f32,
    /// Seed of the sampler's random numbers.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        let p = SamplingParams::default();
        Sampling {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            seed: p.seed,
        }
    }
}

impl Sampling {
    /// The sampler's parameters, range-checked (the error names the field and its value).
    fn params(&self) -> Result<SamplingParams> {
        let params = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        };
        params
            .validate()
            .map_err(|e| Error::Invalid(format!("sampling {e}")))?;
        Ok(params)
    }
}

/// Options of one generation. The defaults come from the model: its end-of-sequence ids end
/// generation, and at most [`Generation::DEFAULT_MAX_NEW_TOKENS`] tokens (never past the
/// model's context) are generated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Generation {
    /// Most tokens to generate; `None`: [`Generation::DEFAULT_MAX_NEW_TOKENS`], capped by the
    /// room left in the model's context.
    pub max_new_tokens: Option<usize>,
    /// How tokens are chosen (greedy by default).
    pub sampling: Sampling,
    /// Generation ends before the first occurrence of any of these strings.
    pub stop: Vec<String>,
    /// Extra ids that end generation, besides the model's end-of-sequence ids.
    pub extra_eos_token_ids: Vec<u32>,
    /// Prefill the prompt in chunks of this many tokens (bounds memory for long prompts).
    pub prefill_chunk: Option<usize>,
    /// The runtime adapters this generation runs with ([`ModelBuilder::runtime_adapter`]):
    /// one, a weighted one or a blend ([`AdapterMix`]); `Some(AdapterMix::none())` is the base
    /// model. `None`: the mix the model was loaded with ([`ModelInfo::default_adapters`]).
    pub adapters: Option<AdapterMix>,
    /// Report each token's log-probability in [`Piece::logprobs`], with this many most likely
    /// alternatives (`Some(0)`: the token's own only). `None` costs nothing; `Some` reads each
    /// step's logits to the host (see [`loading::StepHooks::logprobs`] for what they are).
    pub logprobs: Option<usize>,
    /// Changes each step's logits before the token is picked (constrained decoding).
    pub logits_processor: Option<SharedLogitsProcessor>,
    /// Keep special tokens in the pieces' text (a harmony-format reply's channel markup, see
    /// [`ToolCallFormat::Harmony`]); by default they are left out.
    pub keep_special_tokens: bool,
    /// Images for a vision-language model, in prompt order (decode PNG, JPEG or WebP bytes
    /// with [`decode_image`]). They go before the text of the last user message of a
    /// conversation prompt; a text or ids prompt holds the model's image placeholder once per
    /// image. A model without a vision tower refuses them.
    pub images: Vec<RgbImage>,
}

/// A [`LogitsProcessor`] that a [`Generation`] can carry to the model's worker thread. Clones
/// share one processor (and its state); two are equal when they are the same one.
#[derive(Clone)]
pub struct SharedLogitsProcessor(Arc<Mutex<dyn LogitsProcessor>>);

impl SharedLogitsProcessor {
    /// Wraps `processor`.
    pub fn new(processor: impl LogitsProcessor + 'static) -> SharedLogitsProcessor {
        SharedLogitsProcessor(Arc::new(Mutex::new(processor)))
    }
}

impl PartialEq for SharedLogitsProcessor {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for SharedLogitsProcessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedLogitsProcessor(..)")
    }
}

impl Generation {
    /// The token budget when none is given.
    pub const DEFAULT_MAX_NEW_TOKENS: usize = 512;
}

/// The routed-expert arena of a model whose experts stream from disk, since load
/// ([`Model::expert_arena_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ExpertArenaStats {
    /// Bytes of all streamed layers' arenas.
    pub arena_bytes: u64,
    /// Expert slots per streamed layer.
    pub slots_per_layer: usize,
    /// Experts a token selected that were resident.
    pub hits: u64,
    /// Experts a token selected that were read from disk.
    pub misses: u64,
    /// Bytes read from the stream files.
    pub bytes_read: u64,
    /// Wall-clock seconds spent reading them.
    pub read_seconds: f64,
}

/// MLX's allocator counters (all models of the process share one allocator).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes held by live arrays (weights, caches, computations in flight).
    pub active_bytes: usize,
    /// The most [`MemoryStats::active_bytes`] has been since the process started.
    pub peak_bytes: usize,
    /// Freed bytes MLX keeps cached for reuse.
    pub cache_bytes: usize,
}

/// MLX's memory use now. It only reads the allocator's counters, so it may be called from any
/// thread, also while a model's worker is generating.
pub fn memory_stats() -> Result<MemoryStats> {
    Ok(MemoryStats {
        active_bytes: mlxcel_core::memory::active_bytes()?,
        peak_bytes: mlxcel_core::memory::peak_bytes()?,
        cache_bytes: mlxcel_core::memory::cache_bytes()?,
    })
}

/// Facts about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The registered architecture `config.json`'s `model_type` selected.
    pub model_type: ModelType,
    /// The model folder it was loaded from.
    pub folder: PathBuf,
    /// The dtype it computes in.
    pub dtype: Dtype,
    /// Logits per position; token ids must be below it.
    pub vocab_size: usize,
    /// Ids that end generation (from `config.json`, `generation_config.json` and the tokenizer).
    pub eos_token_ids: Vec<u32>,
    /// `max_position_embeddings`, when the config states it.
    pub context_length: Option<usize>,
    /// Whether text can be encoded and decoded (not when built `without_tokenizer`).
    pub has_tokenizer: bool,
    /// Whether [`Model::chat_text`] and [`Prompt::Messages`] can be used.
    pub has_chat_template: bool,
    /// Seconds the load took on the worker thread.
    pub load_seconds: f64,
    /// What the load-time weight edits did, one line each: the fused LoRA adapter
    /// ([`ModelBuilder::adapter`]), then each surgery rule ([`ModelBuilder::surgery`], or the
    /// `MLXCEL_SURGERY` file with [`ModelBuilder::policy_from_env`]). Empty when none applied.
    pub weight_edits: Vec<String>,
    /// The runtime adapters requests can select ([`Generation::adapters`]).
    pub adapters: Vec<String>,
    /// The adapter mix requests run with when they name none: the base model, or the adapter of
    /// [`ModelBuilder::adapter`] when it was kept unfused over a quantized base.
    pub default_adapters: AdapterMix,
}

/// Builds a [`Model`]: `Model::load(path).dtype(..).build()`.
#[derive(Debug, Clone)]
pub struct ModelBuilder {
    path: PathBuf,
    options: LoadOptions,
    device: Option<Device>,
}

impl ModelBuilder {
    /// Computes in `dtype` instead of the checkpoint's (the CPU computes in float32 by default).
    pub fn dtype(mut self, dtype: Dtype) -> Self {
        self.options.dtype = Some(dtype);
        self
    }

    /// Runs on `device` (MLX's default device otherwise: the GPU where there is one).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Runtime switches (kernels, fusion, expert streaming). The default is
    /// [`RuntimePolicy::default`]; the `MLXCEL_*` environment variables are read only through
    /// [`ModelBuilder::policy_from_env`].
    pub fn policy(mut self, policy: RuntimePolicy) -> Self {
        self.options.policy = Some(policy);
        self
    }

    /// Reads the runtime switches from the `MLXCEL_*` environment variables (an invalid value
    /// is an error naming the variable).
    pub fn policy_from_env(mut self) -> Result<Self> {
        self.options.policy = Some(RuntimePolicy::from_env()?);
        Ok(self)
    }

    /// Fuses the LoRA adapter folder at `path` (mlx-lm's `adapters.safetensors` +
    /// `adapter_config.json`, or PEFT's `adapter_model.safetensors` + `adapter_config.json`)
    /// into the dense weights at load time (over a quantized base it is kept unfused and active
    /// for every request unless [`ModelBuilder::lora_fuse`]). An adapter that does not match the
    /// model is a load error naming the tensor. [`ModelInfo::weight_edits`] lists what was done.
    pub fn adapter(mut self, path: impl Into<PathBuf>) -> Self {
        self.options.adapter = Some(expand_home(&path.into()));
        self
    }

    /// Fuses [`ModelBuilder::adapter`] into a quantized base too (dequantize, add, requantize
    /// at each layer's own bits and group size) instead of keeping it unfused.
    pub fn lora_fuse(mut self) -> Self {
        self.options.lora_fuse = true;
        self
    }

    /// Registers the LoRA adapter folder at `path` as runtime adapter `name`: kept unfused over
    /// the base weights (dense or quantized), so requests choose it, a weighted version or a
    /// blend with others per generation ([`Generation::adapters`]) without reloading.
    pub fn runtime_adapter(mut self, name: impl Into<String>, path: impl Into<PathBuf>) -> Self {
        self.options
            .runtime_adapters
            .push((name.into(), expand_home(&path.into())));
        self
    }

    /// Applies the weight-surgery YAML file at `path` (scale, add, prune, replace,
    /// interpolate; see `mlxcel_loading::surgery`) to the weights at load time, after any
    /// [`ModelBuilder::adapter`]. A rule that matches nothing is a load error.
    /// [`ModelInfo::weight_edits`] lists what each rule did.
    pub fn surgery(mut self, path: impl Into<PathBuf>) -> Self {
        self.options.surgery = Some(expand_home(&path.into()));
        self
    }

    /// Skips the tokenizer and chat template (ids and logits only).
    pub fn without_tokenizer(mut self) -> Self {
        self.options.skip_tokenizer = true;
        self
    }

    /// The lower-level options, for what the builder does not cover.
    pub fn options(mut self, options: LoadOptions) -> Self {
        self.options = options;
        self
    }

    /// Starts the model's worker thread and loads the model there.
    pub fn build(self) -> Result<Model> {
        let ModelBuilder {
            path,
            options,
            device,
        } = self;
        let (worker, ready) = Worker::start("mlxcel-model", device, move || {
            let loaded = mlxcel_loading::load_model(expand_home(&path), &options)?;
            let mut state = ModelState {
                default_adapters: loaded.active_adapters(),
                loaded,
                sessions: HashMap::new(),
                tokenizer: None,
                running: VecDeque::new(),
                batch: None,
                batching: BatchStats::default(),
            };
            state.tokenizer = state.loaded.tokenizer.take().map(Arc::new);
            let ready = Ready {
                info: state.info(),
                tokenizer: state.tokenizer.clone(),
                template: state.loaded.chat_template.take().map(Arc::new),
                vision: state.loaded.vision.clone(),
                folder: state.loaded.folder.clone(),
            };
            Ok((state, ready))
        })?;
        Ok(Model {
            shared: Arc::new(Shared {
                worker,
                info: ready.info,
                tokenizer: ready.tokenizer,
                template: ready.template,
                vision: ready.vision,
                folder: ready.folder,
                next_session: AtomicU64::new(1),
                token_bytes: std::sync::OnceLock::new(),
            }),
        })
    }
}

fn expand_home(path: &std::path::Path) -> PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.to_path_buf(),
    }
}

struct Ready {
    info: ModelInfo,
    tokenizer: Option<Arc<mlxcel_loading::Tokenizer>>,
    template: Option<Arc<mlxcel_loading::ChatTemplate>>,
    vision: Option<mlxcel_loading::vision::VisionProcessor>,
    folder: PathBuf,
}

/// Parked conversations by id: their caches and the adapter mix they were computed under.
type Sessions = HashMap<u64, (SessionState, AdapterMix)>;

/// The worker thread's state: the model and the parked conversations, each with the adapter
/// mix its caches were computed under.
struct ModelState {
    loaded: Loaded,
    sessions: Sessions,
    /// The tokenizer, shared with the [`Model`] handles (taken out of `loaded`).
    tokenizer: Option<Arc<mlxcel_loading::Tokenizer>>,
    /// The generations between their steps and outside the batch, with their caches
    /// ([`batch`]).
    running: VecDeque<(batch::Running, SessionState)>,
    /// The generations decoded together.
    batch: Option<batch::Batch>,
    batching: BatchStats,
    /// The mix of requests that name none.
    default_adapters: AdapterMix,
}

impl ModelState {
    fn info(&self) -> ModelInfo {
        let l = &self.loaded;
        ModelInfo {
            model_type: l.model_type,
            folder: l.folder.clone(),
            dtype: l.dtype,
            vocab_size: l.model.vocab_size(),
            eos_token_ids: l.eos_token_ids.clone(),
            context_length: l
                .config
                .get("max_position_embeddings")
                .and_then(|v| v.as_u64())
                .map(|v| v as usize),
            has_tokenizer: l.tokenizer.is_some(),
            has_chat_template: l.chat_template.is_some(),
            load_seconds: l.load_seconds,
            weight_edits: l.surgery_applied.clone(),
            adapters: l.adapter_names(),
            default_adapters: self.default_adapters.clone(),
        }
    }

    /// Makes `mix` (else the default mix) the model's active adapters.
    fn select(&self, mix: Option<&AdapterMix>) -> Result<AdapterMix> {
        let mix = mix.unwrap_or(&self.default_adapters);
        self.loaded.select_adapters(mix)?;
        Ok(mix.clone())
    }
}

struct Shared {
    worker: Worker<ModelState>,
    info: ModelInfo,
    tokenizer: Option<Arc<mlxcel_loading::Tokenizer>>,
    template: Option<Arc<mlxcel_loading::ChatTemplate>>,
    /// The image processor and prompt expansion of a vision-language model with its tower.
    vision: Option<mlxcel_loading::vision::VisionProcessor>,
    folder: PathBuf,
    next_session: AtomicU64,
    token_bytes: std::sync::OnceLock<Arc<Vec<TokenBytes>>>,
}

/// A loaded model: a cloneable, `Send + Sync` handle to the thread that owns it (see the crate
/// documentation for why).
#[derive(Clone)]
pub struct Model {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("model_type", &self.shared.info.model_type)
            .field("folder", &self.shared.info.folder)
            .finish()
    }
}

impl Model {
    /// A builder loading the model folder at `path` (a leading `~` is the home folder).
    pub fn load(path: impl Into<PathBuf>) -> ModelBuilder {
        ModelBuilder {
            path: path.into(),
            options: LoadOptions {
                policy: Some(RuntimePolicy::default()),
                ..LoadOptions::default()
            },
            device: None,
        }
    }

    /// What was loaded.
    pub fn info(&self) -> &ModelInfo {
        &self.shared.info
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        mlxcel_arch::generate::check_token_ids(ids, self.shared.info.vocab_size)?;
        Ok(())
    }

    /// Token ids of `text` (`add_special_tokens`: the tokenizer's BOS/EOS post-processing; a
    /// rendered chat template already contains its special tokens, encode it without).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self.tokenizer()?.encode(text, add_special_tokens)?)
    }

    /// The text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(self.tokenizer()?.decode(ids, true)?)
    }

    /// The raw bytes each token id stands for (index = id; see
    /// [`loading::Tokenizer::token_bytes`]), computed once per model and shared.
    pub fn token_bytes(&self) -> Result<Arc<Vec<TokenBytes>>> {
        let tokenizer = self.tokenizer()?;
        Ok(self
            .shared
            .token_bytes
            .get_or_init(|| Arc::new(tokenizer.token_bytes()))
            .clone())
    }

    fn tokenizer(&self) -> Result<&mlxcel_loading::Tokenizer> {
        self.shared
            .tokenizer
            .as_deref()
            .ok_or_else(|| Error::Invalid("the model was loaded without a tokenizer".to_string()))
    }

    /// `messages` rendered with the model's chat template, ending with the assistant's turn.
    pub fn chat_text(&self, messages: &[Message]) -> Result<String> {
        Ok(self.template()?.render(messages, true)?)
    }

    /// [`Model::chat_text`] with tool declarations passed to the template as its `tools`
    /// variable (as HF's `apply_chat_template(tools=...)` does). A template that does not read
    /// `tools` ignores them: see [`Model::template_takes_tools`].
    pub fn chat_text_with_tools(
        &self,
        messages: &[Message],
        tools: &[serde_json::Value],
    ) -> Result<String> {
        Ok(self
            .template()?
            .render_with_tools(messages, Some(tools), true)?)
    }

    /// Whether the model's chat template reads tool declarations (its `tools` variable).
    pub fn template_takes_tools(&self) -> bool {
        self.shared
            .template
            .as_deref()
            .is_some_and(|t| t.takes_tools())
    }

    /// How the model writes tool calls, as its chat template teaches it (`None`: no template,
    /// or one that names no format).
    pub fn tool_call_format(&self) -> Option<ToolCallFormat> {
        self.shared
            .template
            .as_deref()
            .and_then(|t| t.tool_call_format())
    }

    fn template(&self) -> Result<&mlxcel_loading::ChatTemplate> {
        self.shared.template.as_deref().ok_or_else(|| {
            Error::Invalid(format!(
                "{} has no chat template",
                self.shared.info.folder.display()
            ))
        })
    }

    /// The token ids a prompt stands for.
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let ids = match prompt {
            Prompt::Messages(m) => self.encode(&self.chat_text(m)?, false)?,
            Prompt::MessagesWithTools { messages, tools } => {
                self.encode(&self.chat_text_with_tools(messages, tools)?, false)?
            }
            Prompt::Text(t) => self.encode(t, true)?,
            Prompt::Ids(ids) => ids.clone(),
        };
        if ids.is_empty() {
            return Err(Error::Invalid("the prompt is empty".to_string()));
        }
        self.check_ids(&ids)?;
        Ok(ids)
    }

    /// Whether the model takes images ([`Generation::images`]): a vision-language model loaded
    /// with its vision tower.
    pub fn takes_images(&self) -> bool {
        self.shared.vision.is_some()
    }

    /// The token ids a generation of `prompt` with `images` prefills (see
    /// [`Generation::images`]): the image placeholders are expanded into the model's image
    /// tokens, so the count is the prompt's length in the model's context. Without images it is
    /// [`Model::prompt_ids`]; a model without a vision tower refuses images.
    pub fn prompt_ids_with_images(&self, prompt: &Prompt, images: &[RgbImage]) -> Result<Vec<u32>> {
        Ok(self.prompt_with_images(prompt, images)?.0)
    }

    /// The prompt's ids with `images` expanded into the model's image tokens (see
    /// [`Generation::images`]), and the images' pixel values.
    fn prompt_with_images(
        &self,
        prompt: &Prompt,
        images: &[RgbImage],
    ) -> Result<(Vec<u32>, Vec<mlxcel_arch::vision::ImageInput>)> {
        if images.is_empty() {
            return Ok((self.prompt_ids(prompt)?, Vec::new()));
        }
        let vision = self.shared.vision.as_ref().ok_or_else(|| {
            Error::Model(mlxcel_arch::vision::no_vision_tower(
                &self.shared.folder.display().to_string(),
            ))
        })?;
        let prepared = images
            .iter()
            .map(|i| vision.prepare_for_prompt(i))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let inputs = prepared.iter().flat_map(|p| p.inputs.clone()).collect();
        let n = images.len();
        let with_images = |messages: &[Message]| -> Result<Vec<Message>> {
            let mut messages = messages.to_vec();
            let last = messages
                .iter_mut()
                .rev()
                .find(|m| m.role == "user")
                .ok_or_else(|| Error::Invalid("images need a user message".to_string()))?;
            last.content = format!("{}{}", vision.content_placeholder.repeat(n), last.content);
            Ok(messages)
        };
        let ids = match prompt {
            Prompt::Messages(m) => {
                let text = self.chat_text(&with_images(m)?)?;
                self.encode(&vision.expand_text_for(&text, &prepared)?, false)?
            }
            Prompt::MessagesWithTools { messages, tools } => {
                let text = self.chat_text_with_tools(&with_images(messages)?, tools)?;
                self.encode(&vision.expand_text_for(&text, &prepared)?, false)?
            }
            Prompt::Text(t) => self.encode(&vision.expand_text_for(t, &prepared)?, true)?,
            Prompt::Ids(ids) => vision.expand_ids_for(ids, &prepared)?,
        };
        self.check_ids(&ids)?;
        Ok((ids, inputs))
    }

    /// Next-token logits after `ids` (one forward pass with fresh caches): `vocab_size` values.
    /// Runs with the default adapter mix ([`ModelInfo::default_adapters`]).
    pub fn logits(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.logits_inner(ids, None)
    }

    /// [`Model::logits`] with the runtime adapters `mix`.
    pub fn logits_with_adapters(&self, ids: &[u32], mix: &AdapterMix) -> Result<Vec<f32>> {
        self.logits_inner(ids, Some(mix.clone()))
    }

    /// An error naming what is wrong with `mix` for this model (an unknown adapter, a repeated
    /// one, a non-finite weight).
    fn check_mix(&self, mix: &AdapterMix) -> Result<()> {
        let known = &self.shared.info.adapters;
        for (i, (name, weight)) in mix.entries.iter().enumerate() {
            if !known.contains(name) {
                return Err(Error::Invalid(format!(
                    "no runtime adapter named `{name}` (loaded: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                )));
            }
            if !weight.is_finite() {
                return Err(Error::Invalid(format!(
                    "adapter `{name}`: weight {weight} is not finite"
                )));
            }
            if mix.entries[..i].iter().any(|(n, _)| n == name) {
                return Err(Error::Invalid(format!(
                    "adapter `{name}` appears twice in the mix"
                )));
            }
        }
        Ok(())
    }

    fn logits_inner(&self, ids: &[u32], mix: Option<AdapterMix>) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::Invalid("no token ids".to_string()));
        }
        self.check_ids(ids)?;
        if let Some(mix) = &mix {
            self.check_mix(mix)?;
        }
        let ids = ids.to_vec();
        self.shared.worker.run(move |w| {
            w.select(mix.as_ref())?;
            let model = &w.loaded.model;
            let mut caches = model.make_caches();
            let row = mlxcel_arch::generate::prefill(model, &ids, &mut caches, None)?;
            Ok(row.astype(Dtype::Float32)?.to_vec::<f32>()?)
        })
    }

    /// Generates from `prompt` with fresh caches (see [`Session::generate`] to keep a
    /// conversation's caches between requests).
    pub fn generate(&self, prompt: impl Into<Prompt>, options: Generation) -> Result<TokenStream> {
        self.stream(None, prompt.into(), options)
    }

    /// How decode steps have been batched so far: generations running at the same time
    /// advance together, one forward pass per step (see the crate documentation). It waits
    /// for the worker, so it counts every step before the jobs submitted before it.
    pub fn batch_stats(&self) -> Result<BatchStats> {
        self.shared.worker.run(|w| Ok(w.batching))
    }

    /// The routed-expert arena's counters since load, when experts stream from disk (`None`
    /// when the model keeps them resident). It waits for the worker, as [`Model::batch_stats`]
    /// does.
    pub fn expert_arena_stats(&self) -> Result<Option<ExpertArenaStats>> {
        self.shared.worker.run(|w| {
            Ok(w.loaded.expert_stream.as_ref().map(|(plan, stats)| {
                let s = stats.borrow();
                ExpertArenaStats {
                    arena_bytes: plan.arena_bytes(),
                    slots_per_layer: plan.slots_per_layer,
                    hits: s.hits,
                    misses: s.misses,
                    bytes_read: s.bytes_read,
                    read_seconds: s.read_seconds,
                }
            }))
        })
    }

    /// A new conversation whose caches persist between its requests.
    pub fn session(&self) -> Session {
        Session {
            model: self.clone(),
            id: self.shared.next_session.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn stream(
        &self,
        session: Option<u64>,
        prompt: Prompt,
        options: Generation,
    ) -> Result<TokenStream> {
        let (ids, images) = self.prompt_with_images(&prompt, &options.images)?;
        let info = &self.shared.info;
        let room = info
            .context_length
            .map(|c| c.saturating_sub(ids.len()))
            .unwrap_or(usize::MAX);
        let max_new_tokens = match options.max_new_tokens {
            Some(n) if n > room => {
                return Err(Error::Invalid(format!(
                    "max_new_tokens {n} with a {}-token prompt exceeds the model's context of {}",
                    ids.len(),
                    info.context_length.unwrap_or(0)
                )))
            }
            Some(n) => n,
            None => Generation::DEFAULT_MAX_NEW_TOKENS.min(room),
        };
        if options.prefill_chunk == Some(0) {
            return Err(Error::Invalid("prefill_chunk must be positive".to_string()));
        }
        if let Some(mix) = &options.adapters {
            self.check_mix(mix)?;
        }
        let adapters = options.adapters;
        let cancel = Arc::new(AtomicBool::new(false));
        let mut eos_token_ids = info.eos_token_ids.clone();
        eos_token_ids.extend(&options.extra_eos_token_ids);
        let request = GenerateRequest {
            max_new_tokens,
            sampling: options.sampling.params()?,
            stop: options.stop,
            eos_token_ids,
            prefill_chunk: options.prefill_chunk,
            cancel: Some(cancel.clone()),
            keep_special_tokens: options.keep_special_tokens,
            images,
        };
        let queue = Arc::new(Queue::default());
        let start = batch::Start {
            session,
            ids,
            request,
            adapters,
            feed: queue.clone(),
            processor: options.logits_processor,
            logprobs: options.logprobs,
        };
        self.shared
            .worker
            .submit(Box::new(move |w: &mut ModelState| w.start(start)))?;
        Ok(TokenStream {
            queue,
            cancel,
            stats: None,
            ended: false,
        })
    }
}

/// One conversation of a [`Model`]: its caches stay on the model's worker between requests, so
/// a request that starts with the previous one's tokens (the usual chat turn) prefills only
/// what is new. `Send`, so it can move to another thread with its handle.
#[derive(Debug)]
pub struct Session {
    model: Model,
    id: u64,
}

impl Session {
    /// Generates from `prompt`, reusing the longest prefix the conversation's caches hold
    /// ([`GenerationStats::reused_tokens`] says how much). The reply's tokens join the caches.
    /// A request under another adapter mix ([`Generation::adapters`]) than the previous one
    /// starts from empty caches.
    pub fn generate(
        &mut self,
        prompt: impl Into<Prompt>,
        options: Generation,
    ) -> Result<TokenStream> {
        self.model.stream(Some(self.id), prompt.into(), options)
    }

    /// The token ids the conversation's caches hold (empty before its first request): a prompt
    /// starting with them is prefilled only past them. It waits for the worker, so it reflects
    /// every request submitted before it, including one still generating or being cancelled.
    pub fn cached_tokens(&self) -> Result<Vec<u32>> {
        let id = self.id;
        self.model.shared.worker.run(move |w| {
            Ok(w.sessions
                .get(&id)
                .map(|(s, _)| s.tokens().to_vec())
                .unwrap_or_default())
        })
    }

    /// The model this conversation runs on.
    pub fn model(&self) -> &Model {
        &self.model
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let id = self.id;
        let _ = self
            .model
            .shared
            .worker
            .submit(Box::new(move |w| w.forget_session(id)));
    }
}

/// A piece of generated output: text that is final (never a split UTF-8 character, never the
/// start of a stop string) and the token ids it came from. Models loaded without a tokenizer
/// give one id per piece and no text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Piece {
    /// Text made final by this piece (may be empty while a character or stop string is pending).
    pub text: String,
    /// The generated token ids this piece accounts for.
    pub tokens: Vec<u32>,
    /// One per token of [`Piece::tokens`] when [`Generation::logprobs`] asked for them, else
    /// empty.
    pub logprobs: Vec<TokenLogprob>,
}

enum Event {
    Piece(Piece),
    Done(Box<GenerationStats>),
    Failed(Error),
}

/// Events from the worker, readable blocking (iterator) or with a waker (async stream).
#[derive(Default)]
struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
}

#[derive(Default)]
struct QueueState {
    events: VecDeque<Event>,
    waker: Option<std::task::Waker>,
}

impl Queue {
    fn push(&self, event: Event) {
        if let Ok(mut s) = self.state.lock() {
            s.events.push_back(event);
            if let Some(w) = s.waker.take() {
                w.wake();
            }
        }
        self.ready.notify_all();
    }

    fn pop_blocking(&self) -> Option<Event> {
        let mut s = self.state.lock().ok()?;
        loop {
            if let Some(e) = s.events.pop_front() {
                return Some(e);
            }
            s = self.ready.wait(s).ok()?;
        }
    }
}

/// Stops a generation from anywhere; see [`TokenStream::cancel_handle`].
#[derive(Debug, Clone)]
pub struct CancelHandle(Arc<AtomicBool>);

impl CancelHandle {
    /// Stops the generation after the token being computed.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The output of one generation, as it is produced: iterate for [`Piece`]s; an error ends the
/// iteration. Dropping the stream cancels the generation.
pub struct TokenStream {
    queue: Arc<Queue>,
    cancel: Arc<AtomicBool>,
    stats: Option<GenerationStats>,
    ended: bool,
}

impl std::fmt::Debug for TokenStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStream")
            .field("ended", &self.ended)
            .finish()
    }
}

impl TokenStream {
    /// Stops the generation after the token being computed.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// A handle that cancels this generation from another thread.
    pub fn cancel_handle(&self) -> CancelHandle {
        CancelHandle(self.cancel.clone())
    }

    /// Reads the rest of the output; returns all of its text and the statistics.
    pub fn finish(mut self) -> Result<(String, GenerationStats)> {
        let mut text = String::new();
        for piece in self.by_ref() {
            text.push_str(&piece?.text);
        }
        self.stats
            .take()
            .map(|s| (text, s))
            .ok_or(Error::WorkerGone)
    }

    /// The statistics, once the stream has ended.
    pub fn stats(&self) -> Option<&GenerationStats> {
        self.stats.as_ref()
    }

    fn handle(&mut self, event: Event) -> Option<Result<Piece>> {
        match event {
            Event::Piece(p) => Some(Ok(p)),
            Event::Done(stats) => {
                self.stats = Some(*stats);
                self.ended = true;
                None
            }
            Event::Failed(e) => {
                self.ended = true;
                Some(Err(e))
            }
        }
    }

    /// The same stream as a `futures_core::Stream` (feature `async`), for async runtimes: it
    /// never blocks, the worker wakes the task when a piece is ready.
    #[cfg(feature = "async")]
    pub fn into_async(self) -> AsyncTokenStream {
        AsyncTokenStream { inner: self }
    }
}

impl Iterator for TokenStream {
    type Item = Result<Piece>;

    fn next(&mut self) -> Option<Result<Piece>> {
        if self.ended {
            return None;
        }
        match self.queue.pop_blocking() {
            Some(event) => self.handle(event),
            None => {
                self.ended = true;
                Some(Err(Error::WorkerGone))
            }
        }
    }
}

impl Drop for TokenStream {
    fn drop(&mut self) {
        if !self.ended {
            self.cancel();
        }
    }
}

/// [`TokenStream`] as a `futures_core::Stream` (feature `async`).
#[cfg(feature = "async")]
#[derive(Debug)]
pub struct AsyncTokenStream {
    inner: TokenStream,
}

#[cfg(feature = "async")]
impl AsyncTokenStream {
    /// See [`TokenStream::cancel`].
    pub fn cancel(&self) {
        self.inner.cancel();
    }

    /// See [`TokenStream::stats`].
    pub fn stats(&self) -> Option<&GenerationStats> {
        self.inner.stats()
    }
}

#[cfg(feature = "async")]
impl futures_core::Stream for AsyncTokenStream {
    type Item = Result<Piece>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Piece>>> {
        use std::task::Poll;
        let inner = &mut self.inner;
        if inner.ended {
            return Poll::Ready(None);
        }
        let event = {
            let Ok(mut s) = inner.queue.state.lock() else {
                inner.ended = true;
                return Poll::Ready(Some(Err(Error::WorkerGone)));
            };
            match s.events.pop_front() {
                Some(e) => e,
                None => {
                    s.waker = Some(cx.waker().clone());
                    return Poll::Pending;
                }
            }
        };
        Poll::Ready(inner.handle(event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}

    #[test]
    fn handles_cross_threads() {
        assert_send_sync::<Model>();
        assert_send::<Session>();
        assert_send::<TokenStream>();
        assert_send_sync::<CancelHandle>();
    }

    #[test]
    fn sampling_values_are_range_checked() {
        let bad = [
            Sampling {
                temperature: -1.0,
                ..Sampling::default()
            },
            Sampling {
                top_p: 2.0,
                ..Sampling::default()
            },
            Sampling {
                min_p: f32::NAN,
                ..Sampling::default()
            },
            Sampling {
                repetition_penalty: 0.0,
                ..Sampling::default()
            },
        ];
        for s in bad {
            assert!(s.params().is_err(), "{s:?}");
        }
        assert!(Sampling::default().params().is_ok());
    }
}
