//! Gemma 3n with its per-layer-embedding table on disk (`prepare-external-ple`,
//! `mlxcel_stream::ple`): unquantized, every I/O mode and cache size from one row to all rows
//! gives the resident model's logits bit for bit (and so the transformers reference) and its
//! greedy ids with chunked prefill 1/3/16; the affine-4 view gives the logits of the same
//! quantization held resident; the loader refuses a table of the wrong shape, and
//! `--estimate-memory` counts the row cache.

use std::path::Path;

use mlxcel_core::ops::{self, QuantSpec};
use mlxcel_core::policy::PleIo;
use mlxcel_core::{Array, Dtype, RuntimePolicy, WeightMap};
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_stream::ple::PrepareQuant;
use mlxcel_tests::{copy_fixture, edit_config, logits_for, max_abs_diff, model_dir, reference};

/// Values per row of the fixtures' table: 4 layers × 16.
const WIDTH: u64 = 64;
const ROWS: u64 = 128;

fn load(dir: &Path, io: PleIo, cache_bytes: u64) -> Loaded {
    let policy = RuntimePolicy {
        ple_io: io,
        ple_cache_bytes: cache_bytes,
        ..RuntimePolicy::default()
    };
    load_model(
        dir,
        &LoadOptions {
            skip_tokenizer: true,
            policy: Some(policy),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn tolerance(logits: &[f32]) -> f32 {
    let max = logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    2e-4f32.max(2e-5 * max)
}

#[test]
fn unquantized_external_table_gives_the_resident_logits_in_every_mode_and_cache_size() {
    for name in ["gemma3n_text", "gemma3n"] {
        let r = reference(name);
        let resident = load(&model_dir(name), PleIo::Mmap, 0);
        assert!(resident.external_ple.is_none());
        let want = logits_for(&resident.model, &r.prompt_ids);
        let (diff, _) = max_abs_diff(&want, &r.logits);
        assert!(diff <= tolerance(&r.logits), "{name}: resident {diff:.2e}");

        let dir = copy_fixture(name);
        let layout = mlxcel_loading::ple::prepare_external_ple(
            dir.path(),
            PrepareQuant::AsStored,
            |_, _| {},
        )
        .unwrap();
        assert_eq!((layout.row_count, layout.row_width as u64), (ROWS, WIDTH));
        let record = layout.record_bytes as u64;
        assert_eq!(record, WIDTH * 4);
        for io in [PleIo::Mmap, PleIo::Direct, PleIo::Ram] {
            for cache_rows in [0, 1, 3, ROWS] {
                let loaded = load(dir.path(), io, cache_rows * record);
                let plan = loaded.external_ple.as_ref().expect("the table is external");
                let got = logits_for(&loaded.model, &r.prompt_ids);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{name}: {io:?}, cache of {cache_rows} rows: logits differ from the resident model's"
                );
                for chunk in [1, 3, 16] {
                    let ids = mlxcel_arch::generate::greedy(
                        &loaded.model,
                        &r.prompt_ids,
                        r.greedy_ids.len(),
                        Some(chunk),
                        |_| false,
                    )
                    .unwrap();
                    assert_eq!(
                        ids, r.greedy_ids,
                        "{name}: {io:?}, cache {cache_rows}, chunk {chunk}"
                    );
                }
                let stats = plan.stats.borrow().clone();
                if io == PleIo::Ram {
                    assert_eq!(stats.misses, 0);
                    assert_eq!(stats.bytes_read, ROWS * record);
                } else {
                    assert!(stats.misses > 0, "{io:?}: {stats:?}");
                    assert_eq!(stats.bytes_read, stats.misses * record, "{io:?}: {stats:?}");
                    if cache_rows < ROWS {
                        // Chunked prefill read the next chunk's rows ahead (with room for the
                        // whole table, the first pass left every prompt row cached).
                        assert!(stats.gathered_ahead > 0, "{io:?} {cache_rows}: {stats:?}");
                    } else {
                        // Every id repeated across the passes came from the cache.
                        assert!(stats.hits > stats.misses, "{stats:?}");
                    }
                }
            }
        }
    }
}

/// The fixture's table quantized as `prepare --quantize affine4` does (MLX affine 4/32, scales
/// and biases rounded to bf16), dequantized back to a dense f32 table.
fn dequantized_table(weights: &WeightMap, name: &str) -> Array {
    let table = weights.get(name).unwrap();
    let q = table.quantize(QuantSpec::affine(32, 4)).unwrap();
    let round = |a: &Array| {
        a.astype(Dtype::Bfloat16)
            .unwrap()
            .astype(Dtype::Float32)
            .unwrap()
    };
    ops::dequantize(
        &q.weight,
        &round(&q.scales),
        Some(&round(&q.biases.unwrap())),
        QuantSpec::affine(32, 4),
        Some(Dtype::Float32),
    )
    .unwrap()
}

#[test]
fn affine4_external_table_gives_the_logits_of_the_same_quantization_resident() {
    let name = "gemma3n_text";
    let table = "model.embed_tokens_per_layer.weight";
    let r = reference(name);
    // Resident: the checkpoint with its table replaced by the quantized-then-dequantized one.
    let resident_dir = copy_fixture(name);
    let weights = WeightMap::open(resident_dir.path()).unwrap();
    let mut tensors: Vec<(String, Array)> = weights
        .names()
        .map(|n| (n.to_string(), weights.get(n).unwrap()))
        .collect();
    let deq = dequantized_table(&weights, table);
    for (n, a) in tensors.iter_mut() {
        if n == table {
            *a = deq.clone();
        }
    }
    drop(weights);
    mlxcel_core::weights::save_safetensors(
        resident_dir.path().join("model.safetensors"),
        &tensors,
        None,
    )
    .unwrap();
    let resident = load(resident_dir.path(), PleIo::Mmap, 0);
    let want = logits_for(&resident.model, &r.prompt_ids);
    // The quantization moved the logits: the comparison below tells the two tables apart.
    let (moved, _) = max_abs_diff(&want, &r.logits);
    assert!(moved > 1e-3, "{moved:.2e}");

    let dir = copy_fixture(name);
    let layout =
        mlxcel_loading::ple::prepare_external_ple(dir.path(), PrepareQuant::Affine4, |_, _| {})
            .unwrap();
    assert_eq!(layout.format, mlxcel_stream::ple::RowFormat::Affine4);
    assert!(dir.path().join("ple-q4.rows").is_file());
    mlxcel_loading::ple::verify_external_ple(dir.path()).unwrap();
    for io in [PleIo::Mmap, PleIo::Direct, PleIo::Ram] {
        for cache_rows in [1, ROWS] {
            let loaded = load(dir.path(), io, cache_rows * layout.record_bytes as u64);
            let got = logits_for(&loaded.model, &r.prompt_ids);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{io:?}, cache {cache_rows}"
            );
            let resident_ids =
                mlxcel_arch::generate::greedy(&resident.model, &r.prompt_ids, 8, None, |_| false)
                    .unwrap();
            for chunk in [1, 3, 16] {
                let ids = mlxcel_arch::generate::greedy(
                    &loaded.model,
                    &r.prompt_ids,
                    8,
                    Some(chunk),
                    |_| false,
                )
                .unwrap();
                assert_eq!(
                    ids, resident_ids,
                    "{io:?}, cache {cache_rows}, chunk {chunk}"
                );
            }
        }
    }
}

#[test]
fn the_loader_refuses_a_table_that_does_not_fit_the_model() {
    let dir = copy_fixture("gemma3n_text");
    mlxcel_loading::ple::prepare_external_ple(dir.path(), PrepareQuant::AsStored, |_, _| {})
        .unwrap();
    // A model with fewer per-layer rows than the table on disk.
    edit_config(dir.path(), |c| c["vocab_size_per_layer_input"] = 64.into());
    let err = load_model(
        dir.path(),
        &LoadOptions {
            skip_tokenizer: true,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.ends_with("manifest fields `row_count` × `row_width` are 128 × 64, the model's per-layer table is vocab_size_per_layer_input × num_hidden_layers·hidden_size_per_layer_input = 64 × 64"),
        "{err}"
    );
    // `ple_storage` on a model without per-layer embeddings: a valid table nobody takes.
    let llama = copy_fixture("llama");
    std::fs::copy(
        dir.path().join("model.safetensors"),
        llama.path().join("ple-src.safetensors"),
    )
    .unwrap();
    let manifest = std::fs::read_to_string(dir.path().join("ple-store.json"))
        .unwrap()
        .replace("\"model.safetensors\"", "\"ple-src.safetensors\"");
    std::fs::write(llama.path().join("ple-store.json"), manifest).unwrap();
    edit_config(llama.path(), |c| {
        c["ple_storage"] = serde_json::json!({"manifest": "ple-store.json"})
    });
    let err = load_model(
        llama.path(),
        &LoadOptions {
            skip_tokenizer: true,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.ends_with("`ple_storage` in config.json puts a per-layer-embedding table on disk, but Llama has no per-layer embeddings"),
        "{err}"
    );
}

#[test]
fn memory_estimate_counts_the_row_cache_not_the_table() {
    let dir = copy_fixture("gemma3n_text");
    let config = mlxcel_loading::read_config(dir.path()).unwrap();
    let resident =
        mlxcel_loading::memory::estimate(dir.path(), &config, Dtype::Float32, 64, 16).unwrap();
    let table = resident
        .weights
        .iter()
        .filter(|((role, _), _)| role == "per-layer embed")
        .map(|(_, b)| *b)
        .sum::<u64>();
    assert_eq!(table, ROWS * WIDTH * 4);
    assert_eq!(resident.ple_rows, 0);
    mlxcel_loading::ple::prepare_external_ple(dir.path(), PrepareQuant::AsStored, |_, _| {})
        .unwrap();
    let config = mlxcel_loading::read_config(dir.path()).unwrap();
    let policy = RuntimePolicy::default();
    let (held, on_disk) = mlxcel_loading::ple::footprint(dir.path(), &config, &policy)
        .unwrap()
        .unwrap();
    // The default 0.5 GiB cache holds the whole (tiny) table.
    assert_eq!((held, on_disk), (ROWS * WIDTH * 4, ROWS * WIDTH * 4));
    let small = RuntimePolicy {
        ple_cache_bytes: 10 * WIDTH * 4 + 7,
        ..RuntimePolicy::default()
    };
    assert_eq!(
        mlxcel_loading::ple::footprint(dir.path(), &config, &small)
            .unwrap()
            .unwrap()
            .0,
        10 * WIDTH * 4
    );
    let ram = RuntimePolicy {
        ple_io: PleIo::Ram,
        ple_cache_bytes: 0,
        ..RuntimePolicy::default()
    };
    assert_eq!(
        mlxcel_loading::ple::footprint(dir.path(), &config, &ram)
            .unwrap()
            .unwrap()
            .0,
        ROWS * WIDTH * 4
    );
    let external =
        mlxcel_loading::memory::estimate(dir.path(), &config, Dtype::Float32, 64, 16).unwrap();
    assert!(external
        .weights
        .keys()
        .all(|(role, _)| role != "per-layer embed"));
    assert_eq!(external.ple_rows, held);
    assert_eq!(external.weight_bytes() + table, resident.weight_bytes());
}

#[test]
fn mlx_lms_quantized_table_on_disk_gives_its_resident_logits_bitwise() {
    // mlx-lm's affine-4 conversion of the full checkpoint keeps f32 scales and biases: read in
    // place (mlxcel's extension of mlx-vlm's BF16 layout), the rows dequantize exactly as the
    // resident quantized table does.
    let name = "gemma3n-affine4-g32";
    let r = reference(name);
    let resident = load(&model_dir(name), PleIo::Mmap, 0);
    let want = logits_for(&resident.model, &r.prompt_ids);
    let dir = copy_fixture(name);
    let layout =
        mlxcel_loading::ple::prepare_external_ple(dir.path(), PrepareQuant::AsStored, |_, _| {})
            .unwrap();
    assert_eq!(
        layout.format,
        mlxcel_stream::ple::RowFormat::Affine4Float(Dtype::Float32)
    );
    mlxcel_loading::ple::verify_external_ple(dir.path()).unwrap();
    let resident_ids =
        mlxcel_arch::generate::greedy(&resident.model, &r.prompt_ids, 8, None, |_| false).unwrap();
    for io in [PleIo::Mmap, PleIo::Direct, PleIo::Ram] {
        for cache_rows in [1, ROWS] {
            let loaded = load(dir.path(), io, cache_rows * layout.record_bytes as u64);
            assert!(loaded.external_ple.is_some());
            let got = logits_for(&loaded.model, &r.prompt_ids);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{io:?}, cache {cache_rows}"
            );
            for chunk in [1, 3, 16] {
                let ids = mlxcel_arch::generate::greedy(
                    &loaded.model,
                    &r.prompt_ids,
                    8,
                    Some(chunk),
                    |_| false,
                )
                .unwrap();
                assert_eq!(
                    ids, resident_ids,
                    "{io:?}, cache {cache_rows}, chunk {chunk}"
                );
            }
        }
    }
}
