//! # mlxcel-models
//!
//! Owns the model side: `ModelType`, detection from `config.json`, config sanitising, the
//! `for_each_model_registration!` registry, per-architecture `ModelArgs` and model code, the
//! `LanguageModel` trait, `LoadedModel`, KV caches, generation and sampling.
