//! Routed-expert streaming: for every MoE fixture, streamed and resident runs give identical
//! logits and greedy ids (with and without chunked prefill) for every arena size from top-k
//! slots per layer up to all experts, and identical logits with each way of reading
//! (`MLXCEL_EXPERT_IO`: direct, dontneed, cached, and direct falling back on a file system that
//! refuses `O_DIRECT`); tampered stream layouts are refused with the reason, and a stream file
//! truncated after load stops generation with an error naming it.

use std::fs;
use std::path::Path;

use mlxcel_arch::generate::greedy;
use mlxcel_loading::stream::{prepare_expert_stream, verify_expert_stream};
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_stream::{manifest, CachePolicy, ExpertIo, StreamConfig, StreamMode};
use mlxcel_tests::{copy_fixture, logits_for, reference};

fn load(dir: &Path, stream: StreamConfig) -> Loaded {
    load_model(
        dir,
        &LoadOptions {
            skip_tokenizer: true,
            stream: Some(stream),
            ..Default::default()
        },
    )
    .unwrap()
}

fn check(name: &str) {
    let dir = copy_fixture(name);
    let manifest = prepare_expert_stream(dir.path(), |_, _| {}).unwrap();
    assert_eq!(verify_expert_stream(dir.path()).unwrap(), manifest);
    let r = reference(name);
    let off = StreamConfig {
        mode: StreamMode::Off,
        ..Default::default()
    };
    let resident = load(dir.path(), off);
    assert!(resident.expert_stream.is_none());
    let want_logits = logits_for(&resident.model, &r.prompt_ids);
    let want_ids = greedy(
        &resident.model,
        &r.prompt_ids,
        r.greedy_ids.len(),
        None,
        |_| false,
    )
    .unwrap();
    assert_eq!(want_ids, r.greedy_ids, "{name}: resident greedy");
    let top_k = resident.config["num_experts_per_tok"].as_u64().unwrap() as usize;
    let experts = manifest.layers[0].experts;
    let per_slot: u64 = manifest.layers.iter().map(|l| l.expert_stride).sum();
    for slots in top_k..=experts {
        for policy in [CachePolicy::Lfu, CachePolicy::Lru] {
            let on = StreamConfig {
                mode: StreamMode::On,
                arena_bytes: Some(per_slot * slots as u64),
                policy,
                ..Default::default()
            };
            let streamed = load(dir.path(), on);
            let (plan, stats) = streamed.expert_stream.as_ref().expect("streaming");
            assert_eq!(plan.slots_per_layer, slots);
            let got = logits_for(&streamed.model, &r.prompt_ids);
            assert_eq!(got, want_logits, "{name}: {slots} slots {policy:?}: logits");
            for chunk in [None, Some(3), Some(16)] {
                let ids = greedy(
                    &streamed.model,
                    &r.prompt_ids,
                    r.greedy_ids.len(),
                    chunk,
                    |_| false,
                )
                .unwrap();
                assert_eq!(
                    ids, want_ids,
                    "{name}: {slots} slots {policy:?} chunk {chunk:?}: greedy"
                );
            }
            let s = stats.borrow();
            assert!(
                s.misses > 0 && s.bytes_read > 0,
                "{name}: experts were read: {s:?}"
            );
            if slots == experts {
                // With every expert resident, each is read at most once per layer.
                assert!(
                    s.misses as usize <= experts * manifest.layers.len(),
                    "{name}: {} misses with a full arena",
                    s.misses
                );
            }
        }
    }
    eprintln!("{name}: streamed = resident for {top_k}..={experts} slots");
}

#[test]
fn streamed_equals_resident_for_every_moe_fixture() {
    for name in MOE_FIXTURES {
        check(name);
    }
}

/// The MoE fixtures, dense and quantized.
const MOE_FIXTURES: [&str; 6] = [
    "qwen3_moe",
    "qwen3_moe-affine4-g64",
    "mixtral",
    "mixtral-affine4-g32",
    "qwen2_moe",
    "olmoe",
];

/// Streaming with top-k slots per layer (the most reads) in `io` mode on the prepared copy in
/// `dir`: its logits of the reference prompt, and the stats.
fn streamed_logits(
    dir: &Path,
    prompt: &[u32],
    io: ExpertIo,
) -> (Vec<f32>, mlxcel_stream::StreamStats) {
    let (_, m) = manifest::open(dir).unwrap().expect("prepared");
    let per_slot: u64 = m.layers.iter().map(|l| l.expert_stride).sum();
    let config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let top_k = config["num_experts_per_tok"].as_u64().unwrap();
    let streamed = load(
        dir,
        StreamConfig {
            mode: StreamMode::On,
            arena_bytes: Some(per_slot * top_k),
            io,
            ..Default::default()
        },
    );
    let got = logits_for(&streamed.model, prompt);
    let stats = streamed
        .expert_stream
        .as_ref()
        .expect("streaming")
        .1
        .borrow()
        .clone();
    (got, stats)
}

#[test]
fn every_io_mode_gives_the_resident_logits() {
    for name in MOE_FIXTURES {
        let dir = copy_fixture(name);
        prepare_expert_stream(dir.path(), |_, _| {}).unwrap();
        let r = reference(name);
        let off = StreamConfig {
            mode: StreamMode::Off,
            ..Default::default()
        };
        let want = logits_for(&load(dir.path(), off).model, &r.prompt_ids);
        // Where the temporary folder's file system refuses O_DIRECT, `direct` reads as
        // `dontneed` (said in the stats): the logits must not change either way.
        let (_, m) = manifest::open(dir.path()).unwrap().expect("prepared");
        let probe = dir
            .path()
            .join(manifest::STREAM_DIR)
            .join(&m.layers[0].file);
        let direct_works = mlxcel_stream::io::try_open_direct(&probe).is_ok();
        for io in [ExpertIo::Direct, ExpertIo::Dontneed, ExpertIo::Cached] {
            let (got, s) = streamed_logits(dir.path(), &r.prompt_ids, io);
            assert_eq!(got, want, "{name}: io {io:?}: logits");
            assert!(s.misses > 0 && s.bytes_read > 0, "{name} {io:?}: {s:?}");
            let in_effect = match io {
                ExpertIo::Direct if !direct_works => ExpertIo::Dontneed,
                other => other,
            };
            assert_eq!(s.io, Some(in_effect), "{name}: io in effect");
            assert!(s.reuse_base > 0 && s.top_decile_share() > 0.0, "{s:?}");
        }
    }
    eprintln!("streamed = resident with direct, dontneed and cached reads");
}

/// tmpfs refuses `O_DIRECT`: `direct` falls back to `dontneed` and the logits do not change.
#[test]
fn direct_reads_fall_back_where_refused() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("skip: no /dev/shm");
        return;
    }
    let name = "qwen3_moe-affine4-g64";
    let src = copy_fixture(name);
    let dir = tempfile::tempdir_in(shm).unwrap();
    for entry in fs::read_dir(src.path()).unwrap() {
        let path = entry.unwrap().path();
        fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    prepare_expert_stream(dir.path(), |_, _| {}).unwrap();
    let probe = dir.path().join("config.json");
    if mlxcel_stream::io::try_open_direct(&probe).is_ok() {
        eprintln!("skip: /dev/shm accepts O_DIRECT here");
        return;
    }
    let r = reference(name);
    let off = StreamConfig {
        mode: StreamMode::Off,
        ..Default::default()
    };
    let want = logits_for(&load(dir.path(), off).model, &r.prompt_ids);
    let (got, s) = streamed_logits(dir.path(), &r.prompt_ids, ExpertIo::Direct);
    assert_eq!(got, want);
    assert_eq!(s.io, Some(ExpertIo::Dontneed), "fell back: {s:?}");
}

/// Bytes of `path` in the page cache (`mincore` over a mapping of it).
fn cached_bytes(path: &Path) -> usize {
    let file = fs::File::open(path).unwrap();
    let len = file.metadata().unwrap().len() as usize;
    if len == 0 {
        return 0;
    }
    // SAFETY: a read-only mapping of a file no one writes while it is mapped; only its page
    // residency is asked for, never its bytes.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let mut resident = vec![0u8; len.div_ceil(page)];
    // SAFETY: the mapping is page-aligned and `len` long; `resident` has one byte per page.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            len,
            resident.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "mincore {}", path.display());
    resident.iter().filter(|r| **r & 1 == 1).count() * page
}

/// Drops the stream files of `dir` from the page cache (written back first: dirty pages stay).
fn drop_stream_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let stream = dir.join(manifest::STREAM_DIR);
    let mut files = Vec::new();
    for entry in fs::read_dir(&stream).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "bin") {
            let file = fs::File::open(&path).unwrap();
            file.sync_all().unwrap();
            mlxcel_stream::io::drop_cached(&file, 0, 0);
            files.push(path);
        }
    }
    files
}

/// `direct` and `dontneed` reads leave no page of the stream files in the page cache, so a
/// streamed model's memory is its arena however large the files; `cached` reads do leave them.
#[test]
fn direct_and_dontneed_reads_leave_the_page_cache_alone() {
    let name = "mixtral-affine4-g32";
    let dir = copy_fixture(name);
    prepare_expert_stream(dir.path(), |_, _| {}).unwrap();
    let r = reference(name);
    for io in [ExpertIo::Direct, ExpertIo::Dontneed, ExpertIo::Cached] {
        let files = drop_stream_files(dir.path());
        let before: usize = files.iter().map(|f| cached_bytes(f)).sum();
        if before > 0 {
            eprintln!("skip: this file system keeps the stream files cached ({before} bytes)");
            return;
        }
        let (_, s) = streamed_logits(dir.path(), &r.prompt_ids, io);
        let after: usize = files.iter().map(|f| cached_bytes(f)).sum();
        match io {
            ExpertIo::Cached => assert!(after > 0, "cached reads leave pages: {s:?}"),
            _ => assert_eq!(after, 0, "{io:?} left {after} bytes cached after {s:?}"),
        }
    }
}

/// A stream file cut short after the load checked its size: the read that runs past its end
/// stops generation with an error naming the file, in every IO mode, and the model recovers
/// once the file is whole again.
#[test]
fn a_stream_file_truncated_after_load_is_an_error_naming_it() {
    let name = "qwen3_moe-affine4-g64";
    let dir = copy_fixture(name);
    let m = prepare_expert_stream(dir.path(), |_, _| {}).unwrap();
    let r = reference(name);
    let per_slot: u64 = m.layers.iter().map(|l| l.expert_stride).sum();
    let file = dir
        .path()
        .join(manifest::STREAM_DIR)
        .join(&m.layers[0].file);
    let original = fs::read(&file).unwrap();
    for io in [ExpertIo::Direct, ExpertIo::Dontneed, ExpertIo::Cached] {
        fs::write(&file, &original).unwrap();
        let streamed = load(
            dir.path(),
            StreamConfig {
                mode: StreamMode::On,
                arena_bytes: Some(per_slot * 2),
                io,
                ..Default::default()
            },
        );
        // Only the first expert's blob is left, and half of it.
        fs::write(&file, &original[..m.layers[0].expert_stride as usize / 2]).unwrap();
        let err = greedy(&streamed.model, &r.prompt_ids, 4, None, |_| false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&m.layers[0].file) && err.contains("truncated"),
            "{io:?}: {err}"
        );
        // The failed read left no slot claiming an expert it does not hold: with the file
        // back, the same model generates the reference.
        fs::write(&file, &original).unwrap();
        let ids = greedy(
            &streamed.model,
            &r.prompt_ids,
            r.greedy_ids.len(),
            None,
            |_| false,
        )
        .unwrap();
        assert_eq!(ids, r.greedy_ids, "{io:?}: after the error");
    }
}

#[test]
fn tampered_layouts_are_refused() {
    let dir = copy_fixture("qwen3_moe-affine4-g64");
    prepare_expert_stream(dir.path(), |_, _| {}).unwrap();
    let stream_dir = dir.path().join(manifest::STREAM_DIR);
    let manifest_path = stream_dir.join(manifest::MANIFEST);
    let original = fs::read_to_string(&manifest_path).unwrap();
    let first_file = {
        let m: serde_json::Value = serde_json::from_str(&original).unwrap();
        m["layers"][0]["file"].as_str().unwrap().to_string()
    };
    // A file outside the folder.
    fs::write(
        &manifest_path,
        original.replace(&first_file, "../config.json"),
    )
    .unwrap();
    let err = verify_expert_stream(dir.path()).unwrap_err().to_string();
    assert!(err.contains("points outside the stream folder"), "{err}");
    fs::write(&manifest_path, &original).unwrap();
    // A flipped byte: the expert's hash catches it; a truncated file: the size check.
    let path = stream_dir.join(&first_file);
    let mut bytes = fs::read(&path).unwrap();
    bytes[100] ^= 0xff;
    fs::write(&path, &bytes).unwrap();
    let err = verify_expert_stream(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("expert 0") && err.contains(&first_file),
        "{err}"
    );
    fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    let err = manifest::open(dir.path()).unwrap_err().to_string();
    assert!(err.contains("size") && err.contains(&first_file), "{err}");
    // Streaming forced on a model without a layout says how to make one.
    let plain = copy_fixture("qwen3_moe");
    let on = StreamConfig {
        mode: StreamMode::On,
        ..Default::default()
    };
    let err = match load_model(
        plain.path(),
        &LoadOptions {
            skip_tokenizer: true,
            stream: Some(on),
            ..Default::default()
        },
    ) {
        Ok(_) => panic!("loaded without a stream layout"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("prepare-expert-stream"), "{err}");
}

/// Logits of each decode step: the prompt prefilled, then each of `continuation` fed alone.
fn decode_logits(
    model: &dyn mlxcel_arch::LanguageModel,
    prompt: &[u32],
    continuation: &[u32],
) -> Vec<Vec<f32>> {
    let mut session = mlxcel_arch::generate::Session::new(model);
    let (_, first) = session.prefill(prompt, None).unwrap();
    let mut out = vec![first
        .astype(mlxcel_core::Dtype::Float32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()];
    for &t in continuation {
        let logits = session.step(t).unwrap();
        out.push(
            logits
                .astype(mlxcel_core::Dtype::Float32)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
        );
    }
    out
}

/// Decode steps read the next streamed layer's predicted experts ahead: the logits of every
/// step stay the resident ones, bit for bit, with and without reading ahead, at the smallest
/// arena (the most misses), and the reads ahead happen and are used. The same holds with slots
/// written through MLX's `slice_update` instead of in place.
#[test]
fn reading_ahead_changes_no_decode_logits() {
    for name in MOE_FIXTURES {
        let dir = copy_fixture(name);
        let manifest = prepare_expert_stream(dir.path(), |_, _| {}).unwrap();
        let r = reference(name);
        let off = StreamConfig {
            mode: StreamMode::Off,
            ..Default::default()
        };
        let resident = load(dir.path(), off);
        let want = decode_logits(&resident.model, &r.prompt_ids, &r.greedy_ids);
        let top_k = resident.config["num_experts_per_tok"].as_u64().unwrap();
        let per_slot: u64 = manifest.layers.iter().map(|l| l.expert_stride).sum();
        for (prefetch, in_place) in [(true, true), (false, true), (true, false)] {
            let on = StreamConfig {
                mode: StreamMode::On,
                arena_bytes: Some(per_slot * top_k),
                prefetch,
                in_place,
                ..Default::default()
            };
            let streamed = load(dir.path(), on);
            let got = decode_logits(&streamed.model, &r.prompt_ids, &r.greedy_ids);
            assert!(
                got == want,
                "{name}: read-ahead {prefetch}, in place {in_place}: decode logits differ"
            );
            let s = streamed.expert_stream.as_ref().unwrap().1.borrow().clone();
            if prefetch && manifest.layers.len() > 1 {
                assert!(s.prefetched > 0 && s.prefetch_used > 0, "{name}: {s:?}");
                assert!(
                    s.prefetch_used <= s.prefetched && s.prefetch_used <= s.misses,
                    "{s:?}"
                );
            } else {
                assert_eq!((s.prefetched, s.prefetch_used), (0, 0), "{name}: {s:?}");
            }
            eprintln!(
                "{name}: read-ahead {prefetch}: {} misses, {} read ahead, {} used",
                s.misses, s.prefetched, s.prefetch_used
            );
        }
    }
}
