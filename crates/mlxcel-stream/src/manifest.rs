//! The prepared expert-stream layout: per MoE layer one file holding each routed expert's planes
//! (gate/up/down weight, scales, biases) as one page-aligned contiguous blob, and a manifest with
//! offsets, sizes, a SHA-256 per file, an xxh3-64 per expert blob, and the identity of the
//! checkpoint tensors it was made from. Written once by `prepare-expert-stream`; a folder that
//! has it streams automatically.
//!
//! What is checked, and when:
//! - [`open`] (every load that streams): version, structure, sizes, planes that fit their blob
//!   without overlapping, every path confined to the model folder after resolving symlinks;
//! - [`check_sources_cheap`] (every load that streams): each checkpoint shard's size, mtime and
//!   safetensors header hash against the manifest; when any differs the caller compares the
//!   source tensors' bytes ([`check_source_tensors`]) and refuses a stale layout;
//! - `LayerStream` (every read from disk into an arena slot): the expert's xxh3-64;
//! - [`verify`] (`prepare-expert-stream --verify`): all of the above in full, every manifest
//!   field against a layout derived afresh from the checkpoint, and every file's SHA-256.

use std::borrow::Cow;
use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::time::UNIX_EPOCH;

use mlxcel_core::{Dtype, WeightMap};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_64;

use crate::io::hex;
use crate::{Result, StreamError};

/// The folder inside a model folder that holds the prepared layout.
pub const STREAM_DIR: &str = "expert-stream";
/// The manifest's file name inside [`STREAM_DIR`].
pub const MANIFEST: &str = "manifest.json";
/// Expert blobs start on page boundaries so a read maps to whole pages.
pub const PAGE: u64 = 4096;
/// Planes inside a blob start on 64-byte boundaries.
const PLANE_ALIGN: u64 = 64;
/// 2: per-expert xxh3 hashes and source identity (version 1 had neither).
pub const VERSION: u32 = 2;
/// The longest safetensors header read for [`check_sources_cheap`].
const MAX_HEADER: u64 = 256 << 20;

/// The projections of a routed expert, in blob order.
pub const PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
const PLANES: [&str; 3] = ["weight", "scales", "biases"];

/// The checkpoint tensor a plane was cut from (after sanitising: the stacked
/// `{prefix}.switch_mlp.{proj}.{plane}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceTensor {
    /// The tensor's name in the (sanitised) checkpoint.
    pub tensor: String,
    /// The safetensors file (relative to the model folder) holding it; `None` when the
    /// sanitiser built it (e.g. stacking per-expert tensors).
    pub file: Option<String>,
    /// The safetensors dtype tag (`BF16`, `U32`, ...).
    pub dtype: String,
    /// The stacked shape, experts first.
    pub shape: Vec<i32>,
    /// xxh3-64 of the tensor's bytes, hex.
    pub xxh3: String,
}

/// One plane of one expert inside its blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlaneEntry {
    /// `gate_proj.weight`, `down_proj.scales`, ...
    pub name: String,
    /// The MLX dtype name of the plane (`bfloat16`, `uint32`, ...), as `Dtype::name` writes it.
    pub dtype: String,
    /// Shape of one expert's plane (the stacked tensor without its leading expert axis).
    pub shape: Vec<i32>,
    /// Byte offset inside the expert's blob.
    pub offset: u64,
    /// Bytes of one expert's plane.
    pub nbytes: u64,
    /// The checkpoint tensor the plane was cut from.
    pub source: SourceTensor,
}

/// One MoE layer's stream file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerEntry {
    /// The feed-forward module, e.g. `model.layers.3.mlp` (its experts are `{prefix}.switch_mlp.*`).
    pub prefix: String,
    /// File name inside the stream folder.
    pub file: String,
    /// The file's size in bytes (`experts * expert_stride`).
    pub size: u64,
    /// SHA-256 (hex) of the whole file, checked by [`verify`].
    pub sha256: String,
    /// Number of routed experts in the layer (blobs in the file).
    pub experts: usize,
    /// Bytes from one expert's blob to the next (a multiple of [`PAGE`]).
    pub expert_stride: u64,
    /// Per expert, xxh3-64 (hex) of its first [`LayerEntry::read_len`] bytes: what a read into
    /// an arena slot is checked against.
    pub expert_xxh3: Vec<String>,
    /// The planes of an expert's blob, in blob order (the same for every expert).
    pub planes: Vec<PlaneEntry>,
}

impl LayerEntry {
    /// Bytes of one expert's planes (without padding).
    pub fn expert_bytes(&self) -> u64 {
        self.planes
            .iter()
            .fold(0u64, |acc, p| acc.saturating_add(p.nbytes))
    }

    /// Bytes read per expert: up to the end of its last plane.
    pub fn read_len(&self) -> u64 {
        self.planes
            .iter()
            .map(|p| p.offset.saturating_add(p.nbytes))
            .max()
            .unwrap_or(0)
    }

    /// The plane named `name` (`gate_proj.weight`, ...), if the layer has it.
    pub fn plane(&self, name: &str) -> Option<&PlaneEntry> {
        self.planes.iter().find(|p| p.name == name)
    }
}

/// A checkpoint shard as it was when the layout was prepared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceFile {
    /// Relative to the model folder.
    pub file: String,
    /// Its size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: u64,
    /// xxh3-64 (hex) of the safetensors header (names, dtypes, shapes, offsets).
    pub header_xxh3: String,
}

/// The prepared layout's `manifest.json`: every MoE layer's stream file and the checkpoint it
/// was made from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The layout version ([`VERSION`]); other versions are refused at [`open`].
    pub version: u32,
    /// The checkpoint shards the layout was prepared from, to detect a changed checkpoint.
    pub sources: Vec<SourceFile>,
    /// One entry per MoE layer, in layer order.
    pub layers: Vec<LayerEntry>,
}

impl Manifest {
    /// The layer whose feed-forward module is `prefix` (`model.layers.3.mlp`), if streamed.
    pub fn layer(&self, prefix: &str) -> Option<&LayerEntry> {
        self.layers.iter().find(|l| l.prefix == prefix)
    }

    /// Bytes of all routed experts.
    pub fn total_expert_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|l| l.expert_bytes().saturating_mul(l.experts as u64))
            .fold(0u64, u64::saturating_add)
    }
}

/// The hex form of an xxh3-64 as the manifest writes it.
pub fn hash_hex(h: u64) -> String {
    format!("{h:016x}")
}

/// Parses a manifest's xxh3 hex string.
pub fn parse_hash(s: &str) -> Option<u64> {
    (s.len() == 16)
        .then(|| u64::from_str_radix(s, 16).ok())
        .flatten()
}

fn align(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

fn layout_err(path: impl AsRef<Path>, message: impl Into<String>) -> StreamError {
    StreamError::Layout {
        path: path.as_ref().to_path_buf(),
        message: message.into(),
    }
}

fn stale(path: &Path, tensor: &str, what: &str) -> StreamError {
    layout_err(
        path,
        format!(
            "expert-stream layout is stale: tensor `{tensor}` changed since it was prepared ({what}); rerun `mlxcel prepare-expert-stream`"
        ),
    )
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

/// The bytes of a (stacked) tensor: borrowed from the mapped file, or copied out of the array a
/// sanitiser built.
fn tensor_bytes<'a>(weights: &'a WeightMap, name: &str) -> Result<Cow<'a, [u8]>> {
    let bytes = match weights.bytes(name) {
        Some(b) => Cow::Borrowed(b),
        None => Cow::Owned(weights.get(name)?.to_bytes()?),
    };
    let want = weights.info(name).map(|i| i.nbytes()).unwrap_or(0);
    if bytes.len() != want {
        return Err(layout_err(
            weights.folder(),
            format!(
                "tensor `{name}` holds {} bytes, its dtype and shape say {want}",
                bytes.len()
            ),
        ));
    }
    Ok(bytes)
}

/// A shard's path relative to the model folder, as the manifest names it.
fn relative_name(model_dir: &Path, path: &Path) -> Result<String> {
    path.strip_prefix(model_dir)
        .ok()
        .and_then(|p| p.to_str())
        .map(str::to_string)
        .ok_or_else(|| {
            layout_err(
                path,
                format!(
                    "checkpoint file is not a UTF-8 path inside {}",
                    model_dir.display()
                ),
            )
        })
}

/// The identity of a checkpoint shard now: size, mtime, header hash.
fn source_file(model_dir: &Path, path: &Path) -> Result<SourceFile> {
    let meta = fs::metadata(path).map_err(|e| StreamError::io(path, e))?;
    let mtime_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos().min(u64::MAX as u128) as u64);
    Ok(SourceFile {
        file: relative_name(model_dir, path)?,
        size: meta.len(),
        mtime_ns,
        header_xxh3: hash_hex(header_hash(path)?),
    })
}

/// xxh3-64 of a safetensors file's length prefix and JSON header.
fn header_hash(path: &Path) -> Result<u64> {
    let mut file = File::open(path).map_err(|e| StreamError::io(path, e))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|e| StreamError::io(path, e))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        return Err(layout_err(
            path,
            format!("safetensors header of {n} bytes is implausible"),
        ));
    }
    let mut bytes = len.to_vec();
    bytes.resize(8 + n as usize, 0);
    file.read_exact(&mut bytes[8..])
        .map_err(|e| StreamError::io(path, e))?;
    Ok(xxh3_64(&bytes))
}

/// The planes of layer `prefix` as the checkpoint's headers give them (no bytes read; source
/// hashes left empty), its expert count and the bytes up to the end of its last plane.
fn plan_layer(
    model_dir: &Path,
    weights: &WeightMap,
    prefix: &str,
) -> Result<(Vec<PlaneEntry>, usize, u64)> {
    let mut planes = Vec::new();
    let mut offset = 0u64;
    let mut experts = 0usize;
    for proj in PROJECTIONS {
        for plane in PLANES {
            let name = format!("{prefix}.switch_mlp.{proj}.{plane}");
            let Some(info) = weights.info(&name) else {
                continue;
            };
            let e = info.shape.first().map_or(0, |d| (*d).max(0) as usize);
            if experts == 0 {
                experts = e;
            }
            if e == 0 || e != experts {
                return Err(layout_err(
                    model_dir,
                    format!("`{name}` stacks {e} experts, expected {experts}"),
                ));
            }
            let nbytes = (info.nbytes() / e) as u64;
            offset = align(offset, PLANE_ALIGN);
            let file = match &info.file {
                Some(f) => Some(relative_name(model_dir, f)?),
                None => None,
            };
            planes.push(PlaneEntry {
                name: format!("{proj}.{plane}"),
                dtype: info.dtype.name().to_string(),
                shape: info.shape[1..].to_vec(),
                offset,
                nbytes,
                source: SourceTensor {
                    tensor: name,
                    file,
                    dtype: info.stored_dtype.clone(),
                    shape: info.shape.clone(),
                    xxh3: String::new(),
                },
            });
            offset += nbytes;
        }
    }
    Ok((planes, experts, offset))
}

/// Checks a layer's manifest entry against the (sanitised) checkpoint's headers, field by
/// field, without reading tensor bytes: what every streaming load runs. The error names the
/// manifest field that differs.
pub fn check_layout(entry: &LayerEntry, weights: &WeightMap) -> Result<()> {
    let model_dir = weights.folder();
    let path = model_dir.join(STREAM_DIR).join(MANIFEST);
    let (planes, experts, end) = plan_layer(model_dir, weights, &entry.prefix)?;
    let stride = align(end, PAGE);
    let want = LayerEntry {
        prefix: entry.prefix.clone(),
        file: format!("{}.bin", entry.prefix.replace('.', "_")),
        size: stride * experts as u64,
        sha256: entry.sha256.clone(),
        experts,
        expert_stride: stride,
        expert_xxh3: entry.expert_xxh3.clone(),
        planes,
    };
    compare_layer(
        &path,
        &format!("layer `{}`", entry.prefix),
        entry,
        &want,
        false,
    )
}

fn field<T: PartialEq + std::fmt::Debug>(path: &Path, name: &str, got: &T, want: &T) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(layout_err(
            path,
            format!("manifest field `{name}` is {got:?} but the checkpoint gives {want:?}"),
        ))
    }
}

/// Compares a layer entry's fields; `hashes`: also the source, expert and file hashes.
fn compare_layer(path: &Path, l: &str, g: &LayerEntry, w: &LayerEntry, hashes: bool) -> Result<()> {
    field(path, &format!("{l}.prefix"), &g.prefix, &w.prefix)?;
    field(path, &format!("{l}.file"), &g.file, &w.file)?;
    field(path, &format!("{l}.experts"), &g.experts, &w.experts)?;
    field(
        path,
        &format!("{l}.planes.len()"),
        &g.planes.len(),
        &w.planes.len(),
    )?;
    for (j, (gp, wp)) in g.planes.iter().zip(&w.planes).enumerate() {
        let p = format!("{l}.planes[{j}]");
        field(path, &format!("{p}.name"), &gp.name, &wp.name)?;
        field(path, &format!("{p}.dtype"), &gp.dtype, &wp.dtype)?;
        field(path, &format!("{p}.shape"), &gp.shape, &wp.shape)?;
        field(path, &format!("{p}.offset"), &gp.offset, &wp.offset)?;
        field(path, &format!("{p}.nbytes"), &gp.nbytes, &wp.nbytes)?;
        let (gs, ws) = (&gp.source, &wp.source);
        field(path, &format!("{p}.source.tensor"), &gs.tensor, &ws.tensor)?;
        field(path, &format!("{p}.source.file"), &gs.file, &ws.file)?;
        field(path, &format!("{p}.source.dtype"), &gs.dtype, &ws.dtype)?;
        field(path, &format!("{p}.source.shape"), &gs.shape, &ws.shape)?;
        if hashes {
            field(path, &format!("{p}.source.xxh3"), &gs.xxh3, &ws.xxh3)?;
        }
    }
    field(
        path,
        &format!("{l}.expert_stride"),
        &g.expert_stride,
        &w.expert_stride,
    )?;
    field(path, &format!("{l}.size"), &g.size, &w.size)?;
    if hashes {
        field(
            path,
            &format!("{l}.expert_xxh3.len()"),
            &g.expert_xxh3.len(),
            &w.expert_xxh3.len(),
        )?;
        for (e, (gh, wh)) in g.expert_xxh3.iter().zip(&w.expert_xxh3).enumerate() {
            field(path, &format!("{l}.expert_xxh3[{e}]"), gh, wh)?;
        }
        field(path, &format!("{l}.sha256"), &g.sha256, &w.sha256)?;
    }
    Ok(())
}

/// Derives the layout of `weights` (sanitised into the stacked `switch_mlp` layout): the
/// manifest, and with `out` the layer files written into that folder.
fn derive(
    model_dir: &Path,
    weights: &WeightMap,
    out: Option<&Path>,
    mut progress: impl FnMut(usize, usize),
) -> Result<Manifest> {
    let prefixes = moe_prefixes(weights);
    if prefixes.is_empty() {
        return Err(layout_err(
            model_dir,
            "no routed experts (`*.switch_mlp.gate_proj.weight`) in this checkpoint",
        ));
    }
    let sources = weights
        .files()
        .map(|p| source_file(model_dir, p))
        .collect::<Result<Vec<_>>>()?;
    let mut layers = Vec::new();
    for (done, prefix) in prefixes.iter().enumerate() {
        let (mut planes, experts, offset) = plan_layer(model_dir, weights, prefix)?;
        let data = planes
            .iter()
            .map(|p| tensor_bytes(weights, &p.source.tensor))
            .collect::<Result<Vec<_>>>()?;
        for (p, bytes) in planes.iter_mut().zip(&data) {
            p.source.xxh3 = hash_hex(xxh3_64(bytes));
        }
        let stride = align(offset, PAGE);
        let read_len = offset as usize;
        let file_name = format!("{}.bin", prefix.replace('.', "_"));
        let mut writer = match out {
            Some(dir) => {
                let path = dir.join(&file_name);
                let file = File::create(&path).map_err(|e| StreamError::io(&path, e))?;
                Some((path, BufWriter::new(file)))
            }
            None => None,
        };
        let mut hasher = Sha256::new();
        let mut expert_xxh3 = Vec::with_capacity(experts);
        let mut blob = vec![0u8; stride as usize];
        for e in 0..experts {
            blob.iter_mut().for_each(|b| *b = 0);
            for (plane, bytes) in planes.iter().zip(&data) {
                let n = plane.nbytes as usize;
                blob[plane.offset as usize..plane.offset as usize + n]
                    .copy_from_slice(&bytes[e * n..(e + 1) * n]);
            }
            if let Some((path, w)) = writer.as_mut() {
                w.write_all(&blob)
                    .map_err(|err| StreamError::io(&*path, err))?;
            }
            hasher.update(&blob);
            expert_xxh3.push(hash_hex(xxh3_64(&blob[..read_len])));
        }
        if let Some((path, w)) = writer.as_mut() {
            w.flush().map_err(|e| StreamError::io(&*path, e))?;
        }
        layers.push(LayerEntry {
            prefix: prefix.clone(),
            file: file_name,
            size: stride * experts as u64,
            sha256: hex(&hasher.finalize()),
            experts,
            expert_stride: stride,
            expert_xxh3,
            planes,
        });
        progress(done + 1, prefixes.len());
    }
    Ok(Manifest {
        version: VERSION,
        sources,
        layers,
    })
}

/// Writes the stream layout for every MoE layer of `weights` (already sanitised into the
/// stacked `switch_mlp` layout) into `model_dir/expert-stream/`, replacing an old one only once
/// the new one is complete. `progress` is called after each layer with (done, total).
pub fn prepare(
    model_dir: &Path,
    weights: &WeightMap,
    progress: impl FnMut(usize, usize),
) -> Result<Manifest> {
    let staging = model_dir.join(format!("{STREAM_DIR}.partial"));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).map_err(|e| StreamError::io(&staging, e))?;
    let manifest = derive(model_dir, weights, Some(&staging), progress)?;
    let text =
        serde_json::to_string_pretty(&manifest).map_err(|e| layout_err(&staging, e.to_string()))?;
    fs::write(staging.join(MANIFEST), text)
        .map_err(|e| StreamError::io(staging.join(MANIFEST), e))?;
    let target = model_dir.join(STREAM_DIR);
    let _ = fs::remove_dir_all(&target);
    fs::rename(&staging, &target).map_err(|e| StreamError::io(&target, e))?;
    Ok(manifest)
}

/// A path the manifest names (relative to `base`), refused when it is not a plain relative
/// path or when, symlinks resolved, it leaves `root`. `what` names the manifest field.
fn confined(base: &Path, root: &Path, name: &str, what: &str, manifest: &Path) -> Result<PathBuf> {
    let rel = Path::new(name);
    let outside = || {
        layout_err(
            manifest,
            format!("{what} `{name}` points outside the stream folder"),
        )
    };
    if name.is_empty() || rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(outside());
    }
    let path = base.join(rel);
    let real = fs::canonicalize(&path).map_err(|e| StreamError::io(&path, e))?;
    if !real.starts_with(root) {
        return Err(layout_err(
            manifest,
            format!(
                "{what} `{name}` resolves to {} outside {}",
                real.display(),
                root.display()
            ),
        ));
    }
    Ok(path)
}

/// The paths of a layout: the stream folder and its manifest, both inside the model folder
/// once symlinks are resolved.
struct Paths {
    dir: PathBuf,
    manifest: PathBuf,
    model_root: PathBuf,
    stream_root: PathBuf,
}

impl Paths {
    fn blob(&self, layer: usize, file: &str) -> Result<PathBuf> {
        confined(
            &self.dir,
            &self.stream_root,
            file,
            &format!("layers[{layer}].file"),
            &self.manifest,
        )
    }

    fn source(&self, model_dir: &Path, index: usize, file: &str) -> Result<PathBuf> {
        confined(
            model_dir,
            &self.model_root,
            file,
            &format!("sources[{index}].file"),
            &self.manifest,
        )
    }
}

fn paths(model_dir: &Path) -> Result<Paths> {
    let dir = model_dir.join(STREAM_DIR);
    let manifest = dir.join(MANIFEST);
    let canon = |p: &Path| fs::canonicalize(p).map_err(|e| StreamError::io(p, e));
    let model_root = canon(model_dir)?;
    let stream_root = canon(&dir)?;
    let real_manifest = canon(&manifest)?;
    if !stream_root.starts_with(&model_root) || !real_manifest.starts_with(&stream_root) {
        return Err(layout_err(
            &manifest,
            format!(
                "the stream folder resolves to {} outside the model folder {}",
                real_manifest.display(),
                model_root.display()
            ),
        ));
    }
    Ok(Paths {
        dir,
        manifest,
        model_root,
        stream_root,
    })
}

/// Checks one layer's structure (not its bytes): plane dtypes, shapes, offsets inside the blob
/// without overlap, per-expert hashes present.
fn check_layer(i: usize, layer: &LayerEntry, file: &Path) -> Result<()> {
    let bad =
        |message: String| layout_err(file, format!("layers[{i}] (`{}`): {message}", layer.prefix));
    if layer.experts == 0 || layer.expert_stride == 0 || layer.expert_stride % PAGE != 0 {
        return Err(bad(format!(
            "{} experts with a stride of {} bytes (a positive multiple of {PAGE} expected)",
            layer.experts, layer.expert_stride
        )));
    }
    if layer.expert_stride.checked_mul(layer.experts as u64) != Some(layer.size) {
        return Err(bad(format!(
            "size {} is not {} experts × {}",
            layer.size, layer.experts, layer.expert_stride
        )));
    }
    if layer.expert_xxh3.len() != layer.experts {
        return Err(bad(format!(
            "expert_xxh3 has {} hashes for {} experts",
            layer.expert_xxh3.len(),
            layer.experts
        )));
    }
    if let Some(e) = layer
        .expert_xxh3
        .iter()
        .position(|h| parse_hash(h).is_none())
    {
        return Err(bad(format!("expert_xxh3[{e}] is not a 16-digit hex hash")));
    }
    let mut end = 0u64;
    for (j, p) in layer.planes.iter().enumerate() {
        let field = |f: &str| format!("planes[{j}].{f} (`{}`)", p.name);
        let known = PROJECTIONS
            .iter()
            .any(|proj| PLANES.iter().any(|pl| p.name == format!("{proj}.{pl}")));
        if !known || layer.planes[..j].iter().any(|q| q.name == p.name) {
            return Err(bad(format!("{} is unknown or repeated", field("name"))));
        }
        let dtype = Dtype::from_name(&p.dtype)
            .ok_or_else(|| bad(format!("{} {} is not a dtype", field("dtype"), p.dtype)))?;
        let elems = p.shape.iter().try_fold(1u64, |acc, d| {
            u64::try_from(*d).ok().and_then(|d| acc.checked_mul(d))
        });
        if elems.and_then(|n| n.checked_mul(dtype.size_of() as u64)) != Some(p.nbytes) {
            return Err(bad(format!(
                "{} {} does not match {} {:?} of {} {}",
                field("nbytes"),
                p.nbytes,
                field("shape"),
                p.shape,
                field("dtype"),
                p.dtype
            )));
        }
        let stop = p.offset.checked_add(p.nbytes);
        if p.offset < end {
            return Err(bad(format!(
                "planes[{}].offset/nbytes reach byte {end}, past {} {}: the planes overlap",
                j - 1,
                field("offset"),
                p.offset
            )));
        }
        if stop.is_none_or(|s| s > layer.expert_stride) {
            return Err(bad(format!(
                "{} {} + nbytes {} leaves the {}-byte blob",
                field("offset"),
                p.offset,
                p.nbytes,
                layer.expert_stride
            )));
        }
        end = stop.unwrap_or(u64::MAX);
    }
    Ok(())
}

/// Reads a manifest: refused when it is not this build's version (with how to make one).
fn read_manifest(path: &Path) -> Result<Manifest> {
    let text = fs::read_to_string(path).map_err(|e| StreamError::io(path, e))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| layout_err(path, format!("invalid manifest: {e}")))?;
    let version = value.get("version").and_then(serde_json::Value::as_u64);
    if version != Some(VERSION as u64) {
        let found = version.map_or("no version".to_string(), |v| format!("version {v}"));
        return Err(layout_err(
            path,
            format!(
                "manifest has {found}, this build reads version {VERSION}: rerun `mlxcel prepare-expert-stream`"
            ),
        ));
    }
    serde_json::from_value(value).map_err(|e| layout_err(path, format!("invalid manifest: {e}")))
}

/// Opens the prepared layout of `model_dir`, checking structure, confinement and file sizes
/// (not contents): `Ok(None)` when the folder has none.
pub fn open(model_dir: &Path) -> Result<Option<(PathBuf, Manifest)>> {
    if !model_dir.join(STREAM_DIR).join(MANIFEST).is_file() {
        return Ok(None);
    }
    let paths = paths(model_dir)?;
    let manifest = read_manifest(&paths.manifest)?;
    if manifest.layers.is_empty() {
        return Err(layout_err(&paths.manifest, "the manifest lists no layers"));
    }
    for (i, source) in manifest.sources.iter().enumerate() {
        paths.source(model_dir, i, &source.file)?;
    }
    for (i, layer) in manifest.layers.iter().enumerate() {
        let file = paths.blob(i, &layer.file)?;
        check_layer(i, layer, &file)?;
        let size = fs::metadata(&file)
            .map_err(|e| StreamError::io(&file, e))?
            .len();
        if size != layer.size {
            return Err(layout_err(
                &file,
                format!(
                    "size {size} bytes, manifest says {} ({} experts × {})",
                    layer.size, layer.experts, layer.expert_stride
                ),
            ));
        }
        for (j, p) in layer.planes.iter().enumerate() {
            if let Some(f) = &p.source.file {
                if !manifest.sources.iter().any(|s| &s.file == f) {
                    return Err(layout_err(
                        &paths.manifest,
                        format!("layers[{i}].planes[{j}].source.file `{f}` is not among sources"),
                    ));
                }
            }
        }
    }
    Ok(Some((paths.dir, manifest)))
}

/// The cheap load-time identity check: every checkpoint shard the layout was made from still has
/// the size, mtime and safetensors header (names, dtypes, shapes, offsets) it had at prepare.
/// `Ok(None)` when all match; otherwise the first difference, for the caller to settle with
/// [`check_source_tensors`] (a copied folder has new mtimes but the same tensors).
///
/// What this does not see: an edit of tensor bytes that keeps the file's size, header and
/// mtime (a deliberate `touch -r`). The per-expert hashes still catch a damaged stream file at
/// read time, and `--verify` compares every source tensor's bytes.
pub fn check_sources_cheap(model_dir: &Path, manifest: &Manifest) -> Result<Option<String>> {
    let paths = paths(model_dir)?;
    for (i, source) in manifest.sources.iter().enumerate() {
        let path = paths.source(model_dir, i, &source.file)?;
        let now = source_file(model_dir, &path)?;
        if now.size != source.size {
            return Ok(Some(format!(
                "{} is {} bytes, was {}",
                source.file, now.size, source.size
            )));
        }
        if now.header_xxh3 != source.header_xxh3 {
            return Ok(Some(format!("{}: its header changed", source.file)));
        }
        if now.mtime_ns != source.mtime_ns {
            return Ok(Some(format!(
                "{}: its modification time changed",
                source.file
            )));
        }
    }
    Ok(None)
}

/// Compares every source tensor of the layout with the (sanitised) checkpoint: presence, file,
/// dtype, shape and an xxh3 of its bytes. An error saying the layout is stale names the tensor.
pub fn check_source_tensors(
    model_dir: &Path,
    weights: &WeightMap,
    manifest: &Manifest,
) -> Result<()> {
    let path = model_dir.join(STREAM_DIR).join(MANIFEST);
    let prefixes = moe_prefixes(weights);
    let listed: Vec<&str> = manifest.layers.iter().map(|l| l.prefix.as_str()).collect();
    if let Some(p) = prefixes.iter().find(|p| !listed.contains(&p.as_str())) {
        return Err(stale(
            &path,
            &format!("{p}.switch_mlp.gate_proj.weight"),
            "a layer the layout lacks",
        ));
    }
    for layer in &manifest.layers {
        for plane in &layer.planes {
            let src = &plane.source;
            let Some(info) = weights.info(&src.tensor) else {
                return Err(stale(
                    &path,
                    &src.tensor,
                    "it is no longer in the checkpoint",
                ));
            };
            if info.stored_dtype != src.dtype {
                return Err(stale(
                    &path,
                    &src.tensor,
                    &format!("dtype {} was {}", info.stored_dtype, src.dtype),
                ));
            }
            if info.shape != src.shape {
                return Err(stale(
                    &path,
                    &src.tensor,
                    &format!("shape {:?} was {:?}", info.shape, src.shape),
                ));
            }
            let file = match &info.file {
                Some(f) => Some(relative_name(model_dir, f)?),
                None => None,
            };
            if file != src.file {
                return Err(stale(
                    &path,
                    &src.tensor,
                    &format!("file {file:?} was {:?}", src.file),
                ));
            }
            let got = hash_hex(xxh3_64(&tensor_bytes(weights, &src.tensor)?));
            if got != src.xxh3 {
                return Err(stale(
                    &path,
                    &src.tensor,
                    &format!("xxh3 {got} was {}", src.xxh3),
                ));
            }
        }
    }
    // Tensors of a layer the layout lists but that the manifest does not name.
    for layer in &manifest.layers {
        for proj in PROJECTIONS {
            for plane in PLANES {
                let name = format!("{}.switch_mlp.{proj}.{plane}", layer.prefix);
                if weights.contains(&name) && !layer.planes.iter().any(|p| p.source.tensor == name)
                {
                    return Err(stale(&path, &name, "the layout lacks it"));
                }
            }
        }
    }
    Ok(())
}

/// Compares every field of `got` (the manifest on disk) with `want` (derived from the
/// checkpoint now); the error names the first differing field.
fn compare(path: &Path, got: &Manifest, want: &Manifest) -> Result<()> {
    field(path, "layers.len()", &got.layers.len(), &want.layers.len())?;
    for (i, (g, w)) in got.layers.iter().zip(&want.layers).enumerate() {
        compare_layer(path, &format!("layers[{i}]"), g, w, true)?;
    }
    field(
        path,
        "sources.len()",
        &got.sources.len(),
        &want.sources.len(),
    )?;
    for (i, (g, w)) in got.sources.iter().zip(&want.sources).enumerate() {
        let s = format!("sources[{i}]");
        field(path, &format!("{s}.file"), &g.file, &w.file)?;
        field(path, &format!("{s}.size"), &g.size, &w.size)?;
        field(
            path,
            &format!("{s}.header_xxh3"),
            &g.header_xxh3,
            &w.header_xxh3,
        )?;
        // The mtime only triggers the load-time byte comparison: a copied folder differs there
        // alone.
    }
    Ok(())
}

/// Hashes a layer file: its SHA-256 and each expert's xxh3, against the manifest.
fn check_blob(file: &Path, layer: &LayerEntry) -> Result<()> {
    let mut f = File::open(file).map_err(|e| StreamError::io(file, e))?;
    let mut hasher = Sha256::new();
    let mut blob = vec![0u8; layer.expert_stride as usize];
    let read_len = layer.read_len() as usize;
    for (e, want) in layer.expert_xxh3.iter().enumerate() {
        f.read_exact(&mut blob)
            .map_err(|err| StreamError::io(file, err))?;
        hasher.update(&blob);
        let got = hash_hex(xxh3_64(&blob[..read_len]));
        if &got != want {
            return Err(layout_err(
                file,
                format!(
                    "expert {e} of layer `{}` has xxh3 {got}, the manifest says {want}: the stream file is corrupt; rerun `mlxcel prepare-expert-stream`",
                    layer.prefix
                ),
            ));
        }
    }
    let got = hex(&hasher.finalize());
    if got != layer.sha256 {
        return Err(layout_err(
            file,
            format!("sha256 {got} differs from the manifest's {}", layer.sha256),
        ));
    }
    Ok(())
}

/// Everything about the prepared layout of `model_dir`, without loading the model: [`open`]'s
/// checks; the source tensors' identity and bytes against `weights` (the sanitised checkpoint);
/// every manifest field against the layout derived afresh from `weights`; each layer file's
/// SHA-256 and each expert's xxh3.
pub fn verify(model_dir: &Path, weights: &WeightMap) -> Result<Manifest> {
    let (dir, manifest) = open(model_dir)?.ok_or_else(|| {
        layout_err(
            model_dir.join(STREAM_DIR),
            "no prepared expert stream (run `mlxcel prepare-expert-stream`)",
        )
    })?;
    let path = dir.join(MANIFEST);
    // Structure first (an edited field is named), then the source bytes (a stale layout), then
    // every field and hash derived afresh, then the files' bytes.
    for layer in &manifest.layers {
        check_layout(layer, weights)?;
    }
    check_source_tensors(model_dir, weights, &manifest)?;
    let want = derive(model_dir, weights, None, |_, _| {})?;
    compare(&path, &manifest, &want)?;
    for layer in &manifest.layers {
        check_blob(&dir.join(&layer.file), layer)?;
    }
    Ok(manifest)
}
