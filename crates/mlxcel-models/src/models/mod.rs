//! One file per architecture (its `ModelArgs`, checkpoint quirks and spec) on top of the shared
//! decoder in [`transformer`]. Each is registered by one row of `for_each_model_registration!`.

pub mod common;
pub mod transformer;

pub mod gemma;
pub mod gemma2;
pub mod gemma3_text;
pub mod llama;
pub mod mixtral;
pub mod olmoe;
pub mod phi3;
pub mod qwen2;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_moe;
