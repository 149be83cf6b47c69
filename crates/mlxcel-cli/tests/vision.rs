//! `mlxcel generate --image`, `mlxcel logits --image` and `mlxcel chat`'s `/image` on the tiny
//! Gemma 3 vision-language fixture (`tests/fixtures/vision/gemma3`, transformers 5.24.0).

mod common;

use common::{assert_ok, max_abs_diff, mlxcel, read_npy_f32, vision, Reference};
use std::io::Write;
use std::process::Stdio;

fn ids(name: &str) -> Vec<u32> {
    Reference::open("gemma3").ids(name)
}

const IMAGES: [&str; 2] = ["images/gradient.png", "images/lossless.webp"];
const USER: &str = "The river flows past the old mill.";

#[test]
fn generate_with_images_prints_transformers_greedy_ids() {
    let out = mlxcel()
        .args([
            "generate",
            "--quiet",
            "--print-ids",
            "--max-new",
            "16",
            "--model",
        ])
        .arg(vision("gemma3"))
        .arg("--image")
        .arg(vision(IMAGES[0]))
        .arg("--image")
        .arg(vision(IMAGES[1]))
        .args(["--user", USER])
        .output()
        .unwrap();
    assert_ok(&out);
    let want: Vec<String> = ids("greedy_ids").iter().map(u32::to_string).collect();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want.join(","));
}

/// The reference prompt with each image's expansion (`\n\n` = ids 201 201, `<start_of_image>`
/// 512, 4 × `<image_soft_token>` 513, `<end_of_image>` 514, `\n\n`) collapsed back to the
/// placeholder 512, as a caller holding unexpanded ids has it.
fn unexpanded_prompt() -> Vec<u32> {
    let full = ids("prompt_ids");
    let mut out = Vec::new();
    let mut i = 0;
    while i < full.len() {
        if full[i..].starts_with(&[201, 201, 512]) {
            assert_eq!(&full[i + 3..i + 10], &[513, 513, 513, 513, 514, 201, 201]);
            out.push(512);
            i += 10;
        } else {
            out.push(full[i]);
            i += 1;
        }
    }
    out
}

#[test]
fn logits_with_images_match_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let npy = dir.path().join("logits.npy");
    let prompt: Vec<String> = unexpanded_prompt().iter().map(u32::to_string).collect();
    let out = mlxcel()
        .args(["logits", "--model"])
        .arg(vision("gemma3"))
        .arg("--image")
        .arg(vision(IMAGES[0]))
        .arg("--image")
        .arg(vision(IMAGES[1]))
        .args(["--prompt-ids", &prompt.join(",")])
        .arg("--out")
        .arg(&npy)
        .output()
        .unwrap();
    assert_ok(&out);
    let got = read_npy_f32(&npy);
    let want = Reference::open("gemma3").f32s("logits");
    assert_eq!(got.len(), want.len(), "47 expanded positions x 515");
    let worst = max_abs_diff(&got, &want);
    assert!(worst <= 3e-4, "logits differ by {worst}");

    // The ids must hold the placeholder once per image.
    let out = mlxcel()
        .args(["logits", "--model"])
        .arg(vision("gemma3"))
        .arg("--image")
        .arg(vision(IMAGES[0]))
        .args(["--prompt-ids", "1,2,3", "--out"])
        .arg(&npy)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("0 time(s) for 1 image(s)"), "{err}");
}

#[test]
fn chat_attaches_images_and_text_only_models_refuse_them() {
    let mut child = mlxcel()
        .args(["chat", "--max-new", "4", "--model"])
        .arg(vision("gemma3"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(
        child.stdin.take().unwrap(),
        "/image {}\n{USER}",
        vision(IMAGES[0]).display()
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("[image 1 attached to the next message]"),
        "{err}"
    );
    // The reference prompt less one image's expansion (10 ids: `\n\n`, boi, 4 soft tokens, eoi,
    // `\n\n`).
    let want = format!("[prompt {} tokens", ids("prompt_ids").len() - 10);
    assert!(err.contains(&want), "{err}");

    // A model without a vision tower refuses an image with the seed's message.
    let text_model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models/gemma3_text");
    let out = mlxcel()
        .args(["generate", "--quiet", "--model"])
        .arg(&text_model)
        .arg("--image")
        .arg(vision(IMAGES[0]))
        .args(["--user", "hi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let folder = std::fs::canonicalize(&text_model).unwrap_or(text_model.clone());
    assert!(
        err.contains("was loaded without a vision tower (text-only checkpoint)")
            && (err.contains(&text_model.display().to_string())
                || err.contains(&folder.display().to_string())),
        "{err}"
    );
}

#[test]
fn inspect_and_estimate_memory_show_the_lazy_tower() {
    let out = mlxcel()
        .arg("inspect")
        .arg(vision("gemma3"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_ok(&out);
    assert!(text.contains("routes    directory Vlm"), "{text}");
    assert!(text.contains("vision (lazy)"), "{text}");
    let out = mlxcel()
        .args(["generate", "--estimate-memory", "--user", "hi", "--model"])
        .arg(vision("llava"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_ok(&out);
    assert!(
        text.contains("vision tower") && text.contains("lazy: on disk until the first image"),
        "{text}"
    );
}
