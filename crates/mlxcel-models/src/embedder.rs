//! [`Embedder`]: an embedding model (BERT, XLM-RoBERTa, ModernBERT checkpoints, or a decoder
//! embedder such as Qwen3-Embedding, with their sentence-transformers modules) on a worker
//! thread, like [`crate::Model`].

use std::path::PathBuf;
use std::sync::Arc;

use mlxcel_loading::{load_embedding_model, EmbedOptions, EmbeddingLoaded, LoadOptions};

use crate::worker::Worker;
use crate::{expand_home, Device, Dtype, ModelType, Result, RuntimePolicy};

pub use mlxcel_loading::Overflow;

/// Facts about a loaded embedding model.
#[derive(Debug, Clone)]
pub struct EmbedderInfo {
    /// The registered encoder type.
    pub model_type: ModelType,
    /// The model folder.
    pub folder: PathBuf,
    /// The dtype it computes in.
    pub dtype: Dtype,
    /// Width of the vectors (before Matryoshka truncation).
    pub dimensions: usize,
    /// The most tokens per text (longer texts are truncated or refused, see [`Overflow`]).
    pub max_tokens: Option<usize>,
    /// Whether a sentence-transformers `modules.json` defined the pooling; otherwise mean
    /// pooling + L2 normalisation.
    pub from_modules_json: bool,
    /// Whether the vectors are L2-normalised.
    pub normalized: bool,
    /// Seconds the load took on the worker thread.
    pub load_seconds: f64,
}

/// Builds an [`Embedder`]: `Embedder::load(path).dimensions(256).build()`.
#[derive(Debug, Clone)]
pub struct EmbedderBuilder {
    path: PathBuf,
    options: LoadOptions,
    device: Option<Device>,
    embed: EmbedOptions,
}

impl EmbedderBuilder {
    /// Computes in `dtype` (the CPU computes in float32 by default).
    pub fn dtype(mut self, dtype: Dtype) -> Self {
        self.options.dtype = Some(dtype);
        self
    }

    /// Runs on `device` (MLX's default device otherwise).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Matryoshka truncation of every vector to its first `n` values (re-normalised).
    pub fn dimensions(mut self, n: usize) -> Self {
        self.embed.dimensions = Some(n);
        self
    }

    /// What to do with texts longer than the model's limit (default: truncate with a warning
    /// on stderr).
    pub fn overflow(mut self, overflow: Overflow) -> Self {
        self.embed.overflow = overflow;
        self
    }

    /// Texts per forward pass (default 32).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.embed.batch_size = n.max(1);
        self
    }

    /// A prompt of `config_sentence_transformers.json` by name (e.g. `"query"`), prepended to
    /// every text.
    pub fn prompt_name(mut self, name: impl Into<String>) -> Self {
        self.embed.prompt_name = Some(name.into());
        self
    }

    /// Runtime switches (see [`RuntimePolicy`]).
    pub fn policy(mut self, policy: RuntimePolicy) -> Self {
        self.options.policy = Some(policy);
        self
    }

    /// Starts the worker thread and loads the model there.
    pub fn build(self) -> Result<Embedder> {
        let EmbedderBuilder {
            path,
            options,
            device,
            embed,
        } = self;
        let (worker, info) = Worker::start("mlxcel-embedder", device, move || {
            let l = load_embedding_model(expand_home(&path), &options)?;
            let info = EmbedderInfo {
                model_type: l.model_type,
                folder: l.folder.clone(),
                dtype: l.dtype,
                dimensions: l.dimensions()?,
                max_tokens: l.max_tokens,
                from_modules_json: l.head.from_modules_json,
                normalized: l.head.normalize,
                load_seconds: l.load_seconds,
            };
            Ok((l, info))
        })?;
        Ok(Embedder {
            shared: Arc::new(Shared {
                worker,
                info,
                options: embed,
            }),
        })
    }
}

struct Shared {
    worker: Worker<EmbeddingLoaded>,
    info: EmbedderInfo,
    options: EmbedOptions,
}

/// A loaded embedding model: a cloneable, `Send + Sync` handle to the thread that owns it.
///
/// ```no_run
/// use mlxcel_models::Embedder;
///
/// let embedder = Embedder::load("~/.cache/mlxcel/models/all-MiniLM-L6-v2").build()?;
/// let vectors = embedder.embed(&["A cat sits on the mat.", "A man plays the guitar."])?;
/// assert_eq!(vectors.len(), 2);
/// assert_eq!(vectors[0].len(), embedder.info().dimensions); // 384, L2-normalised
/// # Ok::<(), mlxcel_models::Error>(())
/// ```
///
/// The pipeline follows the folder's sentence-transformers `modules.json` (pooling, Dense
/// layers, Normalize); without one it is mean pooling + L2 normalisation. Texts are tokenized
/// with the special tokens, sorted by length, padded per batch with an attention mask, and the
/// vectors come back in input order.
#[derive(Clone)]
pub struct Embedder {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Embedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder")
            .field("model_type", &self.shared.info.model_type)
            .field("folder", &self.shared.info.folder)
            .finish()
    }
}

impl Embedder {
    /// A builder loading the embedding model folder at `path` (a leading `~` is the home
    /// folder).
    pub fn load(path: impl Into<PathBuf>) -> EmbedderBuilder {
        EmbedderBuilder {
            path: path.into(),
            options: LoadOptions {
                policy: Some(RuntimePolicy::default()),
                ..LoadOptions::default()
            },
            device: None,
            embed: EmbedOptions::default(),
        }
    }

    /// What was loaded.
    pub fn info(&self) -> &EmbedderInfo {
        &self.shared.info
    }

    /// One vector per text, in input order, with the builder's options.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        self.embed_with(texts, &self.shared.options)
    }

    /// Like [`Embedder::embed`] with per-call options.
    pub fn embed_with(&self, texts: &[&str], options: &EmbedOptions) -> Result<Vec<Vec<f32>>> {
        let texts: Vec<String> = texts.iter().map(|t| t.to_string()).collect();
        let options = options.clone();
        self.shared.worker.run(move |l| {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            Ok(l.embed(&refs, &options)?)
        })
    }

    /// How many tokens the model sees for each text under `options` (prompt prepended,
    /// special tokens added, truncated at the limit), in input order: what an embedding call
    /// costs, for usage reports.
    pub fn token_counts(&self, texts: &[&str], options: &EmbedOptions) -> Result<Vec<usize>> {
        let texts: Vec<String> = texts.iter().map(|t| t.to_string()).collect();
        let options = options.clone();
        self.shared.worker.run(move |l| {
            Ok(texts
                .iter()
                .map(|t| l.tokenize(t, &options).map(|(ids, _)| ids.len()))
                .collect::<std::result::Result<Vec<_>, _>>()?)
        })
    }

    /// The builder's per-call options (see [`Embedder::embed_with`] to change them).
    pub fn options(&self) -> &EmbedOptions {
        &self.shared.options
    }
}

// The worker runs jobs only.
impl crate::worker::Background for mlxcel_loading::EmbeddingLoaded {}
