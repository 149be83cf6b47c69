//! `mlxcel generate --image` and `mlxcel logits --image` on the tiny Idefics3 fixture
//! (`tests/fixtures/vision/idefics3`, transformers 5.24.0): the images are split into tiles,
//! each tile its own framed run of image tokens, from unexpanded `--prompt-ids` holding
//! `<image>` (513) once per image.

use std::process::Command;

fn mlxcel() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mlxcel"))
}

fn vision(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vision")
        .join(path)
}

fn tensor<T>(name: &str, parse: impl Fn(&[u8]) -> T) -> Vec<T> {
    let bytes = std::fs::read(vision("idefics3/reference.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let off = &header[name]["data_offsets"];
    let (a, b) = (
        off[0].as_u64().unwrap() as usize,
        off[1].as_u64().unwrap() as usize,
    );
    data[a..b].chunks_exact(4).map(parse).collect()
}

fn ids(name: &str) -> Vec<u32> {
    tensor(name, |c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
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
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&npy).unwrap();
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let got: Vec<f32> = bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want = tensor("logits", |c| f32::from_le_bytes(c.try_into().unwrap()));
    assert_eq!(got.len(), want.len(), "83 expanded positions x 552");
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
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
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("routes    directory Vlm"), "{text}");
    assert!(text.contains("vision (lazy)"), "{text}");
}
