//! Qwen2-VL and Qwen2.5-VL against transformers 5.24 (f32): the tiny fixtures' logits over a
//! prompt with two images (the processor's pixel values fed to the tower), greedy decoding
//! after them (positions continue at the cache offset plus the prompt's M-RoPE delta), chunked
//! prefill, the checkpoint layouts real releases use, and the text-only rules.

use mlxcel_arch::generate::argmax_token;
use mlxcel_arch::vision::qwen2_vl::{self, ImagePatches, MultimodalPrompt};
use mlxcel_arch::{GenerationModel, LanguageModel};
use mlxcel_core::{Array, WeightMap};
use mlxcel_loading::{load_model, LoadOptions};
use mlxcel_tests::{copy_fixture, max_abs_diff, model_dir};
use safetensors::SafeTensors;
use serde_json::Value;

const FIXTURES: [&str; 2] = ["qwen2_vl", "qwen2_5_vl"];

fn options() -> LoadOptions {
    LoadOptions {
        skip_tokenizer: true,
        ..Default::default()
    }
}

/// A VL fixture's goldens.
struct Golden {
    ids: Vec<i32>,
    logits: Vec<f32>,
    greedy: Vec<i32>,
    greedy_logits: Vec<f32>,
    pixel_values: Vec<f32>,
    patch_values: usize,
    grids: Vec<[i32; 3]>,
    text_ids: Vec<i32>,
    text_logits: Vec<f32>,
}

fn golden(name: &str) -> Golden {
    let bytes = std::fs::read(model_dir(name).join("reference.safetensors")).unwrap();
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
    let grids = i32s("image_grid_thw")
        .chunks_exact(3)
        .map(|g| [g[0], g[1], g[2]])
        .collect();
    Golden {
        ids: i32s("prompt_ids"),
        logits: f32s("logits"),
        greedy: i32s("greedy_ids"),
        greedy_logits: f32s("greedy_logits"),
        pixel_values: f32s("pixel_values"),
        patch_values: st.tensor("pixel_values").unwrap().shape()[1],
        grids,
        text_ids: i32s("text_ids"),
        text_logits: f32s("text_logits"),
    }
}

impl Golden {
    /// The processor's patches, split per image.
    fn images(&self) -> Vec<ImagePatches> {
        let mut start = 0;
        self.grids
            .iter()
            .map(|&g| {
                let n = (g[0] * g[1] * g[2]) as usize;
                let rows =
                    &self.pixel_values[start * self.patch_values..(start + n) * self.patch_values];
                start += n;
                ImagePatches {
                    pixel_values: Array::from_slice(rows, &[n as i32, self.patch_values as i32])
                        .unwrap(),
                    grid_thw: g,
                }
            })
            .collect()
    }
}

fn qwen(model: &GenerationModel) -> &qwen2_vl::Model {
    match model {
        GenerationModel::QwenVl(m) => m,
        other => panic!("expected a Qwen VL model, got {other:?}"),
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

/// Prefill of the expanded prompt in chunks of `chunk` rows (the whole prompt when `None`),
/// then greedy decoding of `steps` tokens at offset + delta. Returns the prompt's logits, the
/// greedy ids and the decode steps' logits (after the first).
fn run(
    model: &qwen2_vl::Model,
    p: &MultimodalPrompt,
    chunk: Option<usize>,
    steps: usize,
) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
    let mut caches = model.make_caches();
    let l = p.embeddings.dim(1).unwrap() as usize;
    let chunk = chunk.unwrap_or(l);
    let mut logits = Vec::new();
    let mut start = 0;
    while start < l {
        let end = (start + chunk).min(l);
        let (s, e) = (start as i32, end as i32);
        let emb = p.embeddings.slice_axis(1, s, e).unwrap();
        let pos = p.positions.slice_axis(1, s, e).unwrap();
        let out = model
            .forward_embeddings(&emb, Some(&pos), &mut caches, false)
            .unwrap();
        logits.extend(to_vec(&out));
        start = end;
    }
    let vocab = model.vocab_size();
    let last = Array::from_slice(&logits[(l - 1) * vocab..], &[vocab as i32]).unwrap();
    let mut next = argmax_token(&last).unwrap() as i32;
    let mut greedy = vec![next];
    let mut step_logits = Vec::new();
    for _ in 1..steps {
        let offset = caches[0].offset() as i64;
        let tokens = Array::from_slice(&[next], &[1, 1]).unwrap();
        let pos = Array::from_slice(&[(offset + p.position_delta) as i32], &[1]).unwrap();
        let out = model
            .forward_embeddings(
                &model.embed(&tokens).unwrap(),
                Some(&pos),
                &mut caches,
                true,
            )
            .unwrap();
        let row = to_vec(&out);
        next = argmax_token(&out.reshape(&[-1]).unwrap()).unwrap() as i32;
        step_logits.extend(row);
        greedy.push(next);
    }
    (logits, greedy, step_logits)
}

#[test]
fn image_prompts_match_transformers() {
    for name in FIXTURES {
        let g = golden(name);
        let loaded =
            load_model(model_dir(name), &options()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let model = qwen(&loaded.model);
        assert!(model.vision().is_some(), "{name}: vision tower built");
        let p = model.prompt(&g.ids, &g.images()).unwrap();
        let (logits, greedy, steps) = run(model, &p, None, g.greedy.len());
        let (diff, at) = max_abs_diff(&logits, &g.logits);
        let b = bound(&g.logits);
        assert!(
            diff <= b,
            "{name}: prompt logits max |Δ| {diff:.2e} > {b:.2e} at {at}"
        );
        assert_eq!(
            greedy, g.greedy,
            "{name}: greedy continuation after the images"
        );
        let (sdiff, sat) = max_abs_diff(
            &steps,
            &g.greedy_logits[g.greedy_logits.len() - steps.len()..],
        );
        let sb = bound(&g.greedy_logits);
        assert!(
            sdiff <= sb,
            "{name}: decode logits max |Δ| {sdiff:.2e} > {sb:.2e} at {sat}"
        );
        eprintln!("{name}: prompt logits max |Δ| {diff:.2e}, decode {sdiff:.2e} (bound {b:.2e})");
        for chunk in [1, 5, 16] {
            let (chunked, greedy, _) = run(model, &p, Some(chunk), g.greedy.len());
            let (d, at) = max_abs_diff(&chunked, &g.logits);
            assert!(
                d <= b,
                "{name}: prefill chunk {chunk}: max |Δ| {d:.2e} at {at}"
            );
            assert_eq!(
                greedy, g.greedy,
                "{name}: greedy with prefill chunk {chunk}"
            );
        }
    }
}

#[test]
fn image_token_counts_and_positions_follow_the_processor() {
    for name in FIXTURES {
        let g = golden(name);
        let meta: Value = serde_json::from_str(
            &std::fs::read_to_string(model_dir(name).join("reference.json")).unwrap(),
        )
        .unwrap();
        let counts: Vec<usize> = g
            .grids
            .iter()
            .map(|&gr| qwen2_vl::image_token_count(gr, 2))
            .collect();
        let want: Vec<usize> = meta["image_token_counts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(counts, want, "{name}");
        assert_eq!(
            g.ids.iter().filter(|t| **t == 514).count(),
            counts.iter().sum::<usize>(),
            "{name}: placeholders in the golden prompt"
        );
        let loaded = load_model(model_dir(name), &options()).unwrap();
        let model = qwen(&loaded.model);
        // One image too few, and one placeholder too many, are refused before any compute.
        let images = g.images();
        let err = model.prompt(&g.ids, &images[..1]).unwrap_err().to_string();
        assert!(err.contains("image tokens"), "{name}: {err}");
        let mut ids = g.ids.clone();
        let first = ids.iter().position(|t| *t == 514).unwrap();
        ids.insert(first, 514);
        assert!(
            model.prompt(&ids, &images).is_err(),
            "{name}: extra placeholder"
        );
    }
}

/// Rewrites a fixture's tensors (names, and the mlx-vlm channels-last patch kernel).
fn relayout(dir: &std::path::Path, rename: impl Fn(&str) -> String, channels_last: bool) {
    let path = dir.join("model.safetensors");
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
    mlxcel_core::weights::save_safetensors(&path, &out, None).unwrap();
}

#[test]
fn checkpoint_layouts_of_transformers5_and_mlx_vlm_load_alike() {
    let name = "qwen2_5_vl";
    let g = golden(name);
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
    for (layout, channels_last) in [("transformers5", false), ("mlx-vlm", true)] {
        let dir = copy_fixture(name);
        if layout == "mlx-vlm" {
            relayout(dir.path(), mlx_vlm, channels_last);
        } else {
            relayout(dir.path(), transformers5, channels_last);
        }
        let loaded = load_model(dir.path(), &options()).unwrap_or_else(|e| panic!("{layout}: {e}"));
        let model = qwen(&loaded.model);
        let p = model.prompt(&g.ids, &g.images()).unwrap();
        let (logits, _, _) = run(model, &p, None, 1);
        let (diff, at) = max_abs_diff(&logits, &g.logits);
        assert!(
            diff <= bound(&g.logits),
            "{layout}: max |Δ| {diff:.2e} at {at}"
        );
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
/// transformers on text, and refuses an image.
#[test]
fn text_only_rules() {
    for name in FIXTURES {
        let g = golden(name);
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
            let loaded =
                load_model(dir.path(), &options()).unwrap_or_else(|e| panic!("{name} {case}: {e}"));
            let model = qwen(&loaded.model);
            assert!(model.vision().is_none(), "{name} {case}: no vision tower");
            let tokens = Array::from_slice(&g.text_ids, &[1, g.text_ids.len() as i32]).unwrap();
            let logits = to_vec(&model.forward(&tokens, &mut model.make_caches()).unwrap());
            let (diff, at) = max_abs_diff(&logits, &g.text_logits);
            assert!(
                diff <= bound(&g.text_logits),
                "{name} {case}: text logits max |Δ| {diff:.2e} at {at}"
            );
            let err = model.prompt(&g.ids, &g.images()).unwrap_err().to_string();
            assert!(
                err.ends_with("was loaded without a vision tower (text-only checkpoint)"),
                "{name} {case}: {err}"
            );
        }
    }
}
