//! The CPU decode engine for the decoders it covers ([`mlxcel_core::cpu_decode`]): every layer
//! pre-norm RMSNorm, separate q/k/v projections (optional biases, optional per-head RMS query/key
//! norms), fixed-period rope, global attention, a SwiGLU MLP, dense or affine-quantized weights,
//! a plain or tied output head. That is the llama/qwen2/qwen3/mistral (without a window) family.
//!
//! A single-token step of one sequence with plain key/value caches runs as one engine call
//! ([`CpuDecode::step`]); everything else (prefill, batches, positions given, other caches or
//! layers, GPUs, `MLXCEL_CPU_DECODE=0`) stays on the MLX graph, which computes the same function.

use std::cell::RefCell;

use mlxcel_core::cpu_decode::{CpuDecoder, DecoderShape, LinearRole, NormRole};
use mlxcel_core::ops::QuantMode;
use mlxcel_core::{Array, Dtype};

use super::{Block, BlockNorms, BlockTopology, DecoderSpec, FeedForward, Mixer};
use crate::cache::LayerCache;
use crate::nn::{Activation, Embedding, Linear, Mlp, Norm, QkNorm, QkvProjection};
use crate::Result;

/// An RMSNorm's weight when its epsilon is `eps` (the engine has one epsilon).
fn same_eps(n: &Norm, eps: f32) -> Option<&Array> {
    n.rms_parts().filter(|(_, e)| *e == eps).map(|(w, _)| w)
}

/// An engine over one decoder's weights.
pub(super) struct CpuDecode {
    engine: RefCell<CpuDecoder>,
    hidden: i32,
    /// A `[1, kv_heads, 1, head_dim]` float32 row: the shape and dtype caches grow in.
    like: Array,
}

impl std::fmt::Debug for CpuDecode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuDecode")
            .field("engine", &self.engine)
            .finish()
    }
}

/// The parts of a decoder the engine reads.
pub(super) struct Parts<'a> {
    pub spec: &'a DecoderSpec,
    pub blocks: &'a [Block],
    pub embed: &'a Embedding,
    pub lm_head: Option<&'a Linear>,
    pub tied_head_bias: bool,
    pub final_norm: &'a Norm,
}

/// A projection's planes as the engine takes them; `None` when it cannot read the layer.
type LinearPlanes<'a> = (&'a Array, Option<(&'a Array, &'a Array, i32, i32)>);

fn planes(l: &Linear) -> Option<(LinearPlanes<'_>, Option<&Array>)> {
    match l {
        Linear::Dense { weight, bias, .. } => Some(((weight, None), bias.as_ref())),
        Linear::Quantized { weight: q, bias } => {
            let spec = q.spec;
            let ok = spec.mode == QuantMode::Affine
                && matches!(spec.bits, 2 | 4 | 8)
                && spec.group_size % 32 == 0;
            let biases = q.biases.as_ref()?;
            ok.then_some((
                (
                    &q.weight,
                    Some((&q.scales, biases, spec.group_size, spec.bits)),
                ),
                bias.as_ref(),
            ))
        }
        Linear::Adapted { .. } => None,
    }
}

fn float_kind(a: &Array) -> Result<bool> {
    Ok(matches!(
        a.dtype()?,
        Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16
    ))
}

impl CpuDecode {
    /// The engine for a decoder it covers, when the policy asks for it on the CPU; `None`
    /// otherwise (the MLX graph serves every step).
    pub(super) fn build(p: Parts<'_>) -> Result<Option<CpuDecode>> {
        let policy = mlxcel_core::policy::current();
        if !policy.cpu_kernels
            || !policy.cpu_decode
            || policy.weight_materialization == mlxcel_core::Materialization::Lazy
            || mlxcel_core::default_device()? != mlxcel_core::Device::Cpu
        {
            return Ok(None);
        }
        let s = p.spec;
        let plain = s.topology == BlockTopology::PreNorm
            && s.residual_scale.is_none()
            && s.logit_scale.is_none()
            && s.final_softcap.is_none()
            && !p.tied_head_bias
            && s.attn_softcap.is_none()
            && !s.attn_sinks
            && !s.attn_output_gate
            && s.windows.iter().all(Option::is_none)
            && s.chunks.iter().all(Option::is_none)
            && s.query_scales.iter().all(Option::is_none);
        let compute_f32 = match p.embed {
            Embedding::Dense { dtype, .. } | Embedding::Quantized { dtype, .. } => {
                *dtype == Dtype::Float32
            }
        };
        if !plain || !compute_f32 || p.blocks.is_empty() {
            return Ok(None);
        }
        let Some((_, eps)) = p.final_norm.rms_parts() else {
            return Ok(None);
        };
        // Every layer's attention and rope must match the first one's.
        let Mixer::Attention(first) = &p.blocks[0].mixer else {
            return Ok(None);
        };
        let Some(rope) = &first.rope else {
            return Ok(None);
        };
        let Some((inv_freq, traditional)) = rope.fixed_inv_freq()? else {
            return Ok(None);
        };
        let cfg = &first.cfg;
        let shape = DecoderShape {
            hidden: s.hidden,
            heads: cfg.n_heads,
            kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            layers: p.blocks.len() as i32,
            eps,
            attn_scale: cfg.scale,
            inv_freq,
            traditional,
        };
        let mut engine = CpuDecoder::new(&shape)?;
        for (i, block) in p.blocks.iter().enumerate() {
            let BlockNorms::PreNorm { mixer_in, ffn_in } = &block.norms else {
                return Ok(None);
            };
            let (Some(n_in), Some(n_post)) = (same_eps(mixer_in, eps), same_eps(ffn_in, eps))
            else {
                return Ok(None);
            };
            let Mixer::Attention(a) = &block.mixer else {
                return Ok(None);
            };
            if a.cfg.n_heads != cfg.n_heads
                || a.cfg.n_kv_heads != cfg.n_kv_heads
                || a.cfg.head_dim != cfg.head_dim
                || a.cfg.scale != cfg.scale
                || a.sinks.is_some()
                || a.output_gate.is_some()
            {
                return Ok(None);
            }
            match &a.rope {
                Some(r) if r.fixed_inv_freq()? == Some((shape.inv_freq.clone(), traditional)) => {}
                _ => return Ok(None),
            }
            let QkvProjection::Separate { q, k, v } = &a.qkv else {
                return Ok(None);
            };
            let qk_norms = match &a.qk_norm {
                QkNorm::None => None,
                QkNorm::PerHead { q, k } => match (same_eps(q, eps), same_eps(k, eps)) {
                    (Some(q), Some(k)) => Some((q, k)),
                    _ => return Ok(None),
                },
                _ => return Ok(None),
            };
            let Some(FeedForward::Dense(Mlp::Gated {
                gate,
                up,
                down,
                act: Activation::Silu,
            })) = &block.ffn
            else {
                return Ok(None);
            };
            let roles = [
                (LinearRole::Q, q),
                (LinearRole::K, k),
                (LinearRole::V, v),
                (LinearRole::O, &a.o),
                (LinearRole::Gate, gate),
                (LinearRole::Up, up),
                (LinearRole::Down, down),
            ];
            for (role, lin) in roles {
                let Some(((w, quant), bias)) = planes(lin) else {
                    return Ok(None);
                };
                if quant.is_none() && !float_kind(w)? {
                    return Ok(None);
                }
                engine.set_linear(Some(i), role, w, quant, bias)?;
            }
            engine.set_norm(Some(i), NormRole::Input, n_in)?;
            engine.set_norm(Some(i), NormRole::PostAttention, n_post)?;
            if let Some((qn, kn)) = qk_norms {
                engine.set_norm(Some(i), NormRole::Query, qn)?;
                engine.set_norm(Some(i), NormRole::Key, kn)?;
            }
        }
        match (p.lm_head, p.embed) {
            (Some(head), _) => {
                let Some(((w, quant), bias)) = planes(head) else {
                    return Ok(None);
                };
                engine.set_linear(None, LinearRole::Head, w, quant, bias)?;
            }
            (None, Embedding::Dense { table, .. }) => {
                engine.set_linear(None, LinearRole::Head, table, None, None)?;
            }
            (None, Embedding::Quantized { table: q, .. }) => {
                let spec = q.spec;
                let (Some(biases), QuantMode::Affine, 2 | 4 | 8) =
                    (q.biases.as_ref(), spec.mode, spec.bits)
                else {
                    return Ok(None);
                };
                if spec.group_size % 32 != 0 {
                    return Ok(None);
                }
                engine.set_linear(
                    None,
                    LinearRole::Head,
                    &q.weight,
                    Some((&q.scales, biases, spec.group_size, spec.bits)),
                    None,
                )?;
            }
        }
        let (Some((w, _)), _) = (p.final_norm.rms_parts(), ()) else {
            return Ok(None);
        };
        engine.set_norm(None, NormRole::Final, w)?;
        engine.finish()?;
        let like = mlxcel_core::ops::zeros(&[1, cfg.n_kv_heads, 1, cfg.head_dim], Dtype::Float32)?;
        Ok(Some(CpuDecode {
            engine: RefCell::new(engine),
            hidden: s.hidden,
            like,
        }))
    }

    /// One decode step on the engine: the logits `[1, 1, vocab]` of `embeddings` (`[1, 1,
    /// hidden]`, float32) continuing `caches`, which gain its keys and values. `None` (nothing
    /// changed but possibly grown buffers) when the step is not the engine's: more rows, given
    /// positions, a cache that is not a plain key/value cache of float32 rows held by nothing
    /// else (a clone), caches at different offsets.
    pub(super) fn step(
        &self,
        embeddings: &Array,
        positions: Option<&Array>,
        caches: &mut [LayerCache],
    ) -> Result<Option<Array>> {
        if positions.is_some()
            || embeddings.shape() != [1, 1, self.hidden]
            || embeddings.dtype()? != Dtype::Float32
        {
            return Ok(None);
        }
        let mut engine = self.engine.borrow_mut();
        if caches.len() != engine.layers() {
            return Ok(None);
        }
        let offset = caches[0].offset();
        if caches
            .iter()
            .any(|c| !matches!(c, LayerCache::Standard(_)) || c.offset() != offset)
        {
            return Ok(None);
        }
        let mut keys = Vec::with_capacity(caches.len());
        let mut values = Vec::with_capacity(caches.len());
        for cache in caches.iter_mut() {
            if let LayerCache::Standard(c) = cache {
                let (k, v, _) = c.decode_buffers(&self.like)?;
                keys.push(k);
                values.push(v);
            }
        }
        let Some(logits) = engine.step(embeddings, &keys, &values, offset)? else {
            return Ok(None);
        };
        drop((keys, values));
        for cache in caches.iter_mut() {
            if let LayerCache::Standard(c) = cache {
                c.advance_one();
            }
        }
        let vocab = logits.len() as i32;
        Ok(Some(Array::from_slice(&logits, &[1, 1, vocab])?))
    }
}
