//! mlxcel's CPU attention kernel (`cpp/cpu_attention.cc`, reached through
//! `ops::scaled_dot_product_attention` with float32 operands on the CPU) against a float64
//! host reference: grouped-query heads, no mask and the causal mask aligned to the end (a
//! prompt chunk after cached tokens), feature sizes off the vector width, and keys/values
//! read through strides (a slice of a longer cache buffer, a head transpose); and additive
//! masks (an encoder's key padding `[B, 1, 1, S]`, a full `[B, H, L, S]` one, a window).

mod common;

use common::*;
use mlxcel_core::ops::{self, AttentionMask};
use mlxcel_core::Dtype;

#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (b, hq, hk, l, s, d): (usize, usize, usize, usize, usize, usize),
    scale: f64,
    causal: bool,
    mask: Option<&[f64]>,
) -> Vec<f64> {
    let mut out = vec![0.0; b * hq * l * d];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / (hq / hk);
            for li in 0..l {
                let visible = if causal { s - l + li + 1 } else { s };
                let qrow = &q[((bi * hq + h) * l + li) * d..][..d];
                let scores: Vec<f64> = (0..visible)
                    .map(|si| {
                        let krow = &k[((bi * hk + kh) * s + si) * d..][..d];
                        let add = mask.map_or(0.0, |m| m[((bi * hq + h) * l + li) * s + si]);
                        scale * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>() + add
                    })
                    .collect();
                let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|x| (x - top).exp()).collect();
                let total: f64 = weights.iter().sum();
                for (si, w) in weights.iter().enumerate() {
                    let vrow = &v[((bi * hk + kh) * s + si) * d..][..d];
                    for di in 0..d {
                        out[((bi * hq + h) * l + li) * d + di] += w / total * vrow[di];
                    }
                }
            }
        }
    }
    out
}

#[test]
fn attention_matches_float64_reference() {
    let mut r = rng(5);
    for (b, hq, hk, l, s, d) in [
        (1, 6, 2, 1, 9, 64),
        (2, 4, 4, 5, 5, 12),
        (1, 6, 3, 5, 9, 8),
        (1, 2, 1, 3, 40, 128),
    ] {
        for causal in [false, true] {
            let q = round_to(
                &random_vec(&mut r, b * hq * l * d, -1.0, 1.0),
                Dtype::Float32,
            );
            let k = round_to(
                &random_vec(&mut r, b * hk * s * d, -1.0, 1.0),
                Dtype::Float32,
            );
            let v = round_to(
                &random_vec(&mut r, b * hk * s * d, -1.0, 1.0),
                Dtype::Float32,
            );
            let scale = 1.0 / (d as f64).sqrt();
            let want = reference(&q, &k, &v, (b, hq, hk, l, s, d), scale, causal, None);
            let dims = |h: usize, n: usize| [b as i32, h as i32, n as i32, d as i32];
            let qa = array(&q, &dims(hq, l), Dtype::Float32);
            // Keys as a slice of a longer zero-padded buffer; values as a head transpose.
            let mut padded = vec![0.0; b * hk * (s + 3) * d];
            for row in 0..b * hk {
                for si in 0..s {
                    padded[(row * (s + 3) + si) * d..][..d]
                        .copy_from_slice(&k[(row * s + si) * d..][..d]);
                }
            }
            let ka = array(&padded, &dims(hk, s + 3), Dtype::Float32)
                .slice_axis(2, 0, s as i32)
                .unwrap();
            let mut vt = vec![0.0; v.len()];
            for bi in 0..b {
                for h in 0..hk {
                    for si in 0..s {
                        vt[((bi * s + si) * hk + h) * d..][..d]
                            .copy_from_slice(&v[((bi * hk + h) * s + si) * d..][..d]);
                    }
                }
            }
            let va = array(
                &vt,
                &[b as i32, s as i32, hk as i32, d as i32],
                Dtype::Float32,
            )
            .transpose(&[0, 2, 1, 3])
            .unwrap();
            let mask = if causal {
                AttentionMask::Causal
            } else {
                AttentionMask::None
            };
            let got =
                ops::scaled_dot_product_attention(&qa, &ka, &va, scale as f32, mask, None).unwrap();
            assert_eq!(got.shape(), dims(hq, l).to_vec());
            for (i, (g, w)) in read(&got).iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "b{b} hq{hq} hk{hk} l{l} s{s} d{d} causal={causal}: element {i}: {g} vs {w}"
                );
            }
        }
    }
}

/// One additive mask of the kind `mask_kind` names, as the array given to the kernel and in
/// full `[b, hq, l, s]` for the reference.
fn additive_mask(
    r: &mut rand::rngs::StdRng,
    mask_kind: &str,
    (b, hq, l, s): (usize, usize, usize, usize),
) -> (mlxcel_core::Array, Vec<f64>) {
    let mut full = vec![0.0; b * hq * l * s];
    let at = |bi: usize, h: usize, li: usize, si: usize| ((bi * hq + h) * l + li) * s + si;
    match mask_kind {
        // Key padding, as encoders build it: row bi keeps its first s - bi keys.
        "padding" => {
            let keep: Vec<f64> = (0..b)
                .flat_map(|bi| (0..s).map(move |si| if si < s - bi { 0.0 } else { -1e9 }))
                .collect();
            for bi in 0..b {
                for h in 0..hq {
                    for li in 0..l {
                        for si in 0..s {
                            full[at(bi, h, li, si)] = keep[bi * s + si];
                        }
                    }
                }
            }
            let arr = array(&keep, &[b as i32, 1, 1, s as i32], Dtype::Float32);
            (arr, full)
        }
        // A sliding window |i - j| <= 2 shared by every row and head: [l, s].
        "window" => {
            let win: Vec<f64> = (0..l)
                .flat_map(|li| {
                    (0..s).map(move |si| {
                        if (li as i64 - si as i64).abs() <= 2 {
                            0.0
                        } else {
                            -1e9
                        }
                    })
                })
                .collect();
            for bi in 0..b {
                for h in 0..hq {
                    for li in 0..l {
                        for si in 0..s {
                            full[at(bi, h, li, si)] = win[li * s + si];
                        }
                    }
                }
            }
            (array(&win, &[l as i32, s as i32], Dtype::Float32), full)
        }
        // Arbitrary additive biases, every element its own.
        _ => {
            full = round_to(&random_vec(r, full.len(), -3.0, 3.0), Dtype::Float32);
            let shape = [b as i32, hq as i32, l as i32, s as i32];
            (array(&full, &shape, Dtype::Float32), full.clone())
        }
    }
}

#[test]
fn masked_attention_matches_float64_reference() {
    let mut r = rng(11);
    // Lengths below, at and past the 16-lane vectors; feature sizes on and off them.
    for (b, hq, hk, l, s, d) in [
        (3, 4, 4, 7, 7, 32),
        (2, 6, 2, 17, 17, 16),
        (2, 2, 1, 33, 33, 12),
        (1, 3, 3, 5, 40, 64),
    ] {
        for mask_kind in ["padding", "window", "full"] {
            if mask_kind == "window" && l != s {
                continue;
            }
            let q = round_to(
                &random_vec(&mut r, b * hq * l * d, -1.0, 1.0),
                Dtype::Float32,
            );
            let k = round_to(
                &random_vec(&mut r, b * hk * s * d, -1.0, 1.0),
                Dtype::Float32,
            );
            let v = round_to(
                &random_vec(&mut r, b * hk * s * d, -1.0, 1.0),
                Dtype::Float32,
            );
            let (mask, full) = additive_mask(&mut r, mask_kind, (b, hq, l, s));
            let scale = 1.0 / (d as f64).sqrt();
            let want = reference(&q, &k, &v, (b, hq, hk, l, s, d), scale, false, Some(&full));
            let shape = |h: usize, n: usize| [b as i32, h as i32, n as i32, d as i32];
            let got = ops::scaled_dot_product_attention(
                &array(&q, &shape(hq, l), Dtype::Float32),
                &array(&k, &shape(hk, s), Dtype::Float32),
                &array(&v, &shape(hk, s), Dtype::Float32),
                scale as f32,
                AttentionMask::Array(&mask),
                None,
            )
            .unwrap();
            assert_eq!(got.shape(), shape(hq, l).to_vec());
            for (i, (g, w)) in read(&got).iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "b{b} hq{hq} hk{hk} l{l} s{s} d{d} mask {mask_kind}: element {i}: {g} vs {w}"
                );
            }
        }
    }
}
