//! # mlxcel-quant
//!
//! Owns quantization: the formats MLX supports (affine 1–8 bit, mxfp4, mxfp8, nvfp4),
//! [`QuantizedWeight`], shape-based bit-width inference ([`infer_quantization_bits`]), the
//! per-tensor configuration MLX checkpoints carry ([`QuantConfig`]), lossless GGUF import
//! ([`gguf`]), recipes ([`recipe`]), importance-weighted affine quantization
//! ([`importance`]) and fp8-block → mxfp8 requantization ([`fp8`]).

#![warn(missing_docs)]

mod config;
pub mod fp8;
pub mod importance;
pub mod recipe;
mod weight;

pub use config::{QuantConfig, TensorQuant};
pub use mlxcel_core::ops::{QuantMode, QuantSpec, Quantized};
pub use recipe::{Format, Recipe, Role};
pub use weight::{infer_quantization_bits, QuantizedWeight};

/// Errors of this crate; each names the tensor or config field at fault.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    /// A tensor's planes or shapes do not form a valid quantized layout (a packed width no
    /// bit width fits, scales that disagree with the weight, an unsupported mode).
    #[error("tensor `{tensor}`: {message}")]
    Layout {
        /// The tensor at fault.
        tensor: String,
        /// What is wrong with it.
        message: String,
    },
    /// A quantization field of `config.json` is missing, of the wrong type or out of range.
    #[error("config.json `{field}`: {message}")]
    Config {
        /// The field's path (`quantization.group_size`, an override's module path, ...).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// MLX or checkpoint I/O failed underneath.
    #[error(transparent)]
    Core(#[from] mlxcel_core::Error),
}

/// `Result` with this crate's [`QuantError`].
pub type Result<T, E = QuantError> = std::result::Result<T, E>;

pub mod gguf;
