//! Converting a GGUF once into the cache folder, keyed by the file's content.

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::import::{import_gguf, ImportReport};
use super::GgufError;

/// Hex digits of the sha256 that name a cached conversion.
const KEY_LEN: usize = 16;

/// The importer's output format, stamped into each cached conversion (`.mlxcel-import`): a
/// conversion written by an importer with another stamp (older mapping, tokenizer or quant
/// handling) is converted again rather than reused. Raise it when the written checkpoint of some
/// GGUF changes.
pub const IMPORT_FORMAT: &str = "mlxcel-gguf-import 2";

const STAMP: &str = ".mlxcel-import";

/// The first 16 hex digits of the sha256 of the file at `path`.
pub fn gguf_cache_key(path: &Path) -> Result<String, GgufError> {
    let mut file = std::fs::File::open(path).map_err(|e| GgufError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| GgufError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let digest = hasher.finalize();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    Ok(hex[..KEY_LEN].to_string())
}

/// Where [`convert_gguf_cached`] put the converted checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct CachedConversion {
    /// The MLX checkpoint folder (`<cache_root>/gguf/<sha256 prefix>/`).
    pub folder: PathBuf,
    /// Whether it was converted by this call (`false`: an earlier conversion was reused).
    pub converted: bool,
    /// What this call's conversion wrote (`None` when an earlier one was reused).
    pub report: Option<ImportReport>,
}

/// Converts `gguf_path` into `<cache_root>/gguf/<first 16 hex digits of its sha256>/` unless
/// that folder already holds a finished conversion by this importer ([`IMPORT_FORMAT`]), which is
/// reused. The import is written to
/// a temporary sibling and renamed into place, so an interrupted conversion is never reused.
/// `progress(done, total, tensor)` is called after each tensor of a conversion.
pub fn convert_gguf_cached(
    gguf_path: &Path,
    cache_root: &Path,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<CachedConversion, GgufError> {
    let key = gguf_cache_key(gguf_path)?;
    let parent = cache_root.join("gguf");
    let folder = parent.join(&key);
    let stamp = std::fs::read_to_string(folder.join(STAMP)).unwrap_or_default();
    if stamp.trim() == IMPORT_FORMAT
        && folder.join("config.json").is_file()
        && folder.join("model.safetensors").is_file()
    {
        return Ok(CachedConversion {
            folder,
            converted: false,
            report: None,
        });
    }
    std::fs::create_dir_all(&parent).map_err(|e| GgufError::io(&parent, e))?;
    let staging = parent.join(format!(".{key}.partial-{}", std::process::id()));
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|e| GgufError::io(&staging, e))?;
    }
    let report = match import_gguf(gguf_path, &staging, progress) {
        Ok(report) => report,
        Err(e) => {
            // Best effort: the staging folder is only ever ours.
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    let stamp_path = staging.join(STAMP);
    if let Err(e) = std::fs::write(&stamp_path, format!("{IMPORT_FORMAT}\n")) {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(GgufError::io(&stamp_path, e));
    }
    if folder.exists() {
        // A conversion by another importer version, or a stale partial layout: replace it.
        std::fs::remove_dir_all(&folder).map_err(|e| GgufError::io(&folder, e))?;
    }
    std::fs::rename(&staging, &folder).map_err(|e| GgufError::io(&folder, e))?;
    Ok(CachedConversion {
        folder,
        converted: true,
        report: Some(report),
    })
}
