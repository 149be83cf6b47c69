use std::path::PathBuf;

/// Loading errors; each names the file, field or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file of the model folder is missing, unreadable or invalid (`config.json`,
    /// `tokenizer.json`, a safetensors shard, ...).
    #[error("{path}: {message}")]
    File {
        /// The file (or folder) at fault.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The model in `folder` could not be built (a config key, a tensor's shape or dtype, an
    /// unused tensor, ...).
    #[error("{}: {source}", folder.display())]
    Model {
        /// The model folder.
        folder: PathBuf,
        /// The model layer's error, naming the key or tensor.
        #[source]
        source: mlxcel_arch::ModelError,
    },
    /// A request this build cannot serve (an unsupported checkpoint kind, a chat template that
    /// does not parse or render, a bad parameter), with the reason.
    #[error("{0}")]
    Unsupported(String),
    /// A model failed while running (generation).
    #[error(transparent)]
    Run(#[from] mlxcel_arch::ModelError),
    /// An MLX operation or a checkpoint read failed.
    #[error(transparent)]
    Core(#[from] mlxcel_core::Error),
    /// The checkpoint's quantization config is invalid.
    #[error(transparent)]
    Quant(#[from] mlxcel_quant::QuantError),
    /// Planning or reading the expert stream failed.
    #[error(transparent)]
    Stream(#[from] mlxcel_stream::StreamError),
}

/// A result whose error defaults to [`LoadError`].
pub type Result<T, E = LoadError> = std::result::Result<T, E>;

impl LoadError {
    pub(crate) fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        LoadError::File {
            path: path.into(),
            message: message.into(),
        }
    }
}
