//! `mlxcel generate --model FILE.gguf` (converted once into the cache, then reused) and
//! `mlxcel convert --gguf` refusing what it cannot import, naming it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn mlxcel() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mlxcel"))
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The prompt and greedy ids of a fixture's reference (int32 tensors in reference.safetensors).
fn reference_ids(name: &str) -> (Vec<i32>, Vec<i32>) {
    let bytes = std::fs::read(
        fixtures()
            .join("models")
            .join(name)
            .join("reference.safetensors"),
    )
    .unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let read = |key: &str| -> Vec<i32> {
        let off = &header[key]["data_offsets"];
        let a = off[0].as_u64().unwrap() as usize + 8 + n;
        let b = off[1].as_u64().unwrap() as usize + 8 + n;
        bytes[a..b]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    (read("prompt_ids"), read("greedy_ids"))
}

fn join(ids: &[i32]) -> String {
    ids.iter().map(i32::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn generate_from_a_gguf_converts_once_and_reuses_the_cache() {
    let cache = tempfile::tempdir().unwrap();
    let (prompt, greedy) = reference_ids("qwen3");
    let run = || -> Output {
        mlxcel()
            .env("MLXCEL_CACHE_DIR", cache.path())
            .args(["generate", "--quiet", "--print-ids", "--max-new", "16"])
            .arg("--model")
            .arg(fixtures().join("gguf/qwen3.gguf"))
            .args(["--prompt-ids", &join(&prompt)])
            .output()
            .unwrap()
    };
    let first = run();
    let err = String::from_utf8_lossy(&first.stderr);
    assert!(first.status.success(), "{err}");
    assert!(
        err.contains("converted"),
        "first run says it converts: {err}"
    );
    assert_eq!(String::from_utf8_lossy(&first.stdout).trim(), join(&greedy));
    let entries = || -> Vec<PathBuf> {
        std::fs::read_dir(cache.path().join("gguf"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    };
    let folders = entries();
    assert_eq!(folders.len(), 1, "{folders:?}");
    let stamp = std::fs::metadata(folders[0].join("model.safetensors"))
        .unwrap()
        .modified()
        .unwrap();

    let second = run();
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{err}");
    assert!(!err.contains("converted"), "second run reuses: {err}");
    assert_eq!(
        String::from_utf8_lossy(&second.stdout).trim(),
        join(&greedy)
    );
    assert_eq!(entries(), folders);
    let again = std::fs::metadata(folders[0].join("model.safetensors"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(stamp, again, "the conversion was not rewritten");
}

/// `qwen3.gguf` with `needle`'s first occurrence after `after` overwritten by `with`.
fn patched(after: &[u8], needle: &[u8], with: &[u8]) -> tempfile::NamedTempFile {
    let mut bytes = std::fs::read(fixtures().join("gguf/qwen3.gguf")).unwrap();
    let find = |hay: &[u8], n: &[u8], from: usize| {
        hay[from..]
            .windows(n.len())
            .position(|w| w == n)
            .map(|p| p + from)
            .unwrap()
    };
    let start = find(&bytes, after, 0) + after.len();
    let at = find(&bytes, needle, start);
    bytes[at..at + with.len()].copy_from_slice(with);
    let f = tempfile::Builder::new().suffix(".gguf").tempfile().unwrap();
    std::fs::write(f.path(), bytes).unwrap();
    f
}

fn convert(gguf: &Path) -> Output {
    let out = tempfile::tempdir().unwrap();
    mlxcel()
        .args(["convert", "--quiet", "--gguf"])
        .arg(gguf)
        .arg("--out")
        .arg(out.path().join("m"))
        .output()
        .unwrap()
}

#[test]
fn unsupported_architecture_and_tensor_type_are_refused_by_name() {
    // general.architecture = "qwen3" → "mamba" (same length).
    let f = patched(b"general.architecture", b"qwen3", b"mamba");
    let out = convert(f.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("`mamba`") && err.contains("general.architecture"),
        "{err}"
    );

    // output_norm.weight: 1 dim of 64, type F32 (0) → IQ4_NL (20), 36 bytes of blocks.
    let mut info = Vec::new();
    info.extend(1u32.to_le_bytes());
    info.extend(64u64.to_le_bytes());
    let mut with = info.clone();
    info.extend(0u32.to_le_bytes());
    with.extend(20u32.to_le_bytes());
    let f = patched(b"output_norm.weight", &info, &with);
    let out = convert(f.path());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("output_norm.weight") && err.contains("IQ4_NL"),
        "{err}"
    );
}
