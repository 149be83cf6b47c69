//! mlxcel's CPU recurrence kernels (`cpp/cpu_scan.cc`) against float64 host references on
//! seeded random inputs: the selective scan with a decay per (channel, state) (Mamba-1) and per
//! head (Mamba-2, grouped B/C), from a non-zero state, over a prompt and one decode position;
//! and RWKV-7's generalised delta rule. A prompt split in two continues from the first call's
//! state to the one-call result.

#![allow(clippy::needless_range_loop)]

mod common;

use common::*;
use mlxcel_core::ops;
use mlxcel_core::Dtype;

const F32: Dtype = Dtype::Float32;

/// `(y [B, L, H, P], last state [B, H, P, N])` of the selective recurrence.
#[allow(clippy::too_many_arguments)]
fn scan_reference(
    x: &[f64],
    dt: &[f64],
    a: &[f64],
    bm: &[f64],
    cm: &[f64],
    h0: &[f64],
    (b, l, h, p, g, n): (usize, usize, usize, usize, usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; b * l * h * p];
    let mut s = h0.to_vec();
    for bi in 0..b {
        for hi in 0..h {
            let gi = hi / (h / g);
            for pi in 0..p {
                let st = &mut s[((bi * h + hi) * p + pi) * n..][..n];
                for t in 0..l {
                    let d = dt[(bi * l + t) * h + hi];
                    let xv = x[((bi * l + t) * h + hi) * p + pi];
                    let row = ((bi * l + t) * g + gi) * n;
                    let mut acc = 0.0;
                    for ni in 0..n {
                        st[ni] = (d * a[hi * n + ni]).exp() * st[ni] + d * xv * bm[row + ni];
                        acc += st[ni] * cm[row + ni];
                    }
                    y[((bi * l + t) * h + hi) * p + pi] = acc;
                }
            }
        }
    }
    (y, s)
}

fn check_scan(dims: (usize, usize, usize, usize, usize, usize), per_head_decay: bool, seed: u64) {
    let (b, l, h, p, g, n) = dims;
    let mut r = rng(seed);
    let x = round_to(&random_vec(&mut r, b * l * h * p, -1.0, 1.0), F32);
    let dt = round_to(&random_vec(&mut r, b * l * h, 0.01, 0.5), F32);
    let a: Vec<f64> = if per_head_decay {
        let per_head = round_to(&random_vec(&mut r, h, -2.0, -0.1), F32);
        (0..h * n).map(|i| per_head[i / n]).collect()
    } else {
        round_to(&random_vec(&mut r, h * n, -2.0, -0.1), F32)
    };
    let bm = round_to(&random_vec(&mut r, b * l * g * n, -1.0, 1.0), F32);
    let cm = round_to(&random_vec(&mut r, b * l * g * n, -1.0, 1.0), F32);
    let h0 = round_to(&random_vec(&mut r, b * h * p * n, -0.5, 0.5), F32);
    let (want_y, want_s) = scan_reference(&x, &dt, &a, &bm, &cm, &h0, dims);
    let (bi, hi, pi, gi, ni) = (b as i32, h as i32, p as i32, g as i32, n as i32);
    let run = |from: usize, to: usize, state: &mlxcel_core::Array| {
        let cut = |v: &[f64], per: usize, shape: &[i32]| {
            let rows: Vec<f64> = (0..b)
                .flat_map(|bb| v[(bb * l + from) * per..(bb * l + to) * per].to_vec())
                .collect();
            array(&rows, shape, F32)
        };
        let len = (to - from) as i32;
        ops::selective_scan(
            &cut(&x, h * p, &[bi, len, hi, pi]),
            &cut(&dt, h, &[bi, len, hi]),
            &array(&a, &[hi, ni], F32),
            &cut(&bm, g * n, &[bi, len, gi, ni]),
            &cut(&cm, g * n, &[bi, len, gi, ni]),
            state,
            per_head_decay,
        )
        .unwrap()
        .expect("the CPU kernels are on by default")
    };
    let what = format!("scan {dims:?} per_head_decay={per_head_decay}");
    let (y, s) = run(0, l, &array(&h0, &[bi, hi, pi, ni], F32));
    assert_close(&format!("{what}: y"), &read(&y), &want_y, 1e-4);
    assert_close(&format!("{what}: state"), &read(&s), &want_s, 1e-4);
    // Two calls, the second continuing from the first's state: the same last state.
    let cut = l / 2;
    let (_, s1) = run(0, cut, &array(&h0, &[bi, hi, pi, ni], F32));
    let (_, s2) = run(cut, l, &s1);
    assert_close(&format!("{what}: split state"), &read(&s2), &want_s, 1e-4);
}

#[test]
fn selective_scan_matches_the_recurrence() {
    // Mamba-1: every channel a head of one, one group, a decay per (channel, state).
    check_scan((2, 9, 12, 1, 1, 5), false, 1);
    // Mamba-2: heads of several channels, two groups of B/C, one decay per head.
    check_scan((1, 17, 4, 20, 2, 8), true, 2);
    // One decode position.
    check_scan((2, 1, 6, 3, 3, 4), true, 3);
}

/// `(y [B, L, H, D], last state [B, H, D, D])` of RWKV-7's rule.
#[allow(clippy::too_many_arguments)]
fn delta_reference(
    rs: &[&[f64]; 6],
    s0: &[f64],
    (b, l, h, d): (usize, usize, usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let [r, w, k, v, a, bb] = rs;
    let mut y = vec![0.0; b * l * h * d];
    let mut s = s0.to_vec();
    for bi in 0..b {
        for hi in 0..h {
            let st = &mut s[(bi * h + hi) * d * d..][..d * d];
            for t in 0..l {
                let row = ((bi * l + t) * h + hi) * d;
                let sa: Vec<f64> = (0..d)
                    .map(|i| (0..d).map(|j| st[i * d + j] * a[row + j]).sum())
                    .collect();
                for i in 0..d {
                    let mut acc = 0.0;
                    for j in 0..d {
                        let e = &mut st[i * d + j];
                        *e = *e * w[row + j] + v[row + i] * k[row + j] + sa[i] * bb[row + j];
                        acc += *e * r[row + j];
                    }
                    y[row + i] = acc;
                }
            }
        }
    }
    (y, s)
}

#[test]
fn delta_rule_scan_matches_the_recurrence() {
    let (b, l, h, d) = (2usize, 11usize, 3usize, 8usize);
    let mut rng_ = rng(7);
    let mut input = |lo: f64, hi: f64| round_to(&random_vec(&mut rng_, b * l * h * d, lo, hi), F32);
    let (r, w, k, v) = (
        input(-1.0, 1.0),
        input(0.5, 0.99),
        input(-1.0, 1.0),
        input(-1.0, 1.0),
    );
    let (a, bb) = (input(-0.3, 0.3), input(-0.3, 0.3));
    let s0 = round_to(&random_vec(&mut rng(8), b * h * d * d, -0.5, 0.5), F32);
    let (want_y, want_s) = delta_reference(&[&r, &w, &k, &v, &a, &bb], &s0, (b, l, h, d));
    let shape = [b as i32, l as i32, h as i32, d as i32];
    let arr = |v: &[f64]| array(v, &shape, F32);
    let (y, s) = ops::cpu_delta_rule_scan(
        &arr(&r),
        &arr(&w),
        &arr(&k),
        &arr(&v),
        &arr(&a),
        &arr(&bb),
        &array(&s0, &[b as i32, h as i32, d as i32, d as i32], F32),
    )
    .unwrap()
    .expect("the CPU kernels are on by default");
    assert_close("delta rule: y", &read(&y), &want_y, 1e-4);
    assert_close("delta rule: state", &read(&s), &want_s, 1e-4);
}
