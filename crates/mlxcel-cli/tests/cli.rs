//! The `mlxcel` binary end to end on a fixture: machine-use generation and logits output.

use std::process::Command;

fn mlxcel() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mlxcel"))
}

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

/// The prompt and greedy ids of a fixture's reference (int32 tensors in reference.safetensors).
fn reference_ids(name: &str) -> (Vec<i32>, Vec<i32>) {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let read = |key: &str| -> Vec<i32> {
        let off = &header[key]["data_offsets"];
        let (a, b) = (
            off[0].as_u64().unwrap() as usize + 8 + n,
            off[1].as_u64().unwrap() as usize + 8 + n,
        );
        bytes[a..b]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    (read("prompt_ids"), read("greedy_ids"))
}

#[test]
fn generate_prompt_ids_prints_the_greedy_ids() {
    let (prompt, greedy) = reference_ids("gemma3_text");
    let ids: Vec<String> = prompt.iter().map(i32::to_string).collect();
    for chunk in ["3", "64"] {
        let out = mlxcel()
            .args([
                "generate",
                "--quiet",
                "--print-ids",
                "--max-new",
                "16",
                "--prefill-chunk",
                chunk,
                "--model",
            ])
            .arg(fixture("gemma3_text"))
            .args(["--prompt-ids", &ids.join(",")])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let want: Vec<String> = greedy.iter().map(i32::to_string).collect();
        assert_eq!(
            String::from_utf8(out.stdout).unwrap().trim(),
            want.join(",")
        );
    }
}

#[test]
fn logits_writes_npy_and_bad_input_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("l.npy");
    let status = mlxcel()
        .args(["logits", "--prompt-ids", "1,2,3", "--out"])
        .arg(&out)
        .arg("--model")
        .arg(fixture("llama"))
        .status()
        .unwrap();
    assert!(status.success());
    let bytes = std::fs::read(&out).unwrap();
    assert!(bytes.starts_with(b"\x93NUMPY\x01\x00"));
    assert!(String::from_utf8_lossy(&bytes[10..128]).contains("'shape': (3, 512)"));
    assert_eq!(bytes.len(), 128 + 3 * 512 * 4);
    let bad = mlxcel()
        .args(["logits", "--prompt-ids", "1,99999", "--out"])
        .arg(&out)
        .arg("--model")
        .arg(fixture("llama"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr)
        .contains("token 99999 is outside the vocabulary of 512"));
    let missing = mlxcel()
        .args(["generate", "--user", "hi", "--model", "/nonexistent/model"])
        .output()
        .unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/model"));
}

#[test]
fn an_invalid_runtime_variable_is_an_error_naming_it() {
    let out = mlxcel()
        .args(["logits", "--prompt-ids", "1,2", "--out"])
        .arg(std::env::temp_dir().join("mlxcel-never-written.npy"))
        .arg("--model")
        .arg(fixture("llama"))
        .env("MLXCEL_CUDA_QMV", "banana")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("MLXCEL_CUDA_QMV=banana: expected 0, 1 or a launch shape NWxRPW"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Out-of-range flags fail before loading, with an error naming the flag and its value.
#[test]
fn out_of_range_flags_name_the_flag() {
    let model = fixture("llama");
    for (flag, value, expected) in [
        ("--top-p", "2", "--top-p 2: must be in (0, 1]"),
        ("--top-p", "0", "--top-p 0: must be in (0, 1]"),
        ("--temperature", "-1", "--temperature -1: must be finite"),
        ("--temperature", "NaN", "--temperature NaN: must be finite"),
        ("--min-p", "1.5", "--min-p 1.5: must be in [0, 1]"),
        (
            "--repetition-penalty",
            "0",
            "--repetition-penalty 0: must be finite",
        ),
        (
            "--prefill-chunk",
            "0",
            "--prefill-chunk 0: must be at least 1",
        ),
        ("--max-context", "0", "--max-context 0: must be at least 1"),
    ] {
        let out = mlxcel()
            .args(["generate", "--model"])
            .arg(&model)
            .args(["--prompt-ids", "1,2", "--print-ids"])
            .arg(format!("{flag}={value}"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} should fail");
        assert!(
            out.status.code().is_some(),
            "{flag} {value}: killed by a signal"
        );
        assert!(stderr.contains(expected), "{flag} {value}: {stderr}");
    }
}

/// A huge --max-context reports that the run does not fit instead of wrapping around.
#[test]
fn huge_max_context_does_not_fit() {
    let out = mlxcel()
        .args(["generate", "--model"])
        .arg(fixture("llama"))
        .args(["--prompt-ids", "1", "--estimate-memory", "--max-context"])
        .arg(u64::MAX.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("does NOT fit"), "{stdout}");
}

#[test]
fn embed_prints_one_json_line_per_text_in_order() {
    let out = mlxcel()
        .args(["embed", "--model"])
        .arg(fixture("bert"))
        .args(["--text", "first text", "--text", "x", "--dimensions", "8"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["index"], i);
        let v: Vec<f64> = l["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(v.len(), 8);
        let norm: f64 = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    }
    // No texts, and npy without --out, are errors saying what to give.
    let out = mlxcel()
        .args(["embed", "--model"])
        .arg(fixture("bert"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no texts"));
    let out = mlxcel()
        .args(["embed", "--model"])
        .arg(fixture("bert"))
        .args(["--text", "a", "--format", "npy"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--out"));
}

/// `mlxcel inspect --surgery FILE --adapter DIR` loads with both and reports what each did
/// (here the adapter stays unfused over the quantized base); a failing rule is an error.
#[test]
fn inspect_reports_the_edits_applied() {
    let tmp = tempfile::tempdir().unwrap();
    let yaml = tmp.path().join("edits.yaml");
    std::fs::write(
        &yaml,
        "- op: scale\n  glob: 'model.norm.weight'\n  factor: 0.5\n",
    )
    .unwrap();
    let adapter = fixture("../adapters/llama-lora-mlx");
    let out = mlxcel()
        .arg("inspect")
        .arg(fixture("llama-affine4-g64"))
        .arg("--surgery")
        .arg(&yaml)
        .arg("--adapter")
        .arg(&adapter)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let edits: Vec<&str> = stdout.lines().filter(|l| l.starts_with("edit ")).collect();
    assert_eq!(edits.len(), 2, "{stdout}");
    assert!(
        edits[0].contains("kept unfused as runtime adapter `adapter`"),
        "{stdout}"
    );
    assert!(
        edits[1].contains("surgery rule 1: scale `model.norm.weight` on 1 tensor"),
        "{stdout}"
    );

    std::fs::write(
        &yaml,
        "- op: scale\n  glob: 'no.such.tensor'\n  factor: 0.5\n",
    )
    .unwrap();
    let out = mlxcel()
        .arg("inspect")
        .arg(fixture("llama"))
        .arg("--surgery")
        .arg(&yaml)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rule 1") && stderr.contains("no.such.tensor"),
        "{stderr}"
    );
}

/// A checkpoint whose config disagrees with its tensors: one `error:` line naming the folder and
/// the tensor, printed once (the model layer's error is both displayed inline and exposed as the
/// source), exit status 1, no backtrace even when `RUST_BACKTRACE` is set.
#[test]
fn a_bad_checkpoint_is_reported_once_on_one_line() {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("llama")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let config_path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["hidden_size"] = 48.into();
    std::fs::write(&config_path, config.to_string()).unwrap();

    let out = mlxcel()
        .env("RUST_BACKTRACE", "1")
        .args(["generate", "--quiet", "--prompt", "hi", "--model"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let message = "tensor `model.embed_tokens.weight` has shape [512, 64], expected [512, 48]";
    assert_eq!(stderr.matches(message).count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(!stderr.contains("backtrace"), "{stderr}");
}

/// `mlxcel rerank` prints the reference scores (sentence-transformers' `CrossEncoder`) in input
/// order, and best first with `--sorted`.
#[test]
fn rerank_prints_reference_scores_in_input_order_or_sorted() {
    let dir = fixture("bert-reranker");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    // The first three pairs share the query.
    let pairs = &reference["pairs"].as_array().unwrap()[..3];
    let query = pairs[0]["query"].as_str().unwrap();
    let run = |sorted: bool| -> Vec<serde_json::Value> {
        let mut cmd = mlxcel();
        cmd.args(["rerank", "--model"])
            .arg(&dir)
            .args(["--query", query]);
        for p in pairs {
            assert_eq!(p["query"], query);
            cmd.args(["--document", p["document"].as_str().unwrap()]);
        }
        if sorted {
            cmd.arg("--sorted");
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let lines = run(false);
    assert_eq!(lines.len(), 3);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["index"], i);
        let (got, want) = (
            l["score"].as_f64().unwrap(),
            pairs[i]["score"].as_f64().unwrap(),
        );
        assert!((got - want).abs() <= 1e-4, "document {i}: {got} vs {want}");
    }
    let sorted = run(true);
    let scores: Vec<f64> = sorted
        .iter()
        .map(|l| l["score"].as_f64().unwrap())
        .collect();
    assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");
    let out = mlxcel()
        .args(["rerank", "--model"])
        .arg(&dir)
        .args(["--query", "q"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("no documents"));
}

/// `mlxcel inspect` on the special routes: Mistral 3's route with its lazy vision tower, and
/// K-EXAONE's multi-token-prediction block, each listed as its own unused role.
#[test]
fn inspect_reports_the_parts_a_text_load_leaves_out() {
    let run = |name: &str| {
        let out = mlxcel().arg("inspect").arg(fixture(name)).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let mistral3 = run("mistral3");
    assert!(mistral3.contains("type      Mistral3 ("), "{mistral3}");
    assert!(
        mistral3.contains("routes    directory Mistral3Dynamic"),
        "{mistral3}"
    );
    assert!(
        mistral3.lines().any(|l| l.starts_with("vision (lazy)")),
        "{mistral3}"
    );
    let exaone = run("exaone_moe");
    assert!(exaone.contains("type      ExaoneMoe ("), "{exaone}");
    assert!(
        exaone.lines().any(|l| l.starts_with("mtp (unused)")),
        "{exaone}"
    );
}

#[test]
fn prepare_external_ple_writes_a_view_that_generates_and_inspects_as_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("gemma3n_text")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = mlxcel();
        cmd.args(args);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    };
    let model = dir.path().to_str().unwrap();
    let out = run(&["prepare-external-ple", "--model", model], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("prepared "), "{stdout}");
    assert!(
        stdout.contains("ple-store.json: 128 rows × 64 (unquantized float32)"),
        "{stdout}"
    );
    let out = run(&["prepare-external-ple", "--model", model, "--verify"], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("verified "));

    let (prompt, greedy) = reference_ids("gemma3n_text");
    let ids: Vec<String> = prompt.iter().map(i32::to_string).collect();
    let want: Vec<String> = greedy.iter().map(i32::to_string).collect();
    let args = [
        "generate",
        "--print-ids",
        "--max-new",
        "16",
        "--prefill-chunk",
        "3",
        "--model",
        model,
        "--prompt-ids",
        &ids.join(","),
    ];
    let out = run(
        &args,
        &[
            ("MLXCEL_PLE_IO", "direct"),
            ("MLXCEL_PLE_CACHE_BYTES", "2560"),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want.join(","));
    assert!(
        stderr.contains("[PLE table: 128 rows × 64 (unquantized float32), 0.0 MiB on disk; MLXCEL_PLE_IO=direct, a row cache of 0.0 MiB (10 rows)]"),
        "{stderr}"
    );
    assert!(stderr.contains("[PLE rows: "), "{stderr}");

    let out = run(
        &["inspect", model, "--estimate-memory"],
        &[("MLXCEL_PLE_IO", "ram")],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("ple       [PLE table: 128 rows × 64"),
        "{stdout}"
    );
    assert!(stdout.contains("the whole table in memory"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("per-layer embed (row cache)")),
        "{stdout}"
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("ple rows                           32768")),
        "{stdout}"
    );

    let out = run(
        &[
            "prepare-external-ple",
            "--model",
            model,
            "--quantize",
            "int8",
        ],
        &[],
    );
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--quantize int8: expected affine4"));
    let out = run(
        &[
            "prepare-external-ple",
            "--model",
            model,
            "--quantize",
            "affine4",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("(affine 4-bit g32)"));
    let rows = dir.path().join("ple-q4.rows");
    let mut bytes = std::fs::read(&rows).unwrap();
    bytes[7] ^= 0x10;
    std::fs::write(&rows, bytes).unwrap();
    let out = run(&["prepare-external-ple", "--model", model, "--verify"], &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the row file is corrupt or was changed"),
        "{stderr}"
    );
}

/// `mlxcel inspect` on a full Gemma 3n checkpoint: the audio tower and both multimodal embedders
/// are listed as unused roles (the text-only load leaves them out), the per-layer table as its
/// own role.
#[test]
fn inspect_reports_gemma3n_towers_left_out() {
    let out = mlxcel()
        .arg("inspect")
        .arg(fixture("gemma3n"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("type      Gemma3n ("), "{text}");
    assert!(text.contains("routes    directory Nonstandard"), "{text}");
    for role in ["audio (unused)", "vision (unused)", "per-layer embed"] {
        assert!(text.lines().any(|l| l.starts_with(role)), "{role}: {text}");
    }
}
