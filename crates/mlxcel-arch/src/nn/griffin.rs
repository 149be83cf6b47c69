//! Griffin's recurrent block (RecurrentGemma): a gated branch `act(linear_y(x))` times the
//! real-gated linear recurrent unit (RG-LRU) over a causal convolution of `linear_x(x)`.
//!
//! The RG-LRU is a diagonal linear recurrence `h_t = a_t ⊙ h_{t-1} + √(1 - a_t²) ⊙ i_t ⊙ x_t`
//! whose decay `a_t = exp(-8 · r_t · softplus(Λ))` and input gate `i_t` are sigmoids of
//! block-diagonal (per-head) projections of `x_t`. At the sequence's first position the
//! normaliser is 1 (transformers' `reset`), which the layer reads from its cache's position.
//! Like the Mamba-1 scan, prefill runs the recurrence as whole-block Hillis-Steele scans (see
//! [`super::ssm::SCAN_BLOCK`]); the state is kept in float32.

use mlxcel_core::{ops, Array, Dtype};

use super::ssm::{linear_recurrence, read_state, softplus, write_state, CausalConv, SCAN_BLOCK};
use super::{Activation, Linear, LinearInput, Norm};
use crate::cache::LayerCache;
use crate::Result;

/// Griffin's recurrent block (`temporal_block` of RecurrentGemma's recurrent layers).
#[derive(Debug)]
pub struct RgLruBlock {
    /// hidden → lru width, the gate branch (`linear_y`).
    pub linear_y: Linear,
    /// hidden → lru width, the recurrent branch (`linear_x`).
    pub linear_x: Linear,
    /// lru width → hidden (`linear_out`).
    pub linear_out: Linear,
    /// The depthwise convolution of the recurrent branch (no activation after it).
    pub conv: CausalConv,
    /// Per-head `[heads, width / heads, width / heads]` input gate weight (`x @ W`).
    pub input_gate_weight: Array,
    /// `[heads, width / heads]`.
    pub input_gate_bias: Array,
    /// Per-head recurrence gate weight, like the input gate's.
    pub recurrent_gate_weight: Array,
    /// `[heads, width / heads]`.
    pub recurrent_gate_bias: Array,
    /// `-8 · softplus(recurrent_param)` `[width]`, float32: the log decay at a gate of 1.
    pub log_decay: Array,
    /// The gate branch's activation (`hidden_activation`).
    pub act: Activation,
    /// Heads of the block-diagonal gates.
    pub heads: i32,
}

impl RgLruBlock {
    /// `recurrent_param` (stored) → the float32 log decay at a gate of 1.
    pub fn log_decay_of(recurrent_param: &Array) -> Result<Array> {
        Ok(softplus(&recurrent_param.astype(Dtype::Float32)?)?.mul_scalar(-8.0)?)
    }

    /// `sigmoid(x_h @ W_h + b_h)` per head for `x` `[B, L, width]`.
    fn gate(&self, x: &Array, weight: &Array, bias: &Array) -> Result<Array> {
        let (b, l, w) = (x.dim(0)?, x.dim(1)?, x.dim(2)?);
        let bw = w / self.heads;
        let per_head = x.reshape(&[b * l, self.heads, bw])?.transpose(&[1, 0, 2])?; // [H, B·L, bw]
        let y = per_head
            .matmul(weight)?
            .add(&bias.expand_dims(&[1])?)?
            .transpose(&[1, 0, 2])?
            .reshape(&[b, l, w])?;
        Ok(y.sigmoid()?)
    }

    /// `residual + linear_out(...)` of `norm(x)` `[B, L, hidden]`, continuing from and updating
    /// the layer's state cache (convolution window and recurrent state).
    pub fn forward(
        &self,
        x: &Array,
        norm: Option<&Norm>,
        residual: Option<&Array>,
        cache: &mut LayerCache,
    ) -> Result<Array> {
        let (window, state) = read_state(cache)?;
        let start = cache.offset();
        let x = match norm {
            Some(n) => n.forward(x)?,
            None => x.clone(),
        };
        let dtype = x.dtype()?;
        let (b, l) = (x.dim(0)?, x.dim(1)?);
        let y = self.act.apply(&self.linear_y.forward(&x)?)?;
        let (xb, window) = self
            .conv
            .convolve(&self.linear_x.forward(&x)?, window.as_ref())?;
        let input_gate = self.gate(&xb, &self.input_gate_weight, &self.input_gate_bias)?;
        let recurrent_gate =
            self.gate(&xb, &self.recurrent_gate_weight, &self.recurrent_gate_bias)?;
        let f32 = |a: &Array| a.astype(Dtype::Float32);
        let log_a = f32(&recurrent_gate)?.multiply(&self.log_decay)?;
        let a = log_a.exp()?;
        let mut scale = log_a
            .mul_scalar(2.0)?
            .exp()?
            .negative()?
            .add_scalar(1.0)?
            .sqrt()?;
        if start == 0 {
            // The sequence's first input enters unnormalised (and the zero state is not decayed).
            let width = scale.dim(2)?;
            let first = ops::ones(&[b, 1, width], Dtype::Float32)?;
            scale = ops::concatenate(&[first, scale.slice_axis(1, 1, l)?], 1)?;
        }
        let input = f32(&xb.multiply(&input_gate)?)?.multiply(&scale)?;
        let h0 = match state {
            Some(s) => s,
            None => ops::zeros(&[b, xb.dim(2)?], Dtype::Float32)?,
        };
        let (states, h) = if l == 1 {
            let h = a.squeeze(&[1])?.multiply(&h0)?.add(&input.squeeze(&[1])?)?;
            (h.expand_dims(&[1])?, h)
        } else {
            let mut h = h0;
            let mut parts = Vec::new();
            let mut at = 0;
            while at < l {
                let end = (at + SCAN_BLOCK).min(l);
                let states = linear_recurrence(
                    &a.slice_axis(1, at, end)?,
                    &input.slice_axis(1, at, end)?,
                    &h,
                )?;
                h = states
                    .slice_axis(1, end - at - 1, end - at)?
                    .squeeze(&[1])?;
                parts.push(states);
                at = end;
            }
            (ops::concatenate(&parts, 1)?, h)
        };
        write_state(cache, window, h, l as usize);
        let out = states.astype(dtype)?.multiply(&y)?;
        self.linear_out
            .forward_fused(&out, LinearInput::Plain, residual)
    }
}
