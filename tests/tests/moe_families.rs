//! The mixture-of-experts families of issue 16 beyond what the parity test checks on every
//! fixture: their detection special cases (Hunyuan's one `model_type` for two architectures),
//! the configs real checkpoints ship, and the errors for values this build does not support.

use mlxcel_arch::config::sanitize_config_json;
use mlxcel_arch::detection::get_model_type;
use mlxcel_arch::{cache_schedule, ModelType};
use mlxcel_loading::{load_model, LoadOptions};
use mlxcel_tests::{
    copy_fixture, distance_to_reference, distances_to_transformers_and_mlx_lm, edit_config,
    load_without_tokenizer, logits_for, max_abs_diff, reference,
};
use serde_json::{json, Value};

/// `tencent/Hunyuan-7B-Instruct`'s config.json as the hub ships it (dense; the remote-code
/// `model_type: "hunyuan"` of the first releases).
fn hunyuan_7b() -> Value {
    json!({
        "architectures": ["HunYuanDenseV1ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "attention_head_dim": 128, "bos_token_id": 1,
        "cla_share_factor": 2, "eod_token_id": 127967, "eos_token_id": 127960, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "mlp_bias": false,
        "model_type": "hunyuan", "norm_type": "rms", "num_attention_heads": 32, "num_experts": 1,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "num_shared_expert": 1,
        "pad_token_id": 127961, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "type": "dynamic"},
        "rope_theta": 10000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "use_cache": true, "use_cla": false, "use_qk_norm": true, "use_rotary_pos_emb": true,
        "vocab_size": 128256
    })
}

/// `tencent/Hunyuan-A13B-Instruct`'s config.json as the hub ships it (MoE: 64 experts, top-8,
/// the per-layer keys as lists).
fn hunyuan_a13b() -> Value {
    let layers = 32;
    json!({
        "architectures": ["HunYuanMoEV1ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "attention_head_dim": 128, "bos_token_id": 1,
        "cla_share_factor": 2, "eod_token_id": 127967, "eos_token_id": 127960, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 3072, "max_position_embeddings": 32768, "mlp_bias": false,
        "model_type": "hunyuan", "moe_intermediate_size": vec![3072; layers],
        "moe_topk": vec![8; layers], "norm_type": "rms", "num_attention_heads": 32,
        "num_experts": 64, "num_hidden_layers": layers, "num_key_value_heads": 8,
        "num_shared_expert": vec![1; layers], "pad_token_id": 127961, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "type": "dynamic"},
        "rope_theta": 10000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "use_cache": true, "use_cla": false, "use_mixed_mlp_moe": true, "use_qk_norm": true,
        "use_rotary_pos_emb": true, "vocab_size": 128167
    })
}

#[test]
fn hunyuan_model_type_is_resolved_to_dense_or_moe_by_num_experts() {
    for (config, expected) in [
        (hunyuan_7b(), ModelType::HunyuanDense),
        (hunyuan_a13b(), ModelType::HunyuanMoe),
    ] {
        let config = sanitize_config_json(config);
        let found = get_model_type(&config, false).unwrap();
        assert_eq!(found, expected);
        // The whole hub config parses for the chosen architecture (per-layer lists included).
        let schedule = cache_schedule(found, &config).unwrap();
        assert_eq!(schedule.len(), 32);
    }
    // The explicit transformers types map directly, and num_experts absent means dense.
    assert_eq!(
        ModelType::from_model_type("hunyuan_v1_dense"),
        Some(ModelType::HunyuanDense)
    );
    assert_eq!(
        ModelType::from_model_type("hunyuan_v1_moe"),
        Some(ModelType::HunyuanMoe)
    );
    let mut bare = hunyuan_7b();
    bare.as_object_mut().unwrap().remove("num_experts");
    assert_eq!(
        get_model_type(&sanitize_config_json(bare), false).unwrap(),
        ModelType::HunyuanDense
    );
}

/// Each Hunyuan fixture relabelled `model_type: "hunyuan"` (how the first hub releases and the
/// mlx-community conversions name both variants) loads as its variant and matches the
/// transformers reference.
#[test]
fn hunyuan_fixtures_load_under_the_shared_model_type() {
    for name in ["hunyuan_v1_dense", "hunyuan_v1_moe"] {
        let dir = copy_fixture(name);
        edit_config(dir.path(), |config| config["model_type"] = "hunyuan".into());
        let loaded = load_without_tokenizer(dir.path());
        let r = reference(name);
        let got = logits_for(&loaded.model, &r.prompt_ids);
        let (diff, _) = max_abs_diff(&got, &r.logits);
        assert!(diff < 2e-4, "{name} as `hunyuan`: {diff:.2e}");
        mlxcel_tests::assert_greedy_ids(&loaded.model, &r, name);
    }
}

#[test]
fn hunyuan_unsupported_values_are_refused_by_name() {
    let cases: [(&str, Value, &str); 4] = [
        ("use_cla", json!(true), "use_cla"),
        ("use_qk_norm", json!(false), "use_qk_norm"),
        ("moe_topk", json!([8, 8]), "moe_topk"),
        ("moe_topk", json!(65), "moe_topk"),
    ];
    for (key, value, named) in cases {
        let mut config = hunyuan_a13b();
        config[key] = value.clone();
        let config = sanitize_config_json(config);
        let t = get_model_type(&config, false).unwrap();
        let err = cache_schedule(t, &config)
            .expect_err(&format!("{key} = {value} accepted"))
            .to_string();
        assert!(err.contains(named), "{key} = {value}: {err}");
    }
    // A dense checkpoint type with experts is refused naming num_experts.
    let mut config = hunyuan_a13b();
    config["model_type"] = "hunyuan_v1_dense".into();
    let config = sanitize_config_json(config);
    let err = cache_schedule(ModelType::HunyuanDense, &config)
        .unwrap_err()
        .to_string();
    assert!(err.contains("num_experts"), "{err}");
}

/// mlx-lm's `hunyuan` keeps the top-k of the softmax over all experts unnormalised;
/// transformers' `HunYuanMoEV1Gate` (the reference) renormalises them. mlxcel follows
/// transformers, so its logits sit far from mlx-lm's.
#[test]
fn hunyuan_moe_follows_transformers_where_mlx_lm_skips_the_renormalisation() {
    let (to_transformers, to_mlx_lm) = distances_to_transformers_and_mlx_lm("hunyuan_v1_moe");
    assert!(to_transformers < 2e-4, "{to_transformers:.2e}");
    assert!(
        to_mlx_lm > 1.0,
        "mlx-lm's hunyuan routing now matches? {to_mlx_lm:.3}"
    );
}

/// gpt-oss's yarn rope says `truncate: false`; mlx-lm's yarn ignores the key and always rounds
/// the correction range (with `truncate: true` the two agree, which the gpt_oss-affine4-g32
/// conversion relies on). mlxcel follows transformers.
#[test]
fn gpt_oss_follows_transformers_where_mlx_lm_truncates_the_yarn_range() {
    let (to_transformers, to_mlx_lm) = distances_to_transformers_and_mlx_lm("gpt_oss");
    assert!(to_transformers < 2e-4, "{to_transformers:.2e}");
    assert!(
        to_mlx_lm > 1.0,
        "mlx-lm's yarn now honours truncate? {to_mlx_lm:.3}"
    );
}

/// `dir`'s `model.safetensors` plus `extra` float32 tensors (name, shape, values).
fn add_tensors(dir: &std::path::Path, extra: &[(&str, Vec<usize>, Vec<f32>)]) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    for (name, shape, values) in extra {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((name.to_string(), shape.clone(), data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, shape, data)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, &None, &path).unwrap();
}

/// ERNIE 4.5 releases carry multi-token-prediction tensors (`model.mtp_block.0.*`,
/// `model.mtp_emb_norm.0.*`, ...) that transformers ignores: dropped at load, not refused.
#[test]
fn ernie4_5_moe_ignores_the_multi_token_prediction_tensors() {
    let name = "ernie4_5_moe";
    let dir = copy_fixture(name);
    add_tensors(
        dir.path(),
        &[
            (
                "model.mtp_block.0.self_attn.q_proj.weight",
                vec![64, 64],
                vec![0.5; 64 * 64],
            ),
            ("model.mtp_emb_norm.0.weight", vec![64], vec![1.0; 64]),
            (
                "model.mtp_linear_proj.0.weight",
                vec![64, 128],
                vec![0.1; 64 * 128],
            ),
        ],
    );
    let diff = distance_to_reference(dir.path(), name);
    assert!(diff < 2e-4, "{diff:.2e}");
}

/// GLM-4.5 checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers after the
/// last decoder layer (`model.layers.{num_hidden_layers}.*`): they are dropped at load, not
/// refused as unexpected tensors, and the logits do not change.
#[test]
fn glm4_moe_drops_the_multi_token_prediction_layer() {
    let name = "glm4_moe";
    let dir = copy_fixture(name);
    // A copy of layer 1 as layer 2 (the MTP layer's shape).
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let layer2: Vec<(String, Vec<usize>, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .filter_map(|(n, v)| {
            let rest = n.strip_prefix("model.layers.1.")?;
            let values = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            Some((format!("model.layers.2.{rest}"), v.shape().to_vec(), values))
        })
        .collect();
    let extra: Vec<(&str, Vec<usize>, Vec<f32>)> = layer2
        .iter()
        .map(|(n, shape, values)| (n.as_str(), shape.clone(), values.clone()))
        .collect();
    add_tensors(dir.path(), &extra);
    edit_config(dir.path(), |config| {
        config["num_nextn_predict_layers"] = 1.into()
    });
    let diff = distance_to_reference(dir.path(), name);
    assert!(diff < 2e-4, "{diff:.2e}");
}

/// OpenAI's MXFP4 experts load as they are: after the sanitiser every expert projection is an
/// mxfp4 plane pair (`weight` uint32, `scales` uint8 E8M0) under `switch_mlp`, split from the
/// interleaved `gate_up_proj_blocks`, and the checkpoint's `quant_method: "mxfp4"` reads as MLX's
/// mxfp4 (32 per scale, 4 bits). The parity test checks the logits of the same fixture.
#[test]
fn gpt_oss_mxfp4_experts_stay_packed() {
    use mlxcel_core::{Dtype, WeightMap};
    use mlxcel_quant::{QuantConfig, QuantMode};
    let dir = mlxcel_tests::model_dir("gpt_oss-mxfp4");
    let config = sanitize_config_json(
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap(),
    );
    let quant = QuantConfig::from_config(&config).unwrap().unwrap();
    assert_eq!(
        (quant.mode, quant.group_size, quant.bits),
        (QuantMode::Mxfp4, 32, 4)
    );
    let weights =
        mlxcel_arch::sanitized_weights(ModelType::GptOss, &config, WeightMap::open(&dir).unwrap())
            .unwrap();
    let (experts, hidden, inter) = (4, 64, 32);
    for layer in 0..2 {
        let s = format!("model.layers.{layer}.mlp.switch_mlp");
        for (proj, out, inp) in [
            ("gate_proj", inter, hidden),
            ("up_proj", inter, hidden),
            ("down_proj", hidden, inter),
        ] {
            let w = weights.get(&format!("{s}.{proj}.weight")).unwrap();
            assert_eq!(w.dtype().unwrap(), Dtype::Uint32, "{s}.{proj}");
            assert_eq!(w.shape(), vec![experts, out, inp / 8], "{s}.{proj}");
            let scales = weights.get(&format!("{s}.{proj}.scales")).unwrap();
            assert_eq!(scales.dtype().unwrap(), Dtype::Uint8, "{s}.{proj}");
            assert_eq!(scales.shape(), vec![experts, out, inp / 32], "{s}.{proj}");
            assert!(weights.contains(&format!("{s}.{proj}.bias")), "{s}.{proj}");
        }
        assert!(!weights.names().any(|n| n.contains("_blocks")));
    }
}

#[test]
fn gpt_oss_unsupported_values_are_refused_by_name() {
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(mlxcel_tests::model_dir("gpt_oss").join("config.json")).unwrap(),
    )
    .unwrap();
    for (key, value) in [("swiglu_limit", json!(10.0)), ("swiglu_alpha", json!(1.0))] {
        let mut bad = config.clone();
        bad[key] = value;
        let err = cache_schedule(ModelType::GptOss, &sanitize_config_json(bad))
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{key}: {err}");
    }
    // The layer pattern without `layer_types`: sliding first, then full (transformers' default).
    let mut plain = config.clone();
    plain.as_object_mut().unwrap().remove("layer_types");
    let schedule = cache_schedule(ModelType::GptOss, &sanitize_config_json(plain)).unwrap();
    assert!(matches!(
        schedule[0],
        mlxcel_arch::LayerKind::SlidingAttention { window: 8, .. }
    ));
    assert!(matches!(
        schedule[1],
        mlxcel_arch::LayerKind::GlobalAttention { .. }
    ));
}

/// ERNIE 4.5's MoE keys with unusable values are refused naming the key; its MoE layer range
/// (`moe_layer_start_index` .. `moe_layer_end_index`, -1 = the last layer) picks the layers.
#[test]
fn ernie4_5_moe_config_values_are_checked_by_name() {
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(mlxcel_tests::model_dir("ernie4_5_moe").join("config.json"))
            .unwrap(),
    )
    .unwrap();
    for (key, value) in [("moe_k", json!(5)), ("moe_layer_end_index", json!(-3))] {
        let mut bad = config.clone();
        bad[key] = value;
        let err = cache_schedule(ModelType::Ernie45Moe, &sanitize_config_json(bad))
            .unwrap_err()
            .to_string();
        assert!(err.contains(key), "{key}: {err}");
    }
}

/// Fused q/k/v and gate/up projections (`fuse_projections`, the GPU default) under the new
/// attention variants (sinks with biases, qk-norm after rope, a tied head with a bias): the
/// fused model computes what the stored layers compute and matches the reference.
#[test]
fn fused_projections_keep_the_new_attention_variants() {
    for name in [
        "gpt_oss",
        "gpt_oss-mxfp4",
        "hunyuan_v1_moe",
        "ernie4_5_moe",
        "glm4_moe",
    ] {
        let r = reference(name);
        let logits = |fuse: bool| {
            let options = LoadOptions {
                skip_tokenizer: true,
                fuse_projections: Some(fuse),
                ..Default::default()
            };
            let loaded = load_model(mlxcel_tests::model_dir(name), &options)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            logits_for(&loaded.model, &r.prompt_ids)
        };
        let (fused, stored) = (logits(true), logits(false));
        let (diff, _) = max_abs_diff(&fused, &stored);
        assert!(diff <= 1e-5, "{name}: fused differs by {diff:.2e}");
        let (to_reference, _) = max_abs_diff(&fused, &r.logits);
        assert!(to_reference < 2e-4, "{name}: {to_reference:.2e}");
    }
}
