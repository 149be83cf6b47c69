//! The runtime switches (`MLXCEL_*` environment variables), parsed once and strictly into a
//! [`RuntimePolicy`].
//!
//! [`RuntimePolicy::from_env`] is the only place that reads them: a value that is not one of
//! the documented forms is an [`Error::Policy`] naming the variable, the value and what is
//! expected (an empty value counts as unset). [`RuntimePolicy::from_vars`] parses from any
//! lookup (tests, configuration files).
//!
//! Layers and kernels deep below the model code read the values of one process-wide installed
//! policy ([`install`], [`current`]); the loading pipeline installs the policy of its
//! `LoadOptions` before building a model. Until something is installed, [`current`] is
//! [`RuntimePolicy::default`] (the environment is not consulted).

use std::sync::RwLock;

use crate::{Error, Materialization, Result};

/// When routed experts stream from disk (`MLXCEL_EXPERT_STREAM`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamMode {
    /// Stream when a prepared layout exists and the routed experts exceed half of the memory
    /// available.
    Auto,
    /// Always stream (the prepared layout must exist).
    On,
    /// Never stream: every expert is loaded into memory.
    Off,
}

/// Which resident expert gives up its slot on a miss (`MLXCEL_EXPERT_CACHE_POLICY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachePolicy {
    /// Least recently used.
    Lru,
    /// Least frequently used over the run; recency breaks ties.
    Lfu,
}

impl CachePolicy {
    /// `lru` or `lfu` (any case).
    pub fn from_name(name: &str) -> Option<CachePolicy> {
        match name.trim().to_ascii_lowercase().as_str() {
            "lru" => Some(CachePolicy::Lru),
            "lfu" => Some(CachePolicy::Lfu),
            _ => None,
        }
    }
}

/// How streamed experts are read from disk (`MLXCEL_EXPERT_IO`).
///
/// The page cache is what makes a streamed model "fit": with `cached` reads, a model larger
/// than memory pushes everything else out of the cache, and a benchmark on a warm cache measures
/// memory copies, not the disk. So reads bypass it by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertIo {
    /// `O_DIRECT` reads into aligned bounce buffers (the default); a file system that refuses
    /// direct I/O falls back to [`ExpertIo::Dontneed`] (logged once).
    Direct,
    /// Ordinary `pread`s, then `posix_fadvise(POSIX_FADV_DONTNEED)` over the range read, so the
    /// pages leave the cache right after the copy into the slot.
    Dontneed,
    /// Ordinary `pread`s through the page cache (what streaming did before `MLXCEL_EXPERT_IO`).
    Cached,
}

impl ExpertIo {
    /// The word `MLXCEL_EXPERT_IO` takes.
    pub fn name(self) -> &'static str {
        match self {
            ExpertIo::Direct => "direct",
            ExpertIo::Dontneed => "dontneed",
            ExpertIo::Cached => "cached",
        }
    }

    /// `direct`, `dontneed` or `cached` (any case).
    pub fn from_name(name: &str) -> Option<ExpertIo> {
        match name.trim().to_ascii_lowercase().as_str() {
            "direct" => Some(ExpertIo::Direct),
            "dontneed" => Some(ExpertIo::Dontneed),
            "cached" => Some(ExpertIo::Cached),
            _ => None,
        }
    }
}

/// How rows of an external per-layer-embedding table are read (`MLXCEL_PLE_IO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PleIo {
    /// Map the row files and copy rows out of the mapping (the default).
    Mmap,
    /// `O_DIRECT` reads into aligned buffers, bypassing the page cache; a truncated file is an
    /// error, never a fault.
    Direct,
    /// Read the whole table into memory at load.
    Ram,
}

impl PleIo {
    /// The word `MLXCEL_PLE_IO` takes.
    pub fn name(self) -> &'static str {
        match self {
            PleIo::Mmap => "mmap",
            PleIo::Direct => "direct",
            PleIo::Ram => "ram",
        }
    }
}

/// The default row cache of external per-layer embeddings (`MLXCEL_PLE_CACHE_BYTES`): 0.5 GiB.
pub const DEFAULT_PLE_CACHE_BYTES: u64 = 512 << 20;

/// How mlxcel's CUDA kernels are launched (`MLXCEL_CUDA_LAUNCH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLaunch {
    /// mlxcel's own graph-node primitive (cpp/cuda_launch.cc), when MLX's entry points exist.
    Mlxcel,
    /// MLX's `fast::precompiled_cuda_kernel`.
    Mlx,
}

/// A decode-step GEMV's launch shape and the blocks of it an SM must be able to hold at once
/// (`__launch_bounds__`' second argument, which caps the registers a thread may take; 0: no
/// cap): `NWxRPW` or `NWxRPW:B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeGemv {
    /// Warps and rows per block.
    pub shape: LaunchShape,
    /// Resident blocks per SM the compiler must allow for (0: its own choice).
    pub min_blocks: i32,
}

impl DecodeGemv {
    /// `NWxRPW` or `NWxRPW:B` with 1 to 32 rows and B blocks of NW warps fitting an SM (at
    /// most 32 blocks and 64 warps on sm_80/sm_90).
    pub fn parse(value: &str) -> Option<DecodeGemv> {
        let (shape, blocks) = match value.split_once(':') {
            Some((shape, blocks)) => (shape, blocks.trim().parse().ok()?),
            None => (value, 0),
        };
        let shape = LaunchShape::parse(shape).filter(|s| s.rows <= 32)?;
        (0..=(64 / shape.warps).min(32))
            .contains(&blocks)
            .then_some(DecodeGemv {
                shape,
                min_blocks: blocks,
            })
    }
}

/// A CUDA GEMV launch shape: warps per block and rows per block (`NWxRPW`, e.g. `4x4`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaunchShape {
    /// Warps per thread block (1-32).
    pub warps: i32,
    /// Output rows each block computes.
    pub rows: i32,
}

impl LaunchShape {
    /// A shape the GEMV kernel supports: 1-32 warps, 1 to 32 rows per warp in total.
    pub const fn new(warps: i32, rows: i32) -> Option<LaunchShape> {
        if warps >= 1 && warps <= 32 && rows >= 1 && rows <= warps * 32 {
            Some(LaunchShape { warps, rows })
        } else {
            None
        }
    }

    /// `NWxRPW`, e.g. `4x8`.
    pub fn parse(value: &str) -> Option<LaunchShape> {
        let (nw, rpw) = value.trim().split_once(['x', 'X'])?;
        LaunchShape::new(nw.parse().ok()?, rpw.parse().ok()?)
    }

    /// `(warps, rows)`.
    pub const fn pair(self) -> (i32, i32) {
        (self.warps, self.rows)
    }
}

/// One typed field per runtime switch; see the README's table for what each does.
/// `Option` fields left `None` take a default that depends on MLX's device when used.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimePolicy {
    /// `MLXCEL_WEIGHT_MATERIALIZATION`: `eager` (default) or `lazy`.
    pub weight_materialization: Materialization,
    /// `MLXCEL_EXPERT_STREAM`: `auto` (default), `1`/`on`, `0`/`off`.
    pub expert_stream: StreamMode,
    /// `MLXCEL_EXPERT_ARENA_BYTES`: total bytes of the expert slot arenas; `None`: half of the
    /// available memory.
    pub expert_arena_bytes: Option<u64>,
    /// `MLXCEL_EXPERT_CACHE_POLICY`: `lfu` (default) or `lru`.
    pub expert_cache_policy: CachePolicy,
    /// `MLXCEL_EXPERT_READ_THREADS`: parallel reads of missing experts (default 4, at least 1).
    pub expert_read_threads: usize,
    /// `MLXCEL_EXPERT_VERIFY`: check each expert read from disk against its hash in the
    /// manifest (default on; `0` only to measure what the check costs).
    pub expert_verify: bool,
    /// `MLXCEL_EXPERT_IO`: `direct` (default), `dontneed` or `cached`.
    pub expert_io: ExpertIo,
    /// `MLXCEL_EXPERT_PREFETCH`: during decode, each streamed MoE layer predicts the next
    /// streamed layer's experts (that layer's router on this layer's input) and starts reading
    /// the missing ones (default on; `0` to measure what it gains).
    pub expert_prefetch: bool,
    /// `MLXCEL_EXPERT_IN_PLACE`: experts read from disk are copied straight into their arena
    /// slots (a `memcpy` on the CPU, a driver copy on CUDA) where the arena's buffer is its own
    /// (default on; `0` writes every slot through MLX's `slice_update`, to measure the gain).
    pub expert_in_place: bool,
    /// `MLXCEL_PLE_IO`: `mmap` (default), `direct` or `ram`.
    pub ple_io: PleIo,
    /// `MLXCEL_PLE_CACHE_BYTES`: bytes of the LRU row cache of an external per-layer-embedding
    /// table (default [`DEFAULT_PLE_CACHE_BYTES`]; 0 = no cache).
    pub ple_cache_bytes: u64,
    /// `MLXCEL_DEQUANT_ROWS`: from this many activation rows quantized layers run as
    /// dequantize + dense GEMM (0 = never; setting it also covers routed experts). `None`:
    /// 256 on a GPU, never on the CPU.
    pub dequant_rows: Option<usize>,
    /// `MLXCEL_PREFILL_DENSE_BYTES`: bytes of device memory the dequantized copies of quantized
    /// layers may keep between prompts, so that later prefills skip the dequantization (0 =
    /// none kept). `None`: a quarter of a CUDA GPU's memory while MLX's active memory stays
    /// under half of it, none elsewhere.
    pub prefill_dense_bytes: Option<u64>,
    /// `MLXCEL_PREFILL_FOLD_RESIDUAL`: a prompt's dequantized projections that end in a residual
    /// add (attention's output, the MLP's down projection) run as one GEMM that adds it (MLX's
    /// `addmm`: on a GPU, cuBLAS's epilogue) instead of a GEMM and an add; the sum is rounded
    /// once instead of twice (default off until measured on a GPU).
    pub prefill_fold_residual: bool,
    /// `MLXCEL_WARM_UP`: one throwaway decode step at load. `None`: on for a GPU.
    pub warm_up: Option<bool>,
    /// `MLXCEL_CPU_KERNELS`: mlxcel's CPU linear kernel instead of MLX's (default on).
    pub cpu_kernels: bool,
    /// `MLXCEL_CPU_DECODE`: single-token decode steps of dense attention-only decoders run on
    /// mlxcel's CPU decode engine (one call per token) instead of an MLX graph (only with
    /// `cpu_kernels`, on the CPU) when a generation decodes alone (a decode batch of several
    /// conversations stays an MLX graph). Default on (2.3x the graph's decode speed on SmolLM2,
    /// same greedy ids: docs/performance.md); `0` for the graph.
    pub cpu_decode: bool,
    /// `MLXCEL_CPU_ACTIVATIONS`: `f32` (default) or `q8`. With `q8`, one-row products of
    /// 4- and 8-bit affine weights on mlxcel's CPU kernel (decode steps) quantize the activation
    /// to int8 per block of 32, as llama.cpp does, and run as integer dot products (AVX-512
    /// VNNI; CPUs without it keep float32). Faster, not bit-faithful to MLX: logits move by the
    /// activation's rounding (docs/performance.md).
    pub cpu_int8_activations: bool,
    /// `MLXCEL_CPU_THREADS`: threads of mlxcel's CPU kernel (1-64). `None`: all cores, at
    /// most 16. Takes effect when the kernel's thread pool starts (its first use).
    pub cpu_threads: Option<usize>,
    /// `MLXCEL_ZERO_COPY`: arrays borrow the mapped checkpoint on the CPU (default on).
    pub zero_copy: bool,
    /// `MLXCEL_CUDA_QMV`: the launch shape of mlxcel's CUDA decode GEMV (default 4x4); `None`
    /// (`0`): MLX's quantized GEMV.
    pub cuda_qmv: Option<LaunchShape>,
    /// `MLXCEL_CUDA_QMV_FOLD`: fold RMSNorm, gate and residual add into the GEMV (default on).
    pub cuda_qmv_fold: bool,
    /// `MLXCEL_CUDA_QMV_FOLD_SHAPE`: the launch shape of folding GEMVs. `None`: 4x8 after an
    /// RMSNorm, 16x16 after a gate.
    pub cuda_qmv_fold_shape: Option<LaunchShape>,
    /// `MLXCEL_CUDA_QMV_ROWS`: at most this many activation rows of a decode batch share one
    /// GEMV block's weight reads (1, 2, 4 or 8). Default 1: every row has its own blocks.
    pub cuda_qmv_rows: i32,
    /// `MLXCEL_CUDA_QMV_MMA`: GEMVs over 2 to 16 activation rows (decode batches) of 4-bit
    /// weights with bf16/f16 activations run on the tensor-core kernel (`qmv_mma.cu`: each
    /// weight read once for all rows, the products on mma.sync) instead of one-row blocks per
    /// row; such a batch then runs its pre-norms and gating as separate ops (the kernel has no
    /// folded forms). Default on (8 concurrent streams on an H200: 3.3x one stream, against
    /// 1.4x with one-row blocks); `0` turns it off.
    pub cuda_qmv_mma: bool,
    /// `MLXCEL_CUDA_GATHER`: routed-expert products over (token, expert) rows sorted by expert
    /// (MoE prefill) of affine 4-bit experts with bf16/f16 activations run on mlxcel's
    /// tensor-core kernel (`qmm_gather` of `qmv_mma.cu`: each block reads an expert's weights
    /// once for its rows of that expert), instead of dequantizing the whole stack for MLX's
    /// gathered matmul. On by default: on an H100 it prefills the Qwen3-30B-A3B 4-bit shape at
    /// 8,400 tok/s against 1,300 on MLX's gathered quantized matmul (session 25,
    /// docs/performance.md); `cuda_kernels --gather` and the `cuda_decode` test check it on a
    /// GPU. `0` turns it off.
    pub cuda_gather: bool,
    /// `MLXCEL_CUDA_LOAD`: on MLX's CUDA backend, checkpoint tensors are read from their files
    /// (no mapping) into pinned host buffers reused for the process and copied from them into
    /// device memory by the CUDA driver, several readers overlapping reads and copies
    /// (`cpp/cuda_load.cc`), instead of being copied from the mapped file into fresh unified
    /// memory, whose pages the device then faults over on first use. On by default: on an
    /// H100 the Llama-3.1-8B 4-bit shape loads in 0.54-0.60 s against 2.2 s that way and
    /// mlx-lm's 1.03-1.14 s, Qwen3-30B-A3B 4-bit in 0.94-1.10 s against 4.4-6.1 s and 6.9-7.7
    /// s, with bit-equal logits (session 25, docs/performance.md). `0` turns it off.
    pub cuda_load: bool,
    /// `MLXCEL_CUDA_LOAD_READERS`: how many threads read a tensor into device memory
    /// (`cuda_load`), 1 to 32; default 8 (4 to 16 measured alike on an H100 host). Each
    /// holds 4 MiB of pinned staging memory.
    pub cuda_load_readers: usize,
    /// `MLXCEL_CUDA_LOAD_POOL`: the readers of `cuda_load` are threads kept for the process
    /// instead of started per tensor, and a tensor under `cuda_load_readers` × 2 MiB is cut into
    /// that many pieces (of at least 256 KiB), so scales and biases are read in parallel too.
    /// On by default: the Llama-3.1-8B 4-bit shape loads in 0.67-0.85 s against 0.77-0.88 s
    /// with a thread per reader and tensor, in the same passes on an H100, bit-equal (session
    /// 29, docs/performance.md); `0` turns it off.
    pub cuda_load_pool: bool,
    /// `MLXCEL_CUDA_DECODE`: single-token decode steps of the decoders mlxcel's CPU decode
    /// engine covers, with affine 4/8-bit or dense weights and bf16/f16 activations, run on the
    /// GPU as one mlxcel primitive that adds the whole step's kernels (5 per layer, `decode.cu`)
    /// to MLX's CUDA graph, instead of an MLX graph of ~14 arrays per layer (decode on a GPU is
    /// bound by MLX's host time per array). Default on: its logits are as close to a float32
    /// reference as the graph's (tests/tests/cuda_decode.rs; docs/performance.md, session 21);
    /// `0` turns it off.
    pub cuda_decode: bool,
    /// `MLXCEL_CUDA_DECODE_TC`: the CUDA decode step's GEMVs of affine 4-bit weights in groups of
    /// 64 or 128 (K up to 16384) run on tensor cores (`qmv_tc.cu`: under one instruction of
    /// unpacking per weight, the multiply-adds on mma.sync) with this launch shape `NWxRPW`
    /// (1 to 16 warps, 16 or 32 rows per block; `1`: 8x16). Off by default (`0`): on an H100 it
    /// decodes the Llama-3.1-8B 4-bit shape at 199-254 tok/s by shape against 295 on the float
    /// GEMV (`qmv.cu`), which stays the path of groups of 32 and 8-bit weights always
    /// (docs/performance.md, session 26).
    pub cuda_decode_tc: Option<LaunchShape>,
    /// `MLXCEL_CUDA_DECODE_GEMV`: the launch shapes `NWxRPW[:B],NWxRPW[:B],NWxRPW[:B]` of the
    /// CUDA decode step's float GEMVs (qmv.cu): RMSNorm in (q|k|v, the head), residual out (o,
    /// down), and gate|up (RPW rows of the two matrices, RPW/2 outputs: even). 1-32 warps and
    /// 1-32 rows each; B: blocks per SM the registers must allow ([`DecodeGemv`]). `None`
    /// (unset): [`default_decode_gemv`] for the model's hidden size.
    pub cuda_decode_gemv: Option<[DecodeGemv; 3]>,
    /// `MLXCEL_CUDA_DECODE_OVERLAP`: the CUDA decode step's kernels join a graph of their own
    /// by programmatic edges (Hopper's programmatic dependent launch), so that each launches
    /// and issues its first weight loads while the one before it finishes; kept off where the
    /// driver cannot build such a graph. `0` chains them as plain graph nodes.
    pub cuda_decode_overlap: bool,
    /// `MLXCEL_CUDA_DECODE_MOE_LANES`: lanes per (expert, row) dot product of the CUDA decode
    /// step's routed-expert GEMVs (decode_moe.cu): 8 (default), 16 or 32. More lanes split K
    /// finer: fewer dependent loads per lane, more shuffles, more warps.
    pub cuda_decode_moe_lanes: i32,
    /// `MLXCEL_CUDA_DECODE_MOE_STAGE`: chunks of 16 bytes per lane that the routed-expert GEMVs
    /// (decode_moe.cu) copy into shared memory with cp.async before using any (2, 4 or 8; a
    /// Qwen3-30B-A3B 4-bit expert row is 8 chunks a lane for gate|up, 3 for down), or `0`
    /// (default) for two chunks at a time in registers.
    pub cuda_decode_moe_stage: i32,
    /// `MLXCEL_CUDA_DECODE_ATTN_THREADS`: threads per block of the CUDA decode step's attention
    /// (decode.cu's `dec_attention`): 128 or 256 (default). More warps split its latency-bound
    /// phases finer (the queries' rope, softmax and merge); each block then runs two warps per
    /// scheduler instead of one.
    pub cuda_decode_attn_threads: i32,
    /// `MLXCEL_CUDA_DECODE_FUSED_ROUTE`: the CUDA decode step routes each token in the last
    /// block of the router's GEMV (one kernel boundary fewer per routed-expert layer) instead
    /// of in a one-block kernel after it. Off by default: on an H100 both measured the same
    /// (Qwen3-30B-A3B 4-bit: 314-315 against 313-316 tok/s; docs/performance.md, session 32).
    pub cuda_decode_fused_route: bool,
    /// `MLXCEL_CUDA_DECODE_ATTN_BLOCKS`: how many blocks the CUDA decode step's split-K
    /// attention aims at per step (all key/value heads together): the cached rows are cut into
    /// chunks of `len * kv_heads / blocks` keys (16 to 128); fewer means longer chunks and
    /// fewer partials to merge. `None` (unset): [`default_decode_attn_blocks`] of the model.
    pub cuda_decode_attn_blocks: Option<i32>,
    /// `MLXCEL_CUDA_LAUNCH`: `mlxcel` (default) or `mlx`.
    pub cuda_launch: CudaLaunch,
    /// `MLXCEL_BATCH_PIPELINE`: an all-greedy decode batch queues its next step before reading
    /// the current one's tokens (default on; 0 reads every step's tokens first).
    pub batch_pipeline: bool,
    /// `MLXCEL_CUDA_DEQUANT`: mlxcel's CUDA dequantize kernel for GPU prefill (default on).
    pub cuda_dequant: bool,
    /// `MLXCEL_CUDA_ROWS`: mlxcel's CUDA kernels for embedding lookups, a MoE prompt's row
    /// gathers and router scores, and the prompt's `silu(gate) * up` instead of MLX's, which MLX
    /// JIT-compiles on a machine's first request (default on).
    pub cuda_rows: bool,
    /// `MLXCEL_CUDA_PREFILL_ROPE`: a prompt's queries, keys and values put into the head layout
    /// with rope applied by one mlxcel CUDA kernel per attention layer
    /// ([`crate::cuda_kernels::heads_rope`]) instead of MLX's rope on each operand (default off
    /// until measured on a GPU).
    pub cuda_prefill_rope: bool,
    /// `MLXCEL_CUDA_ROUTER`: a MoE router's softmax or sigmoid, top-k choice and weights as one
    /// mlxcel CUDA kernel ([`crate::cuda_kernels::route_topk`]) where the MLX graph sorts
    /// every token's scores (default off until measured on a GPU).
    pub cuda_router: bool,
    /// `MLXCEL_FUSE_PROJECTIONS`: fuse q/k/v and gate/up projections at load. `None`: on for a
    /// GPU, off on the CPU.
    pub fuse_projections: Option<bool>,
    /// `MLXCEL_SURGERY`: a weight-surgery YAML file applied at load when the caller gives none
    /// (`mlxcel_loading::LoadOptions::surgery`); it must exist.
    pub surgery: Option<std::path::PathBuf>,
    /// `MLXCEL_EMBED_PAD_TO`: embedding and reranker batches pad their width up to a multiple
    /// of this (1-256), so a run of mixed lengths meets few distinct shapes (each new shape costs
    /// the GPU backend first-use work). `None`: 1 on the CPU, 32 on a GPU.
    pub embed_pad_to: Option<usize>,
    /// `MLXCEL_CUDA_SCAN`: where Mamba's selective scan runs on mlxcel's CUDA kernel instead of
    /// MLX graphs on a GPU: `1` prefill and decode (default), `decode` one-position steps only,
    /// `0` never.
    pub cuda_scan: CudaScan,
}

/// Where the CUDA selective-scan kernel runs (`MLXCEL_CUDA_SCAN`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaScan {
    /// Never: MLX graphs (chunked SSD, Hillis-Steele blocks, the one-step recurrence).
    Off,
    /// Decode steps (one position) only; prefill runs the MLX graphs.
    Decode,
    /// Prefill and decode.
    All,
}

/// The GEMV's launch shape unless `MLXCEL_CUDA_QMV` picks another.
pub const DEFAULT_QMV_SHAPE: LaunchShape = LaunchShape { warps: 4, rows: 4 };

/// The decode step's float GEMV shapes unless `MLXCEL_CUDA_DECODE_GEMV` picks others: RMSNorm
/// in, residual out, gate|up.
pub const DEFAULT_DECODE_GEMV_SHAPES: [DecodeGemv; 3] = [
    DecodeGemv {
        shape: LaunchShape { warps: 4, rows: 8 },
        min_blocks: 0,
    },
    // 8 blocks an SM (registers capped at 64): 375-379 against 362-365 tok/s uncapped on the
    // Llama-3.1-8B 4-bit shape (H100, session 30); 12 and 16 cost 17% and 33%.
    DecodeGemv {
        shape: DEFAULT_QMV_SHAPE,
        min_blocks: 8,
    },
    DecodeGemv {
        shape: LaunchShape { warps: 4, rows: 8 },
        min_blocks: 0,
    },
];
/// The decode step's float GEMV shapes for a model of `hidden` unless `MLXCEL_CUDA_DECODE_GEMV`
/// picks others: [`DEFAULT_DECODE_GEMV_SHAPES`], with 2 warps instead of 4 for the RMSNorm-in
/// GEMVs (q|k|v, a router, the head: K = hidden) from a hidden size of 2048 down. Their
/// threads stride K in 32-value chunks of 4-bit weights, and K = 2048 has 64 of them: half of
/// 4 warps would idle. Measured on an H100 (docs/performance.md, session 33): the
/// Qwen3-30B-A3B 4-bit shape (hidden 2048) decodes at 339.0-342.3 tok/s with 2x8 against
/// 332.1-334.3 with 4x8 (2x16 was 5% slower).
pub fn default_decode_gemv(hidden: i32) -> [DecodeGemv; 3] {
    let mut shapes = DEFAULT_DECODE_GEMV_SHAPES;
    if hidden <= 2048 {
        shapes[0].shape = LaunchShape { warps: 2, rows: 8 };
    }
    shapes
}

/// Lanes per (expert, row) dot product of the decode step's routed-expert GEMVs unless
/// `MLXCEL_CUDA_DECODE_MOE_LANES` picks another.
pub const DEFAULT_DECODE_MOE_LANES: i32 = 8;
/// Chunks per lane the decode step's routed-expert GEMVs stage in shared memory unless
/// `MLXCEL_CUDA_DECODE_MOE_STAGE` picks another: none. Staging measured slower on an H100
/// (Qwen3-30B-A3B 4-bit shape: 308-312 tok/s at 8, 324-326 at 4, 329-333 in registers;
/// docs/performance.md, session 33).
pub const DEFAULT_DECODE_MOE_STAGE: i32 = 0;
/// Threads per attention block of the decode step unless `MLXCEL_CUDA_DECODE_ATTN_THREADS`
/// picks 128. Measured on an H100 (session 34, one process each, request 1 / request 2):
/// Qwen3-30B-A3B 4-bit 360.3 / 366.4 tok/s against 340.3 / 342.3 with 128, Llama-8B 4-bit
/// 396.9 / 398.5 against 391.3 / 386.0; the kernel is latency-bound, and 8 warps give each
/// scheduler two to switch between.
pub const DEFAULT_DECODE_ATTN_THREADS: i32 = 256;
/// Attention blocks per decode step unless `MLXCEL_CUDA_DECODE_ATTN_BLOCKS` picks another, for
/// `group` query heads per key/value head: 264 (two per SM of an H100/H200), halved from 8
/// query heads per key/value head on, whose blocks each carry twice the queries of a
/// Llama-3.1-8B's. Measured on an H100 at 640 cached rows (docs/performance.md, session 32):
/// the 8B 4-bit shape (4 per group) decodes at 395-397 tok/s with 264 against 384-386 with 132;
/// Qwen3-30B-A3B 4-bit (8 per group) at 310.5-312.5 with 132 against 304.2-306.2 with 264.
pub fn default_decode_attn_blocks(group: i32) -> i32 {
    if group >= 8 {
        132
    } else {
        264
    }
}

/// The decode step's tensor-core GEMV shape unless `MLXCEL_CUDA_DECODE_TC` picks another.
pub const DEFAULT_DECODE_TC_SHAPE: LaunchShape = LaunchShape { warps: 8, rows: 16 };

impl RuntimePolicy {
    /// Today's defaults (every variable unset).
    pub const DEFAULT: RuntimePolicy = RuntimePolicy {
        weight_materialization: Materialization::Eager,
        expert_stream: StreamMode::Auto,
        expert_arena_bytes: None,
        expert_cache_policy: CachePolicy::Lfu,
        expert_read_threads: 4,
        expert_verify: true,
        expert_io: ExpertIo::Direct,
        expert_prefetch: true,
        expert_in_place: true,
        ple_io: PleIo::Mmap,
        ple_cache_bytes: DEFAULT_PLE_CACHE_BYTES,
        dequant_rows: None,
        prefill_dense_bytes: None,
        prefill_fold_residual: false,
        warm_up: None,
        cpu_kernels: true,
        cpu_decode: true,
        cpu_int8_activations: false,
        cpu_threads: None,
        zero_copy: true,
        cuda_qmv: Some(DEFAULT_QMV_SHAPE),
        cuda_qmv_fold: true,
        cuda_qmv_fold_shape: None,
        cuda_qmv_rows: 1,
        cuda_qmv_mma: true,
        cuda_gather: true,
        cuda_load: true,
        cuda_load_readers: 8,
        cuda_load_pool: true,
        cuda_decode: true,
        cuda_decode_tc: None,
        cuda_decode_gemv: None,
        cuda_decode_overlap: true,
        cuda_decode_moe_lanes: DEFAULT_DECODE_MOE_LANES,
        cuda_decode_moe_stage: DEFAULT_DECODE_MOE_STAGE,
        cuda_decode_attn_threads: DEFAULT_DECODE_ATTN_THREADS,
        cuda_decode_fused_route: false,
        cuda_decode_attn_blocks: None,
        batch_pipeline: true,
        cuda_launch: CudaLaunch::Mlxcel,
        cuda_dequant: true,
        cuda_rows: true,
        cuda_prefill_rope: false,
        cuda_router: false,
        fuse_projections: None,
        surgery: None,
        embed_pad_to: None,
        cuda_scan: CudaScan::All,
    };

    /// Every runtime variable this policy reads.
    pub const VARIABLES: [&'static str; 47] = [
        "MLXCEL_WEIGHT_MATERIALIZATION",
        "MLXCEL_EXPERT_STREAM",
        "MLXCEL_EXPERT_ARENA_BYTES",
        "MLXCEL_EXPERT_CACHE_POLICY",
        "MLXCEL_EXPERT_READ_THREADS",
        "MLXCEL_EXPERT_VERIFY",
        "MLXCEL_EXPERT_IO",
        "MLXCEL_EXPERT_PREFETCH",
        "MLXCEL_EXPERT_IN_PLACE",
        "MLXCEL_PLE_IO",
        "MLXCEL_PLE_CACHE_BYTES",
        "MLXCEL_DEQUANT_ROWS",
        "MLXCEL_PREFILL_DENSE_BYTES",
        "MLXCEL_PREFILL_FOLD_RESIDUAL",
        "MLXCEL_WARM_UP",
        "MLXCEL_CPU_KERNELS",
        "MLXCEL_CPU_DECODE",
        "MLXCEL_CPU_ACTIVATIONS",
        "MLXCEL_CPU_THREADS",
        "MLXCEL_ZERO_COPY",
        "MLXCEL_CUDA_QMV",
        "MLXCEL_CUDA_QMV_FOLD",
        "MLXCEL_CUDA_QMV_FOLD_SHAPE",
        "MLXCEL_CUDA_QMV_ROWS",
        "MLXCEL_CUDA_QMV_MMA",
        "MLXCEL_CUDA_DECODE_TC",
        "MLXCEL_CUDA_DECODE_GEMV",
        "MLXCEL_CUDA_DECODE_OVERLAP",
        "MLXCEL_CUDA_DECODE_MOE_LANES",
        "MLXCEL_CUDA_DECODE_MOE_STAGE",
        "MLXCEL_CUDA_DECODE_ATTN_THREADS",
        "MLXCEL_CUDA_DECODE_FUSED_ROUTE",
        "MLXCEL_CUDA_DECODE_ATTN_BLOCKS",
        "MLXCEL_CUDA_GATHER",
        "MLXCEL_CUDA_LOAD",
        "MLXCEL_CUDA_LOAD_READERS",
        "MLXCEL_CUDA_LOAD_POOL",
        "MLXCEL_BATCH_PIPELINE",
        "MLXCEL_CUDA_LAUNCH",
        "MLXCEL_CUDA_DEQUANT",
        "MLXCEL_CUDA_ROWS",
        "MLXCEL_CUDA_PREFILL_ROPE",
        "MLXCEL_CUDA_ROUTER",
        "MLXCEL_FUSE_PROJECTIONS",
        "MLXCEL_SURGERY",
        "MLXCEL_EMBED_PAD_TO",
        "MLXCEL_CUDA_SCAN",
    ];

    /// Parses the process environment (the only reader of these variables). A variable that is
    /// set but not valid Unicode is an error naming it too.
    pub fn from_env() -> Result<RuntimePolicy> {
        let mut bad = None;
        let policy = RuntimePolicy::from_vars(|name| match std::env::var(name) {
            Ok(v) => Some(v),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(v)) => {
                bad.get_or_insert_with(|| Error::Policy {
                    var: name.to_string(),
                    value: v.to_string_lossy().into_owned(),
                    expected: "valid UTF-8".to_string(),
                });
                None
            }
        });
        match bad {
            Some(e) => Err(e),
            None => policy,
        }
    }

    /// Parses the variables `lookup` returns (`None`: unset). An empty or blank value counts as
    /// unset; words are matched in any case.
    pub fn from_vars(mut lookup: impl FnMut(&str) -> Option<String>) -> Result<RuntimePolicy> {
        let mut p = RuntimePolicy::DEFAULT;
        let mut get = |var: &'static str| -> Option<Var> {
            lookup(var)
                .filter(|v| !v.trim().is_empty())
                .map(|raw| Var { name: var, raw })
        };
        if let Some(v) = get("MLXCEL_WEIGHT_MATERIALIZATION") {
            p.weight_materialization = match v.word().as_str() {
                "eager" => Materialization::Eager,
                "lazy" => Materialization::Lazy,
                _ => return Err(v.error("`eager` or `lazy`")),
            };
        }
        if let Some(v) = get("MLXCEL_EXPERT_STREAM") {
            p.expert_stream = match v.word().as_str() {
                "auto" => StreamMode::Auto,
                "1" | "on" => StreamMode::On,
                "0" | "off" => StreamMode::Off,
                _ => return Err(v.error("auto, 1 (on) or 0 (off)")),
            };
        }
        if let Some(v) = get("MLXCEL_EXPERT_ARENA_BYTES") {
            p.expert_arena_bytes = Some(v.number("a byte count")?);
        }
        if let Some(v) = get("MLXCEL_EXPERT_CACHE_POLICY") {
            p.expert_cache_policy =
                CachePolicy::from_name(&v.raw).ok_or_else(|| v.error("lfu or lru"))?;
        }
        if let Some(v) = get("MLXCEL_EXPERT_READ_THREADS") {
            p.expert_read_threads = v.in_range("a number of threads, at least 1", 1, usize::MAX)?;
        }
        if let Some(v) = get("MLXCEL_EXPERT_VERIFY") {
            p.expert_verify = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_EXPERT_PREFETCH") {
            p.expert_prefetch = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_EXPERT_IN_PLACE") {
            p.expert_in_place = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_EXPERT_IO") {
            p.expert_io =
                ExpertIo::from_name(&v.raw).ok_or_else(|| v.error("direct, dontneed or cached"))?;
        }
        if let Some(v) = get("MLXCEL_PLE_IO") {
            p.ple_io = match v.word().as_str() {
                "mmap" => PleIo::Mmap,
                "direct" => PleIo::Direct,
                "ram" => PleIo::Ram,
                _ => return Err(v.error("mmap, direct or ram")),
            };
        }
        if let Some(v) = get("MLXCEL_PLE_CACHE_BYTES") {
            p.ple_cache_bytes = v.number("a byte count")?;
        }
        if let Some(v) = get("MLXCEL_DEQUANT_ROWS") {
            p.dequant_rows = Some(v.number("a number of rows (0 = never)")?);
        }
        if let Some(v) = get("MLXCEL_PREFILL_DENSE_BYTES") {
            p.prefill_dense_bytes = Some(v.number("a byte count (0 = keep none)")?);
        }
        if let Some(v) = get("MLXCEL_PREFILL_FOLD_RESIDUAL") {
            p.prefill_fold_residual = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_WARM_UP") {
            p.warm_up = Some(v.switch()?);
        }
        if let Some(v) = get("MLXCEL_CPU_KERNELS") {
            p.cpu_kernels = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CPU_DECODE") {
            p.cpu_decode = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CPU_ACTIVATIONS") {
            p.cpu_int8_activations = match v.word().as_str() {
                "f32" => false,
                "q8" => true,
                _ => return Err(v.error("f32 or q8")),
            };
        }
        if let Some(v) = get("MLXCEL_CPU_THREADS") {
            p.cpu_threads = Some(v.in_range("a number of threads from 1 to 64", 1, 64)?);
        }
        if let Some(v) = get("MLXCEL_ZERO_COPY") {
            p.zero_copy = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_QMV") {
            p.cuda_qmv = match v.word().as_str() {
                "0" => None,
                "1" => Some(DEFAULT_QMV_SHAPE),
                _ => Some(v.shape("0, 1 or a launch shape NWxRPW such as 4x4")?),
            };
        }
        if let Some(v) = get("MLXCEL_CUDA_QMV_FOLD") {
            p.cuda_qmv_fold = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_QMV_FOLD_SHAPE") {
            p.cuda_qmv_fold_shape = Some(v.shape("a launch shape NWxRPW such as 4x8")?);
        }
        if let Some(v) = get("MLXCEL_CUDA_QMV_ROWS") {
            p.cuda_qmv_rows = match v.word().as_str() {
                "1" => 1,
                "2" => 2,
                "4" => 4,
                "8" => 8,
                _ => return Err(v.error("1, 2, 4 or 8")),
            };
        }
        if let Some(v) = get("MLXCEL_CUDA_QMV_MMA") {
            p.cuda_qmv_mma = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_DECODE_OVERLAP") {
            p.cuda_decode_overlap = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_DECODE_MOE_LANES") {
            p.cuda_decode_moe_lanes = match v.word().as_str() {
                "8" => 8,
                "16" => 16,
                "32" => 32,
                _ => return Err(v.error("8, 16 or 32")),
            };
        }
        if let Some(v) = get("MLXCEL_CUDA_DECODE_MOE_STAGE") {
            p.cuda_decode_moe_stage = match v.word().as_str() {
                "0" => 0,
                "2" => 2,
                "4" => 4,
                "8" => 8,
                _ => return Err(v.error("0, 2, 4 or 8")),
            };
        }
        if let Some(v) = get("MLXCEL_CUDA_DECODE_ATTN_THREADS") {
            p.cuda_decode_attn_threads = match v.word().as_str() {
                "128" => 128,
                "256" => 256,
                _ => return Err(v.error("128 or 256")),
            };
        }
        if let Some(v) = get("MLXCEL_CUDA_DECODE_FUSED_ROUTE") {
            p.cuda_decode_fused_route = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_DECODE_ATTN_BLOCKS") {
            p.cuda_decode_attn_blocks =
                Some(v.in_range("a number of blocks from 1 to 65536", 1, 65536)? as i32);
        }
        if let Some(v) = get("MLXCEL_CUDA_DECODE") {
            p.cuda_decode = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_DECODE_TC") {
            p.cuda_decode_tc = match v.word().as_str() {
                "0" => None,
                "1" => Some(DEFAULT_DECODE_TC_SHAPE),
                _ => Some(
                    LaunchShape::parse(&v.raw)
                        .filter(|s| s.warps <= 16 && matches!(s.rows, 16 | 32))
                        .ok_or_else(|| {
                            v.error("0, 1 or NWxRPW with 1 to 16 warps and 16 or 32 rows")
                        })?,
                ),
            };
        }
        if let Some(v) = get("MLXCEL_CUDA_DECODE_GEMV") {
            let shapes: Vec<Option<DecodeGemv>> = v.raw.split(',').map(DecodeGemv::parse).collect();
            p.cuda_decode_gemv =
                match shapes[..] {
                    [Some(rms), Some(res), Some(glu)] if glu.shape.rows % 2 == 0 => {
                        Some([rms, res, glu])
                    }
                    _ => return Err(v.error(
                        "three NWxRPW[:B] shapes (q|k|v and head, o and down, gate|up) of 1 to \
                         32 warps and 1 to 32 rows, gate|up's rows even, B blocks of NW warps \
                         within an SM's 32 blocks and 64 warps",
                    )),
                };
        }
        if let Some(v) = get("MLXCEL_BATCH_PIPELINE") {
            p.batch_pipeline = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_LAUNCH") {
            p.cuda_launch = match v.word().as_str() {
                "mlxcel" => CudaLaunch::Mlxcel,
                "mlx" => CudaLaunch::Mlx,
                _ => return Err(v.error("`mlx` or `mlxcel`")),
            };
        }
        if let Some(v) = get("MLXCEL_CUDA_DEQUANT") {
            p.cuda_dequant = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_GATHER") {
            p.cuda_gather = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_LOAD") {
            p.cuda_load = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_LOAD_READERS") {
            p.cuda_load_readers = v.in_range("a number of readers from 1 to 32", 1, 32)?;
        }
        if let Some(v) = get("MLXCEL_CUDA_LOAD_POOL") {
            p.cuda_load_pool = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_ROWS") {
            p.cuda_rows = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_PREFILL_ROPE") {
            p.cuda_prefill_rope = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_ROUTER") {
            p.cuda_router = v.switch()?;
        }
        if let Some(v) = get("MLXCEL_CUDA_SCAN") {
            p.cuda_scan = match v.word().as_str() {
                "1" => CudaScan::All,
                "decode" => CudaScan::Decode,
                "0" => CudaScan::Off,
                _ => return Err(v.error("1, decode or 0")),
            };
        }
        if let Some(v) = get("MLXCEL_FUSE_PROJECTIONS") {
            p.fuse_projections = Some(v.switch()?);
        }
        if let Some(v) = get("MLXCEL_SURGERY") {
            let path = std::path::PathBuf::from(v.raw.trim());
            if !path.is_file() {
                return Err(v.error("the path of an existing surgery YAML file"));
            }
            p.surgery = Some(path);
        }
        if let Some(v) = get("MLXCEL_EMBED_PAD_TO") {
            p.embed_pad_to = Some(v.in_range("a multiple from 1 to 256", 1, 256)?);
        }
        Ok(p)
    }
}

impl Default for RuntimePolicy {
    fn default() -> Self {
        RuntimePolicy::DEFAULT
    }
}

/// One set variable being parsed.
struct Var {
    name: &'static str,
    raw: String,
}

impl Var {
    fn word(&self) -> String {
        self.raw.trim().to_ascii_lowercase()
    }

    fn error(&self, expected: &str) -> Error {
        Error::Policy {
            var: self.name.to_string(),
            value: self.raw.clone(),
            expected: expected.to_string(),
        }
    }

    fn switch(&self) -> Result<bool> {
        match self.word().as_str() {
            "1" => Ok(true),
            "0" => Ok(false),
            _ => Err(self.error("1 (on) or 0 (off)")),
        }
    }

    /// A decimal number (digits only).
    fn number<T: std::str::FromStr>(&self, expected: &str) -> Result<T> {
        let t = self.raw.trim();
        if !t.bytes().all(|b| b.is_ascii_digit()) {
            return Err(self.error(expected));
        }
        t.parse().map_err(|_| self.error(expected))
    }

    fn in_range(&self, expected: &str, min: usize, max: usize) -> Result<usize> {
        let n: usize = self.number(expected)?;
        if (min..=max).contains(&n) {
            Ok(n)
        } else {
            Err(self.error(expected))
        }
    }

    fn shape(&self, expected: &str) -> Result<LaunchShape> {
        LaunchShape::parse(&self.raw).ok_or_else(|| {
            self.error(&format!(
                "{expected} (1 to 32 warps NW, 1 to 32*NW rows RPW)"
            ))
        })
    }
}

static INSTALLED: RwLock<RuntimePolicy> = RwLock::new(RuntimePolicy::DEFAULT);

/// Makes `policy` the process-wide one that layers and kernels read, and hands its values to
/// the C++ kernels (CPU threads, CUDA launch path). Fails when the CPU kernel's thread pool is
/// already running with another thread count.
pub fn install(policy: &RuntimePolicy) -> Result<()> {
    // Validated by `from_vars`; a policy built in code is checked here.
    let threads = match policy.cpu_threads {
        None => 0,
        Some(n @ 1..=64) => n as i32,
        Some(n) => {
            return Err(Error::Invalid(format!(
                "RuntimePolicy::cpu_threads = {n}: expected 1 to 64 threads"
            )))
        }
    };
    crate::ffi::bridge::set_cpu_threads(threads)?;
    crate::ffi::bridge::set_cpu_int8_activations(policy.cpu_int8_activations)?;
    crate::ffi::bridge::set_cuda_launch_mlx(policy.cuda_launch == CudaLaunch::Mlx)?;
    let mut installed = INSTALLED.write().unwrap_or_else(|e| e.into_inner());
    *installed = policy.clone();
    Ok(())
}

/// The installed policy ([`RuntimePolicy::default`] until [`install`] is called).
pub fn current() -> RuntimePolicy {
    with(RuntimePolicy::clone)
}

/// Reads the installed policy without copying it.
pub fn with<R>(f: impl FnOnce(&RuntimePolicy) -> R) -> R {
    let installed = INSTALLED.read().unwrap_or_else(|e| e.into_inner());
    f(&installed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(pairs: &[(&str, &str)]) -> Result<RuntimePolicy> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        RuntimePolicy::from_vars(|name| map.get(name).cloned())
    }

    fn one(var: &str, value: &str) -> RuntimePolicy {
        parse(&[(var, value)]).unwrap_or_else(|e| panic!("{var}={value}: {e}"))
    }

    fn rejects(var: &str, value: &str) {
        match parse(&[(var, value)]) {
            Err(e @ Error::Policy { .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.starts_with(&format!("{var}={value}: expected ")),
                    "{msg}"
                );
                if let Error::Policy { var: named, .. } = e {
                    assert_eq!(named, var);
                }
            }
            other => panic!("{var}={value}: {other:?}"),
        }
    }

    #[test]
    fn unset_and_blank_are_the_defaults() {
        assert_eq!(parse(&[]).unwrap(), RuntimePolicy::default());
        for var in RuntimePolicy::VARIABLES {
            assert_eq!(one(var, ""), RuntimePolicy::default(), "{var}");
            assert_eq!(one(var, "  "), RuntimePolicy::default(), "{var}");
        }
    }

    #[test]
    fn every_variable_rejects_garbage_naming_itself() {
        for var in RuntimePolicy::VARIABLES {
            rejects(var, "banana");
        }
    }

    #[test]
    fn external_ple() {
        let v = "MLXCEL_PLE_IO";
        assert_eq!(parse(&[]).unwrap().ple_io, PleIo::Mmap);
        assert_eq!(one(v, "direct").ple_io, PleIo::Direct);
        assert_eq!(one(v, "RAM").ple_io, PleIo::Ram);
        assert_eq!(one(v, "mmap").ple_io, PleIo::Mmap);
        rejects(v, "o_direct");
        let v = "MLXCEL_PLE_CACHE_BYTES";
        assert_eq!(parse(&[]).unwrap().ple_cache_bytes, 512 << 20);
        assert_eq!(one(v, "0").ple_cache_bytes, 0);
        assert_eq!(one(v, "4096").ple_cache_bytes, 4096);
        rejects(v, "1G");
    }

    #[test]
    fn materialization() {
        let v = "MLXCEL_WEIGHT_MATERIALIZATION";
        assert_eq!(
            one(v, "eager").weight_materialization,
            Materialization::Eager
        );
        assert_eq!(one(v, "LAZY").weight_materialization, Materialization::Lazy);
        rejects(v, "sometimes");
    }

    #[test]
    fn expert_streaming() {
        let v = "MLXCEL_EXPERT_STREAM";
        assert_eq!(one(v, "auto").expert_stream, StreamMode::Auto);
        for on in ["1", "on", "ON"] {
            assert_eq!(one(v, on).expert_stream, StreamMode::On);
        }
        for off in ["0", "off"] {
            assert_eq!(one(v, off).expert_stream, StreamMode::Off);
        }
        rejects(v, "2");
        let v = "MLXCEL_EXPERT_ARENA_BYTES";
        assert_eq!(one(v, "1048576").expert_arena_bytes, Some(1 << 20));
        assert_eq!(one(v, " 0 ").expert_arena_bytes, Some(0));
        for bad in ["-1", "1.5", "1G", "+3", "99999999999999999999999"] {
            rejects(v, bad);
        }
        let v = "MLXCEL_EXPERT_CACHE_POLICY";
        assert_eq!(one(v, "lru").expert_cache_policy, CachePolicy::Lru);
        assert_eq!(one(v, "LFU").expert_cache_policy, CachePolicy::Lfu);
        rejects(v, "fifo");
        let v = "MLXCEL_EXPERT_READ_THREADS";
        assert_eq!(one(v, "8").expert_read_threads, 8);
        assert_eq!(one(v, "1").expert_read_threads, 1);
        rejects(v, "0");
        rejects(v, "-2");
        let v = "MLXCEL_EXPERT_IO";
        assert_eq!(parse(&[]).unwrap().expert_io, ExpertIo::Direct);
        assert_eq!(one(v, "dontneed").expert_io, ExpertIo::Dontneed);
        assert_eq!(one(v, " CACHED ").expert_io, ExpertIo::Cached);
        assert_eq!(one(v, "direct").expert_io, ExpertIo::Direct);
        rejects(v, "o_direct");
    }

    #[test]
    fn decode_moe_lanes() {
        let v = "MLXCEL_CUDA_DECODE_MOE_LANES";
        assert_eq!(parse(&[]).unwrap().cuda_decode_moe_lanes, 8);
        assert_eq!(one(v, "16").cuda_decode_moe_lanes, 16);
        assert_eq!(one(v, " 32 ").cuda_decode_moe_lanes, 32);
        rejects(v, "4");
        rejects(v, "64");
    }

    #[test]
    fn decode_moe_stage() {
        let v = "MLXCEL_CUDA_DECODE_MOE_STAGE";
        assert_eq!(parse(&[]).unwrap().cuda_decode_moe_stage, 0);
        assert_eq!(one(v, "8").cuda_decode_moe_stage, 8);
        assert_eq!(one(v, " 4 ").cuda_decode_moe_stage, 4);
        rejects(v, "16");
        rejects(v, "3");
    }

    #[test]
    fn decode_attn_threads() {
        let v = "MLXCEL_CUDA_DECODE_ATTN_THREADS";
        assert_eq!(parse(&[]).unwrap().cuda_decode_attn_threads, 256);
        assert_eq!(one(v, "128").cuda_decode_attn_threads, 128);
        rejects(v, "64");
        rejects(v, "512");
    }

    #[test]
    fn decode_attn_blocks() {
        let v = "MLXCEL_CUDA_DECODE_ATTN_BLOCKS";
        assert_eq!(parse(&[]).unwrap().cuda_decode_attn_blocks, None);
        assert_eq!(one(v, "66").cuda_decode_attn_blocks, Some(66));
        assert_eq!(one(v, " 1 ").cuda_decode_attn_blocks, Some(1));
        assert_eq!(default_decode_attn_blocks(4), 264);
        assert_eq!(default_decode_attn_blocks(8), 132);
        assert_eq!(default_decode_attn_blocks(16), 132);
        for bad in ["0", "-3", "65537", "many"] {
            rejects(v, bad);
        }
    }

    #[test]
    fn dequant_rows() {
        let v = "MLXCEL_DEQUANT_ROWS";
        assert_eq!(one(v, "2").dequant_rows, Some(2));
        assert_eq!(one(v, "0").dequant_rows, Some(0));
        rejects(v, "many");
        rejects(v, "-5");
    }

    #[test]
    fn prefill_dense_bytes() {
        let v = "MLXCEL_PREFILL_DENSE_BYTES";
        assert_eq!(RuntimePolicy::default().prefill_dense_bytes, None);
        assert_eq!(one(v, "0").prefill_dense_bytes, Some(0));
        assert_eq!(one(v, "17179869184").prefill_dense_bytes, Some(1 << 34));
        rejects(v, "16G");
        rejects(v, "-1");
    }

    #[test]
    fn switches() {
        type Get = fn(&RuntimePolicy) -> Option<bool>;
        let cases: [(&str, Get); 17] = [
            ("MLXCEL_WARM_UP", |p| p.warm_up),
            ("MLXCEL_CPU_KERNELS", |p| Some(p.cpu_kernels)),
            ("MLXCEL_CPU_DECODE", |p| Some(p.cpu_decode)),
            ("MLXCEL_ZERO_COPY", |p| Some(p.zero_copy)),
            ("MLXCEL_CUDA_QMV_FOLD", |p| Some(p.cuda_qmv_fold)),
            ("MLXCEL_CUDA_QMV_MMA", |p| Some(p.cuda_qmv_mma)),
            ("MLXCEL_CUDA_DECODE", |p| Some(p.cuda_decode)),
            ("MLXCEL_CUDA_DECODE_OVERLAP", |p| {
                Some(p.cuda_decode_overlap)
            }),
            ("MLXCEL_CUDA_DECODE_FUSED_ROUTE", |p| {
                Some(p.cuda_decode_fused_route)
            }),
            ("MLXCEL_CUDA_DEQUANT", |p| Some(p.cuda_dequant)),
            ("MLXCEL_CUDA_ROWS", |p| Some(p.cuda_rows)),
            ("MLXCEL_CUDA_PREFILL_ROPE", |p| Some(p.cuda_prefill_rope)),
            ("MLXCEL_CUDA_ROUTER", |p| Some(p.cuda_router)),
            ("MLXCEL_PREFILL_FOLD_RESIDUAL", |p| {
                Some(p.prefill_fold_residual)
            }),
            ("MLXCEL_CUDA_GATHER", |p| Some(p.cuda_gather)),
            ("MLXCEL_CUDA_LOAD", |p| Some(p.cuda_load)),
            ("MLXCEL_FUSE_PROJECTIONS", |p| p.fuse_projections),
        ];
        for (var, get) in cases {
            assert_eq!(get(&one(var, "1")), Some(true), "{var}");
            assert_eq!(get(&one(var, " 0 ")), Some(false), "{var}");
            for bad in ["yes", "2", "true", "off"] {
                rejects(var, bad);
            }
        }
    }

    #[test]
    fn cuda_scan() {
        let v = "MLXCEL_CUDA_SCAN";
        assert_eq!(RuntimePolicy::default().cuda_scan, CudaScan::All);
        assert_eq!(one(v, "0").cuda_scan, CudaScan::Off);
        assert_eq!(one(v, " Decode ").cuda_scan, CudaScan::Decode);
        assert_eq!(one(v, "1").cuda_scan, CudaScan::All);
        for bad in ["2", "prefill", "yes"] {
            rejects(v, bad);
        }
    }

    #[test]
    fn cpu_activations() {
        let v = "MLXCEL_CPU_ACTIVATIONS";
        assert!(!RuntimePolicy::default().cpu_int8_activations);
        assert!(one(v, "q8").cpu_int8_activations);
        assert!(!one(v, " F32 ").cpu_int8_activations);
        for bad in ["1", "int8", "q4"] {
            rejects(v, bad);
        }
    }

    #[test]
    fn embed_pad_to() {
        let v = "MLXCEL_EMBED_PAD_TO";
        assert_eq!(RuntimePolicy::default().embed_pad_to, None);
        assert_eq!(one(v, "32").embed_pad_to, Some(32));
        assert_eq!(one(v, "1").embed_pad_to, Some(1));
        for bad in ["0", "257", "wide", "-8"] {
            rejects(v, bad);
        }
    }

    #[test]
    fn cpu_threads() {
        let v = "MLXCEL_CPU_THREADS";
        assert_eq!(one(v, "1").cpu_threads, Some(1));
        assert_eq!(one(v, "64").cpu_threads, Some(64));
        for bad in ["0", "65", "four", "-1"] {
            rejects(v, bad);
        }
    }

    #[test]
    fn cuda_load_readers() {
        let v = "MLXCEL_CUDA_LOAD_READERS";
        assert_eq!(RuntimePolicy::default().cuda_load_readers, 8);
        assert_eq!(one(v, "1").cuda_load_readers, 1);
        assert_eq!(one(v, "32").cuda_load_readers, 32);
        for bad in ["0", "33", "eight", "-1"] {
            rejects(v, bad);
        }
        let v = "MLXCEL_CUDA_LOAD_POOL";
        assert!(RuntimePolicy::default().cuda_load_pool);
        assert!(!one(v, "0").cuda_load_pool);
        rejects(v, "pool");
    }

    #[test]
    fn cuda_launch_shapes() {
        let v = "MLXCEL_CUDA_DECODE_TC";
        assert_eq!(one(v, "0").cuda_decode_tc, None);
        assert_eq!(one(v, "1").cuda_decode_tc, Some(DEFAULT_DECODE_TC_SHAPE));
        assert_eq!(one(v, "4x32").cuda_decode_tc, LaunchShape::new(4, 32));
        for bad in ["4x8", "32x16", "8x64", "8", "on"] {
            rejects(v, bad);
        }
        let v = "MLXCEL_CUDA_DECODE_GEMV";
        assert_eq!(
            one(v, "8x16, 2x8:32,4x4:8").cuda_decode_gemv,
            Some(
                [(8, 16, 0), (2, 8, 32), (4, 4, 8)].map(|(w, r, b)| DecodeGemv {
                    shape: LaunchShape::new(w, r).unwrap(),
                    min_blocks: b
                })
            )
        );
        assert_eq!(parse(&[]).unwrap().cuda_decode_gemv, None);
        assert_eq!(default_decode_gemv(4096), DEFAULT_DECODE_GEMV_SHAPES);
        assert_eq!(default_decode_gemv(2048)[0].shape.pair(), (2, 8));
        assert_eq!(
            default_decode_gemv(2048)[1..],
            DEFAULT_DECODE_GEMV_SHAPES[1..]
        );
        for bad in [
            "4x8,4x4",
            "4x8,4x4,4x3",
            "4x8,4x64,4x8",
            "1",
            "4x8,4x4,4x8,4x8",
            "4x8:17,4x4,4x8",
            "4x8:x,4x4,4x8",
            "1x8:33,4x4,4x8",
        ] {
            rejects(v, bad);
        }
        let v = "MLXCEL_CUDA_QMV";
        assert_eq!(one(v, "0").cuda_qmv, None);
        assert_eq!(one(v, "1").cuda_qmv, Some(DEFAULT_QMV_SHAPE));
        assert_eq!(one(v, "8x16").cuda_qmv, LaunchShape::new(8, 16));
        assert_eq!(one(v, "32x1024").cuda_qmv, LaunchShape::new(32, 1024));
        for bad in ["0x4", "4x0", "33x1", "4x129", "4", "x4", "4x4x4", "-4x4"] {
            rejects(v, bad);
        }
        let msg = parse(&[(v, "banana")]).unwrap_err().to_string();
        assert!(
            msg.contains(
                "MLXCEL_CUDA_QMV=banana: expected 0, 1 or a launch shape NWxRPW such as 4x4"
            ),
            "{msg}"
        );
        let v = "MLXCEL_CUDA_QMV_FOLD_SHAPE";
        assert_eq!(
            one(v, "16x16").cuda_qmv_fold_shape,
            LaunchShape::new(16, 16)
        );
        rejects(v, "0");
        rejects(v, "64x64");
        let v = "MLXCEL_CUDA_LAUNCH";
        assert_eq!(one(v, "mlx").cuda_launch, CudaLaunch::Mlx);
        assert_eq!(one(v, "MLXCEL").cuda_launch, CudaLaunch::Mlxcel);
        rejects(v, "1");
    }

    #[test]
    fn install_sets_the_current_policy_and_refuses_bad_thread_counts() {
        // Only fields no other test of this binary depends on.
        let policy = RuntimePolicy {
            weight_materialization: Materialization::Lazy,
            cuda_launch: CudaLaunch::Mlx,
            ..RuntimePolicy::default()
        };
        install(&policy).unwrap();
        assert_eq!(current(), policy);
        let bad = RuntimePolicy {
            cpu_threads: Some(65),
            ..RuntimePolicy::default()
        };
        let e = install(&bad).unwrap_err();
        assert!(e.to_string().contains("cpu_threads = 65"), "{e}");
        assert_eq!(current(), policy);
        install(&RuntimePolicy::default()).unwrap();
        assert_eq!(current(), RuntimePolicy::default());
    }

    #[test]
    fn the_first_bad_variable_is_reported_and_good_ones_combine() {
        let p = parse(&[
            ("MLXCEL_CPU_KERNELS", "0"),
            ("MLXCEL_DEQUANT_ROWS", "2"),
            ("MLXCEL_CUDA_QMV", "4x8"),
        ])
        .unwrap();
        assert!(!p.cpu_kernels);
        assert_eq!(p.dequant_rows, Some(2));
        assert_eq!(p.cuda_qmv, LaunchShape::new(4, 8));
        let e = parse(&[("MLXCEL_CPU_KERNELS", "0"), ("MLXCEL_ZERO_COPY", "nope")]).unwrap_err();
        assert!(e.to_string().starts_with("MLXCEL_ZERO_COPY=nope"), "{e}");
    }
}
