//! The decode engines for the decoders they cover: every layer pre-norm RMSNorm, q/k/v
//! projections (optional biases, optional per-head RMS query/key norms), fixed-period rope,
//! global attention, a SwiGLU MLP, a plain or tied output head. That is the
//! llama/qwen2/qwen3/mistral (without a window) family; on a GPU also its mixture-of-experts kin
//! (Qwen3-MoE, Mixtral), whose feed-forward may be softmax-routed SwiGLU experts held in memory
//! (no shared expert, no expert biases).
//!
//! - On the CPU, [`mlxcel_core::cpu_decode`] (dense or affine-quantized weights, float32
//!   activations, q/k/v and gate/up as separate layers) computes a step in one call.
//! - On a GPU, [`mlxcel_core::cuda_decode`] (affine 4/8-bit or dense weights, bf16/f16
//!   activations, no bias but on q/k/v; separate or fused q/k/v and gate/up) makes a step one
//!   MLX array whose evaluation adds the step's kernels to MLX's CUDA graph.
//!
//! A single-token step of one sequence with plain key/value caches runs on the engine
//! ([`DecodeEngine::step`]); everything else (prefill, batches, positions given, other caches or
//! layers, `MLXCEL_CPU_DECODE=0`, `MLXCEL_CUDA_DECODE=0`) stays on the MLX graph, which computes
//! the same function.

use std::cell::RefCell;

use mlxcel_core::cpu_decode::{CpuDecoder, DecoderShape, LinearRole, NormRole};
use mlxcel_core::cuda_decode::CudaDecoder;
use mlxcel_core::ops::QuantMode;
use mlxcel_core::{Array, Dtype};
use mlxcel_quant::QuantizedWeight;

use super::{Block, BlockNorms, BlockTopology, DecoderSpec, FeedForward, Mixer};
use crate::cache::LayerCache;
use crate::nn::{
    Activation, Embedding, Linear, Mlp, Norm, QkNorm, QkvProjection, RoutedExperts, RouterScoring,
    SwitchLinear,
};
use crate::Result;

/// An RMSNorm's weight when its epsilon is `eps` (the engine has one epsilon).
fn same_eps(n: &Norm, eps: f32) -> Option<&Array> {
    n.rms_parts().filter(|(_, e)| *e == eps).map(|(w, _)| w)
}

/// The engine a decoder's steps run on.
enum Engine {
    Cpu(RefCell<CpuDecoder>),
    Cuda(CudaDecoder),
}

/// An engine over one decoder's weights.
pub(super) struct DecodeEngine {
    engine: Engine,
    hidden: i32,
    /// A `[1, kv_heads, 1, head_dim]` row in the activations' dtype: the shape and dtype caches
    /// grow in.
    like: Array,
}

impl std::fmt::Debug for DecodeEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.engine {
            Engine::Cpu(e) => f.debug_tuple("DecodeEngine").field(e).finish(),
            Engine::Cuda(e) => f.debug_tuple("DecodeEngine").field(e).finish(),
        }
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

/// A projection's planes as the engines take them: the weight, `(scales, biases, group_size,
/// bits)` when affine-quantized; `None` when no engine can read the layer.
type LinearPlanes<'a> = (&'a Array, Option<(&'a Array, &'a Array, i32, i32)>);

fn planes(l: &Linear) -> Option<(LinearPlanes<'_>, Option<&Array>)> {
    match l {
        Linear::Dense { weight, bias, .. } => Some(((weight, None), bias.as_ref())),
        Linear::Quantized {
            weight: q, bias, ..
        } => Some((quantized_planes(q)?, bias.as_ref())),
        Linear::Adapted { .. } => None,
    }
}

/// A quantized matrix's planes when an engine reads its format: affine 2/4/8-bit with biases,
/// groups a multiple of 32.
fn quantized_planes(q: &QuantizedWeight) -> Option<LinearPlanes<'_>> {
    let spec = q.spec;
    let ok = spec.mode == QuantMode::Affine
        && matches!(spec.bits, 2 | 4 | 8)
        && spec.group_size % 32 == 0;
    let biases = q.biases.as_ref()?;
    ok.then_some((
        &q.weight,
        Some((&q.scales, biases, spec.group_size, spec.bits)),
    ))
}

/// An expert stack's planes when an engine reads its format (see [`quantized_planes`]).
fn stack_planes(l: &SwitchLinear) -> Option<LinearPlanes<'_>> {
    match l {
        SwitchLinear::Dense(w) => Some((w, None)),
        SwitchLinear::Quantized(q) => quantized_planes(q),
        SwitchLinear::Adapted { .. } => None,
    }
}

fn float_kind(a: &Array) -> Result<bool> {
    Ok(matches!(
        a.dtype()?,
        Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16
    ))
}

/// One projection of the decoder, as the engines take it.
struct LinearPart<'a> {
    layer: Option<usize>,
    role: LinearRole,
    planes: LinearPlanes<'a>,
    bias: Option<&'a Array>,
}

/// How a routed-expert layer weighs its experts (see `CudaDecoder::set_routing`).
struct Routing {
    layer: usize,
    top_k: i32,
    normalize: bool,
    weight_scale: f32,
}

/// What the engines are given: the shape, every projection and every norm, and the routing of
/// the routed-expert layers (the CUDA step only).
struct Plan<'a> {
    shape: DecoderShape,
    kv_heads: i32,
    head_dim: i32,
    linears: Vec<LinearPart<'a>>,
    norms: Vec<(Option<usize>, NormRole, &'a Array)>,
    routings: Vec<Routing>,
}

/// Which engine a build is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    Cpu,
    Cuda,
}

/// The decoder as the engines read it; `None` when it is not the family they cover.
fn plan(p: Parts<'_>) -> Result<Option<Plan<'_>>> {
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
    if !plain || p.blocks.is_empty() {
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
    let mut linears = Vec::new();
    let mut norms = Vec::new();
    let mut routings = Vec::new();
    for (i, block) in p.blocks.iter().enumerate() {
        let BlockNorms::PreNorm { mixer_in, ffn_in } = &block.norms else {
            return Ok(None);
        };
        let (Some(n_in), Some(n_post)) = (same_eps(mixer_in, eps), same_eps(ffn_in, eps)) else {
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
        let qk_norms = match &a.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead { q, k } => match (same_eps(q, eps), same_eps(k, eps)) {
                (Some(q), Some(k)) => Some((q, k)),
                _ => return Ok(None),
            },
            _ => return Ok(None),
        };
        // Projections as loaded: separate, or fused (a GPU load fuses q/k/v and gate/up).
        let mut roles = match &a.qkv {
            QkvProjection::Separate { q, k, v } => {
                vec![(LinearRole::Q, q), (LinearRole::K, k), (LinearRole::V, v)]
            }
            QkvProjection::Fused(qkv) => vec![(LinearRole::Qkv, qkv)],
        };
        roles.push((LinearRole::O, &a.o));
        match &block.ffn {
            Some(FeedForward::Dense(Mlp::Gated {
                gate,
                up,
                down,
                act: Activation::Silu,
            })) => roles.extend([
                (LinearRole::Gate, gate),
                (LinearRole::Up, up),
                (LinearRole::Down, down),
            ]),
            Some(FeedForward::Dense(Mlp::FusedGated {
                gate_up,
                down,
                act: Activation::Silu,
                ..
            })) => roles.extend([(LinearRole::GateUp, gate_up), (LinearRole::Down, down)]),
            Some(FeedForward::Moe(moe)) => {
                let Some((routing, experts)) = routed_experts(i, moe) else {
                    return Ok(None);
                };
                roles.push((LinearRole::Router, &moe.router.gate));
                routings.push(routing);
                linears.extend(experts);
            }
            _ => return Ok(None),
        }
        for (role, lin) in roles {
            let Some((planes, bias)) = planes(lin) else {
                return Ok(None);
            };
            linears.push(LinearPart {
                layer: Some(i),
                role,
                planes,
                bias,
            });
        }
        norms.push((Some(i), NormRole::Input, n_in));
        norms.push((Some(i), NormRole::PostAttention, n_post));
        if let Some((qn, kn)) = qk_norms {
            norms.push((Some(i), NormRole::Query, qn));
            norms.push((Some(i), NormRole::Key, kn));
        }
    }
    let head = match (p.lm_head, p.embed) {
        (Some(head), _) => match planes(head) {
            Some(found) => found,
            None => return Ok(None),
        },
        (None, Embedding::Dense { table, .. }) => ((table, None), None),
        (None, Embedding::Adapted { .. }) => return Ok(None),
        (None, Embedding::Quantized { table: q, .. }) => match quantized_planes(q) {
            Some(found) => (found, None),
            None => return Ok(None),
        },
    };
    linears.push(LinearPart {
        layer: None,
        role: LinearRole::Head,
        planes: head.0,
        bias: head.1,
    });
    let Some((w, _)) = p.final_norm.rms_parts() else {
        return Ok(None);
    };
    norms.push((None, NormRole::Final, w));
    Ok(Some(Plan {
        kv_heads: cfg.n_kv_heads,
        head_dim: cfg.head_dim,
        shape,
        linears,
        norms,
        routings,
    }))
}

/// Layer `layer`'s routing and expert stacks when the CUDA step covers its mixture of experts:
/// softmax routing over all experts (no group limit or score correction), SwiGLU experts in
/// memory without biases, no shared expert and no per-pair input scaling.
fn routed_experts(layer: usize, moe: &super::MoeBlock) -> Option<(Routing, Vec<LinearPart<'_>>)> {
    let r = &moe.router;
    let plain_routing = r.scoring == RouterScoring::Softmax
        && r.correction_bias.is_none()
        && r.group_limit.is_none()
        && r.top_k >= 1;
    if !plain_routing || moe.shared.is_some() || moe.scale_inputs {
        return None;
    }
    let RoutedExperts::Resident(glu) = &moe.experts else {
        return None;
    };
    let gate = glu.gate.as_ref()?;
    if glu.act != Activation::Silu || glu.biases.is_some() {
        return None;
    }
    let mut parts = Vec::new();
    for (role, stack) in [
        (LinearRole::ExpertGate, gate),
        (LinearRole::ExpertUp, &glu.up),
        (LinearRole::ExpertDown, &glu.down),
    ] {
        parts.push(LinearPart {
            layer: Some(layer),
            role,
            planes: stack_planes(stack)?,
            bias: None,
        });
    }
    // The kernels' bounds on experts, and on experts per token.
    let experts = parts[0].planes.0.dim(0).ok()?;
    let top_k_fits = r.top_k <= experts.min(mlxcel_core::cuda_decode::MAX_TOP_K);
    if experts > mlxcel_core::cuda_decode::MAX_EXPERTS || !top_k_fits {
        return None;
    }
    let routing = Routing {
        layer,
        top_k: r.top_k,
        normalize: r.normalize,
        weight_scale: r.weight_scale,
    };
    Some((routing, parts))
}

impl DecodeEngine {
    /// The engine for a decoder one covers, when the policy asks for it on the default device;
    /// `None` otherwise (the MLX graph serves every step).
    pub(super) fn build(p: Parts<'_>) -> Result<Option<DecodeEngine>> {
        let policy = mlxcel_core::policy::current();
        let device = mlxcel_core::default_device()?;
        if policy.weight_materialization == mlxcel_core::Materialization::Lazy {
            return Ok(None);
        }
        let target =
            if device == mlxcel_core::Device::Cpu && policy.cpu_kernels && policy.cpu_decode {
                Target::Cpu
            } else if device == mlxcel_core::Device::Gpu
                && policy.cuda_decode
                && cfg!(target_os = "linux")
            {
                Target::Cuda
            } else {
                return Ok(None);
            };
        let dtype = match p.embed {
            Embedding::Dense { dtype, .. } | Embedding::Quantized { dtype, .. } => *dtype,
            // A runtime adapter on the embedding (or a tied head) stays on the graph.
            Embedding::Adapted { .. } => return Ok(None),
        };
        let takes_dtype = match target {
            Target::Cpu => dtype == Dtype::Float32,
            Target::Cuda => matches!(dtype, Dtype::Bfloat16 | Dtype::Float16),
        };
        if !takes_dtype {
            return Ok(None);
        }
        let Some(plan) = plan(p)? else {
            return Ok(None);
        };
        let engine = match target {
            Target::Cpu => build_cpu(&plan)?.map(|e| Engine::Cpu(RefCell::new(e))),
            Target::Cuda => build_cuda(&plan, dtype)?.map(Engine::Cuda),
        };
        let Some(engine) = engine else {
            return Ok(None);
        };
        let like = mlxcel_core::ops::zeros(&[1, plan.kv_heads, 1, plan.head_dim], dtype)?;
        Ok(Some(DecodeEngine {
            engine,
            hidden: plan.shape.hidden,
            like,
        }))
    }

    /// One decode step on the engine: the logits `[1, 1, vocab]` of `embeddings` (`[1, 1,
    /// hidden]` in the activations' dtype) continuing `caches`, which gain its keys and values
    /// (on a GPU, when the logits are evaluated). `None` (nothing changed but possibly grown or
    /// copied buffers) when the step is not the engine's: more rows, given positions, a cache
    /// that is not a plain key/value cache (on the CPU: of rows held by nothing else), caches at
    /// different offsets.
    pub(super) fn step(
        &self,
        embeddings: &Array,
        positions: Option<&Array>,
        caches: &mut [LayerCache],
    ) -> Result<Option<Array>> {
        if positions.is_some()
            || embeddings.shape() != [1, 1, self.hidden]
            || embeddings.dtype()? != self.like.dtype()?
        {
            return Ok(None);
        }
        let layers = match &self.engine {
            Engine::Cpu(e) => e.borrow().layers(),
            Engine::Cuda(e) => e.layers(),
        };
        if caches.len() != layers {
            return Ok(None);
        }
        let offset = caches[0].offset();
        if caches
            .iter()
            .any(|c| !matches!(c, LayerCache::Standard(_)) || c.offset() != offset)
        {
            return Ok(None);
        }
        let logits = match &self.engine {
            // The CPU engine borrows the buffers (it writes them only while nothing else holds
            // them: a clone here would make it decline); the CUDA step keeps its own handles
            // until it runs, on buffers the caches own outright.
            Engine::Cpu(e) => {
                let mut keys = Vec::with_capacity(caches.len());
                let mut values = Vec::with_capacity(caches.len());
                for cache in caches.iter_mut() {
                    if let LayerCache::Standard(c) = cache {
                        let (k, v, _) = c.decode_buffers(&self.like)?;
                        keys.push(k);
                        values.push(v);
                    }
                }
                let Some(logits) = e.borrow_mut().step(embeddings, &keys, &values, offset)? else {
                    return Ok(None);
                };
                let vocab = logits.len() as i32;
                Array::from_slice(&logits, &[1, 1, vocab])?
            }
            Engine::Cuda(e) => {
                let mut keys = Vec::with_capacity(caches.len());
                let mut values = Vec::with_capacity(caches.len());
                for cache in caches.iter_mut() {
                    if let LayerCache::Standard(c) = cache {
                        let (k, v, _) = c.owned_decode_buffers(&self.like)?;
                        keys.push(k);
                        values.push(v);
                    }
                }
                e.step(embeddings, &keys, &values, offset)?
            }
        };
        for cache in caches.iter_mut() {
            if let LayerCache::Standard(c) = cache {
                c.advance_one();
            }
        }
        Ok(Some(logits))
    }

    /// Whether steps run on the CPU engine.
    pub(super) fn on_cpu(&self) -> bool {
        matches!(self.engine, Engine::Cpu(_))
    }
}

/// The CPU engine over `plan`: dense (float) or affine 2/4/8-bit projections.
fn build_cpu(plan: &Plan<'_>) -> Result<Option<CpuDecoder>> {
    if !plan.routings.is_empty() {
        return Ok(None);
    }
    let mut engine = CpuDecoder::new(&plan.shape)?;
    for l in &plan.linears {
        let (w, quant) = l.planes;
        let fused = matches!(l.role, LinearRole::Qkv | LinearRole::GateUp);
        if fused || (quant.is_none() && !float_kind(w)?) {
            return Ok(None);
        }
        engine.set_linear(l.layer, l.role, w, quant, l.bias)?;
    }
    for &(layer, role, w) in &plan.norms {
        engine.set_norm(layer, role, w)?;
    }
    engine.finish()?;
    Ok(Some(engine))
}

/// Whether every layer's separate gate and up projections (an MLP's, or its experts') have one
/// format (bits and group size, or both dense): the CUDA step computes `silu(gate) * up` in one
/// launch over both, so a mixed recipe that quantizes them differently stays on the graph.
fn gate_and_up_share_a_format(linears: &[LinearPart<'_>]) -> bool {
    let format = |l: &LinearPart<'_>| l.planes.1.map(|(_, _, group, bits)| (group, bits));
    let pairs = [
        (LinearRole::Gate, LinearRole::Up),
        (LinearRole::ExpertGate, LinearRole::ExpertUp),
    ];
    pairs.into_iter().all(|(gate, up)| {
        linears.iter().filter(|g| g.role == gate).all(|g| {
            linears
                .iter()
                .filter(|u| u.role == up && u.layer == g.layer)
                .all(|u| format(u) == format(g))
        })
    })
}

/// The CUDA step over `plan`: affine 4/8-bit or dense projections with planes, norms and biases
/// in the activations' `dtype`, biases on q/k/v only; anything else stays on the graph.
fn build_cuda(plan: &Plan<'_>, dtype: Dtype) -> Result<Option<CudaDecoder>> {
    let s = &plan.shape;
    let fits = s.head_dim % 8 == 0
        && s.head_dim <= 256
        && s.heads % s.kv_heads == 0
        && s.heads / s.kv_heads <= 16
        && 2 * s.inv_freq.len() <= s.head_dim as usize;
    if !fits {
        return Ok(None);
    }
    for l in &plan.linears {
        let (w, quant) = l.planes;
        let bias_ok = match l.bias {
            None => true,
            Some(b) => {
                matches!(
                    l.role,
                    LinearRole::Q | LinearRole::K | LinearRole::V | LinearRole::Qkv
                ) && b.dtype()? == dtype
            }
        };
        if !bias_ok || !mlxcel_core::cuda_decode::takes_linear(w, quant, dtype)? {
            return Ok(None);
        }
    }
    for &(_, _, w) in &plan.norms {
        if w.dtype()? != dtype {
            return Ok(None);
        }
    }
    if !gate_and_up_share_a_format(&plan.linears) {
        return Ok(None);
    }
    // The module holds the GEMVs of the model's weight formats alone.
    let mut formats = plan.linears.iter().fold(
        mlxcel_core::cuda_kernels::DecoderFormats::default(),
        |f, l| f.with(l.planes.1.map(|(_, _, _, bits)| bits)),
    );
    if !plan.routings.is_empty() {
        formats = formats.with_experts();
    }
    let mut engine = CudaDecoder::new(s, dtype, formats)?;
    for l in &plan.linears {
        let (w, quant) = l.planes;
        engine.set_linear(l.layer, l.role, w, quant, l.bias)?;
    }
    for r in &plan.routings {
        engine.set_routing(r.layer, r.top_k, r.normalize, r.weight_scale)?;
    }
    for &(layer, role, w) in &plan.norms {
        engine.set_norm(layer, role, w)?;
    }
    engine.finish()?;
    Ok(Some(engine))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recipe that quantizes a layer's gate and up projections differently keeps the CUDA
    /// step off (it would fail to build); one format for both, or other layers differing,
    /// does not.
    #[test]
    fn gate_and_up_in_different_formats_keep_the_graph() {
        let a = Array::from_slice(&[0.0f32], &[1, 1]).unwrap();
        let part = |layer, role, quant: Option<(i32, i32)>| LinearPart {
            layer: Some(layer),
            role,
            planes: (&a, quant.map(|(group, bits)| (&a, &a, group, bits))),
            bias: None,
        };
        let same = [
            part(0, LinearRole::Gate, Some((64, 4))),
            part(0, LinearRole::Up, Some((64, 4))),
            part(0, LinearRole::Down, Some((64, 8))),
            part(1, LinearRole::Gate, None),
            part(1, LinearRole::Up, None),
        ];
        assert!(gate_and_up_share_a_format(&same));
        for up in [Some((64, 8)), Some((32, 4)), None] {
            let mixed = [
                part(0, LinearRole::Gate, Some((64, 4))),
                part(0, LinearRole::Up, up),
                part(1, LinearRole::Gate, Some((64, 4))),
                part(1, LinearRole::Up, Some((64, 4))),
            ];
            assert!(!gate_and_up_share_a_format(&mixed), "{up:?}");
        }
    }
}
