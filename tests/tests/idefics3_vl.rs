//! Idefics3 / SmolVLM against transformers 5.24 (f32), through the `Vlm` route, on the tiny
//! fixture `tests/fixtures/vision/idefics3` (made by `tests/fixtures/make_vision_idefics3.py`
//! with transformers' own classes and `AutoProcessor`): the processor's tiles and pixel values
//! from the committed images (image splitting on, and off), its prompt expansion (ids and
//! text), logits over a prompt with two split images, greedy decoding after them, the SigLIP
//! tower's NaViT entry with padded patches, the `smolvlm` model type, the mlx-vlm layout and the
//! text-only rules.

use mlxcel_arch::models::idefics3;
use mlxcel_arch::vision::siglip::navit_position_ids;
use mlxcel_arch::vision::{forward_multimodal, FeatureCache, ImageInput, MultimodalPrompt};
use mlxcel_arch::{GenerationModel, LanguageModel};
use mlxcel_core::{Array, WeightMap};
use mlxcel_loading::image::load_image;
use mlxcel_loading::vision::PreparedImage;
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::{fixtures_dir, max_abs_diff};
use safetensors::SafeTensors;
use serde_json::Value;

/// `<fake_token_around_image>`, `<image>`.
const FAKE: u32 = 512;
const IMAGE: u32 = 513;

fn model_dir() -> std::path::PathBuf {
    fixtures_dir().join("vision").join("idefics3")
}

fn copy_fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model_dir()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

/// The fixture's goldens.
struct Golden {
    st: Vec<u8>,
    meta: Value,
}

impl Golden {
    fn load() -> Golden {
        let dir = model_dir();
        Golden {
            st: std::fs::read(dir.join("reference.safetensors")).unwrap(),
            meta: serde_json::from_str(
                &std::fs::read_to_string(dir.join("reference.json")).unwrap(),
            )
            .unwrap(),
        }
    }

    fn raw(&self, name: &str) -> (Vec<usize>, Vec<[u8; 4]>) {
        let st = SafeTensors::deserialize(&self.st).unwrap();
        let t = st.tensor(name).unwrap();
        (
            t.shape().to_vec(),
            t.data()
                .chunks_exact(4)
                .map(|b| [b[0], b[1], b[2], b[3]])
                .collect(),
        )
    }

    fn f32s(&self, name: &str) -> Vec<f32> {
        self.raw(name)
            .1
            .into_iter()
            .map(f32::from_le_bytes)
            .collect()
    }

    fn ids(&self, name: &str) -> Vec<u32> {
        self.raw(name)
            .1
            .into_iter()
            .map(|b| i32::from_le_bytes(b) as u32)
            .collect()
    }

    /// The processor's pixel values as one [`ImageInput`] per tile (so the model is checked
    /// apart from the resize).
    fn tiles(&self, name: &str) -> Vec<ImageInput> {
        let (shape, _) = self.raw(name);
        let values = self.f32s(name);
        let per = shape[1..].iter().product::<usize>();
        values
            .chunks_exact(per)
            .enumerate()
            .map(|(k, v)| {
                ImageInput::new(v.to_vec(), [1, shape[1], shape[2], shape[3]], k as u64).unwrap()
            })
            .collect()
    }
}

fn load(dir: &std::path::Path) -> Loaded {
    load_model(dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn idefics(model: &GenerationModel) -> &idefics3::Model {
    match model {
        GenerationModel::Idefics3(m) => m,
        other => panic!("expected an Idefics3 model, got {other:?}"),
    }
}

fn to_vec(a: &Array) -> Vec<f32> {
    a.astype(mlxcel_core::Dtype::Float32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
}

fn bound(want: &[f32]) -> f32 {
    let biggest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    2e-4f32.max(2e-5 * biggest)
}

/// `ids` with each image's expansion (from a `<fake_token_around_image>` that opens it to the
/// one that closes its global image) collapsed back to one `<image>`, as a caller holding
/// unexpanded ids has it.
fn unexpanded(ids: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        if ids[i] == FAKE {
            // The global image's tag (515) is followed by its run and the closing FAKE.
            let global = (i..ids.len()).find(|&j| ids[j] == 515).unwrap();
            let close = (global..ids.len()).find(|&j| ids[j] == FAKE).unwrap();
            out.push(IMAGE);
            i = close + 1;
        } else {
            out.push(ids[i]);
            i += 1;
        }
    }
    out
}

fn prepared(loaded: &Loaded, paths: &[&str]) -> Vec<PreparedImage> {
    paths
        .iter()
        .map(|p| {
            let img = load_image(fixtures_dir().join(p)).unwrap();
            loaded.prepare_for_prompt(&img).unwrap()
        })
        .collect()
}

fn image_paths(g: &Golden) -> Vec<String> {
    g.meta["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

/// All-position logits of the expanded prompt, prefilled in chunks of `chunk` positions.
fn prompt_logits(loaded: &Loaded, ids: &[u32], images: &[ImageInput], chunk: usize) -> Vec<f32> {
    let model = &loaded.model;
    let vision = model.vision().expect("a vision tower");
    let mm = MultimodalPrompt::new(vision, ids, images).unwrap();
    let mut caches = model.make_caches();
    let mut features = FeatureCache::default();
    let mut out = Vec::new();
    let mut start = 0;
    while start < ids.len() {
        let end = (start + chunk).min(ids.len());
        let logits =
            forward_multimodal(vision, &mm, start..end, &mut features, &mut caches, false).unwrap();
        out.extend(to_vec(&logits));
        start = end;
    }
    out
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (diff, at) = max_abs_diff(got, want);
    let b = bound(want);
    assert!(diff <= b, "{what}: max |Δ| {diff:.2e} > {b:.2e} at {at}");
    eprintln!("{what}: max |Δ| {diff:.2e}");
}

#[test]
fn tiles_pixel_values_and_expansion_match_the_processor() {
    let g = Golden::load();
    let loaded = load(&model_dir());
    let paths = image_paths(&g);
    let paths: Vec<&str> = paths.iter().map(String::as_str).collect();
    let prepared = prepared(&loaded, &paths);
    // gradient.png (61x45) → 64x64: 2x2 tiles + global; grey.png (17x33) → 64x32: 2x1 + global.
    let counts: Vec<usize> = prepared.iter().map(|p| p.inputs.len()).collect();
    assert_eq!(counts, [5, 3]);
    let got: Vec<f32> = prepared
        .iter()
        .flat_map(|p| p.inputs.iter().flat_map(|i| i.pixels().to_vec()))
        .collect();
    let (diff, at) = max_abs_diff(&got, &g.f32s("pixel_values"));
    assert!(diff <= 1e-6, "pixel values max |Δ| {diff:.2e} at {at}");
    // Every tile is whole: the processor's pixel_attention_mask is all ones, which is what the
    // tower assumes of an `ImageInput` tile.
    assert!(g.ids("pixel_attention_mask").iter().all(|m| *m == 1));

    let want = g.ids("prompt_ids");
    let collapsed = unexpanded(&want);
    assert_eq!(collapsed.iter().filter(|t| **t == IMAGE).count(), 2);
    let expanded = loaded
        .expand_image_tokens_for(&collapsed, &prepared)
        .unwrap();
    assert_eq!(expanded, want, "expanded ids");
    // ... and in text: the chat template's output expanded, then tokenised (what
    // Idefics3Processor does).
    let text = g.meta["prompt_text"].as_str().unwrap();
    let text = loaded.expand_prompt_text_for(text, &prepared).unwrap();
    let tok = loaded.tokenizer.as_ref().unwrap();
    assert_eq!(tok.encode(&text, false).unwrap(), want, "expanded text");
    // The rendered chat prompt itself (the template from chat_template.jinja).
    assert_eq!(
        loaded
            .user_content_with_images("The river flows past the old mill.", 1)
            .unwrap(),
        "<image>The river flows past the old mill."
    );
    assert!(loaded
        .expand_image_tokens_for(&collapsed, &prepared[..1])
        .is_err());
    // Each tile is one run of image_seq_len (4) image tokens.
    let vision = loaded.model.vision().unwrap();
    for p in &prepared {
        for i in &p.inputs {
            assert_eq!(vision.image_token_count(i).unwrap(), 4);
        }
    }
    // A multi-tile image has no single input.
    let img = load_image(fixtures_dir().join(paths[0])).unwrap();
    let err = loaded.prepare_image(&img).unwrap_err().to_string();
    assert!(err.contains("do_image_splitting"), "{err}");

    // The whole chain, images to logits.
    let inputs: Vec<ImageInput> = prepared.iter().flat_map(|p| p.inputs.clone()).collect();
    let logits = prompt_logits(&loaded, &want, &inputs, want.len());
    assert_close(&logits, &g.f32s("logits"), "logits from the images");
}

/// `do_image_splitting: false`: the image resized to one tile, the global expansion alone.
#[test]
fn without_image_splitting_one_tile_matches_the_processor() {
    let g = Golden::load();
    let dir = copy_fixture();
    let path = dir.path().join("processor_config.json");
    let mut pc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    pc["image_processor"]["do_image_splitting"] = Value::Bool(false);
    std::fs::write(&path, pc.to_string()).unwrap();
    let loaded = load(dir.path());
    let img = load_image(fixtures_dir().join(g.meta["nosplit_image"].as_str().unwrap())).unwrap();
    let p = loaded.prepare_for_prompt(&img).unwrap();
    assert_eq!(p.inputs.len(), 1);
    let (diff, at) = max_abs_diff(p.inputs[0].pixels(), &g.f32s("nosplit_pixel_values"));
    assert!(diff <= 1e-6, "pixel values max |Δ| {diff:.2e} at {at}");
    // One tile: `prepare_image` gives it too.
    assert_eq!(
        loaded.prepare_image(&img).unwrap().pixels(),
        p.inputs[0].pixels()
    );
    let want = g.ids("nosplit_prompt_ids");
    let prepared = [p];
    let expanded = loaded
        .expand_image_tokens_for(&unexpanded(&want), &prepared)
        .unwrap();
    assert_eq!(expanded, want);
    let text = g.meta["nosplit_prompt_text"].as_str().unwrap();
    let text = loaded.expand_prompt_text_for(text, &prepared).unwrap();
    let tok = loaded.tokenizer.as_ref().unwrap();
    assert_eq!(tok.encode(&text, false).unwrap(), want);
    let logits = prompt_logits(&loaded, &want, &prepared[0].inputs, want.len());
    assert_close(&logits, &g.f32s("nosplit_logits"), "no-split logits");
}

#[test]
fn image_prompts_match_transformers() {
    let g = Golden::load();
    let loaded = load(&model_dir());
    let model = idefics(&loaded.model);
    assert!(!model.tower().unwrap().materialized(), "lazy tower");
    let ids = g.ids("prompt_ids");
    let tiles = g.tiles("pixel_values");
    assert_eq!(tiles.len(), 8);
    let want = g.f32s("logits");
    for chunk in [ids.len(), 1, 7, 30] {
        let logits = prompt_logits(&loaded, &ids, &tiles, chunk);
        assert_close(&logits, &want, &format!("prefill chunk {chunk}"));
    }
    assert!(model.tower().unwrap().materialized());
    let greedy_want = g.ids("greedy_ids");
    let steps_want = g.f32s("greedy_logits");
    let vocab = steps_want.len() / greedy_want.len();
    for chunk in [None, Some(5)] {
        let mut s = loaded.session();
        let (_, mut logits) = s.prefill_multimodal(&ids, &tiles, chunk).unwrap();
        let mut greedy = Vec::new();
        let mut steps = to_vec(&logits);
        for i in 0..greedy_want.len() {
            let next = mlxcel_arch::generate::argmax_token(&logits).unwrap();
            greedy.push(next);
            if i + 1 < greedy_want.len() {
                logits = s.step(next).unwrap();
                steps.extend(to_vec(&logits));
            }
        }
        assert_eq!(greedy, greedy_want, "greedy after the images ({chunk:?})");
        assert_eq!(steps.len(), greedy_want.len() * vocab);
        assert_close(&steps, &steps_want, &format!("decode logits ({chunk:?})"));
    }
    // Image count mismatches are refused.
    let mut s = loaded.session();
    let err = s
        .prefill_multimodal(&ids, &tiles[..7], None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("image"), "{err}");
}

/// `Idefics3VisionEmbeddings`' bucketed position ids, transformers' values (torch 2.15 CPU):
/// at 29 and 19 patches per side a whole image's ids repeat some values.
#[test]
fn navit_position_ids_match_torch() {
    let cases: [(usize, usize, usize, &[usize]); 8] = [
        (4, 4, 4, &[0, 1, 2, 3]),
        (4, 2, 4, &[0, 2, 3, 3]),
        (
            29,
            29,
            29,
            &[
                0, 1, 2, 2, 4, 5, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
                23, 23, 25, 26, 27, 28,
            ],
        ),
        (
            32,
            32,
            32,
            &[
                0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
                23, 24, 25, 26, 27, 28, 29, 30, 31,
            ],
        ),
        (
            27,
            27,
            27,
            &[
                0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
                23, 24, 25, 26,
            ],
        ),
        (
            26,
            17,
            26,
            &[
                0, 1, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19, 21, 22, 24, 25, 25, 25, 25, 25,
                25, 25, 25, 25,
            ],
        ),
        (
            19,
            19,
            19,
            &[
                0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 13, 14, 15, 16, 17, 18,
            ],
        ),
        (
            31,
            12,
            31,
            &[
                0, 2, 5, 7, 10, 12, 15, 18, 20, 23, 25, 28, 30, 30, 30, 30, 30, 30, 30, 30, 30, 30,
                30, 30, 30, 30, 30, 30, 30, 30, 30,
            ],
        ),
    ];
    for (per_side, real, grid, want) in cases {
        assert_eq!(
            navit_position_ids(real, grid, per_side),
            want,
            "{per_side} per side, {real} of {grid}"
        );
    }
}

/// The tower alone on inputs whose bottom / right patches are padding (the processor's
/// `pixel_attention_mask`): position ids from the real extent, padded keys masked.
#[test]
fn navit_tower_with_padded_patches_matches_transformers() {
    let g = Golden::load();
    let loaded = load(&model_dir());
    let tower = idefics(&loaded.model).tower().unwrap().get().unwrap();
    let (shape, _) = g.raw("navit_pixels");
    let shape: Vec<i32> = shape.iter().map(|d| *d as i32).collect();
    let pixels = Array::from_slice(&g.f32s("navit_pixels"), &shape).unwrap();
    let valid: Vec<(usize, usize)> = g.meta["navit_valid_patches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v[0].as_u64().unwrap() as usize,
                v[1].as_u64().unwrap() as usize,
            )
        })
        .collect();
    let got = to_vec(&tower.siglip().forward_navit(&pixels, &valid).unwrap());
    assert_close(&got, &g.f32s("navit_hidden"), "NaViT tower");
    assert!(tower.siglip().forward_navit(&pixels, &valid[..1]).is_err());
    assert!(tower
        .siglip()
        .forward_navit(&pixels, &[(5, 1), (4, 4)])
        .is_err());
}

fn edit_config(dir: &std::path::Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(config.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

/// `model_type: smolvlm` (SmolVLMForConditionalGeneration, the same network; the generator
/// asserts transformers' logits agree) loads through the same row.
#[test]
fn smolvlm_model_type_runs_the_same_network() {
    let g = Golden::load();
    let dir = copy_fixture();
    edit_config(dir.path(), |c| {
        c.insert("model_type".into(), "smolvlm".into());
        c.insert(
            "architectures".into(),
            serde_json::json!(["SmolVLMForConditionalGeneration"]),
        );
        c["vision_config"]["model_type"] = "smolvlm_vision".into();
    });
    let loaded = load(dir.path());
    assert_eq!(loaded.model.model_type(), mlxcel_arch::ModelType::Idefics3);
    let ids = g.ids("prompt_ids");
    let paths = image_paths(&g);
    let paths: Vec<&str> = paths.iter().map(String::as_str).collect();
    let inputs: Vec<ImageInput> = prepared(&loaded, &paths)
        .into_iter()
        .flat_map(|p| p.inputs)
        .collect();
    let logits = prompt_logits(&loaded, &ids, &inputs, ids.len());
    assert_close(&logits, &g.f32s("logits"), "smolvlm logits");
}

/// Rewrites the fixture's tensors (names, and the channels-last patch kernel of mlx-vlm).
fn relayout(dir: &std::path::Path, rename: impl Fn(&str) -> String, channels_last: bool) {
    let map = WeightMap::open(dir).unwrap();
    let mut out: Vec<(String, Array)> = Vec::new();
    for name in map.names() {
        let mut a = map.get(name).unwrap();
        if channels_last && name.ends_with("patch_embedding.weight") {
            a = a.transpose(&[0, 2, 3, 1]).unwrap().contiguous().unwrap();
        }
        out.push((rename(name), a));
    }
    drop(map);
    mlxcel_core::weights::save_safetensors(dir.join("model.safetensors"), &out, None).unwrap();
}

#[test]
fn the_mlx_vlm_layout_loads_alike() {
    let g = Golden::load();
    let dir = copy_fixture();
    relayout(
        dir.path(),
        |n| {
            if let Some(rest) = n.strip_prefix("model.text_model.") {
                format!("language_model.model.{rest}")
            } else if let Some(rest) = n.strip_prefix("lm_head.") {
                format!("language_model.lm_head.{rest}")
            } else if let Some(rest) = n.strip_prefix("model.") {
                rest.to_string()
            } else {
                n.to_string()
            }
        },
        true,
    );
    let loaded = load(dir.path());
    let ids = g.ids("prompt_ids");
    let logits = prompt_logits(&loaded, &ids, &g.tiles("pixel_values"), ids.len());
    assert_close(&logits, &g.f32s("logits"), "mlx-vlm layout");
}

/// A change to a copied fixture folder.
type Edit = dyn Fn(&std::path::Path);

/// The text-only rules: `vision_config` missing, null or empty, `language_model_only: true`
/// (vision weights present), or no `model.vision_model.*` / `model.connector.*` tensors. Each
/// loads the decoder alone, matches transformers on text, and refuses an image with the seed's
/// message.
#[test]
fn text_only_rules() {
    let g = Golden::load();
    let with_tower = load(&model_dir());
    assert!(with_tower.model.vision().is_some());
    let ids = g.ids("prompt_ids");
    let tiles = g.tiles("pixel_values");
    let cases: Vec<(&str, Box<Edit>)> = vec![
        (
            "no vision_config",
            Box::new(|d| {
                edit_config(d, |c| {
                    c.remove("vision_config");
                })
            }),
        ),
        (
            "vision_config null",
            Box::new(|d| edit_config(d, |c| drop(c.insert("vision_config".into(), Value::Null)))),
        ),
        (
            "vision_config {}",
            Box::new(|d| {
                edit_config(d, |c| {
                    c.insert("vision_config".into(), serde_json::json!({}));
                })
            }),
        ),
        (
            "language_model_only",
            Box::new(|d| {
                edit_config(d, |c| {
                    c.insert("language_model_only".into(), Value::Bool(true));
                })
            }),
        ),
        (
            "no vision weights",
            Box::new(|d| {
                let map = WeightMap::open(d).unwrap();
                let keep: Vec<(String, Array)> = map
                    .names()
                    .filter(|n| {
                        !n.starts_with("model.vision_model.") && !n.starts_with("model.connector.")
                    })
                    .map(|n| (n.to_string(), map.get(n).unwrap()))
                    .collect();
                drop(map);
                mlxcel_core::weights::save_safetensors(d.join("model.safetensors"), &keep, None)
                    .unwrap();
            }),
        ),
    ];
    let text_ids: Vec<i32> = g.ids("text_ids").iter().map(|t| *t as i32).collect();
    for (case, edit) in cases {
        let dir = copy_fixture();
        edit(dir.path());
        let loaded = load(dir.path());
        let model = idefics(&loaded.model);
        assert!(
            model.tower().is_none() && loaded.model.vision().is_none() && loaded.vision.is_none(),
            "{case}"
        );
        if case == "language_model_only" {
            // The tensors left out are named.
            assert!(
                loaded.surgery_applied.iter().any(|l| l.contains(
                    "vision-tower and projector tensors left out (model.connector.modality_projection.proj.weight"
                )),
                "{:?}",
                loaded.surgery_applied
            );
        }
        let tokens = Array::from_slice(&text_ids, &[1, text_ids.len() as i32]).unwrap();
        let logits = to_vec(
            &loaded
                .model
                .forward(&tokens, &mut loaded.model.make_caches())
                .unwrap(),
        );
        assert_close(&logits, &g.f32s("text_logits"), &format!("{case}: text"));
        let err = loaded
            .session()
            .prefill_multimodal(&ids, &tiles, None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "model {} was loaded without a vision tower (text-only checkpoint)",
                loaded.folder.display()
            ),
            "{case}"
        );
    }
}

/// A vision config the connector cannot fold is refused at load, naming the field; so is a
/// tower missing a tensor, and a tile that is not a whole number of connector blocks.
#[test]
fn bad_configs_tensors_and_tiles_are_refused() {
    let dir = copy_fixture();
    edit_config(dir.path(), |c| {
        c.insert("scale_factor".into(), serde_json::json!(3));
    });
    let err = load_model(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("scale_factor"), "{err}");

    let dir = copy_fixture();
    let map = WeightMap::open(dir.path()).unwrap();
    let gone = "model.vision_model.encoder.layers.1.mlp.fc1.weight";
    let keep: Vec<(String, Array)> = map
        .names()
        .filter(|n| *n != gone)
        .map(|n| (n.to_string(), map.get(n).unwrap()))
        .collect();
    drop(map);
    mlxcel_core::weights::save_safetensors(dir.path().join("model.safetensors"), &keep, None)
        .unwrap();
    let err = load_model(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("vision_model.encoder.layers.1.mlp.fc1.weight"),
        "{err}"
    );

    let loaded = load(&model_dir());
    let vision = loaded.model.vision().unwrap();
    let odd = ImageInput::new(vec![0.0; 3 * 24 * 24], [1, 3, 24, 24], 1).unwrap();
    let err = vision.image_token_count(&odd).unwrap_err().to_string();
    assert!(err.contains("multiple of patch_size"), "{err}");
    let two = ImageInput::new(vec![0.0; 2 * 3 * 32 * 32], [2, 3, 32, 32], 1).unwrap();
    assert!(vision.image_token_count(&two).is_err());
}

/// `mlxcel_models::Model` with `Generation::images`: the ids prompt holds `<image>` once per
/// image and each is expanded into its tiles' framed runs; greedy ids equal transformers'.
#[test]
fn the_high_level_model_takes_split_images() {
    use mlxcel_models::{Generation, Model};
    let g = Golden::load();
    let model = Model::load(model_dir()).build().unwrap();
    let images: Vec<_> = image_paths(&g)
        .iter()
        .map(|p| load_image(fixtures_dir().join(p)).unwrap())
        .collect();
    let want = g.ids("greedy_ids");
    let options = Generation {
        max_new_tokens: Some(want.len()),
        images,
        ..Generation::default()
    };
    let mut ids = Vec::new();
    for piece in model
        .generate(unexpanded(&g.ids("prompt_ids")), options)
        .unwrap()
    {
        ids.extend(piece.unwrap().tokens);
    }
    assert_eq!(ids, want);
}

/// At half precision the tower and decoder run in bfloat16 end to end (pixel values cast to the
/// tower's dtype): a smoke test of the dtype plumbing, not a parity bound.
#[test]
fn bfloat16_compute_runs_the_whole_model() {
    let g = Golden::load();
    let options = LoadOptions {
        dtype: Some(mlxcel_core::Dtype::Bfloat16),
        ..Default::default()
    };
    let loaded = load_model(model_dir(), &options).unwrap();
    let ids = g.ids("prompt_ids");
    let logits = prompt_logits(&loaded, &ids, &g.tiles("pixel_values"), ids.len());
    assert!(logits.iter().all(|v| v.is_finite()));
    let (diff, at) = max_abs_diff(&logits, &g.f32s("logits"));
    assert!(diff < 3.0, "bfloat16 logits max |Δ| {diff:.2e} at {at}");
    eprintln!("bfloat16 logits max |Δ| {diff:.2e}");
}
