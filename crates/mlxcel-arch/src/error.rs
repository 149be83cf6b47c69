//! Errors of model construction and execution; each names the config field or tensor at fault.

use mlxcel_quant::QuantError;

/// Why a model could not be built or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `config.json` lacks a field or holds a value the architecture cannot use.
    #[error("config.json: {0}")]
    Config(String),
    /// A request the model cannot serve (an empty prompt, a token id outside the vocabulary, a
    /// cache of the wrong kind): a problem with the call, not with the checkpoint.
    #[error("{0}")]
    Runtime(String),
    /// A tensor the architecture needs is not in the checkpoint.
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    /// A tensor exists with another shape than the config implies.
    #[error("tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    Shape {
        /// The tensor's checkpoint name.
        tensor: String,
        /// Its shape in the checkpoint.
        found: Vec<i32>,
        /// The shape the config implies.
        expected: Vec<i32>,
    },
    /// A tensor is stored with a dtype its role cannot have (a norm weight or scale stored as
    /// integers).
    #[error("tensor `{tensor}` has dtype {found}, expected {expected}")]
    Dtype {
        /// The tensor's checkpoint name.
        tensor: String,
        /// Its dtype in the checkpoint.
        found: String,
        /// The dtype (or dtype family) its role needs.
        expected: String,
    },
    /// The checkpoint holds tensors the architecture does not use (a wrong model type, or a
    /// checkpoint for another variant): loading them silently would hide the mismatch.
    #[error("unexpected tensors not used by {model}: {}{}", names.iter().take(8).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "), if names.len() > 8 { format!(" and {} more", names.len() - 8) } else { String::new() })]
    UnexpectedTensors {
        /// The architecture being built.
        model: String,
        /// The unused tensor names.
        names: Vec<String>,
    },
    /// A load-time edit of the weights (surgery, a fused adapter) failed; the message names the
    /// rule or adapter file and the tensor. Nothing of the edit was applied.
    #[error("{0}")]
    Transform(String),
    /// An error in one part of a composite model (a vision-language model's text decoder or
    /// vision tower), naming the part.
    #[error("{part}: {source}")]
    InPart {
        /// The part, e.g. ``model_type `gemma3`: text decoder `gemma3_text` (text_config)``.
        part: String,
        /// What went wrong there.
        #[source]
        source: Box<ModelError>,
    },
    /// Something this build does not support, with the reason.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A quantization config or packed tensor is invalid.
    #[error(transparent)]
    Quant(#[from] QuantError),
    /// Expert streaming failed (a bad manifest, or reading an expert file failed).
    #[error(transparent)]
    Stream(#[from] mlxcel_stream::StreamError),
    /// An MLX operation or a checkpoint read failed.
    #[error(transparent)]
    Core(#[from] mlxcel_core::Error),
}

/// A result whose error defaults to [`ModelError`].
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
