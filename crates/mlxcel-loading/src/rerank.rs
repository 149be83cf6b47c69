//! The reranker pipeline: a cross-encoder checkpoint (`*ForSequenceClassification`) with its
//! tokenizer's pair template, batched and padded inference, and the score activation
//! sentence-transformers' `CrossEncoder` applies; or, asked for explicitly
//! ([`load_generative_reranker`]), a generator scored the Qwen3-Reranker way (a yes/no question
//! in its chat template, P(yes) from the last position's logits).
//!
//! The activation follows sentence-transformers (6.2): `activation_fn` of
//! `config_sentence_transformers.json`, else `sentence_transformers.activation_fn` of
//! `config.json`, else the legacy `sbert_ce_default_activation_function`, else `Sigmoid` for a
//! single-label head (and `Identity` otherwise). Like sentence-transformers, a path outside
//! `torch.` (custom code) is not run: a warning says so and the default is used.

use std::path::{Path, PathBuf};

use mlxcel_arch::detection::get_reranker_type;
use mlxcel_arch::{LanguageModel, ModelKind, ModelType, RerankerModel, RerankerModelEnum};
use mlxcel_core::{Array, Dtype};
use serde_json::Value;

use crate::embed::{
    build_task_model, check_rows, confined, encoder_tokenizer, open_task_checkpoint, overflowed,
    pad_token_id, padded, pipelined_batches, read_json, TaskCheckpoint,
};
use crate::pipeline::LoadOptions;
use crate::tokenizer::Tokenizer;
use crate::{LoadError, Overflow, Result};

/// The function turning a cross-encoder's logit into the score users see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreActivation {
    /// `torch.nn.Sigmoid`: scores in (0, 1) (the default for a single-label head).
    Sigmoid,
    /// `torch.nn.Identity`: the raw logit.
    Identity,
    /// `torch.nn.Tanh`.
    Tanh,
}

impl ScoreActivation {
    /// The activation a dotted torch path names (`torch.nn.modules.activation.Sigmoid`,
    /// `torch.nn.Sigmoid`, ...); an error naming it when it is another torch module.
    pub fn from_torch_path(path: &str) -> Result<ScoreActivation> {
        match path.rsplit('.').next().unwrap_or(path) {
            "Sigmoid" => Ok(ScoreActivation::Sigmoid),
            "Identity" => Ok(ScoreActivation::Identity),
            "Tanh" => Ok(ScoreActivation::Tanh),
            _ => Err(LoadError::Unsupported(format!(
                "cross-encoder activation_fn `{path}` (supported: Sigmoid, Identity, Tanh)"
            ))),
        }
    }

    /// Applies it to `x`.
    pub fn apply(self, x: &Array) -> Result<Array> {
        Ok(match self {
            ScoreActivation::Sigmoid => x.sigmoid()?,
            ScoreActivation::Identity => x.clone(),
            ScoreActivation::Tanh => x.tanh()?,
        })
    }
}

/// Per-request choices for [`RerankerLoaded::score`].
#[derive(Debug, Clone)]
pub struct RerankOptions {
    /// Pairs longer than the limit ([`RerankerLoaded::max_tokens`]): the tokenizer truncates the
    /// longer of query and document first.
    pub overflow: Overflow,
    /// Pairs per forward pass (sorted by length first, so padding stays small).
    pub batch_size: usize,
    /// The `<Instruct>` of a generative reranker's prompt; `None` uses the model card's
    /// default. Cross-encoders take no instruction (an error when set).
    pub instruction: Option<String>,
}

impl Default for RerankOptions {
    fn default() -> Self {
        RerankOptions {
            overflow: Overflow::default(),
            batch_size: 32,
            instruction: None,
        }
    }
}

/// A loaded cross-encoder (from [`load_reranker_model`]).
#[derive(Debug)]
pub struct RerankerLoaded {
    /// The scoring network.
    pub model: RerankerBackbone,
    /// What turns a logit into a score.
    pub activation: ScoreActivation,
    /// Where [`RerankerLoaded::activation`] came from (a config key, or the default).
    pub activation_source: String,
    /// The tokenizer, set to no padding and longest-first truncation at
    /// [`RerankerLoaded::max_tokens`].
    pub tokenizer: Tokenizer,
    /// The registered cross-encoder type.
    pub model_type: ModelType,
    /// The sanitised `config.json`.
    pub config: Value,
    /// The model folder.
    pub folder: PathBuf,
    /// The compute dtype.
    pub dtype: Dtype,
    /// The most tokens per pair (special tokens included): `max_seq_length` of
    /// `sentence_bert_config.json`, else `model_max_length` of `tokenizer_config.json`, within
    /// the model's position limit; for a generative reranker, the most tokens of the prompt's
    /// body (between the fixed prefix and suffix).
    pub max_tokens: Option<usize>,
    /// The id batches are padded with (`pad_token_id`, else 0).
    pub pad_id: u32,
    /// Wall time of the load.
    pub load_seconds: f64,
    /// The checkpoint files the weights are mapped from.
    pub mapped: mlxcel_core::MappedFiles,
}

/// transformers' "no limit" `model_max_length` (`VERY_LARGE_INTEGER`) and anything near it.
const UNBOUNDED: u64 = 1 << 40;

/// The sequence limit sentence-transformers' `Transformer` module uses for `folder`:
/// `sentence_bert_config.json` `max_seq_length`, else `tokenizer_config.json`
/// `model_max_length` (when bounded).
fn configured_max_length(folder: &Path) -> Result<Option<usize>> {
    for (file, key) in [
        ("sentence_bert_config.json", "max_seq_length"),
        ("tokenizer_config.json", "model_max_length"),
    ] {
        if folder.join(file).is_file() {
            let cfg = read_json(&confined(folder, file)?)?;
            if let Some(n) = cfg.get(key).and_then(Value::as_u64) {
                if n < UNBOUNDED {
                    return Ok(Some(n as usize));
                }
            }
        }
    }
    Ok(None)
}

/// The score activation of `folder` (see the module docs) and where it came from.
fn score_activation(
    folder: &Path,
    config: &Value,
    num_labels: usize,
) -> Result<(ScoreActivation, String)> {
    let mut named: Option<(String, String)> = None;
    if folder.join("config_sentence_transformers.json").is_file() {
        let path = confined(folder, "config_sentence_transformers.json")?;
        if let Some(p) = read_json(&path)?
            .get("activation_fn")
            .and_then(Value::as_str)
        {
            named = Some((
                p.to_string(),
                "config_sentence_transformers.json activation_fn".into(),
            ));
        }
    }
    if named.is_none() {
        let nested = config
            .get("sentence_transformers")
            .and_then(|s| s.get("activation_fn"))
            .and_then(Value::as_str)
            .map(|p| (p, "config.json sentence_transformers.activation_fn"));
        let legacy = config
            .get("sbert_ce_default_activation_function")
            .and_then(Value::as_str)
            .map(|p| (p, "config.json sbert_ce_default_activation_function"));
        named = nested
            .or(legacy)
            .map(|(p, from)| (p.to_string(), from.to_string()));
    }
    if let Some((path, from)) = named {
        if path.starts_with("torch.") {
            let activation = ScoreActivation::from_torch_path(&path)
                .map_err(|e| LoadError::file(folder.join("config.json"), format!("{from}: {e}")))?;
            return Ok((activation, format!("{from} `{path}`")));
        }
        eprintln!(
            "warning: {}: {from} `{path}` is custom code, which is not run; using the default activation (as sentence-transformers does without trust_remote_code)",
            folder.display()
        );
    }
    Ok(if num_labels == 1 {
        (ScoreActivation::Sigmoid, "default for one label".into())
    } else {
        (
            ScoreActivation::Identity,
            "default for several labels".into(),
        )
    })
}

/// Loads a cross-encoder checkpoint (kind `Reranker`: `BertForSequenceClassification`,
/// `XLMRobertaForSequenceClassification`, `ModernBertForSequenceClassification`) with its
/// tokenizer and score activation. A checkpoint of another kind is refused naming it, and so is
/// a head with more than one output (a classifier, not a relevance scorer).
///
/// ```no_run
/// use mlxcel_loading::{load_reranker_model, LoadOptions, RerankOptions};
///
/// # fn main() -> mlxcel_loading::Result<()> {
/// let reranker = load_reranker_model("models/ms-marco-MiniLM-L6-v2", &LoadOptions::default())?;
/// let scores = reranker.score(
///     "Where is Paris?",
///     &["Paris is the capital of France.", "A recipe for bread."],
///     &RerankOptions::default(),
/// )?;
/// assert!(scores[0] > scores[1]);
/// # Ok(())
/// # }
/// ```
pub fn load_reranker_model(
    path: impl AsRef<Path>,
    options: &LoadOptions,
) -> Result<RerankerLoaded> {
    let TaskCheckpoint {
        started,
        runtime,
        folder,
        config,
        kind,
    } = open_task_checkpoint(path, options)?;
    if kind != ModelKind::Reranker {
        return Err(LoadError::Unsupported(format!(
            "{}: a {kind:?} checkpoint, not a cross-encoder reranker (`architectures` has no `*ForSequenceClassification`){}",
            folder.display(),
            if kind == ModelKind::Generation {
                "; a generative reranker (Qwen3-Reranker) loads with `load_generative_reranker` (`mlxcel rerank --generative`)"
            } else {
                ""
            }
        )));
    }
    let model_err = |source| LoadError::Model {
        folder: folder.clone(),
        source,
    };
    let model_type = get_reranker_type(&config).map_err(model_err)?;
    let (model, dtype, mapped) =
        build_task_model(&folder, &config, model_type, options, &runtime, |_| Ok(()))?;
    let model = model.into_reranker().map_err(model_err)?;
    if model.num_labels() != 1 {
        return Err(LoadError::Unsupported(format!(
            "{}: the classification head has {} outputs (id2label / num_labels): a classifier, not a reranker with one relevance score",
            folder.display(),
            model.num_labels()
        )));
    }
    let (activation, activation_source) = score_activation(&folder, &config, model.num_labels())?;
    let (tokenizer, max_tokens) =
        encoder_tokenizer(&folder, configured_max_length(&folder)?, model.max_tokens())?;
    let pad_id = pad_token_id(&config);
    Ok(RerankerLoaded {
        model: RerankerBackbone::CrossEncoder(model),
        activation,
        activation_source,
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

/// One pair as the model sees it: token ids and their token-type ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedPair {
    /// Token ids, special tokens included.
    pub ids: Vec<u32>,
    /// Token-type ids from the tokenizer's pair template (0 query, 1 document, where it has
    /// types).
    pub type_ids: Vec<u32>,
}

impl RerankerLoaded {
    /// `query` and `document` as the model reads them, truncated at the limit, and whether
    /// truncation dropped tokens: through the pair template (longest part first) for a
    /// cross-encoder, inside the Qwen3-Reranker prompt (the document end first) for a
    /// generative reranker, with `instruction` (else the default; cross-encoders take none).
    pub fn tokenize_pair_with(
        &self,
        query: &str,
        document: &str,
        instruction: Option<&str>,
    ) -> Result<(EncodedPair, bool)> {
        match &self.model {
            RerankerBackbone::CrossEncoder(_) => {
                if instruction.is_some() {
                    return Err(LoadError::Unsupported(
                        "an instruction is for generative rerankers; a cross-encoder takes the query and document only".into(),
                    ));
                }
                let (ids, type_ids, truncated) =
                    self.tokenizer.encode_pair_checked(query, document)?;
                Ok((EncodedPair { ids, type_ids }, truncated))
            }
            RerankerBackbone::Generative(g) => {
                let instruction = instruction.unwrap_or(QWEN3_RERANKER_INSTRUCTION);
                let body =
                    format!("<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}");
                let (body, truncated) = self.tokenizer.encode_checked(&body, true)?;
                let mut ids = g.prefix.clone();
                ids.extend(body);
                ids.extend(&g.suffix);
                let type_ids = vec![0; ids.len()];
                Ok((EncodedPair { ids, type_ids }, truncated))
            }
        }
    }

    /// [`RerankerLoaded::tokenize_pair_with`] without an instruction.
    pub fn tokenize_pair(&self, query: &str, document: &str) -> Result<(EncodedPair, bool)> {
        self.tokenize_pair_with(query, document, None)
    }

    /// One score per document for `query`, in input order (activation applied).
    pub fn score(
        &self,
        query: &str,
        documents: &[&str],
        options: &RerankOptions,
    ) -> Result<Vec<f32>> {
        let pairs: Vec<(&str, &str)> = documents.iter().map(|d| (query, *d)).collect();
        self.score_pairs(&pairs, options)
    }

    /// One score per `(query, document)` pair, in input order (activation applied).
    pub fn score_pairs(&self, pairs: &[(&str, &str)], options: &RerankOptions) -> Result<Vec<f32>> {
        let mut encoded = Vec::with_capacity(pairs.len());
        for (i, (q, d)) in pairs.iter().enumerate() {
            let (pair, truncated) =
                self.tokenize_pair_with(q, d, options.instruction.as_deref())?;
            if truncated {
                overflowed(i, d, self.max_tokens, options.overflow)?;
            }
            encoded.push(pair);
        }
        self.score_encoded(&encoded, options.batch_size, true)
    }

    /// One value per encoded pair, in input order: sorted by length, padded per batch of
    /// `batch_size` with an attention mask; the score when `activate`, else the raw logit.
    pub fn score_encoded(
        &self,
        pairs: &[EncodedPair],
        batch_size: usize,
        activate: bool,
    ) -> Result<Vec<f32>> {
        let ids: Vec<Vec<u32>> = pairs.iter().map(|p| p.ids.clone()).collect();
        let limit = match &self.model {
            RerankerBackbone::CrossEncoder(_) => self.max_tokens,
            RerankerBackbone::Generative(g) => Some(g.max_length),
        };
        check_rows(&ids, limit, self.model.vocab_size())?;
        for (i, p) in pairs.iter().enumerate() {
            if p.type_ids.len() != p.ids.len() {
                return Err(LoadError::Unsupported(format!(
                    "pair {i}: {} token-type ids for {} tokens",
                    p.type_ids.len(),
                    p.ids.len()
                )));
            }
        }
        let model = match &self.model {
            RerankerBackbone::CrossEncoder(m) => m,
            RerankerBackbone::Generative(g) => {
                let margins = pairs
                    .iter()
                    .map(|p| g.yes_minus_no(&p.ids))
                    .collect::<Result<Vec<_>>>()?;
                return Ok(if activate {
                    margins
                        .into_iter()
                        .map(|m| 1.0 / (1.0 + (-m).exp()))
                        .collect()
                } else {
                    margins
                });
            }
        };
        let mut out = vec![0f32; pairs.len()];
        let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
        let forward = |chunk: &[usize]| -> Result<Array> {
            let rows: Vec<&[u32]> = chunk.iter().map(|&i| ids[i].as_slice()).collect();
            let (tok, mask) = padded(&rows, self.pad_id)?;
            let types: Vec<&[u32]> = chunk
                .iter()
                .map(|&i| pairs[i].type_ids.as_slice())
                .collect();
            let (types, _) = padded(&types, 0)?;
            let logits = model.logits(&tok, &types, &mask)?.astype(Dtype::Float32)?;
            Ok(if activate {
                self.activation.apply(&logits)?
            } else {
                logits
            })
        };
        pipelined_batches(&lengths, batch_size, forward, |chunk, values| {
            for (row, &i) in chunk.iter().enumerate() {
                out[i] = values[row];
            }
        })?;
        Ok(out)
    }
}

/// The network behind a [`RerankerLoaded`].
#[derive(Debug)]
pub enum RerankerBackbone {
    /// A cross-encoder: pairs through its pair template, one logit each.
    CrossEncoder(RerankerModelEnum),
    /// A generator asked a yes/no question per pair (Qwen3-Reranker).
    Generative(GenerativeScorer),
}

impl RerankerBackbone {
    /// Rows of the token embedding table.
    pub fn vocab_size(&self) -> usize {
        match self {
            RerankerBackbone::CrossEncoder(m) => m.vocab_size(),
            RerankerBackbone::Generative(g) => g.model.vocab_size(),
        }
    }
}

/// The Qwen3-Reranker model card's system prompt and turn opening, before `<Instruct>`.
pub const QWEN3_RERANKER_PREFIX: &str = "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n";
/// What follows the document: the assistant turn with an empty thinking block.
pub const QWEN3_RERANKER_SUFFIX: &str =
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
/// The model card's default `<Instruct>`.
pub const QWEN3_RERANKER_INSTRUCTION: &str =
    "Given a web search query, retrieve relevant passages that answer the query";
/// The model card's `max_length` (prompt included).
pub const QWEN3_RERANKER_MAX_LENGTH: usize = 8192;

/// A generator scoring pairs the Qwen3-Reranker way: `prefix + "<Instruct>: ..\n<Query>: ..\n
/// <Document>: .." + suffix`, and the score is `softmax(logits[no], logits[yes])[yes]` =
/// `sigmoid(logits[yes] - logits[no])` at the last position.
#[derive(Debug)]
pub struct GenerativeScorer {
    /// The decoder.
    pub model: mlxcel_arch::GenerationModel,
    /// Ids of [`QWEN3_RERANKER_PREFIX`] (no special tokens added).
    pub prefix: Vec<u32>,
    /// Ids of [`QWEN3_RERANKER_SUFFIX`].
    pub suffix: Vec<u32>,
    /// The id of the token `yes`.
    pub yes: u32,
    /// The id of the token `no`.
    pub no: u32,
    /// The most tokens per prompt, prefix and suffix included.
    pub max_length: usize,
}

impl GenerativeScorer {
    /// `logits[yes] - logits[no]` at the last position of the prompt `ids` (run alone, so no
    /// padding enters the causal attention).
    fn yes_minus_no(&self, ids: &[u32]) -> Result<f32> {
        let tokens: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let tokens = Array::from_slice(&tokens, &[1, tokens.len() as i32])?;
        let mut caches = self.model.make_caches();
        let logits = self
            .model
            .forward_last(&tokens, &mut caches)?
            .astype(Dtype::Float32)?
            .reshape(&[-1])?;
        let pick = Array::from_slice(&[self.yes as i32, self.no as i32], &[2])?;
        let v = logits.take(&pick, 0)?.to_vec::<f32>()?;
        Ok(v[0] - v[1])
    }
}

/// Loads a generator as a generative reranker, scored as the Qwen3-Reranker model card does
/// (see [`GenerativeScorer`]). A generative reranker's config is a generator's, so this is an
/// explicit choice (`mlxcel rerank --generative`, `serve --reranker-model DIR
/// --generative-reranker`); its tokenizer must have the tokens `yes` and `no`. The body of each
/// prompt is truncated (its end first) to `max_length` (8192, within `max_position_embeddings`)
/// less the prefix and suffix.
pub fn load_generative_reranker(
    path: impl AsRef<Path>,
    options: &LoadOptions,
) -> Result<RerankerLoaded> {
    let started = std::time::Instant::now();
    let loaded = crate::load_model(path, options)?;
    let folder = loaded.folder.clone();
    let mut tokenizer = loaded.tokenizer.ok_or_else(|| {
        LoadError::file(
            &folder,
            "a generative reranker needs the model's tokenizer.json",
        )
    })?;
    let token = |t: &str| {
        tokenizer.token_to_id(t).ok_or_else(|| {
            LoadError::file(
                &tokenizer.path,
                format!("no token `{t}`: a generative reranker scores the tokens `yes` and `no`"),
            )
        })
    };
    let (yes, no) = (token("yes")?, token("no")?);
    let prefix = tokenizer.encode(QWEN3_RERANKER_PREFIX, false)?;
    let suffix = tokenizer.encode(QWEN3_RERANKER_SUFFIX, false)?;
    let positions = loaded
        .config
        .get("max_position_embeddings")
        .and_then(Value::as_u64)
        .map_or(QWEN3_RERANKER_MAX_LENGTH, |p| p as usize);
    let max_length = QWEN3_RERANKER_MAX_LENGTH.min(positions);
    let body = max_length
        .checked_sub(prefix.len() + suffix.len())
        .filter(|b| *b > 0)
        .ok_or_else(|| {
            LoadError::Unsupported(format!(
                "{}: {max_length} positions leave no room for a document after the {}-token prompt",
                folder.display(),
                prefix.len() + suffix.len()
            ))
        })?;
    tokenizer.set_encoder_limits(Some(body))?;
    let pad_id = pad_token_id(&loaded.config);
    Ok(RerankerLoaded {
        model: RerankerBackbone::Generative(GenerativeScorer {
            model: loaded.model,
            prefix,
            suffix,
            yes,
            no,
            max_length,
        }),
        activation: ScoreActivation::Sigmoid,
        activation_source: "Qwen3-Reranker: P(yes) = sigmoid(logit yes - logit no)".into(),
        tokenizer,
        model_type: loaded.model_type,
        config: loaded.config,
        folder,
        dtype: loaded.dtype,
        max_tokens: Some(body),
        pad_id,
        load_seconds: started.elapsed().as_secs_f64(),
        mapped: loaded.mapped,
    })
}
