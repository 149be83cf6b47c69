//! Writing the external view of a checkpoint's per-layer-embedding table (`mlxcel
//! prepare-external-ple`) and checking it (`--verify`).

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use mlxcel_core::ops::QuantSpec;
use mlxcel_core::{Array, Dtype, WeightMap};
use serde_json::{json, Value};

use super::layout::{
    read_header, PleLayout, PleStorageConfig, RowFormat, INTERLEAVED_FILE, MANIFEST_FILE,
    MANIFEST_VERSION,
};
use super::store::PleStore;
use crate::io::sha256_file;
use crate::{Result, StreamError};

/// The suffix naming a per-layer-embedding table in a checkpoint (Gemma 3n's
/// `embed_tokens_per_layer`, at the root or under `model.language_model.`).
pub const PLE_TENSOR_SUFFIX: &str = "embed_tokens_per_layer.weight";

/// Rows quantized and written at a time (bounds the memory `prepare` needs).
const CHUNK_ROWS: usize = 4096;

fn err(path: &Path, message: String) -> StreamError {
    StreamError::Layout {
        path: path.to_path_buf(),
        message,
    }
}

/// The checkpoint's one per-layer-embedding table: its `.weight` name. None, or more than one
/// (one manifest describes one table), is an error.
pub fn find_table(weights: &WeightMap) -> Result<String> {
    let tables: Vec<&str> = weights
        .names()
        .filter(|n| n.ends_with(PLE_TENSOR_SUFFIX))
        .collect();
    match tables.as_slice() {
        [one] => Ok(one.to_string()),
        [] => Err(err(
            weights.folder(),
            format!("no per-layer-embedding table (`*{PLE_TENSOR_SUFFIX}`) in this checkpoint"),
        )),
        many => Err(err(
            weights.folder(),
            format!(
                "{} per-layer-embedding tables ({}): one manifest describes one table, more than one is refused",
                many.len(),
                many.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
            ),
        )),
    }
}

/// How `prepare` stores the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrepareQuant {
    /// As the checkpoint stores them: the manifest points at the checkpoint's own tensor bytes
    /// (`safetensors_ranges`, nothing copied).
    AsStored,
    /// MLX affine 4-bit in groups of 32 (scales and biases rounded to bf16, as mlx-vlm's
    /// layout stores them), one interleaved record per row in [`INTERLEAVED_FILE`].
    Affine4,
}

/// The table as the checkpoint stores it: its planes' names and how its rows are stored.
struct Table {
    base: String,
    rows: usize,
    width: usize,
    format: RowFormat,
    /// The planes' tensor names, in record order.
    planes: Vec<String>,
}

fn table(weights: &WeightMap, name: &str) -> Result<Table> {
    let folder = weights.folder();
    let info = weights
        .info(name)
        .ok_or_else(|| err(folder, format!("tensor `{name}` is missing")))?;
    if info.shape.len() != 2 {
        return Err(err(
            folder,
            format!(
                "`{name}` has shape {:?}: a per-layer-embedding table is 2-D",
                info.shape
            ),
        ));
    }
    let base = name.trim_end_matches(".weight").to_string();
    let rows = info.shape[0] as usize;
    let cols = info.shape[1] as usize;
    let scales = format!("{base}.scales");
    let biases = format!("{base}.biases");
    let tag = |n: &str| weights.info(n).map(|i| i.stored_dtype.clone());
    let (format, width, planes) = match (tag(&scales).as_deref(), tag(&biases).as_deref()) {
        (None, _) if info.dtype.is_float() => (RowFormat::Plain(info.dtype), cols, vec![name.to_string()]),
        (Some("BF16"), Some("BF16")) if info.stored_dtype == "U32" => {
            (RowFormat::Affine4, cols * 8, vec![name.to_string(), scales, biases])
        }
        (Some(s @ ("F32" | "F16")), Some(b)) if info.stored_dtype == "U32" && s == b => {
            let d = if s == "F32" {
                Dtype::Float32
            } else {
                Dtype::Float16
            };
            (
                RowFormat::Affine4Float(d),
                cols * 8,
                vec![name.to_string(), scales, biases],
            )
        }
        (Some("U8"), None) if info.stored_dtype == "U32" => {
            (RowFormat::Nvfp4, cols * 8, vec![name.to_string(), scales])
        }
        (s, b) => {
            return Err(err(
                folder,
                format!(
                    "`{name}` is stored as {} with scales {s:?} and biases {b:?}: external rows are float, affine 4-bit g32 (scales and biases both BF16, F32 or F16) or nvfp4",
                    info.stored_dtype
                ),
            ))
        }
    };
    for (plane, _, _) in format.planes().iter().skip(1) {
        let n = format!("{base}.{plane}");
        let want = vec![rows as i32, format.plane_elems(plane, width) as i32];
        let got = weights
            .info(&n)
            .map(|i| i.shape.clone())
            .unwrap_or_default();
        if got != want {
            return Err(err(
                folder,
                format!(
                    "`{n}` has shape {got:?}, expected {want:?} for {} rows",
                    format.describe()
                ),
            ));
        }
    }
    Ok(Table {
        base,
        rows,
        width,
        format,
        planes,
    })
}

/// The path of `path` relative to the model folder, as the manifest names files.
fn relative(model_dir: &Path, path: &Path) -> Result<String> {
    let root = fs::canonicalize(model_dir).map_err(|e| StreamError::io(model_dir, e))?;
    let real = fs::canonicalize(path).map_err(|e| StreamError::io(path, e))?;
    real.strip_prefix(&root)
        .ok()
        .and_then(Path::to_str)
        .map(str::to_string)
        .ok_or_else(|| {
            err(
                path,
                format!("not a UTF-8 path inside {}", model_dir.display()),
            )
        })
}

/// Records (planes back to back) of rows `start..end` of `t`, as the external view stores them.
fn records(
    weights: &WeightMap,
    t: &Table,
    quant: PrepareQuant,
    start: usize,
    end: usize,
) -> Result<Vec<u8>> {
    let n = end - start;
    let plane_bytes = |name: &str| -> Result<&[u8]> {
        weights
            .bytes(name)
            .ok_or_else(|| err(weights.folder(), format!("`{name}` is not a file tensor")))
    };
    // Per plane: the chunk's bytes and the bytes of one row.
    let planes: Vec<(Vec<u8>, usize)> = match quant {
        PrepareQuant::AsStored => t
            .planes
            .iter()
            .map(|name| {
                let all = plane_bytes(name)?;
                let row = all.len() / t.rows.max(1);
                Ok((all[start * row..end * row].to_vec(), row))
            })
            .collect::<Result<_>>()?,
        PrepareQuant::Affine4 => {
            let RowFormat::Plain(dtype) = t.format else {
                return Err(err(
                    weights.folder(),
                    format!(
                        "`{}` is already quantized ({}): prepare it as stored",
                        t.base,
                        t.format.describe()
                    ),
                ));
            };
            let all = plane_bytes(&t.planes[0])?;
            let row = t.width * dtype.size_of();
            let chunk = Array::from_bytes(
                &all[start * row..end * row],
                &[n as i32, t.width as i32],
                dtype,
            )?;
            let q = chunk.quantize(QuantSpec::affine(32, 4))?;
            let biases = q.biases.ok_or_else(|| {
                err(
                    weights.folder(),
                    "affine quantization gave no biases".into(),
                )
            })?;
            let planes = [
                q.weight,
                q.scales.astype(Dtype::Bfloat16)?,
                biases.astype(Dtype::Bfloat16)?,
            ];
            planes
                .iter()
                .map(|a| {
                    let bytes = a.to_bytes()?;
                    let row = bytes.len() / n.max(1);
                    Ok((bytes, row))
                })
                .collect::<Result<_>>()?
        }
    };
    let record: usize = planes.iter().map(|(_, r)| r).sum();
    let mut out = Vec::with_capacity(n * record);
    for r in 0..n {
        for (bytes, row) in &planes {
            out.extend_from_slice(&bytes[r * row..(r + 1) * row]);
        }
    }
    Ok(out)
}

/// Writes `bytes` to `path` through a sibling temporary file, so a reader never sees half of it.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("partial");
    fs::write(&tmp, bytes).map_err(|e| StreamError::io(&tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| StreamError::io(path, e))
}

/// Writes the external view of the per-layer-embedding table of the checkpoint `weights`
/// (opened from `model_dir`): the manifest [`MANIFEST_FILE`] (mlx-vlm's version 2 plus
/// mlxcel's `sha256` of every row file), the row file when quantizing, and `ple_storage` in
/// `config.json` (under `text_config` when the config has one). Returns the checked layout.
pub fn prepare(
    model_dir: &Path,
    weights: &WeightMap,
    quant: PrepareQuant,
    progress: impl FnMut(usize, usize),
) -> Result<PleLayout> {
    let name = find_table(weights)?;
    let t = table(weights, &name)?;
    let (manifest, files) = match quant {
        PrepareQuant::AsStored => in_place_manifest(model_dir, weights, &t)?,
        PrepareQuant::Affine4 => interleaved(model_dir, weights, &t, progress)?,
    };
    let mut manifest = manifest;
    let mut sha = serde_json::Map::new();
    for f in files {
        sha.insert(relative(model_dir, &f)?, Value::String(sha256_file(&f)?));
    }
    manifest["sha256"] = Value::Object(sha);
    let text =
        serde_json::to_string_pretty(&manifest).map_err(|e| err(model_dir, e.to_string()))? + "\n";
    write_atomically(&model_dir.join(MANIFEST_FILE), text.as_bytes())?;
    let config_path = model_dir.join("config.json");
    let raw = fs::read_to_string(&config_path).map_err(|e| StreamError::io(&config_path, e))?;
    let mut config: Value =
        serde_json::from_str(&raw).map_err(|e| err(&config_path, format!("invalid JSON: {e}")))?;
    let entry = json!({"manifest": MANIFEST_FILE, "cache_rows": 0});
    match config.get_mut("text_config").and_then(Value::as_object_mut) {
        Some(text) => {
            text.insert("ple_storage".into(), entry);
        }
        None => {
            config["ple_storage"] = entry;
        }
    }
    let text =
        serde_json::to_string_pretty(&config).map_err(|e| err(&config_path, e.to_string()))? + "\n";
    write_atomically(&config_path, text.as_bytes())?;
    let storage = PleStorageConfig::from_config(&config, &config_path)?.expect("just written");
    PleLayout::open(model_dir, &storage)
}

/// A `safetensors_ranges` manifest over the checkpoint's own tensor bytes.
fn in_place_manifest(
    model_dir: &Path,
    weights: &WeightMap,
    t: &Table,
) -> Result<(Value, Vec<PathBuf>)> {
    let mut shard = serde_json::Map::new();
    shard.insert("row_start".into(), json!(0));
    shard.insert("row_count".into(), json!(t.rows));
    let mut files = Vec::new();
    for ((plane, tag, _), name) in t.format.planes().iter().zip(&t.planes) {
        let info = weights.info(name).expect("planes exist");
        let file = info
            .file
            .clone()
            .ok_or_else(|| err(model_dir, format!("`{name}` is not a file tensor")))?;
        let header = read_header(&file)?;
        let start = header
            .tensors
            .get(name)
            .and_then(|v| v.get("data_offsets"))
            .and_then(|o| o.get(0))
            .and_then(Value::as_u64)
            .ok_or_else(|| err(&file, format!("`{name}` has no data_offsets in the header")))?;
        shard.insert(
            plane.to_string(),
            json!({
                "file": relative(model_dir, &file)?,
                "offset": header.data_start + start,
                "dtype": tag,
                "shape": info.shape,
            }),
        );
        if !files.contains(&file) {
            files.push(file);
        }
    }
    let manifest = json!({
        "version": MANIFEST_VERSION,
        "source_root": ".",
        "layout": "safetensors_ranges",
        "row_width": t.width,
        "row_count": t.rows,
        "quantization": t.format.quantization_json(),
        "cache_rows": 0,
        "shards": [Value::Object(shard)],
    });
    Ok((manifest, files))
}

/// Writes [`INTERLEAVED_FILE`] (affine 4-bit records) and its `interleaved_q4` manifest.
fn interleaved(
    model_dir: &Path,
    weights: &WeightMap,
    t: &Table,
    mut progress: impl FnMut(usize, usize),
) -> Result<(Value, Vec<PathBuf>)> {
    let path = model_dir.join(INTERLEAVED_FILE);
    let tmp = path.with_extension("rows.partial");
    let file = File::create(&tmp).map_err(|e| StreamError::io(&tmp, e))?;
    let mut w = BufWriter::new(file);
    let mut start = 0;
    while start < t.rows {
        let end = (start + CHUNK_ROWS).min(t.rows);
        let bytes = records(weights, t, PrepareQuant::Affine4, start, end)?;
        w.write_all(&bytes).map_err(|e| StreamError::io(&tmp, e))?;
        progress(end, t.rows);
        start = end;
    }
    w.flush().map_err(|e| StreamError::io(&tmp, e))?;
    drop(w);
    fs::rename(&tmp, &path).map_err(|e| StreamError::io(&path, e))?;
    let format = RowFormat::Affine4;
    let manifest = json!({
        "version": MANIFEST_VERSION,
        "source_root": ".",
        "layout": "interleaved_q4",
        "data_file": INTERLEAVED_FILE,
        "row_width": t.width,
        "row_count": t.rows,
        "row_stride": format.record_bytes(t.width),
        "quantization": format.quantization_json(),
        "cache_rows": 0,
    });
    Ok((manifest, vec![path]))
}

/// Checks the external view of `model_dir` in full: the manifest's structure (what every load
/// checks), every row file's SHA-256 against the manifest, and, while the checkpoint still
/// holds the table, every row against the checkpoint's (re-quantized when the view is
/// quantized and the checkpoint is not).
pub fn verify(model_dir: &Path, weights: &WeightMap, config: &Value) -> Result<PleLayout> {
    let config_path = model_dir.join("config.json");
    let storage = PleStorageConfig::from_config(config, &config_path)?.ok_or_else(|| {
        err(
            &config_path,
            "no `ple_storage` in config.json: run `mlxcel prepare-external-ple` first".to_string(),
        )
    })?;
    let layout = PleLayout::open(model_dir, &storage)?;
    let m = layout.manifest_path.clone();
    if layout.sha256.is_empty() {
        return Err(err(&m, "manifest field `sha256` is missing: nothing to check the row files against (`mlxcel prepare-external-ple` writes it)".to_string()));
    }
    for f in &layout.files {
        let rel = relative(model_dir, f)?;
        let want = layout.sha256.get(&rel).ok_or_else(|| {
            err(
                &m,
                format!("manifest field `sha256` has no digest for `{rel}`"),
            )
        })?;
        let got = sha256_file(f)?;
        if &got != want {
            return Err(err(f, format!("sha256 {got} differs from the manifest's {want}: the row file is corrupt or was changed; rerun `mlxcel prepare-external-ple`")));
        }
    }
    let Ok(name) = find_table(weights) else {
        return Ok(layout);
    };
    let t = table(weights, &name)?;
    let quant = match (t.format, layout.format) {
        (a, b) if a == b => PrepareQuant::AsStored,
        (RowFormat::Plain(_), RowFormat::Affine4) => PrepareQuant::Affine4,
        (a, b) => {
            return Err(err(
                &m,
                format!(
                    "the view stores {} rows, the checkpoint's `{name}` is {}",
                    b.describe(),
                    a.describe()
                ),
            ));
        }
    };
    if (t.rows as u64, t.width) != (layout.row_count, layout.row_width) {
        return Err(err(&m, format!(
            "manifest fields `row_count` × `row_width` are {} × {}, the checkpoint's `{name}` holds {} × {}",
            layout.row_count, layout.row_width, t.rows, t.width
        )));
    }
    let store = PleStore::open(layout.clone(), mlxcel_core::policy::PleIo::Mmap, 0)?;
    let record = layout.record_bytes;
    let mut start = 0;
    while start < t.rows {
        let end = (start + CHUNK_ROWS).min(t.rows);
        let want = records(weights, &t, quant, start, end)?;
        let ids: Vec<u32> = (start as u32..end as u32).collect();
        let got = store.raw_records(&ids)?;
        for (r, row) in got.iter().enumerate() {
            if row[..] != want[r * record..(r + 1) * record] {
                return Err(err(&m, format!(
                    "row {} of the external table differs from the checkpoint's `{name}`: the view is stale or corrupt; rerun `mlxcel prepare-external-ple`",
                    start + r
                )));
            }
        }
        start = end;
    }
    Ok(layout)
}
