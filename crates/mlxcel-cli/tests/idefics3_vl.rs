//! `mlxcel generate --image` and `mlxcel logits --image` on the tiny Idefics3 fixture
//! (`tests/fixtures/vision/idefics3`, transformers 5.24.0): the images are split into tiles,
//! each tile its own framed run of image tokens, from unexpanded `--prompt-ids` holding
//! `<image>` (513) once per image.

use std::process::Command;

mod common;

use common::{assert_ok, max_abs_diff, mlxcel, read_npy_f32, vision, Reference};

fn ids(name: &str) -> Vec<u32> {
    Reference::open("idefics3").ids(name)
}

/// gradient.png: 2x2 tiles + global; grey.png: 2x1 tiles + global.
const IMAGES: [&str; 2] = ["images/gradient.png", "images/grey.png"];
const FAKE: u32 = 512;
const IMAGE: u32 = 513;
const GLOBAL: u32 = 515;

/// The reference prompt with each image's expansion (from its first
/// `<fake_token_around_image>` to the one closing its global image) collapsed back to `<image>`.
fn unexpanded_prompt() -> String {
    let full = ids("prompt_ids");
    let mut out = Vec::new();
    let mut i = 0;
    while i < full.len() {
        if full[i] == FAKE {
            let global = (i..full.len()).find(|&j| full[j] == GLOBAL).unwrap();
            i = (global..full.len()).find(|&j| full[j] == FAKE).unwrap() + 1;
            out.push(IMAGE);
        } else {
            out.push(full[i]);
            i += 1;
        }
    }
    assert_eq!(out.iter().filter(|t| **t == IMAGE).count(), 2);
    out.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn with_images(cmd: &mut Command) -> &mut Command {
    cmd.arg("--model").arg(vision("idefics3"));
    for image in IMAGES {
        cmd.arg("--image").arg(vision(image));
    }
    cmd.args(["--prompt-ids", &unexpanded_prompt()])
}

#[test]
fn generate_with_split_images_prints_transformers_greedy_ids() {
    let out = with_images(mlxcel().args(["generate", "--quiet", "--print-ids", "--max-new", "16"]))
        .output()
        .unwrap();
    assert_ok(&out);
    let want: Vec<String> = ids("greedy_ids").iter().map(u32::to_string).collect();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want.join(","));
}

#[test]
fn logits_with_split_images_match_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let npy = dir.path().join("logits.npy");
    let out = with_images(mlxcel().arg("logits"))
        .arg("--out")
        .arg(&npy)
        .output()
        .unwrap();
    assert_ok(&out);
    let got = read_npy_f32(&npy);
    let want = Reference::open("idefics3").f32s("logits");
    assert_eq!(got.len(), want.len(), "83 expanded positions x 552");
    let worst = max_abs_diff(&got, &want);
    assert!(worst <= 3e-4, "logits differ by {worst}");
}

#[test]
fn inspect_shows_the_lazy_tower_and_connector() {
    let out = mlxcel()
        .arg("inspect")
        .arg(vision("idefics3"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_ok(&out);
    assert!(text.contains("routes    directory Vlm"), "{text}");
    assert!(text.contains("vision (lazy)"), "{text}");
}
