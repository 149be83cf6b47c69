//! # mlxcel-quant
//!
//! Owns quantization: the formats MLX supports (affine 1–8 bit, mxfp4, mxfp8, nvfp4),
//! `QuantizedWeight`, shape-based bit-width inference, fp8-block → mxfp8 requantization, recipes
//! (which tensor gets which format) and GGUF block import.

pub use mlxcel_core::ops::{QuantMode, QuantSpec, Quantized};

pub mod gguf;
