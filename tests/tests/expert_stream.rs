//! Routed-expert streaming: for every MoE fixture, streamed and resident runs give identical
//! logits and greedy ids (with and without chunked prefill) for every arena size from top-k
//! slots per layer up to all experts; tampered stream layouts are refused with the reason.

use std::fs;
use std::path::Path;

use mlxcel_arch::generate::greedy;
use mlxcel_loading::stream::{prepare_expert_stream, verify_expert_stream};
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_stream::{manifest, CachePolicy, StreamConfig, StreamMode};
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
    for name in [
        "qwen3_moe",
        "qwen3_moe-affine4-g64",
        "mixtral",
        "mixtral-affine4-g32",
        "qwen2_moe",
        "olmoe",
    ] {
        check(name);
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
