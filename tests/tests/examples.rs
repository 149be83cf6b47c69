//! Runs every example of `mlxcel-models` (built by `cargo test`, next to this test's binary)
//! against the real SmolLM2, with no `LD_LIBRARY_PATH`: the library is found because binaries
//! record it by path, and none of the examples has a build script.

use std::path::PathBuf;
use std::process::Command;

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/examples-<hash> → target/<profile>/examples/<name>
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target profile folder");
    profile_dir.join("examples").join(name)
}

fn run(name: &str, model: &PathBuf) -> String {
    let out = Command::new(example(name))
        .arg(model)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap_or_else(|e| panic!("{name}: {e} (is the example built?)"));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{name} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn every_example_runs() {
    let Some(model) = mlxcel_tests::fetched_smollm2() else {
        return;
    };
    let chat = run("chat", &model);
    assert!(chat.contains("Paris") && chat.contains("Berlin"), "{chat}");
    let streaming = run("streaming", &model);
    assert!(
        streaming.contains("Paris") && streaming.contains("Cancelled"),
        "{streaming}"
    );
    let logits = run("logits", &model);
    assert!(
        logits.lines().next().is_some_and(|l| l.contains("Paris")),
        "{logits}"
    );
    let threads = run("two_threads", &model);
    assert!(
        threads.contains("France? -> The capital of France is Paris."),
        "{threads}"
    );
    let stream = run("async_stream", &model);
    assert!(stream.contains("Paris"), "{stream}");
}
