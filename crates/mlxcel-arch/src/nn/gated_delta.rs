//! The gated DeltaNet linear-attention mixer of Qwen3-Next and Qwen3.5: a causal convolution
//! over `[q | k | v]`, then the gated delta rule — per value head a `key_dim × value_dim` state
//! `S` that decays by `exp(g_t)` and is corrected towards `v_t` along `k_t` with strength
//! `beta_t`:
//!
//! ```text
//! S_t = exp(g_t) · S_{t-1} + k_t ⊗ beta_t (v_t − exp(g_t) · S_{t-1}ᵀ k_t),   o_t = S_tᵀ q_t
//! ```
//!
//! followed by a gated RMSNorm (`norm(o) · silu(z)`) and the output projection.
//!
//! Like the state-space mixers of [`super::ssm`], the layer keeps a [`LayerCache::State`] with
//! the convolution window and the recurrent state (float32). Prefill runs the chunked form
//! (whole-chunk matmuls within a chunk of [`DELTA_CHUNK`] positions, the state carried from
//! chunk to chunk), a decode step the one-token recurrence; either continues from the cached
//! state, so any split of a prompt gives the state of one pass.

use mlxcel_core::{ops, Array, Dtype};

use super::ssm::{read_state, silu, softplus, write_state, CausalConv};
use super::{Linear, LinearInput, Norm};
use crate::cache::LayerCache;
use crate::Result;

/// Positions per chunk of the chunked delta rule (transformers and fla use 64): the in-chunk
/// work grows with it (`Q²` per head), the sequential chunk-to-chunk steps shrink with it.
pub const DELTA_CHUNK: i32 = 64;

/// Heads and widths of a gated DeltaNet mixer.
#[derive(Debug, Clone, Copy)]
pub struct GatedDeltaDims {
    /// Query/key heads (`linear_num_key_heads`).
    pub key_heads: i32,
    /// Width of a query/key head (`linear_key_head_dim`).
    pub key_dim: i32,
    /// Value heads (`linear_num_value_heads`), a multiple of the key heads.
    pub value_heads: i32,
    /// Width of a value head (`linear_value_head_dim`).
    pub value_dim: i32,
}

impl GatedDeltaDims {
    /// `key_heads · key_dim`.
    pub fn key_width(&self) -> i32 {
        self.key_heads * self.key_dim
    }

    /// `value_heads · value_dim`.
    pub fn value_width(&self) -> i32 {
        self.value_heads * self.value_dim
    }

    /// The convolved width: `q`, `k` and `v` side by side.
    pub fn conv_dim(&self) -> i32 {
        2 * self.key_width() + self.value_width()
    }

    /// Value heads per key head.
    pub fn ratio(&self) -> i32 {
        self.value_heads / self.key_heads.max(1)
    }
}

/// How the input projections are laid out in the checkpoint.
#[derive(Debug)]
pub enum DeltaProjections {
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped per key head (`[q k v z]` and
    /// `[b a]` of each key head's value heads side by side).
    PerKeyHead {
        /// hidden → `2·key_width + 2·value_width`.
        qkvz: Linear,
        /// hidden → `2·value_heads`.
        ba: Linear,
    },
    /// Qwen3.5: `in_proj_qkv` (`[q | k | v]`), `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Separate {
        /// hidden → `conv_dim`.
        qkv: Linear,
        /// hidden → `value_width`.
        z: Linear,
        /// hidden → `value_heads`.
        b: Linear,
        /// hidden → `value_heads`.
        a: Linear,
    },
}

/// The gated DeltaNet mixer (`linear_attn.*`).
#[derive(Debug)]
pub struct GatedDeltaNet {
    /// The input projections.
    pub proj: DeltaProjections,
    /// Over `[q | k | v]`, without bias.
    pub conv: CausalConv,
    /// `[value_heads]`, added to `a` before the softplus (float32).
    pub dt_bias: Array,
    /// `-exp(A_log)`, `[value_heads]`, float32.
    pub a: Array,
    /// The gated RMSNorm's weight `[value_dim]` (plain `w`, not `1 + w`).
    pub norm_weight: Array,
    /// The gated RMSNorm's epsilon.
    pub norm_eps: f32,
    /// `value_width` → hidden.
    pub out_proj: Linear,
    /// Heads and widths.
    pub dims: GatedDeltaDims,
}

/// `x / sqrt(Σx² + 1e-6)` over the last axis (fla's `l2norm`, which transformers mirrors).
fn l2_normalize(x: &Array) -> Result<Array> {
    let sum = x.square()?.sum(&[-1], true)?;
    Ok(x.multiply(&sum.add_scalar(1e-6)?.rsqrt()?)?)
}

/// `[.., K, D]` key heads repeated to `[.., K·ratio, D]` value heads (head `h` reads key head
/// `h / ratio`).
fn repeat_heads(x: &Array, ratio: i32) -> Result<Array> {
    if ratio == 1 {
        return Ok(x.clone());
    }
    let mut shape = x.shape();
    let n = shape.len();
    let (heads, width) = (shape[n - 2], shape[n - 1]);
    let mut wide = shape.clone();
    wide.insert(n - 1, ratio);
    let y = x.expand_dims(&[n as i32 - 1])?.broadcast_to(&wide)?;
    shape[n - 2] = heads * ratio;
    shape[n - 1] = width;
    Ok(y.reshape(&shape)?)
}

/// `(I + n)⁻¹` for `n` `[.., Q, Q]` strictly lower triangular, as the product
/// `(I − n)(I + n²)(I + n⁴)…` = `Σ_k (−n)^k` (`n` is nilpotent, so the series ends at `Q`):
/// `log2 Q` matmuls instead of `Q` sequential substitution steps.
fn unit_lower_inverse(n: &Array, q: i32) -> Result<Array> {
    let idx = ops::arange(0.0, q as f64, 1.0, Dtype::Int32)?;
    let eye = idx
        .reshape(&[q, 1])?
        .equal(&idx.reshape(&[1, q])?)?
        .astype(Dtype::Float32)?;
    let m = n.negative()?;
    let mut inverse = eye.add(&m)?;
    let mut power = m;
    let mut span = 2;
    while span < q {
        power = power.matmul(&power)?;
        inverse = inverse.add(&inverse.matmul(&power)?)?;
        span *= 2;
    }
    Ok(inverse)
}

impl GatedDeltaNet {
    /// One step of the recurrence: `q`, `k` `[B, 1, H, Dk]`, `v` `[B, 1, H, Dv]`, `g`, `beta`
    /// `[B, 1, H]` from `s` `[B, H, Dk, Dv]`.
    fn step(
        q: &Array,
        k: &Array,
        v: &Array,
        g: &Array,
        beta: &Array,
        s: &Array,
    ) -> Result<(Array, Array)> {
        let (b, h) = (k.dim(0)?, k.dim(2)?);
        let (dk, dv) = (k.dim(3)?, v.dim(3)?);
        let column = |a: &Array| a.reshape(&[b, h, dk, 1]);
        let (q, k) = (column(q)?, column(k)?);
        let v = v.reshape(&[b, h, 1, dv])?;
        let decay = g.exp()?.reshape(&[b, h, 1, 1])?;
        let beta = beta.reshape(&[b, h, 1, 1])?;
        let s = s.multiply(&decay)?;
        let remembered = s.multiply(&k)?.sum(&[2], true)?; // [B, H, 1, Dv]
        let delta = v.subtract(&remembered)?.multiply(&beta)?;
        let s = s.add(&k.multiply(&delta)?)?;
        let out = s.multiply(&q)?.sum(&[2], false)?; // [B, H, Dv]
        Ok((out.reshape(&[b, 1, h, dv])?, s))
    }

    /// The chunked delta rule over `L` positions (same arguments as [`Self::step`] with `L`
    /// for 1): within a chunk, the WY form — the corrected values `u = T (beta v)` and keys
    /// `w = T (beta k e^{G})` with `T = (I + strictly_lower(beta k kᵀ ⊙ decay))⁻¹` — and from
    /// chunk to chunk the state, as transformers' `torch_chunk_gated_delta_rule`.
    fn chunked(
        q: &Array,
        k: &Array,
        v: &Array,
        g: &Array,
        beta: &Array,
        s0: &Array,
    ) -> Result<(Array, Array)> {
        let (b, l, h) = (k.dim(0)?, k.dim(1)?, k.dim(2)?);
        let q_len = DELTA_CHUNK.min(l);
        let pad = (q_len - l % q_len) % q_len;
        let chunks = (l + pad) / q_len;
        // [B, L, H, ..] → [B, H, c, Q, ..], zero-padded (a padded position has no decay, no
        // input and no effect on the state).
        let in_chunks = |a: &Array| -> Result<Array> {
            let mut a = a.transpose(&[0, 2, 1, 3])?;
            if pad > 0 {
                let mut s = a.shape();
                s[2] = pad;
                a = ops::concatenate(&[a.clone(), ops::zeros(&s, Dtype::Float32)?], 2)?;
            }
            let width = a.dim(3)?;
            Ok(a.reshape(&[b, h, chunks, q_len, width])?)
        };
        let (q, k, v) = (in_chunks(q)?, in_chunks(k)?, in_chunks(v)?);
        let scalars =
            |a: &Array| -> Result<Array> { Ok(in_chunks(&a.expand_dims(&[-1])?)?.squeeze(&[-1])?) };
        let (g, beta) = (scalars(g)?, scalars(beta)?); // [B, H, c, Q]
        let beta_col = beta.expand_dims(&[-1])?;
        let k_beta = k.multiply(&beta_col)?;
        let v_beta = v.multiply(&beta_col)?;
        let cum = g.cumsum(-1, false, true)?;
        let idx = ops::arange(0.0, q_len as f64, 1.0, Dtype::Int32)?;
        let (row, col) = (idx.reshape(&[q_len, 1])?, idx.reshape(&[1, q_len])?);
        // decay[i, j] = e^{G_i − G_j} for j ≤ i, else 0.
        let diff = cum.expand_dims(&[-1])?.subtract(&cum.expand_dims(&[-2])?)?;
        let decay = ops::where_(
            &row.greater_equal(&col)?,
            &diff,
            &diff.scalar_like(f64::NEG_INFINITY)?,
        )?
        .exp()?;
        let k_t = k.transpose(&[0, 1, 2, 4, 3])?;
        let kkt = k_beta.matmul(&k_t)?.multiply(&decay)?;
        let strictly_lower = ops::where_(&row.greater(&col)?, &kkt, &kkt.scalar_like(0.0)?)?;
        let t = unit_lower_inverse(&strictly_lower, q_len)?;
        let growth = cum.exp()?.expand_dims(&[-1])?; // e^{G_i}
        let values = t.matmul(&v_beta)?;
        let keys_decayed = t.matmul(&k_beta.multiply(&growth)?)?;
        let attn = q.matmul(&k_t)?.multiply(&decay)?;
        let q_decayed = q.multiply(&growth)?;
        let last = cum.slice_axis(-1, q_len - 1, q_len)?; // [B, H, c, 1]
        let k_to_end = k.multiply(&last.subtract(&cum)?.exp()?.expand_dims(&[-1])?)?;
        let chunk_decay = last.exp()?.expand_dims(&[-1])?; // [B, H, c, 1, 1]
        let at =
            |a: &Array, i: i32| -> Result<Array> { Ok(a.slice_axis(2, i, i + 1)?.squeeze(&[2])?) };
        let mut s = s0.clone();
        let mut outs = Vec::with_capacity(chunks as usize);
        for i in 0..chunks {
            let v_new = at(&values, i)?.subtract(&at(&keys_decayed, i)?.matmul(&s)?)?;
            outs.push(
                at(&q_decayed, i)?
                    .matmul(&s)?
                    .add(&at(&attn, i)?.matmul(&v_new)?)?,
            );
            let k_i = at(&k_to_end, i)?.transpose(&[0, 1, 3, 2])?;
            s = s
                .multiply(&at(&chunk_decay, i)?)?
                .add(&k_i.matmul(&v_new)?)?;
        }
        let y = ops::concatenate(&outs, 2)? // [B, H, c·Q, Dv]
            .slice_axis(2, 0, l)?
            .transpose(&[0, 2, 1, 3])?;
        Ok((y, s))
    }

    /// `q`, `k`, `v`, `z` `[B, L, ·]` and `b`, `a` `[B, L, value_heads]` from the input.
    fn project(&self, x: &Array, input: LinearInput) -> Result<[Array; 6]> {
        let d = &self.dims;
        let (bsz, l) = (x.dim(0)?, x.dim(1)?);
        let r = d.ratio();
        Ok(match &self.proj {
            DeltaProjections::PerKeyHead { qkvz, ba } => {
                let kd = d.key_dim;
                let qkvz = qkvz.forward_fused(x, input, None)?.reshape(&[
                    bsz,
                    l,
                    d.key_heads,
                    2 * kd + 2 * r * d.value_dim,
                ])?;
                let p = qkvz.split_at(&[kd, 2 * kd, 2 * kd + r * d.value_dim], -1)?;
                let ba =
                    ba.forward_fused(x, input, None)?
                        .reshape(&[bsz, l, d.key_heads, 2 * r])?;
                let s = ba.split_at(&[r], -1)?;
                let flat = |a: &Array, w: i32| a.reshape(&[bsz, l, w]);
                [
                    flat(&p[0], d.key_width())?,
                    flat(&p[1], d.key_width())?,
                    flat(&p[2], d.value_width())?,
                    flat(&p[3], d.value_width())?,
                    flat(&s[0], d.value_heads)?,
                    flat(&s[1], d.value_heads)?,
                ]
            }
            DeltaProjections::Separate { qkv, z, b, a } => {
                let qkv = qkv.forward_fused(x, input, None)?;
                let p = qkv.split_at(&[d.key_width(), 2 * d.key_width()], -1)?;
                [
                    p[0].clone(),
                    p[1].clone(),
                    p[2].clone(),
                    z.forward_fused(x, input, None)?,
                    b.forward_fused(x, input, None)?,
                    a.forward_fused(x, input, None)?,
                ]
            }
        })
    }

    /// `residual + out_proj(mixer(norm(x)))` for `x` `[B, L, hidden]`, continuing from and
    /// updating the layer's state cache.
    pub fn forward(
        &self,
        x: &Array,
        norm: Option<&Norm>,
        residual: Option<&Array>,
        cache: &mut LayerCache,
    ) -> Result<Array> {
        let (window, state) = read_state(cache)?;
        let d = &self.dims;
        let dtype = x.dtype()?;
        let (bsz, l) = (x.dim(0)?, x.dim(1)?);
        // The norm is applied once here rather than folded into each of the projections.
        let normed = match norm {
            Some(n) => n.forward(x)?,
            None => x.clone(),
        };
        let [q, k, v, z, b, a] = self.project(&normed, LinearInput::Plain)?;
        let mixed = ops::concatenate(&[q, k, v], -1)?;
        let (mixed, window) = self.conv.forward(&mixed, window.as_ref())?;
        let p = mixed.split_at(&[d.key_width(), 2 * d.key_width()], -1)?;
        let f32 = |a: &Array| a.astype(Dtype::Float32);
        let heads =
            |a: &Array, n: i32, w: i32| -> Result<Array> { Ok(f32(a)?.reshape(&[bsz, l, n, w])?) };
        let scale = 1.0 / (d.key_dim as f64).sqrt();
        let q = l2_normalize(&heads(&p[0], d.key_heads, d.key_dim)?)?.mul_scalar(scale)?;
        let k = l2_normalize(&heads(&p[1], d.key_heads, d.key_dim)?)?;
        let (q, k) = (repeat_heads(&q, d.ratio())?, repeat_heads(&k, d.ratio())?);
        let v = heads(&p[2], d.value_heads, d.value_dim)?;
        let beta = f32(&b)?.sigmoid()?;
        // The per-step log decay g = -exp(A_log) · softplus(a + dt_bias) ≤ 0.
        let g = softplus(&f32(&a)?.add(&self.dt_bias)?)?.multiply(&self.a)?;
        let s0 = match state {
            Some(s) => s,
            None => ops::zeros(
                &[bsz, d.value_heads, d.key_dim, d.value_dim],
                Dtype::Float32,
            )?,
        };
        let (y, s) = if l == 1 {
            Self::step(&q, &k, &v, &g, &beta, &s0)?
        } else {
            Self::chunked(&q, &k, &v, &g, &beta, &s0)?
        };
        // Gated RMSNorm over each value head: w · norm(y) · silu(z).
        let z = heads(&z, d.value_heads, d.value_dim)?;
        let out = y
            .rms_norm(None, self.norm_eps)?
            .astype(dtype)?
            .multiply(&self.norm_weight)?
            .astype(Dtype::Float32)?
            .multiply(&silu(&z)?)?
            .astype(dtype)?
            .reshape(&[bsz, l, d.value_width()])?;
        write_state(cache, window, s, l as usize);
        self.out_proj
            .forward_fused(&out, LinearInput::Plain, residual)
    }
}
