//! Qwen2-VL and Qwen2.5-VL against transformers 5.24 (f32), through the `Vlm` route: the HF
//! processor's pixel values and image grids from the committed PNGs, the placeholder
//! expansion, logits over a prompt with two images, greedy decoding after them (positions
//! continue at the cache offset plus the prompt's M-RoPE delta), chunked prefill, the
//! checkpoint layouts real releases use, and the text-only rules.

use mlxcel_arch::generate::Session;
use mlxcel_arch::vision::qwen2_vl::{self, patchify};
use mlxcel_arch::vision::{forward_multimodal, FeatureCache, ImageInput, MultimodalPrompt};
use mlxcel_arch::{GenerationModel, LanguageModel};
use mlxcel_core::{Array, WeightMap};
use mlxcel_loading::image::load_image;
use mlxcel_loading::vision::PreparedImage;
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::{fixtures_dir, max_abs_diff};
use safetensors::SafeTensors;
use serde_json::Value;

const FIXTURES: [&str; 2] = ["qwen2_vl", "qwen2_5_vl"];
const IMAGE_TOKEN: u32 = 514;

/// A VL fixture's goldens.
struct Golden {
    ids: Vec<u32>,
    logits: Vec<f32>,
    greedy: Vec<u32>,
    greedy_logits: Vec<f32>,
    pixel_values: Vec<f32>,
    grids: Vec<[i32; 3]>,
    text_ids: Vec<u32>,
    text_logits: Vec<f32>,
    meta: Value,
}

/// A Qwen VL fixture's folder (`tests/fixtures/vision/<name>`).
fn model_dir(name: &str) -> std::path::PathBuf {
    fixtures_dir().join("vision").join(name)
}

/// A fixture copied into a temporary folder, to edit.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model_dir(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn golden(name: &str) -> Golden {
    let dir = model_dir(name);
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |n: &str| -> Vec<f32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let i32s = |n: &str| -> Vec<i32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let u32s = |n: &str| -> Vec<u32> { i32s(n).into_iter().map(|v| v as u32).collect() };
    Golden {
        ids: u32s("prompt_ids"),
        logits: f32s("logits"),
        greedy: u32s("greedy_ids"),
        greedy_logits: f32s("greedy_logits"),
        pixel_values: f32s("pixel_values"),
        grids: i32s("image_grid_thw")
            .chunks_exact(3)
            .map(|g| [g[0], g[1], g[2]])
            .collect(),
        text_ids: u32s("text_ids"),
        text_logits: f32s("text_logits"),
        meta: serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap(),
    }
}

fn load(dir: &std::path::Path) -> Loaded {
    load_model(dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn qwen(model: &GenerationModel) -> &qwen2_vl::Model {
    match model {
        GenerationModel::QwenVl(m) => m,
        other => panic!("expected a Qwen VL model, got {other:?}"),
    }
}

/// The fixture's images (PNGs under tests/fixtures), through the model's processor.
fn images(loaded: &Loaded, g: &Golden) -> Vec<ImageInput> {
    g.meta["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let img = load_image(fixtures_dir().join(p.as_str().unwrap())).unwrap();
            loaded.prepare_image(&img).unwrap()
        })
        .collect()
}

/// The fixture's images prepared for a prompt: each one input and its own expansion (one
/// placeholder per merged patch).
fn prepared(loaded: &Loaded, g: &Golden) -> Vec<PreparedImage> {
    g.meta["images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let img = load_image(fixtures_dir().join(p.as_str().unwrap())).unwrap();
            loaded.prepare_for_prompt(&img).unwrap()
        })
        .collect()
}

/// The processor's own pixel values (the golden patches put back into `[1, 3, H, W]` images,
/// the first of each patch's temporal copies), so the model is checked apart from the resize.
fn golden_images(g: &Golden) -> Vec<ImageInput> {
    let (p, m, c) = (14usize, 2usize, 3usize);
    let per_patch = c * 2 * p * p;
    let mut row = 0;
    g.grids
        .iter()
        .enumerate()
        .map(|(k, &[_, gh, gw])| {
            let (gh, gw) = (gh as usize, gw as usize);
            let (h, w) = (gh * p, gw * p);
            let mut pixels = vec![0f32; c * h * w];
            for bh in 0..gh / m {
                for bw in 0..gw / m {
                    for mh in 0..m {
                        for mw in 0..m {
                            let patch = &g.pixel_values[row * per_patch..(row + 1) * per_patch];
                            row += 1;
                            let (py, px) = ((bh * m + mh) * p, (bw * m + mw) * p);
                            for ch in 0..c {
                                for y in 0..p {
                                    for x in 0..p {
                                        pixels[ch * h * w + (py + y) * w + px + x] =
                                            patch[ch * 2 * p * p + y * p + x];
                                    }
                                }
                            }
                        }
                    }
                }
            }
            ImageInput::new(pixels, [1, c, h, w], k as u64).unwrap()
        })
        .collect()
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

/// Greedy decoding through a [`Session`]: the prompt with its images, then `steps` tokens.
/// Returns the ids and the logits of every step after the first.
fn session_greedy(
    s: &mut Session<'_>,
    ids: &[u32],
    images: &[ImageInput],
    chunk: Option<usize>,
    steps: usize,
) -> (Vec<u32>, Vec<f32>) {
    let (_, mut logits) = s.prefill_multimodal(ids, images, chunk).unwrap();
    let mut out = Vec::new();
    let mut step_logits = Vec::new();
    for i in 0..steps {
        let next = mlxcel_arch::generate::argmax_token(&logits).unwrap();
        out.push(next);
        if i + 1 < steps {
            logits = s.step(next).unwrap();
            step_logits.extend(to_vec(&logits));
        }
    }
    (out, step_logits)
}

#[test]
fn pixel_values_grids_and_expansion_match_the_processor() {
    for name in FIXTURES {
        let g = golden(name);
        let loaded = load(&model_dir(name));
        let images = images(&loaded, &g);
        let mut got = Vec::new();
        let mut grids = Vec::new();
        for im in &images {
            let [_, c, h, w] = im.shape();
            let (patches, grid) = patchify(im.pixels(), c, h, w, 14, 2, 2).unwrap();
            got.extend(patches);
            grids.push(grid);
        }
        assert_eq!(grids, g.grids, "{name}: image_grid_thw");
        let (diff, at) = max_abs_diff(&got, &g.pixel_values);
        assert!(
            diff <= 1e-5,
            "{name}: pixel values max |Δ| {diff:.2e} at {at}"
        );
        eprintln!("{name}: pixel values max |Δ| {diff:.2e}, grids {grids:?}");
        // The processor's expansion: one <|image_pad|> per image in, one per merged patch out.
        let mut unexpanded = Vec::new();
        for &t in &g.ids {
            if !(t == IMAGE_TOKEN && unexpanded.last() == Some(&IMAGE_TOKEN)) {
                unexpanded.push(t);
            }
        }
        let prepared = prepared(&loaded, &g);
        assert!(prepared
            .iter()
            .zip(&images)
            .all(|(p, i)| p.inputs.len() == 1 && p.inputs[0].pixels() == i.pixels()));
        let expanded = loaded
            .expand_image_tokens_for(&unexpanded, &prepared)
            .unwrap();
        assert_eq!(expanded, g.ids, "{name}: expanded ids");
        let counts: Vec<u64> = images
            .iter()
            .map(|i| loaded.model.vision().unwrap().image_token_count(i).unwrap() as u64)
            .collect();
        let want: Vec<u64> = g.meta["image_token_counts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(counts, want, "{name}: image token counts");
        // ... and in text, through the tokenizer.
        let tok = loaded.tokenizer.as_ref().unwrap();
        let text = tok.decode(&unexpanded, false).unwrap();
        let text = loaded.expand_prompt_text_for(&text, &prepared).unwrap();
        assert_eq!(
            tok.encode(&text, false).unwrap(),
            g.ids,
            "{name}: expanded text"
        );
        assert!(loaded
            .expand_image_tokens_for(&unexpanded, &prepared[..1])
            .is_err());
        // The whole chain, PNG to logits.
        let logits = prompt_logits(&loaded, &g.ids, &images, g.ids.len());
        let (diff, at) = max_abs_diff(&logits, &g.logits);
        assert!(
            diff <= bound(&g.logits),
            "{name}: logits from the PNGs: max |Δ| {diff:.2e} at {at}"
        );
    }
}

/// transformers 5 saves the Qwen2-VL image processor with `size: {shortest_edge,
/// longest_edge}` instead of `min_pixels`/`max_pixels`, and `processor_config.json` may carry it
/// as `image_processor`: all read alike. `min_pixels`/`max_pixels` win over `size`, as in
/// `Qwen2VLImageProcessor.__init__`.
#[test]
fn processor_config_spellings_read_alike() {
    let name = "qwen2_5_vl";
    let g = golden(name);
    let saved = serde_json::json!({
        "do_convert_rgb": true, "do_normalize": true, "do_rescale": true, "do_resize": true,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "merge_size": 2, "patch_size": 14, "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": 9408, "shortest_edge": 3136},
        "temporal_patch_size": 2
    });
    let reference = {
        let loaded = load(&model_dir(name));
        images(&loaded, &g)
    };
    let variants = [
        ("preprocessor_config.json", saved.clone()),
        (
            "processor_config.json",
            serde_json::json!({"image_processor": saved.clone()}),
        ),
        ("preprocessor_config.json", {
            // max_pixels wins over size.longest_edge: b (50x70) must then shrink to 28x28.
            let mut v = saved.clone();
            v["max_pixels"] = serde_json::json!(784);
            v
        }),
    ];
    for (k, (file, json)) in variants.into_iter().enumerate() {
        let dir = copy_fixture(name);
        std::fs::remove_file(dir.path().join("preprocessor_config.json")).unwrap();
        std::fs::write(dir.path().join(file), json.to_string()).unwrap();
        let loaded = load(dir.path());
        let got = images(&loaded, &g);
        if k < 2 {
            for (a, b) in got.iter().zip(&reference) {
                assert_eq!(a.shape(), b.shape(), "{file}");
                assert_eq!(a.pixels(), b.pixels(), "{file}");
            }
        } else {
            assert_eq!(got[1].shape(), [1, 3, 28, 28], "max_pixels over size");
        }
    }
}

#[test]
fn image_prompts_match_transformers() {
    for name in FIXTURES {
        let g = golden(name);
        let loaded = load(&model_dir(name));
        let model = qwen(&loaded.model);
        assert!(!model.tower().unwrap().materialized(), "{name}: lazy tower");
        let images = golden_images(&g);
        let b = bound(&g.logits);
        for chunk in [g.ids.len(), 1, 5, 16] {
            let logits = prompt_logits(&loaded, &g.ids, &images, chunk);
            let (diff, at) = max_abs_diff(&logits, &g.logits);
            assert!(
                diff <= b,
                "{name}: prefill chunk {chunk}: logits max |Δ| {diff:.2e} > {b:.2e} at {at}"
            );
            if chunk == g.ids.len() {
                eprintln!("{name}: prompt logits max |Δ| {diff:.2e} (bound {b:.2e})");
            }
        }
        assert!(model.tower().unwrap().materialized());
        for chunk in [None, Some(3), Some(16)] {
            let mut s = loaded.session();
            let (greedy, steps) = session_greedy(&mut s, &g.ids, &images, chunk, g.greedy.len());
            assert_eq!(
                greedy, g.greedy,
                "{name}: greedy after the images (chunk {chunk:?})"
            );
            let (diff, at) = max_abs_diff(
                &steps,
                &g.greedy_logits[g.greedy_logits.len() - steps.len()..],
            );
            let sb = bound(&g.greedy_logits);
            assert!(
                diff <= sb,
                "{name}: decode logits max |Δ| {diff:.2e} > {sb:.2e} at {at}"
            );
            if chunk.is_none() {
                eprintln!("{name}: decode logits max |Δ| {diff:.2e}, greedy {greedy:?}");
            }
        }
        // Two such conversations decoded side by side (`step_batch`, the server's path for
        // models that do not batch) keep their own position deltas.
        let mut states = Vec::new();
        let mut first = Vec::new();
        for _ in 0..2 {
            let mut s = loaded.session();
            let (_, logits) = s.prefill_multimodal(&g.ids, &images, None).unwrap();
            first.push(mlxcel_arch::generate::argmax_token(&logits).unwrap());
            states.push(s.into_state());
        }
        let mut tokens = first;
        let mut greedy = vec![tokens[0]];
        for _ in 1..g.greedy.len() {
            let mut refs: Vec<&mut mlxcel_arch::generate::SessionState> =
                states.iter_mut().collect();
            let logits =
                mlxcel_arch::generate::step_batch(&loaded.model, &mut refs, &tokens).unwrap();
            let rows = to_vec(&logits);
            let vocab = rows.len() / 2;
            tokens = (0..2)
                .map(|r| {
                    let row = Array::from_slice(&rows[r * vocab..(r + 1) * vocab], &[vocab as i32])
                        .unwrap();
                    mlxcel_arch::generate::argmax_token(&row).unwrap()
                })
                .collect();
            assert_eq!(tokens[0], tokens[1]);
            greedy.push(tokens[0]);
        }
        assert_eq!(greedy, g.greedy, "{name}: greedy through step_batch");
        // The same conversation again reuses its whole prefix (images included) and decodes
        // the same; a text prompt after it starts from plain positions.
        let mut s = loaded.session();
        session_greedy(&mut s, &g.ids, &images, None, 2);
        let (greedy, _) = session_greedy(&mut s, &g.ids, &images, None, g.greedy.len());
        assert_eq!(greedy, g.greedy, "{name}: greedy after prefix reuse");
        // A second turn: the conversation so far (its reply included) plus more text reuses
        // the cached prefix, and the new positions continue after the images' grid positions
        // (the same logits as a fresh prefill of the whole turn).
        let mut turn2 = g.ids.clone();
        turn2.extend(&g.greedy[..4]);
        turn2.extend(&g.text_ids[..5]);
        let (reused, second) = s.prefill_multimodal(&turn2, &images, Some(3)).unwrap();
        assert!(reused >= g.ids.len(), "{name}: reused {reused}");
        let fresh = prompt_logits(&loaded, &turn2, &images, turn2.len());
        let vocab = second.size();
        let (diff, _) = max_abs_diff(&to_vec(&second), &fresh[fresh.len() - vocab..]);
        assert!(diff <= 1e-4, "{name}: second turn after reuse: {diff:.2e}");
        let (_, logits) = s.prefill(&g.text_ids, None).unwrap();
        let tail = &g.text_logits[g.text_logits.len() - logits.size()..];
        let (diff, _) = max_abs_diff(&to_vec(&logits), tail);
        assert!(
            diff <= bound(&g.text_logits),
            "{name}: text after images: {diff:.2e}"
        );
    }
}

#[test]
fn image_count_mismatches_are_refused() {
    let name = "qwen2_vl";
    let g = golden(name);
    let loaded = load(&model_dir(name));
    let images = images(&loaded, &g);
    let mut s = loaded.session();
    let err = s
        .prefill_multimodal(&g.ids, &images[..1], None)
        .unwrap_err();
    assert!(err.to_string().contains("image"), "{err}");
    let swapped = [images[1].clone(), images[0].clone()];
    assert!(s.prefill_multimodal(&g.ids, &swapped, None).is_err());
}

/// Rewrites a fixture's tensors (names, and the mlx-vlm channels-last patch kernel).
fn relayout(dir: &std::path::Path, rename: impl Fn(&str) -> String, channels_last: bool) {
    let map = WeightMap::open(dir).unwrap();
    let mut out: Vec<(String, Array)> = Vec::new();
    for name in map.names() {
        let mut a = map.get(name).unwrap();
        if channels_last && name.ends_with("patch_embed.proj.weight") {
            a = a.transpose(&[0, 2, 3, 4, 1]).unwrap().contiguous().unwrap();
        }
        out.push((rename(name), a));
    }
    drop(map);
    mlxcel_core::weights::save_safetensors(dir.join("model.safetensors"), &out, None).unwrap();
}

#[test]
fn checkpoint_layouts_of_transformers5_and_mlx_vlm_load_alike() {
    let transformers5 = |n: &str| {
        if let Some(rest) = n.strip_prefix("visual.") {
            format!("model.visual.{rest}")
        } else if let Some(rest) = n.strip_prefix("model.") {
            format!("model.language_model.{rest}")
        } else {
            n.to_string()
        }
    };
    let mlx_vlm = |n: &str| {
        if let Some(rest) = n.strip_prefix("visual.") {
            format!("vision_tower.{rest}")
        } else {
            format!("language_model.{n}")
        }
    };
    for name in FIXTURES {
        let g = golden(name);
        for layout in ["transformers5", "mlx-vlm"] {
            let dir = copy_fixture(name);
            match layout {
                "mlx-vlm" => relayout(dir.path(), mlx_vlm, true),
                _ => relayout(dir.path(), transformers5, false),
            }
            let loaded = load(dir.path());
            let images = golden_images(&g);
            let logits = prompt_logits(&loaded, &g.ids, &images, g.ids.len());
            let (diff, at) = max_abs_diff(&logits, &g.logits);
            assert!(
                diff <= bound(&g.logits),
                "{name} {layout}: max |Δ| {diff:.2e} at {at}"
            );
        }
    }
}

fn edit_config(dir: &std::path::Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(config.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
}

/// A change to a copied fixture folder.
type Edit = dyn Fn(&std::path::Path);

/// The text-only rules: `vision_config` missing, null or empty, `language_model_only: true`
/// (vision weights present), or no vision weights. Each loads the decoder alone, matches
/// transformers on text, and refuses an image with the seed's message.
#[test]
fn text_only_rules() {
    for name in FIXTURES {
        let g = golden(name);
        let with_tower = load(&model_dir(name));
        let images = images(&with_tower, &g);
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
                Box::new(|d| {
                    edit_config(d, |c| {
                        c.insert("vision_config".into(), Value::Null);
                    })
                }),
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
                        .filter(|n| !n.starts_with("visual."))
                        .map(|n| (n.to_string(), map.get(n).unwrap()))
                        .collect();
                    drop(map);
                    mlxcel_core::weights::save_safetensors(
                        d.join("model.safetensors"),
                        &keep,
                        None,
                    )
                    .unwrap();
                }),
            ),
        ];
        for (case, edit) in cases {
            let dir = copy_fixture(name);
            edit(dir.path());
            let loaded = load(dir.path());
            let model = qwen(&loaded.model);
            assert!(
                model.tower().is_none() && loaded.model.vision().is_none(),
                "{name} {case}"
            );
            let ids: Vec<i32> = g.text_ids.iter().map(|t| *t as i32).collect();
            let tokens = Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap();
            let logits = to_vec(
                &loaded
                    .model
                    .forward(&tokens, &mut loaded.model.make_caches())
                    .unwrap(),
            );
            let (diff, at) = max_abs_diff(&logits, &g.text_logits);
            assert!(
                diff <= bound(&g.text_logits),
                "{name} {case}: text logits max |Δ| {diff:.2e} at {at}"
            );
            let err = loaded
                .session()
                .prefill_multimodal(&g.ids, &images, None)
                .unwrap_err()
                .to_string();
            assert_eq!(
                err,
                format!(
                    "model {} was loaded without a vision tower (text-only checkpoint)",
                    loaded.folder.display()
                ),
                "{name} {case}"
            );
        }
    }
}

/// At half precision (what a GPU load computes in) the tower and decoder run in bfloat16 end to
/// end: pixel values are cast to the tower's dtype, and the logits stay near float32's (a
/// smoke test of the dtype plumbing, not a parity bound: transformers' own bfloat16 logits of
/// these fixtures are up to 1.1 from its float32 ones, mlxcel's 0.9-2.2: bfloat16 noise).
#[test]
fn bfloat16_compute_runs_the_whole_model() {
    for name in FIXTURES {
        let g = golden(name);
        let options = LoadOptions {
            dtype: Some(mlxcel_core::Dtype::Bfloat16),
            ..Default::default()
        };
        let loaded = load_model(model_dir(name), &options).unwrap();
        let images = golden_images(&g);
        let logits = prompt_logits(&loaded, &g.ids, &images, g.ids.len());
        assert!(logits.iter().all(|v| v.is_finite()), "{name}");
        let (diff, at) = max_abs_diff(&logits, &g.logits);
        assert!(
            diff < 3.0,
            "{name}: bfloat16 logits max |Δ| {diff:.2e} at {at}"
        );
        eprintln!("{name}: bfloat16 logits max |Δ| {diff:.2e}");
    }
}

/// `mlxcel_models::Model` with `Generation::images`: the ids prompt holds `<|image_pad|>` once
/// per image and is expanded per image (dynamic resolution); greedy ids equal transformers'.
#[test]
fn the_high_level_model_takes_qwen_images() {
    use mlxcel_models::{Generation, Model};
    for name in FIXTURES {
        let g = golden(name);
        let model = Model::load(model_dir(name)).build().unwrap();
        let images: Vec<_> = g.meta["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| load_image(fixtures_dir().join(p.as_str().unwrap())).unwrap())
            .collect();
        let mut collapsed = Vec::new();
        for &t in &g.ids {
            if !(t == IMAGE_TOKEN && collapsed.last() == Some(&IMAGE_TOKEN)) {
                collapsed.push(t);
            }
        }
        let options = Generation {
            max_new_tokens: Some(g.greedy.len()),
            images,
            ..Generation::default()
        };
        let mut ids = Vec::new();
        for piece in model.generate(collapsed, options).unwrap() {
            ids.extend(piece.unwrap().tokens);
        }
        assert_eq!(ids, g.greedy, "{name}");
    }
}

/// A vision config the tower cannot be built from is refused at load (the lazy tower is
/// checked then), naming the field; so is a tower missing a tensor.
#[test]
fn bad_vision_configs_and_tensors_are_refused_at_load() {
    let dir = copy_fixture("qwen2_vl");
    edit_config(dir.path(), |c| {
        c["vision_config"]["num_heads"] = serde_json::json!(3);
    });
    let err = load_model(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("vision_config") && err.contains("num_heads"),
        "{err}"
    );

    let dir = copy_fixture("qwen2_5_vl");
    let map = WeightMap::open(dir.path()).unwrap();
    let keep: Vec<(String, Array)> = map
        .names()
        .filter(|n| *n != "visual.blocks.1.mlp.up_proj.weight")
        .map(|n| (n.to_string(), map.get(n).unwrap()))
        .collect();
    drop(map);
    mlxcel_core::weights::save_safetensors(dir.path().join("model.safetensors"), &keep, None)
        .unwrap();
    let err = load_model(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("visual.blocks.1.mlp.up_proj.weight"), "{err}");
}
