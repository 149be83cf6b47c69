//! `WeightMap` on real safetensors files written here, and every malformed-checkpoint error path.

use std::fs;
use std::path::Path;

use mlxcel_core::weights::{save_safetensors, INDEX_FILE};
use mlxcel_core::{Array, Dtype, Error, Materialization, WeightMap};

fn arr(values: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(values, shape).unwrap()
}

fn write(path: &Path, tensors: &[(&str, Array)]) {
    let owned: Vec<(String, Array)> = tensors
        .iter()
        .map(|(n, a)| (n.to_string(), a.clone()))
        .collect();
    save_safetensors(path, &owned, None).unwrap();
}

/// A safetensors file assembled by hand, for headers no writer would produce.
fn raw_file(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    fs::write(path, bytes).unwrap();
}

#[test]
fn opens_a_folder_and_reads_tensors_on_demand() {
    let dir = tempfile::tempdir().unwrap();
    let bf: Vec<half::bf16> = [1.0f32, -2.0, 3.5]
        .iter()
        .map(|v| half::bf16::from_f32(*v))
        .collect();
    write(
        &dir.path().join("model.safetensors"),
        &[
            ("a.weight", arr(&[1., 2., 3., 4., 5., 6.], &[2, 3])),
            ("b", Array::from_slice(&bf, &[3]).unwrap()),
        ],
    );
    let map = WeightMap::open(dir.path()).unwrap();
    assert_eq!(map.len(), 2);
    assert_eq!(map.names().collect::<Vec<_>>(), vec!["a.weight", "b"]);
    let info = map.info("a.weight").unwrap();
    assert_eq!(
        (info.dtype, info.shape.clone(), info.stored_dtype.as_str()),
        (Dtype::Float32, vec![2, 3], "F32")
    );
    assert_eq!(info.nbytes(), 24);
    assert_eq!(
        map.get("a.weight").unwrap().to_vec::<f32>().unwrap(),
        vec![1., 2., 3., 4., 5., 6.]
    );
    assert_eq!(map.get("b").unwrap().to_vec::<half::bf16>().unwrap(), bf);
    assert_eq!(map.bytes("b").unwrap().len(), 6);
    assert_eq!(map.total_bytes(), 30);
    match map.get("nope") {
        Err(Error::MissingTensor { name, .. }) => assert_eq!(name, "nope"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
}

#[test]
fn sanitiser_edits() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("m.safetensors"),
        &[
            ("x", arr(&[1.], &[1])),
            ("p.y", arr(&[2.], &[1])),
            ("p.z", arr(&[3.], &[1])),
        ],
    );
    let mut map = WeightMap::open(dir.path()).unwrap();
    map.rename("x", "w").unwrap();
    assert!(
        map.rename("w", "p.y").is_err(),
        "rename onto an existing name"
    );
    assert!(map.rename("gone", "q").is_err());
    assert_eq!(map.rename_prefix("p.", "model.").unwrap(), 2);
    assert!(map.contains("model.y") && map.contains("model.z") && map.contains("w"));
    map.insert("new", arr(&[9., 9.], &[2])).unwrap();
    assert_eq!(map.info("new").unwrap().file, None);
    assert_eq!(
        map.get("new").unwrap().to_vec::<f32>().unwrap(),
        vec![9., 9.]
    );
    assert!(map.remove("w"));
    assert!(!map.remove("w"));
    assert_eq!(
        map.take("model.y").unwrap().to_vec::<f32>().unwrap(),
        vec![2.]
    );
    assert_eq!(map.len(), 2);
}

#[test]
fn sharded_checkpoint_with_index() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &[("a", arr(&[1.], &[1]))],
    );
    write(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &[("b", arr(&[2.], &[1]))],
    );
    let index = r#"{"metadata": {"total_size": 8}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#;
    fs::write(dir.path().join(INDEX_FILE), index).unwrap();
    let map = WeightMap::open(dir.path()).unwrap();
    assert_eq!(map.get("b").unwrap().to_vec::<f32>().unwrap(), vec![2.]);
    assert!(map
        .info("a")
        .unwrap()
        .file
        .as_ref()
        .unwrap()
        .ends_with("model-00001-of-00002.safetensors"));

    // A shard the index names is missing.
    fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let err = WeightMap::open(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("model-00002-of-00002.safetensors")
            && err.contains("missing")
            && err.contains("`b`"),
        "{err}"
    );

    // The index names a tensor no shard has.
    write(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &[("c", arr(&[2.], &[1]))],
    );
    let err = WeightMap::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("`c`") && err.contains("not listed"), "{err}");
}

#[test]
fn two_shards_defining_one_tensor() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("one.safetensors"),
        &[("dup", arr(&[1.], &[1]))],
    );
    write(
        &dir.path().join("two.safetensors"),
        &[("dup", arr(&[2.], &[1]))],
    );
    let err = WeightMap::open(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("two.safetensors") && err.contains("one.safetensors") && err.contains("`dup`"),
        "{err}"
    );
}

#[test]
fn truncated_file_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write(&path, &[("w", arr(&[1., 2., 3., 4.], &[4]))]);
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
    let err = WeightMap::open(dir.path()).unwrap_err();
    assert!(matches!(err, Error::Checkpoint { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("model.safetensors") && msg.contains("not a valid safetensors file"),
        "{msg}"
    );
    // Shorter than the length prefix.
    fs::write(&path, [1u8, 2, 3]).unwrap();
    assert!(WeightMap::open(dir.path())
        .unwrap_err()
        .to_string()
        .contains("model.safetensors"));
}

#[test]
fn lying_offsets_and_unknown_dtypes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    // Offsets claim 16 bytes, the shape needs 8.
    raw_file(
        &path,
        r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}}"#,
        &[0u8; 16],
    );
    let msg = WeightMap::open(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
    // Offsets run past the end of the file.
    raw_file(
        &path,
        r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
        &[0u8; 8],
    );
    let msg = WeightMap::open(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("model.safetensors"), "{msg}");
    // An element type safetensors does not know.
    raw_file(
        &path,
        r#"{"odd":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}}"#,
        &[0u8; 8],
    );
    let msg = WeightMap::open(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("`odd`") && msg.contains("Q4"), "{msg}");
}

#[test]
fn missing_folder_and_empty_folder() {
    let dir = tempfile::tempdir().unwrap();
    let msg = WeightMap::open(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("no *.safetensors files"), "{msg}");
    let msg = WeightMap::open(dir.path().join("absent"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("absent"), "{msg}");
}

#[test]
fn fp8_tensors_are_exposed_as_bytes() {
    let dir = tempfile::tempdir().unwrap();
    raw_file(
        &dir.path().join("m.safetensors"),
        r#"{"w":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]}}"#,
        &[0x38, 0x40, 0xb8, 0],
    );
    let map = WeightMap::open(dir.path()).unwrap();
    let info = map.info("w").unwrap();
    assert_eq!(
        (info.dtype, info.stored_dtype.as_str()),
        (Dtype::Uint8, "F8_E4M3")
    );
    assert_eq!(
        map.get("w").unwrap().to_vec::<u8>().unwrap(),
        vec![0x38, 0x40, 0xb8, 0]
    );
}

#[test]
fn materialization_policy_from_env() {
    // Parsed as `RuntimePolicy::from_env` parses the environment, without touching it.
    let from = |value: Option<&str>| {
        mlxcel_core::RuntimePolicy::from_vars(|name| {
            (name == Materialization::ENV)
                .then(|| value.map(str::to_string))
                .flatten()
        })
        .map(|p| p.weight_materialization)
    };
    assert_eq!(from(None).unwrap(), Materialization::Eager);
    assert_eq!(from(Some("lazy")).unwrap(), Materialization::Lazy);
    let msg = from(Some("sometimes")).unwrap_err().to_string();
    assert!(
        msg.contains("MLXCEL_WEIGHT_MATERIALIZATION=sometimes"),
        "{msg}"
    );
    let a = arr(&[1., 2.], &[2]).exp().unwrap();
    Materialization::Eager.apply([&a]).unwrap();
    Materialization::Lazy.apply([&a]).unwrap();
}

#[test]
fn half_tensors_convert_to_f32_on_the_host_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let values = [1.5f32, -2.25, 3.0e-5, 65504.0, -0.0, 1.0e-7];
    let h: Vec<half::f16> = values.iter().map(|v| half::f16::from_f32(*v)).collect();
    let b: Vec<half::bf16> = values.iter().map(|v| half::bf16::from_f32(*v)).collect();
    write(
        &dir.path().join("m.safetensors"),
        &[
            ("h", Array::from_slice(&h, &[2, 3]).unwrap()),
            ("b", Array::from_slice(&b, &[2, 3]).unwrap()),
        ],
    );
    let map = WeightMap::open(dir.path()).unwrap();
    for name in ["h", "b"] {
        let host = map.get_as(name, Dtype::Float32).unwrap();
        let mlx = map.get(name).unwrap().astype(Dtype::Float32).unwrap();
        assert_eq!(host.shape(), vec![2, 3]);
        assert_eq!(
            host.to_vec::<f32>().unwrap(),
            mlx.to_vec::<f32>().unwrap(),
            "{name}"
        );
    }
    // Other targets go through MLX.
    assert_eq!(
        map.get_as("h", Dtype::Float16).unwrap().dtype().unwrap(),
        Dtype::Float16
    );
    assert_eq!(
        map.get_as("b", Dtype::Float16).unwrap().dtype().unwrap(),
        Dtype::Float16
    );
}

#[test]
fn cpu_arrays_borrow_the_mapped_file_and_outlive_the_map() {
    // On the CPU backend a tensor read from a checkpoint is the mapped file itself (no copy),
    // it stays valid after the WeightMap is dropped, and computing with it (including ops that
    // could reuse an input buffer) never writes to the file.
    assert!(mlxcel_core::weights::zero_copy_enabled());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let values: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5).collect();
    write(&path, &[("w", arr(&values, &[64, 64]))]);
    let before = fs::read(&path).unwrap();
    let map = WeightMap::open(dir.path()).unwrap();
    let bytes_at = map.bytes("w").unwrap().as_ptr() as usize;
    let w = map.get("w").unwrap();
    assert_eq!(
        w.data_address().unwrap(),
        bytes_at,
        "the array copied the tensor"
    );
    drop(map);
    let doubled = w.add(&w).unwrap();
    let negated = w.negative().unwrap();
    assert_eq!(
        doubled.to_vec::<f32>().unwrap(),
        values.iter().map(|v| v * 2.0).collect::<Vec<_>>()
    );
    assert_eq!(negated.to_vec::<f32>().unwrap()[3], -1.5);
    assert_eq!(w.to_vec::<f32>().unwrap(), values);
    drop(w);
    assert_eq!(
        fs::read(&path).unwrap(),
        before,
        "the checkpoint file changed"
    );
}

#[test]
fn mapped_files_that_change_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    write(&path, &[("a", arr(&[1., 2., 3., 4.], &[4]))]);
    let map = WeightMap::open(dir.path()).unwrap();
    let files = map.mapped_files();
    assert_eq!(files.paths().collect::<Vec<_>>(), vec![path.as_path()]);
    map.check_unchanged().unwrap();
    let original = fs::read(&path).unwrap();

    // Rewritten in place with the same size (a later mtime).
    let mut changed = original.clone();
    let last = changed.len() - 1;
    changed[last] ^= 0x01;
    fs::write(&path, &changed).unwrap();
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
    fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let err = files.check_unchanged().unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("modified"),
        "{err}"
    );

    // Truncated.
    fs::write(&path, &original[..original.len() / 2]).unwrap();
    let err = map.check_unchanged().unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("size"),
        "{err}"
    );

    // Replaced by another file (same bytes, other inode).
    let fresh = WeightMap::open(dir.path());
    assert!(fresh.is_err(), "the truncated file is refused at open");
    fs::write(&path, &original).unwrap();
    let reopened = WeightMap::open(dir.path()).unwrap();
    reopened.check_unchanged().unwrap();
    let other = dir.path().join("other");
    fs::write(&other, &original).unwrap();
    let stamp = fs::metadata(&path).unwrap().modified().unwrap();
    fs::File::options()
        .write(true)
        .open(&other)
        .unwrap()
        .set_modified(stamp)
        .unwrap();
    fs::rename(&other, &path).unwrap();
    let err = reopened.check_unchanged().unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("replaced"),
        "{err}"
    );
}

#[test]
fn slices_read_only_their_part_of_a_file_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let values: Vec<f32> = (0..24).map(|v| v as f32).collect();
    write(
        &dir.path().join("model.safetensors"),
        &[("t", arr(&values, &[2, 3, 4]))],
    );
    let mut map = WeightMap::open(dir.path()).unwrap();
    let full = map.get("t").unwrap();
    for (axis, start, end) in [(0, 1, 2), (1, 1, 3), (2, 0, 2), (2, 3, 4)] {
        let got = map.get_slice("t", axis, start, end).unwrap();
        let want = full.slice_axis(axis as i32, start, end).unwrap();
        assert_eq!(got.shape(), want.shape(), "axis {axis}");
        assert_eq!(
            got.to_vec::<f32>().unwrap(),
            want.to_vec::<f32>().unwrap(),
            "axis {axis} {start}..{end}"
        );
    }
    // A slice of the first axis borrows the mapped bytes when zero-copy is on: its data lies
    // inside the file tensor's own data, 12 floats in.
    if mlxcel_core::weights::zero_copy_enabled() {
        let whole = full.data_address().unwrap();
        let rows = map.get_slice("t", 0, 1, 2).unwrap();
        assert_eq!(rows.data_address().unwrap(), whole + 12 * 4);
    }
    assert!(map.get_slice("t", 3, 0, 1).is_err());
    assert!(map.get_slice("t", 0, 1, 3).is_err());
    // Inserted arrays slice through MLX.
    map.insert("u", arr(&values, &[6, 4])).unwrap();
    let part = map.get_slice("u", 1, 2, 4).unwrap();
    assert_eq!(part.shape(), vec![6, 2]);
    assert_eq!(part.to_vec::<f32>().unwrap()[..2], [2.0, 3.0]);
}

#[test]
fn random_data_replaces_file_bytes_for_benchmarks() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("model.safetensors"),
        &[
            ("w", arr(&[0.0; 64], &[8, 8])),
            ("input_layernorm.weight", arr(&[0.0; 8], &[8])),
        ],
    );
    let map = WeightMap::open(dir.path()).unwrap().with_random_data(3);
    let w = map.get("w").unwrap().to_vec::<f32>().unwrap();
    assert!(w.iter().all(|v| v.abs() < 0.035) && w.iter().any(|v| *v != 0.0));
    let norm = map
        .get("input_layernorm.weight")
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(norm, vec![1.0; 8]);
    assert_eq!(map.get_slice("w", 1, 0, 3).unwrap().shape(), vec![8, 3]);
    assert!(map.bytes("w").is_none());
}

#[test]
fn a_stack_reads_only_the_parts_a_slice_covers() {
    let dir = tempfile::tempdir().unwrap();
    let a: Vec<f32> = (0..6).map(|v| v as f32).collect();
    let b: Vec<f32> = (10..16).map(|v| v as f32).collect();
    write(
        &dir.path().join("model.safetensors"),
        &[
            ("e.0", arr(&a, &[2, 3])),
            ("e.1", arr(&b, &[2, 3])),
            ("odd", arr(&[0.0; 4], &[4])),
        ],
    );
    let mut map = WeightMap::open(dir.path()).unwrap();
    map.stack("s", &["e.0".to_string(), "e.1".to_string()])
        .unwrap();
    assert!(!map.contains("e.0") && map.info("s").unwrap().shape == vec![2, 2, 3]);
    let all = map.get("s").unwrap().to_vec::<f32>().unwrap();
    assert_eq!(all, [a.clone(), b.clone()].concat());
    assert_eq!(
        map.get_slice("s", 0, 1, 2)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        b
    );
    let cols = map.get_slice("s", 2, 1, 3).unwrap();
    assert_eq!(cols.shape(), vec![2, 2, 2]);
    assert_eq!(
        cols.to_vec::<f32>().unwrap(),
        [1.0, 2.0, 4.0, 5.0, 11.0, 12.0, 14.0, 15.0]
    );
    assert!(map
        .stack("t", &["s".to_string(), "odd".to_string()])
        .is_err());
    assert!(map.stack("t", &["missing".to_string()]).is_err());
}

/// `Array::from_file_on_device` (the GPU loader, `MLXCEL_CUDA_LOAD`): a byte count that does not
/// fill the shape is refused before anything is read or allocated, and where MLX has no CUDA
/// backend (this CPU build) the answer is "not here" (the caller then copies through MLX), not an
/// error. On a GPU the loader's bit-equality is `cuda_decode`'s
/// `tensors_read_into_device_memory_make_the_same_model`.
#[test]
fn device_reads_check_the_byte_count_and_defer_without_cuda() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bytes.bin");
    fs::write(&path, [0u8; 64]).unwrap();
    let file = fs::File::open(&path).unwrap();
    let err = Array::from_file_on_device(&file, 0, 12, &[4], Dtype::Float32).unwrap_err();
    assert!(
        err.to_string().contains("12 bytes do not fill"),
        "unexpected error: {err}"
    );
    if mlxcel_core::default_device().unwrap() == mlxcel_core::Device::Cpu {
        let read = Array::from_file_on_device(&file, 16, 16, &[4], Dtype::Float32).unwrap();
        assert!(read.is_none(), "no CUDA backend, yet an array came back");
    }
}
