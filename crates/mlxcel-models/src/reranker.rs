//! [`Reranker`]: a cross-encoder (BERT, XLM-RoBERTa, ModernBERT `*ForSequenceClassification`
//! checkpoints) on a worker thread, like [`crate::Embedder`].

use std::path::PathBuf;
use std::sync::Arc;

use mlxcel_loading::{
    load_generative_reranker, load_reranker_model, LoadOptions, RerankOptions, RerankerLoaded,
    ScoreActivation,
};

use crate::worker::Worker;
use crate::{expand_home, Device, Dtype, ModelType, Overflow, Result, RuntimePolicy};

/// Facts about a loaded reranker.
#[derive(Debug, Clone)]
pub struct RerankerInfo {
    /// The registered cross-encoder type.
    pub model_type: ModelType,
    /// The model folder.
    pub folder: PathBuf,
    /// The dtype it computes in.
    pub dtype: Dtype,
    /// The most tokens per query/document pair (longer pairs are truncated or refused, see
    /// [`Overflow`]).
    pub max_tokens: Option<usize>,
    /// What turns a logit into a score (sentence-transformers' `CrossEncoder` convention;
    /// sigmoid of yes − no for a generative reranker).
    pub activation: ScoreActivation,
    /// Whether it is a generative (yes/no) reranker.
    pub generative: bool,
    /// Seconds the load took on the worker thread.
    pub load_seconds: f64,
}

/// Builds a [`Reranker`]: `Reranker::load(path).batch_size(16).build()`.
#[derive(Debug, Clone)]
pub struct RerankerBuilder {
    path: PathBuf,
    options: LoadOptions,
    device: Option<Device>,
    rerank: RerankOptions,
    generative: bool,
}

impl RerankerBuilder {
    /// Loads the folder as a generative reranker (a generator scored the Qwen3-Reranker way,
    /// yes/no at the last position; see `mlxcel_loading::load_generative_reranker`): its config
    /// is a generator's, so this must be asked for.
    pub fn generative(mut self) -> Self {
        self.generative = true;
        self
    }

    /// The `<Instruct>` line of a generative reranker's prompt (default: the model card's).
    pub fn instruction(mut self, instruction: impl Into<String>) -> Self {
        self.rerank.instruction = Some(instruction.into());
        self
    }

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

    /// What to do with pairs longer than the model's limit (default: truncate the longer part
    /// first, with a warning on stderr).
    pub fn overflow(mut self, overflow: Overflow) -> Self {
        self.rerank.overflow = overflow;
        self
    }

    /// Pairs per forward pass (default 32).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.rerank.batch_size = n.max(1);
        self
    }

    /// Runtime switches (see [`RuntimePolicy`]).
    pub fn policy(mut self, policy: RuntimePolicy) -> Self {
        self.options.policy = Some(policy);
        self
    }

    /// Starts the worker thread and loads the model there.
    pub fn build(self) -> Result<Reranker> {
        let RerankerBuilder {
            path,
            options,
            device,
            rerank,
            generative,
        } = self;
        let (worker, info) = Worker::start("mlxcel-reranker", device, move || {
            let path = expand_home(&path);
            let l = if generative {
                load_generative_reranker(path, &options)?
            } else {
                load_reranker_model(path, &options)?
            };
            let info = RerankerInfo {
                model_type: l.model_type,
                folder: l.folder.clone(),
                dtype: l.dtype,
                max_tokens: l.max_tokens,
                activation: l.activation,
                generative: matches!(l.model, mlxcel_loading::RerankerBackbone::Generative(_)),
                load_seconds: l.load_seconds,
            };
            Ok((l, info))
        })?;
        Ok(Reranker {
            shared: Arc::new(Shared {
                worker,
                info,
                options: rerank,
            }),
        })
    }
}

struct Shared {
    worker: Worker<RerankerLoaded>,
    info: RerankerInfo,
    options: RerankOptions,
}

/// A loaded cross-encoder: a cloneable, `Send + Sync` handle to the thread that owns it.
///
/// ```no_run
/// use mlxcel_models::Reranker;
///
/// let reranker = Reranker::load("~/models/ms-marco-MiniLM-L6-v2").build()?;
/// let scores = reranker.score(
///     "Where is Paris?",
///     &["Paris is the capital of France.", "A recipe for bread."],
/// )?;
/// assert!(scores[0] > scores[1]); // in input order
/// # Ok::<(), mlxcel_models::Error>(())
/// ```
///
/// Each document is paired with the query through the tokenizer's pair template (token types
/// where the model has them), the pairs are sorted by length and padded per batch, and the
/// scores (the checkpoint's activation applied, see [`RerankerInfo::activation`]) come back in
/// input order.
#[derive(Clone)]
pub struct Reranker {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Reranker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reranker")
            .field("model_type", &self.shared.info.model_type)
            .field("folder", &self.shared.info.folder)
            .finish()
    }
}

impl Reranker {
    /// A builder loading the cross-encoder folder at `path` (a leading `~` is the home folder).
    pub fn load(path: impl Into<PathBuf>) -> RerankerBuilder {
        RerankerBuilder {
            path: path.into(),
            options: LoadOptions {
                policy: Some(RuntimePolicy::default()),
                ..LoadOptions::default()
            },
            device: None,
            rerank: RerankOptions::default(),
            generative: false,
        }
    }

    /// What was loaded.
    pub fn info(&self) -> &RerankerInfo {
        &self.shared.info
    }

    /// One score per document for `query`, in input order, with the builder's options.
    pub fn score(&self, query: &str, documents: &[&str]) -> Result<Vec<f32>> {
        self.score_with(query, documents, &self.shared.options)
    }

    /// Like [`Reranker::score`] with per-call options.
    pub fn score_with(
        &self,
        query: &str,
        documents: &[&str],
        options: &RerankOptions,
    ) -> Result<Vec<f32>> {
        let query = query.to_string();
        let documents: Vec<String> = documents.iter().map(|d| d.to_string()).collect();
        let options = options.clone();
        self.shared.worker.run(move |l| {
            let refs: Vec<&str> = documents.iter().map(String::as_str).collect();
            Ok(l.score(&query, &refs, &options)?)
        })
    }

    /// How many tokens the model sees for each (query, document) pair (template and special
    /// tokens included, truncated at the limit), in input order: what a call costs, for usage
    /// reports.
    pub fn token_counts(&self, query: &str, documents: &[&str]) -> Result<Vec<usize>> {
        let query = query.to_string();
        let documents: Vec<String> = documents.iter().map(|d| d.to_string()).collect();
        let options = self.shared.options.clone();
        self.shared.worker.run(move |l| {
            Ok(documents
                .iter()
                .map(|d| {
                    l.tokenize_pair_with(&query, d, options.instruction.as_deref())
                        .map(|(p, _)| p.ids.len())
                })
                .collect::<std::result::Result<Vec<_>, _>>()?)
        })
    }

    /// The builder's per-call options (see [`Reranker::score_with`] to change them).
    pub fn options(&self) -> &RerankOptions {
        &self.shared.options
    }
}

// The worker runs jobs only.
impl crate::worker::Background for mlxcel_loading::RerankerLoaded {}
