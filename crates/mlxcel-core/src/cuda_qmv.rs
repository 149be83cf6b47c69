//! mlxcel's decode GEMV for MLX affine 4/8-bit weights on the CUDA backend, a custom kernel
//! (`kernels/cuda/qmv.cu`) launched through MLX's `fast::cuda_kernel`. MLX 0.32.4's own
//! quantized GEMV reads 4-bit weights at ~20% of an H200's bandwidth; this one streams each
//! row in 16-byte loads, folds scale and bias per group (`scale * (q . x) + bias * sum(x)`) and
//! accumulates in float32.
//!
//! `MLXCEL_CUDA_QMV` selects it: `NWxRPW` (warps per block x output rows per block, e.g. `4x4`),
//! or `0` to keep MLX's kernel. Only rows of activations up to [`MAX_ROWS`] take this path (the
//! kernel re-reads the weights per row; prefill stays on MLX's GEMM).

use crate::kernel::{cuda_kernel, KernelOutput};
use crate::ops::{QuantMode, QuantSpec};
use crate::{Array, Dtype, Result};

const SOURCE: &str = include_str!("../kernels/cuda/qmv.cu");
pub(crate) const HEADER: &str = include_str!("../kernels/cuda/qmv_header.cuh");
/// Part of every kernel name: MLX caches compiled kernels by name, so a changed source needs a
/// new one.
const SOURCE_VERSION: &str = "v1";
/// Up to this many rows of activations (decode, small speculative batches).
pub const MAX_ROWS: usize = 4;
/// The launch shape when `MLXCEL_CUDA_QMV` is unset.
const DEFAULT: Option<(i32, i32)> = None;

fn launch_shape() -> Option<(i32, i32)> {
    static SHAPE: std::sync::OnceLock<Option<(i32, i32)>> = std::sync::OnceLock::new();
    *SHAPE.get_or_init(|| match std::env::var("MLXCEL_CUDA_QMV") {
        Err(_) => DEFAULT,
        Ok(v) => {
            let v = v.trim().to_ascii_lowercase();
            let (nw, rpw) = v.split_once('x')?;
            let (nw, rpw) = (nw.parse().ok()?, rpw.parse().ok()?);
            ((1..=32).contains(&nw) && (1..=nw * 32).contains(&rpw)).then_some((nw, rpw))
        }
    })
}

/// Whether `x @ dequantize(w)^T` runs on this kernel: CUDA build with the GPU as default device,
/// the kernel enabled, affine 4/8-bit with group size 32/64/128, K a multiple of 32, at most
/// [`MAX_ROWS`] rows, float activations with scales of the same dtype.
pub(crate) fn applies(x: &Array, weight: &Array, scales: &Array, spec: QuantSpec) -> Result<bool> {
    if !cfg!(target_os = "linux") || launch_shape().is_none() {
        return Ok(false);
    }
    if spec.mode != QuantMode::Affine
        || !matches!(spec.bits, 4 | 8)
        || !matches!(spec.group_size, 32 | 64 | 128)
        || weight.ndim() != 2
    {
        return Ok(false);
    }
    let k = x.dim(-1)? as usize;
    let dtype = x.dtype()?;
    Ok(k % 32 == 0
        && k > 0
        && x.size() / k <= MAX_ROWS
        && matches!(dtype, Dtype::Bfloat16 | Dtype::Float16 | Dtype::Float32)
        && scales.dtype()? == dtype
        && crate::default_device()? == crate::Device::Gpu)
}

/// Runs the kernel; callers check [`applies`] first.
pub(crate) fn qmv(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
) -> Result<Array> {
    let (nw, rpw) = launch_shape().expect("applies() checked the launch shape");
    let dtype = x.dtype()?;
    let k = x.dim(-1)?;
    let rows = (x.size() / k as usize) as i32;
    let n = weight.dim(0)?;
    let name = format!("mlxcel_qmv_{SOURCE_VERSION}_{}", dtype.name());
    // The kernel reads x as [rows, K] whatever its leading dimensions, so neither x nor the
    // output is reshaped: every extra graph node costs MLX dispatch time in decode.
    let mut shape = x.shape();
    *shape.last_mut().expect("x has a last dimension") = n;
    // Float32 outputs need the exact nibble arithmetic; half precision takes the faster form
    // whose ~2e-5 relative error is far below its own rounding.
    let fast = i32::from(spec.bits == 4 && dtype != Dtype::Float32);
    let kernel = cuda_kernel(
        &name,
        &["w", "scales", "biases", "x"],
        &["out"],
        SOURCE,
        HEADER,
    )?;
    let blocks = (n + rpw - 1) / rpw;
    let out = kernel.call(
        &[weight.clone(), scales.clone(), biases.clone(), x.clone()],
        &[KernelOutput { shape, dtype }],
        [blocks * nw * 32, rows, 1],
        [nw * 32, 1, 1],
        &[
            ("BITS", spec.bits),
            ("NW", nw),
            ("RPW", rpw),
            ("NOALLOC", 1),
            ("FAST", fast),
        ],
    )?;
    Ok(out.into_iter().next().expect("one output"))
}
