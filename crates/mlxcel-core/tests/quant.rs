//! Quantization in every MLX mode: round trips within the format's error bound, dequantize
//! against an independent decoder of the packed planes, and the quantized matmuls against
//! dense matmuls of the dequantized weights.

mod common;

use common::*;
use mlxcel_core::ops::{self, QuantMode, QuantSpec};
use mlxcel_core::{Array, Dtype};

/// Unpacks `bits`-wide unsigned codes from little-endian uint32 words, LSB first (MLX's layout
/// for every width, including 3, 5 and 6 bits which straddle bytes).
fn unpack(words: &[u32], bits: usize, count: usize) -> Vec<u32> {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    (0..count)
        .map(|i| {
            let mut v = 0u32;
            for b in 0..bits {
                let bit = i * bits + b;
                v |= (((bytes[bit / 8] >> (bit % 8)) & 1) as u32) << b;
            }
            v
        })
        .collect()
}

fn weights(rows: usize, cols: usize, seed: u64) -> Vec<f64> {
    let mut r = rng(seed);
    random_vec(&mut r, rows * cols, -1.0, 1.0)
}

#[test]
fn affine_round_trip_every_bit_width() {
    let (rows, cols) = (8usize, 128usize);
    for bits in [1, 2, 3, 4, 5, 6, 8] {
        for group in [32, 64, 128] {
            let w = round_to(&weights(rows, cols, bits as u64), Dtype::Float32);
            let wa = array(&w, &[rows as i32, cols as i32], Dtype::Float32);
            let spec = QuantSpec::affine(group, bits);
            let q = wa.quantize(spec).unwrap();
            let packed = cols * bits as usize / 32;
            assert_eq!(
                q.weight.shape(),
                vec![rows as i32, packed as i32],
                "{bits}-bit packing"
            );
            assert_eq!(q.scales.shape(), vec![rows as i32, cols as i32 / group]);
            let biases = q.biases.as_ref().expect("affine has biases");
            let deq =
                read(&ops::dequantize(&q.weight, &q.scales, Some(biases), spec, None).unwrap());
            // Independent decode: w = scale * q + bias per group.
            let codes = unpack(
                &q.weight.to_vec::<u32>().unwrap(),
                bits as usize,
                rows * cols,
            );
            let scales = read(&q.scales);
            let bias = read(biases);
            let g = group as usize;
            let decoded: Vec<f64> = (0..rows * cols)
                .map(|i| scales[i / g] * codes[i] as f64 + bias[i / g])
                .collect();
            assert_close(
                &format!("affine {bits}b g{group} decode"),
                &deq,
                &decoded,
                1e-6,
            );
            // Error bound: MLX aligns the grid so the group's larger-magnitude edge is exact (the
            // stored scale is edge / round(edge / step)), which can clip the other edge by up to
            // one step; inside the grid the error is half a step.
            for (gi, chunk) in w.chunks(g).enumerate() {
                let step = scales[gi].abs();
                let (lo, hi) = chunk
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(*v), b.max(*v)));
                assert!(
                    step <= (hi - lo) / ((1u32 << bits) - 1) as f64 * 1.5 + 1e-6,
                    "scale {step} too coarse"
                );
                for (j, v) in chunk.iter().enumerate() {
                    let err = (deq[gi * g + j] - v).abs();
                    let inside = *v
                        >= bias[gi].min(bias[gi] + scales[gi] * ((1u32 << bits) - 1) as f64)
                        && *v <= bias[gi].max(bias[gi] + scales[gi] * ((1u32 << bits) - 1) as f64);
                    let bound = if inside { step * 0.5 } else { step };
                    assert!(
                        err <= bound + 1e-5,
                        "affine {bits}b g{group}: |err| {err} > {bound}"
                    );
                }
            }
        }
    }
}

#[test]
fn fp_modes_round_trip_and_decode() {
    let (rows, cols) = (4usize, 64usize);
    for mode in [QuantMode::Mxfp4, QuantMode::Mxfp8, QuantMode::Nvfp4] {
        let spec = QuantSpec::fixed(mode).unwrap();
        let w = round_to(&weights(rows, cols, 11), Dtype::Float32);
        let wa = array(&w, &[rows as i32, cols as i32], Dtype::Float32);
        let q = wa.quantize(spec).unwrap();
        assert!(q.biases.is_none(), "{mode} has no biases");
        assert_eq!(q.scales.dtype().unwrap(), Dtype::Uint8);
        let deq =
            read(&ops::dequantize(&q.weight, &q.scales, None, spec, Some(Dtype::Float32)).unwrap());
        let codes: Vec<u8> = q.weight.view(Dtype::Uint8).unwrap().to_vec::<u8>().unwrap();
        let scale_bytes = q.scales.to_vec::<u8>().unwrap();
        let g = spec.group_size as usize;
        let decoded: Vec<f64> = (0..rows * cols)
            .map(|i| {
                let scale = match mode {
                    QuantMode::Nvfp4 => fp8_e4m3(scale_bytes[i / g]),
                    _ => e8m0(scale_bytes[i / g]),
                };
                let v = match mode {
                    QuantMode::Mxfp8 => fp8_e4m3(codes[i]),
                    _ => fp4_e2m1((codes[i / 2] >> (4 * (i % 2))) & 0xf),
                };
                v * scale
            })
            .collect();
        assert_close(&format!("{mode} decode"), &deq, &decoded, 1e-6);
        // Relative error bound of the element format: fp4 has one mantissa bit (the step is up to
        // 1/3 of the value near the top of a binade, and scales are powers of two), fp8 three.
        let bound = match mode {
            QuantMode::Mxfp8 => 0.07,
            _ => 0.35,
        };
        for (gi, chunk) in w.chunks(g).enumerate() {
            let amax = chunk.iter().fold(0.0f64, |a, v| a.max(v.abs()));
            for (j, v) in chunk.iter().enumerate() {
                let err = (deq[gi * g + j] - v).abs();
                assert!(err <= bound * amax + 1e-6, "{mode}: err {err} amax {amax}");
            }
        }
    }
}

#[test]
fn quantized_matmuls_match_dense_reference() {
    let (m, k, n) = (3usize, 128usize, 16usize);
    let mut r = rng(12);
    let x = round_to(&random_vec(&mut r, m * k, -1.0, 1.0), Dtype::Float32);
    let xa = array(&x, &[m as i32, k as i32], Dtype::Float32);
    let specs = [
        QuantSpec::affine(64, 4),
        QuantSpec::affine(32, 8),
        QuantSpec::affine(64, 3),
        QuantSpec::fixed(QuantMode::Mxfp4).unwrap(),
        QuantSpec::fixed(QuantMode::Mxfp8).unwrap(),
        QuantSpec::fixed(QuantMode::Nvfp4).unwrap(),
    ];
    for spec in specs {
        let w = round_to(&weights(n, k, 13), Dtype::Float32);
        let q = array(&w, &[n as i32, k as i32], Dtype::Float32)
            .quantize(spec)
            .unwrap();
        let deq = read(
            &ops::dequantize(
                &q.weight,
                &q.scales,
                q.biases.as_ref(),
                spec,
                Some(Dtype::Float32),
            )
            .unwrap(),
        );
        // Dense reference: x @ deq^T.
        let mut wt = vec![0.0; k * n];
        for i in 0..n {
            for j in 0..k {
                wt[j * n + i] = deq[i * k + j];
            }
        }
        let want = matmul(&x, &wt, m, k, n);
        let got = ops::quantized_matmul(&xa, &q.weight, &q.scales, q.biases.as_ref(), true, spec)
            .unwrap();
        assert_close(
            &format!("quantized_matmul {spec:?}"),
            &read(&got),
            &want,
            1e-4,
        );

        // gather_qmm over a stack of 3 "experts"; rows pick experts through sorted indices.
        let experts = 3usize;
        let ws: Vec<f64> = (0..experts)
            .flat_map(|e| weights(n, k, 20 + e as u64))
            .collect();
        let stack = array(
            &round_to(&ws, Dtype::Float32),
            &[experts as i32, n as i32, k as i32],
            Dtype::Float32,
        );
        let qs = stack.quantize(spec).unwrap();
        let deq_s = read(
            &ops::dequantize(
                &qs.weight,
                &qs.scales,
                qs.biases.as_ref(),
                spec,
                Some(Dtype::Float32),
            )
            .unwrap(),
        );
        let picks = [0i32, 2, 2];
        let rhs = Array::from_slice(&picks, &[m as i32]).unwrap();
        let x3 = xa.reshape(&[m as i32, 1, k as i32]).unwrap();
        let got = ops::gather_qmm(
            &x3,
            &qs.weight,
            &qs.scales,
            qs.biases.as_ref(),
            None,
            Some(&rhs),
            true,
            spec,
            true,
        )
        .unwrap();
        assert_eq!(got.shape(), vec![m as i32, 1, n as i32]);
        let got = read(&got);
        for (row, e) in picks.iter().enumerate() {
            let we = &deq_s[*e as usize * n * k..(*e as usize + 1) * n * k];
            for i in 0..n {
                let want: f64 = (0..k).map(|j| x[row * k + j] * we[i * k + j]).sum();
                let g = got[row * n + i];
                assert!(
                    (g - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "gather_qmm {spec:?} row {row}: {g} vs {want}"
                );
            }
        }
        // gather_mm with the dense stack gives the same rows.
        let dense = array(
            &deq_s,
            &[experts as i32, n as i32, k as i32],
            Dtype::Float32,
        )
        .t()
        .unwrap();
        let gm = ops::gather_mm(&x3, &dense, None, Some(&rhs), true).unwrap();
        assert_close(&format!("gather_mm {spec:?}"), &read(&gm), &got, 1e-4);
    }
}

#[test]
fn malformed_quantization_is_an_error() {
    let w = ops::zeros(&[4, 100], Dtype::Float32).unwrap();
    assert!(
        w.quantize(QuantSpec::affine(64, 4)).is_err(),
        "group does not divide the row"
    );
    let w = ops::zeros(&[4, 128], Dtype::Float32).unwrap();
    assert!(
        w.quantize(QuantSpec::affine(64, 7)).is_err(),
        "7 bits is not a format"
    );
    let q = w.quantize(QuantSpec::affine(64, 4)).unwrap();
    let bad_scales = ops::zeros(&[4, 3], Dtype::Float32).unwrap();
    let err = ops::dequantize(
        &q.weight,
        &bad_scales,
        q.biases.as_ref(),
        QuantSpec::affine(64, 4),
        None,
    );
    assert!(err.is_err(), "scales of the wrong shape");
    assert!(
        ops::dequantize(&q.weight, &q.scales, None, QuantSpec::affine(64, 4), None).is_err(),
        "affine without biases"
    );
}
