//! `mlxcel generate --image`, `mlxcel logits --image` and `--estimate-memory` on the tiny
//! Qwen2-VL and Qwen2.5-VL fixtures (`tests/fixtures/vision/qwen2_vl`, `qwen2_5_vl`,
//! transformers 5.24.0): the prompt ids hold `<|image_pad|>` once per image, expanded per image
//! (dynamic resolution) as `Qwen2VLProcessor` does.

use std::process::Command;

mod common;

use common::{max_abs_diff, mlxcel, read_npy_f32, vision, Reference};

const MODELS: [&str; 2] = ["qwen2_vl", "qwen2_5_vl"];
const IMAGES: [&str; 2] = ["images/qwen_vl_a.png", "images/qwen_vl_b.png"];
const IMAGE_PAD: u32 = 514;

/// Token ids stored in the fixture's `reference.safetensors`.
fn ids(model: &str, name: &str) -> Vec<u32> {
    Reference::open(model).ids(name)
}

/// The golden prompt with each image's run of `<|image_pad|>` collapsed to one.
fn unexpanded(model: &str) -> String {
    let mut out: Vec<u32> = Vec::new();
    for t in ids(model, "prompt_ids") {
        if !(t == IMAGE_PAD && out.last() == Some(&IMAGE_PAD)) {
            out.push(t);
        }
    }
    out.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn with_images(cmd: &mut Command) -> &mut Command {
    for image in IMAGES {
        cmd.arg("--image").arg(vision(image));
    }
    cmd
}

#[test]
fn generate_with_images_prints_transformers_greedy_ids() {
    for model in MODELS {
        let out = with_images(
            mlxcel()
                .args(["generate", "--quiet", "--print-ids", "--max-new", "16"])
                .arg("--model")
                .arg(vision(model)),
        )
        .args(["--prompt-ids", &unexpanded(model)])
        .output()
        .unwrap();
        assert!(
            out.status.success(),
            "{model}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let want: Vec<String> = ids(model, "greedy_ids")
            .iter()
            .map(u32::to_string)
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            want.join(","),
            "{model}"
        );
    }
}

#[test]
fn logits_with_images_match_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let npy = dir.path().join("logits.npy");
    for model in MODELS {
        let out = with_images(mlxcel().args(["logits", "--model"]).arg(vision(model)))
            .args(["--prompt-ids", &unexpanded(model)])
            .arg("--out")
            .arg(&npy)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{model}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got = read_npy_f32(&npy);
        let want = Reference::open(model).f32s("logits");
        assert_eq!(
            got.len(),
            want.len(),
            "{model}: 30 expanded positions x 516"
        );
        let biggest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = max_abs_diff(&got, &want);
        assert!(
            worst <= 2e-4f32.max(2e-5 * biggest),
            "{model}: logits differ by {worst}"
        );
    }
}

#[test]
fn estimate_memory_lists_the_lazy_vision_tower() {
    let out = with_images(
        mlxcel()
            .args(["generate", "--estimate-memory", "--model"])
            .arg(vision("qwen2_5_vl")),
    )
    .args(["--prompt-ids", &unexpanded("qwen2_5_vl")])
    .output()
    .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("vision tower") && l.contains("lazy")),
        "{text}"
    );
}
