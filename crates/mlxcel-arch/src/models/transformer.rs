//! The decoder most text architectures are compositions of. An architecture file turns its
//! `ModelArgs` into a [`DecoderSpec`] — values, not switches: which token mixer each layer runs
//! (attention, latent attention or a state-space mixer), its rope and window, which feed-forward block (dense, plain,
//! mixture of experts), where the norms sit (the block topology) and the scalings — and
//! [`Decoder`] builds and runs it.
//!
//! The decoder reads the canonical layout under its scope: `model.embed_tokens`,
//! `model.layers.{i}.{self_attn,mlp}.*` (a state-space layer's mixer under `mixer`), the
//! topology's norms, `model.norm`, `lm_head`.
//! Architectures whose checkpoints spell things otherwise (fused projections, `ffn`/`block_sparse_moe`
//! prefixes, other norm names, per-expert tensors) rewrite them in their `sanitize`.
//!
//! The forward pass is split into [`Decoder::embed`] (ids → hidden states), the body and
//! [`Decoder::head`], so other towers can feed it input embeddings and explicit positions.

use std::marker::PhantomData;

use mlxcel_core::{Array, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::de::DeserializeOwned;

mod decode_engine;
mod mtp;

pub use mtp::MtpSpec;

use crate::cache::LayerCache;
use crate::model::{Architecture, LanguageModel, LayerKind, MultiTokenPrediction};
use crate::nn::griffin::RgLruBlock;
use crate::nn::ssm::{BcdtNorms, CausalConv, GatedNorm, Mamba2Dims, MambaDims, PlainRms};
use crate::nn::{
    Activation, Attention, AttentionConfig, Embedding, GroupLimit, LatentAttention, LatentDims,
    LightningAttention, Linear, LinearInput, Mamba2Mixer, MambaMixer, Mlp, Norm, NormKind,
    PositionScale, QkNorm, QkvProjection, QueryProjection, RopeConfig, RotaryEmbedding,
    RoutedExperts, Router, RouterScoring, ShardedRms, XIeluParams,
};
use crate::nn::{DeltaProjections, GatedDeltaDims, GatedDeltaNet};
use crate::parallel::{HeadSplit, Pipeline};
use crate::weights::{ModelWeights, Split};
use crate::{ModelError, Result};

/// Which query/key normalisation an attention layer applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNormSpec {
    /// No query/key normalisation.
    None,
    /// Over each head's features, one weight shared by all heads (`[head_dim]`).
    PerHead,
    /// Over each head's features, a weight per head (`[heads, head_dim]`).
    PerHeadWeights,
    /// Over the whole projection, before splitting heads.
    Full,
    /// Over each head's features after rope, one weight shared by all heads (Hunyuan).
    PerHeadAfterRope,
    /// Over each head's features without a weight, on the layers with rope only (Llama 4's
    /// `use_qk_norm` L2 norm; transformers applies it after rope, which a norm over the whole
    /// head commutes with).
    WeightlessOnRopeLayers,
}

/// A shared expert next to the routed ones (`mlp.shared_expert`), optionally scaled by
/// `sigmoid(mlp.shared_expert_gate(x))`.
#[derive(Debug, Clone, Copy)]
pub struct SharedExpertSpec {
    /// The shared expert's MLP width (`shared_expert_intermediate_size`; DeepSeek:
    /// `n_shared_experts * moe_intermediate_size`).
    pub intermediate: i32,
    /// Scale its output by `sigmoid(shared_expert_gate(x))` (Qwen2-MoE); ungated for DeepSeek.
    pub gated: bool,
}

/// A mixture-of-experts feed-forward block.
#[derive(Debug, Clone)]
pub struct MoeSpec {
    /// Routed experts in the layer.
    pub experts: i32,
    /// Experts per token.
    pub top_k: i32,
    /// Width of one routed expert.
    pub intermediate: i32,
    /// How router logits become weights.
    pub scoring: RouterScoring,
    /// Renormalise the kept weights to sum to one.
    pub normalize: bool,
    /// A shared expert run for every token, if any.
    pub shared: Option<SharedExpertSpec>,
    /// Group-limited routing, if any.
    pub group_limit: Option<GroupLimit>,
    /// The router has an `e_score_correction_bias` added when choosing experts.
    pub correction_bias: bool,
    /// Multiplies the routing weights (`routed_scaling_factor`).
    pub weight_scale: f32,
    /// The router projection's name under `mlp` (`gate`; gpt-oss: `router`, kept so per-module
    /// quantization overrides keyed by it apply).
    pub router: &'static str,
    /// The router projection has a bias (`router.bias`, gpt-oss).
    pub router_bias: bool,
    /// The experts' projections have biases (`switch_mlp.*.bias`, gpt-oss).
    pub expert_bias: bool,
    /// The routing weight scales each expert's input instead of its output (Llama 4).
    pub scale_inputs: bool,
}

impl MoeSpec {
    /// Softmax routing over `experts`, top `top_k`, no shared expert or group limit.
    pub fn softmax(experts: i32, top_k: i32, intermediate: i32, normalize: bool) -> MoeSpec {
        MoeSpec {
            experts,
            top_k,
            intermediate,
            scoring: RouterScoring::Softmax,
            normalize,
            shared: None,
            group_limit: None,
            correction_bias: false,
            weight_scale: 1.0,
            router: "gate",
            router_bias: false,
            expert_bias: false,
            scale_inputs: false,
        }
    }
}

/// The feed-forward block of one layer.
#[derive(Debug, Clone)]
pub enum FfnSpec {
    /// `down(act(gate(x)) * up(x))`.
    Dense {
        /// The MLP width.
        intermediate: i32,
    },
    /// `down(act(up(x)))`.
    Plain {
        /// The MLP width.
        intermediate: i32,
    },
    /// A mixture of experts (`mlp.gate` router, `mlp.switch_mlp.*` experts).
    Moe(MoeSpec),
    /// A mixture of plain experts `down(act(up(x)))`, routed and shared alike (no gate
    /// projections: Nemotron-H).
    PlainMoe(MoeSpec),
    /// No feed-forward block (the [`BlockTopology::MixerOnly`] blocks of state-space stacks).
    None,
}

/// Multi-head latent attention's shape.
#[derive(Debug, Clone)]
pub struct LatentSpec {
    /// Heads and per-head widths.
    pub dims: LatentDims,
    /// Queries through a low-rank bottleneck of this width (`q_a_proj`/`q_b_proj`), else one
    /// `q_proj`.
    pub q_lora_rank: Option<i32>,
    /// Biases on the attention projections (`attention_bias`).
    pub bias: bool,
    /// Multiplies the attention scores.
    pub scale: f32,
    /// The rope of the `qk_rope_head_dim` features.
    pub rope: RopeConfig,
}

/// How a Mamba-1 mixer normalises its time-step input, `B` and `C` before the scan.
#[derive(Debug, Clone, Copy)]
pub struct BcdtNormSpec {
    /// Norms with weights (`dt_layernorm`, `b_layernorm`, `c_layernorm`: Jamba), else weightless
    /// (Falcon-Mamba).
    pub weighted: bool,
    /// Their epsilon.
    pub eps: f32,
}

/// A Mamba-1 selective state-space mixer (`mixer.*`).
#[derive(Debug, Clone)]
pub struct MambaSpec {
    /// Inner width, state size and time-step rank.
    pub dims: MambaDims,
    /// Width of the causal convolution (`conv_kernel`, `d_conv`).
    pub conv_kernel: i32,
    /// The convolution has a bias (`use_conv_bias`).
    pub conv_bias: bool,
    /// `in_proj` and `out_proj` have biases (`use_bias`).
    pub proj_bias: bool,
    /// RMS norms of dt, B and C (Falcon-Mamba, Jamba), if any.
    pub bcdt_norms: Option<BcdtNormSpec>,
}

/// A Mamba-2 (SSD) mixer (`mixer.*`).
#[derive(Debug, Clone)]
pub struct Mamba2Spec {
    /// Heads, head width, groups, state size and SSD chunk.
    pub dims: Mamba2Dims,
    /// Width of the causal convolution (`conv_kernel`).
    pub conv_kernel: i32,
    /// The convolution has a bias (`use_conv_bias`).
    pub conv_bias: bool,
    /// `in_proj` and `out_proj` have biases (`use_bias`).
    pub proj_bias: bool,
    /// Epsilon of the gated RMSNorm.
    pub norm_eps: f32,
    /// Where the output gate sits relative to the norm (or that there is no norm).
    pub gated_norm: GatedNorm,
    /// The clamp of the time step after its softplus (`time_step_limit`).
    pub dt_limit: (f64, f64),
}

/// MiniMax's lightning attention (linear attention with per-head decay, see
/// [`crate::nn::LightningAttention`]).
#[derive(Debug, Clone)]
pub struct LightningSpec {
    /// Heads.
    pub heads: i32,
    /// Width of one head.
    pub head_dim: i32,
    /// Positions per closed-form block of a prefill (`block_size`).
    pub block: i32,
    /// Each head's decay rate.
    pub slopes: Vec<f64>,
}

/// How a gated DeltaNet mixer's input projections are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaLayout {
    /// `in_proj_qkvz` and `in_proj_ba`, grouped per key head (Qwen3-Next).
    PerKeyHead,
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (Qwen3.5).
    Separate,
}

/// A gated DeltaNet linear-attention mixer (`linear_attn.*`).
#[derive(Debug, Clone)]
pub struct GatedDeltaSpec {
    /// Heads and widths.
    pub dims: GatedDeltaDims,
    /// Width of the causal convolution (`linear_conv_kernel_dim`).
    pub conv_kernel: i32,
    /// Epsilon of the gated RMSNorm.
    pub norm_eps: f32,
    /// The projections' layout.
    pub layout: DeltaLayout,
}

/// Griffin's recurrent block (RecurrentGemma's RG-LRU layers, `mixer.*`).
#[derive(Debug, Clone)]
pub struct RgLruSpec {
    /// Width of the recurrence (`lru_width`).
    pub width: i32,
    /// Heads of its block-diagonal gates (`num_attention_heads`).
    pub heads: i32,
    /// Width of the causal convolution (`conv1d_width`).
    pub conv_kernel: i32,
}

/// The token mixer of one layer.
#[derive(Debug, Clone)]
pub enum MixerSpec {
    /// Grouped-query attention with the spec's heads, qk-norm and scale, and the layer's rope
    /// and window.
    Attention,
    /// Multi-head latent attention (DeepSeek V2/V3).
    Latent(LatentSpec),
    /// Mamba-1's selective scan (Mamba, Falcon-Mamba, Jamba's Mamba layers).
    Mamba(MambaSpec),
    /// Mamba-2's multi-head SSD scan.
    Mamba2(Mamba2Spec),
    /// MiniMax's lightning attention.
    Lightning(LightningSpec),
    /// The gated delta rule (Qwen3-Next's linear attention).
    GatedDelta(GatedDeltaSpec),
    /// Griffin's RG-LRU recurrent block.
    RgLru(RgLruSpec),
    /// Attention (under `self_attn`) and a Mamba-2 mixer (under `mamba`) side by side on the
    /// same normed input, their outputs summed (Falcon-H1).
    AttentionWithMamba2(Mamba2Spec),
    /// No token mixer: in a [`BlockTopology::MixerOnly`] stack, the layer is its feed-forward
    /// block alone, `h += ffn(input_layernorm(h))` (Nemotron-H's MLP and MoE layers).
    None,
}

impl MixerSpec {
    /// What the mixer is, for messages.
    fn kind(&self) -> &'static str {
        match self {
            MixerSpec::Attention => "attention",
            MixerSpec::Latent(_) => "multi-head latent attention",
            MixerSpec::Mamba(_) => "Mamba",
            MixerSpec::Mamba2(_) => "Mamba-2",
            MixerSpec::Lightning(_) => "lightning attention",
            MixerSpec::GatedDelta(_) => "gated delta",
            MixerSpec::RgLru(_) => "RG-LRU",
            MixerSpec::AttentionWithMamba2(_) => "attention with Mamba-2",
            MixerSpec::None => "feed-forward-only",
        }
    }

    /// The scope the mixer's tensors are read under within its layer.
    fn scope(&self) -> &'static str {
        match self {
            MixerSpec::Attention
            | MixerSpec::Latent(_)
            | MixerSpec::Lightning(_)
            | MixerSpec::AttentionWithMamba2(_) => "self_attn",
            MixerSpec::Mamba(_) | MixerSpec::Mamba2(_) | MixerSpec::RgLru(_) | MixerSpec::None => {
                "mixer"
            }
            MixerSpec::GatedDelta(_) => "linear_attn",
        }
    }
}

/// Where a block's norms sit, and the canonical names they are read under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockTopology {
    /// `h += mixer(input_layernorm(h)); h += ffn(post_attention_layernorm(h))`.
    PreNorm,
    /// Gemma 2/3: `h += post_attention_layernorm(mixer(input_layernorm(h)));
    /// h += post_feedforward_layernorm(ffn(pre_feedforward_layernorm(h)))`.
    Sandwich,
    /// EXAONE 4: `h += post_attention_layernorm(mixer(h)); h += post_feedforward_layernorm(ffn(h))`.
    PostNorm,
    /// Cohere, Phi-2: `x = input_layernorm(h); h += mixer(x) + ffn(x)`.
    Parallel,
    /// GPT-NeoX: `h += mixer(input_layernorm(h)) + ffn(post_attention_layernorm(h))`.
    ParallelTwoNorms,
    /// State-space stacks (Mamba, Mamba-2): `h += mixer(input_layernorm(h))`, no feed-forward.
    MixerOnly,
    /// MiniMax: the residual is the normed input, both branches scaled by the layer's
    /// [`BlockScales`]: `x = input_layernorm(h); h = α·x + β·mixer(x);
    /// x = post_attention_layernorm(h); h = α'·x + β'·ffn(x)`.
    NormedResidual,
}

/// The residual and branch multipliers of a [`BlockTopology::NormedResidual`] block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockScales {
    /// Multiplies the normed input kept around the mixer (`*_attn_alpha_factor`).
    pub mixer_residual: f64,
    /// Multiplies the mixer's output (`*_attn_beta_factor`).
    pub mixer_out: f64,
    /// Multiplies the normed input kept around the feed-forward block (`mlp_alpha_factor`).
    pub ffn_residual: f64,
    /// Multiplies the feed-forward output (`mlp_beta_factor`).
    pub ffn_out: f64,
}

impl BlockScales {
    /// All multipliers 1.
    pub const ONE: BlockScales = BlockScales {
        mixer_residual: 1.0,
        mixer_out: 1.0,
        ffn_residual: 1.0,
        ffn_out: 1.0,
    };
}

/// Everything that distinguishes one decoder architecture from another.
#[derive(Debug, Clone)]
pub struct DecoderSpec {
    /// Vocabulary size: rows of the embedding table and the output head.
    pub vocab: i32,
    /// Model width.
    pub hidden: i32,
    /// Query heads.
    pub heads: i32,
    /// Key/value heads.
    pub kv_heads: i32,
    /// Width of one head.
    pub head_dim: i32,
    /// The kind of every norm of the model.
    pub norm: NormKind,
    /// The norms' epsilon.
    pub eps: f32,
    /// Biases on the q/k/v projections.
    pub qkv_bias: bool,
    /// A bias on the attention output projection.
    pub o_bias: bool,
    /// Biases on the MLP projections.
    pub mlp_bias: bool,
    /// Query/key normalisation.
    pub qk_norm: QkNormSpec,
    /// Multiplies the attention scores (`1/sqrt(head_dim)` unless the architecture says).
    pub attn_scale: f32,
    /// Soft-cap of the attention scores (Gemma 2's `attn_logit_softcapping`).
    pub attn_softcap: Option<f32>,
    /// Attention layers have per-head sinks (`self_attn.sinks`, gpt-oss).
    pub attn_sinks: bool,
    /// Attention layers gate their output with `sigmoid(self_attn.output_gate(x))` (Qwen3-Next).
    pub attn_output_gate: bool,
    /// The MLP activation.
    pub act: Activation,
    /// Where each block's norms sit.
    pub topology: BlockTopology,
    /// Per layer: token mixer.
    pub mixers: Vec<MixerSpec>,
    /// Per layer: rotary embedding of attention layers, `None` for no positional encoding.
    pub rope: Vec<Option<RopeConfig>>,
    /// Per layer: sliding window (keys per query), `None` for global attention.
    pub windows: Vec<Option<usize>>,
    /// Per layer: feed-forward block.
    pub ffn: Vec<FfnSpec>,
    /// Per layer: chunked local attention's block size (Llama 4), `None` for none.
    pub chunks: Vec<Option<usize>>,
    /// Per layer: the multipliers of a [`BlockTopology::NormedResidual`] block (unread by the
    /// other topologies).
    pub block_scales: Vec<BlockScales>,
    /// Per layer: a position-dependent query multiplier of attention layers (Llama 4's
    /// temperature tuning, Ministral 3's `llama_4_scaling_beta`), `None` for none.
    pub query_scales: Vec<Option<PositionScale>>,
    /// Multiplies the embeddings (Gemma: `sqrt(hidden)`, Granite: `embedding_multiplier`).
    pub embed_scale: Option<f64>,
    /// Multiplies each block's output before its residual add (Granite's `residual_multiplier`).
    pub residual_scale: Option<f64>,
    /// Multiplies the logits (Cohere's `logit_scale`, Granite's `1 / logits_scaling`).
    pub logit_scale: Option<f64>,
    /// Soft-cap of the output logits (Gemma 2's `final_logit_softcapping`).
    pub final_softcap: Option<f64>,
    /// The output head is the embedding table (no `lm_head` tensor).
    pub tie_word_embeddings: bool,
    /// The output head has a bias (`lm_head.bias`, also next to a tied table: ERNIE 4.5 with
    /// `use_bias`).
    pub lm_head_bias: bool,
    /// The multi-token-prediction layers stored after the decoder layers (built on request).
    pub mtp: Option<MtpSpec>,
}

impl DecoderSpec {
    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.mixers.len()
    }

    /// What each layer's cache holds.
    pub fn layer_schedule(&self) -> Vec<LayerKind> {
        self.mixers
            .iter()
            .zip(&self.windows)
            .map(|(mixer, window)| match (mixer, window) {
                (MixerSpec::Mamba(m), _) => LayerKind::Recurrent {
                    window: ((m.conv_kernel - 1) * m.dims.inner) as u64,
                    state: m.dims.inner as u64 * m.dims.state as u64,
                },
                (MixerSpec::Lightning(m), _) => LayerKind::Recurrent {
                    window: 0,
                    state: (m.heads * m.head_dim * m.head_dim) as u64,
                },
                (MixerSpec::Mamba2(m), _) => LayerKind::Recurrent {
                    window: ((m.conv_kernel - 1) * m.dims.conv_dim()) as u64,
                    state: (m.dims.inner * m.dims.state) as u64,
                },
                (MixerSpec::GatedDelta(m), _) => LayerKind::Recurrent {
                    window: ((m.conv_kernel - 1) * m.dims.conv_dim()) as u64,
                    state: (m.dims.value_heads * m.dims.key_dim * m.dims.value_dim) as u64,
                },
                (MixerSpec::AttentionWithMamba2(m), _) => LayerKind::AttentionAndState {
                    kv_heads: self.kv_heads,
                    head_dim: self.head_dim,
                    window: ((m.conv_kernel - 1) * m.dims.conv_dim()) as u64,
                    state: (m.dims.inner * m.dims.state) as u64,
                },
                (MixerSpec::RgLru(m), _) => LayerKind::Recurrent {
                    window: ((m.conv_kernel - 1) * m.width) as u64,
                    state: m.width as u64,
                },
                // Nothing to keep; an empty state cache moves on with the others.
                (MixerSpec::None, _) => LayerKind::Recurrent {
                    window: 0,
                    state: 0,
                },
                (MixerSpec::Latent(l), _) => LayerKind::LatentAttention {
                    latent: l.dims.kv_lora_rank,
                    rope: l.dims.qk_rope,
                },
                (MixerSpec::Attention, Some(w)) => LayerKind::SlidingAttention {
                    window: *w,
                    kv_heads: self.kv_heads,
                    head_dim: self.head_dim,
                },
                (MixerSpec::Attention, None) => LayerKind::GlobalAttention {
                    kv_heads: self.kv_heads,
                    head_dim: self.head_dim,
                },
            })
            .collect()
    }

    fn check(&self) -> Result<()> {
        let n = self.layers();
        if self.rope.len() != n
            || self.ffn.len() != n
            || self.windows.len() != n
            || self.query_scales.len() != n
            || self.chunks.len() != n
            || self.block_scales.len() != n
        {
            return Err(ModelError::Config(format!(
                "internal: {n} layers but {} rope, {} window, {} ffn, {} query-scale and {} chunk entries",
                self.rope.len(),
                self.windows.len(),
                self.ffn.len(),
                self.query_scales.len(),
                self.chunks.len()
            )));
        }
        let mixer_only = self.topology == BlockTopology::MixerOnly;
        // A MixerOnly layer has one branch, its mixer or (without a mixer) its feed-forward;
        // every other layer has both.
        if self.ffn.iter().zip(&self.mixers).any(|(f, m)| {
            let no_ffn = matches!(f, FfnSpec::None);
            let no_mixer = matches!(m, MixerSpec::None);
            if mixer_only {
                no_ffn == no_mixer
            } else {
                no_ffn || no_mixer
            }
        }) {
            return Err(ModelError::Config(
                "internal: a MixerOnly layer has a mixer or a feed-forward, other layers both"
                    .into(),
            ));
        }
        if self.kv_heads <= 0 || self.heads <= 0 || self.heads % self.kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "num_attention_heads {} is not a positive multiple of num_key_value_heads {}",
                self.heads, self.kv_heads
            )));
        }
        Ok(())
    }
}

// One mixer per layer, built once: the size difference costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Mixer {
    Attention(Attention),
    Latent(Box<LatentAttention>),
    Mamba(Box<MambaMixer>),
    Mamba2(Box<Mamba2Mixer>),
    Lightning(Box<LightningAttention>),
    GatedDelta(Box<GatedDeltaNet>),
    RgLru(Box<RgLruBlock>),
    AttentionWithMamba2(Box<(Attention, Mamba2Mixer)>),
    /// See [`MixerSpec::None`].
    None,
}

impl Mixer {
    fn forward(
        &self,
        x: &Array,
        norm: Option<&Norm>,
        residual: Option<&Array>,
        cache: &mut LayerCache,
        positions: Option<&Array>,
    ) -> Result<Array> {
        match self {
            Mixer::Attention(a) => a.forward(x, norm, residual, cache, positions),
            Mixer::Latent(a) => a.forward(x, norm, residual, cache, positions),
            // A state-space layer has no positions: it continues from its state.
            Mixer::Mamba(m) => m.forward(x, norm, residual, cache),
            Mixer::Mamba2(m) => m.forward(x, norm, residual, cache),
            Mixer::Lightning(m) => {
                let x = match norm {
                    Some(n) => n.forward(x)?,
                    None => x.clone(),
                };
                let y = m.forward(&x, cache)?;
                Ok(match residual {
                    Some(r) => r.add(&y)?,
                    None => y,
                })
            }
            Mixer::GatedDelta(m) => m.forward(x, norm, residual, cache),
            Mixer::RgLru(m) => m.forward(x, norm, residual, cache),
            Mixer::AttentionWithMamba2(pair) => {
                let (attention, mamba) = &**pair;
                let x = match norm {
                    Some(n) => n.forward(x)?,
                    None => x.clone(),
                };
                let (kv, state) = cache.pair_mut()?;
                let a = attention.forward(&x, None, None, kv, positions)?;
                let y = mamba.forward(&x, None, Some(&a), state)?;
                Ok(match residual {
                    Some(r) => r.add(&y)?,
                    None => y,
                })
            }
            Mixer::None => Err(ModelError::Runtime(
                "internal: a layer without a token mixer was asked to mix".into(),
            )),
        }
    }
}

// One feed-forward block per layer, built once: the size difference costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum FeedForward {
    Dense(Mlp),
    Moe(Box<MoeBlock>),
}

#[derive(Debug)]
struct MoeBlock {
    router: Router,
    experts: RoutedExperts,
    /// The shared expert and its optional sigmoid gate.
    shared: Option<(Mlp, Option<Linear>)>,
    /// See [`MoeSpec::scale_inputs`].
    scale_inputs: bool,
}

impl FeedForward {
    /// `residual + self(norm(x))` (see [`Mlp::forward_fused`]).
    fn forward_fused(
        &self,
        x: &Array,
        norm: Option<&Norm>,
        residual: Option<&Array>,
    ) -> Result<Array> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward_fused(x, norm, residual),
            FeedForward::Moe(moe) => {
                let x = match norm {
                    Some(n) => n.forward(x)?,
                    None => x.clone(),
                };
                let y = moe.forward(&x)?;
                Ok(match residual {
                    Some(r) => r.add(&y)?,
                    None => y,
                })
            }
        }
    }
}

impl MoeBlock {
    fn forward(&self, x: &Array) -> Result<Array> {
        let shape = x.shape();
        let d = shape[shape.len() - 1];
        let flat = x.reshape(&[-1, d])?;
        let (ids, weights) = self.router.route(&flat)?;
        let shared_out = match &self.shared {
            Some((mlp, gate)) => {
                let mut s = mlp.forward(&flat)?;
                if let Some(gate) = gate {
                    s = s.multiply(&gate.forward(&flat)?.sigmoid()?)?;
                }
                // Streamed experts are read from disk next: let the shared expert, which does
                // not depend on them, compute meanwhile.
                if self.experts.is_streamed() {
                    mlxcel_core::ops::async_eval_all([&s])?;
                }
                Some(s)
            }
            None => None,
        };
        let mut y = if self.scale_inputs {
            // Each (token, expert) pair runs its expert on the token scaled by the pair's
            // weight, as one routed row of its own; the rows of a token are summed.
            let (t, k) = (flat.dim(0)?, ids.dim(1)?);
            let scaled = flat
                .expand_dims(&[1])?
                .multiply(&weights.expand_dims(&[-1])?)?
                .reshape(&[t * k, d])?;
            let one = mlxcel_core::ops::ones(&[t * k, 1], weights.dtype()?)?;
            self.experts
                .combine(&scaled, &ids.reshape(&[t * k, 1])?, &one)?
                .reshape(&[t, k, d])?
                .sum(&[1], false)?
        } else {
            self.experts.combine(&flat, &ids, &weights)?
        };
        if let Some(s) = shared_out {
            y = y.add(&s)?;
        }
        Ok(y.reshape(&shape)?)
    }
}

/// A block's norms, by topology.
#[derive(Debug)]
enum BlockNorms {
    PreNorm {
        mixer_in: Norm,
        ffn_in: Norm,
    },
    Sandwich {
        mixer_in: Norm,
        mixer_out: Norm,
        ffn_in: Norm,
        ffn_out: Norm,
    },
    PostNorm {
        mixer_out: Norm,
        ffn_out: Norm,
    },
    Parallel {
        input: Norm,
    },
    ParallelTwoNorms {
        mixer_in: Norm,
        ffn_in: Norm,
    },
    MixerOnly {
        mixer_in: Norm,
    },
    NormedResidual {
        mixer_in: Norm,
        ffn_in: Norm,
        scales: BlockScales,
    },
}

#[derive(Debug)]
struct Block {
    norms: BlockNorms,
    mixer: Mixer,
    /// `None` exactly for [`BlockNorms::MixerOnly`] (see [`DecoderSpec::check`]).
    ffn: Option<FeedForward>,
    /// Tensor parallelism: the group the mixer's and feed-forward's partial sums are
    /// completed over (see [`crate::parallel`]).
    reduce: Option<mlxcel_core::distributed::Group>,
}

/// Advances a cache of a layer another pipeline stage computes by `l` positions of `b` rows,
/// with one-element placeholder keys and values (a state by its count alone).
fn keep_pace(cache: &mut LayerCache, b: i32, l: i32, dtype: mlxcel_core::Dtype) -> Result<()> {
    let placeholder = mlxcel_core::ops::zeros(&[b, 1, l, 1], dtype)?;
    match cache {
        LayerCache::State(c) => c.advance(l as usize),
        LayerCache::Latent(_) => {
            cache.update_latent(&placeholder, &placeholder)?;
        }
        LayerCache::Shared { .. } => {}
        LayerCache::Pair(pair) => {
            // Falcon-H1: the attention's keys and values, and the Mamba-2 state beside them.
            keep_pace(&mut pair.0, b, l, dtype)?;
            keep_pace(&mut pair.1, b, l, dtype)?;
        }
        _ => {
            cache.update(&placeholder, &placeholder, None)?;
        }
    }
    Ok(())
}

/// The whole logits `[.., vocab]` from every rank's rows `parts[r]` of the vocabulary (`part`
/// is this rank's `[.., parts[rank].len()]`): gathered along a leading axis (padded to the
/// widest part, as every rank must send the same shape), then put back in vocabulary order.
fn gather_vocab(
    group: &mlxcel_core::distributed::Group,
    parts: &[std::ops::Range<i32>],
    part: &Array,
) -> Result<Array> {
    let shape = part.shape();
    let n = shape.len();
    let widest = parts.iter().map(|r| r.end - r.start).max().unwrap_or(0);
    let mine = shape[n - 1];
    let padded = if mine < widest {
        let mut pad_shape = shape.clone();
        pad_shape[n - 1] = widest - mine;
        let pad = mlxcel_core::ops::zeros(&pad_shape, part.dtype()?)?;
        mlxcel_core::ops::concatenate(&[part.clone(), pad], (n - 1) as i32)?
    } else {
        part.clone()
    };
    // [.., widest] → [1, .., widest]: one slot per rank after the gather.
    let gathered = group.all_gather(&padded.expand_dims(&[0])?)?;
    let pieces = parts
        .iter()
        .enumerate()
        .map(|(r, range)| {
            let rank = gathered
                .slice_axis(0, r as i32, r as i32 + 1)?
                .squeeze(&[0])?;
            Ok(rank.slice_axis((n - 1) as i32, 0, range.end - range.start)?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(mlxcel_core::ops::concatenate(&pieces, (n - 1) as i32)?)
}

/// `residual + y` (`y` without a residual).
fn add_residual(y: Array, residual: Option<&Array>) -> Result<Array> {
    Ok(match residual {
        Some(r) => r.add(&y)?,
        None => y,
    })
}

/// `h + scale · y` (`h + y` without a scale).
fn add_scaled(h: &Array, y: &Array, scale: Option<f64>) -> Result<Array> {
    Ok(match scale {
        Some(s) => h.add(&y.mul_scalar(s)?)?,
        None => h.add(y)?,
    })
}

impl Block {
    /// `residual + mixer(norm(x))`, the partial sums of a tensor-parallel rank completed
    /// before the residual is added.
    fn mix(
        &self,
        x: &Array,
        norm: Option<&Norm>,
        residual: Option<&Array>,
        cache: &mut LayerCache,
        positions: Option<&Array>,
    ) -> Result<Array> {
        match &self.reduce {
            None => self.mixer.forward(x, norm, residual, cache, positions),
            Some(group) => {
                let part = self.mixer.forward(x, norm, None, cache, positions)?;
                add_residual(group.all_sum(&part)?, residual)
            }
        }
    }

    /// `residual + ffn(norm(x))`, completed over the ranks like [`Block::mix`].
    fn feed(
        &self,
        ffn: &FeedForward,
        x: &Array,
        norm: Option<&Norm>,
        residual: Option<&Array>,
    ) -> Result<Array> {
        match &self.reduce {
            None => ffn.forward_fused(x, norm, residual),
            Some(group) => {
                let part = ffn.forward_fused(x, norm, None)?;
                add_residual(group.all_sum(&part)?, residual)
            }
        }
    }

    fn forward(
        &self,
        h: &Array,
        cache: &mut LayerCache,
        positions: Option<&Array>,
        residual_scale: Option<f64>,
    ) -> Result<Array> {
        // A layer with no token mixer (Nemotron-H's feed-forward layers) is its feed-forward
        // block alone.
        if let (BlockNorms::MixerOnly { mixer_in }, Mixer::None, Some(ffn)) =
            (&self.norms, &self.mixer, &self.ffn)
        {
            // The layer's (empty) state cache moves on with the others' positions.
            if let LayerCache::State(s) = cache {
                s.advance(h.dim(1)? as usize);
            }
            return match residual_scale {
                None => self.feed(ffn, h, Some(mixer_in), Some(h)),
                Some(s) => add_scaled(h, &self.feed(ffn, h, Some(mixer_in), None)?, Some(s)),
            };
        }
        if let BlockNorms::MixerOnly { mixer_in } = &self.norms {
            return match residual_scale {
                None => self.mix(h, Some(mixer_in), Some(h), cache, positions),
                Some(s) => {
                    let r = self.mix(h, Some(mixer_in), None, cache, positions)?;
                    add_scaled(h, &r, Some(s))
                }
            };
        }
        let Some(ffn) = &self.ffn else {
            return Err(ModelError::Runtime(
                "internal: a block without a feed-forward outside MixerOnly".into(),
            ));
        };
        match (&self.norms, residual_scale) {
            (BlockNorms::PreNorm { mixer_in, ffn_in }, None) => {
                // The norms fold into the first projections and the residual adds into the
                // last ones where the kernels can.
                let h = self.mix(h, Some(mixer_in), Some(h), cache, positions)?;
                self.feed(ffn, &h, Some(ffn_in), Some(&h))
            }
            (BlockNorms::PreNorm { mixer_in, ffn_in }, Some(s)) => {
                let r = self.mix(h, Some(mixer_in), None, cache, positions)?;
                let h = add_scaled(h, &r, Some(s))?;
                add_scaled(&h, &self.feed(ffn, &h, Some(ffn_in), None)?, Some(s))
            }
            (
                BlockNorms::Sandwich {
                    mixer_in,
                    mixer_out,
                    ffn_in,
                    ffn_out,
                },
                s,
            ) => {
                let r = self.mix(h, Some(mixer_in), None, cache, positions)?;
                let h = add_scaled(h, &mixer_out.forward(&r)?, s)?;
                let f = self.feed(ffn, &ffn_in.forward(&h)?, None, None)?;
                add_scaled(&h, &ffn_out.forward(&f)?, s)
            }
            (BlockNorms::PostNorm { mixer_out, ffn_out }, s) => {
                let r = self.mix(h, None, None, cache, positions)?;
                let h = add_scaled(h, &mixer_out.forward(&r)?, s)?;
                let f = self.feed(ffn, &h, None, None)?;
                add_scaled(&h, &ffn_out.forward(&f)?, s)
            }
            (BlockNorms::Parallel { input }, s) => {
                let x = input.forward(h)?;
                let a = self.mix(&x, None, None, cache, positions)?;
                let f = self.feed(ffn, &x, None, None)?;
                add_scaled(h, &a.add(&f)?, s)
            }
            (BlockNorms::ParallelTwoNorms { mixer_in, ffn_in }, s) => {
                let a = self.mix(h, Some(mixer_in), None, cache, positions)?;
                let f = self.feed(ffn, h, Some(ffn_in), None)?;
                add_scaled(h, &a.add(&f)?, s)
            }
            (
                BlockNorms::NormedResidual {
                    mixer_in,
                    ffn_in,
                    scales,
                },
                _,
            ) => {
                let x = mixer_in.forward(h)?;
                let a = self.mix(&x, None, None, cache, positions)?;
                let h = x
                    .mul_scalar(scales.mixer_residual)?
                    .add(&a.mul_scalar(scales.mixer_out)?)?;
                let x = ffn_in.forward(&h)?;
                let f = self.feed(ffn, &x, None, None)?;
                Ok(x.mul_scalar(scales.ffn_residual)?
                    .add(&f.mul_scalar(scales.ffn_out)?)?)
            }
            (BlockNorms::MixerOnly { .. }, _) => unreachable!("returned above"),
        }
    }
}

/// A decoder built from a [`DecoderSpec`].
#[derive(Debug)]
pub struct Decoder {
    /// `None` on a pipeline stage that neither embeds nor has a tied head.
    embed: Option<Embedding>,
    /// This rank's blocks: every layer's, or a pipeline stage's from `first_layer` on.
    blocks: Vec<Block>,
    first_layer: usize,
    /// Pipeline parallelism: this rank's stage (see [`crate::parallel`]).
    stage: Option<Pipeline>,
    hidden: i32,
    dtype: mlxcel_core::Dtype,
    norm: Norm,
    lm_head: Option<Linear>,
    /// Tensor parallelism with an untied head: each rank's vocabulary rows of `lm_head`, in
    /// rank order; the logits are gathered from every rank's part.
    vocab_parallel: Option<(mlxcel_core::distributed::Group, Vec<std::ops::Range<i32>>)>,
    /// `lm_head.bias` added to a tied head's logits (an untied head carries its own).
    tied_head_bias: Option<Array>,
    embed_scale: Option<f64>,
    residual_scale: Option<f64>,
    logit_scale: Option<f64>,
    final_softcap: Option<f64>,
    vocab: usize,
    schedule: Vec<LayerKind>,
    /// The decode engine (CPU or CUDA), when one covers this decoder (see `decode_engine`).
    decode_engine: Option<decode_engine::DecodeEngine>,
    /// The multi-token-prediction layers, when built (see `mtp`).
    mtp: Option<mtp::Mtp>,
}

fn norm(w: &mut ModelWeights, spec: &DecoderSpec, name: &str, dim: i32) -> Result<Norm> {
    w.norm(name, spec.norm, dim, spec.eps)
}

/// The dense MLP under the open scope: `gate_proj`/`up_proj`/`down_proj` (`Plain`: `up_proj`
/// and `down_proj` only).
fn mlp(w: &mut ModelWeights, spec: &DecoderSpec, intermediate: i32, gated: bool) -> Result<Mlp> {
    let (h, b) = (spec.hidden, spec.mlp_bias);
    let act = match spec.act {
        // A learned activation: this layer's own parameters.
        Activation::XIelu(_) => Activation::XIelu(xielu_params(w)?),
        act => act,
    };
    // Tensor parallelism: this rank's intermediate columns (whole quantization groups of
    // `down_proj`'s inputs); the block's output is then a partial sum.
    let (columns, down_part) = match w.tensor_parallel() {
        Some(tp) => {
            let unit = w.input_unit("down_proj");
            let what = format!("`{}`", w.path("down_proj"));
            let cols = tp.columns(intermediate, unit, &what)?;
            let down = Split::Inputs {
                range: cols.clone(),
                with_bias: tp.rank() == 0,
            };
            (Some(Split::rows(cols)), Some(down))
        }
        None => (None, None),
    };
    let down =
        |w: &mut ModelWeights| w.linear_split("down_proj", intermediate, h, b, down_part.as_ref());
    if !gated {
        return Ok(Mlp::Plain {
            up: w.linear_split("up_proj", h, intermediate, b, columns.as_ref())?,
            down: down(w)?,
            act,
        });
    }
    let mut layers = w.linear_group_split(
        &["gate_proj", "up_proj"],
        h,
        &[intermediate, intermediate],
        b,
        &[columns.clone(), columns.clone()],
    )?;
    let down = down(w)?;
    Ok(match (layers.pop(), layers.pop()) {
        (Some(gate_up), None) => Mlp::FusedGated {
            hidden: match &columns {
                Some(Split::Outputs(rows)) => rows.iter().map(|r| r.end - r.start).sum(),
                _ => intermediate,
            },
            gate_up,
            down,
            act,
        },
        (Some(up), Some(gate)) => Mlp::Gated {
            gate,
            up,
            down,
            act,
        },
        _ => unreachable!("linear_group returns one layer or all of them"),
    })
}

/// xIELU's parameters under the open scope (`act_fn.{alpha_p,alpha_n,beta,eps}`, each one
/// value, stored as `[1]` or `[]`); `beta` and `eps` default to the published 0.5 and −1e-6.
fn xielu_params(w: &mut ModelWeights) -> Result<XIeluParams> {
    let mut scalar = |name: &str, default: Option<f32>| -> Result<f32> {
        let name = format!("act_fn.{name}");
        if let (Some(d), false) = (default, w.contains(&name)) {
            return Ok(d);
        }
        let v = w
            .tensor(&name, &[1])?
            .astype(mlxcel_core::Dtype::Float32)?
            .to_vec::<f32>()?;
        Ok(v[0])
    };
    let (alpha_p, alpha_n) = (scalar("alpha_p", None)?, scalar("alpha_n", None)?);
    let (beta, eps) = (scalar("beta", Some(0.5))?, scalar("eps", Some(-1e-6))?);
    Ok(XIeluParams::from_stored(alpha_p, alpha_n, beta, eps))
}

/// Grouped-query attention under the open scope (`self_attn`).
fn attention(w: &mut ModelWeights, spec: &DecoderSpec, layer: usize) -> Result<Attention> {
    let (h, hd) = (spec.hidden, spec.head_dim);
    let (q_dim, kv_dim) = (spec.heads * hd, spec.kv_heads * hd);
    // Tensor parallelism: this rank's query heads and the key/value heads they read; the
    // layer's output is then a partial sum (`o_proj` holds those heads' input columns).
    let heads = match w.tensor_parallel() {
        Some(tp) => {
            // A key/value head held by two ranks would count twice in the key norm's sum of
            // squares.
            let shares_kv = (spec.kv_heads as usize) < tp.size();
            if matches!(spec.qk_norm, QkNormSpec::Full) && shares_kv {
                return Err(ModelError::Unsupported(format!(
                    "tensor parallelism over {} ranks with a key norm over the whole projection needs at least as many key/value heads ({}) as ranks",
                    tp.size(),
                    spec.kv_heads
                )));
            }
            Some((tp.heads(spec.heads, spec.kv_heads)?, tp.rank() == 0))
        }
        None => None,
    };
    let all_q: Vec<i32> = (0..spec.heads).collect();
    let all_kv: Vec<i32> = (0..spec.kv_heads).collect();
    let (q_heads, kv_heads): (Vec<i32>, Vec<i32>) = match &heads {
        Some((split, _)) => (split.q.clone().collect(), split.kv.clone()),
        None => (all_q, all_kv),
    };
    let part = |on: &[i32], width: i32| {
        heads
            .as_ref()
            .map(|_| Split::Outputs(HeadSplit::rows(on, width)))
    };
    let q_split = part(&q_heads, hd);
    let kv_split = part(&kv_heads, hd);
    let o_split = heads.as_ref().map(|(split, first)| Split::Inputs {
        range: split.q.start * hd..split.q.end * hd,
        with_bias: *first,
    });
    let mut layers = w.linear_group_split(
        &["q_proj", "k_proj", "v_proj"],
        h,
        &[q_dim, kv_dim, kv_dim],
        spec.qkv_bias,
        &[q_split.clone(), kv_split.clone(), kv_split],
    )?;
    let qkv = match (layers.pop(), layers.pop(), layers.pop()) {
        (Some(qkv), None, None) => QkvProjection::Fused(qkv),
        (Some(v), Some(k), Some(q)) => QkvProjection::Separate { q, k, v },
        _ => unreachable!("linear_group returns one layer or all of them"),
    };
    let qk_norm = match spec.qk_norm {
        QkNormSpec::None => QkNorm::None,
        QkNormSpec::PerHead => QkNorm::PerHead {
            q: norm(w, spec, "q_norm", hd)?,
            k: norm(w, spec, "k_norm", hd)?,
        },
        QkNormSpec::PerHeadWeights => {
            let per_head = |w: &mut ModelWeights, name: &str, heads: i32, local: &[i32]| {
                let weight = w
                    .tensor_part(
                        &format!("{name}.weight"),
                        &[heads, hd],
                        0,
                        &HeadSplit::rows(local, 1),
                    )?
                    .reshape(&[local.len() as i32, 1, hd])?;
                Norm::new(spec.norm, weight, None, spec.eps)
            };
            QkNorm::PerHeadWeights {
                q: per_head(w, "q_norm", spec.heads, &q_heads)?,
                k: per_head(w, "k_norm", spec.kv_heads, &kv_heads)?,
            }
        }
        QkNormSpec::PerHeadAfterRope => QkNorm::PerHeadAfterRope {
            q: norm(w, spec, "q_norm", hd)?,
            k: norm(w, spec, "k_norm", hd)?,
        },
        QkNormSpec::WeightlessOnRopeLayers if spec.rope[layer].is_some() => {
            let ones = mlxcel_core::ops::ones(&[hd], w.dtype())?;
            QkNorm::PerHead {
                q: Norm::new(NormKind::Rms, ones.clone(), None, spec.eps)?,
                k: Norm::new(NormKind::Rms, ones, None, spec.eps)?,
            }
        }
        QkNormSpec::WeightlessOnRopeLayers => QkNorm::None,
        QkNormSpec::Full => match w.tensor_parallel() {
            None => QkNorm::Full {
                q: norm(w, spec, "q_norm", q_dim)?,
                k: norm(w, spec, "k_norm", kv_dim)?,
            },
            Some(tp) => {
                let group = tp.group().clone();
                let sharded = |w: &mut ModelWeights, name: &str, width: i32, local: &[i32]| {
                    let weight = w.tensor_part(
                        &format!("{name}.weight"),
                        &[width],
                        0,
                        &HeadSplit::rows(local, hd),
                    )?;
                    let norm = Norm::new(spec.norm, weight, None, spec.eps)?;
                    let Some((weight, eps)) = norm.rms_parts() else {
                        return Err(ModelError::Unsupported(
                            "tensor parallelism with a LayerNorm over the whole query/key projection".into(),
                        ));
                    };
                    w.keep_all([weight]);
                    Ok(ShardedRms {
                        weight: weight.clone(),
                        eps,
                        width,
                        group: group.clone(),
                    })
                };
                QkNorm::FullSharded {
                    q: sharded(w, "q_norm", q_dim, &q_heads)?,
                    k: sharded(w, "k_norm", kv_dim, &kv_heads)?,
                }
            }
        },
    };
    let rope = match &spec.rope[layer] {
        Some(cfg) => {
            let rope = RotaryEmbedding::new(cfg)?;
            w.keep_all(rope.arrays());
            Some(rope)
        }
        None => None,
    };
    let sinks = if spec.attn_sinks {
        if spec.attn_softcap.is_some() {
            return Err(ModelError::Unsupported(
                "attention sinks together with attention soft-capping".into(),
            ));
        }
        Some(w.tensor_part("sinks", &[spec.heads], 0, &HeadSplit::rows(&q_heads, 1))?)
    } else {
        None
    };
    let output_gate = if spec.attn_output_gate {
        Some(w.linear_split("output_gate", h, q_dim, spec.qkv_bias, q_split.as_ref())?)
    } else {
        None
    };
    Ok(Attention {
        sinks,
        qkv,
        output_gate,
        o: w.linear_split("o_proj", q_dim, h, spec.o_bias, o_split.as_ref())?,
        qk_norm,
        rope,
        cfg: AttentionConfig {
            n_heads: q_heads.len() as i32,
            n_kv_heads: kv_heads.len() as i32,
            head_dim: hd,
            scale: spec.attn_scale,
            softcap: spec.attn_softcap,
            window: spec.windows[layer],
            query_scale: spec.query_scales[layer],
            chunk: spec.chunks[layer],
        },
    })
}

/// Multi-head latent attention under the open scope (`self_attn`).
fn latent_attention(
    w: &mut ModelWeights,
    spec: &DecoderSpec,
    l: &LatentSpec,
) -> Result<LatentAttention> {
    let d = l.dims;
    let h = spec.hidden;
    let q_head = d.qk_nope + d.qk_rope;
    let q_width = d.heads * q_head;
    // Tensor parallelism: this rank's heads (the shared latent and its projection stay whole);
    // the output is then a partial sum.
    let heads = match w.tensor_parallel() {
        Some(tp) => Some((
            tp.columns(d.heads, 1, "latent attention heads")?,
            tp.rank() == 0,
        )),
        None => None,
    };
    let q_rows = heads
        .as_ref()
        .map(|(r, _)| Split::rows(r.start * q_head..r.end * q_head));
    let o_cols = heads.as_ref().map(|(r, first)| Split::Inputs {
        range: r.start * d.v_head..r.end * d.v_head,
        with_bias: *first,
    });
    let q = match l.q_lora_rank {
        Some(rank) => QueryProjection::LowRank {
            a: w.linear("q_a_proj", h, rank, l.bias)?,
            norm: w.norm("q_a_layernorm", NormKind::Rms, rank, spec.eps)?,
            b: w.linear_split("q_b_proj", rank, q_width, false, q_rows.as_ref())?,
        },
        None => {
            QueryProjection::Direct(w.linear_split("q_proj", h, q_width, false, q_rows.as_ref())?)
        }
    };
    let rope = RotaryEmbedding::new(&l.rope)?;
    w.keep_all(rope.arrays());
    let local = heads.as_ref().map(|(r, _)| r.clone());
    Ok(LatentAttention {
        q,
        kv_a: w.linear("kv_a_proj_with_mqa", h, d.kv_lora_rank + d.qk_rope, l.bias)?,
        kv_a_norm: w.norm("kv_a_layernorm", NormKind::Rms, d.kv_lora_rank, spec.eps)?,
        embed_q: w.dense_stack_part(
            "embed_q",
            &[d.heads, d.kv_lora_rank, d.qk_nope],
            local.clone(),
        )?,
        unembed_out: w.dense_stack_part(
            "unembed_out",
            &[d.heads, d.v_head, d.kv_lora_rank],
            local.clone(),
        )?,
        o: w.linear_split("o_proj", d.heads * d.v_head, h, l.bias, o_cols.as_ref())?,
        rope,
        dims: LatentDims {
            heads: local.map_or(d.heads, |r| r.end - r.start),
            ..d
        },
        scale: l.scale,
    })
}

/// A causal depthwise convolution `conv1d.{weight,bias}` over `channels` (the weight in
/// PyTorch's `[channels, 1, kernel]`; sanitisers bring MLX's `[channels, kernel, 1]` to it).
fn causal_conv(w: &mut ModelWeights, channels: i32, kernel: i32, bias: bool) -> Result<CausalConv> {
    let weight = w
        .tensor("conv1d.weight", &[channels, 1, kernel])?
        .reshape(&[channels, kernel])?
        .transpose(&[1, 0])?;
    let bias = if bias {
        Some(w.tensor("conv1d.bias", &[channels])?)
    } else {
        None
    };
    w.keep_all([&weight]);
    Ok(CausalConv { weight, bias })
}

/// `-exp(A_log)` and `D` in float32 (the scans run in float32).
fn ssm_parameters(w: &mut ModelWeights, a_shape: &[i32], d_len: i32) -> Result<(Array, Array)> {
    let f32 = mlxcel_core::Dtype::Float32;
    let a = w.tensor("A_log", a_shape)?.astype(f32)?.exp()?.negative()?;
    let d = w.tensor("D", &[d_len])?.astype(f32)?;
    w.keep_all([&a, &d]);
    Ok((a, d))
}

/// A Mamba-1 mixer under the open scope (`mixer`).
fn mamba_mixer(w: &mut ModelWeights, spec: &DecoderSpec, m: &MambaSpec) -> Result<MambaMixer> {
    let d = m.dims;
    let (a, skip) = ssm_parameters(w, &[d.inner, d.state], d.inner)?;
    let bcdt_norms = match m.bcdt_norms {
        Some(n) => {
            let mut rms = |name: &str, dim: i32| -> Result<PlainRms> {
                let weight = if n.weighted {
                    Some(w.tensor(&format!("{name}.weight"), &[dim])?)
                } else {
                    None
                };
                Ok(PlainRms { weight, eps: n.eps })
            };
            Some(BcdtNorms {
                dt: rms("dt_layernorm", d.dt_rank)?,
                b: rms("b_layernorm", d.state)?,
                c: rms("c_layernorm", d.state)?,
            })
        }
        None => None,
    };
    Ok(MambaMixer {
        in_proj: w.linear("in_proj", spec.hidden, 2 * d.inner, m.proj_bias)?,
        conv: causal_conv(w, d.inner, m.conv_kernel, m.conv_bias)?,
        x_proj: w.linear("x_proj", d.inner, d.dt_rank + 2 * d.state, false)?,
        dt_proj: w.linear("dt_proj", d.dt_rank, d.inner, true)?,
        a,
        d: skip,
        out_proj: w.linear("out_proj", d.inner, spec.hidden, m.proj_bias)?,
        bcdt_norms,
        dims: d,
    })
}

/// A Mamba-2 mixer under the open scope (`mixer`).
fn mamba2_mixer(w: &mut ModelWeights, spec: &DecoderSpec, m: &Mamba2Spec) -> Result<Mamba2Mixer> {
    let d = m.dims;
    if d.heads * d.head_dim != d.inner || d.groups <= 0 || d.heads % d.groups != 0 {
        return Err(ModelError::Config(format!(
            "num_heads {} × head_dim {} must equal the inner width {} and be a multiple of n_groups {}",
            d.heads, d.head_dim, d.inner, d.groups
        )));
    }
    let (a, skip) = ssm_parameters(w, &[d.heads], d.heads)?;
    let dt_bias = w
        .tensor("dt_bias", &[d.heads])?
        .astype(mlxcel_core::Dtype::Float32)?;
    w.keep_all([&dt_bias]);
    let in_width = d.inner + d.conv_dim() + d.heads;
    Ok(Mamba2Mixer {
        in_proj: w.linear("in_proj", spec.hidden, in_width, m.proj_bias)?,
        conv: causal_conv(w, d.conv_dim(), m.conv_kernel, m.conv_bias)?,
        dt_bias,
        a,
        d: skip,
        norm_weight: match m.gated_norm {
            GatedNorm::GateOnly => None,
            _ => Some(w.tensor("norm.weight", &[d.inner])?),
        },
        gated_norm: m.gated_norm,
        norm_eps: m.norm_eps,
        out_proj: w.linear("out_proj", d.inner, spec.hidden, m.proj_bias)?,
        dt_limit: m.dt_limit,
        dims: d,
    })
}

/// Griffin's recurrent block under the open scope (`mixer`).
fn rg_lru(w: &mut ModelWeights, spec: &DecoderSpec, m: &RgLruSpec) -> Result<RgLruBlock> {
    if m.heads <= 0 || m.width % m.heads != 0 {
        return Err(ModelError::Config(format!(
            "lru_width {} is not a multiple of num_attention_heads {}",
            m.width, m.heads
        )));
    }
    let (h, bw) = (spec.hidden, m.width / m.heads);
    let log_decay = RgLruBlock::log_decay_of(&w.tensor("rg_lru.recurrent_param", &[m.width])?)?;
    w.keep_all([&log_decay]);
    Ok(RgLruBlock {
        linear_y: w.linear("linear_y", h, m.width, true)?,
        linear_x: w.linear("linear_x", h, m.width, true)?,
        linear_out: w.linear("linear_out", m.width, h, true)?,
        conv: causal_conv(w, m.width, m.conv_kernel, true)?,
        input_gate_weight: w.tensor("rg_lru.input_gate_weight", &[m.heads, bw, bw])?,
        input_gate_bias: w.tensor("rg_lru.input_gate_bias", &[m.heads, bw])?,
        recurrent_gate_weight: w.tensor("rg_lru.recurrent_gate_weight", &[m.heads, bw, bw])?,
        recurrent_gate_bias: w.tensor("rg_lru.recurrent_gate_bias", &[m.heads, bw])?,
        log_decay,
        act: spec.act,
        heads: m.heads,
    })
}

/// A lightning-attention mixer under the open scope (`self_attn`).
fn lightning_attention(
    w: &mut ModelWeights,
    spec: &DecoderSpec,
    m: &LightningSpec,
) -> Result<LightningAttention> {
    let inner = m.heads * m.head_dim;
    let slope: Vec<f32> = m.slopes.iter().map(|s| *s as f32).collect();
    let slope = Array::from_slice(&slope, &[m.heads, 1, 1])?;
    w.keep_all([&slope]);
    Ok(LightningAttention {
        qkv: w.linear("qkv_proj", spec.hidden, 3 * inner, false)?,
        gate: w.linear("output_gate", spec.hidden, inner, false)?,
        norm: norm(w, spec, "norm", inner)?,
        out: w.linear("out_proj", inner, spec.hidden, false)?,
        act: spec.act,
        slope,
        heads: m.heads,
        head_dim: m.head_dim,
        block: m.block,
    })
}

/// A gated DeltaNet mixer under the open scope (`linear_attn`).
fn gated_delta(
    w: &mut ModelWeights,
    spec: &DecoderSpec,
    m: &GatedDeltaSpec,
) -> Result<GatedDeltaNet> {
    let d = m.dims;
    if d.key_heads <= 0 || d.value_heads % d.key_heads != 0 {
        return Err(ModelError::Config(format!(
            "linear_num_value_heads {} must be a multiple of linear_num_key_heads {}",
            d.value_heads, d.key_heads
        )));
    }
    let h = spec.hidden;
    let proj = match m.layout {
        DeltaLayout::PerKeyHead => DeltaProjections::PerKeyHead {
            qkvz: w.linear(
                "in_proj_qkvz",
                h,
                2 * d.key_width() + 2 * d.value_width(),
                false,
            )?,
            ba: w.linear("in_proj_ba", h, 2 * d.value_heads, false)?,
        },
        DeltaLayout::Separate => DeltaProjections::Separate {
            qkv: w.linear("in_proj_qkv", h, d.conv_dim(), false)?,
            z: w.linear("in_proj_z", h, d.value_width(), false)?,
            b: w.linear("in_proj_b", h, d.value_heads, false)?,
            a: w.linear("in_proj_a", h, d.value_heads, false)?,
        },
    };
    let f32 = mlxcel_core::Dtype::Float32;
    let a = w
        .tensor("A_log", &[d.value_heads])?
        .astype(f32)?
        .exp()?
        .negative()?;
    let dt_bias = w.tensor("dt_bias", &[d.value_heads])?.astype(f32)?;
    w.keep_all([&a, &dt_bias]);
    Ok(GatedDeltaNet {
        proj,
        conv: causal_conv(w, d.conv_dim(), m.conv_kernel, false)?,
        dt_bias,
        a,
        norm_weight: w.tensor("norm.weight", &[d.value_dim])?,
        norm_eps: m.norm_eps,
        out_proj: w.linear("out_proj", d.value_width(), h, false)?,
        dims: d,
    })
}

/// The feed-forward block under the open scope (`mlp`).
fn feed_forward(w: &mut ModelWeights, spec: &DecoderSpec, ffn: &FfnSpec) -> Result<FeedForward> {
    let h = spec.hidden;
    Ok(match ffn {
        FfnSpec::Dense { intermediate } => FeedForward::Dense(mlp(w, spec, *intermediate, true)?),
        FfnSpec::Plain { intermediate } => FeedForward::Dense(mlp(w, spec, *intermediate, false)?),
        FfnSpec::None => {
            return Err(ModelError::Config(
                "internal: no feed-forward block to build".into(),
            ))
        }
        FfnSpec::Moe(m) | FfnSpec::PlainMoe(m) => {
            let plain = matches!(ffn, FfnSpec::PlainMoe(_));
            let correction_bias = if m.correction_bias {
                let b = w.tensor("gate.e_score_correction_bias", &[m.experts])?;
                Some(b.astype(mlxcel_core::Dtype::Float32)?)
            } else {
                None
            };
            let router = Router {
                correction_bias,
                group_limit: m.group_limit,
                weight_scale: m.weight_scale,
                ..Router::top_k(
                    w.linear(m.router, h, m.experts, m.router_bias)?,
                    m.top_k,
                    m.scoring,
                    m.normalize,
                )
            };
            // Tensor parallelism: every expert's own intermediate columns of this rank, as a
            // dense MLP's (whole quantization groups of `down_proj`'s inputs).
            let columns = match w.tensor_parallel() {
                Some(tp) => {
                    let unit = w.input_unit("switch_mlp.down_proj");
                    let what = format!("`{}`", w.path("switch_mlp.down_proj"));
                    Some((tp.columns(m.intermediate, unit, &what)?, tp.rank() == 0))
                }
                None => None,
            };
            let mut experts = w.routed_experts_split(
                "",
                m.experts,
                h,
                m.intermediate,
                spec.act,
                !plain,
                columns.as_ref().map(|(c, _)| c.clone()),
            )?;
            if m.expert_bias {
                let RoutedExperts::Resident(glu) = &mut experts else {
                    return Err(ModelError::Unsupported(
                        "streaming experts whose projections have biases".into(),
                    ));
                };
                let dtype = w.dtype();
                let mut bias = |name: &str, width: i32| {
                    let name = format!("switch_mlp.{name}.bias");
                    match &columns {
                        Some((cols, _)) if width == m.intermediate => {
                            w.tensor_part(&name, &[m.experts, width], 1, std::slice::from_ref(cols))
                        }
                        _ => w.tensor(&name, &[m.experts, width]),
                    }
                };
                let down_bias = match &columns {
                    // The partial sums' bias: added by one rank only.
                    Some((_, false)) => {
                        bias("down_proj", h)?.multiply(&mlxcel_core::ops::zeros(&[1], dtype)?)?
                    }
                    _ => bias("down_proj", h)?,
                };
                glu.biases = Some(Box::new([
                    bias("gate_proj", m.intermediate)?,
                    bias("up_proj", m.intermediate)?,
                    down_bias,
                ]));
            }
            let shared = match m.shared {
                Some(s) => {
                    let gate = if s.gated {
                        Some(w.linear("shared_expert_gate", h, 1, false)?)
                    } else {
                        None
                    };
                    let mlp = mlp(&mut w.scope("shared_expert"), spec, s.intermediate, !plain)?;
                    Some((mlp, gate))
                }
                None => None,
            };
            FeedForward::Moe(Box::new(MoeBlock {
                router,
                experts,
                shared,
                scale_inputs: m.scale_inputs,
            }))
        }
    })
}

/// Refuses ids outside an embedding table of `vocab` rows (MLX's gather does not check
/// bounds, so an out-of-range id would read outside the table). Ids from the host are read
/// where they are; ids still being computed on the device (a sampled token fed back) come from
/// an argmax over the model's logits and cannot be out of range, and are not waited for.
pub(crate) fn check_token_ids(tokens: &Array, vocab: usize) -> Result<()> {
    if !tokens.is_available() {
        return Ok(());
    }
    let ids: Vec<i64> = match tokens.dtype()? {
        mlxcel_core::Dtype::Int32 => tokens.to_vec::<i32>()?.into_iter().map(i64::from).collect(),
        mlxcel_core::Dtype::Uint32 => tokens.to_vec::<u32>()?.into_iter().map(i64::from).collect(),
        other => {
            return Err(ModelError::Runtime(format!(
                "token ids must be int32 or uint32, not {other}"
            )))
        }
    };
    match ids.iter().position(|&t| t < 0 || t >= vocab as i64) {
        Some(i) => Err(ModelError::Runtime(format!(
            "token id {} at position {i} is outside the vocabulary (size {vocab})",
            ids[i]
        ))),
        None => Ok(()),
    }
}

/// Layer `i` of `spec` from the weights under `l`'s open scope (`model.layers.{i}`, or a
/// multi-token-prediction layer's): its mixer, feed-forward block and norms. `reduce`: the
/// tensor-parallel group its partial sums are completed over.
fn build_block(
    l: &mut ModelWeights,
    spec: &DecoderSpec,
    i: usize,
    reduce: Option<mlxcel_core::distributed::Group>,
) -> Result<Block> {
    let h = spec.hidden;
    let mixer = if let MixerSpec::AttentionWithMamba2(m) = &spec.mixers[i] {
        let attention = attention(&mut l.scope("self_attn"), spec, i)?;
        let mamba = mamba2_mixer(&mut l.scope("mamba"), spec, m)?;
        Mixer::AttentionWithMamba2(Box::new((attention, mamba)))
    } else {
        let mut a = l.scope(spec.mixers[i].scope());
        match &spec.mixers[i] {
            MixerSpec::Attention => Mixer::Attention(attention(&mut a, spec, i)?),
            MixerSpec::Latent(m) => Mixer::Latent(Box::new(latent_attention(&mut a, spec, m)?)),
            MixerSpec::Mamba(m) => Mixer::Mamba(Box::new(mamba_mixer(&mut a, spec, m)?)),
            MixerSpec::Mamba2(m) => Mixer::Mamba2(Box::new(mamba2_mixer(&mut a, spec, m)?)),
            MixerSpec::Lightning(m) => {
                Mixer::Lightning(Box::new(lightning_attention(&mut a, spec, m)?))
            }
            MixerSpec::GatedDelta(m) => Mixer::GatedDelta(Box::new(gated_delta(&mut a, spec, m)?)),
            MixerSpec::RgLru(m) => Mixer::RgLru(Box::new(rg_lru(&mut a, spec, m)?)),
            MixerSpec::None => Mixer::None,
            MixerSpec::AttentionWithMamba2(_) => unreachable!("built above"),
        }
    };
    let ffn = match &spec.ffn[i] {
        FfnSpec::None => None,
        f => Some(feed_forward(&mut l.scope("mlp"), spec, f)?),
    };
    let mut n = |name: &str| norm(l, spec, name, h);
    let norms = match spec.topology {
        BlockTopology::PreNorm => BlockNorms::PreNorm {
            mixer_in: n("input_layernorm")?,
            ffn_in: n("post_attention_layernorm")?,
        },
        BlockTopology::Sandwich => BlockNorms::Sandwich {
            mixer_in: n("input_layernorm")?,
            mixer_out: n("post_attention_layernorm")?,
            ffn_in: n("pre_feedforward_layernorm")?,
            ffn_out: n("post_feedforward_layernorm")?,
        },
        BlockTopology::PostNorm => BlockNorms::PostNorm {
            mixer_out: n("post_attention_layernorm")?,
            ffn_out: n("post_feedforward_layernorm")?,
        },
        BlockTopology::Parallel => BlockNorms::Parallel {
            input: n("input_layernorm")?,
        },
        BlockTopology::ParallelTwoNorms => BlockNorms::ParallelTwoNorms {
            mixer_in: n("input_layernorm")?,
            ffn_in: n("post_attention_layernorm")?,
        },
        BlockTopology::MixerOnly => BlockNorms::MixerOnly {
            mixer_in: n("input_layernorm")?,
        },
        BlockTopology::NormedResidual => BlockNorms::NormedResidual {
            mixer_in: n("input_layernorm")?,
            ffn_in: n("post_attention_layernorm")?,
            scales: spec.block_scales[i],
        },
    };
    Ok(Block {
        norms,
        mixer,
        ffn,
        reduce,
    })
}

impl Decoder {
    /// Builds the decoder from the weights under `w`'s open scope (`model.*` and `lm_head`).
    pub fn build(spec: &DecoderSpec, w: &mut ModelWeights) -> Result<Decoder> {
        spec.check()?;
        let h = spec.hidden;
        let tp_group = w.tensor_parallel().map(|tp| tp.group().clone());
        if tp_group.is_some() {
            if let Some(other) = spec.mixers.iter().find(|m| {
                // A layer without a mixer is its (split) feed-forward block alone.
                !matches!(
                    m,
                    MixerSpec::Attention | MixerSpec::Latent(_) | MixerSpec::None
                )
            }) {
                return Err(ModelError::Unsupported(format!(
                    "tensor parallelism covers grouped-query attention layers only, not {} layers (use pipeline parallelism)",
                    other.kind()
                )));
            }
        }
        let stage = match w.pipeline_plan() {
            Some(plan) => Some(plan.stage(spec.layers())?),
            None => None,
        };
        let own = stage.as_ref().map_or(0..spec.layers(), |s| s.layers());
        let (first, last) = stage
            .as_ref()
            .map_or((true, true), |s| (s.is_first(), s.is_last()));
        let tied = spec.tie_word_embeddings && !w.contains("lm_head.weight");
        let dtype = w.dtype();
        let mut body = w.scope("model");
        let embed = if first || (last && tied) {
            Some(body.embedding("embed_tokens", spec.vocab, h)?)
        } else {
            body.skip("embed_tokens");
            None
        };
        let mut blocks = Vec::with_capacity(own.len());
        let mtp;
        {
            let mut layers = body.scope("layers");
            for i in 0..spec.layers() {
                if !own.contains(&i) {
                    // Another pipeline stage's layer.
                    layers.skip(&i.to_string());
                    continue;
                }
                blocks.push(build_block(
                    &mut layers.scope(i),
                    spec,
                    i,
                    tp_group.clone(),
                )?);
            }
            if layers.wants_mtp() && (tp_group.is_some() || stage.is_some()) {
                return Err(ModelError::Unsupported(
                    "multi-token prediction of a model spread over several processes".into(),
                ));
            }
            mtp = mtp::Mtp::build(&mut layers, spec)?;
        }
        crate::nn::link_streamed_layers(blocks.iter_mut().filter_map(|b| match &mut b.ffn {
            Some(FeedForward::Moe(moe)) => {
                let MoeBlock {
                    router, experts, ..
                } = &mut **moe;
                Some((&*router, experts))
            }
            _ => None,
        }));
        let final_norm = norm(&mut body, spec, "norm", h)?;
        drop(body);
        // Tied heads reuse the embedding table (no second copy); an untied config without
        // `lm_head.weight` is an error naming the tensor.
        let mut vocab_parallel = None;
        let (lm_head, tied_head_bias) = if !last {
            w.skip("lm_head");
            (None, None)
        } else if tied {
            let bias = if spec.lm_head_bias {
                Some(w.tensor("lm_head.bias", &[spec.vocab])?)
            } else {
                None
            };
            (None, bias)
        } else if let Some(tp) = w.tensor_parallel() {
            // Vocabulary-parallel head: this rank's rows, the logits gathered.
            let (group, size, rank) = (tp.group().clone(), tp.size(), tp.rank());
            if (spec.vocab as usize) < size {
                return Err(ModelError::Unsupported(format!(
                    "tensor parallelism over {size} ranks: a vocabulary of {}",
                    spec.vocab
                )));
            }
            let parts: Vec<_> = (0..size)
                .map(|r| crate::parallel::even_part(spec.vocab, size, r))
                .collect();
            let rows = Split::rows(parts[rank].clone());
            let head = w.linear_split("lm_head", h, spec.vocab, spec.lm_head_bias, Some(&rows))?;
            vocab_parallel = Some((group, parts));
            (Some(head), None)
        } else {
            let head = w.linear("lm_head", h, spec.vocab, spec.lm_head_bias)?;
            (Some(head), None)
        };
        // The decode engines run the whole model in one process: a model split over ranks
        // (tensor-parallel partial sums, or one pipeline stage's layers) stays on the graph.
        let decode_engine = match (&embed, &tp_group, &stage) {
            (Some(embed), None, None) => {
                decode_engine::DecodeEngine::build(decode_engine::Parts {
                    spec,
                    blocks: &blocks,
                    embed,
                    lm_head: lm_head.as_ref(),
                    tied_head_bias: tied_head_bias.is_some(),
                    final_norm: &final_norm,
                })?
            }
            _ => None,
        };
        Ok(Decoder {
            embed,
            blocks,
            first_layer: own.start,
            stage,
            hidden: h,
            dtype,
            norm: final_norm,
            lm_head,
            vocab_parallel,
            tied_head_bias,
            decode_engine,
            mtp,
            embed_scale: spec.embed_scale,
            residual_scale: spec.residual_scale,
            logit_scale: spec.logit_scale,
            final_softcap: spec.final_softcap,
            vocab: spec.vocab as usize,
            schedule: spec.layer_schedule(),
        })
    }

    /// Token ids `[B, L]` → input hidden states `[B, L, hidden]`.
    pub fn embed(&self, tokens: &Array) -> Result<Array> {
        check_token_ids(tokens, self.vocab)?;
        let embed = match (&self.embed, &self.stage) {
            (Some(e), Some(s)) if s.is_first() => e,
            (Some(e), None) => e,
            // A later pipeline stage receives the hidden states instead: only their shape
            // counts.
            _ => {
                let shape = tokens.shape();
                return Ok(mlxcel_core::ops::zeros(
                    &[shape[0], shape[1], self.hidden],
                    self.dtype,
                )?);
            }
        };
        let h = embed.forward(tokens)?;
        Ok(match self.embed_scale {
            // In the activation dtype, as transformers rounds the normaliser.
            Some(s) => h.mul_scalar(s)?,
            None => h,
        })
    }

    /// Hidden states `[B, L, hidden]` through every block, extending `caches`.
    pub fn body(
        &self,
        mut h: Array,
        positions: Option<&Array>,
        caches: &mut [LayerCache],
    ) -> Result<Array> {
        if caches.len() != self.schedule.len() {
            return Err(ModelError::Runtime(format!(
                "{} caches for {} layers",
                caches.len(),
                self.schedule.len()
            )));
        }
        if let Some(stage) = &self.stage {
            return self.stage_body(stage, h, positions, caches);
        }
        for (block, cache) in self.blocks.iter().zip(caches.iter_mut()) {
            h = block.forward(&h, cache, positions, self.residual_scale)?;
        }
        Ok(h)
    }

    /// A pipeline stage's part of [`Decoder::body`]: the previous stage's hidden states in,
    /// this stage's layers, sent on to the next stage (the result of a stage before the last
    /// is the send, which must be evaluated). The other stages' layers' caches keep pace with
    /// placeholder entries, so every rank's caches agree on positions, windows and rewinds.
    fn stage_body(
        &self,
        stage: &Pipeline,
        mut h: Array,
        positions: Option<&Array>,
        caches: &mut [LayerCache],
    ) -> Result<Array> {
        let group = stage.group();
        let rank = group.rank();
        if !stage.is_first() {
            h = group.recv(&h.shape(), h.dtype()?, rank - 1)?;
        }
        let own = stage.layers();
        let shape = h.shape();
        for (i, cache) in caches.iter_mut().enumerate() {
            if own.contains(&i) {
                let block = &self.blocks[i - self.first_layer];
                h = block.forward(&h, cache, positions, self.residual_scale)?;
            } else {
                keep_pace(cache, shape[0], shape[1], self.dtype)?;
            }
        }
        if !stage.is_last() {
            h = group.send(&h, rank + 1)?;
        }
        Ok(h)
    }

    /// Logits of `h` from [`Decoder::body`] on every rank: the last pipeline stage computes
    /// them, the others contribute zeros (after their send) to one `all_sum`.
    fn stage_head(&self, stage: &Pipeline, h: &Array, last_only: bool) -> Result<Array> {
        let logits = if stage.is_last() {
            self.head(h, last_only)?
        } else {
            let shape = h.shape();
            let l = if last_only { 1 } else { shape[1] };
            let zeros = mlxcel_core::ops::zeros(&[shape[0], l, self.vocab as i32], self.dtype)?;
            let mut tied = mlxcel_core::distributed::depends(&[zeros], std::slice::from_ref(h))?;
            tied.pop()
                .ok_or_else(|| ModelError::Runtime("internal: depends returned nothing".into()))?
        };
        Ok(stage.group().all_sum(&logits)?)
    }

    /// Final norm and output head: logits for every position of `h`, or for the last one only.
    pub fn head(&self, h: &Array, last_only: bool) -> Result<Array> {
        let h = if last_only {
            let n = h.dim(1)?;
            h.slice_axis(1, n - 1, n)?
        } else {
            h.clone()
        };
        match &self.lm_head {
            Some(head) => {
                let part = head.forward_fused(&h, LinearInput::Normed(&self.norm), None)?;
                self.scale_logits(match &self.vocab_parallel {
                    Some((group, parts)) => gather_vocab(group, parts, &part)?,
                    None => part,
                })
            }
            None => self.project_normed(&self.norm.forward(&h)?),
        }
    }

    /// Logits of hidden states already through a final norm: the output head (the tied
    /// table, with its bias, when there is no `lm_head`), the logit scale and soft-cap.
    fn project_normed(&self, normed: &Array) -> Result<Array> {
        let logits = match &self.lm_head {
            Some(head) => head.forward(normed)?,
            None => {
                let embed = self.embed.as_ref().ok_or_else(|| {
                    ModelError::Runtime(
                        "internal: an output head on a pipeline stage without it".into(),
                    )
                })?;
                let logits = embed.as_linear(normed)?;
                match &self.tied_head_bias {
                    Some(b) => logits.add(b)?,
                    None => logits,
                }
            }
        };
        self.scale_logits(logits)
    }

    /// The logit scale and soft-cap the architecture applies after its output head.
    fn scale_logits(&self, mut logits: Array) -> Result<Array> {
        if let Some(s) = self.logit_scale {
            logits = logits.mul_scalar(s)?;
        }
        if let Some(cap) = self.final_softcap {
            logits = logits.mul_scalar(1.0 / cap)?.tanh()?.mul_scalar(cap)?;
        }
        Ok(logits)
    }

    /// The vocabulary size (rows of the output head).
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// What each layer's cache holds.
    pub fn layer_schedule(&self) -> Vec<LayerKind> {
        self.schedule.clone()
    }

    /// Whether every layer's mixer is key/value attention that takes a batch of conversations'
    /// caches ([`LayerCache::Batch`]).
    pub fn batched_decode(&self) -> bool {
        self.blocks
            .iter()
            .all(|b| matches!(&b.mixer, Mixer::Attention(a) if a.takes_batches()))
            && self.schedule.iter().all(|k| {
                matches!(
                    k,
                    LayerKind::GlobalAttention { .. } | LayerKind::SlidingAttention { .. }
                )
            })
    }
}

/// Implemented by each decoder architecture's `ModelArgs`: the spec its config implies and the
/// rewrites its checkpoints need. [`Transformer`] turns it into an [`Architecture`].
pub trait DecoderArgs: DeserializeOwned {
    /// The decoder this config describes; a [`ModelError::Config`] names a key with an unusable
    /// value, [`ModelError::Unsupported`] a feature this build lacks.
    fn spec(&self) -> Result<DecoderSpec>;

    /// See [`Architecture::sanitize`].
    fn sanitize(&self, _weights: &mut WeightMap, _quant: Option<&QuantConfig>) -> Result<()> {
        Ok(())
    }
}

/// A decoder architecture: `A` is the architecture's `ModelArgs`, which selects its spec and
/// sanitiser.
#[derive(Debug)]
pub struct Transformer<A> {
    /// The built decoder.
    pub decoder: Decoder,
    _args: PhantomData<fn() -> A>,
}

impl<A> Transformer<A> {
    /// Wraps a built decoder.
    pub fn new(decoder: Decoder) -> Self {
        Transformer {
            decoder,
            _args: PhantomData,
        }
    }
}

impl<A> LanguageModel for Transformer<A> {
    fn embed(&self, tokens: &Array) -> Result<Array> {
        self.decoder.embed(tokens)
    }

    fn forward_embeddings(
        &self,
        embeddings: &Array,
        positions: Option<&Array>,
        caches: &mut [LayerCache],
        last_only: bool,
    ) -> Result<Array> {
        if let Some(engine) = &self.decoder.decode_engine {
            if let Some(logits) = engine.step(embeddings, positions, caches)? {
                return Ok(logits);
            }
        }
        let h = self.decoder.body(embeddings.clone(), positions, caches)?;
        match &self.decoder.stage {
            Some(stage) => self.decoder.stage_head(stage, &h, last_only),
            None => self.decoder.head(&h, last_only),
        }
    }

    fn final_hidden_states(&self, embeddings: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        if self.decoder.stage.is_some() {
            return Err(ModelError::Unsupported(
                "final hidden states of a pipeline-parallel model".into(),
            ));
        }
        let h = self.decoder.body(embeddings.clone(), None, caches)?;
        self.decoder.norm.forward(&h)
    }

    fn vocab_size(&self) -> usize {
        self.decoder.vocab_size()
    }

    fn layer_schedule(&self) -> Vec<LayerKind> {
        self.decoder.layer_schedule()
    }

    fn batched_decode(&self) -> bool {
        self.decoder.batched_decode()
    }

    fn decodes_on_cpu_engine(&self) -> bool {
        self.decoder
            .decode_engine
            .as_ref()
            .is_some_and(decode_engine::DecodeEngine::on_cpu)
    }

    fn mtp(&self) -> Option<&dyn MultiTokenPrediction> {
        self.decoder
            .mtp
            .is_some()
            .then_some(&self.decoder as &dyn MultiTokenPrediction)
    }
}

impl<A: DecoderArgs> Architecture for Transformer<A> {
    type Args = A;

    fn sanitize(args: &A, weights: &mut WeightMap, quant: Option<&QuantConfig>) -> Result<()> {
        args.sanitize(weights, quant)
    }

    fn cache_schedule(args: &A) -> Result<Vec<LayerKind>> {
        Ok(args.spec()?.layer_schedule())
    }

    fn build(args: &A, w: &mut ModelWeights) -> Result<Self> {
        Ok(Transformer::new(Decoder::build(&args.spec()?, w)?))
    }
}
