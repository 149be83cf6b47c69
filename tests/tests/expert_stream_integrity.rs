//! Routed-expert streaming verifies what it streams: a damaged stream file stops generation
//! with an error naming the layer, expert and file; an edited manifest is refused by `--verify`
//! (naming the field) and by the load; a layout left over after the checkpoint's expert weights
//! changed is refused as stale.

use std::fs;
use std::path::{Path, PathBuf};

use mlxcel_arch::generate::greedy;
use mlxcel_loading::stream::{prepare_expert_stream, verify_expert_stream};
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_stream::{manifest, Manifest, StreamConfig, StreamMode};
use mlxcel_tests::{copy_fixture, reference};

const FIXTURE: &str = "qwen3_moe";

fn prepared() -> (tempfile::TempDir, Manifest) {
    let dir = copy_fixture(FIXTURE);
    let manifest = prepare_expert_stream(dir.path(), |_, _| {}).unwrap();
    (dir, manifest)
}

/// Loads with streaming on and top-k slots per layer (so experts are read again and again).
fn load(dir: &Path, manifest: &Manifest) -> Result<Loaded, String> {
    let per_slot: u64 = manifest.layers.iter().map(|l| l.expert_stride).sum();
    let stream = StreamConfig {
        mode: StreamMode::On,
        arena_bytes: Some(per_slot * 2),
        ..Default::default()
    };
    load_model(
        dir,
        &LoadOptions {
            skip_tokenizer: true,
            stream: Some(stream),
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())
}

/// The reference prompt's greedy continuation through the streamed model.
fn generate(dir: &Path, manifest: &Manifest) -> Result<Vec<u32>, String> {
    let loaded = load(dir, manifest)?;
    assert!(loaded.expert_stream.is_some(), "streaming");
    let r = reference(FIXTURE);
    greedy(
        &loaded.model,
        &r.prompt_ids,
        r.greedy_ids.len(),
        None,
        |_| false,
    )
    .map_err(|e| e.to_string())
}

fn blob_path(dir: &Path, manifest: &Manifest, layer: usize) -> PathBuf {
    dir.join(manifest::STREAM_DIR)
        .join(&manifest.layers[layer].file)
}

#[test]
fn damaged_stream_files_stop_generation_naming_layer_expert_and_file() {
    let (dir, manifest) = prepared();
    let want = reference(FIXTURE).greedy_ids;
    assert_eq!(generate(dir.path(), &manifest).unwrap(), want);
    let layer = &manifest.layers[0];
    let path = blob_path(dir.path(), &manifest, 0);
    let original = fs::read(&path).unwrap();
    let stride = layer.expert_stride as usize;

    // (a) One flipped byte inside one expert's planes, for each expert in turn: every expert the
    // prompt routes to is refused by name; one it never reads cannot change the output.
    let mut read = Vec::new();
    for e in 0..layer.experts {
        let mut bytes = original.clone();
        bytes[e * stride + layer.planes[1].offset as usize + 5] ^= 0x10;
        fs::write(&path, &bytes).unwrap();
        match generate(dir.path(), &manifest) {
            Ok(ids) => assert_eq!(ids, want, "expert {e} was never read"),
            Err(err) => {
                assert!(
                    err.contains(&format!("expert {e} of layer `{}`", layer.prefix))
                        && err.contains(&layer.file)
                        && err.contains("xxh3"),
                    "{err}"
                );
                read.push(e);
            }
        }
        let err = verify_expert_stream(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("expert {e}")) && err.contains(&layer.file),
            "{err}"
        );
    }
    assert!(
        read.len() >= 2,
        "the prompt reads several experts: {read:?}"
    );

    // (b) Two experts the prompt reads, swapped.
    let (a, b) = (read[0], read[1]);
    let mut bytes = original.clone();
    bytes[a * stride..(a + 1) * stride].copy_from_slice(&original[b * stride..(b + 1) * stride]);
    bytes[b * stride..(b + 1) * stride].copy_from_slice(&original[a * stride..(a + 1) * stride]);
    fs::write(&path, &bytes).unwrap();
    let err = generate(dir.path(), &manifest).unwrap_err();
    assert!(
        (err.contains(&format!("expert {a} ")) || err.contains(&format!("expert {b} ")))
            && err.contains(&layer.prefix)
            && err.contains(&layer.file),
        "{err}"
    );
    assert!(verify_expert_stream(dir.path()).is_err());
    fs::write(&path, &original).unwrap();
    assert_eq!(generate(dir.path(), &manifest).unwrap(), want);

    // (c) A zeroed file (the last layer's).
    let last = manifest.layers.len() - 1;
    let path = blob_path(dir.path(), &manifest, last);
    let len = fs::metadata(&path).unwrap().len() as usize;
    fs::write(&path, vec![0u8; len]).unwrap();
    let err = generate(dir.path(), &manifest).unwrap_err();
    let l = &manifest.layers[last];
    assert!(
        err.contains(&format!("of layer `{}`", l.prefix))
            && err.contains("expert ")
            && err.contains(&l.file),
        "{err}"
    );
    let err = verify_expert_stream(dir.path()).unwrap_err().to_string();
    assert!(err.contains(&l.file), "{err}");
}

/// Rewrites the manifest with `edit` applied to its JSON.
fn edit_manifest(dir: &Path, original: &str, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut value: serde_json::Value = serde_json::from_str(original).unwrap();
    edit(&mut value);
    fs::write(
        dir.join(manifest::STREAM_DIR).join(manifest::MANIFEST),
        serde_json::to_string_pretty(&value).unwrap(),
    )
    .unwrap();
}

#[test]
fn edited_manifests_are_refused_naming_the_field() {
    let (dir, manifest) = prepared();
    let path = dir
        .path()
        .join(manifest::STREAM_DIR)
        .join(manifest::MANIFEST);
    let original = fs::read_to_string(&path).unwrap();
    let refused = |field: &str| {
        let err = verify_expert_stream(dir.path()).unwrap_err().to_string();
        assert!(err.contains(field), "verify: {err}");
        let err = match load(dir.path(), &manifest) {
            Ok(_) => panic!("loaded with a manifest whose {field} was edited"),
            Err(e) => e,
        };
        assert!(err.contains(field), "load: {err}");
    };

    // (d) A plane offset moved.
    let offset = manifest.layers[0].planes[1].offset;
    edit_manifest(dir.path(), &original, |m| {
        m["layers"][0]["planes"][1]["offset"] = (offset + 64).into();
    });
    refused("planes[1].offset");
    // The last plane moved into the blob's padding (still fits, no overlap).
    let layer = &manifest.layers[0];
    let last = layer.planes.len() - 1;
    let p = &layer.planes[last];
    if p.offset + p.nbytes + 64 <= layer.expert_stride {
        edit_manifest(dir.path(), &original, |m| {
            m["layers"][0]["planes"][last]["offset"] = (p.offset + 64).into();
        });
        refused(&format!("planes[{last}].offset"));
    }
    // A dtype of the same width (so sizes still agree).
    let dtype = manifest.layers[0].planes[0].dtype.clone();
    let other = match dtype.as_str() {
        "float32" => "int32",
        "uint32" => "int32",
        "bfloat16" | "float16" => "int16",
        d => panic!("fixture dtype {d}"),
    };
    edit_manifest(dir.path(), &original, |m| {
        m["layers"][0]["planes"][0]["dtype"] = other.into();
    });
    refused("planes[0].dtype");
    // A plane's source tensor renamed, and the layer prefix.
    edit_manifest(dir.path(), &original, |m| {
        m["layers"][0]["planes"][0]["source"]["tensor"] = "model.layers.0.mlp.other".into();
    });
    refused("planes[0].source.tensor");
    // An expert hash: verify names it (the load trusts hashes; reads check them).
    edit_manifest(dir.path(), &original, |m| {
        m["layers"][0]["expert_xxh3"][0] = "0123456789abcdef".into();
    });
    let err = verify_expert_stream(dir.path()).unwrap_err().to_string();
    assert!(err.contains("expert_xxh3[0]"), "{err}");
    // An older manifest version says to prepare again.
    edit_manifest(dir.path(), &original, |m| m["version"] = 1.into());
    let err = load(dir.path(), &manifest).err().unwrap_or_default();
    assert!(
        err.contains("version 1") && err.contains("prepare-expert-stream"),
        "{err}"
    );
    // A blob behind a symlink out of the stream folder.
    let outside = tempfile::tempdir().unwrap();
    let blob = blob_path(dir.path(), &manifest, 0);
    let moved = outside.path().join("layer.bin");
    fs::write(&path, &original).unwrap();
    fs::copy(&blob, &moved).unwrap();
    fs::remove_file(&blob).unwrap();
    std::os::unix::fs::symlink(&moved, &blob).unwrap();
    let err = verify_expert_stream(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("layers[0].file") && err.contains("outside"),
        "{err}"
    );
    fs::remove_file(&blob).unwrap();
    fs::copy(&moved, &blob).unwrap();
    assert_eq!(verify_expert_stream(dir.path()).unwrap(), manifest);
}

#[test]
fn a_layout_older_than_the_checkpoint_experts_is_stale() {
    let (dir, manifest) = prepared();
    let model = dir.path().join("model.safetensors");
    let bytes = fs::read(&model).unwrap();
    // Only the mtime changes (a copied folder): the tensors' bytes decide, and they agree.
    std::thread::sleep(std::time::Duration::from_millis(50));
    fs::write(&model, &bytes).unwrap();
    assert_eq!(
        generate(dir.path(), &manifest).unwrap(),
        reference(FIXTURE).greedy_ids
    );
    // (e) One expert weight changed in place: same size, same header.
    let (name, at) = {
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (name, view) = st
            .tensors()
            .into_iter()
            .find(|(n, _)| n.contains("layers.1.mlp.experts.3.up_proj.weight"))
            .unwrap();
        (
            name,
            view.data().as_ptr() as usize - bytes.as_ptr() as usize,
        )
    };
    let mut changed = bytes.clone();
    changed[at + 2] ^= 0x40;
    std::thread::sleep(std::time::Duration::from_millis(50));
    fs::write(&model, &changed).unwrap();
    let err = match load(dir.path(), &manifest) {
        Ok(_) => panic!("loaded a stale layout ({name} changed)"),
        Err(e) => e,
    };
    assert!(
        err.contains("stale")
            && err.contains("model.layers.1.mlp.switch_mlp.up_proj.weight")
            && err.contains("prepare-expert-stream"),
        "{err}"
    );
    let err = verify_expert_stream(dir.path()).unwrap_err().to_string();
    assert!(err.contains("stale") && err.contains("up_proj"), "{err}");
    // Preparing again makes it current.
    let again = prepare_expert_stream(dir.path(), |_, _| {}).unwrap();
    assert_ne!(again, manifest);
    verify_expert_stream(dir.path()).unwrap();
    generate(dir.path(), &again).unwrap();
}

/// What checking each read costs: a streamed greedy decode with top-k slots (a miss on most
/// expert uses) with and without `MLXCEL_EXPERT_VERIFY`, and xxh3 against `pread` throughput.
/// `cargo test -p mlxcel-tests --test expert_stream_integrity -- --ignored --nocapture`
#[test]
#[ignore]
fn verification_cost() {
    use std::os::unix::fs::FileExt;
    use std::time::Instant;
    let (dir, manifest) = prepared();
    let r = reference(FIXTURE);
    let prompt = &r.prompt_ids;
    let tokens = 256;
    let mut best = [f64::MAX; 2];
    for round in 0..6 {
        for (i, verify) in ["0", "1"].iter().enumerate() {
            std::env::set_var("MLXCEL_EXPERT_VERIFY", verify);
            let loaded = load(dir.path(), &manifest).unwrap();
            let started = Instant::now();
            greedy(&loaded.model, prompt, tokens, None, |_| false).unwrap();
            let s = started.elapsed().as_secs_f64();
            best[i] = best[i].min(s);
            if round == 0 {
                let (_, stats) = loaded.expert_stream.as_ref().unwrap();
                eprintln!("verify={verify}: {:?}", stats.borrow());
            }
        }
    }
    std::env::remove_var("MLXCEL_EXPERT_VERIFY");
    eprintln!(
        "streamed decode of {tokens} tokens (best of 6): unchecked {:.1} ms, checked {:.1} ms ({:+.1}%)",
        best[0] * 1e3,
        best[1] * 1e3,
        (best[1] / best[0] - 1.0) * 100.0
    );
    // Throughput on one layer file: pread of each expert vs xxh3 of it.
    let layer = &manifest.layers[0];
    let file = fs::File::open(blob_path(dir.path(), &manifest, 0)).unwrap();
    let mut buf = vec![0u8; layer.read_len() as usize];
    let reps = 20_000;
    let started = Instant::now();
    for i in 0..reps {
        let e = (i % layer.experts) as u64;
        file.read_exact_at(&mut buf, e * layer.expert_stride)
            .unwrap();
    }
    let read = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut acc = 0u64;
    for _ in 0..reps {
        acc ^= xxhash_rust::xxh3::xxh3_64(std::hint::black_box(&buf));
    }
    let hash = started.elapsed().as_secs_f64();
    let gb = (reps * buf.len()) as f64 / 1e9;
    eprintln!(
        "{} KiB expert reads: pread (page cache) {:.1} GB/s, xxh3 {:.1} GB/s [{acc:x}]",
        buf.len() / 1024,
        gb / read,
        gb / hash
    );
}
