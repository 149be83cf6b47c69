//! Gemma 3n beyond logit parity (which `parity.rs` checks on `gemma3n_text`, `gemma3n` and
//! `gemma3n-affine4-g32`): the text-only load of the full checkpoint, the KV-sharing caches,
//! bad configs, and where mlx-lm and transformers disagree.

use mlxcel_arch::{LanguageModel, LayerKind, ModelType};
use mlxcel_core::{Array, Dtype};
use mlxcel_tests::{
    copy_fixture, edit_config, load_without_tokenizer, logits_for, max_abs_diff, mlx_lm_logits,
    model_dir, reference,
};

/// The full `Gemma3nForConditionalGeneration` checkpoint loads its text decoder only, and the
/// load says which tower and embedder tensors it left out.
#[test]
fn full_checkpoint_loads_text_only_and_reports_the_towers_left_out() {
    let loaded = load_without_tokenizer(model_dir("gemma3n"));
    assert_eq!(loaded.model.model_type(), ModelType::Gemma3n);
    let line = loaded
        .surgery_applied
        .iter()
        .find(|l| l.starts_with("text-only load:"))
        .unwrap_or_else(|| panic!("no text-only line in {:?}", loaded.surgery_applied));
    assert!(
        line.contains("vision/audio-tower and embedder tensors left out")
            && line.contains("model.audio_tower.")
            && line.contains("model.embed_vision."),
        "{line}"
    );
    // The text model alone has nothing to leave out.
    let text = load_without_tokenizer(model_dir("gemma3n_text"));
    assert!(
        text.surgery_applied.is_empty(),
        "{:?}",
        text.surgery_applied
    );
}

/// The last `num_kv_shared_layers` layers keep no keys or values of their own: their caches read
/// the last earlier layer of their kind, and the memory per token counts only the others.
#[test]
fn kv_shared_layers_hold_no_cache() {
    let loaded = load_without_tokenizer(model_dir("gemma3n_text"));
    let model = &loaded.model;
    let schedule = model.layer_schedule();
    assert!(matches!(
        schedule[0],
        LayerKind::SlidingAttention { window: 8, .. }
    ));
    assert!(matches!(schedule[1], LayerKind::GlobalAttention { .. }));
    assert_eq!(schedule[2], LayerKind::Shared { source: 0 });
    assert_eq!(schedule[3], LayerKind::Shared { source: 1 });
    // 2 layers × (k + v) × 1 kv head × 16 features × 4 bytes.
    assert_eq!(model.cache_bytes_per_token(Dtype::Float32), 2 * 2 * 16 * 4);
    let r = reference("gemma3n_text");
    let ids: Vec<i32> = r.prompt_ids.iter().map(|t| *t as i32).collect();
    let tokens = Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap();
    let mut caches = model.make_caches();
    model.forward(&tokens, &mut caches).unwrap();
    assert_eq!(caches[2].nbytes(), 0);
    assert_eq!(caches[3].offset(), ids.len());
    // A shared layer handed a cache of its own is refused by name, not silently recomputed.
    let mut wrong = model.make_caches();
    wrong[3] = mlxcel_arch::cache::LayerCache::standard();
    let err = model.forward(&tokens, &mut wrong).unwrap_err().to_string();
    assert!(
        err.contains("layer 3 shares layer 1's keys and values"),
        "{err}"
    );
}

/// Config errors name the field.
#[test]
fn bad_configs_name_the_field() {
    let cases: [(&str, serde_json::Value, &str); 4] = [
        (
            "num_kv_shared_layers",
            5.into(),
            "num_kv_shared_layers = 5: more than the 4 layers",
        ),
        (
            "num_kv_shared_layers",
            3.into(),
            "layer 1 (full_attention) shares keys and values, but no earlier layer of its kind computes them",
        ),
        (
            "activation_sparsity_pattern",
            serde_json::json!([0.95, 1.0, 0.0, 0.0]),
            "activation_sparsity_pattern entry 1: must be in [0, 1)",
        ),
        (
            "intermediate_size",
            serde_json::json!([64, 64]),
            "intermediate_size has 2 entries for 4 layers",
        ),
    ];
    for (key, value, want) in cases {
        let dir = copy_fixture("gemma3n_text");
        edit_config(dir.path(), |c| c[key] = value.clone());
        let options = mlxcel_loading::LoadOptions {
            skip_tokenizer: true,
            ..Default::default()
        };
        let err = mlxcel_loading::load_model(dir.path(), &options)
            .err()
            .unwrap_or_else(|| panic!("{key} = {value} loaded"))
            .to_string();
        assert!(err.contains(want), "{key} = {value}: {err}");
    }
}

/// mlx-lm clips AltUp's prediction and correction coefficients to `altup_coef_clip` at inference;
/// transformers clips them only while training. mlxcel follows transformers: with a clip small
/// enough to bite (0.5), its logits stay transformers' (which do not change with it), far from
/// mlx-lm's on that config (`mlx_lm_logits.safetensors`, `generate.py --stage mlx-lm-diffs`).
#[test]
fn altup_coefficients_are_not_clipped_at_inference_unlike_mlx_lm() {
    let dir = copy_fixture("gemma3n");
    edit_config(dir.path(), |c| {
        c["text_config"]["altup_coef_clip"] = 0.5.into()
    });
    let loaded = load_without_tokenizer(dir.path());
    let r = reference("gemma3n");
    let got = logits_for(&loaded.model, &r.prompt_ids);
    let (to_transformers, _) = max_abs_diff(&got, &r.logits);
    let (to_mlx_lm, _) = max_abs_diff(&got, &mlx_lm_logits("gemma3n"));
    assert!(to_transformers < 4e-4, "{to_transformers:.2e}");
    assert!(
        to_mlx_lm > 1.0,
        "mlx-lm no longer clips AltUp coefficients at inference? {to_mlx_lm:.2e}"
    );
}

/// Input embeddings without their ids (what another tower feeds the decoder): transformers then
/// builds the per-layer inputs from the projection of the embeddings alone (the table is not
/// consulted). Against transformers' logits for the prompt's embeddings passed as
/// `inputs_embeds` (`models/gemma3n/inputs_embeds.safetensors`), which differ from the ids'.
#[test]
fn embeddings_without_ids_follow_transformers_inputs_embeds() {
    let loaded = load_without_tokenizer(model_dir("gemma3n"));
    let model = &loaded.model;
    let r = reference("gemma3n");
    let ids: Vec<i32> = r.prompt_ids.iter().map(|t| *t as i32).collect();
    let tokens = Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap();
    let embeddings = model.embed(&tokens).unwrap();
    let got = model
        .forward_embeddings(&embeddings, None, &mut model.make_caches(), false)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let path = model_dir("gemma3n").join("inputs_embeds.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let want: Vec<f32> = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let (d, at) = max_abs_diff(&got, &want);
    assert!(d < 4e-4, "{d:.2e} at {at}");
    let (apart, _) = max_abs_diff(&want, &r.logits);
    assert!(
        apart > 1e-2,
        "the per-layer rows made no difference ({apart:.2e})"
    );
}

/// The registry's cache schedule (what `--estimate-memory` reads, without building the model)
/// reads a full checkpoint's nested `text_config` as the loader does.
#[test]
fn cache_schedule_reads_the_nested_text_config() {
    let config = mlxcel_tests::read_config(&model_dir("gemma3n"));
    let config = mlxcel_arch::config::sanitize_config_json(config);
    let schedule = mlxcel_arch::cache_schedule(ModelType::Gemma3n, &config).unwrap();
    let loaded = load_without_tokenizer(model_dir("gemma3n"));
    assert_eq!(schedule, loaded.model.layer_schedule());
    assert_eq!(schedule[3], LayerKind::Shared { source: 1 });
}

/// A full Gemma 3n checkpoint as the hub ships it, with its MobileNet vision tower's tensors
/// (`model.vision_tower.timm_model.*`, which the fixture cannot have: transformers needs timm
/// to build the tower): the text decoder loads alone with the same logits, the load names the
/// tower among what it left out, and an image is refused with the seed's message.
#[test]
fn vision_tower_tensors_are_left_out_and_images_refused() {
    let dir = copy_fixture("gemma3n");
    // Two tower tensors in a shard of their own, as a sharded hub checkpoint has them.
    let conv: Vec<u8> = (0..16 * 3 * 3 * 3)
        .flat_map(|i| (i as f32 * 1e-3).to_le_bytes())
        .collect();
    let bias: Vec<u8> = (0..16).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let tensors = [
        (
            "model.vision_tower.timm_model.conv_stem.conv.weight",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![16, 3, 3, 3], &conv)
                .unwrap(),
        ),
        (
            "model.vision_tower.timm_model.conv_stem.bn.bias",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![16], &bias).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, &None, &dir.path().join("model-vision.safetensors"))
        .unwrap();
    let loaded = load_without_tokenizer(dir.path());
    let line = loaded
        .surgery_applied
        .iter()
        .find(|l| l.starts_with("text-only load:"))
        .unwrap_or_else(|| panic!("no text-only line in {:?}", loaded.surgery_applied));
    assert!(line.contains("model.vision_tower."), "{line}");
    let r = reference("gemma3n");
    let with_tower = logits_for(&loaded.model, &r.prompt_ids);
    let without = logits_for(
        &load_without_tokenizer(model_dir("gemma3n")).model,
        &r.prompt_ids,
    );
    assert_eq!(max_abs_diff(&with_tower, &without).0, 0.0);
    assert!(loaded.model.vision().is_none());
    let png =
        std::fs::read(mlxcel_tests::fixtures_dir().join("vision/images/gradient.png")).unwrap();
    let want = format!(
        "model {} was loaded without a vision tower (text-only checkpoint)",
        dir.path().display()
    );
    assert_eq!(
        loaded.prepare_image_bytes(&png).unwrap_err().to_string(),
        want
    );
}
