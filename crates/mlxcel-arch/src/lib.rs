//! # mlxcel-arch
//!
//! Owns the model side: [`ModelType`] and detection from `config.json`
//! ([`detection`]), config sanitising ([`config::sanitize_config_json`]), the
//! [`for_each_model_registration!`] registry, per-architecture `ModelArgs` and model code
//! ([`models`]), the [`LanguageModel`] trait, [`LoadedModel`], and per-layer caches ([`cache`]).
//! The seams are described in this crate's README.

#![warn(missing_docs)]

pub mod cache;
pub mod config;
pub mod detection;
pub mod embedding;
mod error;
pub mod generate;
pub mod model;
pub mod models;
pub mod nn;
pub mod nonstandard;
pub mod parallel;
pub mod registry;
pub mod rerank;
pub mod sampling;
pub mod sanitize;
pub mod validate;
pub mod vision;
pub mod weights;

pub use cache::{BatchCache, LayerCache, Mask};
pub use embedding::{EmbeddingModel, Pooling};
pub use error::{ModelError, Result};
pub use model::{Architecture, LanguageModel, LayerKind, MultiTokenPrediction};
pub use models::mistral3::load as load_mistral3;
pub use nonstandard::load_nonstandard;
pub use registry::{
    adapter_support, cache_schedule, load_config_backed, model_load_policy, registry_markdown,
    sanitized_weights, BuildOptions, DirectoryRoute, EmbeddingModelEnum, GenerationModel,
    LoadedModel, ModelKind, ModelLoadPolicy, ModelType, RerankerModelEnum, StaticModelDescriptor,
    WeightRoute, WeightTransform, WeightTransformFn, ADAPTERS_AVAILABLE, DESCRIPTORS,
};
pub use rerank::RerankerModel;
pub use vision::load_vlm;
