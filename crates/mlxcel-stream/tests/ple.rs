//! External per-layer-embedding storage on tables written here: every I/O mode and cache size
//! against the table read whole with MLX, quantized views against MLX's own quantize +
//! dequantize of the whole table, gather-ahead, truncated files, `verify`, and every manifest
//! refusal with its exact message.

use std::fs;
use std::path::{Path, PathBuf};

use mlxcel_core::ops::{self, QuantMode, QuantSpec};
use mlxcel_core::policy::PleIo;
use mlxcel_core::weights::save_safetensors;
use mlxcel_core::{Array, Dtype, WeightMap};
use mlxcel_stream::ple::{
    self, PleLayout, PleStorageConfig, PleStore, PrepareQuant, RowFormat, MANIFEST_FILE,
};
use mlxcel_stream::StreamError;
use serde_json::{json, Value};

const ROWS: usize = 40;
const WIDTH: usize = 64;
const TABLE: &str = "model.language_model.embed_tokens_per_layer.weight";

/// A deterministic table with values of both signs and varied magnitudes.
fn table_values() -> Vec<f32> {
    (0..ROWS * WIDTH)
        .map(|i| {
            let x = i as f32;
            (x * 0.37).sin() * (1.0 + (x * 0.011).cos()) + 0.001 * (i % 7) as f32
        })
        .collect()
}

fn table_f32() -> Array {
    Array::from_slice(&table_values(), &[ROWS as i32, WIDTH as i32]).unwrap()
}

/// A model folder holding `tensors` (plus an unrelated tensor) and a Gemma-3n-like config.
fn model_dir(tensors: Vec<(String, Array)>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut all = tensors;
    all.push((
        "model.language_model.norm.weight".to_string(),
        Array::from_slice(&[1f32; 8], &[8]).unwrap(),
    ));
    save_safetensors(dir.path().join("model.safetensors"), &all, None).unwrap();
    let config = json!({
        "model_type": "gemma3n",
        "text_config": {"model_type": "gemma3n_text", "hidden_size_per_layer_input": 16, "num_hidden_layers": 4}
    });
    fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    dir
}

fn prepared(dir: &Path, quant: PrepareQuant) -> PleLayout {
    let weights = WeightMap::open(dir).unwrap();
    ple::prepare(dir, &weights, quant, |_, _| {}).unwrap()
}

fn storage(dir: &Path) -> PleStorageConfig {
    let config: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    PleStorageConfig::from_config(&config, &dir.join("config.json"))
        .unwrap()
        .unwrap()
}

fn f32s(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

/// Rows `ids` of the whole-table reference `[ROWS, WIDTH]`.
fn take(reference: &[f32], ids: &[u32]) -> Vec<f32> {
    ids.iter()
        .flat_map(|i| reference[*i as usize * WIDTH..(*i as usize + 1) * WIDTH].to_vec())
        .collect()
}

/// A pass pattern with repeats inside passes and across them.
const PASSES: [&[u32]; 4] = [
    &[3, 0, 39, 3, 17],
    &[17, 18, 19, 3],
    &[5],
    &[39, 0, 1, 2, 5, 5],
];

/// Every I/O mode and cache size from none to all rows gives exactly `reference`'s rows.
fn check_all_modes(dir: &Path, reference: &[f32], dtype: Dtype) {
    let layout = PleLayout::open(dir, &storage(dir)).unwrap();
    let record = layout.record_bytes as u64;
    for io in [PleIo::Mmap, PleIo::Direct, PleIo::Ram] {
        for cache_rows in [0u64, 1, 3, ROWS as u64, 10 * ROWS as u64] {
            let store = PleStore::open(layout.clone(), io, cache_rows * record).unwrap();
            for (k, ids) in PASSES.iter().enumerate() {
                if k % 2 == 0 {
                    store.prefetch(PASSES[(k + 1) % PASSES.len()]).unwrap();
                }
                let rows = store.rows(ids, dtype).unwrap();
                assert_eq!(rows.shape(), vec![ids.len() as i32, WIDTH as i32]);
                assert_eq!(rows.dtype().unwrap(), dtype);
                assert_eq!(
                    f32s(&rows),
                    take(reference, ids),
                    "{io:?}, cache of {cache_rows} rows, pass {k}"
                );
            }
            let stats = store.stats().borrow().clone();
            let asked: u64 = PASSES.iter().map(|p| p.len() as u64).sum();
            assert_eq!(stats.hits + stats.misses, asked, "{io:?} {cache_rows}");
            if io == PleIo::Ram {
                assert_eq!(stats.misses, 0);
                assert_eq!(stats.bytes_read, layout.table_bytes());
                assert_eq!(store.resident_bytes(), layout.table_bytes());
            } else {
                assert_eq!(
                    stats.bytes_read,
                    stats.misses * record,
                    "{io:?} {cache_rows}"
                );
                assert_eq!(store.resident_bytes(), cache_rows.min(ROWS as u64) * record);
            }
        }
    }
}

#[test]
fn unquantized_rows_in_place_are_the_table_bit_for_bit() {
    let dir = model_dir(vec![(TABLE.into(), table_f32())]);
    let layout = prepared(dir.path(), PrepareQuant::AsStored);
    assert_eq!(layout.format, RowFormat::Plain(Dtype::Float32));
    assert_eq!(layout.kind, ple::LayoutKind::SafetensorsRanges);
    assert_eq!((layout.row_count, layout.row_width), (ROWS as u64, WIDTH));
    // Nothing copied: the manifest points into the checkpoint.
    assert_eq!(
        layout.files,
        vec![fs::canonicalize(dir.path().join("model.safetensors")).unwrap()]
    );
    check_all_modes(dir.path(), &table_values(), Dtype::Float32);
    ple::verify(
        dir.path(),
        &WeightMap::open(dir.path()).unwrap(),
        &config(dir.path()),
    )
    .unwrap();
}

#[test]
fn bf16_rows_come_back_cast_like_the_resident_table() {
    let bf16 = table_f32().astype(Dtype::Bfloat16).unwrap();
    let reference = f32s(&bf16);
    let dir = model_dir(vec![(TABLE.into(), bf16)]);
    let layout = prepared(dir.path(), PrepareQuant::AsStored);
    assert_eq!(layout.format, RowFormat::Plain(Dtype::Bfloat16));
    check_all_modes(dir.path(), &reference, Dtype::Float32);
    check_all_modes(dir.path(), &reference, Dtype::Bfloat16);
}

fn config(dir: &Path) -> Value {
    serde_json::from_str(&fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

/// MLX's affine 4-bit g32 of the whole table, scales and biases rounded to bf16 (mlx-vlm's
/// layout), dequantized in f32.
fn affine_reference() -> Vec<f32> {
    let q = table_f32().quantize(QuantSpec::affine(32, 4)).unwrap();
    let to = |a: &Array| {
        a.astype(Dtype::Bfloat16)
            .unwrap()
            .astype(Dtype::Float32)
            .unwrap()
    };
    let biases = q.biases.unwrap();
    let deq = ops::dequantize(
        &q.weight,
        &to(&q.scales),
        Some(&to(&biases)),
        QuantSpec::affine(32, 4),
        Some(Dtype::Float32),
    )
    .unwrap();
    f32s(&deq)
}

#[test]
fn affine4_interleaved_rows_match_mlx_quantize_and_dequantize() {
    let dir = model_dir(vec![(TABLE.into(), table_f32())]);
    let layout = prepared(dir.path(), PrepareQuant::Affine4);
    assert_eq!(layout.format, RowFormat::Affine4);
    assert_eq!(layout.kind, ple::LayoutKind::InterleavedQ4);
    // 32 bytes of nibbles + 2 groups × (2 + 2) bytes of scales and biases.
    assert_eq!(layout.record_bytes, 32 + 8);
    let manifest: Value =
        serde_json::from_str(&fs::read_to_string(dir.path().join(MANIFEST_FILE)).unwrap()).unwrap();
    assert_eq!(manifest["layout"], "interleaved_q4");
    assert_eq!(manifest["row_stride"], 40);
    assert_eq!(
        manifest["quantization"],
        json!({"bits": 4, "group_size": 32, "mode": "affine"})
    );
    assert_eq!(
        config(dir.path())["text_config"]["ple_storage"],
        json!({"manifest": "ple-store.json", "cache_rows": 0})
    );
    let reference = affine_reference();
    check_all_modes(dir.path(), &reference, Dtype::Float32);
    let weights = WeightMap::open(dir.path()).unwrap();
    ple::verify(dir.path(), &weights, &config(dir.path())).unwrap();
    // A changed byte in the row file: the SHA-256 says so.
    let rows = dir.path().join("ple-q4.rows");
    let mut bytes = fs::read(&rows).unwrap();
    bytes[100] ^= 1;
    fs::write(&rows, &bytes).unwrap();
    let err = ple::verify(dir.path(), &weights, &config(dir.path())).unwrap_err();
    assert!(
        err.to_string()
            .contains("the row file is corrupt or was changed"),
        "{err}"
    );
}

#[test]
fn quantized_checkpoint_tables_are_indexed_in_place() {
    // Affine 4/32 with bf16 planes (an mlx-lm/mlx-vlm quantized checkpoint) and nvfp4.
    let q = table_f32().quantize(QuantSpec::affine(32, 4)).unwrap();
    let scales = q.scales.astype(Dtype::Bfloat16).unwrap();
    let biases = q.biases.unwrap().astype(Dtype::Bfloat16).unwrap();
    let base = TABLE.trim_end_matches(".weight");
    let dir = model_dir(vec![
        (TABLE.into(), q.weight.clone()),
        (format!("{base}.scales"), scales),
        (format!("{base}.biases"), biases),
    ]);
    let layout = prepared(dir.path(), PrepareQuant::AsStored);
    assert_eq!(layout.format, RowFormat::Affine4);
    assert_eq!(layout.kind, ple::LayoutKind::SafetensorsRanges);
    check_all_modes(dir.path(), &affine_reference(), Dtype::Float32);

    let spec = QuantSpec::fixed(QuantMode::Nvfp4).unwrap();
    let q = table_f32().quantize(spec).unwrap();
    let reference =
        f32s(&ops::dequantize(&q.weight, &q.scales, None, spec, Some(Dtype::Float32)).unwrap());
    let dir = model_dir(vec![
        (TABLE.into(), q.weight.clone()),
        (format!("{base}.scales"), q.scales.clone()),
    ]);
    let layout = prepared(dir.path(), PrepareQuant::AsStored);
    assert_eq!(layout.format, RowFormat::Nvfp4);
    check_all_modes(dir.path(), &reference, Dtype::Float32);
    ple::verify(
        dir.path(),
        &WeightMap::open(dir.path()).unwrap(),
        &config(dir.path()),
    )
    .unwrap();
}

#[test]
fn quantized_tables_of_other_layouts_are_refused_naming_the_tensor() {
    let q = table_f32().quantize(QuantSpec::affine(32, 4)).unwrap();
    let base = TABLE.trim_end_matches(".weight");
    let dir = model_dir(vec![
        (TABLE.into(), q.weight.clone()),
        (
            format!("{base}.scales"),
            q.scales.astype(Dtype::Uint8).unwrap(),
        ),
        (format!("{base}.biases"), q.biases.unwrap()),
    ]);
    let weights = WeightMap::open(dir.path()).unwrap();
    let err = ple::prepare(dir.path(), &weights, PrepareQuant::AsStored, |_, _| {}).unwrap_err();
    assert!(err.to_string().ends_with(&format!(
        "`{TABLE}` is stored as U32 with scales Some(\"U8\") and biases Some(\"F32\"): external rows are float, affine 4-bit g32 (scales and biases both BF16, F32 or F16) or nvfp4"
    )), "{err}");
    assert!(!dir.path().join(MANIFEST_FILE).exists());
}

#[test]
fn repeated_ids_are_read_once_and_the_lru_keeps_recent_rows() {
    let dir = model_dir(vec![(TABLE.into(), table_f32())]);
    let layout = prepared(dir.path(), PrepareQuant::AsStored);
    let record = layout.record_bytes as u64;
    let store = PleStore::open(layout, PleIo::Mmap, 2 * record).unwrap();
    let stats = store.stats();
    store.rows(&[1, 2, 1, 1], Dtype::Float32).unwrap();
    assert_eq!((stats.borrow().hits, stats.borrow().misses), (2, 2));
    // 1 and 2 cached; 3 evicts 1 (least recent), so 2 hits and 1 misses.
    store.rows(&[3], Dtype::Float32).unwrap();
    store.rows(&[2], Dtype::Float32).unwrap();
    assert_eq!((stats.borrow().hits, stats.borrow().misses), (3, 3));
    store.rows(&[1], Dtype::Float32).unwrap();
    assert_eq!((stats.borrow().hits, stats.borrow().misses), (3, 4));
    // Gathered ahead: read on the background thread, counted as misses once used.
    store.prefetch(&[10, 11, 10]).unwrap();
    let rows = store.rows(&[10, 11], Dtype::Float32).unwrap();
    assert_eq!(f32s(&rows), take(&table_values(), &[10, 11]));
    let s = stats.borrow().clone();
    assert_eq!((s.hits, s.misses, s.gathered_ahead), (3, 6, 2));
    assert_eq!(s.bytes_read, 6 * record);
    assert!(
        s.describe()
            .starts_with("[PLE rows: 3 hits, 6 misses (33.3% hit rate, 2 gathered ahead)"),
        "{}",
        s.describe()
    );
    let err = store.rows(&[40], Dtype::Float32).unwrap_err();
    assert!(
        err.to_string()
            .ends_with("row 40 asked for, the table has 40 rows"),
        "{err}"
    );
}

#[test]
fn a_truncated_row_file_is_an_error_in_direct_and_mmap_modes() {
    let dir = model_dir(vec![(TABLE.into(), table_f32())]);
    let layout = prepared(dir.path(), PrepareQuant::Affine4);
    let rows = dir.path().join("ple-q4.rows");
    for io in [PleIo::Direct, PleIo::Mmap] {
        let full = fs::read(&rows).unwrap();
        let store = PleStore::open(layout.clone(), io, 0).unwrap();
        store.rows(&[39], Dtype::Float32).unwrap();
        fs::write(&rows, &full[..full.len() - 50]).unwrap();
        let err = store.rows(&[39], Dtype::Float32).unwrap_err();
        assert!(
            err.to_string()
                .contains("file is truncated: 40 bytes expected at offset 1560"),
            "{io:?}: {err}"
        );
        // Also from the gather-ahead thread: the error comes back on the next call.
        store.prefetch(&[38, 39]).unwrap();
        let err = store.rows(&[0], Dtype::Float32).unwrap_err();
        assert!(
            err.to_string().contains("file is truncated"),
            "{io:?}: {err}"
        );
        fs::write(&rows, &full).unwrap();
    }
    // A short file at load is refused by the manifest check.
    fs::write(&rows, &fs::read(&rows).unwrap()[..100]).unwrap();
    let message = layout_message(dir.path());
    assert_eq!(
        message,
        "manifest fields `row_count` × `row_stride` = 40 × 40 bytes, but `data_file` ple-q4.rows is 100 bytes"
    );
}

#[test]
fn two_tables_are_refused() {
    let dir = model_dir(vec![
        (TABLE.into(), table_f32()),
        ("model.embed_tokens_per_layer.weight".into(), table_f32()),
    ]);
    let weights = WeightMap::open(dir.path()).unwrap();
    let err = ple::prepare(dir.path(), &weights, PrepareQuant::AsStored, |_, _| {}).unwrap_err();
    assert!(err.to_string().ends_with(
        "2 per-layer-embedding tables (`model.embed_tokens_per_layer.weight`, `model.language_model.embed_tokens_per_layer.weight`): one manifest describes one table, more than one is refused"
    ), "{err}");
    let config =
        json!({"text_config": {"ple_storage": [{"manifest": "a.json"}, {"manifest": "b.json"}]}});
    let err = PleStorageConfig::from_config(&config, Path::new("config.json")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "config.json: `text_config.ple_storage` lists 2 PLE tables: one manifest describes one table, more than one is refused"
    );
}

#[test]
fn config_entries_outside_the_model_folder_are_refused() {
    let check = |entry: Value, want: &str| {
        let config = json!({"text_config": {"ple_storage": entry}});
        let err = PleStorageConfig::from_config(&config, Path::new("config.json")).unwrap_err();
        assert_eq!(err.to_string(), format!("config.json: {want}"));
    };
    check(
        json!({"manifest": "/models/x/ple-store.json"}),
        "`text_config.ple_storage.manifest` `/models/x/ple-store.json` is absolute: the manifest must be inside the model folder",
    );
    check(
        json!({"manifest": "../other/ple-store.json"}),
        "`text_config.ple_storage.manifest` `../other/ple-store.json` leaves the model folder (`..`)",
    );
    check(json!({}), "`text_config.ple_storage.manifest` is missing");
    check(
        json!({"manifest": 3}),
        "`text_config.ple_storage.manifest` is 3: expected the manifest's path",
    );
    check(
        json!({"manifest": "p.json", "cache_rows": -1}),
        "`text_config.ple_storage.cache_rows` is -1: expected a non-negative integer",
    );
    // Top level (gemma3n_text) works the same; no entry is a resident table.
    let config = json!({"ple_storage": {"manifest": "p.json", "cache_rows": 8}});
    let s = PleStorageConfig::from_config(&config, Path::new("config.json"))
        .unwrap()
        .unwrap();
    assert_eq!(
        (s.manifest.as_str(), s.cache_rows, s.key.as_str()),
        ("p.json", 8, "ple_storage")
    );
    assert!(PleStorageConfig::from_config(&json!({}), Path::new("c"))
        .unwrap()
        .is_none());
}

/// The message of the refusal of the manifest in `dir` (the error names the manifest).
fn layout_message(dir: &Path) -> String {
    match PleLayout::open(dir, &storage(dir)) {
        Err(StreamError::Layout { path, message }) => {
            assert!(
                path.ends_with(MANIFEST_FILE) || path.ends_with("config.json"),
                "{}",
                path.display()
            );
            message
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// One manifest edit of a refusal case.
type Edit = Box<dyn FnOnce(&mut Value)>;

/// Rewrites the manifest through `edit` and returns the refusal's message.
fn refused(dir: &Path, good: &Value, edit: impl FnOnce(&mut Value)) -> String {
    let mut m = good.clone();
    edit(&mut m);
    fs::write(dir.join(MANIFEST_FILE), m.to_string()).unwrap();
    layout_message(dir)
}

#[test]
fn every_malformed_safetensors_ranges_field_is_named() {
    let q = table_f32().quantize(QuantSpec::affine(32, 4)).unwrap();
    let base = TABLE.trim_end_matches(".weight");
    let dir = model_dir(vec![
        (TABLE.into(), q.weight.clone()),
        (
            format!("{base}.scales"),
            q.scales.astype(Dtype::Bfloat16).unwrap(),
        ),
        (
            format!("{base}.biases"),
            q.biases.unwrap().astype(Dtype::Bfloat16).unwrap(),
        ),
    ]);
    prepared(dir.path(), PrepareQuant::AsStored);
    let d = dir.path();
    let good: Value =
        serde_json::from_str(&fs::read_to_string(d.join(MANIFEST_FILE)).unwrap()).unwrap();
    let weight_offset = good["shards"][0]["weight"]["offset"].as_u64().unwrap();
    let cases: Vec<(Edit, String)> = vec![
        (Box::new(|m| m["version"] = json!(3)), "manifest field `version` is 3: this build reads version 2 (mlx-vlm's external-PLE manifest)".into()),
        (Box::new(|m| { m.as_object_mut().unwrap().remove("version"); }), "manifest field `version` is missing".into()),
        (Box::new(|m| { m.as_object_mut().unwrap().remove("source_root"); }), "manifest field `source_root` is missing".into()),
        (Box::new(|m| m["row_width"] = json!(0)), "manifest field `row_width` is 0: expected a positive integer".into()),
        (Box::new(|m| m["row_width"] = json!(48)), "manifest field `row_width` is 48: expected a multiple of the group size 32".into()),
        (Box::new(|m| m["row_width"] = json!("64")), "manifest field `row_width` is \"64\": expected an integer".into()),
        (Box::new(|m| m["quantization"] = json!({"bits": 8, "group_size": 32, "mode": "affine"})),
            "manifest field `quantization` is {\"bits\":8,\"group_size\":32,\"mode\":\"affine\"}: supported are {\"bits\":4,\"group_size\":32,\"mode\":\"affine\"}, {\"bits\":4,\"group_size\":16,\"mode\":\"nvfp4\"} or null (unquantized rows)".into()),
        (Box::new(|m| m["layout"] = json!("rows")), "manifest field `layout` is \"rows\": expected \"safetensors_ranges\" or \"interleaved_q4\"".into()),
        (Box::new(|m| m["source_root"] = json!("/opt/models/gemma")), "manifest field `source_root` `/opt/models/gemma` is absolute: row files must resolve inside the model folder".into()),
        (Box::new(|m| m["cache_rows"] = json!(-2)), "manifest field `cache_rows` is -2: expected a non-negative integer".into()),
        (Box::new(|m| m["row_count"] = json!(41)), "manifest field `row_count` is 41, the shards hold 40 rows".into()),
        (Box::new(|m| m["shards"] = json!([])), "manifest field `shards` is []: expected a non-empty list".into()),
        (Box::new(|m| m["shards"][0]["row_start"] = json!(1)), "manifest field `shards[0].row_start` is 1, expected 0: shards are contiguous from row 0".into()),
        (Box::new(|m| m["shards"][0]["row_count"] = json!(0)), "manifest field `shards[0].row_count` is 0: expected a positive integer".into()),
        (Box::new(|m| { m["shards"][0].as_object_mut().unwrap().remove("biases"); }), "manifest field `shards[0].biases` is missing".into()),
        (Box::new(|m| m["shards"][0]["scales"]["dtype"] = json!("F64")), "manifest field `shards[0].scales.dtype` is \"F64\": affine 4-bit g32 rows store `scales` as \"BF16\"".into()),
        (Box::new(|m| m["shards"][0]["scales"]["dtype"] = json!("F32")), format!("manifest field `shards[0].scales.dtype` is \"F32\" but model.safetensors's header gives \"BF16\" for `{base}.scales`")),
        (Box::new(|m| m["shards"][0]["biases"]["dtype"] = json!("F32")), "manifest field `shards[0].biases.dtype` is \"F32\": affine 4-bit g32 rows store `biases` as \"BF16\"".into()),
        (Box::new(|m| m["shards"][0]["weight"]["file"] = json!("../model.safetensors")), "manifest field `shards[0].weight.file` `../model.safetensors` must be a file name under `source_root`".into()),
        (Box::new(|m| m["shards"][0]["weight"]["file"] = json!("/tmp/model.safetensors")), "manifest field `shards[0].weight.file` `/tmp/model.safetensors` must be a file name under `source_root`".into()),
        (Box::new(|m| m["shards"][0]["weight"]["shape"] = json!([40, 4])), "manifest field `shards[0].weight.shape` is [40, 4], expected [40, 8] (40 rows of 64 values in affine 4-bit g32)".into()),
        (Box::new(move |m| m["shards"][0]["weight"]["offset"] = json!(weight_offset + 4)), format!("manifest field `shards[0].weight.offset` {} is not where a tensor of model.safetensors starts", weight_offset + 4)),
        (Box::new(move |m| m["shards"][0]["scales"]["offset"] = json!(weight_offset)), format!("manifest field `shards[0].scales.dtype` is \"BF16\" but model.safetensors's header gives \"U32\" for `{TABLE}`")),
    ];
    for (edit, want) in cases {
        assert_eq!(refused(d, &good, edit), want);
    }
    // A header that disagrees on the shape: the file has 40 rows, a manifest claiming 20 rows of
    // 128 values points at the same bytes.
    let msg = refused(d, &good, |m| {
        m["row_width"] = json!(128);
        m["row_count"] = json!(20);
        m["shards"][0]["row_count"] = json!(20);
        m["shards"][0]["weight"]["shape"] = json!([20, 16]);
    });
    assert_eq!(msg, format!("manifest field `shards[0].weight.shape` is [20, 16] but model.safetensors's header gives [40, 8] for `{TABLE}`"));
    // source_root escaping the model folder through `..` or a symlink.
    let outside = tempfile::tempdir().unwrap();
    fs::copy(
        d.join("model.safetensors"),
        outside.path().join("model.safetensors"),
    )
    .unwrap();
    let rel = pathdiff(outside.path(), d);
    let msg = refused(d, &good, |m| m["source_root"] = json!(rel.clone()));
    assert!(
        msg.starts_with(&format!(
            "manifest field `source_root` `{rel}` resolves to "
        )) && msg.contains("outside the model folder"),
        "{msg}"
    );
    std::os::unix::fs::symlink(
        outside.path().join("model.safetensors"),
        d.join("linked.safetensors"),
    )
    .unwrap();
    let msg = refused(d, &good, |m| {
        m["shards"][0]["weight"]["file"] = json!("linked.safetensors")
    });
    assert!(
        msg.starts_with("manifest field `shards[0].weight.file` `linked.safetensors` resolves to ")
            && msg.contains("outside the model folder"),
        "{msg}"
    );
    // The good manifest is accepted again.
    fs::write(d.join(MANIFEST_FILE), good.to_string()).unwrap();
    PleLayout::open(d, &storage(d)).unwrap();
}

#[test]
fn every_malformed_interleaved_field_is_named() {
    let dir = model_dir(vec![(TABLE.into(), table_f32())]);
    prepared(dir.path(), PrepareQuant::Affine4);
    let d = dir.path();
    let good: Value =
        serde_json::from_str(&fs::read_to_string(d.join(MANIFEST_FILE)).unwrap()).unwrap();
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|m| m["data_file"] = json!("rows/ple-q4.rows")), "manifest field `data_file` `rows/ple-q4.rows` must be a file name beside the manifest"),
        (Box::new(|m| m["data_file"] = json!("/ple-q4.rows")), "manifest field `data_file` `/ple-q4.rows` must be a file name beside the manifest"),
        (Box::new(|m| { m.as_object_mut().unwrap().remove("data_file"); }), "manifest field `data_file` is missing"),
        (Box::new(|m| m["row_stride"] = json!(48)), "manifest field `row_stride` is 48: rows of 64 values in affine 4-bit g32 take 40 bytes"),
        (Box::new(|m| m["row_count"] = json!(41)), "manifest fields `row_count` × `row_stride` = 41 × 40 bytes, but `data_file` ple-q4.rows is 1600 bytes"),
        (Box::new(|m| { m.as_object_mut().unwrap().remove("row_count"); }), "manifest field `row_count` is missing"),
        (Box::new(|m| m["quantization"] = Value::Null), "manifest field `quantization` is null: the `interleaved_q4` layout stores 4-bit rows"),
        (Box::new(|m| m["sha256"] = json!({"ple-q4.rows": "abc"})), "manifest field `sha256.ple-q4.rows` is \"abc\": expected 64 hex digits"),
    ];
    for (edit, want) in cases {
        assert_eq!(refused(d, &good, edit), want);
    }
    fs::write(d.join(MANIFEST_FILE), good.to_string()).unwrap();
    PleLayout::open(d, &storage(d)).unwrap();
}

/// `to` relative to `from` (both absolute), with `..` steps.
fn pathdiff(to: &Path, from: &Path) -> String {
    let to: Vec<_> = fs::canonicalize(to)
        .unwrap()
        .components()
        .map(|c| c.as_os_str().to_owned())
        .collect();
    let from: Vec<_> = fs::canonicalize(from)
        .unwrap()
        .components()
        .map(|c| c.as_os_str().to_owned())
        .collect();
    let common = to.iter().zip(&from).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..from.len() {
        out.push("..");
    }
    for c in &to[common..] {
        out.push(c);
    }
    out.to_string_lossy().into_owned()
}
