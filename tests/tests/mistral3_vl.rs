//! Mistral 3 with its Pixtral vision tower (issue 21, `Mistral3Dynamic` route) against
//! transformers 5.24.0 (`tests/fixtures/vision/mistral3`, made by
//! `tests/fixtures/make_vision_mistral3.py`):
//!
//! - pixel values after preprocessing vs `PixtralImageProcessor` (PIL backend: fit in
//!   `longest_edge`, rounded up to multiples of patch · merge), and the prompt expansion vs
//!   `PixtralProcessor` (`[IMG]` rows, `[IMG_BREAK]` after each, the last `[IMG_END]`);
//! - logits with one image and with two images of different sizes in one prompt;
//! - the tower lazy until the first image, two images through the tower together
//!   (block-diagonal attention) as each alone;
//! - an image's span covering its break markers (prefix reuse, chunked prefill);
//! - the transformers-5 tensor names and the MLX conv layout;
//! - text-only loads (no tower tensors, `language_model_only`) and the image-refusal message.

use std::path::{Path, PathBuf};

use mlxcel_arch::vision::{ImageInput, MultimodalPrompt};
use mlxcel_arch::{GenerationModel, LanguageModel};
use mlxcel_loading::image::load_image;
use mlxcel_loading::vision::PreparedImage;
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::max_abs_diff;
use safetensors::SafeTensors;
use serde_json::{json, Value};

const IMG: u32 = 512;
const IMG_BREAK: u32 = 513;
const IMG_END: u32 = 514;

fn dir() -> PathBuf {
    mlxcel_tests::fixtures_dir().join("vision").join("mistral3")
}

fn image_path(name: &str) -> PathBuf {
    mlxcel_tests::fixtures_dir()
        .join("vision")
        .join("images")
        .join(name)
}

struct Reference {
    st: Vec<u8>,
    meta: Value,
}

impl Reference {
    fn load() -> Reference {
        Reference {
            st: std::fs::read(dir().join("reference.safetensors")).expect("reference"),
            meta: serde_json::from_str(
                &std::fs::read_to_string(dir().join("reference.json")).expect("meta"),
            )
            .expect("json"),
        }
    }

    fn raw(&self, name: &str) -> (Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.st).expect("safetensors");
        let t = st
            .tensor(name)
            .unwrap_or_else(|e| panic!("reference tensor {name}: {e}"));
        (t.shape().to_vec(), t.data().to_vec())
    }

    fn f32s(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (shape, b) = self.raw(name);
        let v = b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        (shape, v)
    }

    fn ids(&self, name: &str) -> Vec<u32> {
        self.raw(name)
            .1
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    }

    fn images(&self, key: &str) -> Vec<String> {
        self.meta[key]
            .as_array()
            .expect("images")
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
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

fn prepared(loaded: &Loaded, names: &[String]) -> Vec<PreparedImage> {
    names
        .iter()
        .map(|n| {
            let image = load_image(image_path(n)).expect("image");
            loaded.prepare_for_prompt(&image).expect("prepare")
        })
        .collect()
}

fn inputs(p: &[PreparedImage]) -> Vec<ImageInput> {
    p.iter().flat_map(|p| p.inputs.clone()).collect()
}

/// The expanded ids with each image's rows collapsed back to one `[IMG]`.
fn unexpanded(full: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut in_image = false;
    for &t in full {
        match (in_image, t) {
            (false, IMG) => {
                out.push(IMG);
                in_image = true;
            }
            (true, IMG_END) => in_image = false,
            (true, _) => {}
            (false, t) => out.push(t),
        }
    }
    out
}

#[test]
fn pixel_values_and_expanded_ids_match_the_pixtral_processor() {
    let r = Reference::load();
    let loaded = load(&dir());
    // One image: gradient.png (61x45) shrunk to 32x23, rounded up to 32x24.
    let one = prepared(&loaded, &r.images("images1"));
    let (shape, want) = r.f32s("pixel_values1");
    assert_eq!(one[0].inputs[0].shape(), [1, 3, 24, 32]);
    assert_eq!(shape, vec![1, 3, 24, 32]);
    let (d, _) = max_abs_diff(one[0].inputs[0].pixels(), &want);
    assert!(d <= 1e-5, "pixel values differ by {d}");
    let full = r.ids("prompt1_ids");
    assert_eq!(
        loaded
            .expand_image_tokens_for(&unexpanded(&full), &one)
            .unwrap(),
        full
    );
    // 3 rows of 4 merged patches: `[IMG]`×4 `[IMG_BREAK]` ×2, then `[IMG]`×4 `[IMG_END]`.
    let mut row = vec![IMG; 4];
    row.push(IMG_BREAK);
    let mut want_ids = [row.clone(), row.clone(), row].concat();
    *want_ids.last_mut().unwrap() = IMG_END;
    assert_eq!(one[0].expansion_ids, want_ids);
    // The text expansion tokenises to the same ids.
    let text = loaded.expand_prompt_text_for("[IMG]", &one).unwrap();
    assert!(
        text.starts_with("[IMG][IMG][IMG][IMG][IMG_BREAK]"),
        "{text}"
    );
    let tokenizer = loaded.tokenizer.as_ref().unwrap();
    assert_eq!(tokenizer.encode(&text, false).unwrap(), want_ids);

    // Two images of different sizes: the processor pads its batch to the larger size,
    // image_sizes gives each one's own; compare each image's own region.
    let two = prepared(&loaded, &r.images("images2"));
    let (shape, padded) = r.f32s("pixel_values2");
    let sizes = r.ids("image_sizes2");
    let (ph, pw) = (shape[2], shape[3]);
    for (k, p) in two.iter().enumerate() {
        let (h, w) = (sizes[2 * k] as usize, sizes[2 * k + 1] as usize);
        assert_eq!(p.inputs[0].shape(), [1, 3, h, w], "image {k}");
        let mut want = Vec::with_capacity(3 * h * w);
        for c in 0..3 {
            for y in 0..h {
                let at = ((k * 3 + c) * ph + y) * pw;
                want.extend_from_slice(&padded[at..at + w]);
            }
        }
        let (d, _) = max_abs_diff(p.inputs[0].pixels(), &want);
        assert!(d <= 1e-5, "image {k}: pixel values differ by {d}");
    }
    let full = r.ids("prompt2_ids");
    assert_eq!(
        loaded
            .expand_image_tokens_for(&unexpanded(&full), &two)
            .unwrap(),
        full
    );
}

#[test]
fn logits_with_one_and_two_images_match_transformers_and_the_tower_is_lazy() {
    let r = Reference::load();
    let loaded = load(&dir());
    let GenerationModel::Mistral3(model) = &loaded.model else {
        panic!("a Mistral3 model");
    };
    assert!(matches!(
        model.text_tower(),
        mlxcel_arch::models::mistral3::Text::Ministral3(_)
    ));
    let tower = model.tower().expect("loaded with its tower");
    assert!(
        !tower.materialized(),
        "the tower is built at the first image"
    );
    // Text only: no image, the tower stays unread.
    let logits = mlxcel_tests::logits_for(&loaded.model, &r.ids("text_prompt_ids"));
    let (_, want) = r.f32s("text_logits");
    let (d, _) = max_abs_diff(&logits, &want);
    assert!(d <= tolerance(&want), "text logits differ by {d}");
    assert!(!tower.materialized());

    for (images, prompt, logits) in [
        ("images1", "prompt1_ids", "logits1"),
        ("images2", "prompt2_ids", "logits2"),
    ] {
        let p = prepared(&loaded, &r.images(images));
        let got = loaded
            .multimodal_logits(&r.ids(prompt), &inputs(&p))
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let (_, want) = r.f32s(logits);
        assert_eq!(got.len(), want.len(), "{prompt}");
        let (d, _) = max_abs_diff(&got, &want);
        assert!(d <= tolerance(&want), "{prompt}: logits differ by {d}");
    }
    assert!(tower.materialized());

    // Both images through the tower at once (block-diagonal attention) give each image's
    // features alone.
    let p = inputs(&prepared(&loaded, &r.images("images2")));
    let built = tower.get().unwrap();
    let together = built.features(&p).unwrap();
    for (k, image) in p.iter().enumerate() {
        let alone = built.features(std::slice::from_ref(image)).unwrap();
        let (d, _) = max_abs_diff(
            &together[k].to_vec::<f32>().unwrap(),
            &alone[0].to_vec::<f32>().unwrap(),
        );
        assert!(d <= 1e-4, "image {k}: batched features differ by {d}");
    }
}

#[test]
fn an_image_span_covers_its_breaks_for_reuse_and_chunking() {
    let r = Reference::load();
    let loaded = load(&dir());
    let vision = loaded.model.vision().unwrap();
    let full = r.ids("prompt1_ids");
    let p = inputs(&prepared(&loaded, &r.images("images1")));
    let mm = MultimodalPrompt::new(vision, &full, &p).unwrap();
    let first = full.iter().position(|t| *t == IMG).unwrap();
    let end = full.iter().position(|t| *t == IMG_END).unwrap() + 1;
    assert_eq!(mm.runs().len(), 1);
    assert_eq!(mm.runs()[0], first..end);
    assert_eq!(
        mm.feature_runs()[0],
        vec![
            first..first + 4,
            first + 5..first + 9,
            first + 10..first + 14
        ]
    );
    // Identity keys: every position of the span is keyed by the image, breaks included.
    let keys = mm.identity_keys();
    assert!(keys[first..end].iter().all(|k| *k >= 1 << 63));
    assert!(keys[..first].iter().all(|k| *k < 1 << 32));

    let (_, want) = r.f32s("logits1");
    let vocab = loaded.model.vocab_size();
    let last = &want[want.len() - vocab..];
    // Chunked prefill never splits the image and gives the same last logits.
    for chunk in [1, 4, 7, 64] {
        let mut s = loaded.session();
        let (_, logits) = s.prefill_multimodal(&full, &p, Some(chunk)).unwrap();
        let (d, _) = max_abs_diff(&logits.to_vec::<f32>().unwrap(), last);
        assert!(d <= tolerance(last), "chunk {chunk}: {d}");
    }
    // The same prompt again reuses all but the last token; another image of the same size
    // (lossless.webp, 36x24 → 32x24 like gradient.png: the same ids) reuses nothing of it.
    let mut s = loaded.session();
    s.prefill_multimodal(&full, &p, None).unwrap();
    let (reused, _) = s.prefill_multimodal(&full, &p, None).unwrap();
    assert_eq!(reused, full.len() - 1);
    let other = inputs(&prepared(&loaded, &["lossless.webp".to_string()]));
    assert_eq!(other[0].shape(), p[0].shape());
    let (reused, logits) = s.prefill_multimodal(&full, &other, None).unwrap();
    assert!(reused <= first, "reuse must stop at the image ({reused})");
    let (_, fresh) = loaded
        .session()
        .prefill_multimodal(&full, &other, None)
        .unwrap();
    let fresh = fresh.to_vec::<f32>().unwrap();
    let (d, _) = max_abs_diff(&logits.to_vec::<f32>().unwrap(), &fresh);
    assert!(d <= tolerance(&fresh));
    assert!(
        max_abs_diff(&fresh, last).0 > 1e-3,
        "another image must change the logits"
    );

    // A row without its break is refused, naming the image and the row.
    let mut broken = full.clone();
    broken[first + 4] = IMG;
    let err = MultimodalPrompt::new(vision, &broken, &p)
        .unwrap_err()
        .to_string();
    assert!(err.contains("image 0 needs 3 rows of 4"), "{err}");
}

/// The fixture's tensors renamed by `rename` (the patch convolution transposed to MLX's
/// `[out, kh, kw, in]` layout when `mlx_conv`; tensors for which `rename` gives `None`
/// dropped), in a copy of the folder.
fn respelled(rename: impl Fn(&str) -> Option<String>, mlx_conv: bool) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(dir()).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, out.path().join(p.file_name().unwrap())).unwrap();
    }
    let bytes = std::fs::read(dir().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in st.tensors() {
        let Some(new) = rename(&name) else {
            continue;
        };
        let (mut shape, mut data) = (t.shape().to_vec(), t.data().to_vec());
        if mlx_conv && name.ends_with("patch_conv.weight") {
            let (o, c, h, w) = (shape[0], shape[1], shape[2], shape[3]);
            let src: Vec<f32> = data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
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
        owned.push((new, shape, data));
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
fn transformers5_names_and_the_mlx_conv_layout_give_the_same_logits() {
    let r = Reference::load();
    // transformers 5's module paths: `model.language_model.*`, a top-level `lm_head`,
    // `model.vision_tower.*`, `model.multi_modal_projector.*`.
    let module_paths = |n: &str| {
        Some(
            if let Some(rest) = n.strip_prefix("language_model.model.") {
                format!("model.language_model.{rest}")
            } else if let Some(rest) = n.strip_prefix("language_model.lm_head") {
                format!("lm_head{rest}")
            } else {
                format!("model.{n}")
            },
        )
    };
    for (what, copy) in [
        ("module paths", respelled(module_paths, false)),
        ("mlx conv layout", respelled(|n| Some(n.to_string()), true)),
    ] {
        let loaded = load(copy.path());
        assert!(loaded.model.vision().is_some(), "{what}");
        let p = inputs(&prepared(&loaded, &r.images("images2")));
        let got = loaded
            .multimodal_logits(&r.ids("prompt2_ids"), &p)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let (_, want) = r.f32s("logits2");
        let (d, _) = max_abs_diff(&got, &want);
        assert!(d <= tolerance(&want), "{what}: {d}");
    }
}

#[test]
fn text_only_loads_and_the_image_refusal() {
    let r = Reference::load();
    let (_, want) = r.f32s("text_logits");
    let no_tower = respelled(
        |n| {
            (!n.starts_with("vision_tower.") && !n.starts_with("multi_modal_projector."))
                .then(|| n.to_string())
        },
        false,
    );
    let language_only = respelled(|n| Some(n.to_string()), false);
    let path = language_only.path().join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["language_model_only"] = json!(true);
    std::fs::write(&path, config.to_string()).unwrap();
    for (what, copy, left_out) in [
        ("no tower tensors", &no_tower, false),
        ("language_model_only", &language_only, true),
    ] {
        let loaded = load(copy.path());
        let GenerationModel::Mistral3(model) = &loaded.model else {
            panic!("a Mistral3 model");
        };
        assert!(model.tower().is_none(), "{what}");
        assert!(loaded.model.vision().is_none(), "{what}");
        let report = loaded.surgery_applied.join("\n");
        assert_eq!(
            report.contains("vision-tower and projector tensors left out"),
            left_out,
            "{what}: {report}"
        );
        let logits = mlxcel_tests::logits_for(&loaded.model, &r.ids("text_prompt_ids"));
        let (d, _) = max_abs_diff(&logits, &want);
        assert!(d <= tolerance(&want), "{what}: {d}");
        let message = format!(
            "model {} was loaded without a vision tower (text-only checkpoint)",
            copy.path().display()
        );
        let bytes = std::fs::read(image_path("gradient.png")).unwrap();
        assert_eq!(
            loaded.prepare_image_bytes(&bytes).unwrap_err().to_string(),
            message,
            "{what}"
        );
        let full = load(&dir());
        let p = inputs(&prepared(&full, &r.images("images1")));
        let err = loaded
            .session()
            .prefill_multimodal(&r.ids("prompt1_ids"), &p, None)
            .unwrap_err()
            .to_string();
        assert_eq!(err, message, "{what}");
    }
}

#[test]
fn processor_settings_are_checked() {
    // A tokenizer without `[IMG_BREAK]` cannot expand a prompt: the load names the token.
    let copy = respelled(|n| Some(n.to_string()), false);
    std::fs::write(
        copy.path().join("processor_config.json"),
        json!({"patch_size": 4, "spatial_merge_size": 2, "image_break_token": "[BRK]"}).to_string(),
    )
    .unwrap();
    let err = load_model(copy.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("[BRK]"), "{err}");
    assert!(err.contains("language_model_only"), "{err}");
    // A processor whose merge differs from the model's is refused.
    std::fs::write(
        copy.path().join("processor_config.json"),
        json!({"patch_size": 4, "spatial_merge_size": 1}).to_string(),
    )
    .unwrap();
    let err = load_model(copy.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("spatial_merge_size 1"), "{err}");
}

#[test]
fn bad_vision_configs_and_tensors_are_refused_naming_them() {
    let edit = |f: &dyn Fn(&mut Value)| {
        let copy = respelled(|n| Some(n.to_string()), false);
        let path = copy.path().join("config.json");
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        f(&mut config);
        std::fs::write(&path, config.to_string()).unwrap();
        load_model(copy.path(), &LoadOptions::default())
            .unwrap_err()
            .to_string()
    };
    let err = edit(&|c| c["vision_feature_layer"] = json!([-1, -2]));
    assert!(err.contains("vision_feature_layer"), "{err}");
    let err = edit(&|c| c["vision_feature_layer"] = json!(5));
    assert!(err.contains("vision_feature_layer = 5"), "{err}");
    let err = edit(&|c| c["vision_config"]["hidden_act"] = json!("swishy"));
    assert!(err.contains("vision_config.hidden_act"), "{err}");
    let err = edit(&|c| c["projector_hidden_act"] = json!("swishy"));
    assert!(err.contains("projector_hidden_act"), "{err}");
    // A missing projector tensor is named at load, before any image.
    let copy = respelled(
        |n| (n != "multi_modal_projector.norm.weight").then(|| n.to_string()),
        false,
    );
    let err = load_model(copy.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("multi_modal_projector.norm.weight"), "{err}");
}
