//! The generation-model pipeline (see the crate docs for the flow).

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use mlxcel_arch::config::sanitize_config_json;
use mlxcel_arch::detection::{detect_kind, get_model_type};
use mlxcel_arch::nn::lora::{AdapterMix, AdapterSet, RuntimeAdapters};
use mlxcel_arch::{
    load_config_backed, load_mistral3, load_nonstandard, load_vlm, model_load_policy, BuildOptions,
    DirectoryRoute, GenerationModel, LoadedModel, ModelKind, ModelType,
};
use mlxcel_core::{Device, Dtype, Materialization, RuntimePolicy, WeightMap};
use mlxcel_quant::QuantConfig;
use serde_json::Value;

use crate::chat::ChatTemplate;
use crate::tokenizer::{load_tokenizer, Tokenizer};
use crate::{LoadError, Result};

/// Choices a caller may make; the defaults suit most uses.
///
/// The per-field overrides (`materialization`, `stream`, `warm_up`, `fuse_projections`) win
/// over the corresponding fields of the runtime policy.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Compute dtype of float weights; default: [`compute_dtype`].
    pub dtype: Option<Dtype>,
    /// Default: the policy's (`MLXCEL_WEIGHT_MATERIALIZATION`: eager unless `lazy`).
    pub materialization: Option<Materialization>,
    /// Skip the tokenizer (logits-only use).
    pub skip_tokenizer: bool,
    /// Expert streaming switches; default: the policy's (`MLXCEL_EXPERT_*`).
    pub stream: Option<mlxcel_stream::StreamConfig>,
    /// Run one throwaway decode step at the end of loading so GPU kernels (MLX's JIT and
    /// mlxcel's custom kernels) are compiled before the first request; its time counts as
    /// loading. Default: the policy's (`MLXCEL_WARM_UP`, `0` or `1`), else on when MLX's
    /// default device is a GPU.
    pub warm_up: Option<bool>,
    /// Fuse q/k/v and gate/up projections into one layer each at load (when stored alike).
    /// Default: the policy's (`MLXCEL_FUSE_PROJECTIONS`, `0` or `1`), else on when MLX's
    /// default device is a GPU, where each array and kernel launch of a decode step costs host
    /// time and decode is bound by it. On the CPU the layers stay as stored, mapped from the
    /// file without a copy.
    pub fuse_projections: Option<bool>,
    /// The runtime switches (see [`RuntimePolicy`]). `None` reads them from the `MLXCEL_*`
    /// environment variables ([`RuntimePolicy::from_env`]), parsed once here (an invalid
    /// variable is a load error naming it); `Some` is used as given instead of the environment
    /// (the per-field overrides above still apply). [`load_model`] installs it
    /// (with the overrides above applied) as the process-wide policy before building the model
    /// ([`mlxcel_core::policy::install`]), so the last load's policy is the one layers read.
    pub policy: Option<RuntimePolicy>,
    /// A weight-surgery YAML file (see [`crate::surgery`]): edits applied in order to the
    /// sanitised tensors before the model is built, after any [`LoadOptions::adapter`].
    /// Default: the policy's (`MLXCEL_SURGERY`).
    pub surgery: Option<PathBuf>,
    /// A LoRA adapter folder (mlx-lm or PEFT, see [`crate::adapter`]) fused into the dense
    /// base weights before the model is built. On a quantized base it is kept unfused instead
    /// (a runtime adapter named [`LoadOptions::DEFAULT_ADAPTER`], active from the start) unless
    /// [`LoadOptions::lora_fuse`] asks for fusing; the load report says which happened.
    pub adapter: Option<PathBuf>,
    /// Fuse [`LoadOptions::adapter`] into a quantized base as well: each adapted layer is
    /// dequantized, the delta added, and requantized with the layer's own mode, bits and group
    /// size (lossy: the delta is rounded to the quantization grid).
    pub lora_fuse: bool,
    /// LoRA adapter folders kept unfused, registered by name (see [`mlxcel_arch::nn::lora`]):
    /// each adapted linear layer adds `scale·(x·Aᵀ)·Bᵀ` of the active adapters over its
    /// unchanged (possibly quantized) base. None is active until selected
    /// ([`Loaded::select_adapters`]); switching costs no reload.
    pub runtime_adapters: Vec<(String, PathBuf)>,
    /// Build only this process's part of a model spread over several processes (tensor or
    /// pipeline parallelism over an MLX distributed group, see [`mlxcel_arch::parallel`]);
    /// each rank reads only its part of the checkpoint. `None`: the whole model.
    pub parallelism: Option<mlxcel_arch::parallel::Parallelism>,
    /// Benchmarks only: the checkpoint's tensors are random numbers made on the device from
    /// this seed, never read from its files ([`mlxcel_core::WeightMap::with_random_data`]):
    /// shapes too large for the disk, as header-only sparse files.
    pub random_weights: Option<u64>,
    /// Build the multi-token-prediction layers the checkpoint carries (DeepSeek-V3, GLM-4.5),
    /// for self-speculative decoding (`mlxcel generate --speculative mtp`,
    /// [`crate::generate_text_mtp`]); a checkpoint without them is a load error naming the
    /// missing tensor. Off (the default): they are never read.
    pub mtp: bool,
}

impl LoadOptions {
    /// The name [`LoadOptions::adapter`] is registered under when it stays unfused.
    pub const DEFAULT_ADAPTER: &'static str = "adapter";

    /// The runtime policy a load uses: [`LoadOptions::policy`] (else the environment's) with
    /// this struct's per-field overrides applied.
    pub fn runtime_policy(&self) -> Result<RuntimePolicy> {
        let mut policy = match &self.policy {
            Some(p) => p.clone(),
            None => RuntimePolicy::from_env()?,
        };
        if let Some(m) = self.materialization {
            policy.weight_materialization = m;
        }
        if let Some(stream) = &self.stream {
            policy.expert_stream = stream.mode;
            policy.expert_arena_bytes = stream.arena_bytes;
            policy.expert_cache_policy = stream.policy;
            policy.expert_io = stream.io;
            policy.expert_prefetch = stream.prefetch;
            policy.expert_in_place = stream.in_place;
        }
        if let Some(w) = self.warm_up {
            policy.warm_up = Some(w);
        }
        if let Some(f) = self.fuse_projections {
            policy.fuse_projections = Some(f);
        }
        Ok(policy)
    }
}

/// Decode steps on scratch caches, evaluated and dropped: the first use of every weight and of
/// the kernels a reply's decode uses (MLX's GPU backends JIT-compile some on first use, and
/// that took ~0.1 s out of a first request's decode on an H100):
/// - a step on empty caches;
/// - a step on caches that were cloned (a clone shares its buffers, so the step copies the rows
///   the caches hold into new ones, as the first step after a prompt does);
/// - the greedy pick and the NaN check generation runs on each step's logits
///   ([`crate::textgen::device_greedy_pick`]).
fn warm_up(model: &GenerationModel) -> mlxcel_arch::Result<()> {
    use mlxcel_arch::LanguageModel;
    let mut caches = model.make_caches();
    let token = mlxcel_core::Array::from_slice(&[0i32], &[1, 1])?;
    model.forward_last(&token, &mut caches)?.eval()?;
    let shared = caches.clone();
    let logits = model.forward_last(&token, &mut caches)?;
    let (pick, nan) = crate::textgen::device_greedy_pick(&logits)?;
    mlxcel_core::ops::eval_all(&[pick, nan])?;
    drop(shared);
    Ok(())
}

/// Where [`load_model`]'s time went, in seconds (they add up to [`Loaded::load_seconds`] but for
/// the microseconds between the phases).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadPhases {
    /// Reading `config.json`, mapping and indexing the checkpoint, adapters, the streaming plan.
    pub prepare: f64,
    /// Building the model: each tensor handed to MLX (a copy into MLX's memory, except on the
    /// CPU, where arrays borrow the mapped file), load-time fusion and edits, and evaluating
    /// the weights (eager materialization).
    pub build: f64,
    /// The warm-up decode step (on by default on a GPU: first use of every weight and kernel).
    pub warm_up: f64,
    /// Tokenizer, chat template and image processor.
    pub tokenizer: f64,
}

/// A loaded generation model with what was learned on the way (from [`load_model`]).
#[derive(Debug)]
pub struct Loaded {
    /// The generation model (the loaded model of kind `Generation`).
    pub model: GenerationModel,
    /// The model's tokenizer; `None` with [`LoadOptions::skip_tokenizer`].
    pub tokenizer: Option<Tokenizer>,
    /// The registered type `config.json`'s `model_type` mapped to.
    pub model_type: ModelType,
    /// The sanitised `config.json`, as a surgery `prune` left it (head counts, sizes, layers).
    pub config: Value,
    /// The model folder (resolved from the path given to [`load_model`]).
    pub folder: PathBuf,
    /// The compute dtype float weights were cast to.
    pub dtype: Dtype,
    /// Ids that end generation: `eos_token_id` of `config.json` and `generation_config.json`
    /// (a number or a list) and the tokenizer's `eos_token`.
    pub eos_token_ids: Vec<u32>,
    /// The model's chat template, `None` when it ships none (or the tokenizer was skipped).
    pub chat_template: Option<ChatTemplate>,
    /// Wall time of [`load_model`], warm-up included.
    pub load_seconds: f64,
    /// Where that time went.
    pub load_phases: LoadPhases,
    /// Set when routed experts stream from disk: the arena and its counters.
    pub expert_stream: Option<(
        crate::stream::StreamPlan,
        Rc<RefCell<mlxcel_stream::StreamStats>>,
    )>,
    /// Set when the per-layer-embedding table is read from disk (`ple_storage`): the store
    /// and its counters.
    pub external_ple: Option<crate::ple::PlePlan>,
    /// The checkpoint files the weights are mapped from, with their identity at load.
    pub mapped: mlxcel_core::MappedFiles,
    /// What the load-time weight edits did, one line each: the tensors a text-only load of a
    /// vision-language checkpoint left out (Mistral 3), the runtime adapters, the fused adapter,
    /// then each surgery rule. Empty without any of these.
    pub surgery_applied: Vec<String>,
    /// The runtime (unfused) adapters, when any were loaded (see
    /// [`LoadOptions::runtime_adapters`]).
    pub adapters: Option<Rc<AdapterSet>>,
    /// The image processor and prompt expansion of a vision-language model loaded with its
    /// vision tower (and a tokenizer); `None` otherwise.
    pub vision: Option<crate::vision::VisionProcessor>,
}

impl Loaded {
    /// A new session on the model that checks, before each request, that the mapped
    /// checkpoint files are unchanged (see [`mlxcel_core::MappedFiles`]).
    pub fn session(&self) -> mlxcel_arch::generate::Session<'_> {
        mlxcel_arch::generate::Session::new(&self.model)
            .with_mapped_files(self.mapped.clone())
            .with_model_path(self.folder.display().to_string())
    }

    /// The vision processor, or the seed's error for a model without a vision tower.
    fn vision_processor(&self) -> Result<&crate::vision::VisionProcessor> {
        self.vision.as_ref().ok_or_else(|| {
            LoadError::from(mlxcel_arch::vision::no_vision_tower(
                &self.folder.display().to_string(),
            ))
        })
    }

    /// An image's pixel values as the model's HF processor computes them (resize, rescale,
    /// normalise from `preprocessor_config.json`), with its content hash, for
    /// [`crate::GenerateRequest::images`]. A model without a vision tower refuses images with
    /// `model <path> was loaded without a vision tower (text-only checkpoint)`.
    pub fn prepare_image(
        &self,
        image: &crate::image::RgbImage,
    ) -> Result<mlxcel_arch::vision::ImageInput> {
        self.vision_processor()?.prepare(image)
    }

    /// An image prepared for a prompt ([`crate::vision::PreparedImage`]): its model inputs
    /// (one per tile for families that split images) and its own placeholder expansion, for
    /// [`Loaded::expand_prompt_text_for`] / [`Loaded::expand_image_tokens_for`]. Families whose
    /// image-token count depends on the image need this path.
    pub fn prepare_for_prompt(
        &self,
        image: &crate::image::RgbImage,
    ) -> Result<crate::vision::PreparedImage> {
        self.vision_processor()?.prepare_for_prompt(image)
    }

    /// A rendered prompt with its `k`-th image placeholder replaced by `images[k]`'s expansion.
    pub fn expand_prompt_text_for(
        &self,
        text: &str,
        images: &[crate::vision::PreparedImage],
    ) -> Result<String> {
        if images.is_empty() {
            return Ok(text.to_string());
        }
        self.vision_processor()?.expand_text_for(text, images)
    }

    /// Token ids with their `k`-th image placeholder replaced by `images[k]`'s expansion ids.
    pub fn expand_image_tokens_for(
        &self,
        ids: &[u32],
        images: &[crate::vision::PreparedImage],
    ) -> Result<Vec<u32>> {
        if images.is_empty() {
            return Ok(ids.to_vec());
        }
        self.vision_processor()?.expand_ids_for(ids, images)
    }

    /// [`Loaded::prepare_image`] of an encoded PNG, JPEG or WebP image.
    pub fn prepare_image_bytes(&self, bytes: &[u8]) -> Result<mlxcel_arch::vision::ImageInput> {
        let processor = self.vision_processor()?;
        processor.prepare(&crate::image::decode_image(bytes)?)
    }

    /// A user message's text with `images` image placeholders in front (where a chat template
    /// puts image items before the text), to render with the chat template and then expand
    /// with [`Loaded::expand_prompt_text_for`].
    pub fn user_content_with_images(&self, text: &str, images: usize) -> Result<String> {
        if images == 0 {
            return Ok(text.to_string());
        }
        Ok(format!(
            "{}{text}",
            self.vision_processor()?.content_placeholder.repeat(images)
        ))
    }

    /// Logits `[len, vocab]` at every position of one pass over `prompt` (expanded, see
    /// [`Loaded::expand_image_tokens_for`]) with its `images`, from fresh caches: what
    /// `mlxcel logits --image` writes. Without images, the text forward pass.
    pub fn multimodal_logits(
        &self,
        prompt: &[u32],
        images: &[mlxcel_arch::vision::ImageInput],
    ) -> Result<mlxcel_core::Array> {
        use mlxcel_arch::vision::{forward_multimodal, FeatureCache, MultimodalPrompt};
        use mlxcel_arch::LanguageModel;
        let model_err = |source| LoadError::Model {
            folder: self.folder.clone(),
            source,
        };
        let mut caches = self.model.make_caches();
        let logits = if images.is_empty() {
            let ids: Vec<i32> = prompt.iter().map(|t| *t as i32).collect();
            let tokens = mlxcel_core::Array::from_slice(&ids, &[1, ids.len() as i32])?;
            self.model
                .forward(&tokens, &mut caches)
                .map_err(model_err)?
        } else {
            let vision = self.model.vision().ok_or_else(|| {
                LoadError::from(mlxcel_arch::vision::no_vision_tower(
                    &self.folder.display().to_string(),
                ))
            })?;
            let mm = MultimodalPrompt::new(vision, prompt, images).map_err(model_err)?;
            forward_multimodal(
                vision,
                &mm,
                0..prompt.len(),
                &mut FeatureCache::default(),
                &mut caches,
                false,
            )
            .map_err(model_err)?
        };
        let vocab = self.model.vocab_size() as i32;
        Ok(logits.reshape(&[-1, vocab])?)
    }

    /// The names of the runtime adapters (empty when none were loaded).
    pub fn adapter_names(&self) -> Vec<String> {
        self.adapters
            .as_ref()
            .map(|a| a.names().to_vec())
            .unwrap_or_default()
    }

    /// Makes `mix` the adapters the model runs with from the next forward pass (no reload).
    /// The empty mix is the base model; a name that was not loaded is an error.
    pub fn select_adapters(&self, mix: &AdapterMix) -> Result<()> {
        match &self.adapters {
            Some(set) => set.select(mix).map_err(|source| LoadError::Model {
                folder: self.folder.clone(),
                source,
            }),
            None if mix.entries.is_empty() => Ok(()),
            None => Err(LoadError::Model {
                folder: self.folder.clone(),
                source: mlxcel_arch::ModelError::Runtime(format!(
                    "no runtime adapters are loaded, cannot select `{mix}`"
                )),
            }),
        }
    }

    /// The adapter mix the model runs with now (the base model when none is loaded).
    pub fn active_adapters(&self) -> AdapterMix {
        self.adapters
            .as_ref()
            .map(|a| a.current())
            .unwrap_or_default()
    }

    /// An error naming a mapped checkpoint file changed since load.
    pub fn check_unchanged(&self) -> Result<()> {
        Ok(self.mapped.check_unchanged()?)
    }
}

fn ids_of(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// The end-of-sequence ids a model declares (see [`Loaded::eos_token_ids`]).
pub fn eos_token_ids(folder: &Path, config: &Value, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
    let mut ids = ids_of(config.get("eos_token_id"));
    if let Ok(text) = std::fs::read_to_string(folder.join("generation_config.json")) {
        if let Ok(gen) = serde_json::from_str::<Value>(&text) {
            ids.extend(ids_of(gen.get("eos_token_id")));
        }
    }
    if let (Some(t), Ok(text)) = (
        tokenizer,
        std::fs::read_to_string(folder.join("tokenizer_config.json")),
    ) {
        if let Ok(tc) = serde_json::from_str::<Value>(&text) {
            let eos = match tc.get("eos_token") {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Object(o)) => {
                    o.get("content").and_then(Value::as_str).map(str::to_string)
                }
                _ => None,
            };
            ids.extend(eos.and_then(|e| t.token_to_id(&e)));
        }
    }
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// A model folder from a folder or a file inside it; it must hold `config.json`.
pub fn resolve_model_dir(path: impl AsRef<Path>) -> Result<PathBuf> {
    let path = path.as_ref();
    let folder = if path.is_file() {
        path.parent().unwrap_or(Path::new("."))
    } else {
        path
    };
    match std::fs::metadata(folder) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(LoadError::file(path, "not a folder")),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err(LoadError::file(folder, "permission denied"))
        }
        Err(_) => return Err(LoadError::file(path, "no such model folder")),
    }
    // Listing the folder tells a folder we may not read from one without config.json.
    if let Err(e) = std::fs::read_dir(folder) {
        return Err(LoadError::file(
            folder,
            if e.kind() == std::io::ErrorKind::PermissionDenied {
                "permission denied (cannot list the model folder)".to_string()
            } else {
                e.to_string()
            },
        ));
    }
    let config = folder.join("config.json");
    if let Err(e) = std::fs::metadata(&config) {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            return Err(LoadError::file(&config, "permission denied"));
        }
    }
    if !config.is_file() {
        return Err(LoadError::file(
            folder,
            "not a model folder: no config.json",
        ));
    }
    Ok(folder.to_path_buf())
}

/// Reads and sanitises `config.json`.
pub fn read_config(folder: &Path) -> Result<Value> {
    let path = mlxcel_core::weights::confined_path(folder, "config.json")?;
    let text = std::fs::read_to_string(&path).map_err(|e| LoadError::file(&path, e.to_string()))?;
    let raw: Value = serde_json::from_str(&text)
        .map_err(|e| LoadError::file(&path, format!("invalid JSON: {e}")))?;
    if !raw.is_object() {
        return Err(LoadError::file(&path, "expected a JSON object"));
    }
    Ok(sanitize_config_json(raw))
}

/// The compute dtype for float weights: float32 on the CPU backend (MLX's Linux CPU kernels are
/// scalar, emulate half precision and accumulate quantized matmuls in the activation dtype);
/// on a GPU the checkpoint's own dtype.
pub fn compute_dtype(config: &Value) -> Result<Dtype> {
    if mlxcel_core::default_device()? == Device::Cpu {
        return Ok(Dtype::Float32);
    }
    let named = config.get("torch_dtype").and_then(Value::as_str);
    Ok(named
        .and_then(Dtype::from_name)
        .filter(|d| d.is_float())
        .unwrap_or(Dtype::Bfloat16))
}

fn has_vision_weights(weights: &WeightMap) -> bool {
    weights.names().any(|n| {
        n.starts_with("vision_tower.")
            || n.starts_with("model.visual.")
            || n.starts_with("visual.")
            || n.contains(".vision_tower.")
            // Idefics3 / SmolVLM's tower and connector (transformers and mlx-vlm layouts)
            || n.starts_with("model.vision_model.")
            || n.starts_with("vision_model.")
    })
}

/// Loads a generation model and its tokenizer from a folder (or a file in it).
///
/// Installs the runtime policy first ([`LoadOptions::policy`], else the `MLXCEL_*` environment
/// variables), then reads and sanitises `config.json`, maps `model_type` to a registered
/// [`ModelType`], builds the model from the safetensors, and loads the tokenizer, chat template
/// and end-of-sequence ids. Errors name the file, config key or tensor at fault: a missing or
/// invalid file is [`LoadError::File`], a checkpoint the architecture cannot use
/// [`LoadError::Model`], an unsupported kind or type [`LoadError::Unsupported`].
///
/// ```no_run
/// use mlxcel_loading::{generate_text, load_model, GenerateRequest, LoadOptions, Message};
///
/// # fn main() -> mlxcel_loading::Result<()> {
/// let loaded = load_model("models/Qwen3-0.6B", &LoadOptions::default())?;
/// let tokenizer = loaded.tokenizer.as_ref().expect("not skipped");
/// let template = loaded.chat_template.as_ref().expect("the model ships one");
///
/// // The rendered template holds the special tokens: encode without adding more.
/// let text = template.render(&[Message::user("Hello!")], true)?;
/// let prompt = tokenizer.encode(&text, false)?;
///
/// let mut session = loaded.session();
/// let request = GenerateRequest::for_model(&loaded);
/// let (_ids, stats) = generate_text(
///     &mut session,
///     Some(tokenizer),
///     &prompt,
///     &request,
///     |piece| print!("{piece}"),
///     |_id| {},
/// )?;
/// println!("\n{:.1} tokens/s ({:?})", stats.decode_tokens_per_second(), stats.finish);
/// # Ok(())
/// # }
/// ```
pub fn load_model(path: impl AsRef<Path>, options: &LoadOptions) -> Result<Loaded> {
    let started = std::time::Instant::now();
    // First, so that every layer and kernel (weight mapping included) sees it.
    let runtime = options.runtime_policy()?;
    mlxcel_core::policy::install(&runtime)?;
    let folder = resolve_model_dir(path)?;
    let config = read_config(&folder)?;
    let model_err = |source| LoadError::Model {
        folder: folder.clone(),
        source,
    };
    match detect_kind(&config, folder.join("modules.json").is_file()) {
        ModelKind::Generation => {}
        kind => {
            let model_type = config
                .get("model_type")
                .and_then(Value::as_str)
                .unwrap_or("?");
            return Err(LoadError::Unsupported(if kind == ModelKind::Embedding {
                format!(
                    "{}: model_type `{model_type}` is an embedding checkpoint: load it with `load_embedding_model` (`mlxcel_models::Embedder`, `mlxcel embed`)",
                    folder.display()
                )
            } else {
                format!(
                    "{}: model_type `{model_type}` is a cross-encoder (reranker) checkpoint: load it with `load_reranker_model` (`mlxcel_models::Reranker`, `mlxcel rerank`)",
                    folder.display()
                )
            }));
        }
    }
    // Read (and check) the edit files before touching the checkpoint.
    let surgery = options
        .surgery
        .as_ref()
        .or(runtime.surgery.as_ref())
        .map(crate::surgery::Surgery::load)
        .transpose()?;
    let adapter = options
        .adapter
        .as_ref()
        .map(crate::adapter::Adapter::load)
        .transpose()?;
    let mut runtime_adapters = options
        .runtime_adapters
        .iter()
        .map(|(name, dir)| Ok((name.clone(), crate::adapter::Adapter::load(dir)?)))
        .collect::<Result<Vec<_>>>()?;
    let mut weights = WeightMap::open(&folder)?;
    if let Some(seed) = options.random_weights {
        weights = weights.with_random_data(seed);
    }
    let mapped = weights.mapped_files();
    let model_type = get_model_type(&config, has_vision_weights(&weights)).map_err(model_err)?;
    let policy = model_load_policy(model_type);
    if !matches!(
        policy.directory_route,
        DirectoryRoute::ConfigBacked
            | DirectoryRoute::Nonstandard
            | DirectoryRoute::Mistral3Dynamic
            | DirectoryRoute::Vlm
    ) {
        return Err(LoadError::Unsupported(format!(
            "{}: {} loads through the {:?} route, which this build does not have yet",
            folder.display(),
            model_type.name(),
            policy.directory_route
        )));
    }
    // Vendor block-FP8 checkpoints (`quant_method: "fp8"`) are requantized to mxfp8 here.
    let quant = match mlxcel_quant::fp8::block_fp8_config(&config)? {
        Some(block) => Some(mlxcel_quant::fp8::requantize_checkpoint(
            &mut weights,
            block,
        )?),
        None => QuantConfig::from_config(&config)?,
    };
    for a in adapter
        .iter()
        .chain(runtime_adapters.iter().map(|(_, a)| a))
    {
        mlxcel_arch::adapter_support(model_type).map_err(|reason| {
            LoadError::Unsupported(format!(
                "{}: adapter {} cannot be applied to {}: {reason}",
                folder.display(),
                a.dir().display(),
                model_type.name()
            ))
        })?;
    }
    let dtype = match options.dtype {
        Some(d) => d,
        None => compute_dtype(&config)?,
    };
    // On a quantized base the adapter stays unfused unless fusing was asked for.
    let mut report = Vec::new();
    // A Mistral 3 checkpoint with its vision tower builds it (lazily) unless text-only.
    let left_out = if policy.directory_route == DirectoryRoute::Mistral3Dynamic
        && mlxcel_arch::detection::is_text_only(&config, has_vision_weights(&weights))
    {
        Some((
            "vision-tower and projector",
            mlxcel_arch::models::mistral3::unused_tensors(&weights),
        ))
    } else if model_type == ModelType::Gemma3n {
        Some((
            "vision/audio-tower and embedder",
            mlxcel_arch::models::gemma3n::unused_tensors(&weights),
        ))
    } else {
        None
    };
    if let Some((what, unused)) = left_out.filter(|(_, u)| !u.is_empty()) {
        report.push(format!(
            "text-only load: {} {what} tensors left out ({} .. {})",
            unused.len(),
            unused[0],
            unused[unused.len() - 1]
        ));
    } else if model_type == ModelType::Gemma3n && config.get("vision_config").is_some() {
        // A multimodal config whose checkpoint holds no tower tensors: text only all the same.
        report.push(
            "text-only load: the checkpoint has no vision or audio tower tensors; the text decoder alone is built".into(),
        );
    }
    if policy.directory_route == DirectoryRoute::Vlm
        && mlxcel_arch::detection::is_text_only(&config, has_vision_weights(&weights))
    {
        let unused = mlxcel_arch::vision::unused_vision_tensors(model_type, &weights);
        if !unused.is_empty() {
            report.push(format!(
                "text-only load: {} vision-tower and projector tensors left out ({} .. {})",
                unused.len(),
                unused[0],
                unused[unused.len() - 1]
            ));
        }
    }
    let mut initial_mix = AdapterMix::none();
    let adapter = match adapter {
        Some(a) if quant.is_some() && !options.lora_fuse => {
            report.push(format!(
                "{}: kept unfused as runtime adapter `{}` over the quantized base, on {} linear layers (--lora-fuse / `LoadOptions::lora_fuse` fuses it by dequantize-add-requantize instead)",
                a.describe(),
                LoadOptions::DEFAULT_ADAPTER,
                a.modules()
            ));
            initial_mix = AdapterMix::single(LoadOptions::DEFAULT_ADAPTER);
            runtime_adapters.insert(0, (LoadOptions::DEFAULT_ADAPTER.to_string(), a));
            None
        }
        other => other,
    };
    // The unfused `adapter`, when it is one, is first and already reported.
    let lora = runtime_adapters_for(&runtime_adapters, dtype, report.len(), &mut report)?;
    if let Some(r) = &lora {
        r.set.select(&initial_mix).map_err(model_err)?;
    }
    let materialization = runtime.weight_materialization;
    let stream_config = mlxcel_stream::StreamConfig::from_policy(&runtime);
    let plan = crate::stream::plan(
        &folder,
        &config,
        &stream_config,
        crate::memory::available_memory()?,
    )?;
    let applied = Rc::new(RefCell::new(Vec::new()));
    // A structural prune changes shapes and renumbers layers, which unfused adapters (attached
    // by name and shape) and streamed experts (planned from the original layout) cannot follow.
    if let Some(s) = surgery.as_ref().filter(|s| s.changes_structure()) {
        let other = if lora.is_some() {
            Some("unfused (runtime) adapters")
        } else if plan.is_some() {
            Some("expert streaming")
        } else {
            None
        };
        if let Some(other) = other {
            return Err(LoadError::Unsupported(format!(
                "{}: surgery {} prunes structure, which cannot be combined with {other}",
                folder.display(),
                s.path().display()
            )));
        }
    }
    // The config as the surgery left it (a prune updates head counts, sizes, layers).
    let edited_config: Rc<RefCell<Option<Value>>> = Rc::new(RefCell::new(None));
    let transform = if surgery.is_some() || adapter.is_some() {
        let applied = applied.clone();
        let edited_config = edited_config.clone();
        let quant = quant.clone();
        let requantize = options.lora_fuse;
        Some(mlxcel_arch::WeightTransform(Rc::new(
            move |w: &mut WeightMap, config: &mut Value| -> mlxcel_arch::Result<()> {
                let mut log = Vec::new();
                if let Some(a) = &adapter {
                    log.push(a.fuse(w, quant.as_ref(), requantize)?);
                }
                if let Some(s) = &surgery {
                    log.extend(s.apply(w, config, quant.as_ref())?);
                    *edited_config.borrow_mut() = Some(config.clone());
                }
                *applied.borrow_mut() = log;
                Ok(())
            },
        )))
    } else {
        None
    };
    let stats = Rc::new(RefCell::new(mlxcel_stream::StreamStats::default()));
    let external_ple = crate::ple::open(&folder, &config, &runtime)?;
    let gpu = mlxcel_core::default_device()? == Device::Gpu;
    let build = BuildOptions {
        prefix: String::new(),
        quant,
        dtype,
        materialization,
        stream: plan.as_ref().map(|p| p.setup(stats.clone())),
        external_ple: external_ple.as_ref().map(|p| p.store.clone()),
        fuse_projections: runtime.fuse_projections.unwrap_or(gpu),
        transform,
        runtime_adapters: lora.clone(),
        parallelism: options.parallelism.clone(),
        mtp: options.mtp,
    };
    let building = std::time::Instant::now();
    let model = match policy.directory_route {
        DirectoryRoute::Nonstandard => load_nonstandard(model_type, &config, weights, &build),
        DirectoryRoute::Mistral3Dynamic => load_mistral3(&config, weights, &build),
        DirectoryRoute::Vlm => load_vlm(model_type, &config, weights, &build),
        _ => load_config_backed(model_type, &config, weights, &build),
    }
    .and_then(LoadedModel::into_generation)
    .map_err(model_err)?;
    let warming = std::time::Instant::now();
    let warm_up_seconds = if runtime.warm_up.unwrap_or(gpu) {
        warm_up(&model).map_err(model_err)?;
        warming.elapsed().as_secs_f64()
    } else {
        0.0
    };
    let tokenizing = std::time::Instant::now();
    let (tokenizer, chat_template) = if options.skip_tokenizer {
        (None, None)
    } else {
        (Some(load_tokenizer(&folder)?), ChatTemplate::load(&folder)?)
    };
    let eos_token_ids = eos_token_ids(&folder, &config, tokenizer.as_ref());
    let vision = match (&tokenizer, mlxcel_arch::LanguageModel::vision(&model)) {
        (Some(t), Some(_)) => {
            crate::vision::VisionProcessor::load(model_type, &folder, &config, t)?
        }
        _ => None,
    };
    Ok(Loaded {
        model,
        tokenizer,
        model_type,
        config: edited_config.take().unwrap_or(config),
        folder,
        dtype,
        eos_token_ids,
        chat_template,
        load_seconds: started.elapsed().as_secs_f64(),
        load_phases: LoadPhases {
            prepare: (building - started).as_secs_f64(),
            build: (warming - building).as_secs_f64(),
            warm_up: warm_up_seconds,
            tokenizer: tokenizing.elapsed().as_secs_f64(),
        },
        expert_stream: plan.map(|p| (p, stats)),
        external_ple,
        mapped,
        surgery_applied: report.into_iter().chain(applied.take()).collect(),
        adapters: lora.map(|r| r.set),
        vision,
    })
}

/// The runtime adapters `adapters` as the model builder takes them (each module's pairs in the
/// adapters' order), with one report line each past the first `already_reported`; `None` when
/// there are none.
fn runtime_adapters_for(
    adapters: &[(String, crate::adapter::Adapter)],
    dtype: Dtype,
    already_reported: usize,
    report: &mut Vec<String>,
) -> Result<Option<RuntimeAdapters>> {
    if adapters.is_empty() {
        return Ok(None);
    }
    let set = AdapterSet::new(
        adapters
            .iter()
            .map(|(name, a)| (name.clone(), a.is_dora()))
            .collect(),
    )
    .map_err(|e| LoadError::Unsupported(e.to_string()))?;
    let mut modules = std::collections::BTreeMap::new();
    for (i, (name, adapter)) in adapters.iter().enumerate() {
        for (module, pair) in adapter.runtime_pairs(dtype)? {
            modules
                .entry(module)
                .or_insert_with(|| vec![None; adapters.len()])[i] = Some(pair);
        }
        if i >= already_reported {
            report.push(format!(
                "runtime adapter `{name}`: {}, on {} linear layers",
                adapter.describe(),
                adapter.modules()
            ));
        }
    }
    Ok(Some(RuntimeAdapters { set, modules }))
}
