//! Bounded random-mutation fuzzing with a fixed seed (reproducible, a few seconds each): config
//! sanitising and argument parsing, the safetensors reader, the GGUF reader, the expert-stream
//! manifest parser and the chat-template renderer. Every input must give `Ok` or an `Err` with
//! a message: never a panic (an abort would end the test binary).

use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};

use mlxcel_arch::config::sanitize_config_json;
use mlxcel_arch::detection::get_model_type;
use mlxcel_core::WeightMap;
use mlxcel_loading::{load_model, ChatTemplate, LoadOptions, Message};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// Runs `f`, failing the test on a panic or an empty error message.
fn no_panic<E: std::fmt::Display>(what: &str, f: impl FnOnce() -> Result<(), E>) {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => assert!(!e.to_string().trim().is_empty(), "{what}: empty error"),
        Err(_) => panic!("{what}: panicked"),
    }
}

fn bad_value(rng: &mut StdRng) -> Value {
    match rng.gen_range(0..14) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(1e308),
        3 => json!(u64::MAX),
        4 => json!(i64::MIN),
        5 => json!("64"),
        6 => Value::Null,
        7 => json!(true),
        8 => json!([]),
        9 => json!({}),
        10 => json!({"__float__": "NaN"}),
        11 => json!({"__float__": "Infinity"}),
        12 => json!(1e-320),
        _ => json!(rng.gen_range(-3i64..100_000)),
    }
}

fn mutate_config(config: &mut Value, rng: &mut StdRng) {
    let Some(obj) = config.as_object_mut() else {
        return;
    };
    for _ in 0..rng.gen_range(1..4) {
        let keys: Vec<String> = obj.keys().cloned().collect();
        if keys.is_empty() {
            return;
        }
        let key = &keys[rng.gen_range(0..keys.len())];
        if rng.gen_bool(0.25) {
            obj.remove(key);
        } else if let Some(Value::Object(inner)) = obj.get_mut(key) {
            let inner_keys: Vec<String> = inner.keys().cloned().collect();
            if !inner_keys.is_empty() {
                let k = &inner_keys[rng.gen_range(0..inner_keys.len())];
                inner.insert(k.clone(), bad_value(rng));
            }
        } else {
            obj.insert(key.clone(), bad_value(rng));
        }
    }
}

fn fixture_names() -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(mlxcel_tests::fixtures_dir().join("models"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("config.json").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn fuzz_config_sanitiser_and_args() {
    let mut rng = StdRng::seed_from_u64(0x5eed_c0f1);
    for name in fixture_names() {
        let text = fs::read_to_string(mlxcel_tests::model_dir(&name).join("config.json")).unwrap();
        let original: Value = serde_json::from_str(&text).unwrap();
        for i in 0..60 {
            let mut config = original.clone();
            mutate_config(&mut config, &mut rng);
            no_panic(&format!("{name} #{i}: {config}"), || {
                let config = sanitize_config_json(config.clone());
                let t = get_model_type(&config, false)?;
                mlxcel_arch::cache_schedule(t, &config).map(|_| ())
            });
        }
    }
}

/// Full loads (and one decode step) of mutated configs of a few architectures.
#[test]
fn fuzz_config_full_load() {
    let mut rng = StdRng::seed_from_u64(0x10ad);
    let options = LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    };
    for name in [
        "llama",
        "qwen3",
        "gemma2",
        "mixtral",
        "deepseek_v3",
        "phi3",
        "exaone4",
    ] {
        let dir = mlxcel_tests::copy_fixture(name);
        let path = dir.path().join("config.json");
        let original: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        for i in 0..12 {
            let mut config = original.clone();
            mutate_config(&mut config, &mut rng);
            fs::write(&path, config.to_string()).unwrap();
            no_panic(&format!("{name} #{i}: {config}"), || {
                let loaded = load_model(dir.path(), &options)?;
                mlxcel_arch::generate::greedy(&loaded.model, &[1, 2], 2, None, |_| false)
                    .map(|_| ())
                    .map_err(mlxcel_loading::LoadError::from)
            });
        }
    }
}

fn mutate_bytes(bytes: &mut Vec<u8>, rng: &mut StdRng, header: usize) {
    match rng.gen_range(0..4) {
        0 => {
            let keep = rng.gen_range(0..bytes.len().max(1));
            bytes.truncate(keep);
        }
        1 => {
            for _ in 0..rng.gen_range(1..8) {
                let at = rng.gen_range(0..header.min(bytes.len()).max(1));
                if let Some(b) = bytes.get_mut(at) {
                    *b = rng.gen();
                }
            }
        }
        2 => {
            let at = rng.gen_range(0..bytes.len().max(1));
            if let Some(b) = bytes.get_mut(at) {
                *b ^= 1 << rng.gen_range(0..8);
            }
        }
        _ => {
            // A number in the header replaced by a large one.
            let end = header.min(bytes.len());
            if let Some(pos) = bytes[..end].iter().position(u8::is_ascii_digit) {
                let digits = rng.gen_range(1..20);
                let big: Vec<u8> = (0..digits).map(|_| b'1' + rng.gen_range(0..9)).collect();
                let mut out = bytes[..pos].to_vec();
                out.extend_from_slice(&big);
                out.extend_from_slice(&bytes[pos + 1..]);
                *bytes = out;
            }
        }
    }
}

#[test]
fn fuzz_safetensors_reader() {
    let mut rng = StdRng::seed_from_u64(0x5afe);
    let source = fs::read(mlxcel_tests::model_dir("llama").join("model.safetensors")).unwrap();
    let header = 8 + u64::from_le_bytes(source[..8].try_into().unwrap()) as usize;
    let dir = tempfile::tempdir().unwrap();
    for i in 0..300 {
        let mut bytes = source.clone();
        mutate_bytes(&mut bytes, &mut rng, header);
        fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
        no_panic(&format!("safetensors #{i}"), || {
            let map = WeightMap::open(dir.path())?;
            let names: Vec<String> = map.names().map(str::to_string).collect();
            for n in names {
                map.get(&n)?;
            }
            Ok::<(), mlxcel_core::Error>(())
        });
    }
}

fn gguf_bytes() -> Vec<u8> {
    let mut b = Vec::new();
    let string = |b: &mut Vec<u8>, s: &str| {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    };
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&2u64.to_le_bytes()); // tensors
    b.extend_from_slice(&3u64.to_le_bytes()); // metadata
    string(&mut b, "general.architecture");
    b.extend_from_slice(&8u32.to_le_bytes());
    string(&mut b, "llama");
    string(&mut b, "general.alignment");
    b.extend_from_slice(&4u32.to_le_bytes());
    b.extend_from_slice(&32u32.to_le_bytes());
    string(&mut b, "tokenizer.ggml.tokens");
    b.extend_from_slice(&9u32.to_le_bytes());
    b.extend_from_slice(&8u32.to_le_bytes());
    b.extend_from_slice(&2u64.to_le_bytes());
    string(&mut b, "a");
    string(&mut b, "b");
    for (name, offset) in [("t.weight", 0u64), ("u.weight", 32)] {
        string(&mut b, name);
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes()); // F32
        b.extend_from_slice(&offset.to_le_bytes());
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend((0..64u8).map(|i| i.wrapping_mul(7)));
    b
}

#[test]
fn fuzz_gguf_reader() {
    let mut rng = StdRng::seed_from_u64(0x6609);
    let source = gguf_bytes();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    fs::write(&path, &source).unwrap();
    assert!(
        mlxcel_quant::gguf::GgufFile::open(&path).is_ok(),
        "the seed file must parse"
    );
    for i in 0..2000 {
        let mut bytes = source.clone();
        for _ in 0..rng.gen_range(1..4) {
            mutate_bytes(&mut bytes, &mut rng, source.len());
        }
        fs::write(&path, &bytes).unwrap();
        no_panic(&format!("gguf #{i}"), || {
            let f = mlxcel_quant::gguf::GgufFile::open(&path)?;
            for t in f.tensors() {
                let _ = t.numel();
                let _ = t.torch_shape();
            }
            Ok::<(), mlxcel_quant::gguf::GgufError>(())
        });
    }
}

#[test]
fn fuzz_expert_stream_manifest_parser() {
    // A real layout, prepared from an MoE fixture, mutated field by field: parsing and the
    // structural checks `manifest::open` runs at load must refuse, never panic.
    let mut rng = StdRng::seed_from_u64(0x3a41);
    let dir = mlxcel_tests::copy_fixture("qwen3_moe");
    mlxcel_loading::stream::prepare_expert_stream(dir.path(), |_, _| {}).unwrap();
    let path = dir
        .path()
        .join(mlxcel_stream::manifest::STREAM_DIR)
        .join(mlxcel_stream::manifest::MANIFEST);
    let manifest: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    assert!(mlxcel_stream::manifest::open(dir.path()).unwrap().is_some());
    for i in 0..500 {
        let mut m = manifest.clone();
        for pointer in ["/layers/0", "/layers/0/planes/0", "/sources/0", ""] {
            if let Some(v) = m.pointer_mut(pointer).filter(|_| rng.gen_bool(0.4)) {
                mutate_config(v, &mut rng);
            }
        }
        let mut text = m.to_string().into_bytes();
        if rng.gen_bool(0.2) {
            let len = text.len();
            mutate_bytes(&mut text, &mut rng, len);
        }
        fs::write(&path, &text).unwrap();
        no_panic(&format!("manifest #{i}"), || {
            mlxcel_stream::manifest::open(dir.path()).map(|m| {
                let _ = m.map(|(_, m)| m.total_expert_bytes());
            })
        });
    }
}

#[test]
fn fuzz_chat_template_renderer() {
    let mut rng = StdRng::seed_from_u64(0xc4a7);
    let pieces = [
        "{% for m in messages %}",
        "{% endfor %}",
        "{{ m.content }}",
        "{{ m.role }}",
        "{% if m.role == 'user' %}",
        "{% if add_generation_prompt %}",
        "{% endif %}",
        "{% else %}",
        "{{ bos_token }}",
        "{{ raise_exception('no') }}",
        "{{ messages[0]['content'] | tojson }}",
        "{{ m.content.strip() }}",
        "{% for i in range(1000) %}",
        "{% for i in range(100000) %}",
        "{{ 'ab' * 1000 }}",
        "{% set x = 1 %}",
        "{{ x + 1 }}",
        "{{ loop.index }}",
        "{% macro f(n) %}{{ f(n) }}{% endmacro %}",
        "{{ f(1) }}",
        "{{ messages[-1] }}",
        "{{ 1 / 0 }}",
        "{{",
        "}}",
        "{%",
        "text",
    ];
    let roles = ["system", "user", "assistant", "tool", "admin", ""];
    let config = json!({"bos_token": "<s>"});
    let started = std::time::Instant::now();
    for i in 0..400 {
        let source: String = (0..rng.gen_range(1..10))
            .map(|_| pieces[rng.gen_range(0..pieces.len())])
            .collect();
        let messages: Vec<Message> = (0..rng.gen_range(0..4))
            .map(|_| {
                let content: String = (0..rng.gen_range(0..20))
                    .map(|_| char::from(rng.gen_range(32u8..127)))
                    .collect();
                Message::new(roles[rng.gen_range(0..roles.len())], &content)
            })
            .collect();
        no_panic(&format!("template #{i}: {source}"), || {
            let t = ChatTemplate::new(&source, &config)?;
            t.render(&messages, rng.gen_bool(0.5)).map(|_| ())
        });
    }
    assert!(started.elapsed().as_secs() < 60, "templates ran too long");
}
