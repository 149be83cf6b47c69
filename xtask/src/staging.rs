//! Writing a folder atomically: build it in a staging folder beside the destination, then
//! rename it into place, so an interrupted run never leaves a half-written model behind.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// A fresh staging folder next to `dest` (same file system, so the final rename is atomic).
pub fn staging_for(dest: &Path) -> Result<PathBuf> {
    let name = dest
        .file_name()
        .context("destination has no folder name")?
        .to_string_lossy();
    let staging = dest.with_file_name(format!(".{name}.staging-{}", std::process::id()));
    if staging.exists() {
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("removing stale {}", staging.display()))?;
    }
    std::fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;
    Ok(staging)
}

/// Moves `staging` to `dest`, replacing an older (incomplete or outdated) folder there.
pub fn publish(staging: &Path, dest: &Path) -> Result<()> {
    if dest.exists() {
        std::fs::remove_dir_all(dest).with_context(|| format!("removing {}", dest.display()))?;
    }
    std::fs::rename(staging, dest)
        .with_context(|| format!("moving {} to {}", staging.display(), dest.display()))
}
