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
//!   another launch shape (an unreadable value is an error, see [`crate::policy`]). It can fold in the ops
//!   around it ([`GemvInput`], a residual add): decode on a GPU is bound by MLX's host time per
//!   graph node, and a transformer block's RMSNorms, gate activation and residual adds are four
//!   nodes of about twenty. `MLXCEL_CUDA_QMV_FOLD=0` keeps them separate.
//!
//! - **qmv_mma** (`qmv_mma.cu`): the decode GEMV over a batch of 2..=16 activation rows
//!   (concurrent decode steps) of 4-bit weights with bf16/f16 activations, on tensor cores: each
//!   weight is read once for all rows and the integer codes times the activations are
//!   accumulated by `mma.sync` (exact products, float32 sums), scale and bias folded per group.
//!   Off by default until measured; `MLXCEL_CUDA_QMV_MMA=1` turns it on ([`gemv`] then takes
//!   it for plain-input GEMVs, with or without a residual).
//!
//! - **rows** (`rows.cu`): small kernels of a prompt's forward pass, shipped compiled where MLX
//!   would JIT-compile its own on a machine's first request: embedding and MoE row gathers
//!   ([`take_rows`]), a router's chosen scores ([`take_along_rows`]), SiLU gating
//!   ([`silu_halves`], [`silu_mul`]); and a prompt's rope into the head layout ([`heads_rope`],
//!   `MLXCEL_CUDA_PREFILL_ROPE`). `MLXCEL_CUDA_ROWS=0` keeps MLX's. Their CPU tests run them
//!   thread by thread on the host (`cpp/cuda_emulation.cc`).
//!
//! - **selective scan** (`scan.cu`): Mamba-1/Mamba-2's recurrence, one graph node per layer
//!   instead of the MLX graphs of `mlxcel_arch::nn::ssm` ([`selective_scan`]).
//!   `MLXCEL_CUDA_SCAN=0` keeps the graphs, `decode` uses it for one-position steps only.
//!
//! Each is compiled with the NVRTC that MLX's CUDA build loads into the process, at its first use
//! on a machine: the cubin is cached under [`crate::cache_dir`]`/cuda/`, keyed by the source and
//! the GPU architecture, so later processes only load it (MLX's `fast::cuda_kernel` recompiles
//! per process, 1-2 s per kernel, and rebuilds the source per call). Calls become graph nodes of
//! an mlxcel primitive (cpp/cuda_launch.cc) that costs MLX little host time per call; without
//! the MLX CUDA entry points it needs, or with `MLXCEL_CUDA_LAUNCH=mlx`, they go through MLX's
//! `fast::precompiled_cuda_kernel`, which copies and hashes the whole module image per call.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::policy::{DecodeGemv, LaunchShape};

use crate::array::ArrayList;
use crate::ffi::bridge::{self, CudaBinary};
use crate::ops::{QuantMode, QuantSpec};
use crate::{Array, Dtype, Error, Result};

const PRELUDE: &str = include_str!("../kernels/cuda/prelude.cuh");
const HEADER: &str = include_str!("../kernels/cuda/qmv_header.cuh");
const QMV: &str = include_str!("../kernels/cuda/qmv.cu");
const QMV_MMA: &str = include_str!("../kernels/cuda/qmv_mma.cu");
const DEQUANT: &str = include_str!("../kernels/cuda/dequant.cu");
const SCAN: &str = include_str!("../kernels/cuda/scan.cu");
/// The decode step's kernels (decode.cu) after the GEMVs they call (qmv.cu, qmv_tc.cu); with
/// `$tail`, the files after decode.cu.
macro_rules! decode_module {
    ($($tail:literal),*) => {
        concat!(
            include_str!("../kernels/cuda/qmv.cu"),
            "\n",
            include_str!("../kernels/cuda/qmv_tc.cu"),
            "\n",
            include_str!("../kernels/cuda/decode.cu")
            $(, "\n", include_str!($tail))*
        )
    };
}
const QMV_AND_DECODE: &str = decode_module!();
/// With its routed-expert layers (decode_moe.cu), for models that have them; a model without
/// keeps the module (and the cached cubins) of decode.cu alone.
const QMV_DECODE_AND_MOE: &str = decode_module!("../kernels/cuda/decode_moe.cu");
/// In every module: the launcher's copy of an input that is not row-contiguous.
const GATHER: &str = include_str!("../kernels/cuda/gather.cu");
const ROWS: &str = include_str!("../kernels/cuda/rows.cu");
/// Up to this many rows of activations take the GEMV (decode, batched decode of concurrent
/// requests: each row re-reads the weights, mostly from L2, which still beats MLX's quantized
/// matmul at these sizes; measured in docs/performance.md, serving).
pub const QMV_MAX_ROWS: usize = 16;
/// The dequantize kernel's block size (`DQ_THREADS` in dequant.cu: its shared staging is sized by it).
const DEQUANT_THREADS: i32 = 256;
/// The GEMV's launch shape unless `MLXCEL_CUDA_QMV` picks another.
const DEFAULT_QMV_SHAPE: (i32, i32) = crate::policy::DEFAULT_QMV_SHAPE.pair();
/// The same for GEMVs that normalise or gate their input (see `gemv_launch_shape`), measured
/// on an H200 against 4x4 .. 16x16 (docs/bench/gpu-h200-session4-fold.txt): RMSNorm in, on
/// Llama-8B's qkv (6144x4096) and gate/up (28672x4096): 11.3 and 35.4 us at 4x8 against 11.8
/// and 31.6 for the plain GEMV; silu-gate in + residual out on its down projection
/// (4096x14336): 22.8 us at 16x16 against 16.9 plain (and 29 at 4x8).
const RMSNORM_FOLDED_SHAPE: (i32, i32) = (4, 8);
/// The launch shape of GEMVs over several activation rows (decode batches): two output rows
/// per block keep the per-thread accumulators (`MB * RPW` of them) few while each block
/// multiplies up to 8 activation rows per weight read.
const BATCH_QMV_SHAPE: (i32, i32) = (4, 2);
const GATED_FOLDED_SHAPE: (i32, i32) = (16, 16);
const BITS: [i32; 2] = [4, 8];
/// The scan's block size (four warps, one (batch, head, channel) row each).
const SCAN_THREADS: i32 = 128;
/// The scan kernel's instantiations: states per lane (N up to 256).
const SCAN_STATES_PER_LANE: [i32; 4] = [1, 2, 4, 8];
const DTYPES: [Dtype; 3] = [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32];
/// The tensor-core GEMV's block shapes, (warps, 16-row tiles of output features) (`NW`, `RT`
/// of qmv_mma.cu; the warps split K): those whose shared memory fits the 48 KB static limit.
pub const QMV_MMA_SHAPES: [(i32, i32); 3] = [(4, 1), (8, 1), (4, 2)];
/// Its activation dtypes (the mma's operand types).
const QMV_MMA_DTYPES: [Dtype; 2] = [Dtype::Bfloat16, Dtype::Float16];

/// Whether GEMVs may fold their neighbouring ops in (`MLXCEL_CUDA_QMV_FOLD=0`: never, for
/// comparisons; the GEMV itself stays on).
fn folding_enabled() -> bool {
    crate::policy::with(|p| p.cuda_qmv_fold)
}

fn dequant_enabled() -> bool {
    crate::policy::with(|p| p.cuda_dequant)
}

/// The GEMV's launch shape (warps per block, rows per block), `None` when switched off
/// (`MLXCEL_CUDA_QMV`, through the installed [`crate::policy`]).
fn qmv_shape() -> Option<(i32, i32)> {
    crate::policy::with(|p| p.cuda_qmv.map(LaunchShape::pair))
}

fn type_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Bfloat16 => "mlxcel_bf16",
        Dtype::Float16 => "mlxcel_f16",
        _ => "float",
    }
}

/// One compiled kernel: its `extern "C"` name and the source of a module holding just it (and the
/// launcher's gather kernels), loaded at the kernel's first call.
struct Entry {
    name: String,
    /// `qmv.cu` or `dequant.cu`.
    kernel: &'static str,
    /// The `extern "C"` function instantiating it.
    wrapper: String,
}

impl Entry {
    fn source(&self) -> String {
        [PRELUDE, HEADER, self.kernel, GATHER, &self.wrapper].join("\n")
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
        /// Activation rows per block (`MB` of qmv.cu).
        rows_per_block: i32,
        fold: GemvFold,
    },
    /// The tensor-core GEMV (qmv_mma.cu), 4-bit weights.
    QmvMma {
        dtype: Dtype,
        /// Warps per block (`NW`).
        warps: i32,
        /// 16-row tiles of output features per block (`RT`).
        row_tiles: i32,
        /// 8-row tiles of activation rows (`NT`: 1 up to 8 rows, 2 up to 16).
        act_tiles: i32,
        residual: bool,
    },
    /// The routed-expert product over rows sorted by expert (qmm_gather of qmv_mma.cu), 4-bit
    /// weights.
    QmmGather {
        dtype: Dtype,
        /// Warps per block (`NW`).
        warps: i32,
        /// 16-row tiles of output features per block (`RT`).
        row_tiles: i32,
    },
    /// `J` of scan.cu: states per lane, `ceil(N / 32)` rounded up to a power of two.
    Scan {
        states_per_lane: i32,
    },
    /// The CUDA decode step's kernels (decode.cu) for activations of `dtype` and the weight
    /// formats in `formats`, of the launch shapes `shapes` (which the launches must use too:
    /// they are part of the compiled kernels).
    Decoder {
        dtype: Dtype,
        formats: DecoderFormats,
        shapes: DecoderShapes,
    },
    /// rows.cu's `take_rows` over a table of `dtype`.
    TakeRows {
        dtype: Dtype,
    },
    /// rows.cu's `silu_halves` in `dtype`.
    SiluHalves {
        dtype: Dtype,
    },
    /// rows.cu's `heads_rope` in `dtype`.
    HeadsRope {
        dtype: Dtype,
    },
    /// rows.cu's `heads_norm_rope` in `dtype`.
    HeadsNormRope {
        dtype: Dtype,
    },
    /// rows.cu's `silu_mul` in `dtype`.
    SiluMul {
        dtype: Dtype,
    },
    /// rows.cu's `take_along_rows` over values of `dtype`.
    TakeAlongRows {
        dtype: Dtype,
    },
    /// rows.cu's `route_topk` with weights in `dtype`.
    RouteTopk {
        dtype: Dtype,
    },
}

/// Which neighbouring ops a GEMV kernel folds in (`PRE` and `RES` of qmv.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct GemvFold {
    /// 0: plain input, 1: RMSNorm of the input, 2: `silu(gate) * up` of a `[gate | up]` input.
    pre: i32,
    /// Adds a residual to the output.
    residual: bool,
}

impl KernelId {
    fn entry(self) -> Entry {
        match self {
            KernelId::Dequant { bits, dtype } => dequant_entry(bits, dtype),
            KernelId::Qmv {
                bits,
                dtype,
                shape,
                rows_per_block,
                fold,
            } => qmv_entry(bits, dtype, shape, rows_per_block, fold),
            KernelId::QmvMma {
                dtype,
                warps,
                row_tiles,
                act_tiles,
                residual,
            } => qmv_mma_entry(dtype, (warps, row_tiles), act_tiles, residual),
            KernelId::QmmGather {
                dtype,
                warps,
                row_tiles,
            } => qmm_gather_entry(dtype, (warps, row_tiles)),
            KernelId::Scan { states_per_lane } => scan_entry(states_per_lane),
            KernelId::Decoder {
                dtype,
                formats,
                shapes,
            } => decoder_entry(dtype, formats, shapes),
            KernelId::TakeRows { dtype } => rows_entry("take_rows", dtype),
            KernelId::SiluHalves { dtype } => rows_entry("silu_halves", dtype),
            KernelId::HeadsRope { dtype } => rows_entry("heads_rope", dtype),
            KernelId::HeadsNormRope { dtype } => rows_entry("heads_norm_rope", dtype),
            KernelId::SiluMul { dtype } => rows_entry("silu_mul", dtype),
            KernelId::TakeAlongRows { dtype } => rows_entry("take_along_rows", dtype),
            KernelId::RouteTopk { dtype } => rows_entry("route_topk", dtype),
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

/// The C type of a rows.cu element.
fn element_type(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Uint32 => "uint32_t",
        d => type_name(d),
    }
}

/// rows.cu's `kernel` over elements of `dtype`.
fn rows_entry(kernel: &str, dtype: Dtype) -> Entry {
    let name = format!("mlxcel_{kernel}_{}", dtype.name());
    let t = element_type(dtype);
    let wrapper = match kernel {
        "take_rows" => format!(
            "extern \"C\" __global__ void {name}(const {t}* table, const int* ids, {t}* out, \
             int n_ids, int row_len, int n_rows) {{ \
             take_rows<{t}>(table, ids, out, n_ids, row_len, n_rows); }}\n"
        ),
        "silu_halves" => format!(
            "extern \"C\" __global__ void {name}(const {t}* x, {t}* out, int rows, int cols) {{ \
             silu_halves<{t}>(x, out, rows, cols); }}\n"
        ),
        "heads_rope" => format!(
            "extern \"C\" __global__ void {name}(const {t}* qkv, const float* inv_freq, \
             {t}* out, int batch, int len, int heads, int head_dim, int rope_heads, \
             int rot_half, int traditional, int offset) {{ \
             heads_rope<{t}>(qkv, inv_freq, out, batch, len, heads, head_dim, rope_heads, \
             rot_half, traditional, offset); }}\n"
        ),
        "heads_norm_rope" => format!(
            "extern \"C\" __global__ void {name}(const {t}* qkv, const {t}* q_norm, \
             const {t}* k_norm, const float* inv_freq, {t}* out, int batch, int len, int heads, \
             int head_dim, int n_q, int rope_heads, int rot_half, int traditional, int offset, \
             int eps_bits) {{ \
             heads_norm_rope<{t}>(qkv, q_norm, k_norm, inv_freq, out, batch, len, heads, \
             head_dim, n_q, rope_heads, rot_half, traditional, offset, \
             __int_as_float(eps_bits)); }}\n"
        ),
        "silu_mul" => format!(
            "extern \"C\" __global__ void {name}(const {t}* gate, const {t}* up, {t}* out, \
             int n) {{ silu_mul<{t}>(gate, up, out, n); }}\n"
        ),
        "take_along_rows" => format!(
            "extern \"C\" __global__ void {name}(const {t}* values, const uint32_t* ids, \
             {t}* out, int rows, int cols, int k) {{ \
             take_along_rows<{t}>(values, ids, out, rows, cols, k); }}\n"
        ),
        "route_topk" => format!(
            "extern \"C\" __global__ void {name}(const float* logits, const float* bias, \
             uint32_t* ids, {t}* weights, int rows, int experts, int k, int scoring, \
             int has_bias, int normalize, int scale_bits) {{ \
             route_topk<{t}>(logits, bias, ids, weights, rows, experts, k, scoring, has_bias, \
             normalize, __int_as_float(scale_bits)); }}\n"
        ),
        other => unreachable!("rows.cu has no kernel `{other}`"),
    };
    Entry {
        name,
        kernel: ROWS,
        wrapper,
    }
}

/// Table dtypes [`take_rows`] reads: quantized tables' packed words and planes, dense tables.
const TAKE_ROWS_DTYPES: [Dtype; 4] = [
    Dtype::Uint32,
    Dtype::Bfloat16,
    Dtype::Float16,
    Dtype::Float32,
];

/// Activation dtypes of [`silu_halves`].
const SILU_HALVES_DTYPES: [Dtype; 3] = [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32];

/// Threads per block of rows.cu's kernels.
const ROWS_THREADS: i32 = 256;

/// Whether a rows.cu launch of one thread per each of `n` outputs fits its 32-bit indices (the
/// grid is rounded up to whole blocks).
fn rows_launch_fits(n: i64) -> bool {
    n < i32::MAX as i64 - ROWS_THREADS as i64
}

/// The launch grid (in threads) covering `n` outputs.
fn rows_grid(n: i64) -> [i32; 3] {
    let threads = (n + ROWS_THREADS as i64 - 1) / ROWS_THREADS as i64 * ROWS_THREADS as i64;
    [threads as i32, 1, 1]
}

/// Whether [`take_rows`] takes this lookup: on a GPU (unless `MLXCEL_CUDA_ROWS=0`), a
/// row-major 2-D table of a supported dtype, int32 ids, and sizes a 32-bit index covers.
pub fn take_rows_applies(table: &Array, ids: &Array) -> Result<bool> {
    if !rows_enabled() || !on_gpu()? || table.ndim() != 2 || ids.dtype()? != Dtype::Int32 {
        return Ok(false);
    }
    let outputs = ids.size() as i64 * table.dim(1)? as i64;
    Ok(TAKE_ROWS_DTYPES.contains(&table.dtype()?)
        && (table.size() as i64) < i32::MAX as i64
        && rows_launch_fits(outputs))
}

/// `table[ids]` along the first axis, `[..ids, row_len]`, on mlxcel's kernel (see
/// [`take_rows_applies`]); ids outside the table must have been refused before.
pub fn take_rows(table: &Array, ids: &Array) -> Result<Array> {
    let (n_rows, row_len) = (table.dim(0)?, table.dim(1)?);
    let n_ids = ids.size() as i32;
    let dtype = table.dtype()?;
    let mut shape = ids.shape();
    shape.push(row_len);
    let flat = call(
        KernelId::TakeRows { dtype },
        &[table.clone(), ids.reshape(&[-1])?],
        vec![n_ids, row_len],
        dtype,
        &[n_ids, row_len, n_rows],
        rows_grid(n_ids as i64 * row_len as i64),
        [ROWS_THREADS, 1, 1],
    )?;
    flat.reshape(&shape)
}

/// Whether [`silu_halves`] takes `x`: on a GPU (unless `MLXCEL_CUDA_ROWS=0`), a supported
/// dtype, an even last axis, and sizes a 32-bit index covers.
pub fn silu_halves_applies(x: &Array) -> Result<bool> {
    if !rows_enabled() || !on_gpu()? || x.ndim() == 0 {
        return Ok(false);
    }
    Ok(SILU_HALVES_DTYPES.contains(&x.dtype()?)
        && x.dim(-1)? % 2 == 0
        && rows_launch_fits(x.size() as i64))
}

/// `silu(gate) * up` of `x = [gate | up]` along its last axis, `[.., last / 2]`, as one
/// mlxcel kernel (see [`silu_halves_applies`]).
pub fn silu_halves(x: &Array) -> Result<Array> {
    let cols = x.dim(-1)? / 2;
    let rows = (x.size() / (2 * cols.max(1) as usize)) as i32;
    let dtype = x.dtype()?;
    let mut shape = x.shape();
    *shape.last_mut().expect("checked: at least one axis") = cols;
    let flat = call(
        KernelId::SiluHalves { dtype },
        &[x.reshape(&[rows, 2 * cols])?],
        vec![rows, cols],
        dtype,
        &[rows, cols],
        rows_grid(rows as i64 * cols as i64),
        [ROWS_THREADS, 1, 1],
    )?;
    flat.reshape(&shape)
}

/// `MLXCEL_CUDA_ROWS` (default on): rows.cu's kernels instead of MLX's JIT-compiled ones.
fn rows_enabled() -> bool {
    crate::policy::with(|p| p.cuda_rows)
}

/// Whether [`silu_mul`] takes `gate` and `up`: on a GPU (unless `MLXCEL_CUDA_ROWS=0`), one
/// shape and one supported dtype for both, and sizes a 32-bit index covers.
pub fn silu_mul_applies(gate: &Array, up: &Array) -> Result<bool> {
    Ok(rows_enabled() && on_gpu()? && silu_mul_takes(gate, up)?)
}

/// The operands [`silu_mul`] reads: one shape and one supported dtype for both, within its
/// 32-bit indices.
fn silu_mul_takes(gate: &Array, up: &Array) -> Result<bool> {
    let dtype = gate.dtype()?;
    Ok(SILU_HALVES_DTYPES.contains(&dtype)
        && up.dtype()? == dtype
        && gate.shape() == up.shape()
        && rows_launch_fits(gate.size() as i64))
}

/// `silu(gate) * up` element by element (separate gate and up projections: routed experts),
/// as one mlxcel kernel that ships compiled, rounded as [`silu_halves`] (see
/// [`silu_mul_applies`]). MLX would JIT-compile its fused kernel on a machine's first prompt.
pub fn silu_mul(gate: &Array, up: &Array) -> Result<Array> {
    if !silu_mul_takes(gate, up)? {
        return Err(Error::Invalid(format!(
            "silu_mul: gate {} {:?} and up {} {:?} must share one float dtype and shape",
            gate.dtype()?.name(),
            gate.shape(),
            up.dtype()?.name(),
            up.shape()
        )));
    }
    let n = gate.size() as i32;
    let dtype = gate.dtype()?;
    let flat = call(
        KernelId::SiluMul { dtype },
        &[gate.reshape(&[-1])?, up.reshape(&[-1])?],
        vec![n],
        dtype,
        &[n],
        rows_grid(n as i64),
        [ROWS_THREADS, 1, 1],
    )?;
    flat.reshape(&gate.shape())
}

/// Whether [`take_along_rows`] takes this lookup: on a GPU (unless `MLXCEL_CUDA_ROWS=0`), 2-D
/// float `values`, 2-D uint32 `ids` with as many rows, and sizes a 32-bit index covers.
pub fn take_along_rows_applies(values: &Array, ids: &Array) -> Result<bool> {
    Ok(rows_enabled() && on_gpu()? && take_along_rows_takes(values, ids)?)
}

/// The operands [`take_along_rows`] reads: 2-D float `values`, 2-D uint32 `ids` with as many
/// rows, within its 32-bit indices.
fn take_along_rows_takes(values: &Array, ids: &Array) -> Result<bool> {
    if values.ndim() != 2 || ids.ndim() != 2 {
        return Ok(false);
    }
    Ok(SILU_HALVES_DTYPES.contains(&values.dtype()?)
        && ids.dtype()? == Dtype::Uint32
        && ids.dim(0)? == values.dim(0)?
        && (values.size() as i64) < i32::MAX as i64
        && rows_launch_fits(ids.size() as i64))
}

/// `values[r, ids[r, j]]` for `values` `[rows, cols]` and `ids` `[rows, k]` (each row's chosen
/// columns: a router's experts), `[rows, k]`, on mlxcel's kernel (see
/// [`take_along_rows_applies`]), where MLX's `take_along_axis` JIT-compiles its `gather_axis`
/// module on a machine's first prompt. Ids past a row are clamped to its last column (the
/// caller's ids come from a sort of that row).
pub fn take_along_rows(values: &Array, ids: &Array) -> Result<Array> {
    if !take_along_rows_takes(values, ids)? {
        return Err(Error::Invalid(format!(
            "take_along_rows: values {} {:?} and ids {} {:?}: needs 2-D float values and 2-D \
             uint32 ids with as many rows",
            values.dtype()?.name(),
            values.shape(),
            ids.dtype()?.name(),
            ids.shape()
        )));
    }
    let (rows, cols, k) = (values.dim(0)?, values.dim(1)?, ids.dim(1)?);
    let dtype = values.dtype()?;
    call(
        KernelId::TakeAlongRows { dtype },
        &[values.clone(), ids.clone()],
        vec![rows, k],
        dtype,
        &[rows, cols, k],
        rows_grid(rows as i64 * k as i64),
        [ROWS_THREADS, 1, 1],
    )
}

/// The most experts a token may choose in [`route_topk`] (`ROUTE_MAX_K` of rows.cu).
pub const ROUTE_MAX_K: i32 = 16;

/// How [`route_topk`] scores and weighs a router's experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteSpec {
    /// Experts chosen per token (at most [`ROUTE_MAX_K`]).
    pub top_k: i32,
    /// Sigmoid scores instead of a softmax over the experts.
    pub sigmoid: bool,
    /// Weights divided by their sum.
    pub normalize: bool,
    /// Weights multiplied by this at the end.
    pub scale: f32,
}

/// Whether [`route_topk`] takes a router's `logits` `[tokens, experts]`: on a GPU with
/// `MLXCEL_CUDA_ROUTER=1` (off by default until measured), float32 logits, and `top_k` from 1
/// to [`ROUTE_MAX_K`] and at most the experts.
pub fn route_topk_applies(logits: &Array, top_k: i32) -> Result<bool> {
    Ok(crate::policy::with(|p| p.cuda_router) && on_gpu()? && route_topk_takes(logits, top_k)?)
}

/// What [`route_topk`] reads: 2-D float32 logits within 32-bit indices, and `top_k` from 1 to
/// [`ROUTE_MAX_K`] and at most the experts (the kernel's per-thread arrays hold that many).
fn route_topk_takes(logits: &Array, top_k: i32) -> Result<bool> {
    Ok(logits.ndim() == 2
        && logits.dtype()? == Dtype::Float32
        && (1..=ROUTE_MAX_K.min(logits.dim(1)?)).contains(&top_k)
        && (logits.size() as i64) < i32::MAX as i64)
}

/// A MoE router's choice as one mlxcel kernel (rows.cu's `route_topk`, see
/// [`route_topk_applies`]): for `logits` `[tokens, experts]` (float32), the experts' scores
/// (softmax, or sigmoid per `spec`), the `top_k` largest of scores + `bias` (`[experts]`
/// float32, a correction some routers add for the choice only) in descending order, ties to
/// the lower expert, and their scores as weights (normalized and scaled per `spec`) in
/// `dtype`: (ids `[tokens, k]` uint32, weights `[tokens, k]`). MLX's graph of the same is a
/// softmax, a sort of every row, a gather, a sum, a division and casts.
pub fn route_topk(
    logits: &Array,
    bias: Option<&Array>,
    spec: RouteSpec,
    dtype: Dtype,
) -> Result<(Array, Array)> {
    let k = spec.top_k;
    if !route_topk_takes(logits, k)? {
        return Err(Error::Invalid(format!(
            "route_topk: {} logits {:?} choosing {k}: needs 2-D float32 logits and 1 to \
             {ROUTE_MAX_K} experts a token, at most all of them",
            logits.dtype()?.name(),
            logits.shape()
        )));
    }
    let (rows, experts) = (logits.dim(0)?, logits.dim(1)?);
    if let Some(b) = bias {
        if b.dtype()? != Dtype::Float32 || b.size() != experts as usize {
            return Err(Error::Invalid(format!(
                "route_topk: the bias must be float32 [{experts}], got {} {:?}",
                b.dtype()?.name(),
                b.shape()
            )));
        }
    }
    if !SILU_HALVES_DTYPES.contains(&dtype) {
        return Err(Error::Invalid(format!(
            "route_topk: weights in {} (a float dtype expected)",
            dtype.name()
        )));
    }
    // Without a bias the kernel never reads its bias argument: the logits stand in for it.
    let has_bias = bias.is_some();
    let bias = bias.unwrap_or(logits).reshape(&[-1])?;
    let mut outputs = call_outputs(
        KernelId::RouteTopk { dtype },
        &[logits.clone(), bias],
        &[(vec![rows, k], Dtype::Uint32), (vec![rows, k], dtype)],
        &[
            rows,
            experts,
            k,
            i32::from(spec.sigmoid),
            i32::from(has_bias),
            i32::from(spec.normalize),
            spec.scale.to_bits() as i32,
        ],
        rows_grid(rows as i64),
        [ROWS_THREADS, 1, 1],
    )?;
    let weights = outputs.pop().expect("two outputs");
    let ids = outputs.pop().expect("two outputs");
    Ok((ids, weights))
}

/// Whether [`heads_rope`] takes a prompt's `[B, L, heads, head_dim]` projection of `elements`
/// values: on a GPU with `MLXCEL_CUDA_PREFILL_ROPE=1` (off by default until measured), and
/// sizes a 32-bit index covers. Decide before building the projection, so a layer that falls
/// back builds its MLX graph once.
pub fn heads_rope_applies(elements: i64) -> Result<bool> {
    Ok(crate::policy::with(|p| p.cuda_prefill_rope) && on_gpu()? && rows_launch_fits(elements))
}

/// How [`heads_rope`] treats a fused projection's heads: queries first, then keys (rotated),
/// then values (copied).
#[derive(Debug, Clone, Copy)]
pub struct HeadsRope<'a> {
    /// The angle per position of each rotated pair, float32 `[rot_half]`: the first
    /// `2 * rot_half` dims rotate.
    pub inv_freq: &'a Array,
    /// Adjacent pairs rotate, else the two halves.
    pub traditional: bool,
    /// Query heads.
    pub query_heads: i32,
    /// Key heads (as many value heads follow them).
    pub kv_heads: i32,
    /// Per-head RMSNorms before the rope (Qwen3's `q_norm` and `k_norm`): the query and key
    /// weights (`[head_dim]`, in the projection's dtype) and their eps.
    pub norms: Option<(&'a Array, &'a Array, f32)>,
}

/// A prompt's fused q|k|v projection `qkv` `[B, L, heads, head_dim]` in the head layout
/// `[B, heads, L, head_dim]` that attention reads, queries and keys normalised per head when
/// `spec` says so and rotated for positions `offset..offset + L` as MLX's rope does, values
/// copied. One mlxcel kernel (rows.cu's `heads_rope`, or `heads_norm_rope` with norms) where
/// MLX runs a norm and a rope per operand and copies out of the strided views (see
/// [`heads_rope_applies`]).
pub fn heads_rope(qkv: &Array, spec: &HeadsRope<'_>, offset: usize) -> Result<Array> {
    let shape = qkv.shape();
    let &[batch, len, heads, head_dim] = shape.as_slice() else {
        return Err(Error::Invalid(format!(
            "heads_rope: qkv must be [batch, len, heads, head_dim], got {shape:?}"
        )));
    };
    let dtype = qkv.dtype()?;
    let inv_freq = spec.inv_freq;
    let rot_half = inv_freq.size() as i32;
    let rope_heads = spec.query_heads + spec.kv_heads;
    if offset + len.max(0) as usize > i32::MAX as usize {
        return Err(Error::Invalid(format!(
            "heads_rope: positions from {offset} past a 32-bit index"
        )));
    }
    if !SILU_HALVES_DTYPES.contains(&dtype)
        || inv_freq.dtype()? != Dtype::Float32
        || inv_freq.ndim() != 1
        || 2 * rot_half > head_dim
        || spec.query_heads < 0
        || spec.kv_heads < 0
        || rope_heads > heads
    {
        return Err(Error::Invalid(format!(
            "heads_rope: {} qkv {shape:?} with {} inv_freq [{rot_half}], {} query and {} key \
             heads: needs a float qkv, float32 inv_freq of at most head_dim / 2 entries and \
             at most `heads` rotated heads",
            dtype.name(),
            inv_freq.dtype()?.name(),
            spec.query_heads,
            spec.kv_heads
        )));
    }
    if let Some((q, k, _)) = spec.norms {
        for (what, w) in [("query", q), ("key", k)] {
            if w.dtype()? != dtype || w.size() != head_dim as usize {
                return Err(Error::Invalid(format!(
                    "heads_rope: the {what} norm must be {} [{head_dim}], got {} {:?}",
                    dtype.name(),
                    w.dtype()?.name(),
                    w.shape()
                )));
            }
        }
    }
    let elements = qkv.size() as i64;
    if !rows_launch_fits(elements) {
        return Err(Error::Invalid(format!(
            "heads_rope: {elements} values are past a 32-bit index"
        )));
    }
    let (traditional, offset) = (i32::from(spec.traditional), offset as i32);
    // The same layout either way; with norms the kernel takes their weights and eps, and one
    // thread per head row (the norm needs the whole row) instead of one per element.
    let (id, inputs, scalars, threads) = match spec.norms {
        None => (
            KernelId::HeadsRope { dtype },
            vec![qkv.clone(), inv_freq.clone()],
            vec![
                batch,
                len,
                heads,
                head_dim,
                rope_heads,
                rot_half,
                traditional,
                offset,
            ],
            elements,
        ),
        Some((q_norm, k_norm, eps)) => (
            KernelId::HeadsNormRope { dtype },
            vec![
                qkv.clone(),
                q_norm.reshape(&[-1])?,
                k_norm.reshape(&[-1])?,
                inv_freq.clone(),
            ],
            vec![
                batch,
                len,
                heads,
                head_dim,
                spec.query_heads,
                rope_heads,
                rot_half,
                traditional,
                offset,
                eps.to_bits() as i32,
            ],
            batch as i64 * heads as i64 * len as i64,
        ),
    };
    call(
        id,
        &inputs,
        vec![batch, heads, len, head_dim],
        dtype,
        &scalars,
        rows_grid(threads),
        [ROWS_THREADS, 1, 1],
    )
}

fn qmv_entry(bits: i32, dtype: Dtype, (nw, rpw): (i32, i32), mb: i32, fold: GemvFold) -> Entry {
    let (t, threads) = (type_name(dtype), nw * 32);
    let GemvFold { pre, residual } = fold;
    let res = i32::from(residual);
    let name = format!(
        "mlxcel_qmv_b{bits}_{}_{nw}x{rpw}_m{mb}{}{}",
        dtype.name(),
        ["", "_rmsnorm", "_silugate"][pre as usize],
        if residual { "_residual" } else { "" }
    );
    // Float32 outputs need the exact nibble arithmetic (FAST=0); see qmv_header.cuh.
    let fast = i32::from(bits == 4 && dtype != Dtype::Float32);
    // Inputs in call order (w, scales, biases, x, then the norm weight and residual when
    // folded), the output, then the integer scalars (eps travels as its float bits).
    let aux = if pre == 1 {
        format!("const {t}* aux, ")
    } else {
        String::new()
    };
    let res_arg = if residual {
        format!("const {t}* res, ")
    } else {
        String::new()
    };
    let eps_arg = if pre == 1 { ", int eps_bits" } else { "" };
    let wrapper = format!(
        "extern \"C\" __global__ void __launch_bounds__({threads}) {name}(const uint32_t* w, \
         const {t}* scales, const {t}* biases, const {t}* x, {aux}{res_arg}{t}* out, \
         int n_rows, int words_per_row, int groups_per_row, int m_rows{eps_arg}) {{ \
         qmv<{bits}, {nw}, {rpw}, {mb}, 1, {fast}, {pre}, {res}, {t}>(w, scales, biases, x, {}, \
         {}, out, n_rows, words_per_row, groups_per_row, m_rows, {}, blockIdx.x); }}\n",
        if pre == 1 { "aux" } else { "nullptr" },
        if residual { "res" } else { "nullptr" },
        if pre == 1 {
            "__int_as_float(eps_bits)"
        } else {
            "0.0f"
        },
    );
    Entry {
        name,
        kernel: QMV,
        wrapper,
    }
}

fn qmv_mma_entry(dtype: Dtype, (nw, rt): (i32, i32), nt: i32, residual: bool) -> Entry {
    let t = type_name(dtype);
    let name = format!(
        "mlxcel_qmv_mma_b4_{}_{nw}w_r{rt}_n{nt}{}",
        dtype.name(),
        if residual { "_residual" } else { "" }
    );
    let (res_arg, res) = if residual {
        (format!("const {t}* res, "), "res")
    } else {
        (String::new(), "nullptr")
    };
    let wrapper = format!(
        "extern \"C\" __global__ void __launch_bounds__({threads}) {name}(const uint32_t* w, \
         const {t}* scales, const {t}* biases, const {t}* x, {res_arg}{t}* out, int n_rows, \
         int words_per_row, int groups_per_row, int m_rows) {{ \
         qmv_mma<{nw}, {rt}, {nt}, {r}, {t}>(w, scales, biases, x, {res}, out, n_rows, \
         words_per_row, groups_per_row, m_rows); }}\n",
        threads = nw * 32,
        r = i32::from(residual),
    );
    Entry {
        name,
        kernel: QMV_MMA,
        wrapper,
    }
}

fn qmm_gather_entry(dtype: Dtype, (nw, rt): (i32, i32)) -> Entry {
    let t = type_name(dtype);
    let name = format!("mlxcel_qmm_gather_b4_{}_{nw}w_r{rt}", dtype.name());
    let wrapper = format!(
        "extern \"C\" __global__ void __launch_bounds__({threads}) {name}(const uint32_t* w, \
         const {t}* scales, const {t}* biases, const {t}* x, const uint32_t* ids, {t}* out, \
         int n_rows, int words_per_row, int groups_per_row, int m_rows, int experts) {{ \
         qmm_gather<{nw}, {rt}, {t}>(w, scales, biases, x, ids, out, n_rows, words_per_row, \
         groups_per_row, m_rows, experts); }}\n",
        threads = nw * 32,
    );
    Entry {
        name,
        kernel: QMV_MMA,
        wrapper,
    }
}

fn scan_entry(j: i32) -> Entry {
    let name = format!("mlxcel_selective_scan_j{j}");
    let wrapper = format!(
        "extern \"C\" __global__ void __launch_bounds__({SCAN_THREADS}) {name}(const float* x, \
         const float* dt, const float* a, const float* bm, const float* cm, const float* h0, \
         float* out, int B, int L, int H, int P, int G, int N, int per_head) {{ \
         selective_scan<{j}>(x, dt, a, bm, cm, h0, out, B, L, H, P, G, N, per_head); }}\n"
    );
    Entry {
        name,
        kernel: SCAN,
        wrapper,
    }
}

/// The launch shapes (warps, weight rows per block) of the decode step's GEMVs by default:
/// RMSNorm folded in (q|k|v, the head), residual out (o, down), RMSNorm in and silu(gate) * up
/// out (gate|up: half as many outputs as rows per block); as the graph path's (see
/// `gemv_launch_shape`). `MLXCEL_CUDA_DECODE_GEMV` picks others.
pub const DECODER_GEMV_SHAPES: [(i32, i32); 3] = [
    crate::policy::DEFAULT_DECODE_GEMV_SHAPES[0].shape.pair(),
    crate::policy::DEFAULT_DECODE_GEMV_SHAPES[1].shape.pair(),
    crate::policy::DEFAULT_DECODE_GEMV_SHAPES[2].shape.pair(),
];

/// The launch shapes of a decode step's kernels, compiled into its module: read from the
/// policy once per decoder, for the module and its launches alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecoderShapes {
    /// The float GEMVs (qmv.cu) of the three kinds, in [`DECODER_GEMV_SHAPES`]' order: warps,
    /// rows per block and the blocks per SM their registers must allow.
    pub gemv: [DecodeGemv; 3],
    /// (warps, rows per block: 16 or 32) of the tensor-core GEMVs (qmv_tc.cu), or `None` when
    /// `MLXCEL_CUDA_DECODE_TC=0` keeps every 4-bit GEMV on qmv.cu.
    pub tensor_cores: Option<(i32, i32)>,
    /// Lanes per (expert, row) dot product of the routed-expert GEMVs (decode_moe.cu's LPR:
    /// 8, 16 or 32).
    pub moe_lanes: i32,
    /// Chunks per lane those GEMVs stage in shared memory (decode_moe.cu's STAGE; 0: two at a
    /// time in registers).
    pub moe_stage: i32,
    /// Threads per attention block (decode.cu's `dec_attention` NT: 128 or 256).
    pub attn_threads: i32,
}

impl Default for DecoderShapes {
    /// The policy's defaults: the float GEMVs of [`DECODER_GEMV_SHAPES`], no tensor cores.
    fn default() -> Self {
        DecoderShapes {
            gemv: crate::policy::DEFAULT_DECODE_GEMV_SHAPES,
            tensor_cores: None,
            moe_lanes: crate::policy::DEFAULT_DECODE_MOE_LANES,
            moe_stage: crate::policy::DEFAULT_DECODE_MOE_STAGE,
            attn_threads: crate::policy::DEFAULT_DECODE_ATTN_THREADS,
        }
    }
}

/// Whether a decode step of `shapes` can route in its router's GEMV (dec_router: the RMSNorm-in
/// GEMV's blocks, of which one warp ranks the experts while the others normalise h): from 2
/// warps. With 1 (`MLXCEL_CUDA_DECODE_GEMV=1x..`) the routing keeps its own kernel.
pub fn fused_router_fits(shapes: &DecoderShapes) -> bool {
    shapes.gemv[0].shape.warps >= 2
}

/// The decode step's launch shapes the policy asks for now, for a model of `hidden`.
pub fn decoder_shapes(hidden: i32) -> DecoderShapes {
    crate::policy::with(|p| DecoderShapes {
        gemv: p
            .cuda_decode_gemv
            .unwrap_or_else(|| crate::policy::default_decode_gemv(hidden)),
        tensor_cores: p.cuda_decode_tc.map(LaunchShape::pair),
        moe_lanes: p.cuda_decode_moe_lanes,
        moe_stage: p.cuda_decode_moe_stage,
        attn_threads: p.cuda_decode_attn_threads,
    })
}

/// The activation dtypes the CUDA decode step is compiled for.
const DECODER_DTYPES: [Dtype; 2] = [Dtype::Bfloat16, Dtype::Float16];

/// The weight formats a model's projections come in, for the CUDA decode step: its module holds
/// the GEMVs of these alone (each format's three GEMVs are most of the module's compile time on
/// a machine's first run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DecoderFormats {
    /// Affine 4-bit.
    pub affine4: bool,
    /// Affine 8-bit.
    pub affine8: bool,
    /// Weights in the activations' dtype.
    pub dense: bool,
    /// Routed-expert layers (decode_moe.cu's kernels, for each format above).
    pub experts: bool,
}

impl DecoderFormats {
    /// Every format (the whole module, as `module_source` compile-checks it).
    pub const ALL: DecoderFormats = DecoderFormats {
        affine4: true,
        affine8: true,
        dense: true,
        experts: true,
    };

    /// Adds the format of a projection: affine `Some(bits)` (4 or 8), dense `None`.
    pub fn with(mut self, bits: Option<i32>) -> DecoderFormats {
        match bits {
            Some(4) => self.affine4 = true,
            Some(8) => self.affine8 = true,
            Some(_) => {}
            None => self.dense = true,
        }
        self
    }

    /// With routed-expert layers.
    pub fn with_experts(mut self) -> DecoderFormats {
        self.experts = true;
        self
    }
}

/// The kernels of the CUDA decode step (cpp/cuda_decode.cc names them the same way):
/// `mlxcel_dec_qmv_b{4,8}_{rms,res,glu}_{dtype}` (and `mlxcel_dec_dmv_..` for dense
/// weights in the activations' dtype), those of `formats` only, and
/// `mlxcel_dec_attention_{dtype}`.
/// With `shapes.tensor_cores`, also the tensor-core GEMVs
/// `mlxcel_dec_qmt_b4_{rms,res,glu}_{dtype}` of that launch shape (4-bit formats only).
fn decoder_entry(dtype: Dtype, formats: DecoderFormats, shapes: DecoderShapes) -> Entry {
    let (t, d) = (type_name(dtype), dtype.name());
    let mut wrapper = String::new();
    // (name, PRE, RES, GLU) of qmv.cu.
    let folds = [("rms", 1, 0, 0), ("res", 0, 1, 0), ("glu", 1, 0, 1)];
    // Each kind's `__launch_bounds__` arguments: its threads, then the blocks an SM must hold
    // when the policy asks for them (the default's text is unchanged, as are its cubins).
    let bounds = shapes.gemv.map(|g| match g.min_blocks {
        0 => format!("{}", g.shape.warps * 32),
        b => format!("{}, {b}", g.shape.warps * 32),
    });
    let gemv_shapes = shapes.gemv.map(|g| g.shape.pair());
    let affine = [(4, formats.affine4), (8, formats.affine8)];
    for bits in affine
        .into_iter()
        .filter(|&(_, on)| on)
        .map(|(bits, _)| bits)
    {
        for (((kind, pre, res, glu), (nw, rpw)), bounds) in
            folds.into_iter().zip(gemv_shapes).zip(&bounds)
        {
            wrapper += &format!(
                "extern \"C\" __global__ void __launch_bounds__({bounds}) \
                 mlxcel_dec_qmv_b{bits}_{kind}_{d}(\
                 const uint32_t* w0, const {t}* s0, const {t}* z0, {t}* o0, int n0, \
                 const uint32_t* w1, const {t}* s1, const {t}* z1, {t}* o1, int n1, \
                 const uint32_t* w2, const {t}* s2, const {t}* z2, {t}* o2, int n2, \
                 const {t}* x, const {t}* aux, const {t}* res, int words_per_row, \
                 int groups_per_row, int eps_bits) {{ \
                 dec_qmv<{bits}, {nw}, {rpw}, {pre}, {res}, {glu}, {t}>(w0, s0, z0, o0, n0, w1, s1, z1, \
                 o1, n1, w2, s2, z2, o2, n2, x, aux, res, words_per_row, groups_per_row, \
                 __int_as_float(eps_bits)); }}\n",
            );
        }
    }
    // The tensor-core GEMVs of 4-bit weights in groups of 64 or 128 (qmv_tc.cu), one launch
    // shape for the three kinds (`MLXCEL_CUDA_DECODE_TC`).
    if let Some((nw, rows)) = shapes.tensor_cores.filter(|_| formats.affine4) {
        for (kind, pre, res, glu) in folds {
            wrapper += &format!(
                "extern \"C\" __global__ void __launch_bounds__({threads}) \
                 mlxcel_dec_qmt_b4_{kind}_{d}(\
                 const uint32_t* w0, const {t}* s0, const {t}* z0, {t}* o0, int n0, \
                 const uint32_t* w1, const {t}* s1, const {t}* z1, {t}* o1, int n1, \
                 const uint32_t* w2, const {t}* s2, const {t}* z2, {t}* o2, int n2, \
                 const {t}* x, const {t}* aux, const {t}* res, int words_per_row, \
                 int groups_per_row, int eps_bits) {{ \
                 dec_qmt<{nw}, {rt}, {pre}, {res}, {glu}, {t}>(w0, s0, z0, o0, n0, w1, s1, z1, \
                 o1, n1, w2, s2, z2, o2, n2, x, aux, res, words_per_row, groups_per_row, \
                 __int_as_float(eps_bits)); }}\n",
                threads = nw * 32,
                rt = rows / 16,
            );
        }
    }
    let dense = folds.into_iter().zip(gemv_shapes).zip(&bounds);
    for (((kind, pre, res, glu), (nw, rpw)), bounds) in dense.filter(|_| formats.dense) {
        wrapper += &format!(
            "extern \"C\" __global__ void __launch_bounds__({bounds}) \
             mlxcel_dec_dmv_{kind}_{d}(const {t}* w0, {t}* o0, int n0, const {t}* w1, {t}* o1, \
             int n1, const {t}* w2, {t}* o2, int n2, const {t}* x, const {t}* aux, \
             const {t}* res, int k_len, int eps_bits) {{ \
             dec_dmv3<{nw}, {rpw}, {pre}, {res}, {glu}, {t}>(w0, o0, n0, w1, o1, n1, w2, o2, n2, x, aux, \
             res, k_len, __int_as_float(eps_bits)); }}\n",
        );
    }
    let nt = shapes.attn_threads;
    wrapper += &format!(
        "extern \"C\" __global__ void __launch_bounds__({nt}) \
         mlxcel_dec_attention_{d}(const {t}* qkv, const {t}* q_bias, const {t}* k_bias, \
         const {t}* v_bias, const {t}* q_norm, const {t}* k_norm, const float* inv_freq, \
         {t}* k_cache, {t}* v_cache, float* partial, int* counters, {t}* out, int heads, \
         int kv_heads, int head_dim, int rot_half, int traditional, int position, int capacity, \
         int chunk, int n_chunks, int eps_bits, int scale_bits) {{ \
         dec_attention<{t}, {nt}>(qkv, q_bias, k_bias, v_bias, q_norm, k_norm, inv_freq, k_cache, \
         v_cache, partial, counters, out, heads, kv_heads, head_dim, rot_half, traditional, \
         position, capacity, chunk, n_chunks, __int_as_float(eps_bits), \
         __int_as_float(scale_bits)); }}\n"
    );
    if formats.experts {
        wrapper += &format!(
            "extern \"C\" __global__ void __launch_bounds__(DEC_ROUTE_THREADS) \
             mlxcel_dec_route_{d}(const {t}* logits, const {t}* h, const {t}* norm, {t}* xn, \
             int* ids, float* weights, int experts, int top_k, int normalize, int scale_bits, \
             int hidden, int eps_bits) {{ dec_route<{t}>(logits, h, norm, xn, ids, weights, \
             experts, top_k, normalize, __int_as_float(scale_bits), hidden, \
             __int_as_float(eps_bits)); }}\n"
        );
        let expert_formats = [
            (4, "b4", formats.affine4),
            (8, "b8", formats.affine8),
            (16, "dense", formats.dense),
        ];
        let (lanes, stage) = (shapes.moe_lanes, shapes.moe_stage);
        // The router's GEMV with the routing in its last block: the RMS GEMV's launch shape,
        // from 2 warps (one routes while the others normalise; see `fused_router_fits`).
        let ((nw, rpw), router_bounds) = (gemv_shapes[0], &bounds[0]);
        for (bits, f, _) in expert_formats.into_iter().filter(|&(_, _, on)| on) {
            if fused_router_fits(&shapes) {
                wrapper += &format!(
                    "extern \"C\" __global__ void __launch_bounds__({router_bounds}) \
                 mlxcel_dec_router_{f}_{d}(const uint32_t* w, const {t}* s, const {t}* z, \
                 {t}* logits, const {t}* h, const {t}* norm, int words, int groups, int eps_bits, \
                 {t}* xn, int* ids, float* weights, int* counter, int experts, int top_k, \
                 int normalize, int scale_bits) {{ \
                 dec_router<{bits}, {nw}, {rpw}, {t}>(w, s, z, logits, h, norm, words, groups, \
                 __int_as_float(eps_bits), xn, ids, weights, counter, experts, top_k, normalize, \
                 __int_as_float(scale_bits)); }}\n"
                );
            }
            wrapper += &format!(
                "extern \"C\" __global__ void __launch_bounds__(DEC_MOE_THREADS) \
                 mlxcel_dec_moe_glu_{f}_{d}(const uint32_t* gw, const {t}* gs, const {t}* gb, \
                 const uint32_t* uw, const {t}* us, const {t}* ub, const int* ids, const {t}* x, \
                 {t}* out, int inter, int words, int groups, int top_k) {{ \
                 dec_moe_glu<{bits}, {lanes}, {stage}, {t}>(gw, gs, gb, uw, us, ub, ids, x, out, inter, words, \
                 groups, top_k); }}\n\
                 extern \"C\" __global__ void __launch_bounds__(DEC_MOE_THREADS) \
                 mlxcel_dec_moe_down_{f}_{d}(const uint32_t* dw, const {t}* ds, const {t}* db, \
                 const int* ids, const float* weights, const {t}* a, const {t}* res, {t}* out, \
                 int n_rows, int words, int groups, int top_k, int outs) {{ \
                 dec_moe_down<{bits}, {lanes}, {stage}, {t}>(dw, ds, db, ids, weights, a, res, out, n_rows, words, \
                 groups, top_k, outs); }}\n"
            );
        }
    }
    Entry {
        // A kernel of the module (the loader resolves it first); each format set's source,
        // hence its cache file, differs.
        name: format!("mlxcel_dec_attention_{d}"),
        kernel: if formats.experts {
            QMV_DECODE_AND_MOE
        } else {
            QMV_AND_DECODE
        },
        wrapper,
    }
}

/// The compiled module of the CUDA decode step's kernels for `dtype` activations (bf16/f16) and
/// weights in `formats`, of launch shapes `shapes` ([`decoder_shapes`]), compiled at the first
/// call on a machine and cached like every kernel here.
pub fn decoder_binary(
    dtype: Dtype,
    formats: DecoderFormats,
    shapes: DecoderShapes,
) -> Result<&'static CudaBinary> {
    if !DECODER_DTYPES.contains(&dtype) {
        return Err(Error::Invalid(format!(
            "the CUDA decode step runs on bfloat16/float16 activations, not {}",
            dtype.name()
        )));
    }
    binary(KernelId::Decoder {
        dtype,
        formats,
        shapes,
    })
}

/// Every kernel of this build in one source (public so it can be compile-checked with NVRTC off
/// the GPU machine: `cargo run -p mlxcel-core --example cuda_kernels -- --source`).
pub fn module_source() -> String {
    let mut src = [
        PRELUDE,
        HEADER,
        QMV_DECODE_AND_MOE,
        QMV_MMA,
        DEQUANT,
        SCAN,
        GATHER,
    ]
    .join("\n");
    // The tensor-core GEMVs too, whatever the policy says (they are off by default).
    let shapes = DecoderShapes {
        tensor_cores: Some(crate::policy::DEFAULT_DECODE_TC_SHAPE.pair()),
        ..DecoderShapes::default()
    };
    for dtype in DECODER_DTYPES {
        src += &decoder_entry(dtype, DecoderFormats::ALL, shapes).wrapper;
    }
    for j in SCAN_STATES_PER_LANE {
        src += &scan_entry(j).wrapper;
    }
    src += ROWS;
    for dtype in TAKE_ROWS_DTYPES {
        src += &rows_entry("take_rows", dtype).wrapper;
    }
    for dtype in SILU_HALVES_DTYPES {
        src += &rows_entry("silu_halves", dtype).wrapper;
        src += &rows_entry("heads_rope", dtype).wrapper;
        src += &rows_entry("heads_norm_rope", dtype).wrapper;
        src += &rows_entry("silu_mul", dtype).wrapper;
        src += &rows_entry("take_along_rows", dtype).wrapper;
        src += &rows_entry("route_topk", dtype).wrapper;
    }
    for dtype in QMV_MMA_DTYPES {
        for shape in QMV_MMA_SHAPES {
            for nt in [1, 2] {
                for residual in [false, true] {
                    src += &qmv_mma_entry(dtype, shape, nt, residual).wrapper;
                }
            }
            src += &qmm_gather_entry(dtype, shape).wrapper;
        }
    }
    for bits in BITS {
        for dtype in DTYPES {
            src += &dequant_entry(bits, dtype).wrapper;
            for pre in 0..3 {
                for residual in [false, true] {
                    let fold = GemvFold { pre, residual };
                    src += &qmv_entry(bits, dtype, gemv_launch_shape(pre), 1, fold).wrapper;
                    // Shared-row blocks (`MLXCEL_CUDA_QMV_ROWS`), which never fold an RMSNorm.
                    if pre != 1 {
                        for mb in [2, 4, 8] {
                            src += &qmv_entry(bits, dtype, BATCH_QMV_SHAPE, mb, fold).wrapper;
                        }
                    }
                }
            }
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

// `PREBUILT_CUBINS`: the cubins shipped in kernels/prebuilt/ (see build.rs).
include!(concat!(env!("OUT_DIR"), "/prebuilt_cubins.rs"));

/// Nanoseconds this process spent compiling mlxcel's CUDA kernels (NVRTC).
static COMPILE_NANOS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Seconds this process spent compiling mlxcel's CUDA kernels: kernels neither shipped
/// prebuilt for this GPU nor in the disk cache (0 on a machine that has run them before).
pub fn compile_seconds() -> f64 {
    COMPILE_NANOS.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9
}

/// The kernels shipped compiled in kernels/prebuilt/ (`cuda_kernels --prebuild DIR` on a GPU
/// writes them): what the first load and request of a Llama-style model or a Qwen3-style MoE
/// use, 4-bit, 8-bit or unquantized, with bf16 or f16 activations (measured with
/// `gpu_probe.sh fresh`: the decode step's module, the prefill's dequantize kernel, the
/// warm-up's RMSNorm-folded GEMV).
/// Other kernels compile on first use, as do these when their source has changed since.
fn prebuilt_set() -> Vec<KernelId> {
    let mut ids = Vec::new();
    // The decode step's GEMV shapes depend on the hidden size (`policy::default_decode_gemv`):
    // these of 4096 (Llama-3.1-8B) for every format below, those of 2048 (Qwen3-30B-A3B,
    // Llama-3.2-1B) for bf16 4-bit models and MoEs.
    let shapes = decoder_shapes(4096);
    let narrow = decoder_shapes(2048);
    let moe = |router| {
        DecoderFormats::default()
            .with(Some(4))
            .with(router)
            .with_experts()
    };
    if narrow != shapes {
        for formats in [DecoderFormats::default().with(Some(4)), moe(Some(8))] {
            ids.push(KernelId::Decoder {
                dtype: Dtype::Bfloat16,
                formats,
                shapes: narrow,
            });
        }
    }
    for dtype in [Dtype::Bfloat16, Dtype::Float16] {
        for bits in BITS {
            let formats = DecoderFormats::default().with(Some(bits));
            ids.push(KernelId::Decoder {
                dtype,
                formats,
                shapes,
            });
            ids.push(KernelId::Dequant { bits, dtype });
            ids.push(KernelId::Qmv {
                bits,
                dtype,
                shape: RMSNORM_FOLDED_SHAPE,
                rows_per_block: 1,
                fold: GemvFold {
                    pre: 1,
                    residual: false,
                },
            });
        }
        let formats = DecoderFormats::default().with(None);
        ids.push(KernelId::Decoder {
            dtype,
            formats,
            shapes,
        });
        // A 4-bit MoE as mlx-lm writes it (8-bit routers: Qwen3-MoE's `quant_predicate`).
        ids.push(KernelId::Decoder {
            dtype,
            formats: moe(Some(8)),
            shapes,
        });
        ids.push(KernelId::SiluHalves { dtype });
        ids.push(KernelId::TakeRows { dtype });
        ids.push(KernelId::HeadsRope { dtype });
        ids.push(KernelId::HeadsNormRope { dtype });
        // A MoE prompt's SiLU gating of separate expert projections, and its router as one
        // kernel (MLXCEL_CUDA_ROUTER).
        ids.push(KernelId::SiluMul { dtype });
        ids.push(KernelId::RouteTopk { dtype });
        // MoE prefill's routed-expert product (4-bit experts).
        ids.push(KernelId::QmmGather {
            dtype,
            warps: GATHER_SHAPE.0,
            row_tiles: GATHER_SHAPE.1,
        });
    }
    ids.push(KernelId::TakeRows {
        dtype: Dtype::Uint32,
    });
    // A MoE prompt's routing: the chosen experts' float32 scores.
    ids.push(KernelId::TakeAlongRows {
        dtype: Dtype::Float32,
    });
    // The benchmark's random 30B-A3B shape (xtask/bench/make_random_model.py: dense routers).
    ids.push(KernelId::Decoder {
        dtype: Dtype::Bfloat16,
        formats: moe(None),
        shapes: narrow,
    });
    ids
}

/// A compiled module's file name (in the disk cache and kernels/prebuilt/): the kernel, the
/// GPU architecture and a fingerprint of the source, so a changed kernel is never taken from
/// an old file.
fn binary_file_name(entry: &Entry, source: &str, arch: i32) -> String {
    format!("{}-sm{arch}-{:016x}.cubin", entry.name, fingerprint(source))
}

/// Compiles the kernels shipped prebuilt (`prebuilt_set`) for this process's GPU into `dir`
/// (created if needed), under the names `binary` looks them up by, skipping those this build
/// already ships for it; returns the files written. Run on a GPU machine, then commit the files
/// into `crates/mlxcel-core/kernels/prebuilt/` (and delete the stale ones the CPU test names).
pub fn prebuild(dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>> {
    prebuild_for(dir, bridge::cuda_device_arch()?)
}

/// [`prebuild`] for GPU architecture `arch` (e.g. 90), with whatever NVRTC the process has
/// loaded: a GPU is not needed (the CPU test `prebuild_cubins_for_sm90` uses NVRTC from PyPI).
fn prebuild_for(dir: &std::path::Path, arch: i32) -> Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::Invalid(format!("{}: {e}", dir.display())))?;
    let mut written = Vec::new();
    for id in prebuilt_set() {
        let entry = id.entry();
        let source = entry.source();
        let name = binary_file_name(&entry, &source, arch);
        if PREBUILT_CUBINS.iter().any(|(shipped, _)| *shipped == name) {
            continue;
        }
        let image = bridge::cuda_compile(&source, &entry.name, arch)?;
        let file = dir.join(name);
        std::fs::write(&file, image)
            .map_err(|e| Error::Invalid(format!("{}: {e}", file.display())))?;
        written.push(file);
    }
    Ok(written)
}

/// A kernel's compiled module, kept for the life of the process (like MLX's own loaded kernels),
/// or why it could not be built.
type Loaded = std::result::Result<&'static CudaBinary, String>;

/// The compiled module of `id` for this process's GPU: from memory, from the disk cache, or
/// compiled now (and cached on disk for the next process).
fn binary(id: KernelId) -> Result<&'static CudaBinary> {
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
            let name = binary_file_name(&entry, &source, arch);
            let shipped = PREBUILT_CUBINS
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, image)| std::borrow::Cow::Borrowed(*image));
            let file = crate::cache_dir().map(|d| d.join("cuda").join(&name));
            let cached = || {
                let image = std::fs::read(file.as_ref()?).ok()?;
                Some(std::borrow::Cow::Owned(image))
            };
            let image = match shipped.or_else(cached) {
                Some(image) => image,
                None => {
                    let compiling = std::time::Instant::now();
                    let image = bridge::cuda_compile(&source, &entry.name, arch)?;
                    let took = compiling.elapsed();
                    COMPILE_NANOS
                        .fetch_add(took.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
                    if std::env::var_os("MLXCEL_KERNEL_LOG").is_some() {
                        eprintln!(
                            "[mlxcel CUDA kernel {name}: compiled in {:.2} s]",
                            took.as_secs_f64()
                        );
                    }
                    if let Some(file) = &file {
                        save(file, &image);
                    }
                    std::borrow::Cow::Owned(image)
                }
            };
            let binary = bridge::cuda_binary_new(&image, &entry.name)?;
            Box::leak(Box::new(binary))
                .as_ref()
                .ok_or_else(|| Error::Invalid("null CUDA module".into()))
        };
        build().map_err(|e| format!("mlxcel's CUDA kernel {}: {e}", entry.name))
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

/// Whether the default device is a GPU on MLX's CUDA backend (a Linux GPU; Apple GPUs run
/// Metal, whose memory is the system's).
pub fn on_gpu() -> Result<bool> {
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
    let mut outputs = call_outputs(id, inputs, &[(shape, dtype)], scalars, grid, threadgroup)?;
    Ok(outputs.remove(0))
}

/// [`call`] of a kernel with several outputs (`(shape, dtype)` each, in its argument order).
fn call_outputs(
    id: KernelId,
    inputs: &[Array],
    outputs: &[(Vec<i32>, Dtype)],
    scalars: &[i32],
    grid: [i32; 3],
    threadgroup: [i32; 3],
) -> Result<Vec<Array>> {
    let binary = binary(id)?;
    let list = ArrayList::new(inputs)?;
    let shapes: Vec<i32> = outputs
        .iter()
        .flat_map(|(s, _)| s.iter().copied())
        .collect();
    let ndims: Vec<i32> = outputs.iter().map(|(s, _)| s.len() as i32).collect();
    let dtypes: Vec<Dtype> = outputs.iter().map(|(_, d)| *d).collect();
    let out = bridge::cuda_binary_call(
        binary,
        list.as_ref(),
        &shapes,
        &ndims,
        &dtypes,
        scalars,
        &grid,
        &threadgroup,
    )?;
    ArrayList::from_raw(out).into_vec()
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

/// What the GEMV does to its activations before the product (`PRE` of qmv.cu): folding the op
/// that would precede it saves a kernel and, in decode, the MLX host time of a graph node.
#[derive(Debug, Clone, Copy)]
pub enum GemvInput<'a> {
    /// The activations as they are.
    Plain,
    /// `fast::rms_norm(x, weight, eps)`: the pre-norm of the block the layer opens.
    RmsNorm {
        /// The norm's weight, `[K]` in the scales' dtype.
        weight: &'a Array,
        /// Added to the mean square before the reciprocal square root.
        eps: f32,
    },
    /// `silu(gate) * up` of `x = [gate | up]` (a fused gate/up projection's output).
    SiluGated,
}

impl GemvInput<'_> {
    fn pre(&self) -> i32 {
        match self {
            GemvInput::Plain => 0,
            GemvInput::RmsNorm { .. } => 1,
            GemvInput::SiluGated => 2,
        }
    }
}

/// The GEMV's launch shape: `MLXCEL_CUDA_QMV`'s, else the default.
fn qmv_launch_shape() -> (i32, i32) {
    qmv_shape().unwrap_or(DEFAULT_QMV_SHAPE)
}

/// `NWxRPW` (warps per block, rows per block) from `value`, if valid.
/// The launch shape of a GEMV whose input op is `pre` (`GemvInput::pre`): a plain input takes
/// [`qmv_launch_shape`]; a folded one (RMSNorm, gate) has every block prepare the whole
/// activation row, so more rows per block spread that work over more output rows, at the cost
/// of fewer blocks. `MLXCEL_CUDA_QMV_FOLD_SHAPE=NWxRPW` sets one for both folded inputs.
fn gemv_launch_shape(pre: i32) -> (i32, i32) {
    if pre == 0 {
        return qmv_launch_shape();
    }
    let set = crate::policy::with(|p| p.cuda_qmv_fold_shape.map(LaunchShape::pair));
    set.unwrap_or(if pre == 1 {
        RMSNORM_FOLDED_SHAPE
    } else {
        GATED_FOLDED_SHAPE
    })
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
    gemv_applies(x, weight, scales, biases, spec, GemvInput::Plain, None)
}

/// Whether [`gemv`] takes these operands: the GEMV is enabled and on a GPU, the matrix is affine
/// 4/8-bit (see `affine_matrix`), `x` holds at most [`QMV_MAX_ROWS`] rows of `K` activations
/// (`2K` for [`GemvInput::SiluGated`]) in the scales' dtype, a norm weight is `[K]` and a
/// residual has the output's shape, both in that dtype.
pub fn gemv_applies(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    spec: QuantSpec,
    input: GemvInput<'_>,
    residual: Option<&Array>,
) -> Result<bool> {
    let folds = input.pre() != 0 || residual.is_some();
    if qmv_shape().is_none() || (folds && !folding_enabled()) || !on_gpu()? {
        return Ok(false);
    }
    let dtype = x.dtype()?;
    if !affine_matrix(weight, scales, biases, spec, dtype)? {
        return Ok(false);
    }
    let k = weight.dim(1)? * 32 / spec.bits;
    let row = x.dim(-1)?;
    let rows = x.size() / row.max(1) as usize;
    let row_ok = match input {
        GemvInput::Plain => row == k,
        GemvInput::RmsNorm { weight: w, .. } => row == k && w.shape() == [k] && w.dtype()? == dtype,
        GemvInput::SiluGated => row == 2 * k,
    };
    let residual_ok = match residual {
        None => true,
        Some(r) => {
            let mut out = x.shape();
            *out.last_mut().expect("x has a last dimension") = weight.dim(0)?;
            r.shape() == out && r.dtype()? == dtype
        }
    };
    // An RMSNorm folded into a many-row GEMV would have every block normalise every row
    // (more L2 traffic than the weights): batches normalise once, unfolded.
    let fold_ok = rows == 1 || !shared_row_blocks() || !matches!(input, GemvInput::RmsNorm { .. });
    // A batch the tensor-core GEMV takes leaves its norm and gating unfolded (the callers then
    // run them as ops and the product as a plain GEMV): only the one-row-per-row kernel folds
    // them, and it reads the weights once per row (5x slower at 8 rows on an H200).
    let mma_batch =
        rows > 1 && mma_enabled() && qmv_mma_takes(rows as i32, spec, dtype, GemvInput::Plain);
    let input_ok = !mma_batch || matches!(input, GemvInput::Plain);
    Ok(row_ok && residual_ok && fold_ok && input_ok && rows <= QMV_MAX_ROWS)
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
    gemv(x, weight, scales, biases, spec, GemvInput::Plain, None)
}

/// `input(x) @ dequantize(w)^T (+ residual)` as one kernel (see [`gemv_applies`] for what it
/// takes), launched in the default shapes (see `MLXCEL_CUDA_QMV`, `MLXCEL_CUDA_QMV_FOLD_SHAPE`).
pub fn gemv(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
    input: GemvInput<'_>,
    residual: Option<&Array>,
) -> Result<Array> {
    let rows = (x.size() / x.dim(-1)?.max(1) as usize) as i32;
    if mma_enabled() && qmv_mma_takes(rows, spec, x.dtype()?, input) {
        return gemv_mma(x, weight, scales, biases, residual, None);
    }
    let (shape, _) = gemv_plan(rows, input.pre());
    gemv_shaped(x, weight, scales, biases, spec, input, residual, shape)
}

fn mma_enabled() -> bool {
    crate::policy::with(|p| p.cuda_qmv_mma)
}

/// Whether the tensor-core GEMV (qmv_mma.cu) computes a GEMV [`gemv_applies`] took, when
/// `MLXCEL_CUDA_QMV_MMA` is on: 2..=16 activation rows, 4-bit weights, bf16/f16 activations,
/// a plain input (a residual may be folded).
fn qmv_mma_takes(rows: i32, spec: QuantSpec, dtype: Dtype, input: GemvInput<'_>) -> bool {
    (2..=QMV_MAX_ROWS as i32).contains(&rows)
        && spec.bits == 4
        && QMV_MMA_DTYPES.contains(&dtype)
        && matches!(input, GemvInput::Plain)
}

/// `x @ dequantize(w)^T (+ residual)` on the tensor-core GEMV (qmv_mma.cu) whatever the policy
/// says (for checks and measurements; [`gemv`] picks it under `MLXCEL_CUDA_QMV_MMA=1`): `x`
/// holds 1..=16 rows of `K` bf16/f16 activations, the matrix is affine 4-bit with scales and
/// biases in `x`'s dtype (see [`gemv_applies`]). `shape` is one of [`QMV_MMA_SHAPES`], (warps,
/// 16-row tiles of output features) per block; `None` picks by `K`.
pub fn gemv_mma(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    residual: Option<&Array>,
    shape: Option<(i32, i32)>,
) -> Result<Array> {
    let dtype = x.dtype()?;
    let rows = (x.size() / x.dim(-1)?.max(1) as usize) as i32;
    if !QMV_MMA_DTYPES.contains(&dtype) || !(1..=QMV_MAX_ROWS as i32).contains(&rows) {
        return Err(Error::Invalid(format!(
            "qmv_mma: {rows} rows of {} activations (1..=16 of bfloat16/float16)",
            dtype.name()
        )));
    }
    let [n, words, groups] = matrix_scalars(weight, scales)?;
    if x.dim(-1)? != words * 8 || words % 4 != 0 {
        return Err(Error::Invalid(format!(
            "qmv_mma: {} activations per row for a 4-bit matrix of {words} words per row",
            x.dim(-1)?
        )));
    }
    // Long rows take more warps per block (more weight bytes in flight per block, as a matrix
    // of few output features has few blocks); unmeasured, to be tuned on the GPU.
    let (nw, rt) = shape.unwrap_or(if words * 8 >= 8192 { (8, 1) } else { (4, 1) });
    if !QMV_MMA_SHAPES.contains(&(nw, rt)) {
        return Err(Error::Invalid(format!(
            "qmv_mma: block shape {nw}x{rt} (one of {QMV_MMA_SHAPES:?})"
        )));
    }
    let mut out_shape = x.shape();
    *out_shape.last_mut().expect("x has a last dimension") = n;
    let mut inputs = vec![weight.clone(), scales.clone(), biases.clone(), x.clone()];
    inputs.extend(residual.cloned());
    let blocks = (n + 16 * rt - 1) / (16 * rt);
    let threads = nw * 32;
    call(
        KernelId::QmvMma {
            dtype,
            warps: nw,
            row_tiles: rt,
            act_tiles: if rows > 8 { 2 } else { 1 },
            residual: residual.is_some(),
        },
        &inputs,
        out_shape,
        dtype,
        &[n, words, groups, rows],
        [blocks * threads, 1, 1],
        [threads, 1, 1],
    )
}

/// The block shape of the routed-expert product ([`gather_qmm_sorted`]) unless a caller picks
/// one: (warps, 16-row tiles of output features), one of [`QMV_MMA_SHAPES`]. Two feature tiles
/// per block halve how often the rows are read from L2 against one.
pub const GATHER_SHAPE: (i32, i32) = (4, 2);

/// Whether [`gather_qmm_sorted`] takes this routed-expert product: enabled
/// (`MLXCEL_CUDA_GATHER`) and on a GPU; affine 4-bit experts with groups of 32, 64 or 128 and
/// biases, as `spec` says and the planes agree (see `gather_operands_fault`). The caller
/// vouches that the ids are sorted.
pub fn gather_qmm_applies(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: Option<&Array>,
    spec: QuantSpec,
    ids: &Array,
) -> Result<bool> {
    if !crate::policy::with(|p| p.cuda_gather) || !on_gpu()? {
        return Ok(false);
    }
    let Some(biases) = biases else {
        return Ok(false);
    };
    if spec.mode != QuantMode::Affine || spec.bits != 4 || scales.ndim() != 3 {
        return Ok(false);
    }
    // The planes' group size must be the one the caller quantized with.
    let k = weight.dim(-1)? as i64 * 8;
    if k != spec.group_size as i64 * scales.dim(2)? as i64 {
        return Ok(false);
    }
    Ok(gather_operands_fault(x, weight, scales, biases, ids)?.is_none())
}

/// What keeps `qmm_gather` from reading these operands safely, if anything: a 3-D uint32 stack
/// `[E, N, K/8]` (E > 0), scales and biases `[E, N, K/gs]` in `x`'s dtype (bf16/f16) with gs
/// 32, 64 or 128, `x` rows of `K` activations, one uint32 expert id per row (at least one
/// row), and sizes a 32-bit index covers.
fn gather_operands_fault(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    ids: &Array,
) -> Result<Option<String>> {
    let dtype = x.dtype()?;
    if !QMV_MMA_DTYPES.contains(&dtype) {
        return Ok(Some(format!(
            "{} activations (bfloat16/float16)",
            dtype.name()
        )));
    }
    if weight.ndim() != 3 || weight.dtype()? != Dtype::Uint32 || weight.dim(0)? == 0 {
        return Ok(Some(format!(
            "a weight stack {:?} of {} (a non-empty uint32 [experts, N, K/8])",
            weight.shape(),
            weight.dtype()?.name()
        )));
    }
    let (experts, n, words) = (weight.dim(0)?, weight.dim(1)?, weight.dim(2)?);
    let k = words as i64 * 8;
    let groups = if scales.ndim() == 3 {
        scales.dim(2)?
    } else {
        0
    };
    let group_size = if groups > 0 { k / groups as i64 } else { 0 };
    if scales.shape() != [experts, n, groups]
        || biases.shape() != scales.shape()
        || scales.dtype()? != dtype
        || biases.dtype()? != dtype
        || !matches!(group_size, 32 | 64 | 128)
        || group_size * groups as i64 != k
    {
        return Ok(Some(format!(
            "scales {:?} and biases {:?} of {}/{} for {experts}x{n} rows of K = {k} \
             ([experts, N, K/gs] in the activations' {}, gs 32/64/128)",
            scales.shape(),
            biases.shape(),
            scales.dtype()?.name(),
            biases.dtype()?.name(),
            dtype.name()
        )));
    }
    let rows = x.size() as i64 / (x.dim(-1)? as i64).max(1);
    if x.dim(-1)? as i64 != k || ids.dtype()? != Dtype::Uint32 || ids.size() as i64 != rows {
        return Ok(Some(format!(
            "{rows} rows of {} activations and {} {} ids for experts of K = {k} (one uint32 id \
             per row)",
            x.dim(-1)?,
            ids.size(),
            ids.dtype()?.name()
        )));
    }
    let fits = rows > 0
        && (experts as i64) * (n as i64) * (words as i64) < i32::MAX as i64 * 4
        && rows * n as i64 <= i32::MAX as i64
        && rows * k <= i32::MAX as i64;
    Ok((!fits).then(|| format!("{rows} rows of {experts}x{n}x{k} (1 to 2^31 - 1 outputs)")))
}

/// `out[m] = x[m] @ dequantize(weight[ids[m]])^T`: each activation row against the expert its
/// id names, for rows sorted by expert (`ids` non-decreasing; MoE prefill sorts its (token,
/// expert) pairs), on mlxcel's tensor-core kernel (qmm_gather of qmv_mma.cu; see
/// [`gather_qmm_applies`] for what it takes; operands it cannot read are an error). The result
/// is `x`'s shape with the last axis `N`. `shape`: (warps, 16-row feature tiles) per block, one
/// of [`QMV_MMA_SHAPES`]; `None` takes [`GATHER_SHAPE`].
pub fn gather_qmm_sorted(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    ids: &Array,
    shape: Option<(i32, i32)>,
) -> Result<Array> {
    if let Some(fault) = gather_operands_fault(x, weight, scales, biases, ids)? {
        return Err(Error::Invalid(format!("qmm_gather: {fault}")));
    }
    let dtype = x.dtype()?;
    let (experts, n, words) = (weight.dim(0)?, weight.dim(1)?, weight.dim(2)?);
    let groups = scales.dim(2)?;
    let rows = (x.size() / x.dim(-1)?.max(1) as usize) as i32;
    let (nw, rt) = shape.unwrap_or(GATHER_SHAPE);
    if !QMV_MMA_SHAPES.contains(&(nw, rt)) {
        return Err(Error::Invalid(format!(
            "qmm_gather: block shape {nw}x{rt} (one of {QMV_MMA_SHAPES:?})"
        )));
    }
    let mut out_shape = x.shape();
    *out_shape.last_mut().expect("x has a last dimension") = n;
    let threads = nw * 32;
    let row_tiles = (rows + 15) / 16;
    let feature_tiles = (n + 16 * rt - 1) / (16 * rt);
    call(
        KernelId::QmmGather {
            dtype,
            warps: nw,
            row_tiles: rt,
        },
        &[
            weight.clone(),
            scales.clone(),
            biases.clone(),
            x.clone(),
            ids.reshape(&[-1])?,
        ],
        out_shape,
        dtype,
        &[n, words, groups, rows, experts],
        [row_tiles * threads, feature_tiles, 1],
        [threads, 1, 1],
    )
}

/// The launch shape and activation rows per block of a GEMV over `rows` activation rows with
/// input op `pre`: one row takes its tuned shape ([`gemv_launch_shape`]); several take
/// [`BATCH_QMV_SHAPE`], their blocks sharing weight reads across rows.
fn gemv_plan(rows: i32, pre: i32) -> ((i32, i32), i32) {
    if rows <= 1 || !shared_row_blocks() {
        return (gemv_launch_shape(pre), 1);
    }
    let shape = BATCH_QMV_SHAPE;
    (shape, activation_rows_per_block(rows, shape.1))
}

/// [`gemv`] launched with `(warps, rows)` per block (for measuring launch shapes).
#[allow(clippy::too_many_arguments)]
pub fn gemv_shaped(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
    input: GemvInput<'_>,
    residual: Option<&Array>,
    (nw, rpw): (i32, i32),
) -> Result<Array> {
    let dtype = x.dtype()?;
    let rows = (x.size() / x.dim(-1)? as usize) as i32;
    let [n, words, groups] = matrix_scalars(weight, scales)?;
    // The kernel reads x as [rows, K] whatever its leading dimensions, so neither x nor the
    // output is reshaped: every extra graph node costs MLX dispatch time in decode.
    let mut shape = x.shape();
    *shape.last_mut().expect("x has a last dimension") = n;
    let blocks = (n + rpw - 1) / rpw;
    let mb = activation_rows_per_block(rows, rpw);
    let mut inputs = vec![weight.clone(), scales.clone(), biases.clone(), x.clone()];
    let mut scalars = vec![n, words, groups, rows];
    if let GemvInput::RmsNorm { weight: w, eps } = input {
        inputs.push(w.clone());
        scalars.push(eps.to_bits() as i32);
    }
    inputs.extend(residual.cloned());
    let fold = GemvFold {
        pre: input.pre(),
        residual: residual.is_some(),
    };
    call(
        KernelId::Qmv {
            bits: spec.bits,
            dtype,
            shape: (nw, rpw),
            rows_per_block: mb,
            fold,
        },
        &inputs,
        shape,
        dtype,
        &scalars,
        [blocks * nw * 32, (rows + mb - 1) / mb, 1],
        [nw * 32, 1, 1],
    )
}

/// Whether several activation rows share GEMV blocks (`MLXCEL_CUDA_QMV_ROWS` above 1; off by
/// default). With it off, each row of a decode batch has blocks of its own in the one-row
/// launch shapes: the configuration measured on the H200 (docs/performance.md, serving).
fn shared_row_blocks() -> bool {
    crate::policy::with(|p| p.cuda_qmv_rows) > 1
}

/// How many of `rows` activation rows one GEMV block multiplies (`MB` of qmv.cu): each block
/// reads its weight rows once for all of them, so a decode batch of 8 streams the matrix once
/// rather than 8 times. A power of two (few compiled variants), at most 8, and at most 16
/// accumulators per thread (`MB * RPW`) so wide shapes do not spill registers.
/// `MLXCEL_CUDA_QMV_ROWS` lowers the cap.
fn activation_rows_per_block(rows: i32, rpw: i32) -> i32 {
    let set = crate::policy::with(|p| p.cuda_qmv_rows);
    let cap = (16 / rpw.max(1)).clamp(1, 8).min(set.max(1));
    (rows.max(1) as u32).next_power_of_two().min(cap as u32) as i32
}

/// Whether [`selective_scan`] takes a scan of `x` `[B, L, H, P]` with `bm` `[B, L, G, N]`: on a
/// GPU, enabled for this many positions (`MLXCEL_CUDA_SCAN`), `N` at most 256, `G` dividing `H`
/// (the caller has checked every operand is float32).
pub(crate) fn scan_applies(x: &Array, bm: &Array) -> Result<bool> {
    use crate::policy::CudaScan;
    let enabled = match crate::policy::with(|p| p.cuda_scan) {
        CudaScan::Off => false,
        CudaScan::Decode => x.dim(1)? == 1,
        CudaScan::All => true,
    };
    if !enabled || !on_gpu()? || x.ndim() != 4 || bm.ndim() != 4 {
        return Ok(false);
    }
    let (h, g, n) = (x.dim(2)?, bm.dim(2)?, bm.dim(3)?);
    Ok(g > 0 && h % g == 0 && (1..=256).contains(&n))
}

/// The selective scan on mlxcel's CUDA kernel (`scan.cu`), for `ops::selective_scan`: operands
/// as that function describes them (float32), the output packed as `[B, L·H·P + H·P·N]` (`y`,
/// then the last state), as the CPU kernel's is.
pub fn selective_scan(
    x: &Array,
    dt: &Array,
    a: &Array,
    bm: &Array,
    cm: &Array,
    h0: &Array,
    per_head_decay: bool,
) -> Result<Array> {
    let (b, l, h, p) = (x.dim(0)?, x.dim(1)?, x.dim(2)?, x.dim(3)?);
    let (g, n) = (bm.dim(2)?, bm.dim(3)?);
    let states_per_lane = SCAN_STATES_PER_LANE
        .into_iter()
        .find(|&j| j * 32 >= n)
        .ok_or_else(|| {
            Error::Invalid(format!(
                "selective scan: {n} states per channel (at most 256)"
            ))
        })?;
    let rows = i64::from(b) * i64::from(h) * i64::from(p);
    let threads = i32::try_from(rows * 32)
        .map_err(|_| Error::Invalid(format!("selective scan: {rows} rows")))?;
    call(
        KernelId::Scan { states_per_lane },
        &[
            x.clone(),
            dt.clone(),
            a.clone(),
            bm.clone(),
            cm.clone(),
            h0.clone(),
        ],
        vec![b, l * h * p + h * p * n],
        Dtype::Float32,
        &[b, l, h, p, g, n, i32::from(per_head_decay)],
        [threads, 1, 1],
        [SCAN_THREADS, 1, 1],
    )
}

#[cfg(test)]
mod tests {
    use crate::{Array, Dtype};

    fn zeros(shape: &[i32], dtype: Dtype) -> Array {
        crate::ops::zeros(shape, dtype).unwrap()
    }

    /// `qmm_gather`'s operand check passes a well-formed stack and names what is wrong with a
    /// bad one, before any kernel could read past an operand (`gather_qmm_sorted` errors).
    #[test]
    fn gather_operands_are_checked_before_the_kernel() {
        let (e, n, k, gs, rows) = (4, 48, 256, 64, 20);
        let bf16 = Dtype::Bfloat16;
        let w = zeros(&[e, n, k / 8], Dtype::Uint32);
        let sc = zeros(&[e, n, k / gs], bf16);
        let x = zeros(&[rows, 1, k], bf16);
        let ids = zeros(&[rows], Dtype::Uint32);
        let fault = |x: &Array, w: &Array, s: &Array, b: &Array, i: &Array| {
            super::gather_operands_fault(x, w, s, b, i).unwrap()
        };
        assert_eq!(fault(&x, &w, &sc, &sc, &ids), None);
        let cases: [(&str, Option<String>); 8] = [
            (
                "float32",
                fault(&x.astype(Dtype::Float32).unwrap(), &w, &sc, &sc, &ids),
            ),
            (
                "uint32 [experts",
                fault(&x, &w.reshape(&[e * n, k / 8]).unwrap(), &sc, &sc, &ids),
            ),
            (
                "scales [4, 24, 4]",
                fault(&x, &w, &zeros(&[e, n / 2, k / gs], bf16), &sc, &ids),
            ),
            (
                "scales [4, 48, 16]",
                fault(&x, &w, &zeros(&[e, n, k / 16], bf16), &sc, &ids),
            ),
            (
                "float16",
                fault(&x, &w, &sc, &zeros(&[e, n, k / gs], Dtype::Float16), &ids),
            ),
            (
                "int32 ids",
                fault(&x, &w, &sc, &sc, &zeros(&[rows], Dtype::Int32)),
            ),
            (
                "19 uint32 ids",
                fault(&x, &w, &sc, &sc, &zeros(&[rows - 1], Dtype::Uint32)),
            ),
            (
                "0 rows",
                fault(
                    &zeros(&[0, 1, k], bf16),
                    &w,
                    &sc,
                    &sc,
                    &zeros(&[0], Dtype::Uint32),
                ),
            ),
        ];
        for (culprit, found) in cases {
            let found = found.unwrap_or_else(|| panic!("{culprit}: not refused"));
            assert!(found.contains(culprit), "{culprit}: {found}");
        }
        let err = super::gather_qmm_sorted(&x, &w, &sc, &sc, &zeros(&[rows], Dtype::Int32), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("qmm_gather") && err.contains("int32 ids"),
            "{err}"
        );
    }

    /// Every cubin shipped in kernels/prebuilt/ is a kernel of [`super::prebuilt_set`]
    /// compiled from today's source: a kernel edited since is flagged here (recompile with
    /// `cuda_kernels --prebuild DIR` on a GPU, or delete the stale file; it then compiles on
    /// first use).
    #[test]
    fn shipped_cubins_are_of_the_current_kernel_sources() {
        for (file, image) in super::PREBUILT_CUBINS {
            let arch: i32 = file
                .rsplit_once("-sm")
                .and_then(|(_, rest)| rest.split('-').next())
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("{file}: no -sm<arch>- in the name"));
            let current: Vec<String> = super::prebuilt_set()
                .into_iter()
                .map(|id| {
                    let entry = id.entry();
                    super::binary_file_name(&entry, &entry.source(), arch)
                })
                .collect();
            assert!(
                current.iter().any(|n| n == file),
                "kernels/prebuilt/{file} is of no current kernel source (expected one of {current:?})"
            );
            assert!(!image.is_empty(), "{file} is empty");
        }
        // And the whole set for sm_90 (a rebuild writes only the modules that changed: a
        // folder replaced by its output alone would send the others back to NVRTC on a fresh
        // machine's first process).
        for id in super::prebuilt_set() {
            let entry = id.entry();
            let name = super::binary_file_name(&entry, &entry.source(), 90);
            assert!(
                super::PREBUILT_CUBINS.iter().any(|(file, _)| *file == name),
                "kernels/prebuilt/{name} is missing (MLXCEL_PREBUILD_DIR=DIR cargo test -p \
                 mlxcel-core --lib prebuild_cubins_for_sm90 -- --ignored writes it)"
            );
        }
    }

    use super::*;

    /// NVRTC 12.9 from PyPI (the `nvidia-cuda-nvrtc-cu12` wheel: no GPU or driver needed),
    /// installed once under the cache folder, loaded so that cuda_compile.cc's `dlsym` finds it
    /// as it finds MLX's NVRTC on a GPU machine.
    fn load_nvrtc() {
        const WHEEL: &str = "nvidia-cuda-nvrtc-cu12==12.9.86";
        let dir = crate::cache_dir()
            .expect("a cache folder (HOME or MLXCEL_CACHE_DIR)")
            .join("nvrtc-12.9.86");
        let lib = dir.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12");
        if !lib.is_file() {
            let python = std::env::var("MLXCEL_PYTHON").unwrap_or_else(|_| "python3".into());
            let status = std::process::Command::new(&python)
                .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
                .arg(&dir)
                .arg(WHEEL)
                .status()
                .expect("running pip");
            assert!(status.success(), "pip install {WHEEL} failed");
        }
        let path = std::ffi::CString::new(lib.to_str().expect("a UTF-8 path")).unwrap();
        // SAFETY: dlopen of a shared library by path; the handle stays open for the process.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        assert!(!handle.is_null(), "could not load {}", lib.display());
    }

    /// Writes the shipped cubins of changed kernel sources for sm_90 (H100/H200) into
    /// `MLXCEL_PREBUILD_DIR` with NVRTC from PyPI, for a machine without a GPU; the GPU path is
    /// `cuda_kernels --prebuild DIR`. Copy the files into kernels/prebuilt/ and delete the stale
    /// ones `shipped_cubins_are_of_the_current_kernel_sources` names.
    #[test]
    #[ignore = "a tool: writes cubins into MLXCEL_PREBUILD_DIR"]
    fn prebuild_cubins_for_sm90() {
        let dir = std::env::var("MLXCEL_PREBUILD_DIR").expect("MLXCEL_PREBUILD_DIR");
        load_nvrtc();
        for file in super::prebuild_for(std::path::Path::new(&dir), 90).expect("prebuild") {
            println!("{}", file.display());
        }
    }

    /// Every kernel of this build compiles, through mlxcel's own compile path, for the H200
    /// (sm_90) the GPU benchmarks run on; a broken source is an error naming the module.
    #[test]
    fn kernel_sources_compile_with_nvrtc() {
        if !cfg!(all(target_os = "linux", target_arch = "x86_64")) {
            return; // the wheel is Linux x86-64 only
        }
        load_nvrtc();
        let source = module_source();
        let image = bridge::cuda_compile(&source, "mlxcel_all", 90).expect("the module compiles");
        assert!(image.starts_with(b"\x7fELF"), "a cubin is an ELF image");
        for name in [
            "mlxcel_qmv_b4_bfloat16_4x8_m1_rmsnorm",
            "mlxcel_qmv_b4_bfloat16_4x2_m8",
            "mlxcel_qmv_b4_bfloat16_4x2_m2_silugate_residual",
            "mlxcel_qmv_b8_float32_16x16_m1_silugate_residual",
            "mlxcel_qmv_mma_b4_bfloat16_4w_r2_n2_residual",
            "mlxcel_qmv_mma_b4_float16_8w_r1_n1",
            "mlxcel_gather_2",
            "mlxcel_dec_qmv_b4_rms_bfloat16",
            "mlxcel_dec_qmv_b8_glu_float16",
            "mlxcel_dec_attention_bfloat16",
            "mlxcel_dec_dmv_glu_bfloat16",
            "mlxcel_dec_attention_float16",
            "mlxcel_dec_route_bfloat16",
            "mlxcel_dec_router_b4_bfloat16",
            "mlxcel_dec_router_dense_float16",
            "mlxcel_dec_moe_glu_b4_bfloat16",
            "mlxcel_dec_moe_down_b8_float16",
            "mlxcel_dec_moe_down_dense_bfloat16",
        ] {
            assert!(source.contains(name), "{name} missing from the module");
        }
        let err = bridge::cuda_compile("__global__ void k() { undefined_call(); }", "broken", 90)
            .expect_err("a bad source must not compile");
        assert!(err.to_string().contains("broken.cu"), "{err}");
    }

    /// A model's decoder module holds the GEMVs of its weight formats and the attention
    /// kernel, nothing else (each set's source differs, and so does its cache file).
    #[test]
    fn decoder_modules_hold_the_formats_asked_for() {
        let formats = DecoderFormats::default().with(Some(4)).with(Some(4));
        let plain = DecoderShapes::default();
        let entry = decoder_entry(Dtype::Bfloat16, formats, plain);
        for kind in ["rms", "res", "glu"] {
            assert!(entry
                .wrapper
                .contains(&format!("mlxcel_dec_qmv_b4_{kind}_bfloat16(")));
        }
        assert!(!entry.wrapper.contains("mlxcel_dec_qmt_"));
        // The tensor-core GEMVs, of the shape asked for, with 4-bit weights only.
        let tc_shapes = |tc| DecoderShapes {
            tensor_cores: Some(tc),
            ..plain
        };
        let tc = decoder_entry(Dtype::Bfloat16, formats, tc_shapes((4, 32)));
        for kind in ["rms", "res", "glu"] {
            assert!(tc
                .wrapper
                .contains(&format!("mlxcel_dec_qmt_b4_{kind}_bfloat16(")));
        }
        assert!(tc.wrapper.contains("dec_qmt<4, 2, "));
        // Blocks per SM asked for reach the GEMVs' launch bounds (by default 8 for the residual
        // GEMVs only).
        let bounded = decoder_entry(
            Dtype::Bfloat16,
            formats,
            DecoderShapes {
                gemv: [
                    plain.gemv[0],
                    plain.gemv[1],
                    DecodeGemv {
                        min_blocks: 6,
                        ..plain.gemv[2]
                    },
                ],
                ..plain
            },
        );
        assert!(bounded
            .wrapper
            .contains("__launch_bounds__(128, 6) mlxcel_dec_qmv_b4_glu_"));
        assert!(bounded
            .wrapper
            .contains("__launch_bounds__(128) mlxcel_dec_qmv_b4_rms_"));
        assert!(entry
            .wrapper
            .contains("__launch_bounds__(128, 8) mlxcel_dec_qmv_b4_res_"));
        assert_eq!(entry.wrapper.matches("__launch_bounds__(128, ").count(), 1);
        assert!(entry.wrapper.contains("mlxcel_dec_attention_bfloat16("));
        assert!(!entry.wrapper.contains("_b8_") && !entry.wrapper.contains("mlxcel_dec_dmv_"));
        let mixed = DecoderFormats::default().with(Some(8)).with(None);
        let entry = decoder_entry(Dtype::Float16, mixed, tc_shapes((8, 16)));
        assert!(entry.wrapper.contains("mlxcel_dec_qmv_b8_glu_float16("));
        assert!(entry.wrapper.contains("mlxcel_dec_dmv_res_float16("));
        assert!(!entry.wrapper.contains("_b4_") && !entry.wrapper.contains("mlxcel_dec_qmt_"));
        assert!(!entry.wrapper.contains("moe") && entry.kernel == QMV_AND_DECODE);
        let moe = decoder_entry(Dtype::Bfloat16, formats.with_experts(), plain);
        for name in ["route", "moe_glu_b4", "moe_down_b4"] {
            assert!(moe
                .wrapper
                .contains(&format!("mlxcel_dec_{name}_bfloat16(")));
        }
        assert!(!moe.wrapper.contains("_b8_") && moe.kernel == QMV_DECODE_AND_MOE);
        // The experts' GEMVs stage their weights as the policy says (by default in registers).
        assert!(moe.wrapper.contains("dec_moe_glu<4, 8, 0, "));
        assert!(moe.wrapper.contains("dec_moe_down<4, 8, 0, "));
        let staged = decoder_entry(
            Dtype::Bfloat16,
            formats.with_experts(),
            DecoderShapes {
                moe_stage: 4,
                ..plain
            },
        );
        assert!(staged.wrapper.contains("dec_moe_glu<4, 8, 4, "));
        // The attention's block size as the policy says (256 threads by default).
        assert!(moe.wrapper.contains("dec_attention<mlxcel_bf16, 256>("));
        let narrow = decoder_entry(
            Dtype::Bfloat16,
            formats,
            DecoderShapes {
                attn_threads: 128,
                ..plain
            },
        );
        assert!(narrow
            .wrapper
            .contains("__launch_bounds__(128) mlxcel_dec_attention_bfloat16("));
        assert!(narrow.wrapper.contains("dec_attention<mlxcel_bf16, 128>("));
        // A 1-warp RMSNorm-in GEMV leaves the routing to its own kernel: dec_router needs 2.
        assert!(moe.wrapper.contains("mlxcel_dec_router_b4_bfloat16("));
        let mut one_warp = plain;
        one_warp.gemv[0].shape = LaunchShape::new(1, 8).unwrap();
        let routed = decoder_entry(Dtype::Bfloat16, formats.with_experts(), one_warp);
        assert!(!fused_router_fits(&one_warp) && fused_router_fits(&plain));
        assert!(!routed.wrapper.contains("dec_router<"));
        assert!(routed.wrapper.contains("mlxcel_dec_route_bfloat16("));
        assert_eq!(
            DecoderFormats::default()
                .with(Some(4))
                .with(Some(8))
                .with(None)
                .with_experts(),
            DecoderFormats::ALL
        );
    }

    #[test]
    fn launch_shapes_parse_or_are_refused() {
        let parse = |v| LaunchShape::parse(v).map(LaunchShape::pair);
        assert_eq!(parse("4x8"), Some((4, 8)));
        assert_eq!(parse("16x16"), Some((16, 16)));
        for bad in ["", "4", "0x4", "4x0", "33x4", "1x33", "4x8x2", "ax4"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    extern "C" {
        /// cpp/cuda_emulation.cc: rows.cu's `heads_rope` run on the CPU.
        fn mlxcel_emulate_heads_rope(
            bf16: i32,
            qkv: *const std::ffi::c_void,
            inv_freq: *const f32,
            out: *mut std::ffi::c_void,
            batch: i32,
            len: i32,
            heads: i32,
            head_dim: i32,
            rope_heads: i32,
            rot_half: i32,
            traditional: i32,
            offset: i32,
        );
        fn mlxcel_emulate_heads_norm_rope(
            bf16: i32,
            qkv: *const std::ffi::c_void,
            q_norm: *const std::ffi::c_void,
            k_norm: *const std::ffi::c_void,
            inv_freq: *const f32,
            out: *mut std::ffi::c_void,
            batch: i32,
            len: i32,
            heads: i32,
            head_dim: i32,
            n_q: i32,
            rope_heads: i32,
            rot_half: i32,
            traditional: i32,
            offset: i32,
            eps: f32,
        );
        fn mlxcel_emulate_silu_halves(
            bf16: i32,
            x: *const std::ffi::c_void,
            out: *mut std::ffi::c_void,
            rows: i32,
            cols: i32,
        );
        fn mlxcel_emulate_silu_mul(
            bf16: i32,
            gate: *const std::ffi::c_void,
            up: *const std::ffi::c_void,
            out: *mut std::ffi::c_void,
            n: i32,
        );
        fn mlxcel_emulate_route_topk(
            bf16: i32,
            logits: *const f32,
            bias: *const f32,
            ids: *mut u32,
            weights: *mut std::ffi::c_void,
            rows: i32,
            experts: i32,
            k: i32,
            scoring: i32,
            has_bias: i32,
            normalize: i32,
            scale: f32,
        );
        fn mlxcel_emulate_take_along_rows(
            bf16: i32,
            values: *const std::ffi::c_void,
            ids: *const u32,
            out: *mut std::ffi::c_void,
            rows: i32,
            cols: i32,
            k: i32,
        );
    }

    /// Runs an emulated rows.cu kernel (cpp/cuda_emulation.cc) on `inputs` (their bytes, row
    /// major) into a new array of `shape` and `dtype` (float32 or bf16, which `run` gets as
    /// its first argument, 1 for bf16).
    fn emulated(
        inputs: &[&Array],
        shape: &[i32],
        dtype: Dtype,
        run: impl FnOnce(i32, &[*const std::ffi::c_void], *mut std::ffi::c_void),
    ) -> Array {
        let bytes: Vec<Vec<u8>> = inputs
            .iter()
            .map(|a| {
                let a = a.contiguous().unwrap();
                a.eval().unwrap();
                a.to_bytes().unwrap()
            })
            .collect();
        let pointers: Vec<*const std::ffi::c_void> =
            bytes.iter().map(|b| b.as_ptr().cast()).collect();
        let elements: usize = shape.iter().map(|&d| d as usize).product();
        let mut out = vec![0u8; elements * dtype.size_of()];
        run(
            i32::from(dtype == Dtype::Bfloat16),
            &pointers,
            out.as_mut_ptr().cast(),
        );
        Array::from_bytes(&out, shape, dtype).unwrap()
    }

    /// Values uniform in [-`range`, `range`) as `dtype`, from a seeded xorshift.
    fn uniform_array(shape: &[i32], range: f32, dtype: Dtype, seed: u64) -> Array {
        let mut state = seed | 1;
        let n: usize = shape.iter().map(|&d| d as usize).product();
        let values: Vec<f32> = (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * range
            })
            .collect();
        Array::from_slice(&values, shape)
            .unwrap()
            .astype(dtype)
            .unwrap()
    }

    fn float_values(a: &Array) -> Vec<f32> {
        a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
    }

    /// rows.cu's SiLU gating, run on the CPU (cpp/cuda_emulation.cc): `silu_halves` of a fused
    /// `[gate | up]` row and `silu_mul` of separate gate and up arrays, against MLX's unfused
    /// ops (`sigmoid`, two products), which round to the dtype after each op as the kernels do.
    /// The exponentials differ in their last bits, which a rounding can carry to a unit or two
    /// of the output: no output may be further off than that, and in bf16 at least 80% must be
    /// equal (87.5% measured; 68% with the gate's rounding left out of the kernel).
    #[test]
    fn silu_kernels_match_mlx_on_the_cpu() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let (rows, cols) = (7, 40);
            let x = uniform_array(&[rows, 2 * cols], 6.0, dtype, 11);
            let parts = x.split_at(&[cols], -1).unwrap();
            let (gate, up) = (
                parts[0].contiguous().unwrap(),
                parts[1].contiguous().unwrap(),
            );
            let silu = crate::ops::GatedActivation::Silu;
            let want =
                float_values(&crate::ops::gated_activation_as(silu, &gate, &up, false).unwrap());
            // SAFETY (both): the pointers hold the inputs' bytes in `dtype`, `out` room for
            // rows x cols outputs.
            let halves = emulated(&[&x], &[rows, cols], dtype, |bf16, inputs, out| unsafe {
                mlxcel_emulate_silu_halves(bf16, inputs[0], out, rows, cols)
            });
            let mul = emulated(
                &[&gate, &up],
                &[rows, cols],
                dtype,
                |bf16, inputs, out| unsafe {
                    mlxcel_emulate_silu_mul(bf16, inputs[0], inputs[1], out, rows * cols)
                },
            );
            // Two units in the last place, relative to the value (bf16: 8 bits of precision).
            let units = if dtype == Dtype::Bfloat16 {
                2f32.powi(-6)
            } else {
                2f32.powi(-21)
            };
            for (what, got) in [("silu_halves", halves), ("silu_mul", mul)] {
                let got = float_values(&got);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= units * w.abs(),
                        "{what} {} output {i}: kernel {g}, MLX {w}",
                        dtype.name()
                    );
                }
                let equal = got.iter().zip(&want).filter(|(g, w)| g == w).count();
                assert!(
                    dtype != Dtype::Bfloat16 || equal * 5 >= got.len() * 4,
                    "{what}: {equal} of {} outputs equal MLX's",
                    got.len()
                );
            }
        }
    }

    /// rows.cu's `take_along_rows` (a router's chosen experts' scores), run on the CPU, gives
    /// MLX's `take_along_axis` bit for bit; an id past its row reads the row's last column.
    #[test]
    fn take_along_rows_kernel_matches_mlx_on_the_cpu() {
        let (rows, cols, k) = (5, 17, 4);
        let ids: Vec<u32> = (0..rows * k).map(|i| ((i * 7 + 3) % cols) as u32).collect();
        let ids = Array::from_slice(&ids, &[rows, k]).unwrap();
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let values = uniform_array(&[rows, cols], 1.0, dtype, 5);
            let want = float_values(&values.take_along_axis(&ids, -1).unwrap());
            let ids_bytes = ids.to_vec::<u32>().unwrap();
            let got = emulated(&[&values], &[rows, k], dtype, |bf16, inputs, out| unsafe {
                // SAFETY: values' bytes, rows x k ids below `cols`, room for rows x k outputs.
                mlxcel_emulate_take_along_rows(
                    bf16,
                    inputs[0],
                    ids_bytes.as_ptr(),
                    out,
                    rows,
                    cols,
                    k,
                )
            });
            assert_eq!(float_values(&got), want, "{}", dtype.name());
            // Clamped: every id past the row reads its last column.
            let past = vec![cols as u32 + 5; (rows * k) as usize];
            let clamped = emulated(&[&values], &[rows, k], dtype, |bf16, inputs, out| unsafe {
                // SAFETY: as above; the kernel clamps the ids.
                mlxcel_emulate_take_along_rows(bf16, inputs[0], past.as_ptr(), out, rows, cols, k)
            });
            let last = float_values(&values.slice_axis(1, cols - 1, cols).unwrap());
            for (r, row) in float_values(&clamped).chunks(k as usize).enumerate() {
                assert!(
                    row.iter().all(|v| *v == last[r]),
                    "{} row {r}",
                    dtype.name()
                );
            }
        }
    }

    /// rows.cu's `heads_rope`, run on the CPU thread by thread (cpp/cuda_emulation.cc), against
    /// MLX's own ops on the same projection: the transpose into heads, `fast::rope` on the
    /// queries and on the keys at `offset`, the values as they are. Full and partial rotation,
    /// halves and adjacent pairs, batches of 1 and 2, positions from 0 to 70,300. MLX's rope
    /// takes the periods (as llama3 scaling gives them), the kernel their reciprocals (what
    /// `RotaryEmbedding` hands it for every fixed scaling). The reference ropes in float32 and
    /// rounds once, as the kernel does: float32 agrees to float32 precision, bf16 to one unit
    /// in the last place.
    #[test]
    fn heads_rope_kernel_matches_mlx_rope_on_the_cpu() {
        use crate::ops::Rope;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut uniform = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
                })
                .collect()
        };
        // (batch, len, query heads, kv heads, head_dim, rotated dims, traditional, offset)
        let cases = [
            (1, 7, 4, 2, 16, 16, false, 0),
            (2, 5, 6, 2, 32, 32, false, 1000),
            (1, 9, 2, 1, 24, 8, true, 3),
            (2, 3, 3, 3, 16, 12, false, 37),
            (1, 300, 2, 1, 64, 64, true, 70_000),
        ];
        for (b, l, nq, nk, d, dims, traditional, offset) in cases {
            let heads = nq + 2 * nk;
            let base = 10_000.0f32;
            let rot_half = dims / 2;
            let periods: Vec<f32> = (0..rot_half)
                .map(|j| base.powf(2.0 * j as f32 / dims as f32) * (1.0 + 0.1 * j as f32))
                .collect();
            let periods_array = Array::from_slice(&periods, &[rot_half]).unwrap();
            // The kernel's angle per position: the reciprocal of what MLX divides positions by.
            let inv_freq: Vec<f32> = periods.iter().map(|p| 1.0 / p).collect();
            let spec = Rope {
                dims,
                traditional,
                base,
                scale: 1.0,
                freqs: Some(&periods_array),
            };
            let shape = [b, l, heads, d];
            let values = uniform((b * l * heads * d) as usize);
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let qkv = Array::from_slice(&values, &shape)
                    .unwrap()
                    .astype(dtype)
                    .unwrap();
                // Reference: float32 ops on the same (rounded) inputs, rounded once at the end.
                let wide = qkv
                    .astype(Dtype::Float32)
                    .unwrap()
                    .transpose(&[0, 2, 1, 3])
                    .unwrap();
                let parts = wide.split_at(&[nq, nq + nk], 1).unwrap();
                let expected = crate::ops::concatenate(
                    &[
                        parts[0].rope(&spec, offset).unwrap(),
                        parts[1].rope(&spec, offset).unwrap(),
                        parts[2].clone(),
                    ],
                    1,
                )
                .unwrap()
                .astype(dtype)
                .unwrap()
                .astype(Dtype::Float32)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
                let got = emulated(&[&qkv], &[b, heads, l, d], dtype, |bf16, inputs, out| {
                    // SAFETY: the [b, l, heads, d] input's bytes, room for the [b, heads, l, d]
                    // output, both of `dtype`; `inv_freq` has rot_half entries.
                    unsafe {
                        mlxcel_emulate_heads_rope(
                            bf16,
                            inputs[0],
                            inv_freq.as_ptr(),
                            out,
                            b,
                            l,
                            heads,
                            d,
                            nq + nk,
                            rot_half,
                            i32::from(traditional),
                            offset,
                        )
                    }
                });
                let got = float_values(&got);
                // A bf16 unit in the last place below 4 is 2^-6; float32's, 2^-21.
                let tolerance = match dtype {
                    Dtype::Bfloat16 => 2f32.powi(-6),
                    _ => 2f32.powi(-20),
                };
                let worst = got
                    .iter()
                    .zip(&expected)
                    .map(|(g, e)| (g - e).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    worst <= tolerance,
                    "{} case {:?}: max |kernel - MLX| {worst:e} > {tolerance:e}",
                    dtype.name(),
                    (b, l, nq, nk, d, dims, traditional, offset)
                );
            }
        }
    }

    /// rows.cu's `route_topk`, run on the CPU, against a float64 reference of a router written
    /// out here: softmax or sigmoid scores, an optional correction bias for the choice, the
    /// top k in descending order with ties to the lower expert (rows with exact ties included),
    /// weights normalized or not and scaled. Ids must be the reference's exactly, weights
    /// within float32 rounding (bf16: one unit in the last place).
    #[test]
    fn route_topk_kernel_matches_a_reference_router_on_the_cpu() {
        let (rows, experts, k) = (9usize, 64usize, 8usize);
        let mut logits: Vec<f32> = float_values(&uniform_array(
            &[rows as i32, experts as i32],
            4.0,
            Dtype::Float32,
            3,
        ));
        // Row 0: ten experts tied at the top, eight of which make the cut.
        for e in [5, 9, 17, 40, 63, 2, 30, 50, 11, 44] {
            logits[e] = 3.5;
        }
        let bias: Vec<f32> = (0..experts).map(|e| (e % 7) as f32 * 0.01).collect();
        for (sigmoid, with_bias, normalize, scale) in [
            (false, false, true, 1.0f32),
            (false, false, false, 2.5),
            (true, true, true, 1.0),
            (true, false, false, 1.0),
        ] {
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let mut ids = vec![0u32; rows * k];
                let mut weights = vec![0u8; rows * k * dtype.size_of()];
                // SAFETY: logits [rows, experts], bias [experts], ids and weights [rows, k].
                unsafe {
                    mlxcel_emulate_route_topk(
                        i32::from(dtype == Dtype::Bfloat16),
                        logits.as_ptr(),
                        bias.as_ptr(),
                        ids.as_mut_ptr(),
                        weights.as_mut_ptr().cast(),
                        rows as i32,
                        experts as i32,
                        k as i32,
                        i32::from(sigmoid),
                        i32::from(with_bias),
                        i32::from(normalize),
                        scale,
                    );
                }
                let weights = float_values(
                    &Array::from_bytes(&weights, &[(rows * k) as i32], dtype).unwrap(),
                );
                let case = format!(
                    "sigmoid {sigmoid} bias {with_bias} normalize {normalize} scale {scale} {}",
                    dtype.name()
                );
                for r in 0..rows {
                    let x = &logits[r * experts..(r + 1) * experts];
                    let top = x.iter().fold(f64::MIN, |m, &v| m.max(v as f64));
                    let total: f64 = x.iter().map(|&v| (v as f64 - top).exp()).sum();
                    let score = |e: usize| {
                        if sigmoid {
                            1.0 / (1.0 + (-(x[e] as f64)).exp())
                        } else {
                            (x[e] as f64 - top).exp() / total
                        }
                    };
                    let choice = |e: usize| score(e) + if with_bias { bias[e] as f64 } else { 0.0 };
                    let mut order: Vec<usize> = (0..experts).collect();
                    // Stable: equal choices keep the lower expert first.
                    order.sort_by(|&a, &b| choice(b).total_cmp(&choice(a)));
                    let want: Vec<u32> = order[..k].iter().map(|&e| e as u32).collect();
                    assert_eq!(&ids[r * k..(r + 1) * k], want.as_slice(), "{case} row {r}");
                    let sum: f64 = order[..k].iter().map(|&e| score(e)).sum();
                    for (j, &e) in order[..k].iter().enumerate() {
                        let mut w = score(e);
                        if normalize {
                            w /= if sigmoid { sum + 1e-20 } else { sum };
                        }
                        let w = w * scale as f64;
                        let got = weights[r * k + j] as f64;
                        let allowed = if dtype == Dtype::Bfloat16 {
                            2f64.powi(-8)
                        } else {
                            1e-6
                        };
                        assert!(
                            (got - w).abs() <= allowed * w.abs().max(1e-3),
                            "{case} row {r} weight {j}: kernel {got}, reference {w}"
                        );
                    }
                }
            }
        }
    }

    /// rows.cu's `heads_norm_rope` (Qwen3's per-head q/k RMSNorms, then rope), run on the CPU,
    /// against MLX's own ops: the transpose into heads, `rms_norm` with each weight, `fast::rope`
    /// at `offset` in float32 (as its GPU kernel ropes), the values as they are. Both round the
    /// norm's product with 1/rms and then with the weight to the dtype before the rope: bf16
    /// outputs bit-equal, float32 within a few units in the last place (the reciprocal square
    /// roots differ there).
    #[test]
    fn heads_norm_rope_kernel_matches_mlx_on_the_cpu() {
        use crate::ops::Rope;
        for (b, l, nq, nk, d, dims, traditional, offset) in [
            (1, 7, 4, 2, 32, 32, false, 0),
            (2, 5, 6, 2, 64, 48, false, 1000),
            (1, 9, 2, 1, 16, 16, true, 3),
        ] {
            let heads = nq + 2 * nk;
            let rot_half = dims / 2;
            let periods: Vec<f32> = (0..rot_half)
                .map(|j| 10_000f32.powf(2.0 * j as f32 / dims as f32))
                .collect();
            let periods_array = Array::from_slice(&periods, &[rot_half]).unwrap();
            let inv_freq: Vec<f32> = periods.iter().map(|p| 1.0 / p).collect();
            let spec = Rope {
                dims,
                traditional,
                base: 10_000.0,
                scale: 1.0,
                freqs: Some(&periods_array),
            };
            let eps = 1e-6f32;
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let qkv = uniform_array(&[b, l, heads, d], 3.0, dtype, (l * d) as u64);
                let q_norm = uniform_array(&[d], 0.5, dtype, 7).add_scalar(1.0).unwrap();
                let k_norm = uniform_array(&[d], 0.5, dtype, 8).add_scalar(1.0).unwrap();
                let parts = qkv
                    .transpose(&[0, 2, 1, 3])
                    .unwrap()
                    .split_at(&[nq, nq + nk], 1)
                    .unwrap();
                // MLX's norm in the dtype, then its rope in float32 rounded once (as its GPU
                // kernel ropes; the CPU's rope rounds the angles' cos and sin to the dtype).
                let normed_rope = |x: &Array, w: &Array| {
                    x.rms_norm(Some(w), eps)
                        .unwrap()
                        .astype(Dtype::Float32)
                        .unwrap()
                        .rope(&spec, offset)
                        .unwrap()
                        .astype(dtype)
                        .unwrap()
                };
                let want = float_values(
                    &crate::ops::concatenate(
                        &[
                            normed_rope(&parts[0], &q_norm),
                            normed_rope(&parts[1], &k_norm),
                            parts[2].clone(),
                        ],
                        1,
                    )
                    .unwrap(),
                );
                let got = emulated(
                    &[&qkv, &q_norm, &k_norm],
                    &[b, heads, l, d],
                    dtype,
                    |bf16, inputs, out| {
                        // SAFETY: the [b, l, heads, d] input and the two [d] weights' bytes,
                        // room for the [b, heads, l, d] output, all of `dtype`; `inv_freq` has
                        // rot_half entries.
                        unsafe {
                            mlxcel_emulate_heads_norm_rope(
                                bf16,
                                inputs[0],
                                inputs[1],
                                inputs[2],
                                inv_freq.as_ptr(),
                                out,
                                b,
                                l,
                                heads,
                                d,
                                nq,
                                nq + nk,
                                rot_half,
                                i32::from(traditional),
                                offset,
                                eps,
                            )
                        }
                    },
                );
                let got = float_values(&got);
                let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                let case = (b, l, nq, nk, d, dims, traditional, offset);
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs())
                    .fold(0f32, f32::max);
                if dtype == Dtype::Bfloat16 {
                    // The same roundings: bit-equal (77-81% with the norm's first rounding
                    // left out of the kernel).
                    assert_eq!(got, want, "bf16 {case:?}");
                } else {
                    assert!(
                        worst <= scale * 2f32.powi(-20),
                        "float32 {case:?}: max |kernel - MLX| {worst:e} of {scale}"
                    );
                }
            }
        }
    }

    /// rows.cu's public launchers refuse operands their kernels would read past (before
    /// anything is launched): an error naming the kernel and what is wrong, never a launch.
    #[test]
    fn rows_kernels_refuse_operands_they_would_read_past() {
        let f32s = |shape: &[i32]| uniform_array(shape, 1.0, Dtype::Float32, 9);
        let ids = |shape: &[i32]| {
            let n: i32 = shape.iter().product();
            Array::from_slice(&(0..n as u32).collect::<Vec<_>>(), shape).unwrap()
        };
        let err = |r: Result<Array>| r.expect_err("refused").to_string();
        assert!(err(super::silu_mul(&f32s(&[4, 8]), &f32s(&[4, 7]))).contains("silu_mul"));
        assert!(
            err(super::take_along_rows(&f32s(&[4, 8]), &ids(&[3, 2]))).contains("take_along_rows")
        );
        let int_ids = ids(&[4, 2]).astype(Dtype::Int32).unwrap();
        assert!(err(super::take_along_rows(&f32s(&[4, 8]), &int_ids)).contains("uint32"));
        let spec = |top_k| RouteSpec {
            top_k,
            sigmoid: false,
            normalize: true,
            scale: 1.0,
        };
        let logits = f32s(&[3, 12]);
        for k in [0, 13, 17] {
            let e = super::route_topk(&logits, None, spec(k), Dtype::Float32).unwrap_err();
            assert!(e.to_string().contains("route_topk"), "{e}");
        }
        let short_bias = f32s(&[11]);
        let e = super::route_topk(&logits, Some(&short_bias), spec(2), Dtype::Float32).unwrap_err();
        assert!(e.to_string().contains("bias"), "{e}");
        let qkv = f32s(&[1, 3, 6, 8]);
        let inv = f32s(&[4]);
        let rope = |query_heads, kv_heads, inv_freq, norms| HeadsRope {
            inv_freq,
            traditional: false,
            query_heads,
            kv_heads,
            norms,
        };
        let long_inv = f32s(&[5]);
        let short_norm = f32s(&[7]);
        for (what, spec) in [
            ("heads", rope(4, 3, &inv, None)),
            ("inv_freq", rope(4, 1, &long_inv, None)),
            (
                "norm",
                rope(4, 1, &inv, Some((&short_norm, &short_norm, 1e-6))),
            ),
        ] {
            let e = super::heads_rope(&qkv, &spec, 0).unwrap_err().to_string();
            assert!(e.contains("heads_rope"), "{what}: {e}");
        }
        assert!(super::heads_rope(&f32s(&[3, 6, 8]), &rope(4, 1, &inv, None), 0).is_err());
    }
}
