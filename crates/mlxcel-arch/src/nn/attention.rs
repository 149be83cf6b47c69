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

/// Normalisation of queries and keys before rope.
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
}

/// One (grouped-query) self-attention layer: projections, optional q/k norms, rope, and the
/// output projection `o_proj`.
#[derive(Debug, Clone)]
pub struct Attention {
    /// The query/key/value projections.
    pub qkv: QkvProjection,
    /// `o_proj`: `n_heads * head_dim` → hidden.
    pub o: Linear,
    /// Normalisation of queries and keys before rope.
    pub qk_norm: QkNorm,
    /// The rotary embedding, `None` for layers without positions (NoPE layers).
    pub rope: Option<RotaryEmbedding>,
    /// Heads, widths, scale, soft-cap and window.
    pub cfg: AttentionConfig,
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
        let (mut q, mut k, v) = self.project_heads(x, norm, b, l)?;
        if let QkNorm::PerHead { q: qn, k: kn } | QkNorm::PerHeadWeights { q: qn, k: kn } =
            &self.qk_norm
        {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        if let Some(rope) = &self.rope {
            let offset = cache.offset();
            q = rope.rotate(&q, positions, offset)?;
            k = rope.rotate(&k, positions, offset)?;
        }
        let (keys, values, mask) = cache.update(&k, &v, c.window)?;
        let out = match c.softcap {
            None => {
                let m = match &mask {
                    Mask::None => AttentionMask::None,
                    Mask::Causal => AttentionMask::Causal,
                    Mask::Array(a) | Mask::Additive(a) => AttentionMask::Array(a),
                };
                ops::scaled_dot_product_attention(&q, &keys, &values, c.scale, m, None)?
            }
            Some(cap) => manual_attention(&q, &keys, &values, c.scale, Some(cap), &mask)?,
        };
        let out = if l == 1 {
            // [B, H, 1, D] has the memory order of [B, 1, H, D]: no transpose node needed.
            out.reshape(&[b, 1, c.n_heads * c.head_dim])?
        } else {
            out.transpose(&[0, 2, 1, 3])?
                .reshape(&[b, l, c.n_heads * c.head_dim])?
        };
        self.o.forward_fused(&out, LinearInput::Plain, residual)
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
                QkNorm::None | QkNorm::PerHead { .. } | QkNorm::PerHeadWeights { .. },
            ) => {
                let all = heads(
                    &qkv.forward_fused(x, input, None)?,
                    c.n_heads + 2 * c.n_kv_heads,
                )?;
                // One split node rather than three slices.
                let (nq, nk) = (c.n_heads, c.n_kv_heads);
                let mut parts = all.split_at(&[nq, nq + nk], 1)?.into_iter();
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(q), Some(k), Some(v)) => Ok((q, k, v)),
                    _ => unreachable!("a split at two indices has three parts"),
                }
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
                if let QkNorm::Full { q: qn, k: kn } = &self.qk_norm {
                    q = qn.forward(&q)?;
                    k = kn.forward(&k)?;
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
