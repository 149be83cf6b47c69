//! One file per architecture (its `ModelArgs`, checkpoint quirks and spec) on top of the shared
//! decoder in [`transformer`] (see the crate README for how to add one). Each is registered by one row of `for_each_model_registration!`.

pub mod common;
pub mod transformer;

pub mod bamba;
pub mod bert;
pub mod cohere;
pub mod deepseek;
pub mod exaone4;
pub mod gemma;
pub mod gemma2;
pub mod gemma3_text;
pub mod glm4;
pub mod granite;
pub mod jamba;
pub mod llama;
pub mod mamba;
pub mod mamba2;
pub mod mixtral;
pub mod modernbert;
pub mod olmoe;
pub mod phi3;
pub mod qwen2;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod rwkv7;
pub mod starcoder2;
