//! Vision-language models: a vision tower and projector per family, feeding a registered text
//! decoder through input embeddings and explicit positions.

pub mod qwen2_vl;
