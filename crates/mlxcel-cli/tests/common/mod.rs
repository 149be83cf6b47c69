//! What the CLI's vision integration tests share: the binary, the fixture folder, the
//! transformers references stored next to each fixture and the `.npy` files `mlxcel logits`
//! writes. Each test crate uses a subset.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The `mlxcel` binary under test.
pub fn mlxcel() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mlxcel"))
}

/// `path` under `tests/fixtures/vision`.
pub fn vision(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vision")
        .join(path)
}

/// Panics with the command's stderr unless it succeeded.
pub fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A fixture's `reference.safetensors` (written by its generator from transformers' run): int32
/// ids and float32 logits, read without a safetensors dependency.
pub struct Reference {
    header: serde_json::Value,
    data: Vec<u8>,
}

impl Reference {
    /// `tests/fixtures/vision/<model>/reference.safetensors`.
    pub fn open(model: &str) -> Reference {
        let bytes = std::fs::read(vision(&format!("{model}/reference.safetensors"))).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        Reference {
            header,
            data: bytes[8 + n..].to_vec(),
        }
    }

    fn words(&self, name: &str) -> impl Iterator<Item = [u8; 4]> + '_ {
        let off = &self.header[name]["data_offsets"];
        let (a, b) = (
            off[0]
                .as_u64()
                .unwrap_or_else(|| panic!("no tensor {name}")) as usize,
            off[1].as_u64().unwrap() as usize,
        );
        self.data[a..b]
            .chunks_exact(4)
            .map(|c| c.try_into().unwrap())
    }

    /// An int32 tensor as token ids.
    pub fn ids(&self, name: &str) -> Vec<u32> {
        self.words(name)
            .map(|w| i32::from_le_bytes(w) as u32)
            .collect()
    }

    /// A float32 tensor, flattened.
    pub fn f32s(&self, name: &str) -> Vec<f32> {
        self.words(name).map(f32::from_le_bytes).collect()
    }
}

/// The float32 values of a `.npy` file `mlxcel logits --out` wrote (format 1.0 header).
pub fn read_npy_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The largest absolute difference between two equally long slices.
pub fn max_abs_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}
