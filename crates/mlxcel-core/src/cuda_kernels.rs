//! mlxcel's own CUDA kernels for MLX affine 4/8-bit weights (sources in `kernels/cuda/`):
//!
//! - **dequant** (`dequant.cu`): a quantized matrix to bf16/f16/f32. GPU prefill runs quantized
//!   layers as dequantize + dense GEMM; MLX 0.32.4's `dequantize` moves ~1.1 TB/s on an H200
//!   and took about as long as the GEMM it feeds. On by default; `MLXCEL_CUDA_DEQUANT=0` keeps
//!   MLX's.
//! - **qmv** (`qmv.cu`): the decode GEMV (up to [`QMV_MAX_ROWS`] rows of activations). MLX's
//!   quantized GEMV reads 4-bit weights at ~20% of the bandwidth; this one streams rows in
//!   16-byte loads and folds scale and bias per group, and its launches cost MLX less host
//!   time (decode on the 8B 4-bit shape: 188-222 against 155-171 tok/s with MLX's). On by
//!   default with 4 warps x 4 rows per block; `MLXCEL_CUDA_QMV=0` keeps MLX's, `NWxRPW` picks
//!   another launch shape (an unreadable value keeps the default).
//!
//! Each is compiled with the NVRTC that MLX's CUDA build loads into the process, at its first use
//! on a machine: the cubin is cached under [`crate::cache_dir`]`/cuda/`, keyed by the source and
//! the GPU architecture, so later processes only load it. Calls go through MLX's
//! `fast::precompiled_cuda_kernel`, which neither recompiles per process nor rebuilds the source
//! per call as `fast::cuda_kernel` does (MLX 0.32.4 spends 1-2 s per kernel and process on the
//! former, and host time in every decode step on the latter).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::array::ArrayList;
use crate::ffi::bridge::{self, CudaBinary};
use crate::ops::{QuantMode, QuantSpec};
use crate::{Array, Dtype, Error, Result};

const PRELUDE: &str = include_str!("../kernels/cuda/prelude.cuh");
const HEADER: &str = include_str!("../kernels/cuda/qmv_header.cuh");
const QMV: &str = include_str!("../kernels/cuda/qmv.cu");
const DEQUANT: &str = include_str!("../kernels/cuda/dequant.cu");
/// Up to this many rows of activations take the GEMV (decode, small speculative batches).
pub const QMV_MAX_ROWS: usize = 4;
const DEQUANT_THREADS: i32 = 256;
/// The GEMV's launch shape unless `MLXCEL_CUDA_QMV` picks another.
const DEFAULT_QMV_SHAPE: (i32, i32) = (4, 4);
const BITS: [i32; 2] = [4, 8];
const DTYPES: [Dtype; 3] = [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32];

fn switch(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_ascii_lowercase())
}

fn dequant_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| switch("MLXCEL_CUDA_DEQUANT").is_none_or(|v| v != "0"))
}

/// The GEMV's launch shape (warps per block, rows per block), `None` when switched off.
fn qmv_shape() -> Option<(i32, i32)> {
    static SHAPE: OnceLock<Option<(i32, i32)>> = OnceLock::new();
    *SHAPE.get_or_init(|| {
        let parse = |v: &str| {
            let (nw, rpw) = v.split_once('x')?;
            let (nw, rpw): (i32, i32) = (nw.parse().ok()?, rpw.parse().ok()?);
            ((1..=32).contains(&nw) && (1..=nw * 32).contains(&rpw)).then_some((nw, rpw))
        };
        match switch("MLXCEL_CUDA_QMV").as_deref() {
            Some("0") => None,
            Some(v) => Some(parse(v).unwrap_or(DEFAULT_QMV_SHAPE)),
            None => Some(DEFAULT_QMV_SHAPE),
        }
    })
}

fn type_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Bfloat16 => "mlxcel_bf16",
        Dtype::Float16 => "mlxcel_f16",
        _ => "float",
    }
}

/// One compiled kernel: its `extern "C"` name and the source of a module holding just it (one
/// module per kernel keeps the image small: MLX copies it into every call's graph node).
struct Entry {
    name: String,
    /// `qmv.cu` or `dequant.cu`.
    kernel: &'static str,
    /// The `extern "C"` function instantiating it.
    wrapper: String,
}

impl Entry {
    fn source(&self) -> String {
        [PRELUDE, HEADER, self.kernel, &self.wrapper].join("\n")
    }
}

/// Which kernel, as calls name it: cheap to hash, so a call finds its compiled image without
/// building any source text (that happens once per kernel, in [`binary`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum KernelId {
    Dequant {
        bits: i32,
        dtype: Dtype,
    },
    Qmv {
        bits: i32,
        dtype: Dtype,
        shape: (i32, i32),
    },
}

impl KernelId {
    fn entry(self) -> Entry {
        match self {
            KernelId::Dequant { bits, dtype } => dequant_entry(bits, dtype),
            KernelId::Qmv { bits, dtype, shape } => qmv_entry(bits, dtype, shape),
        }
    }
}

fn dequant_entry(bits: i32, dtype: Dtype) -> Entry {
    let (name, t) = (
        format!("mlxcel_dequant_b{bits}_{}", dtype.name()),
        type_name(dtype),
    );
    let wrapper = format!(
        "extern \"C\" __global__ void {name}(const uint32_t* w, const {t}* scales, \
         const {t}* biases, {t}* out, int n_rows, int words_per_row, int groups_per_row) {{ \
         dequant<{bits}, {t}>(w, scales, biases, out, n_rows, words_per_row, groups_per_row); }}\n"
    );
    Entry {
        name,
        kernel: DEQUANT,
        wrapper,
    }
}

fn qmv_entry(bits: i32, dtype: Dtype, (nw, rpw): (i32, i32)) -> Entry {
    let (t, threads) = (type_name(dtype), nw * 32);
    let name = format!("mlxcel_qmv_b{bits}_{}_{nw}x{rpw}", dtype.name());
    // Float32 outputs need the exact nibble arithmetic (FAST=0); see qmv_header.cuh.
    let fast = i32::from(bits == 4 && dtype != Dtype::Float32);
    let wrapper = format!(
        "extern \"C\" __global__ void __launch_bounds__({threads}) {name}(const uint32_t* w, \
         const {t}* scales, const {t}* biases, const {t}* x, {t}* out, int n_rows, \
         int words_per_row, int groups_per_row) {{ qmv<{bits}, {nw}, {rpw}, 1, {fast}, {t}>(w, \
         scales, biases, x, out, n_rows, words_per_row, groups_per_row); }}\n"
    );
    Entry {
        name,
        kernel: QMV,
        wrapper,
    }
}

/// Every kernel of this build in one source (public so it can be compile-checked with NVRTC off
/// the GPU machine: `cargo run -p mlxcel-core --example cuda_kernels -- --source`).
pub fn module_source() -> String {
    let mut src = [PRELUDE, HEADER, QMV, DEQUANT].join("\n");
    for bits in BITS {
        for dtype in DTYPES {
            src += &dequant_entry(bits, dtype).wrapper;
            src += &qmv_entry(bits, dtype, qmv_shape().unwrap_or(DEFAULT_QMV_SHAPE)).wrapper;
        }
    }
    src
}

/// FNV-1a, to name cache files after their source.
fn fingerprint(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A loaded kernel: its compiled image and `extern "C"` name, kept for the life of the process
/// (like MLX's own loaded kernels), or why it could not be built.
type Loaded = std::result::Result<(&'static CudaBinary, &'static str), String>;

/// The compiled image and entry-point name of `id` for this process's GPU: from memory, from
/// the disk cache, or compiled now (and cached on disk for the next process).
fn binary(id: KernelId) -> Result<(&'static CudaBinary, &'static str)> {
    static BINARIES: OnceLock<Mutex<HashMap<KernelId, Loaded>>> = OnceLock::new();
    let mut binaries = BINARIES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let built = binaries.entry(id).or_insert_with(|| {
        let entry = id.entry();
        let build = || -> Result<&'static CudaBinary> {
            let arch = bridge::cuda_device_arch()?;
            let source = entry.source();
            let file = crate::cache_dir().map(|d| {
                let key = fingerprint(&source);
                d.join("cuda")
                    .join(format!("{}-sm{arch}-{key:016x}.cubin", entry.name))
            });
            let image = match file.as_ref().and_then(|f| std::fs::read(f).ok()) {
                Some(image) => image,
                None => {
                    let image = bridge::cuda_compile(&source, &entry.name, arch)?;
                    if let Some(file) = &file {
                        save(file, &image);
                    }
                    image
                }
            };
            let binary = bridge::cuda_binary_new(&image)?;
            Box::leak(Box::new(binary))
                .as_ref()
                .ok_or_else(|| Error::Invalid("null CUDA module".into()))
        };
        match build() {
            Ok(binary) => Ok((binary, &*entry.name.leak())),
            Err(e) => Err(format!("mlxcel's CUDA kernel {}: {e}", entry.name)),
        }
    });
    built.clone().map_err(Error::Invalid)
}

/// Best effort (a cache): a temporary file renamed into place, so a reader never sees half.
fn save(file: &std::path::Path, image: &[u8]) {
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    let saved = file
        .parent()
        .map(std::fs::create_dir_all)
        .transpose()
        .is_ok()
        && std::fs::write(&tmp, image).is_ok()
        && std::fs::rename(&tmp, file).is_ok();
    if !saved {
        let _ = std::fs::remove_file(&tmp);
    }
}

fn on_gpu() -> Result<bool> {
    Ok(cfg!(target_os = "linux") && crate::default_device()? == crate::Device::Gpu)
}

fn call(
    id: KernelId,
    inputs: &[Array],
    shape: Vec<i32>,
    dtype: Dtype,
    scalars: &[i32],
    grid: [i32; 3],
    threadgroup: [i32; 3],
) -> Result<Array> {
    let (binary, name) = binary(id)?;
    let list = ArrayList::new(inputs)?;
    let ndims = [shape.len() as i32];
    let out = bridge::cuda_binary_call(
        binary,
        name,
        list.as_ref(),
        &shape,
        &ndims,
        &[dtype],
        scalars,
        &grid,
        &threadgroup,
    )?;
    Ok(ArrayList::from_raw(out).into_vec()?.remove(0))
}

/// Affine 4/8-bit, group size 32/64/128, a 2-D uint32 matrix with a multiple of 32 elements
/// per row, biases present, scales and biases in `dtype` (a float type).
fn affine_matrix(
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    spec: QuantSpec,
    dtype: Dtype,
) -> Result<bool> {
    let Some(biases) = biases else {
        return Ok(false);
    };
    if spec.mode != QuantMode::Affine
        || !BITS.contains(&spec.bits)
        || !matches!(spec.group_size, 32 | 64 | 128)
        || weight.ndim() != 2
        || !DTYPES.contains(&dtype)
    {
        return Ok(false);
    }
    let (rows, words) = (weight.dim(0)? as i64, weight.dim(1)? as i64);
    Ok((words * 32 / spec.bits as i64) % 32 == 0
        && rows * words < i32::MAX as i64
        && weight.dtype()? == Dtype::Uint32
        && scales.dtype()? == dtype
        && biases.dtype()? == dtype)
}

/// `n_rows, words_per_row, groups_per_row` of a quantized matrix.
fn matrix_scalars(weight: &Array, scales: &Array) -> Result<[i32; 3]> {
    Ok([weight.dim(0)?, weight.dim(1)?, scales.dim(1)?])
}

/// Whether dequantizing `weight` to `dtype` runs on mlxcel's kernel.
pub(crate) fn dequant_applies(
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    spec: QuantSpec,
    dtype: Dtype,
) -> Result<bool> {
    Ok(dequant_enabled() && on_gpu()? && affine_matrix(weight, scales, biases, spec, dtype)?)
}

/// `weight` dequantized to `dtype` `[N, K]` on mlxcel's kernel (affine 4/8-bit, see
/// `dequant_applies`; `ops::dequantize` picks it when it applies).
pub fn dequantize(
    weight: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
    dtype: Dtype,
) -> Result<Array> {
    let [n, words, groups] = matrix_scalars(weight, scales)?;
    let chunks = n * (words / 4);
    let threads = (chunks + DEQUANT_THREADS - 1) / DEQUANT_THREADS * DEQUANT_THREADS;
    call(
        KernelId::Dequant {
            bits: spec.bits,
            dtype,
        },
        &[weight.clone(), scales.clone(), biases.clone()],
        vec![n, words * 32 / spec.bits],
        dtype,
        &[n, words, groups],
        [threads, 1, 1],
        [DEQUANT_THREADS, 1, 1],
    )
}

/// Whether `x @ dequantize(w)^T` runs on mlxcel's GEMV: enabled, at most [`QMV_MAX_ROWS`] rows of
/// row-contiguous activations in the scales' dtype.
pub(crate) fn qmv_applies(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    spec: QuantSpec,
) -> Result<bool> {
    if qmv_shape().is_none() || !on_gpu()? {
        return Ok(false);
    }
    let dtype = x.dtype()?;
    let k = x.dim(-1)? as usize;
    Ok(
        k > 0
            && x.size() / k <= QMV_MAX_ROWS
            && affine_matrix(weight, scales, biases, spec, dtype)?,
    )
}

/// `x @ dequantize(w)^T` on mlxcel's GEMV (see `qmv_applies`; `ops::quantized_matmul` picks it
/// when it applies). Uses the `MLXCEL_CUDA_QMV` launch shape, else 4x4.
pub fn qmv(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
) -> Result<Array> {
    let (nw, rpw) = qmv_shape().unwrap_or(DEFAULT_QMV_SHAPE);
    let dtype = x.dtype()?;
    let k = x.dim(-1)?;
    let rows = (x.size() / k as usize) as i32;
    let [n, words, groups] = matrix_scalars(weight, scales)?;
    // The kernel reads x as [rows, K] whatever its leading dimensions, so neither x nor the
    // output is reshaped: every extra graph node costs MLX dispatch time in decode.
    let mut shape = x.shape();
    *shape.last_mut().expect("x has a last dimension") = n;
    let blocks = (n + rpw - 1) / rpw;
    call(
        KernelId::Qmv {
            bits: spec.bits,
            dtype,
            shape: (nw, rpw),
        },
        &[weight.clone(), scales.clone(), biases.clone(), x.clone()],
        shape,
        dtype,
        &[n, words, groups],
        [blocks * nw * 32, rows, 1],
        [nw * 32, 1, 1],
    )
}
