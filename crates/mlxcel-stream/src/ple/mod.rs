//! External per-layer-embedding (PLE) storage: a model's huge per-layer-embedding table
//! (Gemma 3n's `embed_tokens_per_layer`, billions of parameters) stays on disk and the rows of
//! each pass's tokens are read on demand.
//!
//! ## Selecting it
//!
//! `config.json` declares `text_config.ple_storage` (or a top-level `ple_storage`):
//! `{"manifest": "ple-store.json", "cache_rows": 0}`. The manifest path is relative to the model
//! folder and must resolve inside it (absolute paths and `..` are refused); a list of entries
//! (more than one table) is refused, as is a checkpoint with more than one table when preparing:
//! one manifest describes one table. mlx-vlm's `cache_rows` is accepted and reported; mlxcel
//! sizes its cache in bytes (`MLXCEL_PLE_CACHE_BYTES`).
//!
//! ## The manifest (mlx-vlm's version 2, accepted as is)
//!
//! As mlx-vlm's `QuantizedMMapNGramEmbedding` reads it:
//! - `version`: 2; `source_root`: the folder of the tensor files, relative to the manifest's
//!   folder (mlxcel also refuses an absolute one, and one resolving outside the model folder);
//!   `row_width`: values per row, a multiple of the group size; `cache_rows` (optional, ≥ 0).
//! - `quantization`: `{"bits": 4, "group_size": 32, "mode": "affine"}` (planes `weight` U32
//!   `[rows, width/8]`, `scales` and `biases` BF16 `[rows, width/32]`) or `{"bits": 4,
//!   "group_size": 16, "mode": "nvfp4"}` (`weight` U32, `scales` U8 `[rows, width/16]`).
//!   mlxcel's extensions: `null` for unquantized rows (one `weight` plane, F32/F16/BF16
//!   `[rows, width]`), so that a streamed table can match a resident one bit for bit; and, in
//!   the `safetensors_ranges` layout, affine `scales` and `biases` of F32 or F16 (as mlx-lm
//!   leaves them when it quantizes a float32 or float16 checkpoint).
//! - `layout`: `"safetensors_ranges"` (the default): `shards`, contiguous from row 0, each
//!   `{row_start, row_count, weight, scales[, biases]}` with every tensor `{file, offset, dtype,
//!   shape}` (`file` a plain name under `source_root`, `offset` the absolute byte offset of its
//!   data); each must match its file's safetensors header (a tensor starts at `offset` with that
//!   dtype and shape); an optional top-level `row_count` must equal the shards' sum.
//!   `"interleaved_q4"`: `data_file` (a plain name beside the manifest) holding `row_count`
//!   records of `row_stride` bytes, each the row's planes back to back in the order above; the
//!   file's size must be `row_count × row_stride`.
//! - mlxcel's extension: `sha256`, per row file (path relative to the model folder) its SHA-256,
//!   written by [`prepare`] and checked by [`verify`].
//!
//! Every refusal is a [`StreamError::Layout`](crate::StreamError::Layout) naming the manifest
//! (or `config.json`) and the field.
//!
//! ## Reading ([`PleStore`])
//!
//! `MLXCEL_PLE_IO`: `mmap` (default; the file's size is checked before each copy so a file
//! truncated since it was mapped is an error, though one truncated during the copy can still
//! fault), `direct` (`O_DIRECT` reads into aligned buffers: a truncated file is always an error)
//! or `ram` (the table read into memory at load). An LRU cache of `MLXCEL_PLE_CACHE_BYTES`
//! (default 0.5 GiB, in whole rows) keeps recently used rows; repeats inside one pass are read
//! once. [`PleStore::prefetch`] starts reading the next prefill chunk's rows on a background
//! thread (gather-ahead) while the current chunk computes. Missing rows are read with the bounded
//! parallel reads expert streaming uses ([`crate::io`]). A read error is returned to the caller.
//! Rows come back in the compute dtype: unquantized rows cast as the resident load casts, and
//! quantized rows through MLX's own `dequantize`.

mod layout;
mod prepare;
mod store;

pub use layout::{
    Extent, LayoutKind, PleLayout, PleStorageConfig, RowFormat, Shard, INTERLEAVED_FILE,
    MANIFEST_FILE, MANIFEST_VERSION,
};
pub use prepare::{find_table, prepare, verify, PrepareQuant, PLE_TENSOR_SUFFIX};
pub use store::{resident_bytes, PleStats, PleStore};
