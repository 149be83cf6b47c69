//! # mlxcel-loading
//!
//! Owns the loading pipeline: resolve a path, read and sanitise `config.json`, decide the kind,
//! map the model type, look up the load policy, run the loader family, and hand back a
//! [`LoadedModel`] with its tokenizer.
//!
//! ```text
//! path ─ resolve_model_dir ─ config.json ─ sanitize_config_json ─ detect_kind
//!   ├─ Embedding: load_embedding_model ─ encoder + sentence-transformers head + tokenizer
//!   ├─ Reranker: load_reranker_model ─ cross-encoder + pair template + score activation
//!   └─ Generation ─ get_model_type ─ model_load_policy ─ directory route
//!        ├─ ConfigBacked: load_config_backed (generated from the registry) ─ LoadedModel
//!        └─ Nonstandard: load_nonstandard (a named loader per family) ──────┤
//!                                                                  └─ load_tokenizer
//! ```

#![warn(missing_docs)]

pub mod adapter;
mod chat;
mod embed;
mod error;
pub mod image;
pub mod memory;
mod pipeline;
pub mod ple;
pub mod repack;
mod rerank;
pub mod speculative;
pub mod stream;
pub mod surgery;
mod textgen;
mod tokenizer;
pub mod vision;

pub use chat::{ChatTemplate, Message, ToolCallFormat};
pub use embed::{
    load_embedding_model, EmbedOptions, EmbeddingBackbone, EmbeddingHead, EmbeddingLoaded, Overflow,
};
pub use error::{LoadError, Result};
pub use mlxcel_arch::{LanguageModel, LoadedModel, ModelType};
pub use mlxcel_core::RuntimePolicy;
pub use pipeline::{
    compute_dtype, load_model, read_config, resolve_model_dir, LoadOptions, LoadPhases, Loaded,
};
pub use rerank::{
    load_generative_reranker, load_reranker_model, EncodedPair, GenerativeScorer, RerankOptions,
    RerankerBackbone, RerankerLoaded, ScoreActivation, QWEN3_RERANKER_INSTRUCTION,
    QWEN3_RERANKER_MAX_LENGTH, QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX,
};
pub use speculative::{check_draft_tokenizer, generate_text_mtp, generate_text_speculative, Draft};
pub use textgen::{
    generate_text, generate_text_with, FinishReason, GenerateRequest, GenerationProgress,
    GenerationStats, LogitsProcessor, SpeculationStats, StepHooks, TokenLogprob,
};
pub use tokenizer::{load_tokenizer, DecodeProgress, StreamDecoder, TokenBytes, Tokenizer};
