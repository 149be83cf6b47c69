//! The vision-language route (issue 21) against transformers 5.24.0 and Pillow 13.0.0
//! (`tests/fixtures/vision/`, made by `generate.py --stage vision`):
//!
//! - image decoding and PIL's resize, byte for byte, for every filter;
//! - Gemma 3: pixel values after preprocessing vs `Gemma3Processor` (PIL backend), the expanded
//!   prompt (image-token counts), logits over the whole expanded prompt with two images
//!   (bidirectional attention over each image's tokens), greedy continuation, chunked prefill,
//!   prefix reuse keyed with the images' content;
//! - the seed's text-only rules, with configs as real checkpoints ship them, and the exact
//!   error for an image sent to a text-only load;
//! - the lazy tower (nothing of it read before the first image).

use std::path::{Path, PathBuf};

use mlxcel_arch::vision::{forward_multimodal, FeatureCache, MultimodalPrompt};
use mlxcel_arch::{GenerationModel, LanguageModel};
use mlxcel_loading::image::{decode_image, load_image, resize, Resample, RgbImage};
use mlxcel_loading::vision::PreparedImage;
use mlxcel_loading::{generate_text, load_model, GenerateRequest, LoadOptions, Loaded, Message};
use mlxcel_tests::max_abs_diff;
use safetensors::SafeTensors;
use serde_json::{json, Value};

fn vision_dir() -> PathBuf {
    mlxcel_tests::fixtures_dir().join("vision")
}

fn gemma3_dir() -> PathBuf {
    vision_dir().join("gemma3")
}

fn image_path(name: &str) -> PathBuf {
    vision_dir().join("images").join(name)
}

fn tensor_bytes(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<u8>) {
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("reference tensor {name}: {e}"));
    (t.shape().to_vec(), t.data().to_vec())
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn ids(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
        .collect()
}

/// A vision fixture's references (Gemma 3's, LLaVA's).
struct Gemma3Ref {
    prompt_ids: Vec<u32>,
    pixel_values: Vec<f32>,
    logits: Vec<f32>,
    greedy_ids: Vec<u32>,
    text_prompt_ids: Vec<u32>,
    text_logits: Vec<f32>,
    meta: Value,
}

fn gemma3_reference() -> Gemma3Ref {
    family_reference(&gemma3_dir())
}

fn family_reference(dir: &Path) -> Gemma3Ref {
    let bytes = std::fs::read(dir.join("reference.safetensors")).expect("reference");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let get = |n: &str| tensor_bytes(&st, n).1;
    Gemma3Ref {
        prompt_ids: ids(&get("prompt_ids")),
        pixel_values: f32s(&get("pixel_values")),
        logits: f32s(&get("logits")),
        greedy_ids: ids(&get("greedy_ids")),
        text_prompt_ids: ids(&get("text_prompt_ids")),
        text_logits: f32s(&get("text_logits")),
        meta: serde_json::from_str(
            &std::fs::read_to_string(dir.join("reference.json")).expect("meta"),
        )
        .expect("json"),
    }
}

/// The logit tolerance: max(2e-4, 2e-5 · max|logit|).
fn tolerance(want: &[f32]) -> f32 {
    let peak = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    (2e-5 * peak).max(2e-4)
}

fn load(dir: &Path) -> Loaded {
    load_model(dir, &LoadOptions::default()).expect("load")
}

fn fixture_images(loaded: &Loaded, r: &Gemma3Ref) -> Vec<mlxcel_arch::vision::ImageInput> {
    r.meta["images"]
        .as_array()
        .expect("images")
        .iter()
        .map(|n| {
            let bytes = std::fs::read(image_path(n.as_str().expect("name"))).expect("image");
            loaded.prepare_image_bytes(&bytes).expect("prepare")
        })
        .collect()
}

/// The reference's images prepared for a prompt (inputs and each image's expansion).
fn fixture_prepared(loaded: &Loaded, r: &Gemma3Ref) -> Vec<PreparedImage> {
    r.meta["images"]
        .as_array()
        .expect("images")
        .iter()
        .map(|n| {
            let image = load_image(image_path(n.as_str().expect("name"))).expect("image");
            loaded.prepare_for_prompt(&image).expect("prepare")
        })
        .collect()
}

#[test]
fn decoding_and_resize_match_pillow_byte_for_byte() {
    let bytes = std::fs::read(vision_dir().join("resize_reference.safetensors")).expect("ref");
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let filters = [
        ("nearest", Resample::Nearest),
        ("lanczos", Resample::Lanczos),
        ("bilinear", Resample::Bilinear),
        ("bicubic", Resample::Bicubic),
        ("box", Resample::Box),
        ("hamming", Resample::Hamming),
    ];
    let mut checked = 0;
    for name in [
        "gradient.png",
        "alpha.png",
        "grey.png",
        "lossless.webp",
        "photo.jpg",
        "photo420.jpg",
    ] {
        let decoded = load_image(image_path(name)).expect("decode");
        let (shape, want) = tensor_bytes(&st, &format!("{name}/decoded"));
        assert_eq!(
            [decoded.height, decoded.width, 3],
            [shape[0], shape[1], shape[2]]
        );
        let worst = decoded
            .data
            .iter()
            .zip(&want)
            .map(|(a, b)| (*a as i32 - *b as i32).abs())
            .max()
            .unwrap();
        if name.ends_with(".jpg") {
            // JPEG decoders differ: zune-jpeg (the `image` crate's) against Pillow's
            // libjpeg-turbo, by a few levels per channel (IDCT rounding; chroma upsampling on
            // 4:2:0). Pinned here so a change of either shows.
            eprintln!("{name}: decoded pixels differ from Pillow's by up to {worst} levels");
            assert!((1..=4).contains(&worst), "{name}: {worst}");
        } else {
            assert_eq!(
                worst, 0,
                "{name}: decoded pixels differ from PIL's by up to {worst}"
            );
        }
        // Resize PIL's own decode, so each filter is checked on its own.
        let source = RgbImage::new(shape[1], shape[0], want).expect("image");
        for (fname, filter) in filters {
            for (w, h) in [(32, 32), (17, 23), (40, 36)] {
                let got = resize(&source, w, h, filter);
                let (_, want) = tensor_bytes(&st, &format!("{name}/{fname}/{w}x{h}"));
                assert_eq!(
                    got.data, want,
                    "{name}: PIL {fname} resize to {w}x{h} differs"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 6 * 6 * 3);
}

#[test]
fn undecodable_images_are_refused_naming_the_file() {
    let err = decode_image(b"not an image").unwrap_err().to_string();
    assert!(err.contains("not a PNG, JPEG or WebP image"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.png");
    let mut png = std::fs::read(image_path("gradient.png")).unwrap();
    png.truncate(100);
    std::fs::write(&path, png).unwrap();
    let err = load_image(&path).unwrap_err().to_string();
    assert!(err.contains("broken.png"), "{err}");
}

#[test]
fn gemma3_pixel_values_and_prompt_match_the_processor() {
    let r = gemma3_reference();
    let loaded = load(&gemma3_dir());
    let images = fixture_images(&loaded, &r);
    let got: Vec<f32> = images.iter().flat_map(|i| i.pixels().to_vec()).collect();
    let (d, _) = max_abs_diff(&got, &r.pixel_values);
    eprintln!("gemma3 pixel values: max |Δ| = {d:e}");
    assert!(
        d <= 1e-5,
        "pixel values differ from Gemma3Processor's by {d}"
    );
    assert_eq!(images[0].shape(), [1, 3, 32, 32]);

    // The chat template with the user's text behind the image placeholders, expanded as the
    // processor expands it, tokenises to the processor's ids.
    let text = r.meta["user_text"].as_str().unwrap();
    let content = loaded.user_content_with_images(text, 2).unwrap();
    let template = loaded.chat_template.as_ref().expect("template");
    let rendered = template.render(&[Message::user(&content)], true).unwrap();
    let prepared = fixture_prepared(&loaded, &r);
    assert!(prepared
        .iter()
        .zip(&images)
        .all(|(p, i)| p.inputs.len() == 1 && p.inputs[0].pixels() == i.pixels()));
    let expanded = loaded.expand_prompt_text_for(&rendered, &prepared).unwrap();
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    let prompt = tokenizer.encode(&expanded, false).unwrap();
    assert_eq!(prompt, r.prompt_ids, "expanded prompt ids");
    let image_token = 513;
    assert_eq!(
        prompt.iter().filter(|t| **t == image_token).count(),
        2 * 4,
        "mm_tokens_per_image per image"
    );
    // The same expansion from ids that hold the placeholder once per image.
    let unexpanded = tokenizer.encode(&rendered, false).unwrap();
    let by_ids = loaded
        .expand_image_tokens_for(&unexpanded, &prepared)
        .unwrap();
    assert_eq!(by_ids, r.prompt_ids, "ids-level expansion");
    // Counts that do not match are refused.
    let three = [
        prepared[0].clone(),
        prepared[1].clone(),
        prepared[0].clone(),
    ];
    let err = loaded
        .expand_prompt_text_for(&rendered, &three)
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 image placeholder(s)"), "{err}");
    let err = loaded
        .expand_image_tokens_for(&unexpanded, &prepared[..1])
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 time(s) for 1 image(s)"), "{err}");
}

#[test]
fn gemma3_logits_over_the_expanded_prompt_match_transformers() {
    let r = gemma3_reference();
    let loaded = load(&gemma3_dir());
    let images = fixture_images(&loaded, &r);
    let vision = loaded.model.vision().expect("a vision tower");
    let prompt = MultimodalPrompt::new(vision, &r.prompt_ids, &images).unwrap();
    let mut caches = loaded.model.make_caches();
    let logits = forward_multimodal(
        vision,
        &prompt,
        0..r.prompt_ids.len(),
        &mut FeatureCache::default(),
        &mut caches,
        false,
    )
    .unwrap()
    .to_vec::<f32>()
    .unwrap();
    let (d, at) = max_abs_diff(&logits, &r.logits);
    let tol = tolerance(&r.logits);
    eprintln!(
        "gemma3 logits (2 images, {} positions): max |Δ| = {d:e} (tolerance {tol:e})",
        r.prompt_ids.len()
    );
    assert!(d <= tol, "logits differ by {d} at {at}");

    // Without the bidirectional image blocks the logits are measurably different: the mask
    // is exercised.
    let vocab = loaded.model.vocab_size();
    let mut causal = loaded.model.make_caches();
    let mut feats = FeatureCache::default();
    let emb = mlxcel_arch::vision::multimodal_embeddings(
        vision,
        &prompt,
        0..r.prompt_ids.len(),
        &mut feats,
    )
    .unwrap();
    let plain = loaded
        .model
        .forward_embeddings(&emb, None, &mut causal, false)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let (dc, _) = max_abs_diff(&plain, &r.logits);
    assert!(dc > 100.0 * tol, "causal-only logits should differ ({dc})");
    assert_eq!(logits.len(), r.prompt_ids.len() * vocab);
}

#[test]
fn gemma3_greedy_chunked_prefill_and_prefix_reuse() {
    let r = gemma3_reference();
    let loaded = load(&gemma3_dir());
    let images = fixture_images(&loaded, &r);
    let request = GenerateRequest {
        max_new_tokens: r.greedy_ids.len(),
        eos_token_ids: Vec::new(),
        images: images.clone(),
        ..GenerateRequest::default()
    };
    let mut session = loaded.session();
    let (out, stats) =
        generate_text(&mut session, None, &r.prompt_ids, &request, |_| {}, |_| {}).unwrap();
    assert_eq!(out, r.greedy_ids, "greedy continuation");
    assert_eq!(stats.reused_tokens, 0);

    // Chunked prefill never splits an image and gives the same last logits.
    let last = &r.logits[r.logits.len() - loaded.model.vocab_size()..];
    for chunk in [1, 3, 5, 8, 64] {
        let mut s = loaded.session();
        let (_, logits) = s
            .prefill_multimodal(&r.prompt_ids, &images, Some(chunk))
            .unwrap();
        let (d, _) = max_abs_diff(&logits.to_vec::<f32>().unwrap(), last);
        assert!(
            d <= tolerance(last),
            "chunk {chunk}: last logits differ by {d}"
        );
    }

    // Same prompt again: everything but the last token is reused.
    let mut s = loaded.session();
    s.prefill_multimodal(&r.prompt_ids, &images, None).unwrap();
    let (reused, again) = s.prefill_multimodal(&r.prompt_ids, &images, None).unwrap();
    assert_eq!(reused, r.prompt_ids.len() - 1);
    let (d, _) = max_abs_diff(&again.to_vec::<f32>().unwrap(), last);
    assert!(d <= tolerance(last));

    // The same ids with the second image replaced: nothing from where that image starts is
    // reused (the sliding-window layer cannot rewind that far here, so the session starts
    // over), and the logits are those of a fresh prefill with the new images, not the cached
    // ones.
    let swapped = vec![images[0].clone(), images[0].clone()];
    let vision = loaded.model.vision().unwrap();
    let second_start = MultimodalPrompt::new(vision, &r.prompt_ids, &images)
        .unwrap()
        .runs()[1]
        .start;
    let (reused, logits) = s.prefill_multimodal(&r.prompt_ids, &swapped, None).unwrap();
    assert!(
        reused <= second_start,
        "reuse must stop at the changed image ({reused})"
    );
    let mut fresh = loaded.session();
    let (_, want) = fresh
        .prefill_multimodal(&r.prompt_ids, &swapped, None)
        .unwrap();
    let want = want.to_vec::<f32>().unwrap();
    let (d, _) = max_abs_diff(&logits.to_vec::<f32>().unwrap(), &want);
    assert!(d <= tolerance(&want), "reused vs fresh: {d}");
    let (d, _) = max_abs_diff(&want, last);
    assert!(d > 1e-3, "another image must change the logits");

    // A text-only request over the same ids does not reuse the image positions either.
    let (reused, _) = s.prefill(&r.prompt_ids, None).unwrap();
    assert!(
        reused
            <= MultimodalPrompt::new(vision, &r.prompt_ids, &images)
                .unwrap()
                .runs()[0]
                .start
    );
}

#[test]
fn gemma3_text_prompt_matches_transformers_and_the_tower_stays_lazy() {
    let r = gemma3_reference();
    let loaded = load(&gemma3_dir());
    let GenerationModel::Gemma3(model) = &loaded.model else {
        panic!("a Gemma3 model");
    };
    let tower = model.tower().expect("loaded with its tower");
    assert!(
        !tower.materialized(),
        "the tower is built at the first image"
    );
    let logits = mlxcel_tests::logits_for(&loaded.model, &r.text_prompt_ids);
    let (d, _) = max_abs_diff(&logits, &r.text_logits);
    assert!(
        d <= tolerance(&r.text_logits),
        "text-only logits differ by {d}"
    );
    assert!(
        !tower.materialized(),
        "a text prompt does not touch the tower"
    );
    let images = fixture_images(&loaded, &r);
    loaded
        .session()
        .prefill_multimodal(&r.prompt_ids, &images, None)
        .unwrap();
    assert!(tower.materialized());

    // --estimate-memory counts the tower apart, as lazy: the SigLIP tower and projector's f32
    // bytes, not in the weights.
    let est = |dir: &Path| {
        let config = mlxcel_loading::read_config(dir).unwrap();
        mlxcel_loading::memory::estimate(dir, &config, mlxcel_core::Dtype::Float32, 64, 16).unwrap()
    };
    let full = est(&gemma3_dir());
    let tensors =
        SafeTensors::deserialize(&std::fs::read(gemma3_dir().join("model.safetensors")).unwrap())
            .unwrap()
            .tensors()
            .into_iter()
            .filter(|(n, _)| {
                n.starts_with("vision_tower.") || n.starts_with("multi_modal_projector.")
            })
            .map(|(_, t)| t.data().len() as u64)
            .sum::<u64>();
    assert_eq!(full.vision_tower_lazy, tensors);
    assert!(full
        .weights
        .keys()
        .all(|(role, _)| !role.starts_with("vision")));
    let text_only = text_only_variant(|c| c["language_model_only"] = json!(true), false);
    assert_eq!(est(text_only.path()).vision_tower_lazy, 0);
}

/// The fixture with `edit` applied to its config (and, with `drop_vision`, its vision tensors
/// removed from the safetensors file).
fn text_only_variant(edit: impl FnOnce(&mut Value), drop_vision: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(gemma3_dir()).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    mlxcel_tests::edit_config(dir.path(), edit);
    if drop_vision {
        let bytes = std::fs::read(gemma3_dir().join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .filter(|(n, _)| !n.contains("vision_tower") && !n.contains("multi_modal_projector"))
            .collect();
        safetensors::serialize_to_file(kept, &None, &dir.path().join("model.safetensors")).unwrap();
    }
    dir
}

#[test]
fn gemma3_text_only_rules() {
    let r = gemma3_reference();
    let cases: Vec<(&str, tempfile::TempDir, bool)> = vec![
        (
            "vision_config null",
            text_only_variant(|c| c["vision_config"] = Value::Null, false),
            true,
        ),
        (
            "vision_config {}",
            text_only_variant(|c| c["vision_config"] = json!({}), false),
            true,
        ),
        (
            "vision_config absent",
            text_only_variant(
                |c| {
                    c.as_object_mut().unwrap().remove("vision_config");
                },
                false,
            ),
            true,
        ),
        (
            "language_model_only with vision weights",
            text_only_variant(|c| c["language_model_only"] = json!(true), false),
            true,
        ),
        ("no vision weights", text_only_variant(|_| {}, true), false),
    ];
    for (what, dir, weights_left_out) in cases {
        let loaded = load(dir.path());
        assert!(loaded.model.vision().is_none(), "{what}: loaded text-only");
        assert!(loaded.vision.is_none(), "{what}");
        let report = loaded.surgery_applied.join("\n");
        assert_eq!(
            report.contains("text-only load:")
                && report.contains("vision-tower and projector tensors left out"),
            weights_left_out,
            "{what}: {report}"
        );
        // The text decoder alone gives transformers' text-only logits.
        let logits = mlxcel_tests::logits_for(&loaded.model, &r.text_prompt_ids);
        let (d, _) = max_abs_diff(&logits, &r.text_logits);
        assert!(d <= tolerance(&r.text_logits), "{what}: {d}");
        // An image is refused with the seed's exact message.
        let want = format!(
            "model {} was loaded without a vision tower (text-only checkpoint)",
            dir.path().display()
        );
        let bytes = std::fs::read(image_path("gradient.png")).unwrap();
        assert_eq!(
            loaded.prepare_image_bytes(&bytes).unwrap_err().to_string(),
            want,
            "{what}"
        );
        // Also at the session, for images prepared elsewhere.
        let full = load(&gemma3_dir());
        let images = fixture_images(&full, &r);
        let err = loaded
            .session()
            .prefill_multimodal(&r.prompt_ids, &images, None)
            .unwrap_err()
            .to_string();
        assert_eq!(err, want, "{what}");
    }
}

#[test]
fn gemma3_image_count_mismatches_are_refused() {
    let r = gemma3_reference();
    let loaded = load(&gemma3_dir());
    let images = fixture_images(&loaded, &r);
    let mut s = loaded.session();
    let err = s
        .prefill_multimodal(&r.prompt_ids, &images[..1], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("more image-token positions"), "{err}");
    let three = vec![images[0].clone(), images[1].clone(), images[0].clone()];
    let err = s
        .prefill_multimodal(&r.prompt_ids, &three, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("3 image(s) given"), "{err}");
}

#[test]
fn llava_matches_transformers() {
    let dir = vision_dir().join("llava");
    let r = family_reference(&dir);
    let loaded = load(&dir);
    let GenerationModel::Llava(model) = &loaded.model else {
        panic!("a Llava model");
    };
    assert!(!model.tower().unwrap().materialized());
    // Pixel values (shortest edge 40 bicubic, center crop 32, CLIP mean/std; the RGBA image
    // composited over white) as CLIPImageProcessor computes them.
    let images = fixture_images(&loaded, &r);
    let got: Vec<f32> = images.iter().flat_map(|i| i.pixels().to_vec()).collect();
    let (d, _) = max_abs_diff(&got, &r.pixel_values);
    eprintln!("llava pixel values: max |Δ| = {d:e}");
    assert!(d <= 1e-5, "pixel values differ by {d}");
    // The prompt: 16 `<image>` positions per image (4x4 patches, class dropped).
    let text = r.meta["user_text"].as_str().unwrap();
    let content = loaded.user_content_with_images(text, 2).unwrap();
    let rendered = loaded
        .chat_template
        .as_ref()
        .unwrap()
        .render(&[Message::user(&content)], true)
        .unwrap();
    let expanded = loaded
        .expand_prompt_text_for(&rendered, &fixture_prepared(&loaded, &r))
        .unwrap();
    let prompt = loaded
        .tokenizer
        .as_ref()
        .unwrap()
        .encode(&expanded, false)
        .unwrap();
    assert_eq!(prompt, r.prompt_ids);
    assert_eq!(prompt.iter().filter(|t| **t == 512).count(), 32);
    // Logits over the whole expanded prompt, and greedy.
    let logits = loaded
        .multimodal_logits(&r.prompt_ids, &images)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let (d, at) = max_abs_diff(&logits, &r.logits);
    let tol = tolerance(&r.logits);
    eprintln!(
        "llava logits (2 images, {} positions): max |Δ| = {d:e} (tolerance {tol:e})",
        r.prompt_ids.len()
    );
    assert!(d <= tol, "logits differ by {d} at {at}");
    let request = GenerateRequest {
        max_new_tokens: r.greedy_ids.len(),
        images: images.clone(),
        ..GenerateRequest::default()
    };
    let (out, _) = generate_text(
        &mut loaded.session(),
        None,
        &r.prompt_ids,
        &request,
        |_| {},
        |_| {},
    )
    .unwrap();
    assert_eq!(out, r.greedy_ids);
    let text_logits = mlxcel_tests::logits_for(&loaded.model, &r.text_prompt_ids);
    let (d, _) = max_abs_diff(&text_logits, &r.text_logits);
    assert!(d <= tolerance(&r.text_logits), "text-only prompt: {d}");

    // Text-only: `vision_config: null`.
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    mlxcel_tests::edit_config(tmp.path(), |c| c["vision_config"] = Value::Null);
    let text_only = load(tmp.path());
    assert!(text_only.model.vision().is_none());
    let logits = mlxcel_tests::logits_for(&text_only.model, &r.text_prompt_ids);
    let (d, _) = max_abs_diff(&logits, &r.text_logits);
    assert!(d <= tolerance(&r.text_logits), "text-only load: {d}");
    assert_eq!(
        text_only
            .multimodal_logits(&r.prompt_ids, &images)
            .unwrap_err()
            .to_string(),
        format!(
            "model {} was loaded without a vision tower (text-only checkpoint)",
            tmp.path().display()
        )
    );
}

#[test]
fn processor_config_spellings_and_pan_and_scan() {
    let r = gemma3_reference();
    // The image processor nested in `processor_config.json` (how newer checkpoints ship it)
    // reads the same.
    let nested = text_only_variant(|_| {}, false);
    let pre: Value = serde_json::from_str(
        &std::fs::read_to_string(nested.path().join("preprocessor_config.json")).unwrap(),
    )
    .unwrap();
    std::fs::remove_file(nested.path().join("preprocessor_config.json")).unwrap();
    std::fs::write(
        nested.path().join("processor_config.json"),
        json!({"image_processor": pre, "image_seq_length": 4}).to_string(),
    )
    .unwrap();
    let loaded = load(nested.path());
    let images = fixture_images(&loaded, &r);
    let got: Vec<f32> = images.iter().flat_map(|i| i.pixels().to_vec()).collect();
    assert!(max_abs_diff(&got, &r.pixel_values).0 <= 1e-5);

    // Pan and scan: a wide image becomes the original and two crops, framed in the prompt as
    // Gemma3Processor frames them; pixel values, ids and logits as transformers'.
    let pas = text_only_variant(|_| {}, false);
    let mut pre = pre.clone();
    pre["do_pan_and_scan"] = json!(true);
    pre["pan_and_scan_min_crop_size"] = json!(8);
    pre["pan_and_scan_max_num_crops"] = json!(4);
    pre["pan_and_scan_min_ratio_to_activate"] = json!(1.2);
    std::fs::write(pas.path().join("preprocessor_config.json"), pre.to_string()).unwrap();
    let loaded = load(pas.path());
    let bytes = std::fs::read(gemma3_dir().join("pan_and_scan.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want_ids = ids(&tensor_bytes(&st, "prompt_ids").1);
    let want_pixels = f32s(&tensor_bytes(&st, "pixel_values").1);
    let want_logits = f32s(&tensor_bytes(&st, "logits").1);
    let image = load_image(image_path("gradient.png")).unwrap();
    let prepared = loaded.prepare_for_prompt(&image).unwrap();
    assert_eq!(prepared.inputs.len(), 3, "the original and two crops");
    let got: Vec<f32> = prepared
        .inputs
        .iter()
        .flat_map(|i| i.pixels().to_vec())
        .collect();
    assert!(max_abs_diff(&got, &want_pixels).0 <= 1e-5);
    let content = loaded
        .user_content_with_images(r.meta["user_text"].as_str().unwrap(), 1)
        .unwrap();
    let rendered = loaded
        .chat_template
        .as_ref()
        .unwrap()
        .render(&[Message::user(&content)], true)
        .unwrap();
    let text = loaded
        .expand_prompt_text_for(&rendered, std::slice::from_ref(&prepared))
        .unwrap();
    let prompt = loaded
        .tokenizer
        .as_ref()
        .unwrap()
        .encode(&text, false)
        .unwrap();
    assert_eq!(prompt, want_ids);
    let logits = loaded
        .multimodal_logits(&prompt, &prepared.inputs)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let (d, _) = max_abs_diff(&logits, &want_logits);
    eprintln!("gemma3 pan and scan logits: max |Δ| = {d:e}");
    assert!(
        d <= tolerance(&want_logits),
        "pan-and-scan logits differ by {d}"
    );
    // The single-input path refuses it rather than dropping the crops.
    let err = loaded.prepare_image(&image).unwrap_err().to_string();
    assert!(err.contains("prepare_for_prompt"), "{err}");
    // A bad value names the key.
    let bad = text_only_variant(|_| {}, false);
    pre["do_pan_and_scan"] = json!(false);
    pre["resample"] = json!(9);
    std::fs::write(bad.path().join("preprocessor_config.json"), pre.to_string()).unwrap();
    let err = load_model(bad.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("resample = 9"), "{err}");
}

/// The Gemma 3 fixture with a nonzero `position_delta` (as Qwen2-VL's M-RoPE has), to check
/// that decode steps after a multimodal prefill run at `offset + delta`.
struct Shifted<'m> {
    inner: &'m GenerationModel,
    delta: i64,
}

impl mlxcel_arch::vision::VisionLanguage for Shifted<'_> {
    fn text(&self) -> &dyn LanguageModel {
        self.inner.vision().unwrap().text()
    }
    fn image_token_id(&self) -> u32 {
        self.inner.vision().unwrap().image_token_id()
    }
    fn image_token_count(
        &self,
        image: &mlxcel_arch::vision::ImageInput,
    ) -> mlxcel_arch::Result<usize> {
        self.inner.vision().unwrap().image_token_count(image)
    }
    fn image_features(
        &self,
        image: &mlxcel_arch::vision::ImageInput,
    ) -> mlxcel_arch::Result<mlxcel_core::Array> {
        self.inner.vision().unwrap().image_features(image)
    }
    fn bidirectional_images(&self) -> bool {
        true
    }
    fn position_delta(&self, _: &MultimodalPrompt<'_>) -> mlxcel_arch::Result<i64> {
        Ok(self.delta)
    }
}

impl LanguageModel for Shifted<'_> {
    fn embed(&self, tokens: &mlxcel_core::Array) -> mlxcel_arch::Result<mlxcel_core::Array> {
        self.inner.embed(tokens)
    }
    fn forward_embeddings(
        &self,
        embeddings: &mlxcel_core::Array,
        positions: Option<&mlxcel_core::Array>,
        caches: &mut [mlxcel_arch::LayerCache],
        last_only: bool,
    ) -> mlxcel_arch::Result<mlxcel_core::Array> {
        self.inner
            .forward_embeddings(embeddings, positions, caches, last_only)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn layer_schedule(&self) -> Vec<mlxcel_arch::LayerKind> {
        self.inner.layer_schedule()
    }
    fn vision(&self) -> Option<&dyn mlxcel_arch::vision::VisionLanguage> {
        Some(self)
    }
}

#[test]
fn decode_steps_follow_the_position_delta() {
    let r = gemma3_reference();
    let loaded = load(&gemma3_dir());
    let images = fixture_images(&loaded, &r);
    let next = r.greedy_ids[0];
    let step = |delta: i64| {
        let model = Shifted {
            inner: &loaded.model,
            delta,
        };
        let mut s = mlxcel_arch::generate::Session::new(&model);
        s.prefill_multimodal(&r.prompt_ids, &images, None).unwrap();
        s.step(next).unwrap().to_vec::<f32>().unwrap()
    };
    // By hand: the prompt, then the token at the explicit position len + 5.
    let vision = loaded.model.vision().unwrap();
    let mm = MultimodalPrompt::new(vision, &r.prompt_ids, &images).unwrap();
    let mut caches = loaded.model.make_caches();
    forward_multimodal(
        vision,
        &mm,
        0..r.prompt_ids.len(),
        &mut FeatureCache::default(),
        &mut caches,
        true,
    )
    .unwrap();
    let token = mlxcel_core::Array::from_slice(&[next as i32], &[1, 1]).unwrap();
    let position = mlxcel_core::Array::from_slice(&[r.prompt_ids.len() as i32 + 5], &[1]).unwrap();
    let want = loaded
        .model
        .forward_embeddings(
            &loaded.model.embed(&token).unwrap(),
            Some(&position),
            &mut caches,
            true,
        )
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let (d, _) = max_abs_diff(&step(5), &want);
    assert!(d <= 1e-5, "delta 5: {d}");
    let (d0, _) = max_abs_diff(&step(0), &want);
    assert!(d0 > 1e-4, "the delta must move the rotary position ({d0})");
}

#[test]
fn the_high_level_model_takes_images() {
    use mlxcel_models::{Generation, Model};
    let r = gemma3_reference();
    let model = Model::load(gemma3_dir()).build().unwrap();
    let images: Vec<_> = r.meta["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| load_image(image_path(n.as_str().unwrap())).unwrap())
        .collect();
    let options = Generation {
        max_new_tokens: Some(r.greedy_ids.len()),
        images: images.clone(),
        ..Generation::default()
    };
    let text = r.meta["user_text"].as_str().unwrap();
    let mut session = model.session();
    let (first, stats) = session
        .generate(vec![Message::user(text)], options.clone())
        .unwrap()
        .finish()
        .unwrap();
    assert_eq!(stats.prompt_tokens, r.prompt_ids.len());
    // The reference's ids come back (greedy) through the ids prompt too.
    let collapsed: Vec<u32> = {
        let mut out = Vec::new();
        let mut i = 0;
        while i < r.prompt_ids.len() {
            if r.prompt_ids[i..].starts_with(&[201, 201, 512]) {
                out.push(512);
                i += 10;
            } else {
                out.push(r.prompt_ids[i]);
                i += 1;
            }
        }
        out
    };
    let mut ids = Vec::new();
    let stream = model.generate(collapsed, options.clone()).unwrap();
    for piece in stream {
        ids.extend(piece.unwrap().tokens);
    }
    assert_eq!(ids, r.greedy_ids);
    // The same conversation again in the session (its caches hold the reply too; the
    // sliding-window layer cannot rewind past its 8 rows, so it starts over) answers the same.
    let (second, _) = session
        .generate(vec![Message::user(text)], options)
        .unwrap()
        .finish()
        .unwrap();
    assert_eq!(first, second);
    // A text model refuses images.
    let text_model = Model::load(mlxcel_tests::model_dir("gemma3_text"))
        .build()
        .unwrap();
    let err = text_model
        .generate(
            "hi",
            Generation {
                images: vec![images[0].clone()],
                ..Generation::default()
            },
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.ends_with("was loaded without a vision tower (text-only checkpoint)"),
        "{err}"
    );
}

/// The fixture's tensors renamed by `rename` (and the patch convolution transposed to MLX's
/// `[out, kh, kw, in]` layout when `mlx_conv`), written into a copy of the folder.
fn respelled(dir: &Path, rename: impl Fn(&str) -> String, mlx_conv: bool) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, out.path().join(p.file_name().unwrap())).unwrap();
    }
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in st.tensors() {
        let (mut shape, mut data) = (t.shape().to_vec(), t.data().to_vec());
        if mlx_conv && name.ends_with("patch_embedding.weight") {
            // [O, C, kh, kw] → [O, kh, kw, C] (f32).
            let (o, c, h, w) = (shape[0], shape[1], shape[2], shape[3]);
            let src = f32s(&data);
            let mut dst = vec![0f32; src.len()];
            for a in 0..o {
                for b in 0..c {
                    for y in 0..h {
                        for x in 0..w {
                            dst[((a * h + y) * w + x) * c + b] = src[((a * c + b) * h + y) * w + x];
                        }
                    }
                }
            }
            data = dst.iter().flat_map(|v| v.to_le_bytes()).collect();
            shape = vec![o, h, w, c];
        }
        owned.push((rename(&name), shape, data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, &out.path().join("model.safetensors")).unwrap();
    out
}

#[test]
fn other_checkpoint_spellings_give_the_same_logits() {
    for family in ["gemma3", "llava"] {
        let dir = vision_dir().join(family);
        let r = family_reference(&dir);
        // transformers' module paths (`model.language_model.*`, `model.vision_tower.*`, a
        // top-level `lm_head`), and hub / mlx-vlm ones (`vision_tower.vision_model.*`, the
        // patch convolution in MLX's layout).
        let module_paths = |n: &str| {
            if let Some(rest) = n.strip_prefix("language_model.model.") {
                format!("model.language_model.{rest}")
            } else if let Some(rest) = n.strip_prefix("language_model.lm_head") {
                format!("lm_head{rest}")
            } else {
                format!("model.{n}")
            }
        };
        let hub = |n: &str| match n.strip_prefix("vision_tower.") {
            Some(rest) => format!("vision_tower.vision_model.{rest}"),
            None => n.to_string(),
        };
        for (what, copy) in [
            ("module paths", respelled(&dir, module_paths, false)),
            ("hub / mlx-vlm", respelled(&dir, hub, true)),
        ] {
            let loaded = load(copy.path());
            assert!(loaded.model.vision().is_some(), "{family} {what}");
            let images = fixture_images(&loaded, &r);
            let logits = loaded
                .multimodal_logits(&r.prompt_ids, &images)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            let (d, _) = max_abs_diff(&logits, &r.logits);
            assert!(d <= tolerance(&r.logits), "{family} {what}: {d}");
        }
    }
}

#[test]
fn llava_image_processor_pads_to_a_square_when_asked() {
    let dir = vision_dir().join("llava");
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want = f32s(&tensor_bytes(&st, "pixel_values_padded").1);
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, copy.path().join(p.file_name().unwrap())).unwrap();
    }
    let path = copy.path().join("preprocessor_config.json");
    let mut pre: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    pre["image_processor_type"] = json!("LlavaImageProcessor");
    pre["do_pad"] = json!(true);
    std::fs::write(&path, pre.to_string()).unwrap();
    let loaded = load(copy.path());
    let r = family_reference(&dir);
    let got: Vec<f32> = fixture_images(&loaded, &r)
        .iter()
        .flat_map(|i| i.pixels().to_vec())
        .collect();
    let (d, _) = max_abs_diff(&got, &want);
    assert!(d <= 1e-5, "padded pixel values differ by {d}");
    // Without the padding they differ (the images are not square).
    let (d, _) = max_abs_diff(&r.pixel_values, &want);
    assert!(d > 1e-2);
}
