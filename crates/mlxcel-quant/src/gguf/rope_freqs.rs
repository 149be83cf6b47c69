//! Llama 3's rope scaling, back from llama.cpp's `rope_freqs.weight`.
//!
//! llama.cpp's converter (`LlamaModel.generate_extra_tensors` in `convert_hf_to_gguf.py`) does
//! not write HF's `rope_scaling = {rope_type: llama3, factor, low_freq_factor,
//! high_freq_factor, original_max_position_embeddings}` as metadata: it writes the table it
//! implies, one divisor per rotary frequency. Only the table reaches the file, and different
//! parameters can give the same table (scaling the context and both frequency factors together
//! changes nothing), so [`reconstruct_llama3`] tries the usual values and keeps the first set
//! whose table reproduces every stored factor; since HF computes its frequencies from the same
//! formula, any such set gives the model llama.cpp runs.

use serde_json::{json, Value};

/// The GGUF tensor holding the factor table.
pub(crate) const ROPE_FREQS: &str = "rope_freqs.weight";

/// How far a recomputed factor may be from the stored one, relative to it. The converter
/// computes in float32 (frequencies included); the float64 recomputation here lands within
/// 2e-7 of Llama 3.1's table.
const TOLERANCE: f64 = 1e-6;

/// HF's `llama3` rope-scaling parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Llama3Rope {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: u64,
}

impl Llama3Rope {
    /// llama.cpp's factor for each of the `head_dim / 2` rotary frequencies.
    fn factors(&self, theta: f64, head_dim: u64) -> Vec<f64> {
        let old_ctx = self.original_max_position_embeddings as f64;
        let low_freq_wavelen = old_ctx / self.low_freq_factor;
        let high_freq_wavelen = old_ctx / self.high_freq_factor;
        (0..head_dim)
            .step_by(2)
            .map(|i| {
                let freq = 1.0 / theta.powf(i as f64 / head_dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                if wavelen < high_freq_wavelen {
                    1.0
                } else if wavelen > low_freq_wavelen {
                    self.factor
                } else {
                    let smooth = (old_ctx / wavelen - self.low_freq_factor)
                        / (self.high_freq_factor - self.low_freq_factor);
                    1.0 / ((1.0 - smooth) / self.factor + smooth)
                }
            })
            .collect()
    }

    /// The `rope_scaling` entry of `config.json`.
    pub fn to_json(self) -> Value {
        json!({
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        })
    }
}

/// Recovers parameters whose table matches `stored` (the `rope_freqs.weight` values) within
/// [`TOLERANCE`], for rope base `theta` and `head_dim`. The factor is the table's largest entry;
/// the frequency factors come from the values Llama 3.x and HF's defaults use, and the original
/// context from the GGUF's `rope.scaling.original_context_length` (`original_ctx`) when present,
/// else llama.cpp's default 8192 and the powers of two up to `n_ctx` (the extended context).
/// The error says why nothing fits.
pub(crate) fn reconstruct_llama3(
    stored: &[f32],
    theta: f64,
    head_dim: u64,
    n_ctx: u64,
    original_ctx: Option<u64>,
) -> Result<Llama3Rope, String> {
    if stored.len() as u64 != head_dim / 2 {
        return Err(format!(
            "{} factors, expected {} (head_dim {head_dim} / 2)",
            stored.len(),
            head_dim / 2
        ));
    }
    let factor = stored.iter().fold(f64::NAN, |m, v| m.max(*v as f64));
    if !factor.is_finite() || factor < 1.0 {
        return Err(format!(
            "largest factor {factor} is not a llama3 scale factor (≥ 1)"
        ));
    }
    let mut contexts: Vec<u64> = original_ctx.into_iter().chain([8192]).collect();
    contexts.extend(
        (0..u64::BITS)
            .map(|k| 1u64 << k)
            .take_while(|c| *c <= n_ctx),
    );
    contexts.dedup();
    let pairs = [1.0, 2.0, 0.5]
        .into_iter()
        .flat_map(|low| [4.0, 2.0, 8.0, 16.0, 32.0].map(|high| (low, high)))
        .filter(|(low, high)| high > low);
    for (low_freq_factor, high_freq_factor) in pairs {
        for &original_max_position_embeddings in &contexts {
            let candidate = Llama3Rope {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            };
            let reproduces = candidate
                .factors(theta, head_dim)
                .iter()
                .zip(stored)
                .all(|(want, got)| (want - *got as f64).abs() <= TOLERANCE * (*got as f64).abs());
            if reproduces {
                return Ok(candidate);
            }
        }
    }
    Err(format!(
        "no llama3 rope scaling (factor {factor}) reproduces the stored factors"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA_3_1: Llama3Rope = Llama3Rope {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };

    fn table(p: Llama3Rope, theta: f64, head_dim: u64) -> Vec<f32> {
        p.factors(theta, head_dim)
            .iter()
            .map(|v| *v as f32)
            .collect()
    }

    #[test]
    fn llama_3_1_table_gives_back_its_parameters() {
        // Llama 3.1 8B: head_dim 128, theta 500000, 131072 positions.
        let stored = table(LLAMA_3_1, 500000.0, 128);
        assert!(
            stored.iter().any(|f| *f > 1.0 && *f < 8.0),
            "the table has smoothed entries"
        );
        let got = reconstruct_llama3(&stored, 500000.0, 128, 131072, None).unwrap();
        assert_eq!(got, LLAMA_3_1);
    }

    #[test]
    fn the_original_context_from_metadata_is_used() {
        let p = Llama3Rope {
            factor: 32.0,
            original_max_position_embeddings: 6000,
            ..LLAMA_3_1
        };
        let stored = table(p, 500000.0, 64);
        assert!(reconstruct_llama3(&stored, 500000.0, 64, 131072, None).is_err());
        assert_eq!(
            reconstruct_llama3(&stored, 500000.0, 64, 131072, Some(6000)).unwrap(),
            p
        );
    }

    #[test]
    fn a_perturbed_factor_is_refused() {
        let mut stored = table(LLAMA_3_1, 500000.0, 128);
        let smoothed = stored.iter().position(|f| *f > 1.0 && *f < 8.0).unwrap();
        stored[smoothed] *= 1.0 + 1e-5;
        let err = reconstruct_llama3(&stored, 500000.0, 128, 131072, None).unwrap_err();
        assert!(err.contains("reproduces"), "{err}");
        // A wrong length is named as such.
        let err = reconstruct_llama3(&stored[1..], 500000.0, 128, 131072, None).unwrap_err();
        assert!(err.contains("expected 64"), "{err}");
    }
}
