//! The traits every architecture implements, and the per-layer cache schedule.

use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_quant::QuantConfig;
use serde::de::DeserializeOwned;

use crate::cache::LayerCache;
use crate::weights::ModelWeights;
use crate::Result;

/// What one layer keeps between tokens, with the widths that size it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Keys and values of every previous position.
    GlobalAttention {
        /// Key/value heads (`num_key_value_heads`).
        kv_heads: i32,
        /// Width of one head.
        head_dim: i32,
    },
    /// Keys and values of the last `window` positions (including the current one).
    SlidingAttention {
        /// Positions kept (`sliding_window`).
        window: usize,
        /// Key/value heads (`num_key_value_heads`).
        kv_heads: i32,
        /// Width of one head.
        head_dim: i32,
    },
    /// Multi-head latent attention: the compressed latent and the shared rope key per position.
    LatentAttention {
        /// Width of the compressed key/value latent (`kv_lora_rank`).
        latent: i32,
        /// Width of the shared rotary key (`qk_rope_head_dim`).
        rope: i32,
    },
    /// A recurrent (state-space) layer: a fixed-size convolution window and scan state, whatever
    /// the context length.
    Recurrent {
        /// Elements of the convolution window (`(kernel - 1) · channels`).
        window: u64,
        /// Elements of the scan state (float32 whatever the compute dtype).
        state: u64,
    },
    /// Attention over the keys and values of an earlier layer (KV sharing, Gemma 3n): holds
    /// nothing of its own ([`LayerCache::Shared`]).
    Shared {
        /// The layer whose keys and values it reads.
        source: usize,
    },
    /// Global attention and a recurrent mixer side by side in one layer (Falcon-H1): keys and
    /// values of every position, and a fixed-size window and state.
    AttentionAndState {
        /// Key/value heads.
        kv_heads: i32,
        /// Width of one head.
        head_dim: i32,
        /// Elements of the convolution window.
        window: u64,
        /// Elements of the scan state (float32).
        state: u64,
    },
}

impl LayerKind {
    /// Cache bytes one position costs this layer in `dtype`.
    pub fn bytes_per_token(&self, dtype: Dtype) -> u64 {
        let features = match *self {
            LayerKind::GlobalAttention { kv_heads, head_dim }
            | LayerKind::AttentionAndState {
                kv_heads, head_dim, ..
            }
            | LayerKind::SlidingAttention {
                kv_heads, head_dim, ..
            } => 2 * kv_heads as u64 * head_dim as u64,
            LayerKind::LatentAttention { latent, rope } => latent as u64 + rope as u64,
            LayerKind::Recurrent { .. } | LayerKind::Shared { .. } => 0,
        };
        features * dtype.size_of() as u64
    }

    /// Cache bytes this layer holds whatever the context (a recurrent layer's window in `dtype`
    /// and its float32 state); 0 for attention layers.
    pub fn fixed_bytes(&self, dtype: Dtype) -> u64 {
        match *self {
            LayerKind::Recurrent { window, state }
            | LayerKind::AttentionAndState { window, state, .. } => {
                window * dtype.size_of() as u64 + state * Dtype::Float32.size_of() as u64
            }
            _ => 0,
        }
    }

    /// Whether the layer's cache is a recurrent state, which cannot be cut back to an earlier
    /// position (prefix reuse restores a snapshot instead).
    pub fn is_recurrent(&self) -> bool {
        matches!(
            self,
            LayerKind::Recurrent { .. } | LayerKind::AttentionAndState { .. }
        )
    }

    /// Positions this layer's cache holds after `context` tokens processed in chunks of
    /// `chunk`: all of them, or a ring's window plus one chunk.
    pub fn rows_held(&self, context: u64, chunk: u64) -> u64 {
        match *self {
            LayerKind::SlidingAttention { window, .. } => context.min(window as u64 + chunk),
            _ => context,
        }
    }

    /// A fresh cache for this layer.
    pub fn new_cache(&self) -> LayerCache {
        match *self {
            LayerKind::GlobalAttention { .. } => LayerCache::standard(),
            LayerKind::SlidingAttention { window, .. } => LayerCache::rotating(window),
            LayerKind::LatentAttention { .. } => LayerCache::latent(),
            LayerKind::Recurrent { .. } => LayerCache::state(),
            LayerKind::Shared { source } => LayerCache::shared(source),
            LayerKind::AttentionAndState { .. } => LayerCache::attention_and_state(),
        }
    }
}

/// A loaded text model: token ids (or input embeddings) in, next-token logits out. The forward
/// pass is split in three so other towers can feed the decoder: [`LanguageModel::embed`]
/// (ids → hidden states), [`LanguageModel::forward_embeddings`] (hidden states → logits).
///
/// Typical use, with a checkpoint loaded through `mlxcel_loading::load_model` (a
/// [`crate::GenerationModel`] implements this trait):
///
/// ```no_run
/// use mlxcel_arch::{LanguageModel, LoadedModel};
/// use mlxcel_core::Array;
///
/// fn next_token(loaded: &LoadedModel, prompt: &[i32]) -> mlxcel_arch::Result<u32> {
///     let model = loaded.generation()?;
///     let mut caches = model.make_caches(); // one per layer
///     let tokens = Array::from_slice(prompt, &[1, prompt.len() as i32])?; // [B = 1, L]
///     let logits = model.forward_last(&tokens, &mut caches)?; // [1, 1, vocab]
///     mlxcel_arch::generate::argmax_token(&logits.reshape(&[-1])?)
/// }
/// ```
pub trait LanguageModel {
    /// Token ids `[B, L]` (int32) → input hidden states `[B, L, hidden]`, scaled as the
    /// architecture scales its embeddings.
    fn embed(&self, tokens: &Array) -> Result<Array>;

    /// Input hidden states `[B, L, hidden]` → logits `[B, L, vocab]` (or `[B, 1, vocab]` for
    /// the last position only when `last_only`: prefill needs no others, and the output head is
    /// a large share of a prompt's compute), extending `caches` (one per layer, from
    /// [`LanguageModel::make_caches`]). `positions` `[L]` (int32) gives the rotary position of
    /// each input row; `None` continues from the caches' offset.
    fn forward_embeddings(
        &self,
        embeddings: &Array,
        positions: Option<&Array>,
        caches: &mut [LayerCache],
        last_only: bool,
    ) -> Result<Array>;

    /// `tokens` `[B, L]` (int32) → logits `[B, L, vocab]`.
    fn forward(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        self.forward_embeddings(&self.embed(tokens)?, None, caches, false)
    }

    /// Like [`LanguageModel::forward`] but only the last position's logits `[B, 1, vocab]`.
    fn forward_last(&self, tokens: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        self.forward_embeddings(&self.embed(tokens)?, None, caches, true)
    }

    /// Input hidden states `[B, L, hidden]` → the hidden states after the final norm
    /// `[B, L, hidden]` (no output head), under causal attention over `caches` (fresh ones for a
    /// whole text): what a decoder-based embedder (Qwen3-Embedding) pools. The default says the
    /// architecture does not expose them.
    fn final_hidden_states(&self, embeddings: &Array, caches: &mut [LayerCache]) -> Result<Array> {
        let _ = (embeddings, caches);
        Err(crate::ModelError::Unsupported(
            "this architecture does not expose its final hidden states (decoder embedding)".into(),
        ))
    }

    /// Rows of the output head: the size of the last logits axis (token ids must be below it).
    fn vocab_size(&self) -> usize;

    /// The model's vision side when it was loaded with a vision tower (a vision-language
    /// checkpoint not loaded text-only); `None` for text models.
    fn vision(&self) -> Option<&dyn crate::vision::VisionLanguage> {
        None
    }

    /// A hint from chunked prefill that the next pass will run `next_tokens`: a model that reads
    /// per-token data from disk (an external per-layer-embedding table) starts reading it while
    /// the current pass computes (gather-ahead). The default has nothing to read.
    fn prefetch(&self, next_tokens: &[u32]) -> Result<()> {
        let _ = next_tokens;
        Ok(())
    }

    /// Whether one forward pass can advance several conversations by one token each, every
    /// layer given a [`LayerCache::Batch`] of their caches ([`crate::generate::DecodeBatch`]):
    /// true when every layer is key/value attention with fixed rope frequencies. Others
    /// (state-space, latent and shared caches) decode each conversation on its own.
    fn batched_decode(&self) -> bool {
        false
    }

    /// Whether a single-token step of one conversation runs on mlxcel's CPU decode engine (one
    /// call per token; `MLXCEL_CPU_DECODE`), which a decode batch never reaches: a lone
    /// generation then decodes on its own caches.
    fn decodes_on_cpu_engine(&self) -> bool {
        false
    }

    /// The checkpoint's multi-token-prediction layers, when they were built
    /// (`BuildOptions::mtp`): self-speculative decoding drafts tokens with them. `None` for
    /// the others.
    fn mtp(&self) -> Option<&dyn MultiTokenPrediction> {
        None
    }

    /// One entry per layer: what its cache holds.
    fn layer_schedule(&self) -> Vec<LayerKind>;

    /// Fresh caches, one per layer, of the kinds [`LanguageModel::layer_schedule`] names.
    fn make_caches(&self) -> Vec<LayerCache> {
        self.layer_schedule()
            .iter()
            .map(LayerKind::new_cache)
            .collect()
    }

    /// Cache bytes one more position of context costs, over all layers (windowed layers
    /// included at full size: an upper bound once a ring is full).
    fn cache_bytes_per_token(&self, dtype: Dtype) -> u64 {
        self.layer_schedule()
            .iter()
            .map(|k| k.bytes_per_token(dtype))
            .sum()
    }
}

/// A model's multi-token-prediction (MTP) layers: DeepSeek-V3-style blocks that predict the
/// token after next from the model's own hidden state at a position and the embedding of the
/// token after it. Layer `d` (depth) combines `enorm(embed(t[i+1]))` and `hnorm(h[i])` through
/// `eh_proj`, runs one decoder block (its own cache) and the output head after its own norm;
/// depth `d + 1` reads depth `d`'s block output as its `h`. Speculative decoding proposes with
/// them and checks the proposals with the model itself, so the output stays the model's.
pub trait MultiTokenPrediction {
    /// How many MTP layers the checkpoint carries (`num_nextn_predict_layers`).
    fn mtp_layers(&self) -> usize;

    /// Fresh caches, one per MTP layer.
    fn mtp_caches(&self) -> Vec<LayerCache>;

    /// Token ids `[1, L]` through the model, extending `caches`: the logits `[1, L, vocab]`
    /// (or of the last position, `[1, 1, vocab]`, with `last_only`) and the hidden states
    /// after the final norm `[1, L, hidden]` (all positions), which the MTP layers read.
    fn forward_with_hidden(
        &self,
        tokens: &Array,
        caches: &mut [LayerCache],
        last_only: bool,
    ) -> Result<(Array, Array)>;

    /// MTP layer `depth` over `L` positions: `hidden` `[1, L, hidden]` (the model's at those
    /// positions, or the previous depth's output), `next_tokens` `[1, L]` (the token after
    /// each position), `positions` `[L]` (int32; where each row sits, for rope), extending
    /// `cache`. Returns the logits `[1, L, vocab]` for the token after `next_tokens` and the
    /// block's output `[1, L, hidden]` (the next depth's `hidden`).
    fn mtp_forward(
        &self,
        depth: usize,
        hidden: &Array,
        next_tokens: &Array,
        positions: &Array,
        cache: &mut LayerCache,
    ) -> Result<(Array, Array)>;
}

/// How a config-backed architecture is built: its `ModelArgs`, its checkpoint quirks, its
/// construction from named tensors. Each kind adds its own trait on top ([`LanguageModel`] for
/// generation, [`crate::EmbeddingModel`] for encoders, which return no cache schedule).
pub trait Architecture: Sized {
    /// Deserialised from the sanitised `config.json`.
    type Args: DeserializeOwned;

    /// Rewrites the checkpoint's spellings into the canonical layout the builder reads (fused
    /// projections split, per-expert tensors stacked, module names unified) before
    /// construction. `quant` is the checkpoint's quantization, for rewrites of packed tensors.
    fn sanitize(
        _args: &Self::Args,
        _weights: &mut WeightMap,
        _quant: Option<&QuantConfig>,
    ) -> Result<()> {
        Ok(())
    }

    /// The per-layer cache schedule the config implies, without building the model (memory
    /// estimates).
    fn cache_schedule(args: &Self::Args) -> Result<Vec<LayerKind>>;

    /// Builds the model; `weights` is scoped at the model's root (`""` for a text checkpoint,
    /// e.g. `language_model` inside a vision-language one).
    fn build(args: &Self::Args, weights: &mut ModelWeights) -> Result<Self>;
}
