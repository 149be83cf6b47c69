//! The prepared expert-stream layout: per MoE layer one file holding each routed expert's planes
//! (gate/up/down weight, scales, biases) as one page-aligned contiguous blob, and a manifest with
//! offsets, sizes and a SHA-256 per file. Written once by `prepare-expert-stream`; a folder that
//! has it streams automatically.

use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Component, Path, PathBuf};

use mlxcel_core::{Dtype, WeightMap};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{Result, StreamError};

/// The folder inside a model folder that holds the prepared layout.
pub const STREAM_DIR: &str = "expert-stream";
pub const MANIFEST: &str = "manifest.json";
/// Expert blobs start on page boundaries so a read maps to whole pages.
pub const PAGE: u64 = 4096;
/// Planes inside a blob start on 64-byte boundaries.
const PLANE_ALIGN: u64 = 64;
const VERSION: u32 = 1;

/// The projections of a routed expert, in blob order.
pub const PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
const PLANES: [&str; 3] = ["weight", "scales", "biases"];

/// One plane of one expert inside its blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlaneEntry {
    /// `gate_proj.weight`, `down_proj.scales`, ...
    pub name: String,
    pub dtype: String,
    /// Shape of one expert's plane (the stacked tensor without its leading expert axis).
    pub shape: Vec<i32>,
    /// Byte offset inside the expert's blob.
    pub offset: u64,
    pub nbytes: u64,
}

/// One MoE layer's stream file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerEntry {
    /// The feed-forward module, e.g. `model.layers.3.mlp` (its experts are `{prefix}.switch_mlp.*`).
    pub prefix: String,
    /// File name inside the stream folder.
    pub file: String,
    pub size: u64,
    pub sha256: String,
    pub experts: usize,
    /// Bytes from one expert's blob to the next (a multiple of [`PAGE`]).
    pub expert_stride: u64,
    pub planes: Vec<PlaneEntry>,
}

impl LayerEntry {
    /// Bytes of one expert's planes (without padding).
    pub fn expert_bytes(&self) -> u64 {
        self.planes.iter().map(|p| p.nbytes).sum()
    }

    pub fn plane(&self, name: &str) -> Option<&PlaneEntry> {
        self.planes.iter().find(|p| p.name == name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    pub layers: Vec<LayerEntry>,
}

impl Manifest {
    pub fn layer(&self, prefix: &str) -> Option<&LayerEntry> {
        self.layers.iter().find(|l| l.prefix == prefix)
    }

    /// Bytes of all routed experts.
    pub fn total_expert_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.expert_bytes() * l.experts as u64)
            .sum()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut file = File::open(path).map_err(|e| StreamError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| StreamError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn align(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

/// The MoE feed-forward prefixes of a (sanitised) checkpoint: every `X` with a stacked
/// `X.switch_mlp.gate_proj.weight`, in layer order.
pub fn moe_prefixes(weights: &WeightMap) -> Vec<String> {
    let mut prefixes: Vec<String> = weights
        .names()
        .filter_map(|n| n.strip_suffix(".switch_mlp.gate_proj.weight"))
        .map(str::to_string)
        .collect();
    let layer_of = |p: &str| -> usize {
        p.split('.')
            .find_map(|s| s.parse::<usize>().ok())
            .unwrap_or(usize::MAX)
    };
    prefixes.sort_by_key(|p| (layer_of(p), p.clone()));
    prefixes
}

/// The bytes of expert `e` of a stacked tensor.
fn expert_slice(weights: &WeightMap, name: &str, e: usize, experts: usize) -> Result<Vec<u8>> {
    let bytes = match weights.bytes(name) {
        Some(b) => b.to_vec(),
        None => weights.get(name)?.to_bytes()?,
    };
    let per = bytes.len() / experts;
    Ok(bytes[e * per..(e + 1) * per].to_vec())
}

/// Writes the stream layout for every MoE layer of `weights` (already sanitised into the
/// stacked `switch_mlp` layout) into `model_dir/expert-stream/`, replacing an old one only once
/// the new one is complete. `progress` is called after each layer with (done, total).
pub fn prepare(
    model_dir: &Path,
    weights: &WeightMap,
    mut progress: impl FnMut(usize, usize),
) -> Result<Manifest> {
    let prefixes = moe_prefixes(weights);
    if prefixes.is_empty() {
        return Err(StreamError::Layout {
            path: model_dir.to_path_buf(),
            message: "no routed experts (`*.switch_mlp.gate_proj.weight`) in this checkpoint"
                .into(),
        });
    }
    let staging = model_dir.join(format!("{STREAM_DIR}.partial"));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).map_err(|e| StreamError::io(&staging, e))?;
    let mut layers = Vec::new();
    for (done, prefix) in prefixes.iter().enumerate() {
        let mut planes = Vec::new();
        let mut sources = Vec::new();
        let mut offset = 0u64;
        let mut experts = 0usize;
        for proj in PROJECTIONS {
            for plane in PLANES {
                let name = format!("{prefix}.switch_mlp.{proj}.{plane}");
                let Some(info) = weights.info(&name) else {
                    continue;
                };
                let e = *info.shape.first().unwrap_or(&0) as usize;
                if experts == 0 {
                    experts = e;
                }
                if e == 0 || e != experts {
                    return Err(StreamError::Layout {
                        path: model_dir.to_path_buf(),
                        message: format!("`{name}` stacks {e} experts, expected {experts}"),
                    });
                }
                let nbytes = (info.nbytes() / e) as u64;
                offset = align(offset, PLANE_ALIGN);
                planes.push(PlaneEntry {
                    name: format!("{proj}.{plane}"),
                    dtype: info.dtype.name().to_string(),
                    shape: info.shape[1..].to_vec(),
                    offset,
                    nbytes,
                });
                sources.push(name);
                offset += nbytes;
            }
        }
        let stride = align(offset, PAGE);
        let file_name = format!("{}.bin", prefix.replace('.', "_"));
        let path = staging.join(&file_name);
        let file = File::create(&path).map_err(|e| StreamError::io(&path, e))?;
        let mut out = BufWriter::new(file);
        let mut hasher = Sha256::new();
        let mut blob = vec![0u8; stride as usize];
        // One stacked tensor at a time per expert keeps memory at one blob plus one tensor view.
        for e in 0..experts {
            blob.iter_mut().for_each(|b| *b = 0);
            for (plane, source) in planes.iter().zip(&sources) {
                let bytes = expert_slice(weights, source, e, experts)?;
                blob[plane.offset as usize..(plane.offset + plane.nbytes) as usize]
                    .copy_from_slice(&bytes);
            }
            out.write_all(&blob)
                .map_err(|e| StreamError::io(&path, e))?;
            hasher.update(&blob);
        }
        out.flush().map_err(|e| StreamError::io(&path, e))?;
        layers.push(LayerEntry {
            prefix: prefix.clone(),
            file: file_name,
            size: stride * experts as u64,
            sha256: hex(&hasher.finalize()),
            experts,
            expert_stride: stride,
            planes,
        });
        progress(done + 1, prefixes.len());
    }
    let manifest = Manifest {
        version: VERSION,
        layers,
    };
    let text = serde_json::to_string_pretty(&manifest).map_err(|e| StreamError::Layout {
        path: staging.clone(),
        message: e.to_string(),
    })?;
    fs::write(staging.join(MANIFEST), text)
        .map_err(|e| StreamError::io(staging.join(MANIFEST), e))?;
    let target = model_dir.join(STREAM_DIR);
    let _ = fs::remove_dir_all(&target);
    fs::rename(&staging, &target).map_err(|e| StreamError::io(&target, e))?;
    Ok(manifest)
}

/// A file name from a manifest, refused when it would leave the stream folder.
fn contained(dir: &Path, file: &str) -> Result<PathBuf> {
    let rel = Path::new(file);
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) || file.is_empty() {
        return Err(StreamError::Layout {
            path: dir.join(MANIFEST),
            message: format!("file `{file}` points outside the stream folder"),
        });
    }
    Ok(dir.join(rel))
}

/// Opens the prepared layout of `model_dir`, checking structure and file sizes (not hashes):
/// `Ok(None)` when the folder has none.
pub fn open(model_dir: &Path) -> Result<Option<(PathBuf, Manifest)>> {
    let dir = model_dir.join(STREAM_DIR);
    let path = dir.join(MANIFEST);
    if !path.is_file() {
        return Ok(None);
    }
    let text = fs::read_to_string(&path).map_err(|e| StreamError::io(&path, e))?;
    let manifest: Manifest = serde_json::from_str(&text).map_err(|e| StreamError::Layout {
        path: path.clone(),
        message: format!("invalid manifest: {e}"),
    })?;
    if manifest.version != VERSION {
        return Err(StreamError::Layout {
            path,
            message: format!(
                "manifest version {} (this build reads {VERSION})",
                manifest.version
            ),
        });
    }
    for layer in &manifest.layers {
        let file = contained(&dir, &layer.file)?;
        let bad = |message: String| StreamError::Layout {
            path: file.clone(),
            message,
        };
        let size = fs::metadata(&file)
            .map_err(|e| StreamError::io(&file, e))?
            .len();
        if size != layer.size || layer.size != layer.expert_stride * layer.experts as u64 {
            return Err(bad(format!(
                "size {size} bytes, manifest says {} ({} experts × {})",
                layer.size, layer.experts, layer.expert_stride
            )));
        }
        for p in &layer.planes {
            let dtype = Dtype::from_name(&p.dtype)
                .ok_or_else(|| bad(format!("plane `{}` has unknown dtype {}", p.name, p.dtype)))?;
            let elems: u64 = p.shape.iter().map(|d| *d as u64).product();
            if p.offset + p.nbytes > layer.expert_stride
                || elems * dtype.size_of() as u64 != p.nbytes
            {
                return Err(bad(format!(
                    "plane `{}` does not fit its blob or its shape",
                    p.name
                )));
            }
        }
    }
    Ok(Some((dir, manifest)))
}

/// [`open`] plus every file's SHA-256, without loading the model.
pub fn verify(model_dir: &Path) -> Result<Manifest> {
    let (dir, manifest) = open(model_dir)?.ok_or_else(|| StreamError::Layout {
        path: model_dir.join(STREAM_DIR),
        message: "no prepared expert stream (run `mlxcel prepare-expert-stream`)".into(),
    })?;
    for layer in &manifest.layers {
        let file = contained(&dir, &layer.file)?;
        let got = sha256_file(&file)?;
        if got != layer.sha256 {
            return Err(StreamError::Layout {
                path: file,
                message: format!("sha256 {got} differs from the manifest's {}", layer.sha256),
            });
        }
    }
    Ok(manifest)
}
