//! Mixture-of-experts: routers and the gathered expert MLP. Tokens are routed, their
//! (token, expert) pairs sorted by expert, and each projection runs as one `gather_qmm` /
//! `gather_mm` over the sorted rows — no per-expert loop.

use mlxcel_core::{Array, Dtype};

use super::{Activation, Linear, SwitchLinear};
use crate::Result;

/// How router logits become expert weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterScoring {
    /// Softmax over all experts, keep the top-k probabilities (optionally renormalised).
    Softmax,
    /// Sigmoid per expert, keep the top-k (optionally renormalised).
    Sigmoid,
}

#[derive(Debug, Clone)]
pub struct Router {
    pub gate: Linear,
    pub top_k: i32,
    pub scoring: RouterScoring,
    /// Renormalise the kept weights to sum to one (`norm_topk_prob`).
    pub normalize: bool,
}

impl Router {
    /// `x` `[T, D]` → (expert ids `[T, k]` uint32, weights `[T, k]` in x's dtype).
    pub fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let logits = self.gate.forward(x)?.astype(Dtype::Float32)?;
        let scores = match self.scoring {
            RouterScoring::Softmax => logits.softmax(&[-1], true)?,
            RouterScoring::Sigmoid => logits.sigmoid()?,
        };
        let k = self.top_k;
        let ids = scores
            .negative()?
            .argpartition(k - 1, -1)?
            .slice_axis(-1, 0, k)?;
        let mut weights = scores.take_along_axis(&ids, -1)?;
        if self.normalize {
            weights = weights.divide(&weights.sum(&[-1], true)?)?;
        }
        Ok((ids.astype(Dtype::Uint32)?, weights.astype(x.dtype()?)?))
    }
}

/// The experts' gated MLP: `down(act(gate(x)) * up(x))` with per-row expert choice.
#[derive(Debug, Clone)]
pub struct SwitchGlu {
    pub gate: SwitchLinear,
    pub up: SwitchLinear,
    pub down: SwitchLinear,
    pub act: Activation,
}

impl SwitchGlu {
    /// `x` `[T, D]`, `ids` `[T, k]` → `[T, k, D]`: each token through each of its experts.
    pub fn forward(&self, x: &Array, ids: &Array) -> Result<Array> {
        let shape = ids.shape();
        let (t, k) = (shape[0], shape[1]);
        let d = x.dim(-1)?;
        let flat = ids.reshape(&[t * k])?;
        // Sort (token, expert) pairs by expert so each expert's rows are contiguous.
        let order = flat.argsort(0)?;
        let inverse = order.argsort(0)?;
        let sorted_ids = flat.take(&order, 0)?;
        let token_of = order.floor_divide(&Array::scalar(k as f64, order.dtype()?)?)?;
        let rows = x.take(&token_of, 0)?.reshape(&[t * k, 1, d])?;
        let g = self.gate.forward_sorted(&rows, &sorted_ids)?;
        let u = self.up.forward_sorted(&rows, &sorted_ids)?;
        let h = self.act.apply(&g)?.multiply(&u)?;
        let y = self.down.forward_sorted(&h, &sorted_ids)?;
        Ok(y.take(&inverse, 0)?.reshape(&[t, k, d])?)
    }

    /// Weighted sum over each token's experts: `x` `[T, D]` → `[T, D]`.
    pub fn combine(&self, x: &Array, ids: &Array, weights: &Array) -> Result<Array> {
        let y = self.forward(x, ids)?;
        Ok(y.multiply(&weights.expand_dims(&[-1])?)?.sum(&[1], false)?)
    }
}
