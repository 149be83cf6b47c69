//! MLX's custom-kernel entry points (`mlx::core::fast::metal_kernel` / `cuda_kernel`): an engine
//! can ship its own GPU kernels (e.g. a quantized GEMV) without rebuilding MLX. On a build
//! without the matching backend, creating or calling a kernel returns an error.

use cxx::UniquePtr;

use crate::array::ArrayList;
use crate::ffi::bridge::{self, CustomKernel};
use crate::{Array, Dtype, Error, Result};

/// Which GPU language the kernel source is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelBackend {
    /// Metal Shading Language (Apple GPUs).
    Metal,
    /// CUDA C++ (NVIDIA GPUs, compiled with NVRTC).
    Cuda,
}

/// A kernel compiled on first call and cached by MLX under its name.
pub struct Kernel {
    raw: UniquePtr<CustomKernel>,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The compiled kernel is opaque (a C++ object); MLX keeps its source and name.
        f.debug_struct("Kernel").finish_non_exhaustive()
    }
}

/// One output of a kernel call.
#[derive(Debug, Clone)]
pub struct KernelOutput {
    /// The output's shape.
    pub shape: Vec<i32>,
    /// The output's element type.
    pub dtype: Dtype,
}

impl Kernel {
    /// `source` is the kernel body; MLX generates the signature from the input and output
    /// names (see MLX's documentation of `metal_kernel` / `cuda_kernel`).
    pub fn new(
        backend: KernelBackend,
        name: &str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
    ) -> Result<Kernel> {
        let backend = match backend {
            KernelBackend::Metal => "metal",
            KernelBackend::Cuda => "cuda",
        };
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let raw = bridge::custom_kernel_new(
            backend,
            name,
            &names(inputs),
            &names(outputs),
            source,
            header,
        )?;
        Ok(Kernel { raw })
    }

    /// Launches the kernel over `grid` threads in groups of `threadgroup`; `template` sets
    /// integer template parameters.
    pub fn call(
        &self,
        inputs: &[Array],
        outputs: &[KernelOutput],
        grid: [i32; 3],
        threadgroup: [i32; 3],
        template: &[(&str, i32)],
    ) -> Result<Vec<Array>> {
        let kernel = self
            .raw
            .as_ref()
            .ok_or_else(|| Error::Invalid("kernel handle is null".into()))?;
        let list = ArrayList::new(inputs)?;
        let shapes: Vec<i32> = outputs.iter().flat_map(|o| o.shape.clone()).collect();
        let ndims: Vec<i32> = outputs.iter().map(|o| o.shape.len() as i32).collect();
        let dtypes: Vec<Dtype> = outputs.iter().map(|o| o.dtype).collect();
        let tnames: Vec<String> = template.iter().map(|(n, _)| n.to_string()).collect();
        let tvalues: Vec<i32> = template.iter().map(|(_, v)| *v).collect();
        let out = bridge::custom_kernel_call(
            kernel,
            list.as_ref(),
            &shapes,
            &ndims,
            &dtypes,
            &grid,
            &threadgroup,
            &tnames,
            &tvalues,
        )?;
        ArrayList::from_raw(out).into_vec()
    }
}
