//! Dense copies of quantized layers kept for prefill, within a device-memory budget.
//!
//! On a GPU, prefill runs a quantized layer as dequantize + dense GEMM (see
//! [`super::dequantize_rows_threshold`]). Dequantizing writes the whole layer in the compute
//! dtype on every prompt: for a Llama-8B 4-bit shape that is 14 GB of bf16 per prompt, about a
//! third of a 512-token prefill on an H100. Keeping the first dequantization instead makes every
//! later prompt run the dense GEMMs alone, at the bf16 model's prefill speed, for the cost of
//! the dense copy's memory. The copy is the very array the transient path would compute (same
//! kernel, same rounding), so outputs do not change.
//!
//! The budget (`MLXCEL_PREFILL_DENSE_BYTES`; by default a quarter of a CUDA GPU's memory, while
//! MLX's active memory stays under half of it, and none on the CPU or on Apple GPUs, whose
//! memory is the system's) is shared by every model of the process: layers are kept in the
//! order prefill first reaches them until it is spent, and the rest dequantize per prompt as
//! before. A copy gives its bytes back when the last clone of its layer is dropped.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use mlxcel_core::{Array, Device};

use crate::Result;

/// Bytes held by kept copies, all models of the process together.
static KEPT_BYTES: AtomicU64 = AtomicU64::new(0);

/// The share of a CUDA GPU's memory dense copies may take when `MLXCEL_PREFILL_DENSE_BYTES` is
/// unset.
const DEFAULT_GPU_SHARE: u64 = 4;

/// How much device memory dense copies may use.
enum Budget {
    /// `MLXCEL_PREFILL_DENSE_BYTES`: exactly this many bytes (0 = none kept).
    Set(u64),
    /// The default on a CUDA GPU of `device` bytes: a quarter of it, and only while MLX's active
    /// memory with the copy stays under half of it, so that a model filling most of the GPU
    /// (weights, KV caches, a server's batches) is not pushed out of memory by its copies.
    Default { device: u64 },
}

fn budget() -> Budget {
    if let Some(bytes) = mlxcel_core::policy::with(|p| p.prefill_dense_bytes) {
        return Budget::Set(bytes);
    }
    if !mlxcel_core::cuda_kernels::on_gpu().unwrap_or(false) {
        return Budget::Set(0);
    }
    match Device::Gpu.memory_bytes() {
        Ok(Some(bytes)) => Budget::Default {
            device: bytes as u64,
        },
        _ => Budget::Set(0),
    }
}

/// Reserves `bytes` of the budget; false (nothing reserved) when they do not fit.
fn reserve(bytes: u64) -> bool {
    let limit = match budget() {
        Budget::Set(limit) => limit,
        Budget::Default { device } => {
            let Ok(active) = mlxcel_core::memory::active_bytes() else {
                return false;
            };
            if (active as u64).saturating_add(bytes) > device / 2 {
                return false;
            }
            device / DEFAULT_GPU_SHARE
        }
    };
    KEPT_BYTES
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |kept| {
            kept.checked_add(bytes).filter(|&total| total <= limit)
        })
        .is_ok()
}

/// Bytes currently held by kept dense copies in this process.
pub fn prefill_dense_bytes_kept() -> u64 {
    KEPT_BYTES.load(Ordering::SeqCst)
}

/// A kept copy, held as the transposed view `[in, out]` the GEMM reads: once evaluated it is a
/// leaf of later prompts' graphs, where a fresh `transpose` would be one more node per layer
/// and prompt (on a GPU, MLX spends host time on every node). Its bytes go back to the budget
/// when it is dropped.
struct Kept {
    dense_t: Array,
    bytes: u64,
}

impl Drop for Kept {
    fn drop(&mut self) {
        KEPT_BYTES.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

/// The slot of one quantized layer: empty until a prefill keeps its dense copy. Clones of the
/// layer share it.
#[derive(Clone, Default)]
pub struct PrefillDense(Rc<RefCell<Option<Kept>>>);

impl std::fmt::Debug for PrefillDense {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept = self.0.borrow();
        match kept.as_ref() {
            Some(k) => write!(f, "PrefillDense(kept, {} bytes)", k.bytes),
            None => write!(f, "PrefillDense(empty)"),
        }
    }
}

impl PrefillDense {
    /// The layer's dense weight in `dtype`, transposed (`[in, out]`, a view): the kept copy
    /// when there is one in that dtype, else `dequantize()`'s, kept when the budget has room
    /// for it.
    pub(crate) fn get_or_dequantize_t(
        &self,
        dtype: mlxcel_core::Dtype,
        dequantize: impl FnOnce() -> Result<Array>,
    ) -> Result<Array> {
        if let Some(k) = self.0.borrow().as_ref() {
            if k.dense_t.dtype()? == dtype {
                return Ok(k.dense_t.clone());
            }
        }
        let dense_t = dequantize()?.t()?;
        let bytes = dense_t.nbytes() as u64;
        let mut slot = self.0.borrow_mut();
        // A copy in another dtype (a model run in two compute dtypes) is replaced, its bytes
        // returned first.
        *slot = None;
        if reserve(bytes) {
            *slot = Some(Kept {
                dense_t: dense_t.clone(),
                bytes,
            });
        }
        Ok(dense_t)
    }
}
