//! The embedding pipeline: an encoder checkpoint with its sentence-transformers modules
//! (`modules.json`: Transformer → Pooling → Dense… → Normalize), batched and padded inference,
//! Matryoshka truncation.
//!
//! Without a `modules.json` the pipeline is **mean pooling over the real tokens, then L2
//! normalisation** (what most embedding checkpoints use).

use std::path::{Path, PathBuf};

use mlxcel_arch::cache::LayerCache;
use mlxcel_arch::detection::{detect_kind, get_model_type};
use mlxcel_arch::embedding::{normalize, truncate_dimensions, DenseActivation, DenseLayer};
use mlxcel_arch::model::LayerKind;
use mlxcel_arch::weights::ModelWeights;
use mlxcel_arch::{
    load_config_backed, BuildOptions, EmbeddingModel, EmbeddingModelEnum, GenerationModel,
    LanguageModel, LoadedModel, ModelKind, ModelType, Pooling,
};
use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::QuantConfig;
use serde_json::Value;

use crate::pipeline::{compute_dtype, read_config, resolve_model_dir, LoadOptions};
use crate::tokenizer::{load_tokenizer, Tokenizer};
use crate::{LoadError, Result};

/// What to do with a text longer than the model's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overflow {
    /// Keep the first tokens (the tokenizer's truncation keeps its special tokens) and print a
    /// warning to stderr.
    #[default]
    TruncateWithWarning,
    /// Truncate silently.
    Truncate,
    /// Refuse the request with an error naming the text.
    Refuse,
}

/// Per-request choices for [`EmbeddingLoaded::embed`].
#[derive(Debug, Clone)]
pub struct EmbedOptions {
    /// Matryoshka truncation: keep the first `dimensions` values (re-normalised when the
    /// pipeline normalises). `None` keeps them all.
    pub dimensions: Option<usize>,
    /// Texts longer than the limit ([`EmbeddingLoaded::max_tokens`]).
    pub overflow: Overflow,
    /// Texts per forward pass (texts are sorted by length first, so padding stays small).
    pub batch_size: usize,
    /// A prompt of `config_sentence_transformers.json` by name (`"query"`, ...), prepended to
    /// every text; `None` uses its `default_prompt_name` (if any).
    pub prompt_name: Option<String>,
}

impl Default for EmbedOptions {
    fn default() -> Self {
        EmbedOptions {
            dimensions: None,
            overflow: Overflow::default(),
            batch_size: 32,
            prompt_name: None,
        }
    }
}

/// The modules after the encoder, from the sentence-transformers files (or the default).
#[derive(Debug)]
pub struct EmbeddingHead {
    /// Pooling modes, concatenated in sentence-transformers' order when several are on.
    pub pooling: Vec<Pooling>,
    /// `Dense` modules, in order.
    pub dense: Vec<DenseLayer>,
    /// Whether a `Normalize` module ends the pipeline.
    pub normalize: bool,
    /// `sentence_bert_config.json` `max_seq_length`, when given.
    pub max_seq_length: Option<usize>,
    /// `config_sentence_transformers.json` `prompts`.
    pub prompts: Vec<(String, String)>,
    /// `config_sentence_transformers.json` `default_prompt_name`.
    pub default_prompt_name: Option<String>,
    /// Whether `modules.json` was present (else the documented default).
    pub from_modules_json: bool,
}

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::file(path, e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| LoadError::file(path, format!("invalid JSON: {e}")))
}

pub(crate) fn confined(folder: &Path, name: &str) -> Result<PathBuf> {
    Ok(mlxcel_core::weights::confined_path(folder, name)?)
}

fn pooling_modes(path: &Path, cfg: &Value) -> Result<Vec<Pooling>> {
    let flag = |k: &str| cfg.get(k).and_then(Value::as_bool).unwrap_or(false);
    // sentence-transformers' concatenation order.
    let mut modes = Vec::new();
    for (key, mode) in [
        ("pooling_mode_cls_token", Pooling::Cls),
        ("pooling_mode_max_tokens", Pooling::Max),
        ("pooling_mode_mean_tokens", Pooling::Mean),
        ("pooling_mode_mean_sqrt_len_tokens", Pooling::MeanSqrtLen),
        ("pooling_mode_weightedmean_tokens", Pooling::WeightedMean),
        ("pooling_mode_lasttoken", Pooling::LastToken),
    ] {
        if flag(key) {
            modes.push(mode);
        }
    }
    if let Some(name) = cfg.get("pooling_mode").and_then(Value::as_str) {
        let mode = match name {
            "mean" => Pooling::Mean,
            "cls" => Pooling::Cls,
            "max" => Pooling::Max,
            "lasttoken" | "last_token" | "last-token" => Pooling::LastToken,
            "weightedmean" | "weighted_mean" | "weighted-mean" => Pooling::WeightedMean,
            "mean_sqrt_len_tokens" => Pooling::MeanSqrtLen,
            other => {
                return Err(LoadError::file(
                    path,
                    format!("pooling_mode `{other}` is not supported"),
                ))
            }
        };
        if !modes.contains(&mode) {
            modes.push(mode);
        }
    }
    if modes.is_empty() {
        return Err(LoadError::file(path, "no pooling mode is switched on"));
    }
    if cfg.get("include_prompt").and_then(Value::as_bool) == Some(false) {
        return Err(LoadError::file(
            path,
            "include_prompt = false (pooling without the prompt tokens) is not supported",
        ));
    }
    Ok(modes)
}

fn dense_layer(folder: &Path, dtype: Dtype) -> Result<DenseLayer> {
    let cfg_path = folder.join("config.json");
    let cfg = read_json(&cfg_path)?;
    let int = |k: &str| -> Result<i32> {
        cfg.get(k)
            .and_then(Value::as_u64)
            .map(|v| v as i32)
            .ok_or_else(|| LoadError::file(&cfg_path, format!("missing or invalid `{k}`")))
    };
    let (inp, out) = (int("in_features")?, int("out_features")?);
    let bias = cfg.get("bias").and_then(Value::as_bool).unwrap_or(true);
    let activation = match cfg.get("activation_function").and_then(Value::as_str) {
        None => None,
        Some(name) => DenseActivation::from_torch_name(name).map_err(|e| LoadError::Model {
            folder: folder.to_path_buf(),
            source: e,
        })?,
    };
    if !folder.join("model.safetensors").is_file() {
        return Err(LoadError::file(
            folder,
            "Dense module without model.safetensors (pytorch_model.bin is not read)",
        ));
    }
    let map = WeightMap::open(folder)?;
    let model_err = |source| LoadError::Model {
        folder: folder.to_path_buf(),
        source,
    };
    let mut w = ModelWeights::new(map, None, dtype);
    let linear = w.linear("linear", inp, out, bias).map_err(model_err)?;
    let kept = w.finish("Dense").map_err(model_err)?;
    for a in &kept {
        a.eval()?;
    }
    Ok(DenseLayer { linear, activation })
}

impl EmbeddingHead {
    /// Reads the sentence-transformers modules of `folder` (see the module docs for the default
    /// without `modules.json`); Dense weights are loaded in `dtype`.
    pub fn load(folder: &Path, dtype: Dtype) -> Result<EmbeddingHead> {
        let mut head = EmbeddingHead {
            pooling: vec![Pooling::Mean],
            dense: Vec::new(),
            normalize: true,
            max_seq_length: None,
            prompts: Vec::new(),
            default_prompt_name: None,
            from_modules_json: false,
        };
        let sbert = folder.join("sentence_bert_config.json");
        if sbert.is_file() {
            let cfg = read_json(&confined(folder, "sentence_bert_config.json")?)?;
            head.max_seq_length = cfg
                .get("max_seq_length")
                .and_then(Value::as_u64)
                .map(|v| v as usize);
        }
        let st = folder.join("config_sentence_transformers.json");
        if st.is_file() {
            let cfg = read_json(&confined(folder, "config_sentence_transformers.json")?)?;
            if let Some(p) = cfg.get("prompts").and_then(Value::as_object) {
                head.prompts = p
                    .iter()
                    .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                    .collect();
            }
            head.default_prompt_name = cfg
                .get("default_prompt_name")
                .and_then(Value::as_str)
                .map(str::to_string);
        }
        if !folder.join("modules.json").is_file() {
            return Ok(head);
        }
        let modules_path = confined(folder, "modules.json")?;
        let modules = read_json(&modules_path)?;
        let list = modules
            .as_array()
            .ok_or_else(|| LoadError::file(&modules_path, "expected a list of modules"))?;
        head.from_modules_json = true;
        head.normalize = false;
        let mut pooled = false;
        for (i, m) in list.iter().enumerate() {
            let kind = m.get("type").and_then(Value::as_str).ok_or_else(|| {
                LoadError::file(&modules_path, format!("module {i}: missing `type`"))
            })?;
            let sub = m.get("path").and_then(Value::as_str).unwrap_or("");
            let short = kind.rsplit('.').next().unwrap_or(kind);
            match short {
                "Transformer" => {}
                "Pooling" => {
                    let path = confined(folder, &format!("{sub}/config.json"))?;
                    head.pooling = pooling_modes(&path, &read_json(&path)?)?;
                    pooled = true;
                }
                "Dense" => head
                    .dense
                    .push(dense_layer(&confined(folder, sub)?, dtype)?),
                "Normalize" => head.normalize = true,
                other => {
                    return Err(LoadError::file(
                        &modules_path,
                        format!("module {i}: `{other}` is not supported"),
                    ))
                }
            }
        }
        if !pooled {
            return Err(LoadError::file(&modules_path, "no Pooling module"));
        }
        Ok(head)
    }

    /// Hidden states `[B, L, H]` and their mask `[B, L]` → embeddings `[B, D]` (float32).
    pub fn apply(&self, hidden: &Array, mask: &Array) -> Result<Array> {
        let parts = self
            .pooling
            .iter()
            .map(|p| p.pool(hidden, mask))
            .collect::<mlxcel_arch::Result<Vec<_>>>()?;
        let mut x = if parts.len() == 1 {
            parts[0].clone()
        } else {
            mlxcel_core::ops::concatenate(&parts, -1)?
        };
        for d in &self.dense {
            x = d.forward(&x)?.astype(Dtype::Float32)?;
        }
        if self.normalize {
            x = normalize(&x)?;
        }
        Ok(x)
    }
}

/// The network under an embedding head: a bidirectional encoder (BERT, XLM-RoBERTa,
/// ModernBERT), or a decoder of a registered generation type, read causally (Qwen3-Embedding)
/// or, when its config sets `use_bidirectional_attention`, bidirectionally (EmbeddingGemma).
/// Rows are right-padded, so under causal attention a real token never sees padding, and
/// last-token pooling finds the last real token.
#[derive(Debug)]
pub enum EmbeddingBackbone {
    /// An encoder of kind `Embedding`.
    Encoder(EmbeddingModelEnum),
    /// A decoder of kind `Generation`: its final-norm hidden states, no output head.
    Decoder {
        /// The decoder.
        model: GenerationModel,
        /// `hidden_size`.
        hidden: usize,
        /// `max_position_embeddings`, when given.
        max_positions: Option<usize>,
        /// `use_bidirectional_attention`: every query sees every real key (within half the
        /// window on sliding layers) instead of the keys before it.
        bidirectional: bool,
    },
}

impl EmbeddingModel for EmbeddingBackbone {
    fn hidden_states(&self, ids: &Array, mask: &Array) -> mlxcel_arch::Result<Array> {
        match self {
            EmbeddingBackbone::Encoder(m) => m.hidden_states(ids, mask),
            EmbeddingBackbone::Decoder {
                model,
                bidirectional,
                ..
            } => {
                // Causal attention keeps padding out of real rows only when it comes last.
                let b = mask.dim(0)? as usize;
                let keep = mask.astype(Dtype::Int32)?.to_vec::<i32>()?;
                let l = keep.len() / b.max(1);
                for (r, row) in keep.chunks(l.max(1)).enumerate() {
                    if row.windows(2).any(|w| w[0] == 0 && w[1] != 0) {
                        return Err(mlxcel_arch::ModelError::Runtime(format!(
                            "row {r} of the attention mask is not right-padded (a decoder embedder needs the padding after the tokens)"
                        )));
                    }
                }
                let mut caches = if *bidirectional {
                    let keep = mask.astype(Dtype::Int32)?;
                    model
                        .layer_schedule()
                        .iter()
                        .map(|_| LayerCache::bidirectional(keep.clone()))
                        .collect()
                } else {
                    model.make_caches()
                };
                let x = model.embed(&ids.astype(Dtype::Int32)?)?;
                model.final_hidden_states(&x, &mut caches)
            }
        }
    }

    fn hidden_size(&self) -> usize {
        match self {
            EmbeddingBackbone::Encoder(m) => m.hidden_size(),
            EmbeddingBackbone::Decoder { hidden, .. } => *hidden,
        }
    }

    fn vocab_size(&self) -> usize {
        match self {
            EmbeddingBackbone::Encoder(m) => m.vocab_size(),
            EmbeddingBackbone::Decoder { model, .. } => model.vocab_size(),
        }
    }

    fn max_tokens(&self) -> Option<usize> {
        match self {
            EmbeddingBackbone::Encoder(m) => m.max_tokens(),
            EmbeddingBackbone::Decoder { max_positions, .. } => *max_positions,
        }
    }
}

/// Builds a decoder of a generation type as an embedding backbone. Decoder embedders are often
/// saved from the bare decoder (`Qwen3Model`: no `model.` prefix, no `lm_head`): the prefix is
/// restored, and the output head, never used here, is dropped and tied to the embedding table
/// so a checkpoint without one still loads. A bidirectional decoder
/// (`use_bidirectional_attention`, EmbeddingGemma) must be key/value attention in every layer.
fn decoder_backbone(
    folder: &Path,
    config: &Value,
    model_type: ModelType,
    options: &LoadOptions,
    runtime: &mlxcel_core::RuntimePolicy,
) -> Result<(EmbeddingBackbone, Dtype, mlxcel_core::MappedFiles)> {
    let bidirectional = config
        .get("use_bidirectional_attention")
        .and_then(Value::as_bool)
        == Some(true);
    let mut config = config.clone();
    config["tie_word_embeddings"] = Value::Bool(true);
    let (model, dtype, mapped) =
        build_task_model(folder, &config, model_type, options, runtime, |weights| {
            if !weights.names().any(|n| n.starts_with("model.")) {
                weights.rename_prefix("", "model.")?;
            }
            let heads: Vec<String> = weights
                .names()
                .filter(|n| n.starts_with("lm_head."))
                .map(str::to_string)
                .collect();
            for n in heads {
                weights.remove(&n);
            }
            Ok(())
        })?;
    let model = model.into_generation().map_err(|source| LoadError::Model {
        folder: folder.to_path_buf(),
        source,
    })?;
    let int = |k: &str| config.get(k).and_then(Value::as_u64).map(|v| v as usize);
    let hidden = int("hidden_size").ok_or_else(|| {
        LoadError::file(
            folder.join("config.json"),
            "missing or invalid `hidden_size`",
        )
    })?;
    if bidirectional {
        let other = model.layer_schedule().iter().position(|k| {
            !matches!(
                k,
                LayerKind::GlobalAttention { .. } | LayerKind::SlidingAttention { .. }
            )
        });
        if let Some(layer) = other {
            return Err(LoadError::Unsupported(format!(
                "{}: use_bidirectional_attention = true, but layer {layer} of this {} is not a key/value attention layer (only those run bidirectionally)",
                folder.display(),
                model_type.name()
            )));
        }
    }
    let backbone = EmbeddingBackbone::Decoder {
        model,
        hidden,
        max_positions: int("max_position_embeddings"),
        bidirectional,
    };
    Ok((backbone, dtype, mapped))
}

/// Builds an encoder-style checkpoint of `model_type` (an embedding or reranker row) from
/// `folder`'s weights (first rewritten by `prepare`): the model, its compute dtype and the
/// mapped files.
pub(crate) fn build_task_model(
    folder: &Path,
    config: &Value,
    model_type: ModelType,
    options: &LoadOptions,
    runtime: &mlxcel_core::RuntimePolicy,
    prepare: impl FnOnce(&mut WeightMap) -> Result<()>,
) -> Result<(LoadedModel, Dtype, mlxcel_core::MappedFiles)> {
    let mut weights = WeightMap::open(folder)?;
    prepare(&mut weights)?;
    let mapped = weights.mapped_files();
    let dtype = match options.dtype {
        Some(d) => d,
        None => compute_dtype(config)?,
    };
    let build = BuildOptions {
        prefix: String::new(),
        quant: QuantConfig::from_config(config)?,
        dtype,
        materialization: runtime.weight_materialization,
        stream: None,
        external_ple: None,
        fuse_projections: false,
        transform: None,
        runtime_adapters: None,
        parallelism: None,
        mtp: false,
    };
    let model = load_config_backed(model_type, config, weights, &build).map_err(|source| {
        LoadError::Model {
            folder: folder.to_path_buf(),
            source,
        }
    })?;
    Ok((model, dtype, mapped))
}

/// Checks token rows before a forward pass: none empty, none over `max_tokens`, every id below
/// `vocab`; the error names the row.
pub(crate) fn check_rows(rows: &[Vec<u32>], max_tokens: Option<usize>, vocab: usize) -> Result<()> {
    for (i, row) in rows.iter().enumerate() {
        if row.is_empty() {
            return Err(LoadError::Unsupported(format!("input {i} has no tokens")));
        }
        if let Some(max) = max_tokens {
            if row.len() > max {
                return Err(LoadError::Unsupported(format!(
                    "input {i} has {} tokens, more than the model's limit of {max}",
                    row.len()
                )));
            }
        }
        if let Some(&bad) = row.iter().find(|&&t| t as usize >= vocab) {
            return Err(LoadError::Unsupported(format!(
                "input {i}: token id {bad} is not below the vocabulary size {vocab}"
            )));
        }
    }
    Ok(())
}

/// What `overflow` says to do with input `i` (`text`), which the tokenizer truncated to `limit`
/// tokens: an error, a warning on stderr, or nothing.
pub(crate) fn overflowed(
    i: usize,
    text: &str,
    limit: Option<usize>,
    overflow: Overflow,
) -> Result<()> {
    let limit = limit.unwrap_or(0);
    let preview: String = text.chars().take(40).collect();
    match overflow {
        Overflow::Refuse => {
            return Err(LoadError::Unsupported(format!(
                "text {i} (\"{preview}…\") is longer than the model's limit of {limit} tokens"
            )))
        }
        Overflow::TruncateWithWarning => eprintln!(
            "warning: text {i} (\"{preview}…\") truncated to the model's limit of {limit} tokens"
        ),
        Overflow::Truncate => {}
    }
    Ok(())
}

/// Indices `0..lengths.len()` in batches of at most `batch_size`, longest first (so each batch
/// pads little); callers put the results back in input order by index.
pub(crate) fn length_sorted_batches(lengths: &[usize], batch_size: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    order
        .chunks(batch_size.max(1))
        .map(<[usize]>::to_vec)
        .collect()
}

/// `rows` right-padded with `pad` to the longest, rounded up to the runtime policy's
/// [`pad_multiple`]: ids and attention mask (1 = token), both `[rows, width]` int32.
pub(crate) fn padded(rows: &[&[u32]], pad: u32) -> Result<(Array, Array)> {
    let longest = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let width = longest.div_ceil(pad_multiple()?) * pad_multiple()?;
    let mut tok = Vec::with_capacity(rows.len() * width);
    let mut mask = Vec::with_capacity(rows.len() * width);
    for row in rows {
        tok.extend(row.iter().map(|&t| t as i32));
        tok.extend(std::iter::repeat_n(pad as i32, width - row.len()));
        mask.extend(std::iter::repeat_n(1i32, row.len()));
        mask.extend(std::iter::repeat_n(0i32, width - row.len()));
    }
    let shape = [rows.len() as i32, width as i32];
    Ok((
        Array::from_slice(&tok, &shape)?,
        Array::from_slice(&mask, &shape)?,
    ))
}

/// The multiple batch widths are padded up to: `MLXCEL_EMBED_PAD_TO`, else 1 on the CPU (no
/// extra work) and 32 on a GPU, where every new `[rows, width]` shape pays the backend's
/// first-use costs and a few padded columns cost nothing measurable.
pub(crate) fn pad_multiple() -> Result<usize> {
    if let Some(n) = mlxcel_core::policy::with(|p| p.embed_pad_to) {
        return Ok(n);
    }
    Ok(match mlxcel_core::default_device()? {
        mlxcel_core::Device::Gpu => 32,
        _ => 1,
    })
}

/// Runs `forward` over `lengths.len()` inputs in [`length_sorted_batches`] of `batch_size`,
/// queueing each batch on the device before reading the previous one back, so the host builds
/// batch k+1's graph while the device computes batch k. `store` receives each batch's input
/// indices and its output as float32, `[rows, ...]` row-major, in batch order.
pub(crate) fn pipelined_batches(
    lengths: &[usize],
    batch_size: usize,
    mut forward: impl FnMut(&[usize]) -> Result<Array>,
    mut store: impl FnMut(&[usize], Vec<f32>),
) -> Result<()> {
    let mut queued: Option<(Vec<usize>, Array)> = None;
    for chunk in length_sorted_batches(lengths, batch_size) {
        let out = forward(&chunk)?.astype(Dtype::Float32)?;
        mlxcel_core::ops::async_eval_all([&out])?;
        if let Some((rows, previous)) = queued.replace((chunk, out)) {
            store(&rows, previous.to_vec::<f32>()?);
        }
    }
    if let Some((rows, last)) = queued {
        store(&rows, last.to_vec::<f32>()?);
    }
    Ok(())
}

/// A loaded embedding model (from [`load_embedding_model`]).
#[derive(Debug)]
pub struct EmbeddingLoaded {
    /// The encoder (or a decoder read causally).
    pub model: EmbeddingBackbone,
    /// Pooling, Dense, Normalize.
    pub head: EmbeddingHead,
    /// The tokenizer, set to no padding and truncation at [`EmbeddingLoaded::max_tokens`].
    pub tokenizer: Tokenizer,
    /// The registered encoder type.
    pub model_type: ModelType,
    /// The sanitised `config.json`.
    pub config: Value,
    /// The model folder.
    pub folder: PathBuf,
    /// The compute dtype.
    pub dtype: Dtype,
    /// The most tokens per text (special tokens included): `max_seq_length` of
    /// `sentence_bert_config.json` within the model's position limit.
    pub max_tokens: Option<usize>,
    /// The id batches are padded with (`pad_token_id`, else 0).
    pub pad_id: u32,
    /// Wall time of the load.
    pub load_seconds: f64,
    /// The checkpoint files the weights are mapped from.
    pub mapped: mlxcel_core::MappedFiles,
}

/// What every task loader (embedding, reranker) does first: the runtime policy installed, the
/// folder resolved, `config.json` read and the checkpoint's kind detected.
pub(crate) struct TaskCheckpoint {
    pub started: std::time::Instant,
    pub runtime: mlxcel_core::RuntimePolicy,
    pub folder: PathBuf,
    pub config: Value,
    pub kind: ModelKind,
}

pub(crate) fn open_task_checkpoint(
    path: impl AsRef<Path>,
    options: &LoadOptions,
) -> Result<TaskCheckpoint> {
    let started = std::time::Instant::now();
    let runtime = options.runtime_policy()?;
    mlxcel_core::policy::install(&runtime)?;
    let folder = resolve_model_dir(path)?;
    let config = read_config(&folder)?;
    let kind = detect_kind(&config, folder.join("modules.json").is_file());
    Ok(TaskCheckpoint {
        started,
        runtime,
        folder,
        config,
        kind,
    })
}

/// The folder's tokenizer set to no padding and truncation at the tighter of the configured
/// sequence limit (sentence-transformers') and the model's own, with that limit.
pub(crate) fn encoder_tokenizer(
    folder: &Path,
    configured: Option<usize>,
    model_limit: Option<usize>,
) -> Result<(Tokenizer, Option<usize>)> {
    let max_tokens = match (configured, model_limit) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let mut tokenizer = load_tokenizer(folder)?;
    tokenizer.set_encoder_limits(max_tokens)?;
    Ok((tokenizer, max_tokens))
}

/// The id batches are padded with: `pad_token_id` of `config.json`, else 0.
pub(crate) fn pad_token_id(config: &Value) -> u32 {
    config
        .get("pad_token_id")
        .and_then(Value::as_u64)
        .map_or(0, |v| v as u32)
}

/// Loads an embedding checkpoint with its tokenizer and sentence-transformers modules: an
/// encoder of kind `Embedding` (`bert`, `xlm-roberta`, `modernbert`), or a decoder of a
/// registered generation type in a sentence-transformers folder (Qwen3-Embedding: `qwen3` with
/// last-token pooling), read causally, or bidirectionally when its config sets
/// `use_bidirectional_attention` (EmbeddingGemma: `gemma3_text` with mean pooling and two Dense
/// projections; see [`EmbeddingBackbone`]). A checkpoint of another kind is refused naming it.
///
/// ```no_run
/// use mlxcel_loading::{load_embedding_model, EmbedOptions, LoadOptions};
///
/// # fn main() -> mlxcel_loading::Result<()> {
/// let model = load_embedding_model("models/all-MiniLM-L6-v2", &LoadOptions::default())?;
/// let vectors = model.embed(&["A cat.", "A dog."], &EmbedOptions::default())?;
/// assert_eq!(vectors[0].len(), 384);
/// # Ok(())
/// # }
/// ```
pub fn load_embedding_model(
    path: impl AsRef<Path>,
    options: &LoadOptions,
) -> Result<EmbeddingLoaded> {
    let TaskCheckpoint {
        started,
        runtime,
        folder,
        config,
        kind,
    } = open_task_checkpoint(path, options)?;
    if kind != ModelKind::Embedding {
        return Err(LoadError::Unsupported(format!(
            "{}: a {kind:?} checkpoint, not an embedding model",
            folder.display()
        )));
    }
    let model_err = |source| LoadError::Model {
        folder: folder.clone(),
        source,
    };
    let model_type = get_model_type(&config, false).map_err(model_err)?;
    let (model, dtype, mapped) = match model_type.descriptor().kind {
        ModelKind::Embedding => {
            let (model, dtype, mapped) =
                build_task_model(&folder, &config, model_type, options, &runtime, |_| Ok(()))?;
            let model = model.into_embedding().map_err(model_err)?;
            (EmbeddingBackbone::Encoder(model), dtype, mapped)
        }
        ModelKind::Generation => decoder_backbone(&folder, &config, model_type, options, &runtime)?,
        ModelKind::Reranker => {
            return Err(LoadError::Unsupported(format!(
                "{}: {} is a cross-encoder, not an embedding model",
                folder.display(),
                model_type.name()
            )))
        }
    };
    let head = EmbeddingHead::load(&folder, dtype)?;
    let (tokenizer, max_tokens) =
        encoder_tokenizer(&folder, head.max_seq_length, model.max_tokens())?;
    let pad_id = pad_token_id(&config);
    Ok(EmbeddingLoaded {
        model,
        head,
        tokenizer,
        model_type,
        config,
        folder,
        dtype,
        max_tokens,
        pad_id,
        load_seconds: started.elapsed().as_secs_f64(),
        mapped,
    })
}

impl EmbeddingLoaded {
    /// Width of the vectors [`EmbeddingLoaded::embed`] returns before Matryoshka truncation.
    pub fn dimensions(&self) -> Result<usize> {
        let probe = self.embed_ids(&[vec![self.pad_id]], None, 1)?;
        Ok(probe.first().map_or(0, Vec::len))
    }

    /// Token ids of `text` as the model sees it (prompt prepended, special tokens added,
    /// truncated at the limit), and whether it was truncated.
    pub fn tokenize(&self, text: &str, options: &EmbedOptions) -> Result<(Vec<u32>, bool)> {
        let prompt_name = options
            .prompt_name
            .as_ref()
            .or(self.head.default_prompt_name.as_ref());
        let prompt = match prompt_name {
            None => "",
            Some(name) => self
                .head
                .prompts
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
                .ok_or_else(|| {
                    LoadError::Unsupported(format!(
                        "no prompt `{name}` in config_sentence_transformers.json (has: {})",
                        self.head
                            .prompts
                            .iter()
                            .map(|(k, _)| k.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })?,
        };
        if prompt.is_empty() {
            self.tokenizer.encode_checked(text, true)
        } else {
            self.tokenizer
                .encode_checked(&format!("{prompt}{text}"), true)
        }
    }

    /// One vector per text, in input order (see [`EmbedOptions`]).
    pub fn embed(&self, texts: &[&str], options: &EmbedOptions) -> Result<Vec<Vec<f32>>> {
        let mut all = Vec::with_capacity(texts.len());
        for (i, text) in texts.iter().enumerate() {
            let (ids, truncated) = self.tokenize(text, options)?;
            if truncated {
                overflowed(i, text, self.max_tokens, options.overflow)?;
            }
            all.push(ids);
        }
        self.embed_ids(&all, options.dimensions, options.batch_size)
    }

    /// One vector per id list (special tokens already in place), in input order: sorted by
    /// length, padded per batch of `batch_size` with an attention mask, Matryoshka-truncated to
    /// `dimensions` (re-normalised when the pipeline normalises).
    pub fn embed_ids(
        &self,
        ids: &[Vec<u32>],
        dimensions: Option<usize>,
        batch_size: usize,
    ) -> Result<Vec<Vec<f32>>> {
        check_rows(ids, self.max_tokens, self.model.vocab_size())?;
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); ids.len()];
        let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
        let forward = |chunk: &[usize]| -> Result<Array> {
            let rows: Vec<&[u32]> = chunk.iter().map(|&i| ids[i].as_slice()).collect();
            let (tok, mask) = padded(&rows, self.pad_id)?;
            let hidden = self.model.hidden_states(&tok, &mask)?;
            let emb = self.head.apply(&hidden, &mask)?;
            match dimensions {
                Some(d) => Ok(truncate_dimensions(&emb, d, self.head.normalize)?),
                None => Ok(emb),
            }
        };
        pipelined_batches(&lengths, batch_size, forward, |chunk, values| {
            let d = values.len() / chunk.len();
            for (row, &i) in chunk.iter().enumerate() {
                out[i] = values[row * d..(row + 1) * d].to_vec();
            }
        })?;
        Ok(out)
    }
}
