//! Plain-Rust references for the bridge tests: seeded random data, broadcasting, tolerance
//! checks per dtype.
#![allow(dead_code)]

use mlxcel_core::{Array, Dtype};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Relative tolerance per compute dtype (the contract): an element passes when
/// `|got - want| <= tol * max(|want|, 1)`, i.e. relative for magnitudes above 1 and absolute below.
pub fn tolerance(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::Float32 => 1e-5,
        Dtype::Float16 => 3e-3,
        Dtype::Bfloat16 => 3e-2,
        _ => 0.0,
    }
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub fn random_vec(rng: &mut StdRng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n).map(|_| rng.gen_range(lo..hi)).collect()
}

/// Rounds values through `dtype` so references see exactly what the array holds.
pub fn round_to(values: &[f64], dtype: Dtype) -> Vec<f64> {
    values
        .iter()
        .map(|v| match dtype {
            Dtype::Float16 => half::f16::from_f64(*v).to_f64(),
            Dtype::Bfloat16 => half::bf16::from_f64(*v).to_f64(),
            Dtype::Float32 => *v as f32 as f64,
            _ => *v,
        })
        .collect()
}

/// An array of `dtype` holding `values` (rounded to the dtype).
pub fn array(values: &[f64], shape: &[i32], dtype: Dtype) -> Array {
    match dtype {
        Dtype::Float32 => {
            let v: Vec<f32> = values.iter().map(|x| *x as f32).collect();
            Array::from_slice(&v, shape).unwrap()
        }
        Dtype::Float16 => {
            let v: Vec<half::f16> = values.iter().map(|x| half::f16::from_f64(*x)).collect();
            Array::from_slice(&v, shape).unwrap()
        }
        Dtype::Bfloat16 => {
            let v: Vec<half::bf16> = values.iter().map(|x| half::bf16::from_f64(*x)).collect();
            Array::from_slice(&v, shape).unwrap()
        }
        other => panic!("test helper has no float dtype {other}"),
    }
}

/// Reads any float or integer array back as f64.
pub fn read(a: &Array) -> Vec<f64> {
    match a.dtype().unwrap() {
        Dtype::Float32 => a
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        Dtype::Float16 => a
            .to_vec::<half::f16>()
            .unwrap()
            .into_iter()
            .map(|x| x.to_f64())
            .collect(),
        Dtype::Bfloat16 => a
            .to_vec::<half::bf16>()
            .unwrap()
            .into_iter()
            .map(|x| x.to_f64())
            .collect(),
        Dtype::Int32 => a
            .to_vec::<i32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        Dtype::Uint32 => a
            .to_vec::<u32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        Dtype::Int64 => a
            .to_vec::<i64>()
            .unwrap()
            .into_iter()
            .map(|x| x as f64)
            .collect(),
        Dtype::Uint8 => a
            .to_vec::<u8>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        Dtype::Bool => a
            .to_vec::<bool>()
            .unwrap()
            .into_iter()
            .map(|b| b as u8 as f64)
            .collect(),
        other => panic!("test helper cannot read {other}"),
    }
}

/// Asserts element-wise closeness under [`tolerance`]`(dtype)` (or `tol` when given).
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0.0f64, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / w.abs().max(1.0);
        // NaN (a wrong infinity or a NaN result) counts as the worst possible error.
        let err = if err.is_nan() { f64::INFINITY } else { err };
        if err > worst.0 {
            worst = (err, i);
        }
    }
    assert!(
        worst.0 <= tol,
        "{what}: max relative error {:.3e} > {tol:.1e} at {} (got {}, want {})",
        worst.0,
        worst.1,
        got[worst.1],
        want[worst.1]
    );
}

/// Row-major strides of a shape.
pub fn strides(shape: &[i32]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1] as usize;
    }
    s
}

/// NumPy broadcasting of two shapes.
pub fn broadcast_shape(a: &[i32], b: &[i32]) -> Vec<i32> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| {
            let da = if i + a.len() >= n {
                a[i + a.len() - n]
            } else {
                1
            };
            let db = if i + b.len() >= n {
                b[i + b.len() - n]
            } else {
                1
            };
            assert!(da == db || da == 1 || db == 1);
            da.max(db)
        })
        .collect()
}

/// The flat index into an array of `shape` for output coordinates under broadcasting.
pub fn broadcast_index(coord: &[usize], shape: &[i32]) -> usize {
    let off = coord.len() - shape.len();
    let st = strides(shape);
    shape
        .iter()
        .enumerate()
        .map(|(i, d)| if *d == 1 { 0 } else { coord[off + i] * st[i] })
        .sum()
}

/// Every coordinate of `shape` in row-major order.
pub fn coords(shape: &[i32]) -> Vec<Vec<usize>> {
    let total: usize = shape.iter().map(|d| *d as usize).product();
    let st = strides(shape);
    (0..total)
        .map(|flat| {
            st.iter()
                .zip(shape)
                .map(|(s, d)| (flat / s) % (*d as usize))
                .collect()
        })
        .collect()
}

/// Plain matrix product of `[m, k] x [k, n]`.
pub fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    out
}

/// Decodes an FP4 E2M1 nibble.
pub fn fp4_e2m1(nibble: u8) -> f64 {
    const MAG: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = MAG[(nibble & 7) as usize];
    if nibble & 8 != 0 {
        -v
    } else {
        v
    }
}

/// Decodes an FP8 E4M3 (fn variant: no infinities, 0x7f/0xff are NaN) byte.
pub fn fp8_e4m3(byte: u8) -> f64 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((byte >> 3) & 0xf) as i32;
    let man = (byte & 7) as f64;
    if exp == 0xf && (byte & 7) == 7 {
        return f64::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f64.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f64.powi(exp - 7)
    }
}

/// Decodes an E8M0 scale byte (a power of two).
pub fn e8m0(byte: u8) -> f64 {
    2f64.powi(byte as i32 - 127)
}
