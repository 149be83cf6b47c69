use std::path::PathBuf;

/// Loading errors; each names the file, field or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{}: {source}", folder.display())]
    Model {
        folder: PathBuf,
        #[source]
        source: mlxcel_arch::ModelError,
    },
    #[error("{0}")]
    Unsupported(String),
    /// A model failed while running (generation).
    #[error(transparent)]
    Run(#[from] mlxcel_arch::ModelError),
    #[error(transparent)]
    Core(#[from] mlxcel_core::Error),
    #[error(transparent)]
    Quant(#[from] mlxcel_quant::QuantError),
    #[error(transparent)]
    Stream(#[from] mlxcel_stream::StreamError),
}

pub type Result<T, E = LoadError> = std::result::Result<T, E>;

impl LoadError {
    pub(crate) fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        LoadError::File {
            path: path.into(),
            message: message.into(),
        }
    }
}
