//! MLX's allocator statistics and limits.

use crate::ffi::bridge;
use crate::Result;

/// Bytes held by live arrays.
pub fn active_bytes() -> Result<usize> {
    Ok(bridge::active_memory()?)
}

/// The high-water mark of [`active_bytes`] since start or the last [`reset_peak`].
pub fn peak_bytes() -> Result<usize> {
    Ok(bridge::peak_memory()?)
}

/// Restarts [`peak_bytes`] from the current [`active_bytes`].
pub fn reset_peak() -> Result<()> {
    Ok(bridge::reset_peak_memory()?)
}

/// Bytes freed by arrays but kept by MLX's buffer cache for reuse.
pub fn cache_bytes() -> Result<usize> {
    Ok(bridge::cache_memory()?)
}

/// Caps the buffer cache; returns the previous limit.
pub fn set_cache_limit(bytes: usize) -> Result<usize> {
    Ok(bridge::set_cache_limit(bytes)?)
}

/// Sets MLX's memory limit; returns the previous limit.
pub fn set_memory_limit(bytes: usize) -> Result<usize> {
    Ok(bridge::set_memory_limit(bytes)?)
}

/// Returns the buffer cache to the system.
pub fn clear_cache() -> Result<()> {
    Ok(bridge::clear_cache()?)
}
