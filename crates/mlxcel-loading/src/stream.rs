//! Whether a model's routed experts stream from disk, and preparing the stream files.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use mlxcel_arch::detection::get_model_type;
use mlxcel_arch::sanitized_weights;
use mlxcel_arch::weights::ExpertStreamSetup;
use mlxcel_core::WeightMap;
use mlxcel_stream::{manifest, Manifest, StreamConfig, StreamMode, StreamStats};
use serde_json::Value;

use crate::{LoadError, Result};

/// The decision to stream, and its arena.
#[derive(Debug, Clone)]
pub struct StreamPlan {
    /// The prepared `expert-stream` folder.
    pub dir: PathBuf,
    /// Its manifest: the streamed layers and where each expert's bytes lie.
    pub manifest: Manifest,
    /// Experts kept resident per streamed layer, sized from the arena budget.
    pub slots_per_layer: usize,
    /// The streaming switches the plan was made under (mode, arena budget, eviction policy).
    pub config: StreamConfig,
}

impl StreamPlan {
    /// Bytes of all layers' arenas.
    pub fn arena_bytes(&self) -> u64 {
        self.manifest
            .layers
            .iter()
            .map(|l| l.expert_stride * self.slots_per_layer.min(l.experts) as u64)
            .sum()
    }

    /// The line printed at start-up.
    pub fn describe(&self) -> String {
        let per_slot: u64 = self
            .manifest
            .layers
            .iter()
            .map(|l| l.expert_bytes())
            .max()
            .unwrap_or(0);
        format!(
            "[Expert arena: {} layers × {} slots × {:.2} MiB = {:.1} MiB ({:.1} MiB of experts on disk), {:?} policy, io {}]",
            self.manifest.layers.len(),
            self.slots_per_layer,
            per_slot as f64 / (1 << 20) as f64,
            self.arena_bytes() as f64 / (1 << 20) as f64,
            self.manifest.total_expert_bytes() as f64 / (1 << 20) as f64,
            self.config.policy,
            self.config.io.name()
        )
    }

    /// What the model builder needs to stream the experts, sharing `stats` across layers.
    pub fn setup(&self, stats: Rc<RefCell<StreamStats>>) -> ExpertStreamSetup {
        ExpertStreamSetup {
            dir: self.dir.clone(),
            manifest: self.manifest.clone(),
            slots_per_layer: self.slots_per_layer,
            policy: self.config.policy,
            io: self.config.io,
            prefetch: self.config.prefetch,
            in_place: self.config.in_place,
            stats,
        }
    }
}

/// Decides streaming for the model in `folder`: `None` when experts stay resident.
/// `MLXCEL_EXPERT_STREAM=1` without a prepared layout is an error saying how to make one.
pub fn plan(
    folder: &Path,
    config: &Value,
    stream: &StreamConfig,
    available: Option<u64>,
) -> Result<Option<StreamPlan>> {
    if stream.mode == StreamMode::Off {
        return Ok(None);
    }
    let Some((dir, manifest)) = manifest::open(folder)? else {
        if stream.mode == StreamMode::On {
            return Err(LoadError::file(
                folder,
                format!("MLXCEL_EXPERT_STREAM=1 but the model has no prepared expert stream: run `mlxcel prepare-expert-stream --model {}`", folder.display()),
            ));
        }
        return Ok(None);
    };
    let available = available.unwrap_or(u64::MAX);
    if stream.mode == StreamMode::Auto && manifest.total_expert_bytes() <= available / 2 {
        return Ok(None);
    }
    // A layout made from other expert weights than the checkpoint's now would serve them
    // silently: the shards' size, mtime and header are compared every time (cheap); when one
    // differs, the source tensors' bytes decide (as after copying the folder).
    if manifest::check_sources_cheap(folder, &manifest)?.is_some() {
        let weights = sanitized(folder, config)?;
        manifest::check_source_tensors(folder, &weights, &manifest)?;
    }
    let top_k = config
        .get("num_experts_per_tok")
        .and_then(Value::as_u64)
        .unwrap_or(1) as usize;
    let slots_per_layer = stream.slots_per_layer(&manifest, available, top_k);
    if slots_per_layer < top_k {
        return Err(LoadError::Unsupported(format!(
            "{}: the expert arena needs at least {top_k} slots per layer (top-k)",
            folder.display()
        )));
    }
    Ok(Some(StreamPlan {
        dir,
        manifest,
        slots_per_layer,
        config: stream.clone(),
    }))
}

/// The checkpoint of `folder`, sanitised into the stacked `switch_mlp` layout the stream
/// files are cut from.
fn sanitized(folder: &Path, config: &Value) -> Result<WeightMap> {
    let model_type = get_model_type(config, false).map_err(|source| LoadError::Model {
        folder: folder.to_path_buf(),
        source,
    })?;
    let weights = WeightMap::open(folder)?;
    sanitized_weights(model_type, config, weights).map_err(|source| LoadError::Model {
        folder: folder.to_path_buf(),
        source,
    })
}

/// Writes the expert-stream layout of the MoE model in `folder` (see `mlxcel_stream::manifest`).
pub fn prepare_expert_stream(
    folder: &Path,
    progress: impl FnMut(usize, usize),
) -> Result<Manifest> {
    let folder = crate::resolve_model_dir(folder)?;
    let config = crate::read_config(&folder)?;
    let weights = sanitized(&folder, &config)?;
    Ok(manifest::prepare(&folder, &weights, progress)?)
}

/// Checks the expert-stream layout of the model in `folder` in full (what
/// `prepare-expert-stream --verify` runs): every manifest field against the checkpoint's
/// tensors, the source tensors' bytes, every file's SHA-256 and every expert's hash.
pub fn verify_expert_stream(folder: &Path) -> Result<Manifest> {
    let folder = crate::resolve_model_dir(folder)?;
    let config = crate::read_config(&folder)?;
    let weights = sanitized(&folder, &config)?;
    Ok(manifest::verify(&folder, &weights)?)
}
