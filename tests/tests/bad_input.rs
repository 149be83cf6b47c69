//! One regression test per class of bad input: each gets an error naming what is at fault,
//! never a panic, a hang or a silently wrong answer.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use mlxcel_arch::generate::{greedy, Session};
use mlxcel_arch::sampling::SamplingParams;
use mlxcel_core::weights::save_safetensors;
use mlxcel_core::{Array, WeightMap};
use mlxcel_loading::memory::estimate;
use mlxcel_loading::{
    generate_text, load_model, read_config, ChatTemplate, GenerateRequest, LoadOptions, Message,
};
use mlxcel_tests::copy_fixture;
use serde_json::{json, Value};

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut config: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    edit(config.as_object_mut().unwrap());
    fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

fn options() -> LoadOptions {
    LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    }
}

fn load_error(dir: &Path) -> String {
    match load_model(dir, &options()) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn config_error(fixture: &str, key: &str, value: Value) -> String {
    let dir = copy_fixture(fixture);
    edit_config(dir.path(), |c| {
        c.insert(key.to_string(), value);
    });
    load_error(dir.path())
}

#[test]
fn config_values_are_validated_naming_the_key() {
    let cases = [
        (
            "llama",
            "rms_norm_eps",
            json!(0),
            "rms_norm_eps = 0: must be positive and finite",
        ),
        (
            "llama",
            "rms_norm_eps",
            json!({"__float__": "NaN"}),
            "rms_norm_eps = \"NaN\"",
        ),
        (
            "llama",
            "rope_theta",
            json!(-1.0),
            "rope_theta = -1.0: must be positive",
        ),
        (
            "llama",
            "hidden_size",
            json!(0),
            "hidden_size = 0: must be a positive integer",
        ),
        (
            "llama",
            "hidden_size",
            json!("64"),
            "hidden_size = \"64\": wrong type",
        ),
        (
            "llama",
            "num_hidden_layers",
            json!(1u64 << 40),
            "num_hidden_layers = 1099511627776: must be at most",
        ),
        (
            "llama",
            "num_key_value_heads",
            json!(3),
            "num_key_value_heads = 3: must divide num_attention_heads = 4",
        ),
        ("llama", "vocab_size", json!(-1), "vocab_size = -1"),
        (
            "llama",
            "intermediate_size",
            json!(null),
            "missing field `intermediate_size`",
        ),
        (
            "llama",
            "model_type",
            json!(42),
            "model_type = 42: wrong type: must be a string",
        ),
        (
            "llama",
            "rope_scaling",
            json!({"type": "linear", "factor": 0}),
            "rope_scaling.factor = 0",
        ),
        ("qwen3", "head_dim", json!(0), "head_dim = 0"),
        (
            "phi3-partial-rotary",
            "partial_rotary_factor",
            json!(1.5),
            "partial_rotary_factor = 1.5: must be in (0, 1]",
        ),
        (
            "gemma2",
            "final_logit_softcapping",
            json!(0),
            "final_logit_softcapping = 0",
        ),
        (
            "gemma2",
            "query_pre_attn_scalar",
            json!(-4),
            "query_pre_attn_scalar = -4",
        ),
        ("mistral", "sliding_window", json!(0), "sliding_window = 0"),
        (
            "mixtral",
            "num_experts_per_tok",
            json!(9),
            "num_experts_per_tok = 9",
        ),
        (
            "mixtral",
            "num_local_experts",
            json!(0),
            "num_local_experts = 0",
        ),
        ("olmoe", "clip_qkv", json!("x"), "clip_qkv = \"x\""),
        (
            "granite",
            "embedding_multiplier",
            json!(f64::MAX),
            "embedding_multiplier",
        ),
        (
            "cohere",
            "layer_norm_eps",
            json!(-1e-5),
            "layer_norm_eps = -0.00001",
        ),
        ("deepseek_v3", "kv_lora_rank", json!(0), "kv_lora_rank = 0"),
        (
            "deepseek_v3",
            "n_group",
            json!(3),
            "n_group = 3: must divide",
        ),
        ("deepseek_v3", "topk_group", json!(5), "topk_group = 5"),
    ];
    for (fixture, key, value, expected) in cases {
        let err = config_error(fixture, key, value.clone());
        assert!(
            err.contains(expected) && err.contains("config.json"),
            "{fixture} {key} = {value}: {err}"
        );
    }
}

/// Rewrites the safetensors header of `file` through `edit` (tensor data unchanged).
fn edit_header(file: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let bytes = fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(header.as_object_mut().unwrap());
    let mut text = serde_json::to_string(&header).unwrap();
    while text.len() % 8 != 0 {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    fs::write(file, out).unwrap();
}

#[test]
fn float_tensors_relabelled_as_integers_are_refused() {
    for tensor in ["model.norm.weight", "model.layers.0.input_layernorm.weight"] {
        let dir = copy_fixture("llama");
        edit_header(&dir.path().join("model.safetensors"), |h| {
            h[tensor]["dtype"] = json!("I32");
        });
        let err = load_error(dir.path());
        assert!(
            err.contains(&format!("`{tensor}`")) && err.contains("I32"),
            "{err}"
        );
    }
    // An affine scale plane relabelled as integers.
    let dir = copy_fixture("llama-affine4-g64");
    let scales = "model.layers.0.self_attn.q_proj.scales";
    let stored = {
        let m = WeightMap::open(dir.path()).unwrap();
        m.info(scales).unwrap().stored_dtype.clone()
    };
    let relabel = match stored.as_str() {
        "F32" => "I32",
        _ => "I16",
    };
    edit_header(&dir.path().join("model.safetensors"), |h| {
        h[scales]["dtype"] = json!(relabel);
    });
    let err = load_error(dir.path());
    assert!(err.contains(scales), "{err}");
}

#[test]
fn nan_weights_stop_generation_naming_the_step() {
    let dir = copy_fixture("llama");
    let map = WeightMap::open(dir.path()).unwrap();
    let mut tensors: Vec<(String, Array)> = map
        .names()
        .map(|n| (n.to_string(), map.get(n).unwrap()))
        .collect();
    drop(map);
    for (name, array) in &mut tensors {
        if name == "model.norm.weight" {
            let n = array.shape().iter().product::<i32>() as usize;
            *array = Array::from_slice(&vec![f32::NAN; n], &array.shape()).unwrap();
        }
    }
    let _ = fs::remove_file(dir.path().join("model.safetensors.index.json"));
    save_safetensors(dir.path().join("model.safetensors"), &tensors, None).unwrap();
    let loaded = load_model(dir.path(), &options()).unwrap();
    let err = greedy(&loaded.model, &[1, 2, 3], 4, None, |_| false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("NaN") && err.contains("step 0"), "{err}");
    for sampling in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.7,
            ..Default::default()
        },
    ] {
        let mut session = Session::new(&loaded.model);
        let request = GenerateRequest {
            max_new_tokens: 4,
            sampling,
            ..Default::default()
        };
        let err = generate_text(&mut session, None, &[1, 2, 3], &request, |_| {}, |_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("NaN") && err.contains("step"), "{err}");
    }
}

#[test]
fn files_a_checkpoint_names_stay_inside_its_folder() {
    for escape in [
        "../../x.safetensors",
        "/etc/passwd",
        "sub/../../y.safetensors",
    ] {
        let dir = copy_fixture("llama");
        let names: Vec<String> = WeightMap::open(dir.path())
            .unwrap()
            .names()
            .map(str::to_string)
            .collect();
        let mut map = serde_json::Map::new();
        for (i, n) in names.iter().enumerate() {
            let file = if i == 0 { escape } else { "model.safetensors" };
            map.insert(n.clone(), json!(file));
        }
        fs::write(
            dir.path().join("model.safetensors.index.json"),
            json!({"metadata": {}, "weight_map": map}).to_string(),
        )
        .unwrap();
        let err = match WeightMap::open(dir.path()) {
            Ok(_) => panic!("{escape} should be refused"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(escape) && err.contains("outside"), "{err}");
    }
    // A tokenizer (or template) that links out of the folder.
    #[cfg(unix)]
    {
        let outside = tempfile::tempdir().unwrap();
        let dir = copy_fixture("llama");
        fs::copy(
            dir.path().join("tokenizer.json"),
            outside.path().join("tokenizer.json"),
        )
        .unwrap();
        fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
        std::os::unix::fs::symlink(
            outside.path().join("tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
        let err = match load_model(dir.path(), &LoadOptions::default()) {
            Ok(_) => panic!("a tokenizer outside the folder should be refused"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("tokenizer.json") && err.contains("outside"),
            "{err}"
        );
    }
}

#[test]
fn truncated_safetensors_name_the_tensor() {
    let dir = copy_fixture("llama");
    let file = dir.path().join("model.safetensors");
    let bytes = fs::read(&file).unwrap();
    fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("tensor `") && err.contains("past the end"),
        "{err}"
    );
}

#[test]
fn unreadable_folders_say_permission_denied() {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let dir = copy_fixture("llama");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o000)).unwrap();
        let readable = fs::read_dir(dir.path()).is_ok();
        let result = load_model(dir.path(), &options())
            .err()
            .map(|e| e.to_string());
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        if readable {
            eprintln!("skip: running as a user that ignores permissions (root)");
            return;
        }
        let err = result.expect("an unreadable folder should fail");
        assert!(err.contains("permission denied"), "{err}");
    }
}

#[test]
fn looping_chat_templates_fail_quickly_naming_the_template() {
    let config = json!({});
    let user = [Message::new("user", "hi")];
    for source in [
        "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% set k = i + j %}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{{ 'x' * 99999999 }}{{ 'x' * 99999999 }}",
    ] {
        let t = ChatTemplate::new(source, &config).unwrap();
        let started = Instant::now();
        let err = t.render(&user, true).unwrap_err().to_string();
        assert!(err.contains("chat template"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(20), "{source}: too slow");
    }
    let t = ChatTemplate::new(
        "{% for m in messages %}{{ m.content }}{% endfor %}",
        &config,
    )
    .unwrap();
    let err = t.render(&[], true).unwrap_err().to_string();
    assert!(err.contains("empty"), "{err}");
    let err = t
        .render(&[Message::new("hacker", "x")], true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"hacker\""), "{err}");
    // A role the template itself names is accepted.
    let t = ChatTemplate::new(
        "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}",
        &config,
    )
    .unwrap();
    assert_eq!(
        t.render(&[Message::new("developer", "x")], false).unwrap(),
        "D"
    );
}

#[test]
fn out_of_range_parameters_name_the_parameter() {
    let loaded = load_model(mlxcel_tests::model_dir("llama"), &options()).unwrap();
    let cases = [
        (
            SamplingParams {
                top_p: 2.0,
                ..Default::default()
            },
            "top_p = 2",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            "top_p = 0",
        ),
        (
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            "temperature = -1",
        ),
        (
            SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            },
            "temperature = NaN",
        ),
        (
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            "min_p = 1.5",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            "repetition_penalty = 0",
        ),
        (
            SamplingParams {
                repetition_penalty: f32::INFINITY,
                ..Default::default()
            },
            "repetition_penalty = inf",
        ),
    ];
    for (sampling, expected) in cases {
        let request = GenerateRequest {
            max_new_tokens: 2,
            sampling,
            ..Default::default()
        };
        let mut session = Session::new(&loaded.model);
        let err = generate_text(&mut session, None, &[1, 2], &request, |_| {}, |_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains(expected), "{err}");
    }
    let request = GenerateRequest {
        max_new_tokens: 2,
        prefill_chunk: Some(0),
        ..Default::default()
    };
    let mut session = Session::new(&loaded.model);
    let err = generate_text(&mut session, None, &[1, 2], &request, |_| {}, |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("prefill_chunk = 0"), "{err}");
}

#[test]
fn huge_contexts_do_not_fit_rather_than_wrap() {
    let dir = mlxcel_tests::model_dir("llama");
    let config = read_config(&dir).unwrap();
    for context in [u64::MAX, u64::MAX / 2, 1 << 62] {
        let est = estimate(&dir, &config, mlxcel_core::Dtype::Float32, context, 512).unwrap();
        assert!(est.kv_cache > 0 && est.total() >= est.kv_cache);
        if est.available.is_some() {
            assert!(!est.fits(), "context {context}: {est:?}");
        }
    }
}
