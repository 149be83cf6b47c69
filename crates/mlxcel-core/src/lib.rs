//! # mlxcel-core
//!
//! Owns the bridge to Apple's MLX array library and everything below the model code:
//!
//! - [`Array`], [`Dtype`], [`Device`]: a safe handle over `mlx::core::array`, with every MLX call
//!   fallible (MLX's C++ exceptions become [`Error::Mlx`], never an abort);
//! - the ops transformer, MoE and SSM inference needs (methods on [`Array`] and functions in
//!   [`ops`]), including quantized matmuls in every MLX mode and the fused `fast` kernels;
//! - [`WeightMap`]: safetensors checkpoints opened over memory maps, tensors materialised as
//!   arrays on demand, with a materialisation policy ([`Materialization`]);
//! - memory statistics ([`memory`]) and the shared [`Error`] type.
//!
//! MLX itself is located at build time (see the crate's `build.rs` and the workspace README):
//! `MLX_DIR`, an importable Python `mlx`, or the `mlx-cpu` wheel from PyPI.

#![warn(missing_docs)]

mod array;
pub mod cpu_decode;
pub mod cuda_decode;
pub mod cuda_kernels;
mod device;
pub mod distributed;
mod dtype;
mod error;
mod ffi;
pub mod kernel;
pub mod memory;
pub mod ops;
pub mod policy;
pub mod weights;

pub use array::{Array, HostElement};
pub use device::{default_device, set_default_device, Device};
pub use dtype::Dtype;
pub use error::{Error, Result};
pub use policy::RuntimePolicy;
pub use weights::{DeviceReads, MappedFiles, Materialization, TensorInfo, WeightMap};

/// The version string of the MLX library this process is running against (which may differ from
/// the one it was built against when `LD_LIBRARY_PATH` selects another `libmlx`).
pub fn mlx_version() -> Result<String> {
    Ok(ffi::bridge::mlx_version()?)
}

/// mlxcel's cache folder (downloads, imported models): `MLXCEL_CACHE_DIR`, else
/// `$HOME/.cache/mlxcel`; `None` when neither is set. (The build script resolves the same
/// folder for the MLX wheel on its own, as it cannot call this crate.)
pub fn cache_dir() -> Option<std::path::PathBuf> {
    if let Some(dir) = std::env::var_os("MLXCEL_CACHE_DIR") {
        return Some(dir.into());
    }
    std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache").join("mlxcel"))
}

/// The folder of the `libmlx` this crate was linked against (its RUNPATH).
pub const MLX_LIB_DIR: &str = env!("MLXCEL_MLX_LIB_DIR");
