// Shared by the examples: the model folder from the first argument, else the SmolLM2 import that
// `cargo xtask fetch-models` makes.

use std::path::PathBuf;

pub fn model_dir() -> PathBuf {
    match std::env::args().nth(1) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from("~/.cache/mlxcel/models/SmolLM2-135M-Instruct-4bit"),
    }
}
