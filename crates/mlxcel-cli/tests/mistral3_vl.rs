//! `mlxcel logits --image ... --prompt-ids ...` on the tiny Mistral 3 (Pixtral) fixture
//! (`tests/fixtures/vision/mistral3`, transformers 5.24.0): the unexpanded ids (one `[IMG]`
//! per image) are expanded into rows with `[IMG_BREAK]` / `[IMG_END]` as PixtralProcessor does,
//! and the logits match transformers'; `mlxcel generate --image` continues as transformers does.

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
    let bytes = std::fs::read(vision("mistral3/reference.safetensors")).unwrap();
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

/// `[IMG]`, `[IMG_BREAK]`, `[IMG_END]` in the fixture's tokenizer.
const IMG: u32 = 512;
const IMG_END: u32 = 514;

/// The reference prompt with each image's rows (`[IMG]`… `[IMG_BREAK]` … `[IMG_END]`)
/// collapsed back to one `[IMG]`, as a caller holding unexpanded ids has it.
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

fn run_logits(images: &[&str], prompt: &[u32]) -> Vec<f32> {
    let dir = tempfile::tempdir().unwrap();
    let npy = dir.path().join("logits.npy");
    let prompt: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let mut cmd = mlxcel();
    cmd.args(["logits", "--model"]).arg(vision("mistral3"));
    for i in images {
        cmd.arg("--image").arg(vision(&format!("images/{i}")));
    }
    let out = cmd
        .args(["--prompt-ids", &prompt.join(",")])
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
    bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn logits_with_images_match_transformers() {
    for (images, prompt, logits) in [
        (&["gradient.png"][..], "prompt1_ids", "logits1"),
        (&["gradient.png", "alpha.png"][..], "prompt2_ids", "logits2"),
    ] {
        let full = ids(prompt);
        let short = unexpanded(&full);
        assert_eq!(
            short.iter().filter(|t| **t == IMG).count(),
            images.len(),
            "{prompt}"
        );
        let got = run_logits(images, &short);
        let want = tensor(logits, |c| f32::from_le_bytes(c.try_into().unwrap()));
        assert_eq!(got.len(), want.len(), "{prompt}: expanded positions x 515");
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let peak = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            worst <= (2e-5 * peak).max(2e-4),
            "{prompt}: logits differ by {worst}"
        );
    }
}

/// The chat path: the template puts one `[IMG]` per image, the processor expands each into
/// its rows; the greedy continuation is transformers'.
#[test]
fn generate_with_two_images_prints_transformers_greedy_ids() {
    let mut cmd = mlxcel();
    cmd.args([
        "generate",
        "--quiet",
        "--print-ids",
        "--max-new",
        "16",
        "--model",
    ])
    .arg(vision("mistral3"));
    for i in ["gradient.png", "alpha.png"] {
        cmd.arg("--image").arg(vision(&format!("images/{i}")));
    }
    let out = cmd
        .args(["--user", "The river flows past the old mill."])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want: Vec<String> = ids("greedy_ids2").iter().map(u32::to_string).collect();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want.join(","));
}

#[test]
fn inspect_and_estimate_memory_show_the_lazy_pixtral_tower() {
    let out = mlxcel()
        .arg("inspect")
        .arg(vision("mistral3"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("routes    directory Mistral3Dynamic"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("vision (lazy)")),
        "{text}"
    );
    let out = mlxcel()
        .args(["generate", "--estimate-memory", "--user", "hi", "--model"])
        .arg(vision("mistral3"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("vision tower") && text.contains("lazy: on disk until the first image"),
        "{text}"
    );
}
