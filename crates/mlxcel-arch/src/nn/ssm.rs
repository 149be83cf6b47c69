//! State-space token mixers: Mamba's selective scan (Mamba-1, Falcon-Mamba, Jamba's Mamba layers)
//! and Mamba-2's state-space duality (SSD) scan, with the causal depthwise convolution in front of
//! both.
//!
//! A state-space layer keeps no keys and values: its [`LayerCache::State`] holds the last
//! `kernel - 1` inputs of the convolution (the *window*) and the scan's recurrent state, both of
//! fixed size. On the CPU with mlxcel's kernels on, both scans run as one call of the CPU
//! recurrence kernel (`ops::selective_scan`: position after position, rows over the thread
//! pool), prefill and decode alike; on a GPU as one call of its CUDA twin (`MLXCEL_CUDA_SCAN`).
//! Otherwise (`MLXCEL_CPU_KERNELS=0`, `MLXCEL_CUDA_SCAN=0`) prefill runs the scan as a graph of
//! whole-chunk MLX ops — Mamba-1 as a Hillis-Steele scan over blocks of [`SCAN_BLOCK`]
//! positions, Mamba-2 as the chunked SSD (quadratic within a chunk, a recurrence over chunk
//! states between them) — and a decode step runs the one-token recurrence. Either way the
//! layer starts from, and leaves, the state in the cache, so any split of a prompt into prefill
//! chunks gives the same state as one pass.
//!
//! The scans run in float32 whatever the compute dtype (decay products of many steps lose
//! everything in half precision); the state is kept in float32.

use mlxcel_core::{ops, Array, Dtype};

use super::{Linear, LinearInput, Norm};
use crate::cache::LayerCache;
use crate::{ModelError, Result};

/// Positions per block of Mamba-1's parallel scan: the scan's transient arrays are
/// `[B, block, inner, state]`, so this bounds prefill memory whatever the chunk.
pub const SCAN_BLOCK: i32 = 64;

/// `x * sigmoid(x)`.
pub(crate) fn silu(x: &Array) -> Result<Array> {
    Ok(x.multiply(&x.sigmoid()?)?)
}

/// `log(1 + e^x)`, computed as `max(x, 0) + log1p(e^-|x|)` so large inputs do not overflow.
pub(crate) fn softplus(x: &Array) -> Result<Array> {
    let zero = x.scalar_like(0.0)?;
    Ok(x.maximum(&zero)?
        .add(&x.abs()?.negative()?.exp()?.log1p()?)?)
}

/// `a` with axes `i` and `j` (negative: from the end) exchanged.
fn swap_axes(a: &Array, i: i32, j: i32) -> Result<Array> {
    let n = a.ndim() as i32;
    let (i, j) = (i.rem_euclid(n), j.rem_euclid(n));
    let mut perm: Vec<i32> = (0..n).collect();
    perm.swap(i as usize, j as usize);
    Ok(a.transpose(&perm)?)
}

/// The state arrays of a state-space layer's cache: `(window, state)`, `None` before the first
/// token.
pub(crate) fn read_state(cache: &LayerCache) -> Result<(Option<Array>, Option<Array>)> {
    match cache {
        LayerCache::State(s) => Ok((
            s.arrays.first().cloned().flatten(),
            s.arrays.get(1).cloned().flatten(),
        )),
        other => Err(ModelError::Runtime(format!(
            "a state-space layer was given a cache at position {} that is not a state cache (caches must come from the model's make_caches)",
            other.offset()
        ))),
    }
}

/// Stores the new window and state and moves the cache `positions` on.
pub(crate) fn write_state(cache: &mut LayerCache, window: Array, state: Array, positions: usize) {
    if let LayerCache::State(s) = cache {
        s.arrays = vec![Some(window), Some(state)];
        s.advance(positions);
    }
}

/// A causal depthwise 1-D convolution over the sequence, followed by SiLU, that continues from
/// the previous call's last `kernel - 1` inputs.
#[derive(Debug, Clone)]
pub struct CausalConv {
    /// `[kernel, channels]`: tap `k` multiplies the input `kernel - 1 - k` positions back.
    pub weight: Array,
    /// `[channels]`.
    pub bias: Option<Array>,
}

impl CausalConv {
    fn kernel(&self) -> Result<i32> {
        Ok(self.weight.dim(0)?)
    }

    /// `x` `[B, L, C]` and the previous window `[B, kernel - 1, C]` (zeros when `None`) →
    /// `silu(conv(x))` `[B, L, C]` and the new window.
    pub fn forward(&self, x: &Array, window: Option<&Array>) -> Result<(Array, Array)> {
        let (y, window) = self.convolve(x, window)?;
        Ok((silu(&y)?, window))
    }

    /// [`CausalConv::forward`] without the SiLU (Griffin's recurrent block).
    pub fn convolve(&self, x: &Array, window: Option<&Array>) -> Result<(Array, Array)> {
        let k = self.kernel()?;
        let (b, l, c) = (x.dim(0)?, x.dim(1)?, x.dim(2)?);
        let window = match window {
            Some(w) => w.astype(x.dtype()?)?,
            None => ops::zeros(&[b, k - 1, c], x.dtype()?)?,
        };
        let padded = ops::concatenate(&[window, x.clone()], 1)?;
        let mut y = if l == 1 {
            // One position (decode): the window and the weight line up tap for tap.
            padded.multiply(&self.weight)?.sum(&[1], true)?
        } else {
            let mut y = padded
                .slice_axis(1, 0, l)?
                .multiply(&self.weight.slice_axis(0, 0, 1)?)?;
            for tap in 1..k {
                let w = self.weight.slice_axis(0, tap, tap + 1)?;
                y = padded.slice_axis(1, tap, tap + l)?.multiply(&w)?.add(&y)?;
            }
            y
        };
        if let Some(bias) = &self.bias {
            y = y.add(bias)?;
        }
        let new_window = padded.slice_axis(1, l, l + k - 1)?;
        Ok((y, new_window))
    }
}

/// An RMS normalisation with an optional weight (Falcon-Mamba's weightless norms of B, C and
/// the time step; Jamba's weighted ones).
#[derive(Debug, Clone)]
pub struct PlainRms {
    /// `[dim]`, or `None` for a weightless norm.
    pub weight: Option<Array>,
    /// The norm's epsilon.
    pub eps: f32,
}

impl PlainRms {
    fn forward(&self, x: &Array) -> Result<Array> {
        Ok(x.rms_norm(self.weight.as_ref(), self.eps)?)
    }
}

/// RMS norms applied to the time-step rank input, `B` and `C` before the scan (Falcon-Mamba,
/// Jamba).
#[derive(Debug, Clone)]
pub struct BcdtNorms {
    /// Over the `dt_rank` features.
    pub dt: PlainRms,
    /// Over `B`'s `state` features.
    pub b: PlainRms,
    /// Over `C`'s `state` features.
    pub c: PlainRms,
}

/// Widths of a Mamba-1 mixer.
#[derive(Debug, Clone, Copy)]
pub struct MambaDims {
    /// Inner width (`expand * hidden`).
    pub inner: i32,
    /// State features per channel (`state_size`, `d_state`).
    pub state: i32,
    /// Rank of the time-step projection (`time_step_rank`, `dt_rank`).
    pub dt_rank: i32,
}

/// Mamba-1's selective state-space mixer.
#[derive(Debug)]
pub struct MambaMixer {
    /// hidden → `[x | z]`, 2 × inner.
    pub in_proj: Linear,
    /// Over `x`.
    pub conv: CausalConv,
    /// inner → `[dt | B | C]`.
    pub x_proj: Linear,
    /// `dt_rank` → inner, with bias.
    pub dt_proj: Linear,
    /// `-exp(A_log)`, `[inner, state]`, float32.
    pub a: Array,
    /// The skip connection `[inner]`, float32.
    pub d: Array,
    /// inner → hidden.
    pub out_proj: Linear,
    /// Norms of dt, B, C (Falcon-Mamba, Jamba), if any.
    pub bcdt_norms: Option<BcdtNorms>,
    /// Widths.
    pub dims: MambaDims,
}

/// `h_t = a_t ⊙ h_{t-1} + b_t` for every `t` of a block, `a`, `b` `[B, T, ...]`, from `h0`
/// `[B, ...]`: a Hillis-Steele scan (log2 T steps of whole-block ops; every product is of decays
/// ≤ 1, so nothing overflows). Returns all `h_t`.
pub(crate) fn linear_recurrence(a: &Array, b: &Array, h0: &Array) -> Result<Array> {
    let t = a.dim(1)?;
    let (mut a, mut b) = (a.clone(), b.clone());
    let mut step = 1;
    while step < t {
        let a_prev = a.slice_axis(1, 0, t - step)?;
        let b_prev = b.slice_axis(1, 0, t - step)?;
        let a_cur = a.slice_axis(1, step, t)?;
        let b_cur = b.slice_axis(1, step, t)?;
        b = ops::concatenate(
            &[
                b.slice_axis(1, 0, step)?,
                a_cur.multiply(&b_prev)?.add(&b_cur)?,
            ],
            1,
        )?;
        a = ops::concatenate(&[a.slice_axis(1, 0, step)?, a_cur.multiply(&a_prev)?], 1)?;
        step *= 2;
    }
    // `a` now holds the decay from the block start, `b` the states from a zero start.
    Ok(b.add(&a.multiply(&h0.expand_dims(&[1])?)?)?)
}

impl MambaMixer {
    /// The selective scan of `x`, `dt` `[B, L, inner]`, `bm`, `cm` `[B, L, state]` (all
    /// float32) from `h0` `[B, inner, state]`: `y` `[B, L, inner]` (without the skip term)
    /// and the last state.
    fn scan(
        &self,
        x: &Array,
        dt: &Array,
        bm: &Array,
        cm: &Array,
        h0: Array,
    ) -> Result<(Array, Array)> {
        // mlxcel's CPU or CUDA kernel runs the recurrence directly: each channel a head of one.
        if let Some((y, h)) = ops::selective_scan(
            &x.expand_dims(&[-1])?,
            dt,
            &self.a,
            &bm.expand_dims(&[2])?,
            &cm.expand_dims(&[2])?,
            &h0.expand_dims(&[2])?,
            false,
        )? {
            return Ok((y.squeeze(&[-1])?, h.squeeze(&[2])?));
        }
        let l = x.dim(1)?;
        let mut h = h0;
        let mut ys = Vec::new();
        let mut start = 0;
        while start < l {
            let end = (start + SCAN_BLOCK).min(l);
            let part = |a: &Array| a.slice_axis(1, start, end);
            let (x, dt, bm, cm) = (part(x)?, part(dt)?, part(bm)?, part(cm)?);
            // [B, T, inner, state]
            let decay = dt.expand_dims(&[-1])?.multiply(&self.a)?.exp()?;
            let input = dt
                .multiply(&x)?
                .expand_dims(&[-1])?
                .multiply(&bm.expand_dims(&[2])?)?;
            let states = if end - start == 1 {
                decay.multiply(&h.expand_dims(&[1])?)?.add(&input)?
            } else {
                linear_recurrence(&decay, &input, &h)?
            };
            // y_t = h_t · C_t: [B, T, inner, state] @ [B, T, state, 1].
            let y = states.matmul(&cm.expand_dims(&[-1])?)?.squeeze(&[-1])?;
            h = states
                .slice_axis(1, end - start - 1, end - start)?
                .squeeze(&[1])?;
            ys.push(y);
            start = end;
        }
        let y = if ys.len() == 1 {
            ys.pop().expect("one block")
        } else {
            ops::concatenate(&ys, 1)?
        };
        Ok((y, h))
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
        let dtype = x.dtype()?;
        let (b, l) = (x.dim(0)?, x.dim(1)?);
        let d = &self.dims;
        let input = norm.map_or(LinearInput::Plain, LinearInput::Normed);
        let xz = self.in_proj.forward_fused(x, input, None)?;
        let parts = xz.split_at(&[d.inner], -1)?;
        let (xs, z) = (&parts[0], &parts[1]);
        let (xs, window) = self.conv.forward(xs, window.as_ref())?;
        let dbc = self.x_proj.forward(&xs)?;
        let parts = dbc.split_at(&[d.dt_rank, d.dt_rank + d.state], -1)?;
        let (mut dt, mut bm, mut cm) = (parts[0].clone(), parts[1].clone(), parts[2].clone());
        if let Some(n) = &self.bcdt_norms {
            dt = n.dt.forward(&dt)?;
            bm = n.b.forward(&bm)?;
            cm = n.c.forward(&cm)?;
        }
        let f32 = |a: &Array| a.astype(Dtype::Float32);
        let dt = softplus(&f32(&self.dt_proj.forward(&dt)?)?)?;
        let xf = f32(&xs)?;
        let h0 = match state {
            Some(s) => s,
            None => ops::zeros(&[b, d.inner, d.state], Dtype::Float32)?,
        };
        let (y, h) = self.scan(&xf, &dt, &f32(&bm)?, &f32(&cm)?, h0)?;
        let y = y.add(&xf.multiply(&self.d)?)?.astype(dtype)?;
        let y = y.multiply(&silu(z)?)?;
        write_state(cache, window, h, l as usize);
        self.out_proj
            .forward_fused(&y, LinearInput::Plain, residual)
    }
}

/// Widths of a Mamba-2 mixer.
#[derive(Debug, Clone, Copy)]
pub struct Mamba2Dims {
    /// Inner width (`expand * hidden` = heads × head_dim).
    pub inner: i32,
    /// Heads (`num_heads`).
    pub heads: i32,
    /// Channels per head (`head_dim`).
    pub head_dim: i32,
    /// Groups sharing one `B` and `C` (`n_groups`).
    pub groups: i32,
    /// State features (`state_size`).
    pub state: i32,
    /// Positions per SSD chunk during prefill (`chunk_size`).
    pub chunk: i32,
}

impl Mamba2Dims {
    /// The convolved width: `x`, `B` and `C` side by side.
    pub fn conv_dim(&self) -> i32 {
        self.inner + 2 * self.groups * self.state
    }
}

/// Where Mamba-2's output gate `silu(z)` sits relative to its grouped RMSNorm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatedNorm {
    /// `norm(y · silu(z))` (Mamba-2, Bamba, Nemotron-H; Falcon-H1's default).
    GateThenNorm,
    /// `norm(y) · silu(z)` (Falcon-H1's `mamba_norm_before_gate`).
    NormThenGate,
    /// `y · silu(z)`, no norm (Falcon-H1 without `mamba_rms_norm`).
    GateOnly,
}

/// Mamba-2's mixer: multi-head SSD with grouped `B`/`C` and a gated RMSNorm.
#[derive(Debug)]
pub struct Mamba2Mixer {
    /// hidden → `[z | x B C | dt]`.
    pub in_proj: Linear,
    /// Over `x B C`.
    pub conv: CausalConv,
    /// `[heads]`, added to dt before the softplus.
    pub dt_bias: Array,
    /// `-exp(A_log)`, `[heads]`, float32.
    pub a: Array,
    /// The skip connection `[heads]`, float32.
    pub d: Array,
    /// The gated RMSNorm's weight `[inner]`, over groups of `inner / groups` features (`None`
    /// for [`GatedNorm::GateOnly`]).
    pub norm_weight: Option<Array>,
    /// Where the gate sits.
    pub gated_norm: GatedNorm,
    /// The gated RMSNorm's epsilon.
    pub norm_eps: f32,
    /// inner → hidden.
    pub out_proj: Linear,
    /// The time-step clamp (`time_step_limit`), when finite.
    pub dt_limit: (f64, f64),
    /// Widths.
    pub dims: Mamba2Dims,
}

/// `segsum(x)[.., i, j] = x[j+1] + … + x[i]` for `j ≤ i`, `-inf` above the diagonal, over the
/// last axis of `x` `[.., T]` (summed directly rather than as a difference of cumulative sums,
/// as transformers does, for accuracy).
fn segment_sum(x: &Array) -> Result<Array> {
    let t = x.dim(-1)?;
    let mut shape = x.shape();
    shape.push(t);
    // [.., i, j] = x[i]
    let rows = x.expand_dims(&[-1])?.broadcast_to(&shape)?;
    let idx = ops::arange(0.0, t as f64, 1.0, Dtype::Int32)?;
    let i = idx.reshape(&[t, 1])?;
    let j = idx.reshape(&[1, t])?;
    let below = i.greater(&j)?;
    let sums = ops::where_(&below, &rows, &rows.scalar_like(0.0)?)?.cumsum(-2, false, true)?;
    Ok(ops::where_(
        &i.greater_equal(&j)?,
        &sums,
        &sums.scalar_like(f64::NEG_INFINITY)?,
    )?)
}

/// Positions per SSD chunk on the CPU path at most: the result does not depend on the chunk,
/// the in-chunk work grows with it (`L · Q` per head) and the chunk-to-chunk recurrence with
/// `(L / Q)²`, tiny either way; checkpoints' `chunk_size` (256) is tuned for GPU kernels.
const SSD_CHUNK_MAX: i32 = 64;

impl Mamba2Mixer {
    /// The chunked SSD scan of `x` `[B, L, H, P]`, `dt` `[B, L, H]` (softplus'd), `bm`, `cm`
    /// `[B, L, G, N]` (float32, one per group of `R = H / G` heads) from `h0` `[B, H, P, N]`:
    /// `y` `[B, L, H, P]` (without the skip term) and the last state. `C·Bᵀ` is computed once
    /// per group, not per head.
    fn ssd(
        &self,
        x: &Array,
        dt: &Array,
        bm: &Array,
        cm: &Array,
        h0: &Array,
    ) -> Result<(Array, Array)> {
        let d = &self.dims;
        let (b, l) = (x.dim(0)?, x.dim(1)?);
        let (h, p, n, g) = (d.heads, d.head_dim, d.state, d.groups);
        let r = h / g;
        let q = d.chunk.min(SSD_CHUNK_MAX).min(l).max(1);
        let pad = (q - l % q) % q;
        let chunks = (l + pad) / q;
        let padded = |a: &Array| -> Result<Array> {
            if pad == 0 {
                return Ok(a.clone());
            }
            let mut s = a.shape();
            s[1] = pad;
            Ok(ops::concatenate(
                &[a.clone(), ops::zeros(&s, a.dtype()?)?],
                1,
            )?)
        };
        let xdt = x.multiply(&dt.expand_dims(&[-1])?)?;
        let adt = dt.multiply(&self.a)?;
        // [B, c, G, Q, N] and [B, c, G, R, Q, P]
        let in_chunks = |a: &Array, heads: i32, width: i32| -> Result<Array> {
            Ok(padded(a)?
                .reshape(&[b, chunks, q, heads, width])?
                .transpose(&[0, 1, 3, 2, 4])?)
        };
        let b_g = in_chunks(bm, g, n)?;
        let c_g = in_chunks(cm, g, n)?;
        let x_h = in_chunks(&xdt, h, p)?.reshape(&[b, chunks, g, r, q, p])?;
        // [B, H, c, Q]
        let adt = padded(&adt)?
            .reshape(&[b, chunks, q, h])?
            .transpose(&[0, 3, 1, 2])?;
        let a_cum = adt.cumsum(-1, false, true)?;
        // Per head and chunk, [B, c, G, R, ·] views of [B, H, c, ·].
        let by_head = |a: &Array| -> Result<Array> {
            let mut shape = vec![b, chunks, g, r];
            shape.extend_from_slice(&a.shape()[3..]);
            Ok(swap_axes(a, 1, 2)?.reshape(&shape)?)
        };
        // Within each chunk: y_diag[l] = Σ_{s≤l} (C_l·B_s) e^{Σ_{s<k≤l} A dt_k} x_s dt_s.
        let decay = by_head(&segment_sum(&adt)?.exp()?)?; // [B, c, G, R, Q(l), Q(s)]
        let cb = c_g.matmul(&swap_axes(&b_g, -1, -2)?)?.expand_dims(&[3])?; // [B, c, G, 1, Q, Q]
        let y_diag = cb.multiply(&decay)?.matmul(&x_h)?; // [B, c, G, R, Q, P]
                                                         // Each chunk's state from its own inputs: Σ_s e^{A_cum[last] - A_cum[s]} x_s B_s^T.
        let last = a_cum.slice_axis(-1, q - 1, q)?;
        let to_end = by_head(&last.subtract(&a_cum)?.exp()?)?.expand_dims(&[-1])?; // [B, c, G, R, Q, 1]
        let b_decayed = b_g.expand_dims(&[3])?.multiply(&to_end)?; // [B, c, G, R, Q, N]
        let states = swap_axes(&x_h, -1, -2)?
            .matmul(&b_decayed)?
            .reshape(&[b, chunks, h, p, n])?;
        // Between chunks: the state entering chunk i is Σ_{j≤i} e^{Σ A over chunks j..i-1} s_j,
        // with s_0 the initial state.
        let states = ops::concatenate(&[h0.expand_dims(&[1])?, states], 1)?; // [B, c+1, H, P, N]
        let chunk_totals = ops::concatenate(
            &[
                ops::zeros(&[b, h, 1], Dtype::Float32)?,
                last.squeeze(&[-1])?,
            ],
            -1,
        )?; // [B, H, c+1]
        let carry = segment_sum(&chunk_totals)?.exp()?; // [B, H, c+1(i), c+1(j)]
        let flat = states
            .transpose(&[0, 2, 1, 3, 4])?
            .reshape(&[b, h, chunks + 1, p * n])?;
        let entering = carry
            .matmul(&flat)?
            .reshape(&[b, h, chunks + 1, p, n])?
            .transpose(&[0, 2, 1, 3, 4])?; // [B, c+1, H, P, N]
        let final_state = entering.slice_axis(1, chunks, chunks + 1)?.squeeze(&[1])?;
        // Contribution of the entering state: C_l · state, decayed by e^{A_cum[l]}, with one
        // product per group over its heads' channels.
        let entering = entering
            .slice_axis(1, 0, chunks)?
            .reshape(&[b, chunks, g, r * p, n])?;
        let from_start = by_head(&a_cum.exp()?)?.expand_dims(&[-1])?; // [B, c, G, R, Q, 1]
        let y_off = c_g
            .matmul(&swap_axes(&entering, -1, -2)?)? // [B, c, G, Q, R·P]
            .reshape(&[b, chunks, g, q, r, p])?
            .transpose(&[0, 1, 2, 4, 3, 5])?
            .multiply(&from_start)?; // [B, c, G, R, Q, P]
        let y = y_diag
            .add(&y_off)?
            .reshape(&[b, chunks, h, q, p])?
            .transpose(&[0, 1, 3, 2, 4])?
            .reshape(&[b, chunks * q, h, p])?
            .slice_axis(1, 0, l)?;
        Ok((y, final_state))
    }

    /// One decode step of the recurrence: `x` `[B, 1, H, P]`, `dt` `[B, 1, H]`, `bm`, `cm`
    /// `[B, 1, G, N]` from `h0` `[B, H, P, N]`, computed per group of heads.
    fn step(
        &self,
        x: &Array,
        dt: &Array,
        bm: &Array,
        cm: &Array,
        h0: &Array,
    ) -> Result<(Array, Array)> {
        let d = &self.dims;
        let b = x.dim(0)?;
        let (h, p, n, g) = (d.heads, d.head_dim, d.state, d.groups);
        let r = h / g;
        let dt = dt.reshape(&[b, g, r, 1, 1])?;
        let decay = dt.multiply(&self.a.reshape(&[g, r, 1, 1])?)?.exp()?; // [B, G, R, 1, 1]
        let input = x
            .reshape(&[b, g, r, p, 1])?
            .multiply(&dt)?
            .multiply(&bm.reshape(&[b, g, 1, 1, n])?)?; // [B, G, R, P, N]
        let state = h0
            .reshape(&[b, g, r, p, n])?
            .multiply(&decay)?
            .add(&input)?;
        let y = state.matmul(&cm.reshape(&[b, g, 1, n, 1])?)?; // [B, G, R, P, 1]
        Ok((y.reshape(&[b, 1, h, p])?, state.reshape(&[b, h, p, n])?))
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
        let dtype = x.dtype()?;
        let (b, l) = (x.dim(0)?, x.dim(1)?);
        let d = &self.dims;
        let input = norm.map_or(LinearInput::Plain, LinearInput::Normed);
        let proj = self.in_proj.forward_fused(x, input, None)?;
        let parts = proj.split_at(&[d.inner, d.inner + d.conv_dim()], -1)?;
        let (z, xbc, dt) = (&parts[0], &parts[1], &parts[2]);
        let (xbc, window) = self.conv.forward(xbc, window.as_ref())?;
        let gn = d.groups * d.state;
        let parts = xbc.split_at(&[d.inner, d.inner + gn], -1)?;
        let f32 = |a: &Array| a.astype(Dtype::Float32);
        let xs = f32(&parts[0])?.reshape(&[b, l, d.heads, d.head_dim])?;
        let bm = f32(&parts[1])?.reshape(&[b, l, d.groups, d.state])?;
        let cm = f32(&parts[2])?.reshape(&[b, l, d.groups, d.state])?;
        let mut dt = softplus(&f32(dt)?.add(&self.dt_bias)?)?;
        let (lo, hi) = self.dt_limit;
        // dt is a softplus (≥ 0): a lower limit ≤ 0 never binds, nor does an upper one of 1e30
        // (configs' stand-in for transformers' default `inf`, which JSON cannot hold).
        if lo > 0.0 || hi < 1e30 {
            let lo = Array::scalar(lo, Dtype::Float32)?;
            let hi = Array::scalar(hi.min(f32::MAX as f64), Dtype::Float32)?;
            dt = dt.clip(Some(&lo), Some(&hi))?;
        }
        let h0 = match state {
            Some(s) => s,
            None => ops::zeros(&[b, d.heads, d.head_dim, d.state], Dtype::Float32)?,
        };
        // mlxcel's CPU or CUDA kernel runs the recurrence directly (prefill and decode alike).
        let a = self
            .a
            .reshape(&[d.heads, 1])?
            .broadcast_to(&[d.heads, d.state])?;
        let (y, h) = match ops::selective_scan(&xs, &dt, &a, &bm, &cm, &h0, true)? {
            Some(scanned) => scanned,
            None if l == 1 => self.step(&xs, &dt, &bm, &cm, &h0)?,
            None => self.ssd(&xs, &dt, &bm, &cm, &h0)?,
        };
        let y = y
            .add(&xs.multiply(&self.d.expand_dims(&[-1])?)?)?
            .reshape(&[b, l, d.inner])?;
        // Gated RMSNorm over each group's features (float32, the weight applied in the compute
        // dtype after the norm as transformers' Mamba-2 does, in float32 before the gate as its
        // Falcon-H1 does).
        let gate = silu(&f32(z)?)?;
        let group_norm = |a: &Array| -> Result<Array> {
            Ok(a.reshape(&[b, l, d.groups, d.inner / d.groups])?
                .rms_norm(None, self.norm_eps)?
                .reshape(&[b, l, d.inner])?)
        };
        let weight = |a: Array| -> Result<Array> {
            Ok(match &self.norm_weight {
                Some(w) => a.multiply(w)?,
                None => a,
            })
        };
        let normed = match self.gated_norm {
            GatedNorm::GateThenNorm => weight(group_norm(&y.multiply(&gate)?)?.astype(dtype)?)?,
            GatedNorm::NormThenGate => weight(group_norm(&y)?)?.multiply(&gate)?.astype(dtype)?,
            GatedNorm::GateOnly => y.multiply(&gate)?.astype(dtype)?,
        };
        write_state(cache, window, h, l as usize);
        self.out_proj
            .forward_fused(&normed, LinearInput::Plain, residual)
    }
}
