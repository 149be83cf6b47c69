//! The traits every architecture implements, and the layer schedule that decides caches.

use mlxcel_core::{Array, WeightMap};
use serde::de::DeserializeOwned;

use crate::cache::KvCache;
use crate::weights::ModelWeights;
use crate::Result;

/// What kind of state a layer keeps between tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Attention over every previous position.
    GlobalAttention,
    /// Attention over the last `window` positions (including the current one).
    SlidingAttention { window: usize },
}

/// A loaded text model: token ids in, next-token logits out.
pub trait LanguageModel {
    /// `tokens` `[B, L]` (int32) → logits `[B, L, vocab]`, extending `caches` (one per layer,
    /// from [`LanguageModel::make_caches`]).
    fn forward(&self, tokens: &Array, caches: &mut [KvCache]) -> Result<Array>;

    /// Like [`LanguageModel::forward`] but only the last position's logits `[B, 1, vocab]`
    /// (prefill and decoding need no others).
    fn forward_last(&self, tokens: &Array, caches: &mut [KvCache]) -> Result<Array> {
        let logits = self.forward(tokens, caches)?;
        let n = logits.dim(1)?;
        Ok(logits.slice_axis(1, n - 1, n)?)
    }

    fn vocab_size(&self) -> usize;

    /// One entry per layer.
    fn layer_schedule(&self) -> Vec<LayerKind>;

    /// Fresh caches: rings for sliding-window layers, growing buffers for global ones.
    fn make_caches(&self) -> Vec<KvCache> {
        self.layer_schedule()
            .into_iter()
            .map(|kind| match kind {
                LayerKind::GlobalAttention => KvCache::standard(),
                LayerKind::SlidingAttention { window } => KvCache::rotating(window),
            })
            .collect()
    }
}

/// How a config-backed architecture is built: its `ModelArgs`, its checkpoint quirks, its
/// construction from named tensors.
pub trait Architecture: LanguageModel + Sized {
    /// Deserialised from the sanitised `config.json`.
    type Args: DeserializeOwned;

    /// Rewrites checkpoint quirks in place before construction.
    fn sanitize(_args: &Self::Args, _weights: &mut WeightMap) -> Result<()> {
        Ok(())
    }

    fn build(args: &Self::Args, weights: &mut ModelWeights) -> Result<Self>;
}
