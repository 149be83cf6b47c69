//! The external-PLE manifest (mlx-vlm's version 2, read as is) and its checks: what
//! [`PleLayout::open`] accepts, and the exact error for everything it refuses.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use mlxcel_core::Dtype;
use serde_json::{Map, Value};

use crate::{Result, StreamError};

/// The manifest version read and written (mlx-vlm's `MANIFEST_VERSION`).
pub const MANIFEST_VERSION: u64 = 2;
/// The manifest's file name `prepare` writes (mlx-vlm's choice).
pub const MANIFEST_FILE: &str = "ple-store.json";
/// The interleaved row file `prepare --quantize affine4` writes (mlx-vlm's default name).
pub const INTERLEAVED_FILE: &str = "ple-q4.rows";
/// The longest safetensors header read when checking a `safetensors_ranges` tensor.
const MAX_HEADER: u64 = 256 << 20;

/// How a row is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowFormat {
    /// Unquantized rows of a float dtype (mlxcel's extension: `"quantization": null`).
    Plain(Dtype),
    /// MLX affine 4-bit, groups of 32: `weight` U32, `scales` and `biases` BF16.
    Affine4,
    /// The same with `scales` and `biases` of another float dtype (F32 or F16, as mlx-lm
    /// leaves them when it quantizes a float32 or float16 checkpoint): mlxcel's extension, read
    /// in the `safetensors_ranges` layout only.
    Affine4Float(Dtype),
    /// MLX nvfp4, groups of 16: `weight` U32, `scales` U8 (E4M3 codes).
    Nvfp4,
}

impl RowFormat {
    /// The planes of a row record in storage order: (name, safetensors dtype tag, MLX dtype).
    pub fn planes(self) -> Vec<(&'static str, &'static str, Dtype)> {
        match self {
            RowFormat::Plain(d) => vec![("weight", st_tag(d), d)],
            RowFormat::Affine4 => vec![
                ("weight", "U32", Dtype::Uint32),
                ("scales", "BF16", Dtype::Bfloat16),
                ("biases", "BF16", Dtype::Bfloat16),
            ],
            RowFormat::Affine4Float(d) => vec![
                ("weight", "U32", Dtype::Uint32),
                ("scales", st_tag(d), d),
                ("biases", st_tag(d), d),
            ],
            RowFormat::Nvfp4 => vec![
                ("weight", "U32", Dtype::Uint32),
                ("scales", "U8", Dtype::Uint8),
            ],
        }
    }

    /// Elements per group (`None` for unquantized rows).
    pub fn group_size(self) -> Option<usize> {
        match self {
            RowFormat::Plain(_) => None,
            RowFormat::Affine4 | RowFormat::Affine4Float(_) => Some(32),
            RowFormat::Nvfp4 => Some(16),
        }
    }

    /// Elements per row of plane `name` for rows of `width` values.
    pub fn plane_elems(self, name: &str, width: usize) -> usize {
        match (self, name) {
            (RowFormat::Plain(_), _) => width,
            (_, "weight") => width / 8,
            (f, _) => width / f.group_size().unwrap_or(1),
        }
    }

    /// Bytes of one row record (all planes).
    pub fn record_bytes(self, width: usize) -> usize {
        self.planes()
            .iter()
            .map(|(name, _, d)| self.plane_elems(name, width) * d.size_of())
            .sum()
    }

    /// The manifest's `quantization` value.
    pub fn quantization_json(self) -> Value {
        match self {
            RowFormat::Plain(_) => Value::Null,
            RowFormat::Affine4 | RowFormat::Affine4Float(_) => {
                serde_json::json!({"bits": 4, "group_size": 32, "mode": "affine"})
            }
            RowFormat::Nvfp4 => serde_json::json!({"bits": 4, "group_size": 16, "mode": "nvfp4"}),
        }
    }

    /// A short description for reports.
    pub fn describe(self) -> String {
        match self {
            RowFormat::Plain(d) => format!("unquantized {d}"),
            RowFormat::Affine4 => "affine 4-bit g32".to_string(),
            RowFormat::Affine4Float(d) => format!("affine 4-bit g32, {d} scales"),
            RowFormat::Nvfp4 => "nvfp4".to_string(),
        }
    }
}

/// The safetensors dtype tag of a float dtype.
pub(crate) fn st_tag(d: Dtype) -> &'static str {
    match d {
        Dtype::Float32 => "F32",
        Dtype::Float16 => "F16",
        Dtype::Bfloat16 => "BF16",
        Dtype::Uint32 => "U32",
        Dtype::Uint8 => "U8",
        _ => "?",
    }
}

fn float_of_tag(tag: &str) -> Option<Dtype> {
    match tag {
        "F32" => Some(Dtype::Float32),
        "F16" => Some(Dtype::Float16),
        "BF16" => Some(Dtype::Bfloat16),
        _ => None,
    }
}

/// Where one plane of a run of rows lies: row `r` of the run starts at `offset + r * stride`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    /// Index into [`PleLayout::files`].
    pub file: usize,
    /// Byte offset of the run's first row in the file.
    pub offset: u64,
    /// Bytes from one row to the next.
    pub stride: u64,
    /// Bytes of this plane (or, interleaved, of the whole record) per row.
    pub len: u64,
}

/// A run of consecutive rows (a `safetensors_ranges` shard, or the whole interleaved file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The first row.
    pub row_start: u64,
    /// Rows in the run.
    pub row_count: u64,
    /// Where each plane lies (interleaved: one extent holding the whole record).
    pub extents: Vec<Extent>,
}

/// How the manifest lays rows out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutKind {
    /// Rows stay inside safetensors tensors (one tensor per plane per shard).
    SafetensorsRanges,
    /// One file, one record per row: the planes back to back.
    InterleavedQ4,
}

/// The `ple_storage` entry of `config.json` (under `text_config` or at the top level).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PleStorageConfig {
    /// The manifest, relative to the model folder.
    pub manifest: String,
    /// mlx-vlm's row-cache size in rows; accepted and reported, while mlxcel sizes its cache in
    /// bytes (`MLXCEL_PLE_CACHE_BYTES`).
    pub cache_rows: u64,
    /// Where it was found (`text_config.ple_storage` or `ple_storage`), for messages.
    pub key: String,
}

fn cfg_err(config: &Path, message: String) -> StreamError {
    StreamError::Layout {
        path: config.to_path_buf(),
        message,
    }
}

impl PleStorageConfig {
    /// The entry of a (sanitised) `config.json` read from `config_path`, `None` when the model
    /// keeps its table resident. A list of entries (two tables) is refused: one manifest
    /// describes one table.
    pub fn from_config(config: &Value, config_path: &Path) -> Result<Option<PleStorageConfig>> {
        let (key, value) = match (
            config.get("text_config").and_then(|t| t.get("ple_storage")),
            config.get("ple_storage"),
        ) {
            (Some(v), _) => ("text_config.ple_storage", v),
            (None, Some(v)) => ("ple_storage", v),
            (None, None) => return Ok(None),
        };
        if value.is_null() {
            return Ok(None);
        }
        if let Value::Array(list) = value {
            return Err(cfg_err(
                config_path,
                format!(
                    "`{key}` lists {} PLE tables: one manifest describes one table, more than one is refused",
                    list.len()
                ),
            ));
        }
        let Some(obj) = value.as_object() else {
            return Err(cfg_err(
                config_path,
                format!("`{key}` is {value}: expected an object with `manifest`"),
            ));
        };
        let manifest = match obj.get("manifest") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(other) => {
                return Err(cfg_err(
                    config_path,
                    format!("`{key}.manifest` is {other}: expected the manifest's path"),
                ))
            }
            None => return Err(cfg_err(config_path, format!("`{key}.manifest` is missing"))),
        };
        if Path::new(&manifest).is_absolute() {
            return Err(cfg_err(
                config_path,
                format!(
                    "`{key}.manifest` `{manifest}` is absolute: the manifest must be inside the model folder"
                ),
            ));
        }
        if Path::new(&manifest)
            .components()
            .any(|c| matches!(c, Component::ParentDir))
        {
            return Err(cfg_err(
                config_path,
                format!("`{key}.manifest` `{manifest}` leaves the model folder (`..`)"),
            ));
        }
        let cache_rows = match obj.get("cache_rows") {
            None | Some(Value::Null) => 0,
            Some(v) => v.as_u64().ok_or_else(|| {
                cfg_err(
                    config_path,
                    format!("`{key}.cache_rows` is {v}: expected a non-negative integer"),
                )
            })?,
        };
        Ok(Some(PleStorageConfig {
            manifest,
            cache_rows,
            key: key.to_string(),
        }))
    }
}

/// A checked manifest: where every row of the table lies.
#[derive(Debug, Clone)]
pub struct PleLayout {
    /// The manifest file.
    pub manifest_path: PathBuf,
    /// How rows are laid out.
    pub kind: LayoutKind,
    /// How a row is stored.
    pub format: RowFormat,
    /// Values per row.
    pub row_width: usize,
    /// Rows of the table.
    pub row_count: u64,
    /// Bytes of one row record in memory (all planes, back to back).
    pub record_bytes: usize,
    /// The files rows are read from (resolved, inside the model folder).
    pub files: Vec<PathBuf>,
    /// The runs of rows, in row order.
    pub shards: Vec<Shard>,
    /// mlx-vlm's `cache_rows` (reported only).
    pub cache_rows: u64,
    /// mlxcel's extension: SHA-256 per file, keyed by the path relative to the model folder
    /// (checked by `prepare-external-ple --verify`).
    pub sha256: BTreeMap<String, String>,
}

impl PleLayout {
    /// Bytes of the whole table as stored.
    pub fn table_bytes(&self) -> u64 {
        self.row_count.saturating_mul(self.record_bytes as u64)
    }
}

fn err(manifest: &Path, message: String) -> StreamError {
    StreamError::Layout {
        path: manifest.to_path_buf(),
        message,
    }
}

/// An integer field; `what` names it in the error.
fn int_field(m: &Path, value: Option<&Value>, what: &str) -> Result<i64> {
    match value {
        None => Err(err(m, format!("manifest field `{what}` is missing"))),
        Some(v) => v.as_i64().ok_or_else(|| {
            err(
                m,
                format!("manifest field `{what}` is {v}: expected an integer"),
            )
        }),
    }
}

fn positive(m: &Path, value: Option<&Value>, what: &str) -> Result<u64> {
    let n = int_field(m, value, what)?;
    if n <= 0 {
        return Err(err(
            m,
            format!("manifest field `{what}` is {n}: expected a positive integer"),
        ));
    }
    Ok(n as u64)
}

fn string_field<'a>(m: &Path, value: Option<&'a Value>, what: &str) -> Result<&'a str> {
    match value {
        None => Err(err(m, format!("manifest field `{what}` is missing"))),
        Some(Value::String(s)) => Ok(s),
        Some(v) => Err(err(
            m,
            format!("manifest field `{what}` is {v}: expected a string"),
        )),
    }
}

/// Whether `name` is one plain file name (no folder, not absolute, not `.`/`..`).
fn plain_file_name(name: &str) -> bool {
    let p = Path::new(name);
    let mut parts = p.components();
    matches!(parts.next(), Some(Component::Normal(_))) && parts.next().is_none()
}

/// `path` resolved (symlinks followed), refused unless inside `root`.
fn inside(m: &Path, root: &Path, path: &Path, what: &str, shown: &str) -> Result<PathBuf> {
    let real = fs::canonicalize(path).map_err(|e| StreamError::io(path, e))?;
    if !real.starts_with(root) {
        return Err(err(
            m,
            format!(
                "manifest field `{what}` `{shown}` resolves to {} outside the model folder {}",
                real.display(),
                root.display()
            ),
        ));
    }
    Ok(real)
}

/// A safetensors file's header: the absolute offset where its data starts, and its tensors.
pub(crate) struct Header {
    pub data_start: u64,
    pub tensors: Map<String, Value>,
}

/// Reads the header of the safetensors file `path`.
pub(crate) fn read_header(path: &Path) -> Result<Header> {
    let mut file = File::open(path).map_err(|e| StreamError::io(path, e))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|e| StreamError::io(path, e))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        return Err(err(
            path,
            format!("safetensors header of {n} bytes is implausible"),
        ));
    }
    let mut bytes = vec![0u8; n as usize];
    file.read_exact(&mut bytes)
        .map_err(|e| StreamError::io(path, e))?;
    let tensors: Map<String, Value> = serde_json::from_slice(&bytes)
        .map_err(|e| err(path, format!("invalid safetensors header: {e}")))?;
    Ok(Header {
        data_start: 8 + n,
        tensors,
    })
}

impl Header {
    /// The tensor whose data starts at absolute offset `offset`: (name, dtype tag, shape,
    /// data bytes).
    fn tensor_at(&self, offset: u64) -> Option<(&str, &str, Vec<i64>, u64)> {
        self.tensors.iter().find_map(|(name, v)| {
            let offs = v.get("data_offsets")?.as_array()?;
            let start = offs.first()?.as_u64()?;
            let end = offs.get(1)?.as_u64()?;
            if self.data_start + start != offset {
                return None;
            }
            let dtype = v.get("dtype")?.as_str()?;
            let shape = v
                .get("shape")?
                .as_array()?
                .iter()
                .map(|d| d.as_i64().unwrap_or(-1))
                .collect();
            Some((name.as_str(), dtype, shape, end.saturating_sub(start)))
        })
    }
}

fn parse_format(m: &Path, q: Option<&Value>) -> Result<Option<RowFormat>> {
    let supported = "{\"bits\":4,\"group_size\":32,\"mode\":\"affine\"}, {\"bits\":4,\"group_size\":16,\"mode\":\"nvfp4\"} or null (unquantized rows)";
    let Some(q) = q else {
        return Err(err(
            m,
            "manifest field `quantization` is missing".to_string(),
        ));
    };
    if q.is_null() {
        // The dtype comes from the tensors (only `safetensors_ranges` stores plain rows).
        return Ok(None);
    }
    let key = (
        q.get("bits").and_then(Value::as_i64),
        q.get("group_size").and_then(Value::as_i64),
        q.get("mode").and_then(Value::as_str),
    );
    match key {
        (Some(4), Some(32), Some("affine")) => Ok(Some(RowFormat::Affine4)),
        (Some(4), Some(16), Some("nvfp4")) => Ok(Some(RowFormat::Nvfp4)),
        _ => Err(err(
            m,
            format!("manifest field `quantization` is {q}: supported are {supported}"),
        )),
    }
}

impl PleLayout {
    /// Reads and checks the manifest `storage` names inside `model_dir`. Every refusal names
    /// the manifest field at fault (see the module docs for the list).
    pub fn open(model_dir: &Path, storage: &PleStorageConfig) -> Result<PleLayout> {
        let root = fs::canonicalize(model_dir).map_err(|e| StreamError::io(model_dir, e))?;
        let config_path = model_dir.join("config.json");
        let manifest_path = model_dir.join(&storage.manifest);
        if !manifest_path.is_file() {
            return Err(cfg_err(
                &config_path,
                format!(
                    "`{}.manifest` names {}, which does not exist (run `mlxcel prepare-external-ple --model {}`)",
                    storage.key,
                    manifest_path.display(),
                    model_dir.display()
                ),
            ));
        }
        let real_manifest =
            fs::canonicalize(&manifest_path).map_err(|e| StreamError::io(&manifest_path, e))?;
        if !real_manifest.starts_with(&root) {
            return Err(cfg_err(
                &config_path,
                format!(
                    "`{}.manifest` `{}` resolves to {} outside the model folder {}",
                    storage.key,
                    storage.manifest,
                    real_manifest.display(),
                    root.display()
                ),
            ));
        }
        let m = manifest_path.as_path();
        let text = fs::read_to_string(m).map_err(|e| StreamError::io(m, e))?;
        let json: Value =
            serde_json::from_str(&text).map_err(|e| err(m, format!("invalid manifest: {e}")))?;
        let Some(obj) = json.as_object() else {
            return Err(err(m, "invalid manifest: not a JSON object".to_string()));
        };
        let version = int_field(m, obj.get("version"), "version")?;
        if version != MANIFEST_VERSION as i64 {
            return Err(err(
                m,
                format!("manifest field `version` is {version}: this build reads version {MANIFEST_VERSION} (mlx-vlm's external-PLE manifest)"),
            ));
        }
        let source_root = string_field(m, obj.get("source_root"), "source_root")?;
        let row_width = positive(m, obj.get("row_width"), "row_width")? as usize;
        let declared = parse_format(m, obj.get("quantization"))?;
        let kind = match obj.get("layout") {
            None => LayoutKind::SafetensorsRanges,
            Some(Value::String(s)) if s == "safetensors_ranges" => LayoutKind::SafetensorsRanges,
            Some(Value::String(s)) if s == "interleaved_q4" => LayoutKind::InterleavedQ4,
            Some(v) => {
                return Err(err(
                    m,
                    format!("manifest field `layout` is {v}: expected \"safetensors_ranges\" or \"interleaved_q4\""),
                ))
            }
        };
        if let Some(g) = declared.and_then(RowFormat::group_size) {
            if row_width % g != 0 {
                return Err(err(
                    m,
                    format!("manifest field `row_width` is {row_width}: expected a multiple of the group size {g}"),
                ));
            }
        }
        let cache_rows = match obj.get("cache_rows") {
            None | Some(Value::Null) => 0,
            Some(v) => v.as_u64().ok_or_else(|| {
                err(
                    m,
                    format!("manifest field `cache_rows` is {v}: expected a non-negative integer"),
                )
            })?,
        };
        let manifest_dir = manifest_path.parent().unwrap_or(model_dir).to_path_buf();
        let sha256 = match obj.get("sha256") {
            None => BTreeMap::new(),
            Some(Value::Object(map)) => map
                .iter()
                .map(|(k, v)| match v.as_str() {
                    Some(h) if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) => {
                        Ok((k.clone(), h.to_string()))
                    }
                    _ => Err(err(
                        m,
                        format!("manifest field `sha256.{k}` is {v}: expected 64 hex digits"),
                    )),
                })
                .collect::<Result<_>>()?,
            Some(v) => {
                return Err(err(
                    m,
                    format!(
                        "manifest field `sha256` is {v}: expected an object of file → hex digest"
                    ),
                ))
            }
        };
        let mut layout = PleLayout {
            manifest_path: manifest_path.clone(),
            kind,
            format: declared.unwrap_or(RowFormat::Plain(Dtype::Float32)),
            row_width,
            row_count: 0,
            record_bytes: 0,
            files: Vec::new(),
            shards: Vec::new(),
            cache_rows,
            sha256,
        };
        match kind {
            LayoutKind::InterleavedQ4 => {
                let Some(format) = declared else {
                    return Err(err(
                        m,
                        "manifest field `quantization` is null: the `interleaved_q4` layout stores 4-bit rows".to_string(),
                    ));
                };
                let data_file = string_field(m, obj.get("data_file"), "data_file")?;
                if !plain_file_name(data_file) {
                    return Err(err(
                        m,
                        format!("manifest field `data_file` `{data_file}` must be a file name beside the manifest"),
                    ));
                }
                let row_count = positive(m, obj.get("row_count"), "row_count")?;
                let row_stride = positive(m, obj.get("row_stride"), "row_stride")?;
                let record = format.record_bytes(row_width) as u64;
                if row_stride != record {
                    return Err(err(
                        m,
                        format!(
                            "manifest field `row_stride` is {row_stride}: rows of {row_width} values in {} take {record} bytes",
                            format.describe()
                        ),
                    ));
                }
                let path = manifest_dir.join(data_file);
                let real = inside(m, &root, &path, "data_file", data_file)?;
                let size = fs::metadata(&real)
                    .map_err(|e| StreamError::io(&real, e))?
                    .len();
                let want = row_count.checked_mul(row_stride);
                if want != Some(size) {
                    return Err(err(
                        m,
                        format!(
                            "manifest fields `row_count` × `row_stride` = {row_count} × {row_stride} bytes, but `data_file` {data_file} is {size} bytes"
                        ),
                    ));
                }
                layout.format = format;
                layout.row_count = row_count;
                layout.record_bytes = record as usize;
                layout.files.push(real);
                layout.shards.push(Shard {
                    row_start: 0,
                    row_count,
                    extents: vec![Extent {
                        file: 0,
                        offset: 0,
                        stride: row_stride,
                        len: row_stride,
                    }],
                });
            }
            LayoutKind::SafetensorsRanges => {
                if Path::new(source_root).is_absolute() {
                    return Err(err(
                        m,
                        format!("manifest field `source_root` `{source_root}` is absolute: row files must resolve inside the model folder"),
                    ));
                }
                let source_dir = inside(
                    m,
                    &root,
                    &manifest_dir.join(source_root),
                    "source_root",
                    source_root,
                )?;
                layout.read_shards(m, &root, &source_dir, obj, declared)?;
                if let Some(v) = obj.get("row_count") {
                    let declared_rows = int_field(m, Some(v), "row_count")?;
                    if declared_rows != layout.row_count as i64 {
                        return Err(err(
                            m,
                            format!(
                                "manifest field `row_count` is {declared_rows}, the shards hold {} rows",
                                layout.row_count
                            ),
                        ));
                    }
                }
            }
        }
        Ok(layout)
    }

    /// The `shards` of a `safetensors_ranges` manifest, each tensor checked against its file's
    /// safetensors header.
    fn read_shards(
        &mut self,
        m: &Path,
        root: &Path,
        source_dir: &Path,
        obj: &Map<String, Value>,
        declared: Option<RowFormat>,
    ) -> Result<()> {
        let shards = match obj.get("shards") {
            None => return Err(err(m, "manifest field `shards` is missing".to_string())),
            Some(Value::Array(s)) if !s.is_empty() => s,
            Some(v) => {
                return Err(err(
                    m,
                    format!("manifest field `shards` is {v}: expected a non-empty list"),
                ))
            }
        };
        let mut headers: BTreeMap<PathBuf, Header> = BTreeMap::new();
        let mut next_row = 0u64;
        // Unquantized rows take their dtype from the first shard's `weight`.
        let mut format = declared;
        for (i, shard) in shards.iter().enumerate() {
            let at = |f: &str| format!("shards[{i}].{f}");
            let Some(shard) = shard.as_object() else {
                return Err(err(
                    m,
                    format!("manifest field `shards[{i}]` is not an object"),
                ));
            };
            let row_start = int_field(m, shard.get("row_start"), &at("row_start"))?;
            if row_start != next_row as i64 {
                return Err(err(
                    m,
                    format!("manifest field `{}` is {row_start}, expected {next_row}: shards are contiguous from row 0", at("row_start")),
                ));
            }
            let row_count = positive(m, shard.get("row_count"), &at("row_count"))?;
            // Affine rows whose scales and biases are F32 or F16 (mlx-lm's conversions of
            // float checkpoints) are read too (mlxcel's extension; mlx-vlm writes BF16).
            if i == 0 && format == Some(RowFormat::Affine4) {
                let tag = shard
                    .get("scales")
                    .and_then(|w| w.get("dtype"))
                    .and_then(Value::as_str)
                    .unwrap_or("?");
                if let Some(d @ (Dtype::Float32 | Dtype::Float16)) = float_of_tag(tag) {
                    format = Some(RowFormat::Affine4Float(d));
                }
            }
            if format.is_none() {
                let tag = shard
                    .get("weight")
                    .and_then(|w| w.get("dtype"))
                    .and_then(Value::as_str)
                    .unwrap_or("?");
                format = Some(RowFormat::Plain(float_of_tag(tag).ok_or_else(|| {
                    err(
                        m,
                        format!("manifest field `{}` is \"{tag}\": unquantized rows are F32, F16 or BF16", at("weight.dtype")),
                    )
                })?));
            }
            let format = format.expect("set above");
            let mut extents = Vec::new();
            for (name, tag, dtype) in format.planes() {
                let what = |f: &str| at(&format!("{name}.{f}"));
                let Some(t) = shard.get(name).and_then(Value::as_object) else {
                    return Err(err(m, format!("manifest field `{}` is missing", at(name))));
                };
                let file = string_field(m, t.get("file"), &what("file"))?;
                if !plain_file_name(file) {
                    return Err(err(
                        m,
                        format!(
                            "manifest field `{}` `{file}` must be a file name under `source_root`",
                            what("file")
                        ),
                    ));
                }
                let offset = int_field(m, t.get("offset"), &what("offset"))?;
                let dtype_tag = string_field(m, t.get("dtype"), &what("dtype"))?;
                if dtype_tag != tag {
                    return Err(err(
                        m,
                        format!("manifest field `{}` is \"{dtype_tag}\": {} rows store `{name}` as \"{tag}\"", what("dtype"), format.describe()),
                    ));
                }
                let shape: Vec<i64> = match t.get("shape").and_then(Value::as_array) {
                    Some(s) => s.iter().map(|d| d.as_i64().unwrap_or(-1)).collect(),
                    None => {
                        return Err(err(
                            m,
                            format!(
                                "manifest field `{}` is missing or not a list",
                                what("shape")
                            ),
                        ))
                    }
                };
                let per_row = format.plane_elems(name, self.row_width) as i64;
                let want_shape = vec![row_count as i64, per_row];
                if shape != want_shape {
                    return Err(err(
                        m,
                        format!(
                            "manifest field `{}` is {shape:?}, expected {want_shape:?} ({row_count} rows of {} values in {})",
                            what("shape"),
                            self.row_width,
                            format.describe()
                        ),
                    ));
                }
                let path = inside(m, root, &source_dir.join(file), &what("file"), file)?;
                if !headers.contains_key(&path) {
                    headers.insert(path.clone(), read_header(&path)?);
                }
                let header = &headers[&path];
                let Some((tensor, st_dtype, st_shape, nbytes)) =
                    header.tensor_at(offset.max(0) as u64)
                else {
                    return Err(err(
                        m,
                        format!(
                            "manifest field `{}` {offset} is not where a tensor of {file} starts",
                            what("offset")
                        ),
                    ));
                };
                if st_dtype != dtype_tag {
                    return Err(err(
                        m,
                        format!("manifest field `{}` is \"{dtype_tag}\" but {file}'s header gives \"{st_dtype}\" for `{tensor}`", what("dtype")),
                    ));
                }
                if st_shape != shape {
                    return Err(err(
                        m,
                        format!("manifest field `{}` is {shape:?} but {file}'s header gives {st_shape:?} for `{tensor}`", what("shape")),
                    ));
                }
                let row_bytes = per_row as u64 * dtype.size_of() as u64;
                if nbytes != row_bytes * row_count {
                    return Err(err(
                        m,
                        format!("{file}'s header gives `{tensor}` {nbytes} bytes of data, its shape and dtype {}", row_bytes * row_count),
                    ));
                }
                let file_index = match self.files.iter().position(|f| *f == path) {
                    Some(i) => i,
                    None => {
                        self.files.push(path);
                        self.files.len() - 1
                    }
                };
                extents.push(Extent {
                    file: file_index,
                    offset: offset as u64,
                    stride: row_bytes,
                    len: row_bytes,
                });
            }
            self.shards.push(Shard {
                row_start: next_row,
                row_count,
                extents,
            });
            next_row += row_count;
        }
        let format = format.expect("at least one shard");
        self.format = format;
        self.row_count = next_row;
        self.record_bytes = format.record_bytes(self.row_width);
        Ok(())
    }
}
