//! # mlxcel-stream
//!
//! Owns what keeps huge models off memory: routed-expert streaming from disk.
//!
//! - [`manifest`]: the prepared layout (one page-aligned blob per expert per MoE layer, a
//!   manifest with offsets, sizes, SHA-256s, per-expert xxh3s and source identity), its writer and
//!   its checks;
//! - [`arena`]: per MoE layer a slot arena of fixed capacity, the LRU/LFU cache policy, and
//!   bounded parallel `pread`s of missing experts, each checked against its hash;
//! - [`StreamConfig`]: the `MLXCEL_EXPERT_*` switches.
//!
//! External per-layer-embedding row storage is the other half of this crate's charter and is
//! not built yet.

pub mod arena;
pub mod manifest;

use std::path::{Path, PathBuf};

pub use arena::{CachePolicy, LayerStream, SlotMap, StreamStats};
pub use manifest::{Manifest, STREAM_DIR};

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Layout { path: PathBuf, message: String },
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Core(#[from] mlxcel_core::Error),
}

impl StreamError {
    pub(crate) fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        StreamError::Io {
            path: path.as_ref().to_path_buf(),
            source,
        }
    }
}

pub type Result<T, E = StreamError> = std::result::Result<T, E>;

/// When to stream (`MLXCEL_EXPERT_STREAM`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamMode {
    /// Stream when a prepared layout exists and the routed experts exceed half of the memory
    /// available.
    Auto,
    /// Always stream (the prepared layout must exist).
    On,
    Off,
}

/// The streaming switches, from the environment or set by a caller.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamConfig {
    pub mode: StreamMode,
    /// Total bytes for all layers' arenas (`MLXCEL_EXPERT_ARENA_BYTES`); `None`: sized from
    /// available memory.
    pub arena_bytes: Option<u64>,
    /// `MLXCEL_EXPERT_CACHE_POLICY` (`lfu` default, or `lru`).
    pub policy: CachePolicy,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            mode: StreamMode::Auto,
            arena_bytes: None,
            policy: CachePolicy::Lfu,
        }
    }
}

impl StreamConfig {
    pub fn from_env() -> Result<StreamConfig> {
        let mut c = StreamConfig::default();
        if let Ok(v) = std::env::var("MLXCEL_EXPERT_STREAM") {
            c.mode = match v.trim() {
                "" | "auto" => StreamMode::Auto,
                "1" | "on" => StreamMode::On,
                "0" | "off" => StreamMode::Off,
                other => {
                    return Err(StreamError::Config(format!(
                        "MLXCEL_EXPERT_STREAM={other}: expected auto, 1 or 0"
                    )))
                }
            };
        }
        if let Ok(v) = std::env::var("MLXCEL_EXPERT_ARENA_BYTES") {
            c.arena_bytes = Some(v.trim().parse().map_err(|_| {
                StreamError::Config(format!(
                    "MLXCEL_EXPERT_ARENA_BYTES={v}: expected a byte count"
                ))
            })?);
        }
        if let Ok(v) = std::env::var("MLXCEL_EXPERT_CACHE_POLICY") {
            c.policy = CachePolicy::from_name(&v).ok_or_else(|| {
                StreamError::Config(format!(
                    "MLXCEL_EXPERT_CACHE_POLICY={v}: expected lru or lfu"
                ))
            })?;
        }
        Ok(c)
    }

    /// Slots per layer for `manifest` given `available` bytes of memory (leaving room for the
    /// rest of the model and the KV cache: half of it when no budget is set), never fewer than
    /// `min_slots` (the router's top-k) nor more than the experts of a layer.
    pub fn slots_per_layer(&self, manifest: &Manifest, available: u64, min_slots: usize) -> usize {
        let budget = self.arena_bytes.unwrap_or(available / 2);
        let per_slot_all_layers: u64 = manifest
            .layers
            .iter()
            .map(|l| l.expert_stride)
            .sum::<u64>()
            .max(1);
        let max_experts = manifest.layers.iter().map(|l| l.experts).max().unwrap_or(0);
        ((budget / per_slot_all_layers) as usize)
            .clamp(min_slots.min(max_experts), max_experts.max(1))
    }
}
