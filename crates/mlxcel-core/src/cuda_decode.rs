//! mlxcel's CUDA decode step: one decode token of an attention-only decoder (the decoders the
//! [CPU decode engine](crate::cpu_decode) covers, and their softmax-routed mixture-of-experts
//! kin: Qwen3-MoE, Mixtral) with affine 4/8-bit or dense weights and
//! bf16/f16 activations as one MLX array, whose evaluation adds the whole step's kernels
//! (`kernels/cuda/decode.cu`, 5 per layer) to MLX's CUDA graph (see `cpp/cuda_decode.cc`).
//! Decode on a GPU is bound by MLX's host time per array; the MLX graph of the same step has ~14
//! arrays per layer.
//!
//! The model layer describes its weights once, as for the CPU engine ([`CudaDecoder::new`],
//! [`CudaDecoder::set_linear`], [`CudaDecoder::set_norm`], [`CudaDecoder::finish`]); each
//! [`CudaDecoder::step`] then takes the embedded token and the layers' key/value buffers and
//! returns the logits, lazily: evaluating them writes the new key/value row into the buffers.

use cxx::UniquePtr;

use crate::array::ArrayList;
use crate::cpu_decode::{layer_index, linear_pointers, DecoderShape, LinearRole, NormRole};
use crate::ffi::bridge;
use crate::{Array, Dtype, Error, Result};

/// A built decode step (see the module docs).
pub struct CudaDecoder {
    raw: UniquePtr<bridge::CudaDecoder>,
    layers: usize,
    dtype: Dtype,
}

impl std::fmt::Debug for CudaDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDecoder")
            .field("layers", &self.layers)
            .field("dtype", &self.dtype)
            .finish()
    }
}

/// The first compute capability (times ten) with programmatic dependent launch (Hopper).
const PROGRAMMATIC_LAUNCH_ARCH: i32 = 90;

/// Whether this process's GPU has programmatic dependent launch (what overlapped launches of
/// the step need; the driver must still build the graph: [`CudaDecoder::overlapped`]).
pub fn programmatic_launch_available() -> Result<bool> {
    Ok(bridge::cuda_device_arch()? >= PROGRAMMATIC_LAUNCH_ARCH)
}

/// Decoders finished in this process whose kernels launch overlapped (see
/// [`CudaDecoder::overlapped`]).
static OVERLAPPED_DECODERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many decode steps built in this process launch their kernels overlapped (the stats
/// line's `cuda_decode_overlapped`, and what the GPU test checks the policy against).
pub fn overlapped_decoders() -> usize {
    OVERLAPPED_DECODERS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Most experts a routed-expert layer of the step may have (decode_moe.cu's
/// `DEC_MOE_MAX_EXPERTS`).
pub const MAX_EXPERTS: i32 = 1024;
/// Most experts per token (decode_moe.cu's `DEC_MOE_MAX_TOP_K`).
pub const MAX_TOP_K: i32 = 32;

/// Whether a projection's planes are ones the CUDA step reads: dense `[out, in]` (or a stack of
/// experts' `[experts, out, in]`) in `dtype` (`in` a multiple of 8), or affine 4/8-bit, group
/// 32/64/128, biases present, scales and biases in `dtype`.
pub fn takes_linear(
    w: &Array,
    quant: Option<(&Array, &Array, i32, i32)>,
    dtype: Dtype,
) -> Result<bool> {
    let Some((scales, biases, group, bits)) = quant else {
        return Ok(matches!(w.ndim(), 2 | 3) && w.dtype()? == dtype && w.dim(-1)? % 8 == 0);
    };
    Ok(matches!(bits, 4 | 8)
        && matches!(group, 32 | 64 | 128)
        && w.dtype()? == Dtype::Uint32
        && scales.dtype()? == dtype
        && biases.dtype()? == dtype)
}

impl CudaDecoder {
    /// A step of `shape` on `dtype` activations (bfloat16 or float16) with nothing set, for
    /// projections in `formats`; its kernels are compiled (or read from the cache) now.
    pub fn new(
        shape: &DecoderShape,
        dtype: Dtype,
        formats: crate::cuda_kernels::DecoderFormats,
    ) -> Result<CudaDecoder> {
        // One read of the policy for the kernels and their launches (the shapes are compiled
        // in).
        let launch = crate::cuda_kernels::decoder_shapes(shape.hidden);
        let binary = crate::cuda_kernels::decoder_binary(dtype, formats, launch)?;
        // The three GEMV kinds' shapes, then the tensor-core GEMVs' (0, 0: none), then the
        // expert GEMVs' lanes per row, the attention blocks per step, whether the routing
        // runs in the router's GEMV and the attention blocks' threads.
        let (attn_blocks, fused_route, overlap) = crate::policy::with(|p| {
            (
                p.cuda_decode_attn_blocks,
                p.cuda_decode_fused_route,
                p.cuda_decode_overlap,
            )
        });
        let fused_route = fused_route && crate::cuda_kernels::fused_router_fits(&launch);
        let group = shape.heads / shape.kv_heads.max(1);
        let attn_blocks =
            attn_blocks.unwrap_or_else(|| crate::policy::default_decode_attn_blocks(group));
        let shapes: Vec<i32> = launch
            .gemv
            .iter()
            .map(|g| g.shape.pair())
            .chain([launch.tensor_cores.unwrap_or((0, 0))])
            .flat_map(|(nw, rpw)| [nw, rpw])
            .chain([
                launch.moe_lanes,
                attn_blocks,
                i32::from(fused_route),
                launch.attn_threads,
            ])
            .collect();
        // Overlapped launches on sm_90 and later only: older GPUs compile the kernels without
        // their wait (prelude.cuh), so a programmatic edge must never reach them.
        let overlap = overlap && programmatic_launch_available()?;
        let raw = bridge::cuda_decoder_new(
            binary,
            dtype == Dtype::Float16,
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.layers,
            shape.eps,
            shape.attn_scale,
            &shape.inv_freq,
            shape.traditional,
            &shapes,
            overlap,
        )?;
        Ok(CudaDecoder {
            raw,
            layers: shape.layers.max(0) as usize,
            dtype,
        })
    }

    /// Sets a projection: dense `w` (`quant` `None`) or MLX affine packed with `quant =
    /// Some((scales, biases, group_size, bits))` (see [`takes_linear`]); `bias` `[out]` (q/k/v
    /// only).
    pub fn set_linear(
        &mut self,
        layer: Option<usize>,
        role: LinearRole,
        w: &Array,
        quant: Option<(&Array, &Array, i32, i32)>,
        bias: Option<&Array>,
    ) -> Result<()> {
        let (scales, biases, group, bits, bias) = linear_pointers(quant, bias);
        // SAFETY: the pointers are null or borrow arrays alive for this call.
        unsafe {
            bridge::cuda_decoder_set_linear(
                self.raw.pin_mut(),
                layer_index(layer),
                role as i32,
                w.as_ref(),
                scales,
                biases,
                bias,
                group,
                bits,
            )?
        };
        Ok(())
    }

    /// Makes `layer` a routed-expert layer (its projections [`LinearRole::Router`] and
    /// `Expert*`): softmax over the router's logits, the `top_k` best experts kept (their
    /// weights renormalised to sum to one when `normalize`), times `weight_scale`.
    pub fn set_routing(
        &mut self,
        layer: usize,
        top_k: i32,
        normalize: bool,
        weight_scale: f32,
    ) -> Result<()> {
        bridge::cuda_decoder_set_routing(
            self.raw.pin_mut(),
            layer_index(Some(layer)),
            top_k,
            normalize,
            weight_scale,
        )?;
        Ok(())
    }

    /// Sets an RMSNorm weight (in the activations' dtype).
    pub fn set_norm(&mut self, layer: Option<usize>, role: NormRole, w: &Array) -> Result<()> {
        bridge::cuda_decoder_set_norm(
            self.raw.pin_mut(),
            layer_index(layer),
            role as i32,
            w.as_ref(),
        )?;
        Ok(())
    }

    /// Checks every part, evaluates the weights and loads the kernels; the step can run
    /// afterwards.
    pub fn finish(&mut self) -> Result<()> {
        bridge::cuda_decoder_finish(self.raw.pin_mut())?;
        if self.overlapped() {
            OVERLAPPED_DECODERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }

    /// Whether the finished step launches each kernel while the one before it finishes
    /// (`MLXCEL_CUDA_DECODE_OVERLAP`, where the driver builds such graphs: see
    /// `cpp/cuda_decode.cc`).
    pub fn overlapped(&self) -> bool {
        bridge::cuda_decoder_overlapped(&self.raw)
    }

    /// Layers of the step.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// The activations' dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The logits `[1, 1, vocab]` of the token embedded as `x` (`[1, 1, hidden]`) at
    /// `position`, lazily. Evaluating them writes every layer's new key/value row into row
    /// `position` of its buffers (`keys[i]`, `values[i]`: `[1, kv_heads, capacity, head_dim]`,
    /// evaluated, row-contiguous, capacity above `position`), which nothing else may read as
    /// they were: the caller owns them.
    pub fn step(
        &self,
        x: &Array,
        keys: &[Array],
        values: &[Array],
        position: usize,
    ) -> Result<Array> {
        if keys.len() != self.layers || values.len() != self.layers {
            return Err(Error::Invalid(format!(
                "cuda decoder: {} key and {} value buffers for {} layers",
                keys.len(),
                values.len(),
                self.layers
            )));
        }
        let keys = ArrayList::new(keys)?;
        let values = ArrayList::new(values)?;
        let out = bridge::cuda_decoder_step(
            &self.raw,
            x.as_ref(),
            keys.as_ref(),
            values.as_ref(),
            position as i64,
        )?;
        Ok(Array::from_raw(out))
    }
}
