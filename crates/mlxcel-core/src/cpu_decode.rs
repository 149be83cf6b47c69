//! mlxcel's CPU decode engine: one call per decode token of a dense attention-only decoder
//! (llama/qwen2/qwen3/mistral-shaped), instead of the thousands of small MLX arrays the same
//! step is as a graph (see `cpp/cpu_decode.cc`).
//!
//! The model layer describes its weights once ([`CpuDecoder::new`], [`CpuDecoder::set_linear`],
//! [`CpuDecoder::set_norm`], [`CpuDecoder::finish`]); each [`CpuDecoder::step`] then takes the
//! embedded token and the layers' key/value cache buffers (MLX arrays `[1, kv_heads, capacity,
//! head_dim]` float32 that nothing else shares: the new row is written into them in place) and
//! returns the logits. Prefill, batches and every other layer stay on MLX.

use cxx::UniquePtr;

use crate::ffi::bridge;
use crate::{Array, Dtype, Error, Result};

/// A projection's place in a layer (the output head is [`LinearRole::Head`], layer `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearRole {
    /// Queries.
    Q,
    /// Keys.
    K,
    /// Values.
    V,
    /// The attention output projection.
    O,
    /// The MLP gate (SiLU applied).
    Gate,
    /// The MLP up projection.
    Up,
    /// The MLP down projection.
    Down,
    /// The output head (vocabulary logits).
    Head,
    /// Queries, keys and values as one `[q | k | v]` projection (the CUDA step only).
    Qkv,
    /// The MLP gate and up projections as one `[gate | up]` projection (the CUDA step only).
    GateUp,
    /// A routed-expert layer's router, `[experts, hidden]` (the CUDA step only).
    Router,
    /// The experts' gates, `[experts, intermediate, hidden]` (the CUDA step only).
    ExpertGate,
    /// The experts' up projections, `[experts, intermediate, hidden]` (the CUDA step only).
    ExpertUp,
    /// The experts' down projections, `[experts, hidden, intermediate]` (the CUDA step only).
    ExpertDown,
}

/// A norm's place (all RMSNorm; the final norm is [`NormRole::Final`], layer `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormRole {
    /// Before attention.
    Input,
    /// Before the MLP.
    PostAttention,
    /// Each query head (before rope).
    Query,
    /// Each key head (before rope).
    Key,
    /// After the last layer.
    Final,
}

/// The shape of the decoder: widths, norm epsilon, attention scale and rope.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderShape {
    /// Model width.
    pub hidden: i32,
    /// Query heads.
    pub heads: i32,
    /// Key/value heads.
    pub kv_heads: i32,
    /// Width of one head.
    pub head_dim: i32,
    /// Number of layers.
    pub layers: i32,
    /// Every RMSNorm's epsilon.
    pub eps: f32,
    /// Multiplies `q . k`.
    pub attn_scale: f32,
    /// Per rotated pair, the angle per position (`inv_freq`, scalings applied).
    pub inv_freq: Vec<f32>,
    /// Interleaved pairs instead of halves.
    pub traditional: bool,
}

/// A built engine (see the module docs).
pub struct CpuDecoder {
    raw: UniquePtr<bridge::CpuDecoder>,
    layers: usize,
    vocab: usize,
}

impl std::fmt::Debug for CpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuDecoder")
            .field("layers", &self.layers)
            .field("vocab", &self.vocab)
            .finish()
    }
}

/// A layer as the engines' C++ side takes it: `-1` for the output head and final norm.
pub(crate) fn layer_index(layer: Option<usize>) -> i32 {
    layer.map_or(-1, |l| l as i32)
}

/// A projection's quantization planes and bias as the engines' C++ side takes them: `(scales,
/// biases, group_size, bits, bias)`, null pointers and zeros when dense / absent. The pointers
/// borrow the arrays: use them while those live.
pub(crate) type LinearPointers = (
    *const bridge::MlxArray,
    *const bridge::MlxArray,
    i32,
    i32,
    *const bridge::MlxArray,
);

pub(crate) fn linear_pointers(
    quant: Option<(&Array, &Array, i32, i32)>,
    bias: Option<&Array>,
) -> LinearPointers {
    let (scales, biases, group, bits) = match quant {
        Some((s, b, g, bits)) => (
            s.as_ref() as *const bridge::MlxArray,
            b.as_ref() as *const bridge::MlxArray,
            g,
            bits,
        ),
        None => (std::ptr::null(), std::ptr::null(), 0, 0),
    };
    let bias = bias.map_or(std::ptr::null(), |b| b.as_ref() as *const bridge::MlxArray);
    (scales, biases, group, bits, bias)
}

impl CpuDecoder {
    /// An engine of `shape` with nothing set.
    pub fn new(shape: &DecoderShape) -> Result<CpuDecoder> {
        let raw = bridge::cpu_decoder_new(
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.layers,
            shape.eps,
            shape.attn_scale,
            &shape.inv_freq,
            shape.traditional,
        )?;
        Ok(CpuDecoder {
            raw,
            layers: shape.layers.max(0) as usize,
            vocab: 0,
        })
    }

    /// Sets a projection: `w` dense `[out, in]` (float32/bf16/f16, `quant` `None`) or MLX affine
    /// packed with `quant = Some((scales, biases, group_size, bits))`; `bias` `[out]`.
    pub fn set_linear(
        &mut self,
        layer: Option<usize>,
        role: LinearRole,
        w: &Array,
        quant: Option<(&Array, &Array, i32, i32)>,
        bias: Option<&Array>,
    ) -> Result<()> {
        let role = role as i32;
        let (scales, biases, group, bits, bias) = linear_pointers(quant, bias);
        // SAFETY: the pointers are null or borrow arrays alive for this call.
        unsafe {
            bridge::cpu_decoder_set_linear(
                self.raw.pin_mut(),
                layer_index(layer),
                role,
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

    /// Sets an RMSNorm weight.
    pub fn set_norm(&mut self, layer: Option<usize>, role: NormRole, w: &Array) -> Result<()> {
        bridge::cpu_decoder_set_norm(
            self.raw.pin_mut(),
            layer_index(layer),
            role as i32,
            w.as_ref(),
        )?;
        Ok(())
    }

    /// Checks every part and evaluates the weights; the engine can step afterwards.
    pub fn finish(&mut self) -> Result<()> {
        bridge::cpu_decoder_finish(self.raw.pin_mut())?;
        self.vocab = bridge::cpu_decoder_vocab(&self.raw)? as usize;
        Ok(())
    }

    /// Layers of the engine.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// One decode step of the token embedded as `x` (`hidden` float32 values) at `position`:
    /// every layer's new key/value row is written into row `position` of its buffers
    /// (`keys[i]`, `values[i]`: `[1, kv_heads, capacity, head_dim]` float32, evaluated, held by
    /// nothing else), attention reads rows `0..=position`; returns the logits `[vocab]`.
    /// `None`, with nothing written, when a buffer is shared with another array or not float32
    /// (the caller computes the step another way).
    pub fn step(
        &mut self,
        x: &Array,
        keys: &[&Array],
        values: &[&Array],
        position: usize,
    ) -> Result<Option<Vec<f32>>> {
        if keys.len() != self.layers || values.len() != self.layers {
            return Err(Error::Mlx(format!(
                "cpu decoder: {} key and {} value buffers for {} layers",
                keys.len(),
                values.len(),
                self.layers
            )));
        }
        x.eval()?;
        let mut k_addr = Vec::with_capacity(self.layers);
        let mut v_addr = Vec::with_capacity(self.layers);
        let mut caps = Vec::with_capacity(self.layers);
        for (k, v) in keys.iter().zip(values) {
            let shape = k.shape();
            if shape.len() != 4
                || shape[0] != 1
                || v.shape() != shape
                || k.dtype()? != Dtype::Float32
                || v.dtype()? != Dtype::Float32
            {
                return Ok(None);
            }
            k.eval()?;
            v.eval()?;
            // The kernel writes row `position` at `(g * capacity + position) * head_dim`: only
            // a dense buffer nothing else reads may be written that way.
            let writable =
                |a: &Array| -> Result<bool> { Ok(a.is_exclusive()? && a.is_row_contiguous()?) };
            if !writable(k)? || !writable(v)? {
                return Ok(None);
            }
            k_addr.push(k.data_address()?);
            v_addr.push(v.data_address()?);
            caps.push(shape[2] as i64);
        }
        let mut logits = vec![0.0f32; self.vocab];
        bridge::cpu_decoder_step(
            self.raw.pin_mut(),
            x.as_ref(),
            &k_addr,
            &v_addr,
            &caps,
            position as i64,
            &mut logits,
        )?;
        Ok(Some(logits))
    }
}

/// Checks the CPU kernels' thread pool (shared by the linear kernel, the attention and this
/// engine): runs `calls` back-to-back pool calls of 2-9 short tasks each and returns how many of
/// them did not run every task exactly once before returning (0 on a sound pool). For tests
/// and diagnostics; it uses the process's pool, so it also exercises its sizing.
pub fn check_thread_pool(calls: u32) -> Result<u64> {
    let calls = i32::try_from(calls).map_err(|_| {
        Error::Invalid(format!(
            "check_thread_pool: {calls} calls, at most {} are supported",
            i32::MAX
        ))
    })?;
    Ok(bridge::cpu_pool_check(calls)? as u64)
}
