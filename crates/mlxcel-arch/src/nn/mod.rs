//! Building blocks shared by the architectures: linear layers (dense or quantized), embeddings,
//! norms, rotary embeddings, attention, MLPs, mixture-of-experts layers, state-space and
//! linear-attention (gated DeltaNet) mixers, Griffin's RG-LRU block and
//! runtime LoRA adapters.

mod attention;
pub mod calibration;
pub mod gated_delta;
pub mod griffin;
mod lightning;
mod linear;
pub mod lora;
mod mla;
mod mlp;
mod moe;
mod norm;
mod prefill_dense;
mod rope;
pub mod ssm;

pub use attention::{Attention, AttentionConfig, PositionScale, QkNorm, QkvProjection, ShardedRms};
pub use gated_delta::{DeltaProjections, GatedDeltaDims, GatedDeltaNet};
pub use lightning::{lightning_slopes, LightningAttention};
pub use linear::{dequantize_rows_threshold, Embedding, Linear, LinearInput, SwitchLinear};
pub use mla::{LatentAttention, LatentDims, QueryProjection};
pub use mlp::{Activation, Mlp, XIeluParams, OAI_SWIGLU_ALPHA, OAI_SWIGLU_LIMIT};
pub use moe::{
    link_streamed_layers, GroupLimit, GroupScore, NextStreamed, RoutedExperts, Router,
    RouterScoring, StreamedGlu, SwitchGlu,
};
pub use norm::{Norm, NormKind};
pub use prefill_dense::{prefill_dense_bytes_kept, PrefillDense};
pub use rope::{RopeConfig, RotaryEmbedding};
pub use ssm::{Mamba2Mixer, MambaMixer};
