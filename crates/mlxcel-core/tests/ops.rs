//! Every bridged op against a plain-Rust reference on seeded random inputs, in f32, f16 and bf16
//! where the op is floating point. Tolerances: see `common::tolerance`.

// The references below are written as plain index loops on purpose: they mirror the math.
#![allow(clippy::too_many_arguments, clippy::needless_range_loop)]

mod common;

use common::*;
use mlxcel_core::ops::{self, random, AttentionMask, Rope};
use mlxcel_core::{Array, Dtype};

const FLOATS: [Dtype; 3] = [Dtype::Float32, Dtype::Float16, Dtype::Bfloat16];

type UnaryCase = (
    &'static str,
    fn(&Array) -> mlxcel_core::Result<Array>,
    fn(f64) -> f64,
    f64,
    f64,
);

fn erf_ref(x: f64) -> f64 {
    // Abramowitz–Stegun 7.1.26 is too coarse for 1e-5; integrate the series instead.
    let mut sum = 0.0;
    let mut term = x;
    let mut n = 0.0;
    while term.abs() > 1e-17 || n < 3.0 {
        sum += term / (2.0 * n + 1.0);
        n += 1.0;
        term *= -x * x / n;
        if n > 200.0 {
            break;
        }
    }
    2.0 / std::f64::consts::PI.sqrt() * sum
}

#[test]
fn unary_ops_match_reference() {
    let cases: Vec<UnaryCase> = vec![
        ("abs", Array::abs, f64::abs, -3.0, 3.0),
        ("negative", Array::negative, |x| -x, -3.0, 3.0),
        ("exp", Array::exp, f64::exp, -4.0, 4.0),
        ("expm1", Array::expm1, f64::exp_m1, -1.0, 1.0),
        ("log", Array::log, f64::ln, 0.05, 20.0),
        ("log1p", Array::log1p, f64::ln_1p, -0.5, 5.0),
        ("sqrt", Array::sqrt, f64::sqrt, 0.0, 9.0),
        ("rsqrt", Array::rsqrt, |x| 1.0 / x.sqrt(), 0.1, 9.0),
        ("square", Array::square, |x| x * x, -3.0, 3.0),
        ("reciprocal", Array::reciprocal, |x| 1.0 / x, 0.2, 5.0),
        ("sin", Array::sin, f64::sin, -3.0, 3.0),
        ("cos", Array::cos, f64::cos, -3.0, 3.0),
        ("tanh", Array::tanh, f64::tanh, -4.0, 4.0),
        (
            "sigmoid",
            Array::sigmoid,
            |x| 1.0 / (1.0 + (-x).exp()),
            -6.0,
            6.0,
        ),
        ("erf", Array::erf, erf_ref, -2.5, 2.5),
        ("floor", Array::floor, f64::floor, -5.0, 5.0),
        ("ceil", Array::ceil, f64::ceil, -5.0, 5.0),
        ("sign", Array::sign, f64::signum, -5.0, 5.0),
    ];
    let mut r = rng(1);
    for (name, op, reference, lo, hi) in cases {
        for dtype in FLOATS {
            let x = round_to(&random_vec(&mut r, 257, lo, hi), dtype);
            let a = array(&x, &[257], dtype);
            let got = op(&a).unwrap();
            assert_eq!(got.dtype().unwrap(), dtype, "{name} keeps the dtype");
            let want: Vec<f64> = x.iter().map(|v| reference(*v)).collect();
            assert_close(
                &format!("{name} {dtype}"),
                &read(&got),
                &want,
                tolerance(dtype),
            );
        }
    }
}

type BinaryCase = (
    &'static str,
    fn(&Array, &Array) -> mlxcel_core::Result<Array>,
    fn(f64, f64) -> f64,
);

#[test]
fn binary_ops_broadcast_and_match_reference() {
    let cases: Vec<BinaryCase> = vec![
        ("add", Array::add, |a, b| a + b),
        ("subtract", Array::subtract, |a, b| a - b),
        ("multiply", Array::multiply, |a, b| a * b),
        ("divide", Array::divide, |a, b| a / b),
        ("power", Array::power, f64::powf),
        ("maximum", Array::maximum, f64::max),
        ("minimum", Array::minimum, f64::min),
        ("remainder", Array::remainder, |a, b| {
            a - b * (a / b).floor()
        }),
        ("floor_divide", Array::floor_divide, |a, b| (a / b).floor()),
    ];
    let (sa, sb) = ([3, 1, 5], [4, 5]);
    let out_shape = broadcast_shape(&sa, &sb);
    let mut r = rng(2);
    for (name, op, reference) in cases {
        for dtype in FLOATS {
            let x = round_to(&random_vec(&mut r, 15, 0.5, 3.0), dtype);
            let y = round_to(&random_vec(&mut r, 20, 0.5, 3.0), dtype);
            let got = op(&array(&x, &sa, dtype), &array(&y, &sb, dtype)).unwrap();
            assert_eq!(got.shape(), out_shape, "{name} broadcast shape");
            let want: Vec<f64> = coords(&out_shape)
                .iter()
                .map(|c| reference(x[broadcast_index(c, &sa)], y[broadcast_index(c, &sb)]))
                .collect();
            // floor-based ops may round differently at exact boundaries in half precision:
            // compare them in f32 only.
            if dtype != Dtype::Float32 && (name == "remainder" || name == "floor_divide") {
                continue;
            }
            assert_close(
                &format!("{name} {dtype}"),
                &read(&got),
                &want,
                tolerance(dtype),
            );
        }
    }
}

#[test]
fn comparisons_and_logic() {
    let x = [1.0, 2.0, 3.0, 4.0];
    let y = [4.0, 2.0, 1.0, 5.0];
    let a = array(&x, &[4], Dtype::Float32);
    let b = array(&y, &[4], Dtype::Float32);
    let check = |name: &str, got: Array, f: fn(f64, f64) -> bool| {
        assert_eq!(got.dtype().unwrap(), Dtype::Bool, "{name}");
        let want: Vec<f64> = x
            .iter()
            .zip(&y)
            .map(|(p, q)| f(*p, *q) as u8 as f64)
            .collect();
        assert_eq!(read(&got), want, "{name}");
    };
    check("equal", a.equal(&b).unwrap(), |p, q| p == q);
    check("not_equal", a.not_equal(&b).unwrap(), |p, q| p != q);
    check("less", a.less(&b).unwrap(), |p, q| p < q);
    check("less_equal", a.less_equal(&b).unwrap(), |p, q| p <= q);
    check("greater", a.greater(&b).unwrap(), |p, q| p > q);
    check("greater_equal", a.greater_equal(&b).unwrap(), |p, q| p >= q);
    let lt = a.less(&b).unwrap();
    let eq = a.equal(&b).unwrap();
    assert_eq!(read(&lt.logical_or(&eq).unwrap()), vec![1.0, 1.0, 0.0, 1.0]);
    assert_eq!(read(&lt.logical_and(&eq).unwrap()), vec![0.0; 4]);
    assert_eq!(read(&lt.logical_not().unwrap()), vec![0.0, 1.0, 1.0, 0.0]);
    let nan = Array::from_slice(&[f32::NAN, 1.0], &[2]).unwrap();
    assert_eq!(read(&nan.isnan().unwrap()), vec![1.0, 0.0]);
    let i = Array::from_slice(&[0b1100u32, 0b1010], &[2]).unwrap();
    let j = Array::from_slice(&[0b1010u32, 2], &[2]).unwrap();
    assert_eq!(read(&i.bitwise_and(&j).unwrap()), vec![8.0, 2.0]);
    assert_eq!(read(&i.bitwise_or(&j).unwrap()), vec![14.0, 10.0]);
    assert_eq!(read(&i.right_shift(&j).unwrap()), vec![0.0, 2.0]);
    assert_eq!(read(&i.left_shift(&j).unwrap()), vec![12288.0, 40.0]);
}

type ReduceRef = fn(&[f64]) -> f64;

#[test]
fn reductions_match_reference() {
    let shape = [3, 4, 5];
    let mut r = rng(3);
    for dtype in FLOATS {
        let x = round_to(&random_vec(&mut r, 60, -2.0, 2.0), dtype);
        let a = array(&x, &shape, dtype);
        for axes in [vec![0], vec![1], vec![2], vec![0, 2], vec![-1]] {
            let norm: Vec<usize> = axes.iter().map(|ax| ((*ax + 3) % 3) as usize).collect();
            // Group the elements by their coordinates outside the reduced axes.
            let mut groups: std::collections::BTreeMap<Vec<usize>, Vec<f64>> = Default::default();
            for (flat, c) in coords(&shape).into_iter().enumerate() {
                let key: Vec<usize> = c
                    .iter()
                    .enumerate()
                    .map(|(i, v)| if norm.contains(&i) { 0 } else { *v })
                    .collect();
                groups.entry(key).or_default().push(x[flat]);
            }
            let refs: [(&str, ReduceRef); 6] = [
                ("sum", |v| v.iter().sum()),
                ("mean", |v| v.iter().sum::<f64>() / v.len() as f64),
                ("max", |v| v.iter().cloned().fold(f64::MIN, f64::max)),
                ("min", |v| v.iter().cloned().fold(f64::MAX, f64::min)),
                ("prod", |v| v.iter().product()),
                ("logsumexp", |v| {
                    let m = v.iter().cloned().fold(f64::MIN, f64::max);
                    m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
                }),
            ];
            for (name, f) in refs {
                let got = match name {
                    "sum" => a.sum(&axes, true),
                    "mean" => a.mean(&axes, true),
                    "max" => a.max(&axes, true),
                    "min" => a.min(&axes, true),
                    "prod" => a.prod(&axes, true),
                    _ => a.logsumexp(&axes, true),
                }
                .unwrap();
                let mut want_shape = shape.to_vec();
                for ax in &norm {
                    want_shape[*ax] = 1;
                }
                assert_eq!(got.shape(), want_shape, "{name} keepdims shape");
                let want: Vec<f64> = groups.values().map(|g| f(g)).collect();
                // Half-precision sums of many terms round at every step.
                let tol = tolerance(dtype) * if dtype == Dtype::Float32 { 1.0 } else { 4.0 };
                assert_close(&format!("{name} {axes:?} {dtype}"), &read(&got), &want, tol);
            }
            let dropped = a.sum(&axes, false).unwrap();
            assert_eq!(dropped.ndim(), 3 - norm.len());
        }
    }
    let b = Array::from_slice(&[true, false, true, true], &[2, 2]).unwrap();
    assert_eq!(read(&b.all(&[1], false).unwrap()), vec![0.0, 1.0]);
    assert_eq!(read(&b.any(&[0], false).unwrap()), vec![1.0, 1.0]);
}

#[test]
fn matmul_and_addmm() {
    let mut r = rng(4);
    let (m, k, n) = (7, 33, 5);
    for dtype in FLOATS {
        let x = round_to(&random_vec(&mut r, m * k, -1.0, 1.0), dtype);
        let w = round_to(&random_vec(&mut r, k * n, -1.0, 1.0), dtype);
        let c = round_to(&random_vec(&mut r, n, -1.0, 1.0), dtype);
        let a = array(&x, &[m as i32, k as i32], dtype);
        let b = array(&w, &[k as i32, n as i32], dtype);
        let want = matmul(&x, &w, m, k, n);
        let tol = tolerance(dtype) * if dtype == Dtype::Float32 { 1.0 } else { 4.0 };
        assert_close(
            &format!("matmul {dtype}"),
            &read(&a.matmul(&b).unwrap()),
            &want,
            tol,
        );
        let bias = array(&c, &[n as i32], dtype);
        let got = bias.addmm(&a, &b, 0.5, 2.0).unwrap();
        let want2: Vec<f64> = want
            .iter()
            .enumerate()
            .map(|(i, v)| 0.5 * v + 2.0 * c[i % n])
            .collect();
        assert_close(&format!("addmm {dtype}"), &read(&got), &want2, tol);
    }
    // Batched: [2, m, k] x [k, n] broadcasts the right operand.
    let x = random_vec(&mut r, 2 * 3 * 4, -1.0, 1.0);
    let w = random_vec(&mut r, 4 * 2, -1.0, 1.0);
    let got = array(&x, &[2, 3, 4], Dtype::Float32)
        .matmul(&array(&w, &[4, 2], Dtype::Float32))
        .unwrap();
    let mut want = matmul(&x[..12], &w, 3, 4, 2);
    want.extend(matmul(&x[12..], &w, 3, 4, 2));
    assert_close("batched matmul", &read(&got), &want, 1e-5);
}

#[test]
fn softmax_argmax_sort_topk_partition() {
    let mut r = rng(5);
    for dtype in FLOATS {
        let x = round_to(&random_vec(&mut r, 4 * 9, -3.0, 3.0), dtype);
        let a = array(&x, &[4, 9], dtype);
        let got = read(&a.softmax(&[-1], true).unwrap());
        let mut want = Vec::new();
        for row in x.chunks(9) {
            let m = row.iter().cloned().fold(f64::MIN, f64::max);
            let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
            want.extend(row.iter().map(|v| (v - m).exp() / s));
        }
        assert_close(&format!("softmax {dtype}"), &got, &want, tolerance(dtype));
    }
    let x = random_vec(&mut r, 4 * 9, -3.0, 3.0);
    let a = array(&x, &[4, 9], Dtype::Float32);
    let x: Vec<f64> = round_to(&x, Dtype::Float32);
    let arg = read(&a.argmax(-1, false).unwrap());
    let argmin = read(&a.argmin(-1, false).unwrap());
    let sorted = read(&a.sort(-1).unwrap());
    let argsorted = read(&a.argsort(-1).unwrap());
    let top = read(&a.topk(3, -1).unwrap());
    let part = read(&a.argpartition(2, -1).unwrap());
    for (i, row) in x.chunks(9).enumerate() {
        let mut s = row.to_vec();
        s.sort_by(|p, q| p.partial_cmp(q).unwrap());
        let best = row
            .iter()
            .cloned()
            .enumerate()
            .fold((0, f64::MIN), |b, (j, v)| if v > b.1 { (j, v) } else { b });
        let worst = row
            .iter()
            .cloned()
            .enumerate()
            .fold((0, f64::MAX), |b, (j, v)| if v < b.1 { (j, v) } else { b });
        assert_eq!(arg[i] as usize, best.0, "argmax row {i}");
        assert_eq!(argmin[i] as usize, worst.0, "argmin row {i}");
        assert_eq!(&sorted[i * 9..i * 9 + 9], s.as_slice(), "sort row {i}");
        let by_idx: Vec<f64> = argsorted[i * 9..i * 9 + 9]
            .iter()
            .map(|j| row[*j as usize])
            .collect();
        assert_eq!(by_idx, s, "argsort row {i}");
        let mut t = top[i * 3..i * 3 + 3].to_vec();
        t.sort_by(|p, q| p.partial_cmp(q).unwrap());
        assert_eq!(t, s[6..].to_vec(), "topk row {i}");
        let p: Vec<f64> = part[i * 9..i * 9 + 9]
            .iter()
            .map(|j| row[*j as usize])
            .collect();
        assert_eq!(p[2], s[2], "argpartition kth row {i}");
        assert!(p[..2].iter().all(|v| *v <= s[2]) && p[3..].iter().all(|v| *v >= s[2]));
    }
}

#[test]
fn shape_ops_and_non_contiguous_copy_out() {
    let x: Vec<f32> = (0..24).map(|v| v as f32).collect();
    let a = Array::from_slice(&x, &[2, 3, 4]).unwrap();
    // Transposed view: to_vec must return logical row-major order.
    let t = a.transpose(&[2, 0, 1]).unwrap();
    assert_eq!(t.shape(), vec![4, 2, 3]);
    let got = t.to_vec::<f32>().unwrap();
    for (flat, c) in coords(&[4, 2, 3]).iter().enumerate() {
        assert_eq!(got[flat], x[c[1] * 12 + c[2] * 4 + c[0]]);
    }
    // Strided slice: every other element of the last axis, rows 1..3.
    let s = a.slice(&[0, 1, 0], &[2, 3, 4], &[1, 1, 2]).unwrap();
    assert_eq!(s.shape(), vec![2, 2, 2]);
    assert_eq!(
        s.to_vec::<f32>().unwrap(),
        vec![4., 6., 8., 10., 16., 18., 20., 22.]
    );
    assert_eq!(
        a.slice_axis(-1, 1, 3).unwrap().to_vec::<f32>().unwrap()[..2],
        [1., 2.]
    );
    // Broadcast view copied out.
    let b = Array::from_slice(&[1.0f32, 2.0], &[2, 1])
        .unwrap()
        .broadcast_to(&[2, 3])
        .unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![1., 1., 1., 2., 2., 2.]);
    let r = a.reshape(&[6, -1]).unwrap();
    assert_eq!(r.shape(), vec![6, 4]);
    assert_eq!(a.expand_dims(&[0, 2]).unwrap().shape(), vec![1, 2, 1, 3, 4]);
    assert_eq!(
        a.expand_dims(&[0]).unwrap().squeeze(&[0]).unwrap().shape(),
        vec![2, 3, 4]
    );
    assert_eq!(a.t().unwrap().shape(), vec![2, 4, 3]);
    assert_eq!(a.dim(-1).unwrap(), 4);
    assert!(a.dim(3).is_err());
    let parts = a.split_equal(2, 1).err();
    assert!(parts.is_some(), "3 rows do not split in 2 equal parts");
    let parts = a.split_at(&[1, 3], 2).unwrap();
    assert_eq!(
        parts.iter().map(|p| p.shape()[2]).collect::<Vec<_>>(),
        vec![1, 2, 1]
    );
    let back = ops::concatenate(&parts, 2).unwrap();
    assert_eq!(back.to_vec::<f32>().unwrap(), x);
    let st = ops::stack(&[a.clone(), a.clone()], 1).unwrap();
    assert_eq!(st.shape(), vec![2, 2, 3, 4]);
    assert_eq!(
        st.slice_axis(1, 1, 2)
            .unwrap()
            .reshape(&[24])
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        x
    );
    // astype / view / contiguous
    let i = a.astype(Dtype::Int32).unwrap();
    assert_eq!(i.to_vec::<i32>().unwrap(), (0..24).collect::<Vec<_>>());
    let bytes = a.view(Dtype::Uint8).unwrap();
    assert_eq!(bytes.shape(), vec![2, 3, 16]);
    assert_eq!(t.contiguous().unwrap().to_vec::<f32>().unwrap(), got);
    assert!(matches!(
        a.to_vec::<i32>(),
        Err(mlxcel_core::Error::DtypeMismatch { .. })
    ));
}

#[test]
fn dynamic_slices_and_updates() {
    let x: Vec<f32> = (0..20).map(|v| v as f32).collect();
    let a = Array::from_slice(&x, &[4, 5]).unwrap();
    let start = Array::from_slice(&[1i32, 2], &[2]).unwrap();
    let s = a.slice_dynamic(&start, &[0, 1], &[2, 3]).unwrap();
    assert_eq!(s.to_vec::<f32>().unwrap(), vec![7., 8., 9., 12., 13., 14.]);
    let upd = ops::zeros(&[2, 2], Dtype::Float32).unwrap();
    let u = a.slice_update(&upd, &[0, 0], &[4, 4], &[2, 2]).unwrap();
    let got = u.to_vec::<f32>().unwrap();
    for (i, v) in got.iter().enumerate() {
        let (r, c) = (i / 5, i % 5);
        let zeroed = r % 2 == 0 && c % 2 == 0 && c < 4;
        assert_eq!(
            *v,
            if zeroed { 0.0 } else { x[i] },
            "slice_update at {r},{c}"
        );
    }
    let one = ops::ones(&[1, 5], Dtype::Float32).unwrap();
    let row = Array::from_slice(&[2i32], &[1]).unwrap();
    let d = a.slice_update_dynamic(&one, &row, &[0]).unwrap();
    let got = d.to_vec::<f32>().unwrap();
    assert_eq!(&got[10..15], &[1.0; 5]);
    assert_eq!(&got[..10], &x[..10]);
}

#[test]
fn gathers_scatters_where_cumsum_clip() {
    let table: Vec<f32> = (0..12).map(|v| v as f32).collect();
    let t = Array::from_slice(&table, &[4, 3]).unwrap();
    let ids = Array::from_slice(&[3i32, 0, 3], &[3]).unwrap();
    assert_eq!(
        t.take(&ids, 0).unwrap().to_vec::<f32>().unwrap(),
        vec![9., 10., 11., 0., 1., 2., 9., 10., 11.]
    );
    let idx = Array::from_slice(&[2i32, 0, 1, 1], &[4, 1]).unwrap();
    assert_eq!(
        t.take_along_axis(&idx, 1).unwrap().to_vec::<f32>().unwrap(),
        vec![2., 3., 7., 10.]
    );
    let vals = ops::full(&[4, 1], -1.0, Dtype::Float32).unwrap();
    let p = t
        .put_along_axis(&idx, &vals, 1)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(p[2], -1.0);
    assert_eq!(p[3], -1.0);
    assert_eq!(p[0], 0.0);
    let cond = Array::from_slice(&[true, false, true], &[3]).unwrap();
    let x = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let y = ops::zeros(&[3], Dtype::Float32).unwrap();
    assert_eq!(
        ops::where_(&cond, &x, &y).unwrap().to_vec::<f32>().unwrap(),
        vec![1., 0., 3.]
    );
    assert_eq!(
        x.cumsum(0, false, true).unwrap().to_vec::<f32>().unwrap(),
        vec![1., 3., 6.]
    );
    assert_eq!(
        x.cumsum(0, false, false).unwrap().to_vec::<f32>().unwrap(),
        vec![0., 1., 3.]
    );
    assert_eq!(
        x.cumsum(0, true, true).unwrap().to_vec::<f32>().unwrap(),
        vec![6., 5., 3.]
    );
    let lo = Array::scalar(1.5, Dtype::Float32).unwrap();
    let hi = Array::scalar(2.5, Dtype::Float32).unwrap();
    assert_eq!(
        x.clip(Some(&lo), Some(&hi))
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![1.5, 2., 2.5]
    );
    assert_eq!(
        x.clip(None, Some(&hi)).unwrap().to_vec::<f32>().unwrap(),
        vec![1., 2., 2.5]
    );
    assert_eq!(
        ops::arange(0.0, 5.0, 2.0, Dtype::Int32)
            .unwrap()
            .to_vec::<i32>()
            .unwrap(),
        vec![0, 2, 4]
    );
    assert_eq!(
        ops::ones(&[2], Dtype::Bfloat16)
            .unwrap()
            .to_vec::<half::bf16>()
            .unwrap()[1]
            .to_f32(),
        1.0
    );
    let half_x = Array::from_slice(&[half::f16::from_f32(1.5)], &[1]).unwrap();
    assert_eq!(
        half_x.mul_scalar(2.0).unwrap().dtype().unwrap(),
        Dtype::Float16
    );
    assert_eq!(half_x.add_scalar(1.0).unwrap().item().unwrap(), 2.5);
}

#[test]
fn norms_match_reference() {
    let mut r = rng(6);
    let (rows, d) = (5, 48);
    for dtype in FLOATS {
        let x = round_to(&random_vec(&mut r, rows * d, -2.0, 2.0), dtype);
        let w = round_to(&random_vec(&mut r, d, 0.5, 1.5), dtype);
        let b = round_to(&random_vec(&mut r, d, -0.5, 0.5), dtype);
        let xa = array(&x, &[rows as i32, d as i32], dtype);
        let wa = array(&w, &[d as i32], dtype);
        let ba = array(&b, &[d as i32], dtype);
        let eps = 1e-5;
        let mut rms = Vec::new();
        let mut ln = Vec::new();
        for row in x.chunks(d) {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
            rms.extend(row.iter().zip(&w).map(|(v, g)| v / (ms + eps).sqrt() * g));
            let mean = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            ln.extend(
                row.iter()
                    .zip(&w)
                    .zip(&b)
                    .map(|((v, g), bb)| (v - mean) / (var + eps).sqrt() * g + bb),
            );
        }
        let tol = tolerance(dtype) * 2.0;
        assert_close(
            &format!("rms_norm {dtype}"),
            &read(&xa.rms_norm(Some(&wa), eps as f32).unwrap()),
            &rms,
            tol,
        );
        assert_close(
            &format!("layer_norm {dtype}"),
            &read(&xa.layer_norm(Some(&wa), Some(&ba), eps as f32).unwrap()),
            &ln,
            tol,
        );
    }
}

/// Reference rotary embedding over `[.., L, D]` rows starting at position `offset`.
fn rope_ref(
    x: &[f64],
    l: usize,
    d: usize,
    dims: usize,
    traditional: bool,
    inv_freq: &[f64],
    scale: f64,
    offset: usize,
) -> Vec<f64> {
    let mut out = x.to_vec();
    for (r, row) in x.chunks(d).enumerate() {
        let pos = ((r % l) + offset) as f64 * scale;
        for i in 0..dims / 2 {
            let theta = pos * inv_freq[i];
            let (s, c) = theta.sin_cos();
            let (a, b) = if traditional {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + dims / 2)
            };
            out[r * d + a] = row[a] * c - row[b] * s;
            out[r * d + b] = row[a] * s + row[b] * c;
        }
    }
    out
}

#[test]
fn rope_matches_reference() {
    let mut r = rng(7);
    let (h, l, d) = (2usize, 6usize, 16usize);
    for dtype in FLOATS {
        let x = round_to(&random_vec(&mut r, h * l * d, -1.0, 1.0), dtype);
        let xa = array(&x, &[1, h as i32, l as i32, d as i32], dtype);
        for (dims, traditional, scale, offset) in
            [(16, false, 1.0, 0), (16, true, 1.0, 3), (8, false, 0.5, 5)]
        {
            let base = 10000.0f64;
            let inv: Vec<f64> = (0..dims / 2)
                .map(|i| base.powf(-(2.0 * i as f64) / dims as f64))
                .collect();
            let spec = Rope {
                dims: dims as i32,
                traditional,
                base: base as f32,
                scale: scale as f32,
                freqs: None,
            };
            let got = read(&xa.rope(&spec, offset as i32).unwrap());
            let want = rope_ref(&x, l, d, dims, traditional, &inv, scale, offset);
            // Angles up to ~10 rad in half precision: allow a few ulps of the angle.
            let tol = tolerance(dtype) * if dtype == Dtype::Float32 { 2.0 } else { 3.0 };
            assert_close(
                &format!("rope dims={dims} trad={traditional} {dtype}"),
                &got,
                &want,
                tol,
            );
        }
    }
    // Custom frequencies: MLX takes periods ("freqs") and uses inv_freq = 1 / freqs.
    let x = random_vec(&mut r, h * l * d, -1.0, 1.0);
    let xa = array(&x, &[1, h as i32, l as i32, d as i32], Dtype::Float32);
    let periods: Vec<f64> = (0..d / 2).map(|i| 1.0 + i as f64 * 3.0).collect();
    let fa = array(&periods, &[(d / 2) as i32], Dtype::Float32);
    let spec = Rope {
        dims: d as i32,
        traditional: false,
        base: 0.0,
        scale: 1.0,
        freqs: Some(&fa),
    };
    let inv: Vec<f64> = periods.iter().map(|p| 1.0 / p).collect();
    let want = rope_ref(&round_to(&x, Dtype::Float32), l, d, d, false, &inv, 1.0, 2);
    assert_close(
        "rope custom freqs",
        &read(&xa.rope(&spec, 2).unwrap()),
        &want,
        2e-5,
    );
}

/// Reference attention for one batch: q `[Hq, Lq, D]`, k/v `[Hk, Lk, D]`.
#[allow(clippy::too_many_arguments)]
fn sdpa_ref(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    hq: usize,
    hk: usize,
    lq: usize,
    lk: usize,
    d: usize,
    scale: f64,
    mask: &dyn Fn(usize, usize) -> f64,
    sinks: Option<&[f64]>,
) -> Vec<f64> {
    let mut out = vec![0.0; hq * lq * d];
    for h in 0..hq {
        let kh = h / (hq / hk);
        for i in 0..lq {
            let mut scores: Vec<f64> = (0..lk)
                .map(|j| {
                    let dot: f64 = (0..d)
                        .map(|t| q[(h * lq + i) * d + t] * k[(kh * lk + j) * d + t])
                        .sum();
                    dot * scale + mask(i, j)
                })
                .collect();
            let sink = sinks.map(|s| s[h]);
            let m = scores.iter().cloned().chain(sink).fold(f64::MIN, f64::max);
            let mut denom: f64 = scores.iter().map(|s| (s - m).exp()).sum();
            if let Some(s) = sink {
                denom += (s - m).exp();
            }
            for s in scores.iter_mut() {
                *s = (*s - m).exp() / denom;
            }
            for t in 0..d {
                out[(h * lq + i) * d + t] =
                    (0..lk).map(|j| scores[j] * v[(kh * lk + j) * d + t]).sum();
            }
        }
    }
    out
}

#[test]
fn attention_matches_reference() {
    let mut r = rng(8);
    let (hq, hk, lq, lk, d) = (4usize, 2usize, 5usize, 7usize, 16usize);
    let scale = 1.0 / (d as f64).sqrt();
    for dtype in FLOATS {
        let q = round_to(&random_vec(&mut r, hq * lq * d, -1.0, 1.0), dtype);
        let k = round_to(&random_vec(&mut r, hk * lk * d, -1.0, 1.0), dtype);
        let v = round_to(&random_vec(&mut r, hk * lk * d, -1.0, 1.0), dtype);
        let qa = array(&q, &[1, hq as i32, lq as i32, d as i32], dtype);
        let ka = array(&k, &[1, hk as i32, lk as i32, d as i32], dtype);
        let va = array(&v, &[1, hk as i32, lk as i32, d as i32], dtype);
        let tol = tolerance(dtype) * 2.0;
        let none = sdpa_ref(&q, &k, &v, hq, hk, lq, lk, d, scale, &|_, _| 0.0, None);
        let got = ops::scaled_dot_product_attention(
            &qa,
            &ka,
            &va,
            scale as f32,
            AttentionMask::None,
            None,
        )
        .unwrap();
        assert_close(&format!("sdpa {dtype}"), &read(&got), &none, tol);
        let causal_mask = |i: usize, j: usize| {
            if j <= i + (lk - lq) {
                0.0
            } else {
                f64::NEG_INFINITY
            }
        };
        let causal = sdpa_ref(&q, &k, &v, hq, hk, lq, lk, d, scale, &causal_mask, None);
        let got = ops::scaled_dot_product_attention(
            &qa,
            &ka,
            &va,
            scale as f32,
            AttentionMask::Causal,
            None,
        )
        .unwrap();
        assert_close(&format!("sdpa causal {dtype}"), &read(&got), &causal, tol);
        // Boolean array mask: a sliding window of 3 keys ending at the causal diagonal.
        let keep: Vec<bool> = (0..lq * lk)
            .map(|f| {
                let (i, j) = (f / lk, f % lk);
                let diag = i + (lk - lq);
                j <= diag && j + 3 > diag
            })
            .collect();
        let ma = Array::from_slice(&keep, &[lq as i32, lk as i32]).unwrap();
        let window = sdpa_ref(
            &q,
            &k,
            &v,
            hq,
            hk,
            lq,
            lk,
            d,
            scale,
            &|i, j| {
                if keep[i * lk + j] {
                    0.0
                } else {
                    f64::NEG_INFINITY
                }
            },
            None,
        );
        let got = ops::scaled_dot_product_attention(
            &qa,
            &ka,
            &va,
            scale as f32,
            AttentionMask::Array(&ma),
            None,
        )
        .unwrap();
        assert_close(
            &format!("sdpa window mask {dtype}"),
            &read(&got),
            &window,
            tol,
        );
        // Attention sinks: one extra logit per head.
        let sinks = round_to(&random_vec(&mut r, hq, -1.0, 1.0), dtype);
        let sa = array(&sinks, &[hq as i32], dtype);
        let want = sdpa_ref(
            &q,
            &k,
            &v,
            hq,
            hk,
            lq,
            lk,
            d,
            scale,
            &causal_mask,
            Some(&sinks),
        );
        let got = ops::scaled_dot_product_attention(
            &qa,
            &ka,
            &va,
            scale as f32,
            AttentionMask::Causal,
            Some(&sa),
        )
        .unwrap();
        assert_close(&format!("sdpa sinks {dtype}"), &read(&got), &want, tol);
    }
}

#[test]
fn conv1d_matches_reference() {
    let mut r = rng(9);
    let (n, l, cin, cout, k) = (1usize, 10usize, 4usize, 4usize, 3usize);
    // Depthwise (groups = channels), as Mamba's causal conv uses it, and a dense conv.
    for groups in [1usize, 4] {
        let cpg = cin / groups;
        let x = round_to(&random_vec(&mut r, n * l * cin, -1.0, 1.0), Dtype::Float32);
        let w = round_to(
            &random_vec(&mut r, cout * k * cpg, -1.0, 1.0),
            Dtype::Float32,
        );
        let xa = array(&x, &[n as i32, l as i32, cin as i32], Dtype::Float32);
        let wa = array(&w, &[cout as i32, k as i32, cpg as i32], Dtype::Float32);
        let pad = 2usize;
        let lout = l + 2 * pad - k + 1;
        let got = read(&xa.conv1d(&wa, 1, pad as i32, 1, groups as i32).unwrap());
        let mut want = vec![0.0; lout * cout];
        for t in 0..lout {
            for o in 0..cout {
                let g = o / (cout / groups);
                let mut s = 0.0;
                for kk in 0..k {
                    let pos = t as i64 + kk as i64 - pad as i64;
                    if pos < 0 || pos >= l as i64 {
                        continue;
                    }
                    for c in 0..cpg {
                        s += x[pos as usize * cin + g * cpg + c] * w[(o * k + kk) * cpg + c];
                    }
                }
                want[t * cout + o] = s;
            }
        }
        assert_close(&format!("conv1d groups={groups}"), &got, &want, 1e-5);
    }
}

#[test]
fn random_is_reproducible_and_follows_the_distribution() {
    let logits = Array::from_slice(&[0.0f32, (3.0f32).ln(), f32::NEG_INFINITY], &[1, 3])
        .unwrap()
        .broadcast_to(&[4000, 3])
        .unwrap();
    let key = random::key(42).unwrap();
    let a = read(&random::categorical(&logits, -1, &key).unwrap());
    let b = read(&random::categorical(&logits, -1, &random::key(42).unwrap()).unwrap());
    assert_eq!(a, b, "same key, same samples");
    let c = read(&random::categorical(&logits, -1, &random::key(43).unwrap()).unwrap());
    assert_ne!(a, c, "another key, other samples");
    let ones = a.iter().filter(|v| **v == 1.0).count() as f64 / a.len() as f64;
    assert!(a.iter().all(|v| *v != 2.0), "-inf logit never sampled");
    assert!((ones - 0.75).abs() < 0.03, "P(1) = {ones}, expected 0.75");
    let keys = random::split(&key, 3).unwrap();
    assert_eq!(keys.shape(), vec![3, 2]);
    let u = read(&random::uniform(&[1000], Dtype::Float32, &key).unwrap());
    assert!(u.iter().all(|v| (0.0..1.0).contains(v)));
    let mean = u.iter().sum::<f64>() / u.len() as f64;
    assert!((mean - 0.5).abs() < 0.05);
}

#[test]
fn half_precision_round_trips() {
    let v: Vec<half::bf16> = [1.5f32, -2.25, 1e-3]
        .iter()
        .map(|x| half::bf16::from_f32(*x))
        .collect();
    let a = Array::from_slice(&v, &[3]).unwrap();
    assert_eq!(a.dtype().unwrap(), Dtype::Bfloat16);
    assert_eq!(a.to_vec::<half::bf16>().unwrap(), v);
    let h: Vec<half::f16> = [1.5f32, -2.25, 1e-3]
        .iter()
        .map(|x| half::f16::from_f32(*x))
        .collect();
    let b = Array::from_slice(&h, &[3]).unwrap();
    assert_eq!(b.to_vec::<half::f16>().unwrap(), h);
    let f = b.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(f, h.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
    assert_eq!(a.nbytes(), 6);
    let raw = b.to_bytes().unwrap();
    let c = Array::from_bytes(&raw, &[3], Dtype::Float16).unwrap();
    assert_eq!(c.to_vec::<half::f16>().unwrap(), h);
}

#[test]
fn errors_are_results_not_aborts() {
    let a = ops::zeros(&[2, 3], Dtype::Float32).unwrap();
    let b = ops::zeros(&[4, 5], Dtype::Float32).unwrap();
    let err = a.matmul(&b).unwrap_err().to_string();
    assert!(err.starts_with("MLX: "), "{err}");
    assert!(
        err.contains("matmul") || err.contains("shape"),
        "readable message: {err}"
    );
    // The process is still alive and MLX still works.
    let ok = a
        .matmul(&ops::zeros(&[3, 1], Dtype::Float32).unwrap())
        .unwrap();
    assert_eq!(ok.shape(), vec![2, 1]);
    assert!(a.reshape(&[7]).is_err());
    assert!(a.add(&b).is_err(), "non-broadcastable add");
    assert!(Array::from_bytes(&[0u8; 5], &[2], Dtype::Float32).is_err());
    assert!(Array::from_slice(&[1.0f32], &[-1]).is_err());
    assert!(
        a.take(&ops::zeros(&[1], Dtype::Float32).unwrap(), 0)
            .is_err(),
        "float indices"
    );
    let q = ops::zeros(&[1, 2, 3, 8], Dtype::Float32).unwrap();
    let k = ops::zeros(&[1, 2, 3, 4], Dtype::Float32).unwrap();
    assert!(ops::scaled_dot_product_attention(&q, &k, &k, 1.0, AttentionMask::None, None).is_err());
}

#[test]
fn devices_and_memory() {
    let dev = mlxcel_core::default_device().unwrap();
    assert!(dev.is_available().unwrap());
    assert!(mlxcel_core::Device::Cpu.is_available().unwrap());
    if !mlxcel_core::Device::Gpu.is_available().unwrap() {
        assert!(mlxcel_core::set_default_device(mlxcel_core::Device::Gpu).is_err());
    }
    let a = ops::ones(&[1024, 1024], Dtype::Float32).unwrap();
    a.eval().unwrap();
    assert!(mlxcel_core::memory::active_bytes().unwrap() >= 4 << 20);
    assert!(mlxcel_core::memory::peak_bytes().unwrap() >= 4 << 20);
    assert!(mlxcel_core::mlx_version().unwrap().starts_with("0.32"));
}

#[test]
fn gated_activations_fused_and_unfused_match_the_definition() {
    use mlxcel_core::ops::{gated_activation_as, GatedActivation};
    let mut r = rng(77);
    let n = 257;
    let g = random_vec(&mut r, n, -4.0, 4.0);
    let u = random_vec(&mut r, n, -2.0, 2.0);
    let erf = |x: f64| {
        // Abramowitz-Stegun 7.1.26 is too coarse for 1e-5; integrate instead.
        let steps = 4000;
        let h = x / steps as f64;
        let f = |t: f64| (-t * t).exp();
        let mut s = f(0.0) + f(x);
        for i in 1..steps {
            s += f(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
        }
        s * h / 3.0 * 2.0 / std::f64::consts::PI.sqrt()
    };
    let cases: [(GatedActivation, &dyn Fn(f64) -> f64); 3] = [
        (GatedActivation::Silu, &|x: f64| x / (1.0 + (-x).exp())),
        (GatedActivation::GeluTanh, &|x: f64| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        }),
        (GatedActivation::Gelu, &|x: f64| {
            0.5 * x * (1.0 + erf(x / 2f64.sqrt()))
        }),
    ];
    for dtype in [Dtype::Float32, Dtype::Bfloat16] {
        let (gv, uv) = (round_to(&g, dtype), round_to(&u, dtype));
        let (ga, ua) = (
            array(&gv, &[n as i32], dtype),
            array(&uv, &[n as i32], dtype),
        );
        for (kind, act) in &cases {
            let want: Vec<f64> = gv.iter().zip(&uv).map(|(g, u)| act(*g) * u).collect();
            for fused in [false, true] {
                let got = gated_activation_as(*kind, &ga, &ua, fused).unwrap();
                assert_eq!(
                    got.dtype().unwrap(),
                    dtype,
                    "{kind:?} keeps the input dtype"
                );
                // bf16: a few roundings of intermediate results.
                let tol = if dtype == Dtype::Float32 {
                    1e-5
                } else {
                    4.0 * tolerance(dtype)
                };
                for (i, (a, b)) in read(&got).iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() <= tol * b.abs().max(1.0),
                        "{kind:?} {dtype} fused={fused} element {i}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

/// In-place byte writes land where asked in an array nothing else holds, equal what
/// `slice_update` computes, and are refused (nothing written) while another array shares the
/// buffer, or for a view; out-of-range writes are errors.
#[test]
fn in_place_writes_only_into_exclusive_buffers() {
    let rows = [[1u32, 2, 3], [4, 5, 6], [7, 8, 9]];
    let flat: Vec<u32> = rows.iter().flatten().copied().collect();
    let make = || {
        let a = Array::from_slice(&flat, &[3, 3])
            .unwrap()
            .add_scalar(0.0)
            .unwrap();
        a.astype(Dtype::Uint32).unwrap()
    };
    let update = [40u32, 50, 60];
    let bytes: Vec<u8> = update.iter().flat_map(|v| v.to_le_bytes()).collect();
    let expected = make()
        .slice_update(
            &Array::from_slice(&update, &[1, 3]).unwrap(),
            &[1, 0],
            &[2, 3],
            &[1, 1],
        )
        .unwrap()
        .to_vec::<u32>()
        .unwrap();
    let mut a = make();
    assert!(
        a.write_bytes_in_place(12, &bytes).unwrap(),
        "exclusive buffer"
    );
    assert_eq!(a.to_vec::<u32>().unwrap(), expected);
    // A second handle on the same array: refused, both unchanged.
    let mut b = make();
    b.eval().unwrap();
    let other = b.clone();
    assert!(!b.write_bytes_in_place(12, &bytes).unwrap());
    assert_eq!(other.to_vec::<u32>().unwrap(), flat);
    drop(other);
    // A view sharing the buffer (a row of `c`): refused while the view lives.
    let c = make();
    c.eval().unwrap();
    let row = c.slice(&[0, 0], &[1, 3], &[1, 1]).unwrap();
    row.eval().unwrap();
    let mut c2 = c.clone();
    drop(c);
    assert!(!c2.write_bytes_in_place(0, &bytes).unwrap());
    assert_eq!(row.to_vec::<u32>().unwrap(), vec![1, 2, 3]);
    assert!(a.write_bytes_in_place(30, &bytes).is_err(), "past the end");
}
