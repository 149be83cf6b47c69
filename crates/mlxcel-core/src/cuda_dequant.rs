//! mlxcel's dequantization of MLX affine 4/8-bit matrices on the CUDA backend, a custom kernel
//! (`kernels/cuda/dequant.cu`) launched through MLX's `fast::cuda_kernel`. GPU prefill runs
//! quantized layers as dequantize + dense GEMM; MLX 0.32.4's own `dequantize` moves ~1.1 TB/s on
//! an H200 and took as long as the GEMM it feeds, this kernel streams at the copy bandwidth.
//!
//! On by default wherever it applies; `MLXCEL_CUDA_DEQUANT=0` keeps MLX's `dequantize`.

use crate::kernel::{cuda_kernel, KernelOutput};
use crate::ops::{QuantMode, QuantSpec};
use crate::{Array, Dtype, Result};

const SOURCE: &str = include_str!("../kernels/cuda/dequant.cu");
/// Part of the kernel name: MLX caches compiled kernels by name, so a changed source needs a
/// new one.
const SOURCE_VERSION: &str = "v1";
const THREADS: i32 = 256;

fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MLXCEL_CUDA_DEQUANT").map_or(true, |v| v.trim() != "0"))
}

/// Whether dequantizing `weight` to `dtype` runs on this kernel: Linux (where MLX's GPU backend
/// is CUDA) with the GPU as default device, affine 4/8-bit with group size 32/64/128, a 2-D matrix whose rows hold a
/// multiple of 32 elements, biases present, and scales and biases already in `dtype`.
pub(crate) fn applies(
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    spec: QuantSpec,
    dtype: Dtype,
) -> Result<bool> {
    let Some(biases) = biases else {
        return Ok(false);
    };
    if !cfg!(target_os = "linux")
        || !enabled()
        || spec.mode != QuantMode::Affine
        || !matches!(spec.bits, 4 | 8)
        || !matches!(spec.group_size, 32 | 64 | 128)
        || weight.ndim() != 2
        || !matches!(dtype, Dtype::Bfloat16 | Dtype::Float16 | Dtype::Float32)
    {
        return Ok(false);
    }
    let (rows, words) = (weight.dim(0)? as i64, weight.dim(1)? as i64);
    Ok((words * 32 / spec.bits as i64) % 32 == 0
        && rows * words / 4 < i32::MAX as i64 / 2
        && weight.dtype()? == Dtype::Uint32
        && scales.dtype()? == dtype
        && biases.dtype()? == dtype
        && crate::default_device()? == crate::Device::Gpu)
}

/// Runs the kernel; callers check [`applies`] first.
pub(crate) fn dequantize(
    weight: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
    dtype: Dtype,
) -> Result<Array> {
    let (n, words) = (weight.dim(0)?, weight.dim(1)?);
    let k = words * 32 / spec.bits;
    let name = format!("mlxcel_dequant_{SOURCE_VERSION}_{}", dtype.name());
    let kernel = cuda_kernel(
        &name,
        &["w", "scales", "biases"],
        &["out"],
        SOURCE,
        crate::cuda_qmv::HEADER,
    )?;
    let chunks = n * (words / 4);
    let threads = (chunks + THREADS - 1) / THREADS * THREADS;
    let out = kernel.call(
        &[weight.clone(), scales.clone(), biases.clone()],
        &[KernelOutput {
            shape: vec![n, k],
            dtype,
        }],
        [threads, 1, 1],
        [THREADS, 1, 1],
        &[("BITS", spec.bits)],
    )?;
    Ok(out.into_iter().next().expect("one output"))
}
