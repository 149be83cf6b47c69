//! MiniMax's lightning attention: linear attention with a per-head exponential decay. Its state
//! is one `[heads, head_dim, head_dim]` matrix per layer, `S_t = e^{-s}·S_{t-1} + k_tᵀ v_t`, and
//! `o_t = q_t S_t`. A prefill runs in blocks of `block` positions, each in closed form:
//! `o = ((Q Kᵀ) ⊙ D) V + (Q ⊙ e^{-s(i+1)}) S` with `D[i, j] = e^{-s(i-j)}` for `j ≤ i`, then
//! `S ← e^{-s·L} S + (K ⊙ e^{-s(L-1-j)})ᵀ V` — transformers' computation.

use mlxcel_core::ops;
use mlxcel_core::{Array, Dtype};

use super::{Activation, Linear, Norm};
use crate::cache::LayerCache;
use crate::{ModelError, Result};

/// One lightning-attention layer (`self_attn.{qkv_proj, output_gate, norm, out_proj}`).
#[derive(Debug, Clone)]
pub struct LightningAttention {
    /// hidden → `3 · heads · head_dim`, per head `[q | k | v]`, followed by `act`.
    pub qkv: Linear,
    /// hidden → `heads · head_dim`: the sigmoid gate of the output.
    pub gate: Linear,
    /// RMSNorm over the concatenated heads.
    pub norm: Norm,
    /// `heads · head_dim` → hidden.
    pub out: Linear,
    /// Applied to the qkv projection.
    pub act: Activation,
    /// Each head's decay rate `s`, `[heads, 1, 1]` float32.
    pub slope: Array,
    /// Heads.
    pub heads: i32,
    /// Width of one head.
    pub head_dim: i32,
    /// Positions per closed-form block of a prefill (`block_size`).
    pub block: i32,
}

/// The decay rates of layer `layer` of `layers` with `heads` heads (transformers'
/// `get_slope_rate`): `(2^(-8/heads))^(h+1) · (1 - layer / (layers - 1 + 1e-5) + 1e-5)`.
pub fn lightning_slopes(heads: i32, layer: usize, layers: usize) -> Vec<f64> {
    let base = 1.0 / 2f64.powf(8.0 / heads as f64);
    let factor = 1.0 - layer as f64 / (layers as f64 - 1.0 + 1e-5) + 1e-5;
    (0..heads).map(|h| base.powi(h + 1) * factor).collect()
}

impl LightningAttention {
    /// `x` `[B, L, hidden]` → `[B, L, hidden]`, continuing from and updating the layer's state.
    pub fn forward(&self, x: &Array, cache: &mut LayerCache) -> Result<Array> {
        let shape = x.shape();
        let (b, l) = (shape[0], shape[1]);
        let (h, d) = (self.heads, self.head_dim);
        let dtype = x.dtype()?;
        let LayerCache::State(state_cache) = cache else {
            return Err(ModelError::Runtime(format!(
                "a lightning-attention layer was given a cache at position {} that is not a state cache",
                cache.offset()
            )));
        };
        let qkv = self.act.apply(&self.qkv.forward(x)?)?;
        let qkv = qkv
            .reshape(&[b, l, h, 3 * d])?
            .transpose(&[0, 2, 1, 3])?
            .astype(Dtype::Float32)?;
        let parts = qkv.split_equal(3, -1)?;
        let (q, k, v) = (&parts[0], &parts[1], &parts[2]);
        let mut state = match state_cache.arrays.first().cloned().flatten() {
            Some(s) => s,
            None => ops::zeros(&[b, h, d, d], Dtype::Float32)?,
        };
        let neg_slope = self.slope.negative()?;
        let mut outputs = Vec::new();
        let mut start = 0;
        while start < l {
            let n = self.block.min(l - start);
            let (qb, kb, vb) = (
                q.slice_axis(2, start, start + n)?,
                k.slice_axis(2, start, start + n)?,
                v.slice_axis(2, start, start + n)?,
            );
            let idx = ops::arange(0.0, n as f64, 1.0, Dtype::Float32)?;
            let diff = idx.reshape(&[n, 1])?.subtract(&idx.reshape(&[1, n])?)?;
            let decay = ops::where_(
                &diff.greater_equal(&diff.scalar_like(0.0)?)?,
                &neg_slope.multiply(&diff)?.exp()?,
                &ops::zeros(&[1, 1, 1], Dtype::Float32)?,
            )?;
            let intra = qb
                .matmul(&kb.transpose(&[0, 1, 3, 2])?)?
                .multiply(&decay)?
                .matmul(&vb)?;
            let q_decay = neg_slope
                .multiply(&idx.add_scalar(1.0)?.reshape(&[n, 1])?)?
                .exp()?;
            let inter = qb.multiply(&q_decay)?.matmul(&state)?;
            outputs.push(intra.add(&inter)?);
            let k_decay = neg_slope
                .multiply(
                    &idx.negative()?
                        .add_scalar((n - 1) as f64)?
                        .reshape(&[n, 1])?,
                )?
                .exp()?;
            let block_decay = neg_slope.mul_scalar(n as f64)?.exp()?;
            state = state.multiply(&block_decay)?.add(
                &kb.multiply(&k_decay)?
                    .transpose(&[0, 1, 3, 2])?
                    .matmul(&vb)?,
            )?;
            start += n;
        }
        let out = if outputs.len() == 1 {
            outputs.pop().expect("one block")
        } else {
            ops::concatenate(&outputs, 2)?
        };
        state_cache.arrays = vec![Some(state)];
        state_cache.advance(l as usize);
        let out = out
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[b, l, h * d])?
            .astype(dtype)?;
        let out = self
            .norm
            .forward(&out)?
            .multiply(&self.gate.forward(x)?.sigmoid()?)?;
        self.out.forward(&out)
    }
}
