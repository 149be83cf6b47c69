//! `mlxcel generate --model FILE.gguf` (converted once into the cache, then reused),
//! `mlxcel convert --gguf` refusing what it cannot import, naming it, and saying what it had to
//! re-quantize; and a user's run: a copy of the binary, outside the source tree, with only a HOME,
//! converting and running (generate, serve) a GGUF.

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

#[test]
fn convert_says_what_it_requantized() {
    let out = convert(&fixtures().join("gguf/quant/llama256-q6_k.gguf"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("Q6_K: 8 tensors re-quantized to MLX affine 8-bit")
            && err.contains("max |Δw|"),
        "{err}"
    );
    let out = convert(&fixtures().join("gguf/quant/llama256-q4_k.gguf"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("re-quantized"), "Q4_K is exact: {err}");
}

/// What a user has: the `mlxcel` binary copied somewhere, a GGUF file, a HOME; no source tree,
/// no MLXCEL_* variables, run from another folder.
struct UserSetup {
    root: tempfile::TempDir,
    binary: PathBuf,
}

impl UserSetup {
    fn new() -> UserSetup {
        let root = tempfile::tempdir().unwrap();
        let binary = root.path().join("bin/mlxcel");
        std::fs::create_dir_all(binary.parent().unwrap()).unwrap();
        std::fs::copy(env!("CARGO_BIN_EXE_mlxcel"), &binary).unwrap();
        let gguf = root.path().join("Downloads/gemma3.gguf");
        std::fs::create_dir_all(gguf.parent().unwrap()).unwrap();
        std::fs::copy(fixtures().join("gguf/gemma3_text.gguf"), &gguf).unwrap();
        std::fs::create_dir_all(root.path().join("home")).unwrap();
        UserSetup { root, binary }
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.binary);
        c.current_dir(self.root.path().join("Downloads"))
            .env("HOME", self.root.path().join("home"));
        for (k, _) in std::env::vars() {
            if k.starts_with("MLXCEL_") || k.starts_with("CARGO") {
                c.env_remove(k);
            }
        }
        c
    }
}

#[test]
fn a_copied_binary_converts_and_runs_a_gguf_with_only_a_home() {
    let user = UserSetup::new();
    let (prompt, greedy) = reference_ids("gemma3_text");
    let out = user
        .command()
        .args(["generate", "--quiet", "--print-ids", "--max-new", "8"])
        .args(["--model", "gemma3.gguf", "--prompt-ids", &join(&prompt)])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("converted"), "{err}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        join(&greedy[..8])
    );
    let cached = user.root.path().join("home/.cache/mlxcel/gguf");
    assert_eq!(std::fs::read_dir(&cached).unwrap().count(), 1, "{cached:?}");
}

/// `serve --model FILE.gguf` converts like generate, then answers over HTTP.
#[test]
fn serve_converts_a_gguf_and_answers() {
    use std::io::{BufRead, BufReader, Read, Write};
    let user = UserSetup::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = user
        .command()
        .args(["serve", "--model", "gemma3.gguf", "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut said = Vec::new();
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap();
        let done = line.contains("listening");
        said.push(line);
        if done {
            break;
        }
    }
    let said = said.join("\n");
    let request = |body: &str| -> Option<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).ok()?;
        let mut resp = String::new();
        s.read_to_string(&mut resp).ok()?;
        Some(resp)
    };
    let body = r#"{"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}"#;
    let mut resp = None;
    for _ in 0..100 {
        resp = request(body);
        if resp.is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(said.contains("converted"), "{said}");
    let resp = resp.expect("the server answered");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"choices\""), "{resp}");
}
