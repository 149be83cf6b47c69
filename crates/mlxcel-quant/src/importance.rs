//! Importance-weighted affine quantization.
//!
//! Plain affine quantization (MLX's `quantize`) maps each group's `[min, max]` onto the codes.
//! Given a per-input-channel importance `h` (the mean squared activation each input feature
//! carries, from calibration prompts), the output error of a row is
//! `E[(x·(ŵ − w))²] ≈ Σ_j h_j (ŵ_j − w_j)²` (diagonal approximation), so the scale and bias of
//! each group should minimise the *importance-weighted* squared error instead. For every group
//! this searches a grid of clipping ranges (trimming up to 30% of the range from either end),
//! and for each candidate refits scale and bias by weighted least squares for the codes it
//! chose (twice, re-rounding in between); the best candidate (plain min/max included) wins.
//!
//! The codes are packed exactly as MLX packs affine weights: a little-endian bit stream per row,
//! value `j` at bits `[j·bits, (j+1)·bits)`, read as uint32 words (checked against MLX's own
//! `quantize` in the tests).

use half::{bf16, f16};
use mlxcel_core::{Array, Dtype};

use crate::{QuantError, QuantSpec, Quantized, Result};

/// Rounds `x` to what `dtype` stores (scales and biases are written in the source dtype).
fn round_to(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::Bfloat16 => bf16::from_f32(x).to_f32(),
        Dtype::Float16 => f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// One group's affine parameters and the weighted error they give.
fn group_error(w: &[f32], h: &[f32], scale: f32, bias: f32, max_q: f32, codes: &mut [f32]) -> f64 {
    let mut err = 0.0f64;
    for j in 0..w.len() {
        let q = if scale != 0.0 {
            ((w[j] - bias) / scale).round().clamp(0.0, max_q)
        } else {
            0.0
        };
        codes[j] = q;
        let d = (scale * q + bias - w[j]) as f64;
        err += h[j] as f64 * d * d;
    }
    err
}

/// Weighted least squares for `w ≈ s·q + b` given codes `q`.
fn refit(w: &[f32], h: &[f32], codes: &[f32]) -> Option<(f32, f32)> {
    let (mut sh, mut shq, mut shqq, mut shw, mut shqw) = (0.0f64, 0.0, 0.0, 0.0, 0.0);
    for j in 0..w.len() {
        let (hj, q, x) = (h[j] as f64, codes[j] as f64, w[j] as f64);
        sh += hj;
        shq += hj * q;
        shqq += hj * q * q;
        shw += hj * x;
        shqw += hj * q * x;
    }
    let det = sh * shqq - shq * shq;
    if det.abs() < 1e-30 || sh <= 0.0 {
        return None;
    }
    let s = (sh * shqw - shq * shw) / det;
    let b = (shw - s * shq) / sh;
    (s.is_finite() && b.is_finite()).then_some((s as f32, b as f32))
}

/// The parameters the search picks for one group.
fn search_group(w: &[f32], h: &[f32], bits: i32, dtype: Dtype) -> (f32, f32) {
    let max_q = ((1u32 << bits) - 1) as f32;
    let lo = w.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let range = hi - lo;
    let mut codes = vec![0.0f32; w.len()];
    let params = |a: f32, b: f32| {
        let s = round_to(dtype, (b - a) / max_q);
        (s, round_to(dtype, a))
    };
    let (s0, b0) = params(lo, hi);
    let mut best = (s0, b0, group_error(w, h, s0, b0, max_q, &mut codes));
    if range <= 0.0 {
        return (best.0, best.1);
    }
    const TRIM: [f32; 6] = [0.0, 0.05, 0.1, 0.15, 0.2, 0.3];
    for tl in TRIM {
        for th in TRIM {
            let (mut s, mut b) = params(lo + tl * range, hi - th * range);
            for _ in 0..3 {
                let e = group_error(w, h, s, b, max_q, &mut codes);
                if e < best.2 {
                    best = (s, b, e);
                }
                match refit(w, h, &codes) {
                    Some((s2, b2)) => (s, b) = (round_to(dtype, s2), round_to(dtype, b2)),
                    None => break,
                }
            }
        }
    }
    (best.0, best.1)
}

/// Packs codes `[rows, cols]` of `bits` bits into MLX's uint32 layout `[rows, cols·bits/32]`.
pub fn pack_codes(codes: &[u8], rows: usize, cols: usize, bits: i32) -> Vec<u32> {
    let bits = bits as usize;
    let words = cols * bits / 32;
    let mut out = vec![0u32; rows * words];
    for r in 0..rows {
        let row = &mut out[r * words..(r + 1) * words];
        for (j, &q) in codes[r * cols..(r + 1) * cols].iter().enumerate() {
            let bit = j * bits;
            let (w, off) = (bit / 32, bit % 32);
            row[w] |= (q as u32) << off;
            if off + bits > 32 {
                row[w + 1] |= (q as u32) >> (32 - off);
            }
        }
    }
    out
}

/// Quantizes `w` (`[rows, cols]`, row-major) with affine `spec`, choosing each group's scale
/// and bias to minimise `Σ_j importance[j] (ŵ_j − w_j)²`. Scales and biases are rounded to
/// `dtype`, the dtype they are stored in.
pub fn quantize_weighted_host(
    tensor: &str,
    w: &[f32],
    rows: usize,
    cols: usize,
    spec: QuantSpec,
    importance: &[f32],
    dtype: Dtype,
) -> Result<(Vec<u32>, Vec<f32>, Vec<f32>)> {
    let layout = |message: String| QuantError::Layout {
        tensor: tensor.to_string(),
        message,
    };
    if spec.mode != crate::QuantMode::Affine {
        return Err(layout(format!(
            "importance weighting applies to affine formats, not {}",
            spec.mode
        )));
    }
    let g = spec.group_size as usize;
    if g == 0 || cols % g != 0 || (cols * spec.bits as usize) % 32 != 0 {
        return Err(layout(format!(
            "row of {cols} values is not a whole number of groups of {g}"
        )));
    }
    if importance.len() != cols {
        return Err(layout(format!(
            "importance vector has {} entries for {cols} input features",
            importance.len()
        )));
    }
    if w.len() != rows * cols {
        return Err(layout(format!(
            "{} values for shape [{rows}, {cols}]",
            w.len()
        )));
    }
    // Guard against all-zero or negative importances: a small floor keeps every weight counted.
    let mean = importance.iter().map(|x| x.max(0.0) as f64).sum::<f64>() / cols as f64;
    let floor = (mean * 1e-3).max(1e-12) as f32;
    let h: Vec<f32> = importance.iter().map(|x| x.max(0.0) + floor).collect();
    let groups = cols / g;
    let max_q = ((1u32 << spec.bits) - 1) as f32;
    let mut scales = vec![0.0f32; rows * groups];
    let mut biases = vec![0.0f32; rows * groups];
    let mut codes = vec![0u8; rows * cols];
    for r in 0..rows {
        for k in 0..groups {
            let span = r * cols + k * g..r * cols + (k + 1) * g;
            let (s, b) = search_group(&w[span.clone()], &h[k * g..(k + 1) * g], spec.bits, dtype);
            scales[r * groups + k] = s;
            biases[r * groups + k] = b;
            for (c, x) in codes[span.clone()].iter_mut().zip(&w[span]) {
                let q = if s != 0.0 {
                    ((x - b) / s).round().clamp(0.0, max_q)
                } else {
                    0.0
                };
                *c = q as u8;
            }
        }
    }
    Ok((pack_codes(&codes, rows, cols, spec.bits), scales, biases))
}

/// [`quantize_weighted_host`] on an array `[.., rows, cols]` (leading axes are treated as more
/// rows), returning MLX planes with scales and biases in the array's dtype.
pub fn quantize_weighted(
    tensor: &str,
    w: &Array,
    spec: QuantSpec,
    importance: &[f32],
) -> Result<Quantized> {
    let shape = w.shape();
    let dtype = w.dtype()?;
    let Some(&cols) = shape.last() else {
        return Err(QuantError::Layout {
            tensor: tensor.into(),
            message: "a scalar cannot be quantized".into(),
        });
    };
    let rows: usize = shape[..shape.len() - 1]
        .iter()
        .map(|d| *d as usize)
        .product();
    let host = w.astype(Dtype::Float32)?.to_vec::<f32>()?;
    let (packed, scales, biases) =
        quantize_weighted_host(tensor, &host, rows, cols as usize, spec, importance, dtype)?;
    let mut wshape = shape.clone();
    let mut sshape = shape.clone();
    let n = shape.len() - 1;
    wshape[n] = cols * spec.bits / 32;
    sshape[n] = cols / spec.group_size;
    Ok(Quantized {
        weight: Array::from_slice(&packed, &wshape)?,
        scales: Array::from_slice(&scales, &sshape)?.astype(dtype)?,
        biases: Some(Array::from_slice(&biases, &sshape)?.astype(dtype)?),
    })
}

/// `Σ_rows Σ_j h_j (ŵ_ij − w_ij)²` for a dense `w` `[rows, cols]` and its reconstruction.
pub fn weighted_error(w: &[f32], w_hat: &[f32], cols: usize, importance: &[f32]) -> f64 {
    w.iter()
        .zip(w_hat)
        .enumerate()
        .map(|(i, (a, b))| importance[i % cols] as f64 * ((a - b) as f64).powi(2))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxcel_core::ops::{self, random};

    fn random_matrix(rows: i32, cols: i32, seed: u64) -> Array {
        let key = random::key(seed).unwrap();
        random::uniform(&[rows, cols], Dtype::Float32, &key)
            .unwrap()
            .add_scalar(-0.5)
            .unwrap()
    }

    #[test]
    fn packing_matches_mlx_for_every_width() {
        let w = random_matrix(4, 128, 7);
        for bits in [1, 2, 3, 4, 5, 6, 8] {
            let spec = QuantSpec::affine(64, bits);
            let q = w.quantize(spec).unwrap();
            let deq = ops::dequantize(&q.weight, &q.scales, q.biases.as_ref(), spec, None)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            let s = q.scales.to_vec::<f32>().unwrap();
            let b = q.biases.as_ref().unwrap().to_vec::<f32>().unwrap();
            let codes: Vec<u8> = deq
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let k = i / 64;
                    if s[k] == 0.0 {
                        0
                    } else {
                        ((v - b[k]) / s[k]).round() as u8
                    }
                })
                .collect();
            let ours = pack_codes(&codes, 4, 128, bits);
            assert_eq!(
                ours,
                q.weight.to_vec::<u32>().unwrap(),
                "{bits}-bit packing"
            );
        }
    }

    #[test]
    fn weighted_search_lowers_weighted_error() {
        let (rows, cols) = (16usize, 128usize);
        let w = random_matrix(rows as i32, cols as i32, 3);
        let host = w.to_vec::<f32>().unwrap();
        // A few channels carry most of the activation energy, as in real models.
        let imp: Vec<f32> = (0..cols)
            .map(|j| {
                if j % 17 == 0 {
                    50.0
                } else {
                    0.1 + (j % 5) as f32 * 0.1
                }
            })
            .collect();
        for bits in [2, 3, 4] {
            let spec = QuantSpec::affine(64, bits);
            let plain = w.quantize(spec).unwrap();
            let plain_hat = ops::dequantize(
                &plain.weight,
                &plain.scales,
                plain.biases.as_ref(),
                spec,
                None,
            )
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
            let ours = quantize_weighted("t", &w, spec, &imp).unwrap();
            let ours_hat =
                ops::dequantize(&ours.weight, &ours.scales, ours.biases.as_ref(), spec, None)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap();
            let e_plain = weighted_error(&host, &plain_hat, cols, &imp);
            let e_ours = weighted_error(&host, &ours_hat, cols, &imp);
            assert!(e_ours < e_plain * 0.9, "{bits}-bit: {e_ours} vs {e_plain}");
        }
        let e = quantize_weighted("model.x", &w, QuantSpec::affine(64, 4), &imp[..10])
            .unwrap_err()
            .to_string();
        assert!(e.contains("`model.x`") && e.contains("10 entries"), "{e}");
    }
}
