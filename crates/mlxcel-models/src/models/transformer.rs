//! The pre-norm decoder most text architectures are variations of. An architecture file turns
//! its `ModelArgs` into a [`DecoderSpec`] (which norms, which attention options, which layers
//! are sliding, which feed-forward blocks are mixtures of experts) and [`Decoder`] does the rest:
//! tensor names follow the HF/mlx-lm layout (`model.layers.{i}.self_attn.q_proj`, ...).

use std::marker::PhantomData;

use mlxcel_core::Array;

use crate::cache::KvCache;
use crate::model::{LanguageModel, LayerKind};
use crate::nn::{
    Activation, Attention, AttentionConfig, Embedding, Linear, LinearInput, Mlp, Norm, NormKind,
    QkNorm, QkvProjection, RopeConfig, RotaryEmbedding, RoutedExperts, Router, RouterScoring,
};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// Which query/key normalisation a layer applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNormSpec {
    None,
    PerHead,
    Full,
}

/// A mixture-of-experts feed-forward block.
#[derive(Debug, Clone)]
pub struct MoeSpec {
    pub experts: i32,
    pub top_k: i32,
    pub intermediate: i32,
    pub scoring: RouterScoring,
    pub normalize: bool,
    /// A shared expert of this intermediate size, gated by `sigmoid(shared_expert_gate(x))`.
    pub shared_intermediate: Option<i32>,
}

#[derive(Debug, Clone)]
pub enum FfnSpec {
    Dense { intermediate: i32 },
    Moe(MoeSpec),
}

/// Everything that distinguishes one decoder architecture from another.
#[derive(Debug, Clone)]
pub struct DecoderSpec {
    pub vocab: i32,
    pub hidden: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub norm: NormKind,
    pub eps: f32,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub fused_qkv: bool,
    pub fused_gate_up: bool,
    pub qk_norm: QkNormSpec,
    pub attn_scale: f32,
    pub attn_softcap: Option<f32>,
    pub act: Activation,
    /// Per layer: rotary embedding.
    pub rope: Vec<RopeConfig>,
    /// Per layer: sliding window (keys per query), `None` for global attention.
    pub windows: Vec<Option<usize>>,
    /// Per layer: feed-forward block.
    pub ffn: Vec<FfnSpec>,
    /// Name of the feed-forward module (`mlp`, or `block_sparse_moe` for mixtral).
    pub ffn_prefix: &'static str,
    /// Gemma 2/3: norms after attention and around the feed-forward block.
    pub sandwich_norms: bool,
    /// Multiplies the embeddings (Gemma: `sqrt(hidden)`).
    pub embed_scale: Option<f64>,
    pub final_softcap: Option<f64>,
    pub tie_word_embeddings: bool,
}

impl DecoderSpec {
    pub fn layers(&self) -> usize {
        self.windows.len()
    }
}

#[derive(Debug)]
enum FeedForward {
    Dense(Mlp),
    Moe(Box<MoeBlock>),
}

#[derive(Debug)]
struct MoeBlock {
    router: Router,
    experts: RoutedExperts,
    shared: Option<(Mlp, Linear)>,
}

impl FeedForward {
    /// `residual + self(norm(x))` (see [`Mlp::forward_fused`]).
    fn forward_fused(&self, x: &Array, norm: &Norm, residual: Option<&Array>) -> Result<Array> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward_fused(x, Some(norm), residual),
            FeedForward::Moe(_) => {
                let y = self.forward(&norm.forward(x)?)?;
                Ok(match residual {
                    Some(r) => r.add(&y)?,
                    None => y,
                })
            }
        }
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(x),
            FeedForward::Moe(moe) => {
                let MoeBlock {
                    router,
                    experts,
                    shared,
                } = moe.as_ref();
                let shape = x.shape();
                let d = shape[shape.len() - 1];
                let flat = x.reshape(&[-1, d])?;
                let (ids, weights) = router.route(&flat)?;
                let shared_out = match shared {
                    Some((mlp, gate)) => {
                        let s = mlp
                            .forward(&flat)?
                            .multiply(&gate.forward(&flat)?.sigmoid()?)?;
                        // Streamed experts are read from disk next: let the shared expert, which
                        // does not depend on them, compute meanwhile.
                        if experts.is_streamed() {
                            mlxcel_core::ops::async_eval_all([&s])?;
                        }
                        Some(s)
                    }
                    None => None,
                };
                let mut y = experts.combine(&flat, &ids, &weights)?;
                if let Some(s) = shared_out {
                    y = y.add(&s)?;
                }
                Ok(y.reshape(&shape)?)
            }
        }
    }
}

#[derive(Debug)]
struct Layer {
    input_norm: Norm,
    attn: Attention,
    post_attn_norm: Norm,
    /// Sandwich norms: (pre-ffn, post-ffn).
    ffn_norms: Option<(Norm, Norm)>,
    ffn: FeedForward,
}

/// A decoder built from a [`DecoderSpec`].
#[derive(Debug)]
pub struct Decoder {
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Norm,
    lm_head: Option<Linear>,
    embed_scale: Option<f64>,
    final_softcap: Option<f64>,
    vocab: usize,
    windows: Vec<Option<usize>>,
}

fn norm(w: &mut ModelWeights, spec: &DecoderSpec, name: &str, dim: i32) -> Result<Norm> {
    w.norm(name, spec.norm, dim, spec.eps)
}

fn mlp(w: &mut ModelWeights, spec: &DecoderSpec, prefix: &str, intermediate: i32) -> Result<Mlp> {
    let (h, b) = (spec.hidden, spec.mlp_bias);
    let down = w.linear(&format!("{prefix}.down_proj"), intermediate, h, b)?;
    Ok(if spec.fused_gate_up {
        Mlp::FusedGated {
            gate_up: w.linear(&format!("{prefix}.gate_up_proj"), h, 2 * intermediate, b)?,
            down,
            act: spec.act,
            hidden: intermediate,
        }
    } else {
        let names = [format!("{prefix}.gate_proj"), format!("{prefix}.up_proj")];
        let mut layers =
            w.linear_group(&[&names[0], &names[1]], h, &[intermediate, intermediate], b)?;
        match (layers.pop(), layers.pop()) {
            (Some(gate_up), None) => Mlp::FusedGated {
                gate_up,
                down,
                act: spec.act,
                hidden: intermediate,
            },
            (Some(up), Some(gate)) => Mlp::Gated {
                gate,
                up,
                down,
                act: spec.act,
            },
            _ => unreachable!("linear_group returns one layer or all of them"),
        }
    })
}

impl Decoder {
    pub fn build(spec: &DecoderSpec, w: &mut ModelWeights) -> Result<Decoder> {
        let n = spec.layers();
        if spec.rope.len() != n || spec.ffn.len() != n {
            return Err(ModelError::Config(format!(
                "internal: {n} layers but {} rope and {} ffn entries",
                spec.rope.len(),
                spec.ffn.len()
            )));
        }
        if spec.heads % spec.kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                spec.heads, spec.kv_heads
            )));
        }
        let (h, hd) = (spec.hidden, spec.head_dim);
        let (q_dim, kv_dim) = (spec.heads * hd, spec.kv_heads * hd);
        let embed = w.embedding("model.embed_tokens", spec.vocab, h)?;
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let qkv = if spec.fused_qkv {
                QkvProjection::Fused(w.linear(
                    &format!("{a}.qkv_proj"),
                    h,
                    q_dim + 2 * kv_dim,
                    spec.qkv_bias,
                )?)
            } else {
                let names = ["q_proj", "k_proj", "v_proj"].map(|n| format!("{a}.{n}"));
                let mut layers = w.linear_group(
                    &[&names[0], &names[1], &names[2]],
                    h,
                    &[q_dim, kv_dim, kv_dim],
                    spec.qkv_bias,
                )?;
                match (layers.pop(), layers.pop(), layers.pop()) {
                    (Some(qkv), None, None) => QkvProjection::Fused(qkv),
                    (Some(v), Some(k), Some(q)) => QkvProjection::Separate { q, k, v },
                    _ => unreachable!("linear_group returns one layer or all of them"),
                }
            };
            let qk_norm = match spec.qk_norm {
                QkNormSpec::None => QkNorm::None,
                QkNormSpec::PerHead => QkNorm::PerHead {
                    q: norm(w, spec, &format!("{a}.q_norm"), hd)?,
                    k: norm(w, spec, &format!("{a}.k_norm"), hd)?,
                },
                QkNormSpec::Full => QkNorm::Full {
                    q: norm(w, spec, &format!("{a}.q_norm"), q_dim)?,
                    k: norm(w, spec, &format!("{a}.k_norm"), kv_dim)?,
                },
            };
            let rope = RotaryEmbedding::new(&spec.rope[i])?;
            w.keep_all(rope.arrays());
            let attn = Attention {
                qkv,
                o: w.linear(&format!("{a}.o_proj"), q_dim, h, spec.o_bias)?,
                qk_norm,
                rope: Some(rope),
                cfg: AttentionConfig {
                    n_heads: spec.heads,
                    n_kv_heads: spec.kv_heads,
                    head_dim: hd,
                    scale: spec.attn_scale,
                    softcap: spec.attn_softcap,
                    window: spec.windows[i],
                },
            };
            let f = format!("{p}.{}", spec.ffn_prefix);
            let ffn = match &spec.ffn[i] {
                FfnSpec::Dense { intermediate } => {
                    FeedForward::Dense(mlp(w, spec, &f, *intermediate)?)
                }
                FfnSpec::Moe(m) => {
                    let router = Router {
                        gate: w.linear(&format!("{f}.gate"), h, m.experts, false)?,
                        top_k: m.top_k,
                        scoring: m.scoring,
                        normalize: m.normalize,
                    };
                    let experts = w.routed_experts(&f, m.experts, h, m.intermediate, spec.act)?;
                    let shared = match m.shared_intermediate {
                        Some(si) => Some((
                            mlp(w, spec, &format!("{f}.shared_expert"), si)?,
                            w.linear(&format!("{f}.shared_expert_gate"), h, 1, false)?,
                        )),
                        None => None,
                    };
                    FeedForward::Moe(Box::new(MoeBlock {
                        router,
                        experts,
                        shared,
                    }))
                }
            };
            let ffn_norms = if spec.sandwich_norms {
                Some((
                    norm(w, spec, &format!("{p}.pre_feedforward_layernorm"), h)?,
                    norm(w, spec, &format!("{p}.post_feedforward_layernorm"), h)?,
                ))
            } else {
                None
            };
            layers.push(Layer {
                input_norm: norm(w, spec, &format!("{p}.input_layernorm"), h)?,
                attn,
                post_attn_norm: norm(w, spec, &format!("{p}.post_attention_layernorm"), h)?,
                ffn_norms,
                ffn,
            });
        }
        let final_norm = norm(w, spec, "model.norm", h)?;
        // Tied heads reuse the embedding table (no second copy); an untied config without
        // `lm_head.weight` is an error naming the tensor.
        let lm_head = if spec.tie_word_embeddings && !w.contains("lm_head.weight") {
            None
        } else {
            Some(w.linear("lm_head", h, spec.vocab, false)?)
        };
        Ok(Decoder {
            embed,
            layers,
            norm: final_norm,
            lm_head,
            embed_scale: spec.embed_scale,
            final_softcap: spec.final_softcap,
            vocab: spec.vocab as usize,
            windows: spec.windows.clone(),
        })
    }

    /// Logits `[B, L, vocab]` for every position, or `[B, 1, vocab]` for the last one only
    /// (`last_only`: prefill needs just the next token's logits, and the output head is a large
    /// share of a prompt's compute).
    pub fn forward(
        &self,
        tokens: &Array,
        caches: &mut [KvCache],
        last_only: bool,
    ) -> Result<Array> {
        if caches.len() != self.layers.len() {
            return Err(ModelError::Config(format!(
                "{} caches for {} layers",
                caches.len(),
                self.layers.len()
            )));
        }
        let mut h = self.embed.forward(tokens)?;
        if let Some(s) = self.embed_scale {
            // In the activation dtype, as transformers rounds the normaliser.
            h = h.mul_scalar(s)?;
        }
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            let input_norm = Some(&layer.input_norm);
            if let Some((pre, post)) = &layer.ffn_norms {
                // Sandwich norms sit between each block and its residual add.
                let r = layer.attn.forward(&h, input_norm, None, cache)?;
                h = h.add(&layer.post_attn_norm.forward(&r)?)?;
                let f = layer.ffn.forward(&pre.forward(&h)?)?;
                h = h.add(&post.forward(&f)?)?;
            } else {
                h = layer.attn.forward(&h, input_norm, Some(&h), cache)?;
                h = layer
                    .ffn
                    .forward_fused(&h, &layer.post_attn_norm, Some(&h))?;
            }
        }
        let h = if last_only {
            let n = h.dim(1)?;
            h.slice_axis(1, n - 1, n)?
        } else {
            h
        };
        let mut logits = match &self.lm_head {
            Some(head) => head.forward_fused(&h, LinearInput::Normed(&self.norm), None)?,
            None => self.embed.as_linear(&self.norm.forward(&h)?)?,
        };
        if let Some(cap) = self.final_softcap {
            logits = logits.mul_scalar(1.0 / cap)?.tanh()?.mul_scalar(cap)?;
        }
        Ok(logits)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    pub fn layer_schedule(&self) -> Vec<LayerKind> {
        self.windows
            .iter()
            .map(|w| match w {
                Some(window) => LayerKind::SlidingAttention { window: *window },
                None => LayerKind::GlobalAttention,
            })
            .collect()
    }
}

/// A decoder architecture: `A` is the architecture's `ModelArgs`, which selects the
/// [`crate::model::Architecture`] implementation (its sanitiser and its spec).
#[derive(Debug)]
pub struct Transformer<A> {
    pub decoder: Decoder,
    _args: PhantomData<fn() -> A>,
}

impl<A> Transformer<A> {
    pub fn new(decoder: Decoder) -> Self {
        Transformer {
            decoder,
            _args: PhantomData,
        }
    }
}

impl<A> LanguageModel for Transformer<A> {
    fn forward(&self, tokens: &Array, caches: &mut [KvCache]) -> Result<Array> {
        self.decoder.forward(tokens, caches, false)
    }

    fn forward_last(&self, tokens: &Array, caches: &mut [KvCache]) -> Result<Array> {
        self.decoder.forward(tokens, caches, true)
    }

    fn vocab_size(&self) -> usize {
        self.decoder.vocab_size()
    }

    fn layer_schedule(&self) -> Vec<LayerKind> {
        self.decoder.layer_schedule()
    }
}
