//! Multi-head attention with grouped-query heads, as most decoder architectures use it; the
//! variations (fused qkv, per-head or full-width qk-norm, soft-capping, sliding windows, partial
//! rotary) are configuration, not copies.

use mlxcel_core::ops::{self, AttentionMask};
use mlxcel_core::Array;

use super::{Linear, LinearInput, Norm, RotaryEmbedding};
use crate::cache::{LayerCache, Mask};
use crate::Result;

/// How queries, keys and values are projected.
#[derive(Debug, Clone)]
pub enum QkvProjection {
    /// `q_proj`, `k_proj`, `v_proj` as separate layers.
    Separate {
        /// hidden → `n_heads * head_dim`.
        q: Linear,
        /// hidden → `n_kv_heads * head_dim`.
        k: Linear,
        /// hidden → `n_kv_heads * head_dim`.
        v: Linear,
    },
    /// One `qkv_proj` whose output is `[q | k | v]`.
    Fused(Linear),
}

/// Normalisation of queries and keys (before rope, except [`QkNorm::PerHeadAfterRope`]).
#[derive(Debug, Clone)]
pub enum QkNorm {
    /// No query/key normalisation.
    None,
    /// Over each head's `head_dim` features (qwen3, gemma3).
    PerHead {
        /// Query norm.
        q: Norm,
        /// Key norm.
        k: Norm,
    },
    /// Over each head's `head_dim` features with a weight per head (`[heads, head_dim]`,
    /// Cohere's `use_qk_norm`).
    PerHeadWeights {
        /// Query norm.
        q: Norm,
        /// Key norm.
        k: Norm,
    },
    /// Over the whole projection, before splitting heads (olmoe).
    Full {
        /// Query norm.
        q: Norm,
        /// Key norm.
        k: Norm,
    },
    /// [`QkNorm::Full`] on a tensor-parallel rank, which holds only some heads of the
    /// projection: the sum of squares is completed over the ranks first.
    FullSharded {
        /// Query norm.
        q: ShardedRms,
        /// Key norm.
        k: ShardedRms,
    },
    /// Over each head's `head_dim` features like [`QkNorm::PerHead`], but of the rotated
    /// queries and keys (Hunyuan's `query_layernorm`/`key_layernorm`): the norm's weight is
    /// per feature, so it does not commute with rope.
    PerHeadAfterRope {
        /// Query norm.
        q: Norm,
        /// Key norm.
        k: Norm,
    },
}

/// An RMSNorm over features spread across the ranks of a tensor-parallel group: each rank holds
/// a slice of the features and its slice of the weight; the mean square is taken over all of
/// them (one `all_sum` of the per-rank sums of squares).
#[derive(Debug, Clone)]
pub struct ShardedRms {
    /// This rank's slice of the weight (Gemma's `1 + w` already folded in).
    pub weight: Array,
    /// Added to the mean square.
    pub eps: f32,
    /// The number of features over all ranks.
    pub width: i32,
    /// The ranks holding the other features.
    pub group: mlxcel_core::distributed::Group,
}

impl ShardedRms {
    /// `x / sqrt(mean(x²) + eps) · weight` over the last axis, the mean over every rank's
    /// features; computed in float32 and returned in `x`'s dtype.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let dtype = x.dtype()?;
        let x32 = x.astype(mlxcel_core::Dtype::Float32)?;
        let squares = x32.square()?.sum(&[-1], true)?;
        let mean = self
            .group
            .all_sum(&squares)?
            .mul_scalar(1.0 / self.width as f64)?;
        let scale = mean.add_scalar(self.eps as f64)?.rsqrt()?;
        Ok(x32
            .multiply(&scale)?
            .astype(dtype)?
            .multiply(&self.weight)?)
    }
}

/// Shape and behaviour of one attention layer.
#[derive(Debug, Clone)]
pub struct AttentionConfig {
    /// Query heads (`num_attention_heads`).
    pub n_heads: i32,
    /// Key/value heads (`num_key_value_heads`); divides `n_heads` (grouped-query attention).
    pub n_kv_heads: i32,
    /// Width of one head (`head_dim`, else `hidden_size / num_attention_heads`).
    pub head_dim: i32,
    /// Multiplies `q k^T`.
    pub scale: f32,
    /// `tanh(s / cap) * cap` on the scores (gemma2).
    pub softcap: Option<f32>,
    /// Sliding window in keys per query (including itself), `None` for global attention.
    pub window: Option<usize>,
    /// Multiplies the queries by a factor growing with the absolute position, if any.
    pub query_scale: Option<PositionScale>,
    /// Chunked local attention (Llama 4): each query sees only the keys of its own block of
    /// this many positions; `None` for none. The cache keeps every key (a global layer's).
    pub chunk: Option<usize>,
}

/// A per-position query multiplier `1 + weight · ln(1 + ⌊(p + shift) / period⌋)` that keeps
/// attention sharp at positions far beyond the trained context: Llama 4's temperature tuning of
/// its NoPE layers (`attn_scale`, `floor_scale`, shift 1) and Ministral 3's
/// `llama_4_scaling_beta` over `original_max_position_embeddings` (shift 0). Computed in float32
/// and cast to the queries' dtype, as transformers does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PositionScale {
    /// Multiplies the logarithm (`attn_scale`, `llama_4_scaling_beta`).
    pub weight: f64,
    /// Added to the position before dividing (Llama 4 counts positions from 1).
    pub shift: f64,
    /// Positions per step of the floor (`floor_scale`, `original_max_position_embeddings`).
    pub period: f64,
}

impl PositionScale {
    /// The factors for `l` queries at `positions` (`[L]` or `[B, L]`) or, without them, at
    /// `offset..offset + l`, shaped to broadcast over `[B, heads, L, head_dim]`.
    pub fn factors(&self, l: i32, positions: Option<&Array>, offset: usize) -> Result<Array> {
        let f32 = mlxcel_core::Dtype::Float32;
        let (p, shape) = match positions {
            Some(p) if p.ndim() == 2 => (p.astype(f32)?, vec![p.dim(0)?, 1, l, 1]),
            Some(p) => (p.astype(f32)?, vec![l, 1]),
            None => (
                ops::arange(offset as f64, offset as f64 + l as f64, 1.0, f32)?,
                vec![l, 1],
            ),
        };
        let period = Array::from_slice(&[self.period as f32], &[1])?;
        let steps = p.add_scalar(self.shift)?.floor_divide(&period)?;
        Ok(steps
            .add_scalar(1.0)?
            .log()?
            .mul_scalar(self.weight)?
            .add_scalar(1.0)?
            .reshape(&shape)?)
    }
}

/// One (grouped-query) self-attention layer: projections, optional q/k norms, rope, and the
/// output projection `o_proj`.
#[derive(Debug, Clone)]
pub struct Attention {
    /// The query/key/value projections.
    pub qkv: QkvProjection,
    /// `o_proj`: `n_heads * head_dim` → hidden.
    pub o: Linear,
    /// Normalisation of queries and keys.
    pub qk_norm: QkNorm,
    /// The rotary embedding, `None` for layers without positions (NoPE layers).
    pub rope: Option<RotaryEmbedding>,
    /// Heads, widths, scale, soft-cap and window.
    pub cfg: AttentionConfig,
    /// Per-head attention sinks `[n_heads]` (gpt-oss's `sinks`): a learned logit each query's
    /// softmax also normalises over, with no value behind it.
    pub sinks: Option<Array>,
    /// An output gate: the heads' output is multiplied by `sigmoid(output_gate(x))` before
    /// `o_proj` (Qwen3-Next's gated attention), `None` for plain attention.
    pub output_gate: Option<Linear>,
}

impl Attention {
    /// `residual + attention(norm(x))` for `x` `[B, L, hidden]`, reading and extending
    /// `cache`; the norm folds into the qkv projection and the residual add into the output
    /// projection where [`Linear::forward_fused`] can.
    pub fn forward(
        &self,
        x: &Array,
        norm: Option<&Norm>,
        residual: Option<&Array>,
        cache: &mut LayerCache,
        positions: Option<&Array>,
    ) -> Result<Array> {
        let shape = x.shape();
        let (b, l) = (shape[0], shape[1]);
        let c = &self.cfg;
        let out = match self.prefill_heads_roped(x, norm, b, l, cache, positions)? {
            Some((q, k, v)) => self.attend(q, k, v, cache, positions, true)?,
            None => {
                let (mut q, mut k, v) = self.project_heads(x, norm, b, l)?;
                if let QkNorm::PerHead { q: qn, k: kn } | QkNorm::PerHeadWeights { q: qn, k: kn } =
                    &self.qk_norm
                {
                    q = qn.forward(&q)?;
                    k = kn.forward(&k)?;
                }
                self.attend(q, k, v, cache, positions, false)?
            }
        };
        let out = if l == 1 {
            // [B, H, 1, D] has the memory order of [B, 1, H, D]: no transpose node needed.
            out.reshape(&[b, 1, c.n_heads * c.head_dim])?
        } else {
            out.transpose(&[0, 2, 1, 3])?
                .reshape(&[b, l, c.n_heads * c.head_dim])?
        };
        let out = match &self.output_gate {
            Some(gate) => {
                let input = norm.map_or(LinearInput::Plain, LinearInput::Normed);
                out.multiply(&gate.forward_fused(x, input, None)?.sigmoid()?)?
            }
            None => out,
        };
        self.o.forward_fused(&out, LinearInput::Plain, residual)
    }

    /// Rope (unless `roped`: applied already), cache update and attention of heads
    /// `[B, heads, L, head_dim]` → `[B, heads, L, head_dim]`: one sequence (or rows at one
    /// position), or a decode batch of conversations at their own positions
    /// ([`LayerCache::Batch`]).
    fn attend(
        &self,
        mut q: Array,
        mut k: Array,
        v: Array,
        cache: &mut LayerCache,
        positions: Option<&Array>,
        roped: bool,
    ) -> Result<Array> {
        let c = &self.cfg;
        let l = q.dim(2)?;
        let offset = cache.offset();
        if let (Some(rope), false) = (&self.rope, roped) {
            match (&*cache, positions) {
                (LayerCache::Batch(b), None) => {
                    let offsets = b.positions()?;
                    q = rope.forward_offsets(&q, &offsets)?;
                    k = rope.forward_offsets(&k, &offsets)?;
                }
                _ => {
                    q = rope.rotate(&q, positions, offset)?;
                    k = rope.rotate(&k, positions, offset)?;
                }
            }
        }
        if let QkNorm::PerHeadAfterRope { q: qn, k: kn } = &self.qk_norm {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        if let Some(scale) = &c.query_scale {
            let factors = scale.factors(l, positions, offset)?.astype(q.dtype()?)?;
            q = q.multiply(&factors)?;
        }
        let (keys, values, mask) = cache.update(&k, &v, c.window)?;
        let mask = match c.chunk {
            Some(chunk) => Mask::chunked(offset, l as usize, 0, keys.dim(2)? as usize, chunk)?,
            None => mask,
        };
        match c.softcap {
            None => {
                let m = match &mask {
                    Mask::None => AttentionMask::None,
                    Mask::Causal => AttentionMask::Causal,
                    Mask::Array(a) | Mask::Additive(a) => AttentionMask::Array(a),
                };
                Ok(ops::scaled_dot_product_attention(
                    &q,
                    &keys,
                    &values,
                    c.scale,
                    m,
                    self.sinks.as_ref(),
                )?)
            }
            Some(cap) => manual_attention(&q, &keys, &values, c.scale, Some(cap), &mask),
        }
    }

    /// Whether this layer can decode a batch of conversations at their own positions
    /// ([`LayerCache::Batch`]): its rotary embedding takes per-row offsets, and nothing else
    /// depends on the position (Ministral 3's query scaling, Llama 4's chunks).
    pub fn takes_batches(&self) -> bool {
        self.rope.as_ref().is_none_or(|r| r.takes_row_offsets())
            && self.cfg.query_scale.is_none()
            && self.cfg.chunk.is_none()
    }

    /// A prompt's queries, keys and values as `[B, heads, L, head_dim]` with per-head q/k
    /// norms and rope applied, by one mlxcel CUDA kernel on the fused projection's output
    /// (`cuda_kernels::heads_rope`, `MLXCEL_CUDA_PREFILL_ROPE`) where MLX would normalise and
    /// rope each strided operand and copy it into that layout. `None` where it does not apply:
    /// one position, a decode batch, explicit positions, separate projections, q/k norms other
    /// than per-head RMSNorms with one weight and eps, a rope whose frequencies depend on the
    /// length or that scales its output, or not on a GPU.
    fn prefill_heads_roped(
        &self,
        x: &Array,
        norm: Option<&Norm>,
        b: i32,
        l: i32,
        cache: &LayerCache,
        positions: Option<&Array>,
    ) -> Result<Option<(Array, Array, Array)>> {
        let (QkvProjection::Fused(qkv), Some(rope), None) = (&self.qkv, &self.rope, positions)
        else {
            return Ok(None);
        };
        let c = &self.cfg;
        let heads = c.n_heads + 2 * c.n_kv_heads;
        let elements = b as i64 * l as i64 * heads as i64 * c.head_dim as i64;
        if l == 1
            || matches!(cache, LayerCache::Batch(_))
            || !mlxcel_core::cuda_kernels::heads_rope_applies(elements)?
        {
            return Ok(None);
        }
        // Per-head norms with one eps and weights in the activations' dtype (MLX's rms_norm
        // would promote to a wider weight's dtype).
        let norms = match &self.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead { q, k } => match (q.rms_parts(), k.rms_parts()) {
                (Some((q, q_eps)), Some((k, k_eps)))
                    if q_eps == k_eps && q.dtype()? == x.dtype()? && k.dtype()? == x.dtype()? =>
                {
                    Some((q, k, q_eps))
                }
                _ => return Ok(None),
            },
            _ => return Ok(None),
        };
        let Some((inv_freq, traditional)) = rope.inv_freq_array()? else {
            return Ok(None);
        };
        let input = norm.map_or(LinearInput::Plain, LinearInput::Normed);
        let projected = qkv
            .forward_fused(x, input, None)?
            .reshape(&[b, l, heads, c.head_dim])?;
        if let Some((q, _, _)) = norms {
            if q.dtype()? != projected.dtype()? {
                // A projection that widened its output: leave it to MLX's ops.
                return Ok(None);
            }
        }
        let spec = mlxcel_core::cuda_kernels::HeadsRope {
            inv_freq: &inv_freq,
            traditional,
            query_heads: c.n_heads,
            kv_heads: c.n_kv_heads,
            norms,
        };
        let all = mlxcel_core::cuda_kernels::heads_rope(&projected, &spec, cache.offset())?;
        Ok(Some(split_heads(&all, c.n_heads, c.n_kv_heads)?))
    }

    /// Queries, keys and values of `x` `[B, L, hidden]` as `[B, heads, L, head_dim]`, with
    /// full-width qk-norm applied. Decode steps (`L == 1`) reshape straight to the head layout,
    /// and a fused projection is split into heads after one reshape: on a GPU, MLX spends host
    /// time on every array of a decode step, so each one saved counts.
    fn project_heads(
        &self,
        x: &Array,
        norm: Option<&Norm>,
        b: i32,
        l: i32,
    ) -> Result<(Array, Array, Array)> {
        let c = &self.cfg;
        let input = norm.map_or(LinearInput::Plain, LinearInput::Normed);
        let d = c.head_dim;
        let heads = |t: &Array, n: i32| -> Result<Array> {
            Ok(if l == 1 {
                t.reshape(&[b, n, 1, d])?
            } else {
                t.reshape(&[b, l, n, d])?.transpose(&[0, 2, 1, 3])?
            })
        };
        match (&self.qkv, &self.qk_norm) {
            (
                QkvProjection::Fused(qkv),
                QkNorm::None
                | QkNorm::PerHead { .. }
                | QkNorm::PerHeadWeights { .. }
                | QkNorm::PerHeadAfterRope { .. },
            ) => {
                let all = heads(
                    &qkv.forward_fused(x, input, None)?,
                    c.n_heads + 2 * c.n_kv_heads,
                )?;
                split_heads(&all, c.n_heads, c.n_kv_heads)
            }
            _ => {
                let (mut q, mut k, v) = match &self.qkv {
                    QkvProjection::Separate { q, k, v } => {
                        let x = match norm {
                            Some(n) => n.forward(x)?,
                            None => x.clone(),
                        };
                        (q.forward(&x)?, k.forward(&x)?, v.forward(&x)?)
                    }
                    QkvProjection::Fused(qkv) => {
                        let parts = qkv
                            .forward_fused(x, input, None)?
                            .split_at(&[c.n_heads * d, (c.n_heads + c.n_kv_heads) * d], -1)?;
                        (parts[0].clone(), parts[1].clone(), parts[2].clone())
                    }
                };
                match &self.qk_norm {
                    QkNorm::Full { q: qn, k: kn } => {
                        q = qn.forward(&q)?;
                        k = kn.forward(&k)?;
                    }
                    QkNorm::FullSharded { q: qn, k: kn } => {
                        q = qn.forward(&q)?;
                        k = kn.forward(&k)?;
                    }
                    _ => {}
                }
                Ok((
                    heads(&q, c.n_heads)?,
                    heads(&k, c.n_kv_heads)?,
                    heads(&v, c.n_kv_heads)?,
                ))
            }
        }
    }
}

/// Queries, keys and values of `all` `[B, nq + 2 * nk, L, D]` (heads of a fused projection),
/// as one split node rather than three slices.
fn split_heads(all: &Array, nq: i32, nk: i32) -> Result<(Array, Array, Array)> {
    let mut parts = all.split_at(&[nq, nq + nk], 1)?.into_iter();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(q), Some(k), Some(v)) => Ok((q, k, v)),
        _ => unreachable!("a split at two indices has three parts"),
    }
}

/// Attention as separate ops: for what the fused kernel does not offer (tanh soft-capping of
/// the scores, values narrower or wider than the keys). `q` `[B, Hq, L, D]`, `k` `[B, Hk, S, D]`,
/// `v` `[B, Hk, S, Dv]` → `[B, Hq, L, Dv]`.
pub(crate) fn manual_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    softcap: Option<f32>,
    mask: &Mask,
) -> Result<Array> {
    let (qs, ks) = (q.shape(), k.shape());
    let (b, hq, l, d) = (qs[0], qs[1], qs[2], qs[3]);
    let hk = ks[1];
    let dv = v.dim(-1)?;
    let rep = hq / hk;
    // Group query heads by their shared kv head: [B, Hk, rep, L, D] against [B, Hk, 1, S, D].
    let q = q.reshape(&[b, hk, rep, l, d])?;
    let k = k.expand_dims(&[2])?;
    let v = v.expand_dims(&[2])?;
    let scores = q
        .mul_scalar(scale as f64)?
        .matmul(&k.transpose(&[0, 1, 2, 4, 3])?)?;
    let scores = match softcap {
        Some(cap) => scores
            .mul_scalar(1.0 / cap as f64)?
            .tanh()?
            .mul_scalar(cap as f64)?,
        None => scores,
    };
    let scores = mask.hide(&scores)?;
    let probs = scores.softmax(&[-1], true)?;
    Ok(probs.matmul(&v)?.reshape(&[b, hq, l, dv])?)
}
