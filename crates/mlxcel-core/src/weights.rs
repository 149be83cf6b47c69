//! [`WeightMap`]: the tensors of a safetensors checkpoint, by name.
//!
//! Opening a folder maps every shard (`memmap2`) and parses its header with the `safetensors`
//! crate, so names, dtypes and shapes are known without touching tensor data. A tensor becomes
//! an [`Array`] only when asked for ([`WeightMap::get`]), copied once from the page cache into
//! an MLX buffer. Sanitisers edit the map in place ([`WeightMap::insert`], [`WeightMap::remove`],
//! [`WeightMap::rename`]) before a model takes its tensors.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use memmap2::{Advice, MmapMut, MmapOptions};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

use crate::{Array, Dtype, Error, Result};

/// The index file sharded checkpoints carry.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where a tensor's value comes from.
#[derive(Clone)]
enum Source {
    /// Bytes `[start, end)` of a mapped shard.
    File {
        shard: usize,
        start: usize,
        end: usize,
    },
    /// An array a sanitiser put in the map.
    Array(Array),
    /// Same-shaped tensors stacked along a new first axis ([`WeightMap::stack`]), kept as
    /// their own entries so that a slice reads only the parts it covers.
    Stack(Vec<(String, Entry)>),
}

/// What is known about a tensor without reading its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The dtype the tensor becomes as an [`Array`]. FP8 tensors (`F8_E4M3`, `F8_E5M2`) are
    /// exposed as their raw bytes (`uint8`); `stored_dtype` tells them apart.
    pub dtype: Dtype,
    /// The safetensors dtype tag as written in the file (`"BF16"`, `"F8_E4M3"`, ...).
    pub stored_dtype: String,
    /// The dimensions as stored, outermost first.
    pub shape: Vec<i32>,
    /// The shard file, `None` for tensors inserted by a sanitiser.
    pub file: Option<PathBuf>,
}

impl TensorInfo {
    /// Number of elements (the product of `shape`).
    pub fn numel(&self) -> usize {
        self.shape.iter().map(|d| *d as usize).product()
    }

    /// Bytes of the data as an [`Array`] of `dtype` (`numel * dtype.size_of()`).
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_of()
    }
}

#[derive(Clone)]
struct Entry {
    info: TensorInfo,
    source: Source,
}

struct Shard {
    path: PathBuf,
    /// The file's identity when it was mapped (see [`MappedFiles`]).
    stamp: FileStamp,
    /// Private copy-on-write mapping: arrays may borrow from it (see [`zero_copy_enabled`]),
    /// and a write through one (MLX reusing an input buffer) could never reach the file.
    map: Arc<MmapMut>,
    /// The open file, for reads into device memory ([`device_load_enabled`]).
    file: File,
}

/// The tensors of a checkpoint folder.
#[derive(Clone)]
pub struct WeightMap {
    folder: PathBuf,
    shards: Arc<Vec<Shard>>,
    entries: BTreeMap<String, Entry>,
    /// Benchmarks only: file tensors are random numbers made on the device from this seed
    /// instead of the file's bytes (see [`WeightMap::with_random_data`]).
    random: Option<u64>,
}

impl std::fmt::Debug for WeightMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightMap")
            .field("folder", &self.folder)
            .field("tensors", &self.entries.len())
            .finish()
    }
}

fn map_dtype(st: StDtype) -> Option<Dtype> {
    Some(match st {
        StDtype::BOOL => Dtype::Bool,
        StDtype::U8 | StDtype::F8_E4M3 | StDtype::F8_E5M2 => Dtype::Uint8,
        StDtype::I8 => Dtype::Int8,
        StDtype::U16 => Dtype::Uint16,
        StDtype::I16 => Dtype::Int16,
        StDtype::F16 => Dtype::Float16,
        StDtype::BF16 => Dtype::Bfloat16,
        StDtype::U32 => Dtype::Uint32,
        StDtype::I32 => Dtype::Int32,
        StDtype::F32 => Dtype::Float32,
        StDtype::U64 => Dtype::Uint64,
        StDtype::I64 => Dtype::Int64,
        StDtype::F64 => Dtype::Float64,
        _ => return None,
    })
}

fn safetensors_dtype(d: Dtype) -> Option<StDtype> {
    Some(match d {
        Dtype::Bool => StDtype::BOOL,
        Dtype::Uint8 => StDtype::U8,
        Dtype::Int8 => StDtype::I8,
        Dtype::Uint16 => StDtype::U16,
        Dtype::Int16 => StDtype::I16,
        Dtype::Float16 => StDtype::F16,
        Dtype::Bfloat16 => StDtype::BF16,
        Dtype::Uint32 => StDtype::U32,
        Dtype::Int32 => StDtype::I32,
        Dtype::Float32 => StDtype::F32,
        Dtype::Uint64 => StDtype::U64,
        Dtype::Int64 => StDtype::I64,
        Dtype::Float64 => StDtype::F64,
        _ => return None,
    })
}

/// When the safetensors crate refuses a header, find which tensor is at fault so the message
/// can name it (the crate's serde error does not).
fn diagnose_header(bytes: &[u8]) -> Option<String> {
    let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value =
        serde_json::from_slice(bytes.get(8..8usize.checked_add(len)?)?).ok()?;
    let known = [
        "BOOL", "U8", "I8", "U16", "I16", "F16", "BF16", "U32", "I32", "F32", "U64", "I64", "F64",
        "F8_E4M3", "F8_E5M2",
    ];
    for (name, value) in header.as_object()? {
        if name == "__metadata__" {
            continue;
        }
        if let Some(dtype) = value.get("dtype").and_then(|d| d.as_str()) {
            if !known.contains(&dtype) {
                return Some(format!("tensor `{name}` has unknown dtype `{dtype}`"));
            }
        }
    }
    None
}

/// What identifies a file's contents cheaply: size, modification time and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    size: u64,
    mtime: (i64, i64),
    inode: (u64, u64),
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> FileStamp {
        use std::os::unix::fs::MetadataExt;
        FileStamp {
            size: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            inode: (meta.dev(), meta.ino()),
        }
    }
}

/// The files a [`WeightMap`] mapped, with each one's (size, mtime, inode) at open.
///
/// The checkpoint is memory-mapped and model arrays may borrow the mapping: if another process
/// truncates or rewrites a mapped file, touching its pages faults (`SIGBUS`) or reads the new
/// bytes. [`MappedFiles::check_unchanged`] turns that into an error naming the file; callers run
/// it before each request. It cannot close the window in which a file is truncated *during* a
/// forward pass (after the check, while pages are read): that still faults, and nothing short of
/// copying the weights out of the mapping prevents it.
#[derive(Debug, Clone, Default)]
pub struct MappedFiles {
    files: Vec<(PathBuf, FileStamp)>,
}

impl MappedFiles {
    /// The mapped files' paths.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }

    /// An error naming the first mapped file whose size, mtime or inode differs from when it was
    /// opened (or that is gone).
    pub fn check_unchanged(&self) -> Result<()> {
        for (path, then) in &self.files {
            let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
            let now = FileStamp::of(&meta);
            if now != *then {
                let what = if now.size != then.size {
                    format!("its size went from {} to {} bytes", then.size, now.size)
                } else if now.inode != then.inode {
                    "it was replaced by another file".to_string()
                } else {
                    "it was modified".to_string()
                };
                return Err(Error::checkpoint(
                    path,
                    format!(
                        "the checkpoint file changed while the model is loaded ({what}); reload the model"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// `name`, a file a checkpoint names (an index's shard, a tokenizer, a chat template), as a
/// path inside `folder`: relative, without `..`, and resolving (symlinks followed) inside the
/// folder. A Hugging Face hub snapshot (`…/snapshots/<rev>/`) may also link into its
/// repository's `blobs/`, as the hub cache lays files out. Anything else is an error naming the
/// path, so a checkpoint cannot make mlxcel read files elsewhere.
pub fn confined_path(folder: &Path, name: &str) -> Result<PathBuf> {
    use std::path::Component;
    let named = Path::new(name);
    let plain = !name.is_empty()
        && named
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    let joined = folder.join(named);
    if !plain {
        return Err(Error::checkpoint(
            &joined,
            format!("`{name}` is outside the model folder (absolute or with `..`): refused"),
        ));
    }
    let root = folder.canonicalize().map_err(|e| Error::io(folder, e))?;
    let real = joined.canonicalize().map_err(|e| Error::io(&joined, e))?;
    let hub_blobs = (root.parent().and_then(Path::file_name) == Some("snapshots".as_ref()))
        .then(|| {
            root.parent()
                .and_then(Path::parent)
                .map(|r| r.join("blobs"))
        })
        .flatten();
    if real.starts_with(&root) || hub_blobs.is_some_and(|b| real.starts_with(b)) {
        Ok(real)
    } else {
        Err(Error::checkpoint(
            &joined,
            format!(
                "`{name}` resolves to {}, outside the model folder: refused",
                real.display()
            ),
        ))
    }
}

/// The tensor of a safetensors header whose data lies past the end of the file (the crate's
/// error does not name it).
fn tensor_past_end(bytes: &[u8]) -> Option<String> {
    let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value =
        serde_json::from_slice(bytes.get(8..8usize.checked_add(len)?)?).ok()?;
    let data = bytes.len().saturating_sub(8 + len) as u64;
    for (name, value) in header.as_object()? {
        let Some(offsets) = value.get("data_offsets").and_then(|o| o.as_array()) else {
            continue;
        };
        let end = offsets.get(1).and_then(|e| e.as_u64()).unwrap_or(0);
        let start = offsets.first().and_then(|e| e.as_u64()).unwrap_or(0);
        if end > data || start > end {
            return Some(format!(
                "tensor `{name}` has data_offsets [{start}, {end}] past the end of the data ({data} bytes): the file is truncated or its header is wrong"
            ));
        }
    }
    None
}

fn open_shard(path: &Path) -> Result<(Arc<MmapMut>, FileStamp, File)> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let stamp = FileStamp::of(&file.metadata().map_err(|e| Error::io(path, e))?);
    // SAFETY: private mapping (our writes never reach the file). If another process truncates
    // the file while it is mapped, reads fault; checkpoints are not modified in place while a
    // model loads.
    let map = unsafe { MmapOptions::new().map_copy(&file) }.map_err(|e| Error::io(path, e))?;
    Ok((Arc::new(map), stamp, file))
}

/// Whether [`WeightMap::get`] hands out arrays that borrow the mapped file instead of copying
/// it: on MLX's CPU backend (which computes on host memory) unless `MLXCEL_ZERO_COPY=0`.
/// Loading then costs no copy of the weights; the pages are faulted in (read from the page
/// cache) while loading, so the first forward pass does not pay for them.
/// The switch is read from the installed [`crate::policy`].
pub fn zero_copy_enabled() -> bool {
    crate::policy::with(|p| p.zero_copy) && crate::default_device().ok() == Some(crate::Device::Cpu)
}

/// Whether [`WeightMap::get`] reads file tensors straight into device memory
/// ([`Array::from_file_on_device`]): on MLX's CUDA backend unless `MLXCEL_CUDA_LOAD=0`.
pub fn device_load_enabled() -> bool {
    crate::policy::with(|p| p.cuda_load) && crate::default_device().ok() == Some(crate::Device::Gpu)
}

/// Tensors read straight into device memory by this process so far ([`device_load_enabled`]),
/// for load diagnostics (`mlxcel generate --stats-json`: `device_reads`): how many, their
/// bytes, and the wall time the reads took. A load's build time less its reads' is what
/// building does besides reading.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceReads {
    /// Tensors read.
    pub tensors: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Seconds spent reading them (each read returns once its tensor is in device memory).
    pub seconds: f64,
}

static DEVICE_READ_TENSORS: AtomicU64 = AtomicU64::new(0);
static DEVICE_READ_BYTES: AtomicU64 = AtomicU64::new(0);
static DEVICE_READ_NANOS: AtomicU64 = AtomicU64::new(0);

/// The process's [`DeviceReads`] so far.
pub fn device_reads() -> DeviceReads {
    DeviceReads {
        tensors: DEVICE_READ_TENSORS.load(Ordering::Relaxed),
        bytes: DEVICE_READ_BYTES.load(Ordering::Relaxed),
        seconds: DEVICE_READ_NANOS.load(Ordering::Relaxed) as f64 * 1e-9,
    }
}

/// The array of `bytes`, the range of `shard`'s mapped file from byte `start`: borrowed from
/// the map on the CPU ([`zero_copy_enabled`]), read into device memory on a GPU
/// ([`device_load_enabled`]), else copied by MLX.
fn file_array(
    shard: &Shard,
    start: usize,
    bytes: &[u8],
    shape: &[i32],
    dtype: Dtype,
) -> crate::Result<Array> {
    if bytes.is_empty() {
        return Array::from_bytes(bytes, shape, dtype);
    }
    if device_load_enabled() {
        let reading = std::time::Instant::now();
        if let Some(a) =
            Array::from_file_on_device(&shard.file, start as u64, bytes.len(), shape, dtype)?
        {
            DEVICE_READ_NANOS.fetch_add(reading.elapsed().as_nanos() as u64, Ordering::Relaxed);
            DEVICE_READ_BYTES.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            DEVICE_READ_TENSORS.fetch_add(1, Ordering::Relaxed);
            return Ok(a);
        }
    }
    // Fault the range in with one call: far cheaper than a fault per page during a copy, and
    // for borrowed tensors it keeps the faults out of the first forward pass. An old kernel
    // without MADV_POPULATE_READ just faults them later.
    let _ = shard
        .map
        .advise_range(Advice::PopulateRead, start, bytes.len());
    let aligned = (bytes.as_ptr() as usize) % dtype.size_of().max(1) == 0;
    if zero_copy_enabled() && aligned {
        // SAFETY: `bytes` lies in `shard.map`, which the owner keeps mapped; the mapping is
        // private, so nothing modifies it behind MLX's back.
        unsafe { Array::borrowing_bytes(bytes, shape, dtype, Box::new(shard.map.clone())) }
    } else {
        Array::from_bytes(bytes, shape, dtype)
    }
}

impl WeightMap {
    /// An empty map rooted at `folder` (for building checkpoints in memory).
    pub fn empty(folder: impl Into<PathBuf>) -> WeightMap {
        WeightMap {
            folder: folder.into(),
            shards: Arc::new(Vec::new()),
            entries: BTreeMap::new(),
            random: None,
        }
    }

    /// Benchmarks only: every file tensor reads as random numbers made on MLX's default device
    /// (from `seed` and the tensor's name) instead of the file's bytes, which are never touched.
    /// With a checkpoint whose data regions are holes (a sparse file: headers only on disk),
    /// this measures shapes no disk could hold; each rank of a tensor-parallel run makes only
    /// its own slices ([`WeightMap::get_slice`]). Norm weights are ones, float weights uniform
    /// with std 0.02, quantization scales and biases small enough to keep activations finite.
    pub fn with_random_data(mut self, seed: u64) -> WeightMap {
        self.random = Some(seed);
        self
    }

    /// A random stand-in for file tensor `name` (see [`WeightMap::with_random_data`]).
    fn random_tensor(&self, name: &str, shape: &[i32], dtype: Dtype, seed: u64) -> Result<Array> {
        use crate::ops::random;
        // FNV-1a of the name: a different stream per tensor.
        let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        let key = random::key(seed ^ hash)?;
        let uniform = |lo: f64, hi: f64| -> Result<Array> {
            random::uniform(shape, Dtype::Float32, &key)?
                .mul_scalar(hi - lo)?
                .add_scalar(lo)
        };
        let is_norm = name.ends_with("norm.weight") || name.contains("layernorm");
        match dtype {
            Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16 => {
                let values = if is_norm {
                    crate::ops::ones(shape, Dtype::Float32)?
                } else if name.ends_with(".scales") {
                    uniform(0.0005, 0.005)?
                } else if name.ends_with(".biases") {
                    uniform(-0.04, -0.004)?
                } else {
                    uniform(-0.0346, 0.0346)?
                };
                values.astype(dtype)
            }
            // Packed quantized words: every bit pattern.
            Dtype::Uint32 => uniform(0.0, 4_294_967_040.0)?.astype(dtype),
            // Byte scales (fp4/fp8 modes): exponents near 2^0.
            Dtype::Uint8 => uniform(120.0, 128.0)?.astype(dtype),
            _ => crate::ops::zeros(shape, dtype),
        }
    }

    /// Opens every shard of a checkpoint folder: the files `model.safetensors.index.json` names,
    /// else the `model*.safetensors` files, else every `*.safetensors` file in the folder.
    pub fn open(folder: impl AsRef<Path>) -> Result<WeightMap> {
        let folder = folder.as_ref().to_path_buf();
        let index_path = folder.join(INDEX_FILE);
        let (files, index) = if index_path.is_file() {
            let index = read_index(&index_path)?;
            let mut files: Vec<String> = index.values().cloned().collect();
            files.sort();
            files.dedup();
            for f in &files {
                let lexical_escape = Path::new(f).is_absolute()
                    || Path::new(f)
                        .components()
                        .any(|c| !matches!(c, std::path::Component::Normal(_)));
                if !lexical_escape && !folder.join(f).exists() {
                    // Reported as missing below.
                } else {
                    confined_path(&folder, f).map_err(|e| match e {
                        Error::Io { .. } | Error::Checkpoint { .. } => {
                            let tensor =
                                index.iter().find(|(_, v)| *v == f).map(|(k, _)| k.as_str());
                            Error::checkpoint(
                                &index_path,
                                format!(
                                    "shard `{f}` named by the index (e.g. for tensor `{}`): {e}",
                                    tensor.unwrap_or("?")
                                ),
                            )
                        }
                        other => other,
                    })?;
                }
                if !folder.join(f).is_file() {
                    let tensor = index.iter().find(|(_, v)| *v == f).map(|(k, _)| k.as_str());
                    return Err(Error::checkpoint(
                        &index_path,
                        format!(
                            "shard `{f}` named by the index (e.g. for tensor `{}`) is missing",
                            tensor.unwrap_or("?")
                        ),
                    ));
                }
            }
            (
                files.into_iter().map(|f| folder.join(f)).collect(),
                Some(index),
            )
        } else {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&folder)
                .map_err(|e| Error::io(&folder, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            // Folders often hold other safetensors next to the model (Mistral's
            // `consolidated.safetensors` duplicating the model, LoRA `adapters.safetensors`):
            // when `model*.safetensors` shards exist, they are the model.
            let is_model = |p: &PathBuf| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("model"))
            };
            if files.iter().any(is_model) {
                files.retain(is_model);
            }
            files.sort();
            // Shards found by listing may be links: they too must resolve inside the folder.
            let files = files
                .into_iter()
                .map(|p| {
                    let name = p
                        .file_name()
                        .and_then(|n| n.to_str())
                        .unwrap_or_default()
                        .to_string();
                    confined_path(&folder, &name).map(|_| p)
                })
                .collect::<Result<Vec<_>>>()?;
            (files, None)
        };
        if files.is_empty() {
            return Err(Error::checkpoint(
                &folder,
                "no *.safetensors files in the folder",
            ));
        }
        Self::from_files(folder, files, index)
    }

    /// Opens one safetensors file (an adapter's, a surgery rule's) as a map rooted at its folder.
    pub fn open_file(path: impl AsRef<Path>) -> Result<WeightMap> {
        let path = path.as_ref().to_path_buf();
        if !path.is_file() {
            return Err(Error::checkpoint(&path, "no such safetensors file"));
        }
        let folder = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        Self::from_files(folder, vec![path], None)
    }

    fn from_files(
        folder: PathBuf,
        files: Vec<PathBuf>,
        index: Option<BTreeMap<String, String>>,
    ) -> Result<WeightMap> {
        let mut shards = Vec::with_capacity(files.len());
        let mut entries: BTreeMap<String, Entry> = BTreeMap::new();
        for (shard, path) in files.into_iter().enumerate() {
            let (map, stamp, file) = open_shard(&path)?;
            let parsed = SafeTensors::deserialize(&map).map_err(|e| {
                let detail = diagnose_header(&map)
                    .or_else(|| tensor_past_end(&map))
                    .unwrap_or_else(|| e.to_string());
                Error::checkpoint(&path, format!("not a valid safetensors file: {detail}"))
            })?;
            let (header_len, _) = SafeTensors::read_metadata(&map)
                .map_err(|e| Error::checkpoint(&path, format!("bad header: {e}")))?;
            let data_start = 8 + header_len;
            for (name, view) in parsed.tensors() {
                let dtype = map_dtype(view.dtype()).ok_or_else(|| {
                    Error::checkpoint(
                        &path,
                        format!("tensor `{name}` has unsupported dtype {:?}", view.dtype()),
                    )
                })?;
                let shape = view
                    .shape()
                    .iter()
                    .map(|d| i32::try_from(*d))
                    .collect::<std::result::Result<Vec<i32>, _>>()
                    .map_err(|_| {
                        Error::checkpoint(
                            &path,
                            format!("tensor `{name}` has a dimension over 2^31"),
                        )
                    })?;
                // The view's data is a sub-slice of the map: recover its offsets.
                let start = view.data().as_ptr() as usize - map.as_ptr() as usize;
                let end = start + view.data().len();
                debug_assert!(start >= data_start);
                if let Some(prev) = entries.get(&name) {
                    return Err(Error::checkpoint(
                        &path,
                        format!(
                            "tensor `{name}` is also defined in {}",
                            prev.info
                                .file
                                .as_deref()
                                .unwrap_or(Path::new("?"))
                                .display()
                        ),
                    ));
                }
                if let Some(index) = &index {
                    match index.get(&name) {
                        Some(f) if folder.join(f) == path => {}
                        Some(f) => {
                            return Err(Error::checkpoint(
                                &path,
                                format!("tensor `{name}` is here but the index places it in `{f}`"),
                            ))
                        }
                        None => {
                            return Err(Error::checkpoint(
                                &path,
                                format!("tensor `{name}` is not listed in {INDEX_FILE}"),
                            ))
                        }
                    }
                }
                let info = TensorInfo {
                    dtype,
                    stored_dtype: format!("{:?}", view.dtype()),
                    shape,
                    file: Some(path.clone()),
                };
                entries.insert(
                    name,
                    Entry {
                        info,
                        source: Source::File { shard, start, end },
                    },
                );
            }
            shards.push(Shard {
                path,
                stamp,
                map,
                file,
            });
        }
        if let Some(index) = &index {
            if let Some((name, file)) = index.iter().find(|(name, _)| !entries.contains_key(*name))
            {
                return Err(Error::checkpoint(
                    folder.join(file),
                    format!("tensor `{name}` is listed in {INDEX_FILE} but not in this shard"),
                ));
            }
        }
        Ok(WeightMap {
            folder,
            shards: Arc::new(shards),
            entries,
            random: None,
        })
    }

    /// The checkpoint folder the map was opened from (or created for).
    pub fn folder(&self) -> &Path {
        &self.folder
    }

    /// The mapped shard files, in the order they were opened.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// The mapped files and their identity at open, to check before each request (see
    /// [`MappedFiles`]).
    pub fn mapped_files(&self) -> MappedFiles {
        MappedFiles {
            files: self
                .shards
                .iter()
                .map(|s| (s.path.clone(), s.stamp))
                .collect(),
        }
    }

    /// [`MappedFiles::check_unchanged`] for this map's files.
    pub fn check_unchanged(&self) -> Result<()> {
        self.mapped_files().check_unchanged()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the map holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Tensor names in sorted order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// The tensor's dtype, shape and file, without reading its data; `None` when absent.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.entries.get(name).map(|e| &e.info)
    }

    /// The tensor as an array (copied from the mapped file on each call for file tensors).
    pub fn get(&self, name: &str) -> Result<Array> {
        let entry = self.entries.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            folder: self.folder.clone(),
        })?;
        self.entry_array(name, entry)
    }

    fn entry_array(&self, name: &str, entry: &Entry) -> Result<Array> {
        match &entry.source {
            Source::Array(a) => Ok(a.clone()),
            Source::Stack(parts) => {
                let arrays = parts
                    .iter()
                    .map(|(n, e)| self.entry_array(n, e))
                    .collect::<Result<Vec<_>>>()?;
                crate::ops::stack(&arrays, 0)
            }
            Source::File { .. } if self.random.is_some() => {
                let seed = self.random.unwrap_or_default();
                self.random_tensor(name, &entry.info.shape, entry.info.dtype, seed)
            }
            Source::File { shard, start, end } => {
                let shard = &self.shards[*shard];
                let bytes = shard.map.get(*start..*end).ok_or_else(|| {
                    Error::checkpoint(
                        &shard.path,
                        format!("tensor `{name}` lies outside the file"),
                    )
                })?;
                file_array(shard, *start, bytes, &entry.info.shape, entry.info.dtype)
                    .map_err(|e| Error::checkpoint(&shard.path, format!("tensor `{name}`: {e}")))
            }
        }
    }

    /// Part of a tensor: indices `start..end` of `axis`, every index of the other axes. Only
    /// those bytes are read from the mapped file (a rank of a tensor-parallel job loads its own
    /// shard, never the whole tensor): a slice of the first axis borrows them as [`get`]
    /// does, a slice of another axis copies each of its runs. Inserted arrays are sliced
    /// through MLX.
    ///
    /// [`get`]: WeightMap::get
    pub fn get_slice(&self, name: &str, axis: usize, start: i32, end: i32) -> Result<Array> {
        let entry = self.entries.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            folder: self.folder.clone(),
        })?;
        self.entry_slice(name, entry, axis, start, end)
    }

    fn entry_slice(
        &self,
        name: &str,
        entry: &Entry,
        axis: usize,
        start: i32,
        end: i32,
    ) -> Result<Array> {
        let shape = &entry.info.shape;
        if axis >= shape.len() || start < 0 || end > shape[axis] || start > end {
            return Err(Error::Invalid(format!(
                "tensor `{name}` {shape:?}: no slice {start}..{end} of axis {axis}"
            )));
        }
        if let (Some(seed), Source::File { .. }) = (self.random, &entry.source) {
            let mut sliced = shape.clone();
            sliced[axis] = end - start;
            let part = format!("{name}[{axis}:{start}..{end}]");
            return self.random_tensor(&part, &sliced, entry.info.dtype, seed);
        }
        let (shard, start_byte, end_byte) = match &entry.source {
            Source::Array(a) => return a.slice_axis(axis as i32, start, end),
            // Only the parts the slice covers, each read only as far as it needs.
            Source::Stack(parts) => {
                let arrays = if axis == 0 {
                    parts[start as usize..end as usize]
                        .iter()
                        .map(|(n, e)| self.entry_array(n, e))
                        .collect::<Result<Vec<_>>>()?
                } else {
                    parts
                        .iter()
                        .map(|(n, e)| self.entry_slice(n, e, axis - 1, start, end))
                        .collect::<Result<Vec<_>>>()?
                };
                return crate::ops::stack(&arrays, 0);
            }
            Source::File { shard, start, end } => (&self.shards[*shard], *start, *end),
        };
        let bytes = shard.map.get(start_byte..end_byte).ok_or_else(|| {
            Error::checkpoint(
                &shard.path,
                format!("tensor `{name}` lies outside the file"),
            )
        })?;
        let elem = entry.info.dtype.size_of();
        let outer: usize = shape[..axis].iter().map(|d| *d as usize).product();
        let run: usize = shape[axis + 1..]
            .iter()
            .map(|d| *d as usize)
            .product::<usize>()
            * elem;
        let mut sliced = shape.clone();
        sliced[axis] = end - start;
        let (lo, hi) = (start as usize * run, end as usize * run);
        let stride = shape[axis] as usize * run;
        let array = if outer == 1 {
            file_array(
                shard,
                start_byte + lo,
                &bytes[lo..hi],
                &sliced,
                entry.info.dtype,
            )
        } else {
            let mut out = Vec::with_capacity(outer * (hi - lo));
            for o in 0..outer {
                out.extend_from_slice(&bytes[o * stride + lo..o * stride + hi]);
            }
            Array::from_bytes(&out, &sliced, entry.info.dtype)
        };
        array.map_err(|e| Error::checkpoint(&shard.path, format!("tensor `{name}`: {e}")))
    }

    /// The tensor converted to `dtype`. Half-precision file tensors become float32 on the host
    /// (SIMD conversion while copying out of the map) instead of through an MLX cast: on the CPU
    /// backend that cast is a scalar loop and dominated load time. Other conversions use MLX.
    pub fn get_as(&self, name: &str, dtype: Dtype) -> Result<Array> {
        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
        let info = self.entries.get(name).map(|e| &e.info);
        let half_to_f32 = dtype == Dtype::Float32
            && info.is_some_and(|i| matches!(i.dtype, Dtype::Float16 | Dtype::Bfloat16));
        if let (true, Some(bytes), Some(info)) = (half_to_f32, self.bytes(name), info) {
            let mut out = vec![0f32; bytes.len() / 2];
            let units: Vec<u16> = bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            if info.dtype == Dtype::Float16 {
                units
                    .reinterpret_cast::<half::f16>()
                    .convert_to_f32_slice(&mut out);
            } else {
                units
                    .reinterpret_cast::<half::bf16>()
                    .convert_to_f32_slice(&mut out);
            }
            return Array::from_slice(&out, &info.shape);
        }
        let a = self.get(name)?;
        if a.dtype()? == dtype {
            Ok(a)
        } else {
            a.astype(dtype)
        }
    }

    /// The raw bytes of a file tensor, without creating an array (`None` for inserted arrays).
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        if self.random.is_some() {
            return None;
        }
        match &self.entries.get(name)?.source {
            Source::File { shard, start, end } => self.shards[*shard].map.get(*start..*end),
            Source::Array(_) | Source::Stack(_) => None,
        }
    }

    /// Takes a tensor out of the map.
    pub fn take(&mut self, name: &str) -> Result<Array> {
        let a = self.get(name)?;
        self.entries.remove(name);
        Ok(a)
    }

    /// Adds or replaces a tensor.
    pub fn insert(&mut self, name: impl Into<String>, array: Array) -> Result<()> {
        let info = TensorInfo {
            dtype: array.dtype()?,
            stored_dtype: array.dtype()?.name().to_string(),
            shape: array.shape(),
            file: None,
        };
        self.entries.insert(
            name.into(),
            Entry {
                info,
                source: Source::Array(array),
            },
        );
        Ok(())
    }

    /// Replaces tensors `parts` (same shape and dtype) by one tensor `name` of shape
    /// `[parts.len(), ..]`, their stack along a new first axis, without reading them: the
    /// stack reads its parts when asked for, a slice of it ([`WeightMap::get_slice`]) only
    /// the parts and rows it covers (one expert's columns of a per-expert checkpoint).
    pub fn stack(&mut self, name: impl Into<String>, parts: &[String]) -> Result<()> {
        let name = name.into();
        let mut entries = Vec::with_capacity(parts.len());
        for part in parts {
            let entry = self.entries.get(part).ok_or_else(|| Error::MissingTensor {
                name: part.clone(),
                folder: self.folder.clone(),
            })?;
            if let Some((first, e)) = entries.first() {
                let e: &Entry = e;
                if e.info.shape != entry.info.shape || e.info.dtype != entry.info.dtype {
                    return Err(Error::Invalid(format!(
                        "cannot stack `{part}` ({:?} {}) with `{first}` ({:?} {}) into `{name}`",
                        entry.info.shape, entry.info.dtype, e.info.shape, e.info.dtype
                    )));
                }
            }
            entries.push((part.clone(), entry.clone()));
        }
        let Some((_, first)) = entries.first() else {
            return Err(Error::Invalid(format!("`{name}`: a stack of no tensors")));
        };
        let mut shape = vec![entries.len() as i32];
        shape.extend(&first.info.shape);
        let info = TensorInfo {
            dtype: first.info.dtype,
            stored_dtype: first.info.stored_dtype.clone(),
            shape,
            file: None,
        };
        for part in parts {
            self.entries.remove(part);
        }
        self.entries.insert(
            name,
            Entry {
                info,
                source: Source::Stack(entries),
            },
        );
        Ok(())
    }

    /// Removes a tensor; returns whether it was present.
    pub fn remove(&mut self, name: &str) -> bool {
        self.entries.remove(name).is_some()
    }

    /// Renames a tensor; an error when `from` is missing or `to` exists.
    pub fn rename(&mut self, from: &str, to: &str) -> Result<()> {
        if self.entries.contains_key(to) {
            return Err(Error::Invalid(format!(
                "cannot rename `{from}` to `{to}`: `{to}` exists"
            )));
        }
        let entry = self
            .entries
            .remove(from)
            .ok_or_else(|| Error::MissingTensor {
                name: from.to_string(),
                folder: self.folder.clone(),
            })?;
        self.entries.insert(to.to_string(), entry);
        Ok(())
    }

    /// Renames every tensor whose name starts with `from` to start with `to` instead.
    pub fn rename_prefix(&mut self, from: &str, to: &str) -> Result<usize> {
        let names: Vec<String> = self
            .entries
            .keys()
            .filter(|n| n.starts_with(from))
            .cloned()
            .collect();
        for n in &names {
            self.rename(n, &format!("{to}{}", &n[from.len()..]))?;
        }
        Ok(names.len())
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.entries.values().map(|e| e.info.nbytes()).sum()
    }
}

fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::checkpoint(path, format!("invalid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::checkpoint(path, "no `weight_map` object"))?;
    map.iter()
        .map(|(k, v)| {
            v.as_str()
                .map(|f| (k.clone(), f.to_string()))
                .ok_or_else(|| {
                    Error::checkpoint(path, format!("weight_map entry `{k}` is not a file name"))
                })
        })
        .collect()
}

/// Writes arrays as one safetensors file (evaluating them), with optional string metadata
/// (mlx-lm writes `{"format": "mlx"}`).
pub fn save_safetensors(
    path: impl AsRef<Path>,
    tensors: &[(String, Array)],
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Result<()> {
    let path = path.as_ref();
    let mut owned = Vec::with_capacity(tensors.len());
    for (name, array) in tensors {
        let dtype = array.dtype()?;
        let st = safetensors_dtype(dtype).ok_or_else(|| {
            Error::Invalid(format!(
                "tensor `{name}`: dtype {dtype} cannot be stored in safetensors"
            ))
        })?;
        let shape: Vec<usize> = array.shape().iter().map(|d| *d as usize).collect();
        owned.push((name.clone(), st, shape, array.to_bytes()?));
    }
    let views = owned
        .iter()
        .map(|(name, st, shape, bytes)| {
            safetensors::tensor::TensorView::new(*st, shape.clone(), bytes)
                .map(|v| (name.clone(), v))
                .map_err(|e| Error::Invalid(format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::tensor::serialize_to_file(views, &metadata, path)
        .map_err(|e| Error::checkpoint(path, format!("writing safetensors: {e}")))
}

/// Whether loading evaluates every kept tensor before reporting the model loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Materialization {
    /// Evaluate all kept weights (and their load-time transforms) during loading, so the first
    /// token never waits on weight I/O. The default.
    #[default]
    Eager,
    /// Leave weights (and load-time transforms such as dtype casts) as lazy graph nodes;
    /// they are computed on first use.
    Lazy,
}

impl Materialization {
    /// The environment switch that selects the policy.
    pub const ENV: &'static str = "MLXCEL_WEIGHT_MATERIALIZATION";

    /// Reads `MLXCEL_WEIGHT_MATERIALIZATION` (`eager` or `lazy`; unset means eager) through
    /// [`RuntimePolicy::from_env`](crate::policy::RuntimePolicy::from_env), which parses (and
    /// checks) every runtime variable.
    pub fn from_env() -> Result<Materialization> {
        Ok(crate::policy::RuntimePolicy::from_env()?.weight_materialization)
    }

    /// Applies the policy to the arrays a model kept.
    pub fn apply<'a>(self, arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
        match self {
            Materialization::Eager => crate::ops::eval_all(arrays),
            Materialization::Lazy => Ok(()),
        }
    }
}
