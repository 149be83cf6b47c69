//! # mlxcel-loading
//!
//! Owns the loading pipeline: resolve a path, read and sanitise `config.json`, decide the kind,
//! map the model type, look up the load policy, run the loader family, and hand back a
//! `LoadedModel` with its tokenizer; tied embeddings, the surgery hook, LoRA, tokenizer and chat
//! template loading.
