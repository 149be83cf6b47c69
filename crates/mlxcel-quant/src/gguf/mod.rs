//! GGUF import: read llama.cpp's GGUF files and write an MLX checkpoint folder.
//!
//! - [`GgufFile`]: a GGUF v2/v3 reader over a memory map (metadata of every value type, tensor
//!   infos, `general.alignment`), with errors that name the file and the tensor at fault.
//! - [`blocks`]: ggml block decoding and the mapping onto MLX affine planes: exact for
//!   `Q4_0`/`Q4_1`/`Q5_0`/`Q5_1`/`Q8_0`/`Q4_K`/`Q5_K`, re-quantized with the error measured for
//!   `Q2_K`/`Q3_K`/`Q6_K` (their 16-weight sub-blocks have no MLX group size); the module docs
//!   say why for each.
//! - [`import_gguf`]: a llama, qwen2 or qwen3 GGUF → `config.json` (with mlx-lm's `quantization`
//!   block), `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` and
//!   `generation_config.json`. Block-quantized matrices become MLX affine planes (group 32) as
//!   [`blocks::mlx_mapping`] says; F32/F16/BF16 pass through; 1-D quantized tensors are decoded
//!   to float32; other types are an error naming the tensor and type. Llama 3's rope scaling,
//!   which llama.cpp stores as the `rope_freqs.weight` factor table, is turned back into
//!   `rope_scaling` (`rope_freqs` module).
//! - [`convert_gguf_cached`]: the same import, once per file content, into a cache folder.

mod arch;
pub mod blocks;
mod cache;
mod import;
mod reader;
mod rope_freqs;
mod tokenizer;
mod types;

use std::path::{Path, PathBuf};

pub use cache::{convert_gguf_cached, gguf_cache_key, CachedConversion, IMPORT_FORMAT};
pub use import::{
    hf_tensor_name, import_gguf, unpermute_rope_rows, ImportReport, TensorImport,
    SUPPORTED_ARCHITECTURES,
};
pub use reader::{GgufFile, GgufTensorInfo, MetaValue};
pub use tokenizer::{build_tokenizer_files, TokenizerFiles};
pub use types::GgmlType;

/// Errors reading or importing a GGUF file; each names the file and, where it applies, the
/// tensor or metadata key.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened, mapped or read.
    #[error("{path}: {source}")]
    Io {
        /// The GGUF file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The header is malformed or truncated.
    #[error("{path}: {message}")]
    Format {
        /// The GGUF file.
        path: PathBuf,
        /// What is wrong with the header.
        message: String,
    },
    /// A tensor's info or data is inconsistent (shape, offset, size out of the file).
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        /// The GGUF file.
        path: PathBuf,
        /// The tensor's GGUF name.
        tensor: String,
        /// What is wrong with it.
        message: String,
    },
    /// A tensor's type id is not one GGUF has defined.
    #[error("{path}: tensor `{tensor}` has ggml type id {type_id}, which is not a known type")]
    UnknownType {
        /// The GGUF file.
        path: PathBuf,
        /// The tensor's GGUF name.
        tensor: String,
        /// The id stored in the file.
        type_id: u32,
    },
    /// A tensor's type is known but cannot be imported.
    #[error(
        "{path}: tensor `{tensor}` is {ggml_type}, which cannot be imported (supported: F32, F16, \
         BF16 as they are; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K losslessly as MLX affine; \
         Q2_K, Q3_K, Q6_K re-quantized to MLX affine 8-bit; no IQ, TQ or MXFP4 types)"
    )]
    UnsupportedType {
        /// The GGUF file.
        path: PathBuf,
        /// The tensor's GGUF name.
        tensor: String,
        /// Its type.
        ggml_type: GgmlType,
    },
    /// A metadata key the import needs is missing or has the wrong type or value.
    #[error("{path}: metadata `{key}`: {message}")]
    Metadata {
        /// The GGUF file.
        path: PathBuf,
        /// The metadata key (`llama.block_count`, `tokenizer.ggml.tokens`, ...).
        key: String,
        /// What is wrong with it.
        message: String,
    },
    /// MLX failed converting a tensor, or writing the imported checkpoint failed.
    #[error("{path}: {source}")]
    Mlx {
        /// The GGUF file being imported, or the `model.safetensors` being written.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: mlxcel_core::Error,
    },
}

impl GgufError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        GgufError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn format(path: &Path, message: impl Into<String>) -> Self {
        GgufError::Format {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }

    pub(crate) fn tensor(path: &Path, tensor: &str, message: impl Into<String>) -> Self {
        GgufError::Tensor {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
            message: message.into(),
        }
    }

    pub(crate) fn metadata(path: &Path, key: &str, message: impl Into<String>) -> Self {
        GgufError::Metadata {
            path: path.to_path_buf(),
            key: key.to_string(),
            message: message.into(),
        }
    }

    pub(crate) fn mlx(path: &Path, source: mlxcel_core::Error) -> Self {
        GgufError::Mlx {
            path: path.to_path_buf(),
            source,
        }
    }
}
