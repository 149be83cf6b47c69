//! The error type shared by the bridge and weight I/O.

use std::path::PathBuf;

/// Errors from MLX and from reading checkpoints. Every variant names what is at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// MLX threw: a shape mismatch, an unsupported dtype or mode, a device error.
    #[error("MLX: {0}")]
    Mlx(String),
    /// A call was made with arguments the bridge refuses before reaching MLX.
    #[error("{0}")]
    Invalid(String),
    /// A runtime variable (`MLXCEL_*`) holds a value that is not one of its documented forms
    /// (see [`crate::policy::RuntimePolicy`]).
    #[error("{var}={value}: expected {expected}")]
    Policy {
        /// The variable's name.
        var: String,
        /// The value it holds.
        value: String,
        /// The forms it accepts.
        expected: String,
    },
    /// Host data and array element types disagree.
    #[error("dtype mismatch: array is {array}, requested {requested}")]
    DtypeMismatch {
        /// The array's element type.
        array: crate::Dtype,
        /// The host type's element type.
        requested: crate::Dtype,
    },
    /// A file could not be opened, mapped or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint file or tensor is malformed.
    #[error("{path}: {message}")]
    Checkpoint {
        /// The file (or checkpoint folder).
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A tensor was asked for that no file defines.
    #[error("tensor `{name}` is not in the checkpoint at {folder}")]
    MissingTensor {
        /// The tensor's name.
        name: String,
        /// The checkpoint folder searched.
        folder: PathBuf,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<cxx::Exception> for Error {
    fn from(e: cxx::Exception) -> Self {
        Error::Mlx(e.what().to_string())
    }
}

impl Error {
    pub(crate) fn checkpoint(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            message: message.into(),
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
