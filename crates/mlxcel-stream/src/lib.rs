//! # mlxcel-stream
//!
//! Owns what keeps huge models off memory: routed-expert streaming from disk (slot arena, cache
//! policy, bounded parallel reads, prepared stream files) and external per-layer-embedding row
//! storage.
