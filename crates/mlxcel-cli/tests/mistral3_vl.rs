//! `mlxcel logits --image ... --prompt-ids ...` on the tiny Mistral 3 (Pixtral) fixture
//! (`tests/fixtures/vision/mistral3`, transformers 5.24.0): the unexpanded ids (one `[IMG]`
//! per image) are expanded into rows with `[IMG_BREAK]` / `[IMG_END]` as PixtralProcessor does,
//! and the logits match transformers'; `mlxcel generate --image` continues as transformers does.

mod common;

use common::{assert_ok, max_abs_diff, mlxcel, read_npy_f32, vision, Reference};

fn ids(name: &str) -> Vec<u32> {
    Reference::open("mistral3").ids(name)
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
    assert_ok(&out);
    read_npy_f32(&npy)
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
        let want = Reference::open("mistral3").f32s(logits);
        assert_eq!(got.len(), want.len(), "{prompt}: expanded positions x 515");
        let worst = max_abs_diff(&got, &want);
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
    assert_ok(&out);
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
    assert_ok(&out);
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
    assert_ok(&out);
    assert!(
        text.contains("vision tower") && text.contains("lazy: on disk until the first image"),
        "{text}"
    );
}
