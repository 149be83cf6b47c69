//! # mlxcel-stream
//!
//! Owns what keeps huge models off memory: routed-expert streaming from disk and external
//! per-layer-embedding rows.
//!
//! - [`manifest`]: the prepared layout (one page-aligned blob per expert per MoE layer, a
//!   manifest with offsets, sizes, SHA-256s, per-expert xxh3s and source identity), its writer and
//!   its checks;
//! - [`arena`]: per MoE layer a slot arena of fixed capacity, the LRU/LFU cache policy, and
//!   bounded parallel `pread`s of missing experts, each checked against its hash;
//! - [`StreamConfig`]: the `MLXCEL_EXPERT_*` switches (from [`mlxcel_core::RuntimePolicy`]).
//!
//! - [`ple`]: external per-layer-embedding storage: mlx-vlm's v2 manifest, rows read on demand
//!   (`MLXCEL_PLE_IO`, an LRU row cache, gather-ahead), `prepare-external-ple`'s writer;
//! - [`io`]: what both share: exact and `O_DIRECT` reads, bounded parallel reads, SHA-256.

#![warn(missing_docs)]

pub mod arena;
pub mod io;
pub mod manifest;
pub mod ple;

use std::path::{Path, PathBuf};

pub use arena::{CachePolicy, ExpertIo, Fetched, LayerStream, SlotMap, StreamStats};
pub use manifest::{Manifest, STREAM_DIR};
/// When to stream (`MLXCEL_EXPERT_STREAM`).
pub use mlxcel_core::policy::StreamMode;

/// Errors of expert streaming; each names the file at fault where there is one.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// A stream file, manifest or checkpoint shard could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The prepared layout is malformed, stale (the checkpoint changed since it was prepared)
    /// or corrupt (a hash mismatch), or a request does not fit it (more experts than slots, an
    /// expert out of range). The message says which, and how to remake the layout.
    #[error("{path}: {message}")]
    Layout {
        /// The manifest, stream file or checkpoint file concerned.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A streaming setting is invalid or cannot be honoured; the message says which.
    #[error("{0}")]
    Config(String),
    /// MLX or checkpoint I/O failed underneath.
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

/// `Result` with this crate's [`StreamError`].
pub type Result<T, E = StreamError> = std::result::Result<T, E>;

/// The streaming switches, from the runtime policy or set by a caller.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamConfig {
    /// When to stream (`MLXCEL_EXPERT_STREAM`).
    pub mode: StreamMode,
    /// Total bytes for all layers' arenas (`MLXCEL_EXPERT_ARENA_BYTES`); `None`: sized from
    /// available memory.
    pub arena_bytes: Option<u64>,
    /// `MLXCEL_EXPERT_CACHE_POLICY` (`lfu` default, or `lru`).
    pub policy: CachePolicy,
    /// `MLXCEL_EXPERT_IO` (`direct` default, `dontneed` or `cached`).
    pub io: ExpertIo,
    /// `MLXCEL_EXPERT_PREFETCH` (default on): decode steps read the next streamed layer's
    /// predicted experts ahead.
    pub prefetch: bool,
    /// `MLXCEL_EXPERT_IN_PLACE` (default on): experts read from disk are copied straight into
    /// their arena slots where the arena's buffer is its own, else through MLX's `slice_update`.
    pub in_place: bool,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            mode: StreamMode::Auto,
            arena_bytes: None,
            policy: CachePolicy::Lfu,
            io: ExpertIo::Direct,
            prefetch: true,
            in_place: true,
        }
    }
}

impl StreamConfig {
    /// The policy's `MLXCEL_EXPERT_*` switches.
    pub fn from_policy(policy: &mlxcel_core::RuntimePolicy) -> StreamConfig {
        StreamConfig {
            mode: policy.expert_stream,
            arena_bytes: policy.expert_arena_bytes,
            policy: policy.expert_cache_policy,
            io: policy.expert_io,
            prefetch: policy.expert_prefetch,
            in_place: policy.expert_in_place,
        }
    }

    /// [`StreamConfig::from_policy`] of [`RuntimePolicy::from_env`](mlxcel_core::RuntimePolicy::from_env)
    /// (which parses, and checks, every runtime variable).
    pub fn from_env() -> Result<StreamConfig> {
        Ok(StreamConfig::from_policy(
            &mlxcel_core::RuntimePolicy::from_env()?,
        ))
    }

    /// Slots per layer for `manifest` given `available` bytes of memory (leaving room for the
    /// rest of the model and the KV cache: half of it when no budget is set), never fewer than
    /// `min_slots` (the router's top-k) nor more than the experts of a layer.
    pub fn slots_per_layer(&self, manifest: &Manifest, available: u64, min_slots: usize) -> usize {
        let budget = self.arena_bytes.unwrap_or(available / 2);
        let per_slot_all_layers: u64 = manifest
            .layers
            .iter()
            .fold(0u64, |acc, l| acc.saturating_add(l.expert_stride))
            .max(1);
        let max_experts = manifest.layers.iter().map(|l| l.experts).max().unwrap_or(0);
        ((budget / per_slot_all_layers) as usize)
            .clamp(min_slots.min(max_experts), max_experts.max(1))
    }
}
