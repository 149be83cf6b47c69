//! External per-layer-embedding tables (see `mlxcel_stream::ple`): opening the one a
//! model's `config.json` declares, what it holds in memory, and preparing or checking the view.

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;

use mlxcel_core::policy::PleIo;
use mlxcel_core::{RuntimePolicy, WeightMap};
use mlxcel_stream::ple::{self, PleLayout, PleStats, PleStorageConfig, PleStore, PrepareQuant};
use serde_json::Value;

use crate::Result;

/// The table a model reads from disk, and its counters.
#[derive(Debug, Clone)]
pub struct PlePlan {
    /// The store the model reads rows from.
    pub store: Rc<PleStore>,
    /// Hits, misses, bytes and read time (the stats line after a run).
    pub stats: Rc<RefCell<PleStats>>,
}

impl PlePlan {
    /// The line printed at start-up.
    pub fn describe(&self) -> String {
        describe(
            self.store.layout(),
            self.store.io(),
            self.store.resident_bytes(),
        )
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn describe(layout: &PleLayout, io: PleIo, resident: u64) -> String {
    let held = match io {
        PleIo::Ram => format!("the whole table in memory ({:.1} MiB)", mib(resident)),
        _ => format!(
            "a row cache of {:.1} MiB ({} rows)",
            mib(resident),
            resident / layout.record_bytes.max(1) as u64
        ),
    };
    format!(
        "[PLE table: {} rows × {} ({}), {:.1} MiB on disk; MLXCEL_PLE_IO={}, {held}]",
        layout.row_count,
        layout.row_width,
        layout.format.describe(),
        mib(layout.table_bytes()),
        io.name()
    )
}

/// The external table `config` (read from `folder/config.json`) declares, checked and
/// opened under `policy`'s `MLXCEL_PLE_IO` and `MLXCEL_PLE_CACHE_BYTES`; `None` when the
/// table is resident.
pub fn open(folder: &Path, config: &Value, policy: &RuntimePolicy) -> Result<Option<PlePlan>> {
    let Some(storage) = PleStorageConfig::from_config(config, &folder.join("config.json"))? else {
        return Ok(None);
    };
    let layout = PleLayout::open(folder, &storage)?;
    let store = PleStore::open(layout, policy.ple_io, policy.ple_cache_bytes)?;
    let stats = store.stats();
    Ok(Some(PlePlan {
        store: Rc::new(store),
        stats,
    }))
}

/// What an external table holds in memory under `policy` (the row cache, or the table in
/// `ram` mode) and the table's bytes on disk, without reading rows; `None` when the table is
/// resident. What `inspect` and `--estimate-memory` count.
pub fn footprint(
    folder: &Path,
    config: &Value,
    policy: &RuntimePolicy,
) -> Result<Option<(u64, u64)>> {
    let Some(storage) = PleStorageConfig::from_config(config, &folder.join("config.json"))? else {
        return Ok(None);
    };
    let layout = PleLayout::open(folder, &storage)?;
    Ok(Some((
        ple::resident_bytes(&layout, policy.ple_io, policy.ple_cache_bytes),
        layout.table_bytes(),
    )))
}

/// The line `inspect` prints for an external table (`None` when resident).
pub fn describe_footprint(
    folder: &Path,
    config: &Value,
    policy: &RuntimePolicy,
) -> Result<Option<String>> {
    let Some(storage) = PleStorageConfig::from_config(config, &folder.join("config.json"))? else {
        return Ok(None);
    };
    let layout = PleLayout::open(folder, &storage)?;
    let resident = ple::resident_bytes(&layout, policy.ple_io, policy.ple_cache_bytes);
    Ok(Some(describe(&layout, policy.ple_io, resident)))
}

/// Writes the external view of the per-layer-embedding table of the model in `folder` (see
/// `mlxcel_stream::ple::prepare`): rows as stored (the manifest points into the checkpoint) or
/// quantized to affine 4-bit g32 into a row file; `config.json` gains `ple_storage`.
pub fn prepare_external_ple(
    folder: &Path,
    quant: PrepareQuant,
    progress: impl FnMut(usize, usize),
) -> Result<PleLayout> {
    let folder = crate::resolve_model_dir(folder)?;
    let weights = WeightMap::open(&folder)?;
    Ok(ple::prepare(&folder, &weights, quant, progress)?)
}

/// Checks the external view of the model in `folder` in full (`prepare-external-ple
/// --verify`): the manifest, every row file's SHA-256, and every row against the checkpoint's
/// table while the checkpoint still has it.
pub fn verify_external_ple(folder: &Path) -> Result<PleLayout> {
    let folder = crate::resolve_model_dir(folder)?;
    let raw = std::fs::read_to_string(folder.join("config.json"))
        .map_err(|e| crate::LoadError::file(folder.join("config.json"), e.to_string()))?;
    let config: Value = serde_json::from_str(&raw)
        .map_err(|e| crate::LoadError::file(folder.join("config.json"), e.to_string()))?;
    let weights = WeightMap::open(&folder)?;
    Ok(ple::verify(&folder, &weights, &config)?)
}
