//! mlxcel's CPU linear kernel (`cpp/cpu_linear.cc`, reached through `ops::quantized_matmul` and
//! `ops::linear` on the CPU with float32 activations) against a float64 host reference built
//! from MLX's own `dequantize` (quantized weights) or the stored values (dense weights): every
//! bit width and scale dtype it takes, the fused few-row path (1–4 rows), the blocked path, the
//! packed GEMM (16 rows and more) with its bias and activation epilogue, the thread pool (large
//! enough layers), odd sizes and strided inputs.

mod common;

use common::*;
use mlxcel_core::ops::{self, KernelActivation, QuantSpec};
use mlxcel_core::{Array, Dtype};

/// `x [m, k] @ w[n, k]^T` in float64, with the bound `sum |x| |w|` per output used to scale the
/// tolerance (float32 accumulation in a different order than the reference).
fn reference(x: &[f64], w: &[f64], m: usize, k: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0; m * n];
    let mut bound = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut b) = (0.0, 0.0);
            for t in 0..k {
                s += x[i * k + t] * w[j * k + t];
                b += (x[i * k + t] * w[j * k + t]).abs();
            }
            y[i * n + j] = s;
            bound[i * n + j] = b;
        }
    }
    (y, bound)
}

fn check(what: &str, got: &Array, want: &[f64], bound: &[f64]) {
    assert_eq!(got.dtype().unwrap(), Dtype::Float32, "{what}: output dtype");
    let got = read(got);
    assert_eq!(got.len(), want.len(), "{what}: output size");
    for (i, ((g, w), b)) in got.iter().zip(want).zip(bound).enumerate() {
        let tol = 2e-6 * b + 1e-6;
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: got {g}, want {w} (tolerance {tol})"
        );
    }
}

/// Dequantizes MLX's affine layout on the host: codes packed LSB-first into little-endian u32
/// words, `w = scale * code + bias` per group, in float64 from the stored scales and biases.
fn dequantize_host(q: &ops::Quantized, bits: usize, group: usize, n: usize, k: usize) -> Vec<f64> {
    let words = q.weight.to_vec::<u32>().unwrap();
    let scales = read(&q.scales);
    let biases = read(q.biases.as_ref().unwrap());
    let per_word = 32 / bits;
    (0..n * k)
        .map(|i| {
            let code = (words[i / per_word] >> ((i % per_word) * bits)) & ((1 << bits) - 1);
            let g = i / group;
            scales[g] * code as f64 + biases[g]
        })
        .collect()
}

fn random_matrix(rows: usize, cols: usize, seed: u64, dtype: Dtype) -> (Array, Vec<f64>) {
    let mut r = rng(seed);
    let v = round_to(&random_vec(&mut r, rows * cols, -1.0, 1.0), dtype);
    (array(&v, &[rows as i32, cols as i32], dtype), v)
}

#[test]
fn quantized_rows_match_float64_reference() {
    let mut case = 0u64;
    for bits in [2, 4, 8] {
        for group in [32, 64, 128] {
            for scale_dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
                for (m, k, n) in [
                    (1, 128, 7),
                    (2, 256, 33),
                    (3, 128, 64),
                    (4, 384, 9),
                    (5, 128, 5),
                    (17, 256, 30),
                    // From 64 rows on, the packed GEMM on panels dequantized as they are packed
                    // (strip and panel edges at 67 rows, 45 columns).
                    (67, 256, 45),
                ] {
                    if k % group != 0 {
                        continue;
                    }
                    case += 1;
                    let (w, _) = random_matrix(n, k, 100 + case, scale_dtype);
                    let spec = QuantSpec::affine(group as i32, bits);
                    let q = w.quantize(spec).unwrap();
                    let biases = q.biases.as_ref().unwrap();
                    assert_eq!(q.scales.dtype().unwrap(), scale_dtype);
                    let deq = dequantize_host(&q, bits as usize, group, n, k);
                    let (x, xv) = random_matrix(m, k, 200 + case, Dtype::Float32);
                    let (want, bound) = reference(&xv, &deq, m, k, n);
                    let got =
                        ops::quantized_matmul(&x, &q.weight, &q.scales, Some(biases), true, spec)
                            .unwrap();
                    check(
                        &format!("{bits}-bit g{group} scales {scale_dtype} m{m} k{k} n{n}"),
                        &got,
                        &want,
                        &bound,
                    );
                }
            }
        }
    }
}

#[test]
fn dense_rows_match_float64_reference() {
    for (i, dtype) in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16]
        .into_iter()
        .enumerate()
    {
        // k = 13 and 70 exercise the scalar tail after the 8-wide vectors.
        // From 16 rows on, the packed GEMM (its strip and panel edges at 33 rows, 9 columns).
        for (m, k, n) in [
            (1, 13, 5),
            (3, 70, 9),
            (4, 64, 2),
            (6, 13, 3),
            (9, 200, 31),
            (16, 13, 5),
            (33, 70, 9),
        ] {
            let seed = 10 * i as u64 + m as u64;
            let (w, wv) = random_matrix(n, k, 300 + seed, dtype);
            let (x, xv) = random_matrix(m, k, 400 + seed, Dtype::Float32);
            let (want, bound) = reference(&xv, &wv, m, k, n);
            let got = ops::linear(&x, &w, None).unwrap();
            check(
                &format!("dense {dtype} m{m} k{k} n{n}"),
                &got,
                &want,
                &bound,
            );
        }
    }
}

#[test]
fn large_layers_split_over_threads_and_keep_batch_dims() {
    // 1024 x 512 weights are past the size from which the kernel uses its thread pool; x has
    // a batch dimension and is a transposed (non-contiguous) view.
    let (k, n) = (512usize, 1024usize);
    let spec = QuantSpec::affine(64, 4);
    let (w, _) = random_matrix(n, k, 7, Dtype::Bfloat16);
    let q = w.quantize(spec).unwrap();
    let biases = q.biases.as_ref().unwrap();
    let deq = dequantize_host(&q, 4, 64, n, k);
    for rows in [1usize, 6] {
        let (xt, xtv) = random_matrix(k, 2 * rows, 8 + rows as u64, Dtype::Float32);
        // x = xt^T reshaped to [2, rows, k]: row r of x is column r of xt.
        let x = xt
            .t()
            .unwrap()
            .reshape(&[2, rows as i32, k as i32])
            .unwrap();
        let xv: Vec<f64> = (0..2 * rows)
            .flat_map(|r| (0..k).map(move |c| (r, c)))
            .map(|(r, c)| xtv[c * 2 * rows + r])
            .collect();
        let (want, bound) = reference(&xv, &deq, 2 * rows, k, n);
        let got =
            ops::quantized_matmul(&x, &q.weight, &q.scales, Some(biases), true, spec).unwrap();
        assert_eq!(got.shape(), vec![2, rows as i32, n as i32]);
        check(&format!("threaded 4-bit rows {rows}"), &got, &want, &bound);

        let (wd, wdv) = random_matrix(n, k, 9, Dtype::Bfloat16);
        let (want, bound) = reference(&xv, &wdv, 2 * rows, k, n);
        let got = ops::linear(&x, &wd, None).unwrap();
        check(&format!("threaded dense rows {rows}"), &got, &want, &bound);
    }
}

#[test]
fn the_thread_pool_runs_every_task_once_before_a_call_returns() {
    // Regression: a worker that had seen one call could pick up the next call's job while the
    // previous call's claim counter was still open, run one of the new call's tasks under the
    // old claim and count it twice, so that a call returned with a task still writing its
    // outputs (a parity fixture's logits came out wrong, then the pool hung). Back-to-back
    // calls with changing task counts, as the decode engine makes, are where that window opens.
    // The broken pool also hung (a count past `tasks` never equals it): fail instead of waiting.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(mlxcel_core::cpu_decode::check_thread_pool(200_000).unwrap());
    });
    let bad = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the thread pool hung: a call never saw its tasks complete");
    assert_eq!(
        bad, 0,
        "{bad} pool calls returned before each task ran exactly once"
    );
}

#[test]
fn mismatched_shapes_are_errors_not_aborts() {
    let (x, _) = random_matrix(2, 64, 1, Dtype::Float32);
    let (w, _) = random_matrix(8, 32, 2, Dtype::Float32);
    let err = ops::linear(&x, &w, None).unwrap_err().to_string();
    assert!(err.contains("32 columns, x has 64"), "{err}");
}

#[test]
fn routed_experts_match_float64_reference() {
    // A stack of 5 experts; (a) decode layout: x [t, 1, 1, K] with k experts per row, ids
    // [t, k], unsorted; (b) prefill layout: x [P, 1, K], ids [P] sorted, so runs of one expert
    // become many-row products. Output [..ids, 1, N].
    let (experts, k, n) = (5usize, 128usize, 40usize);
    for (bits, group) in [(4, 64), (8, 32), (2, 128)] {
        let spec = QuantSpec::affine(group as i32, bits);
        let (stack, _) = random_matrix(experts * n, k, 900 + bits as u64, Dtype::Bfloat16);
        let stack = stack
            .reshape(&[experts as i32, n as i32, k as i32])
            .unwrap();
        let q = stack.quantize(spec).unwrap();
        let deq = dequantize_host(&q, bits as usize, group, experts * n, k);
        let expert_rows = |e: usize| &deq[e * n * k..(e + 1) * n * k];

        let (t, per_row) = (3usize, 2usize);
        let ids: Vec<u32> = vec![4, 1, 0, 4, 2, 2];
        let (x, xv) = random_matrix(t, k, 31, Dtype::Float32);
        let x4 = x.reshape(&[t as i32, 1, 1, k as i32]).unwrap();
        let ids_a = Array::from_slice(&ids, &[t as i32, per_row as i32]).unwrap();
        let got = ops::gather_qmm(
            &x4,
            &q.weight,
            &q.scales,
            q.biases.as_ref(),
            None,
            Some(&ids_a),
            true,
            spec,
            false,
        )
        .unwrap();
        assert_eq!(got.shape(), vec![t as i32, per_row as i32, 1, n as i32]);
        let mut want = Vec::new();
        let mut bound = Vec::new();
        for (p, e) in ids.iter().enumerate() {
            let row = &xv[(p / per_row) * k..(p / per_row + 1) * k];
            let (y, b) = reference(row, expert_rows(*e as usize), 1, k, n);
            want.extend(y);
            bound.extend(b);
        }
        check(&format!("{bits}-bit decode layout"), &got, &want, &bound);

        let sorted: Vec<i32> = vec![0, 0, 0, 1, 3, 3, 4, 4, 4, 4];
        let rows = sorted.len();
        let (x, xv) = random_matrix(rows, k, 32, Dtype::Float32);
        let x3 = x.reshape(&[rows as i32, 1, k as i32]).unwrap();
        let ids_s = Array::from_slice(&sorted, &[rows as i32]).unwrap();
        let got = ops::gather_qmm(
            &x3,
            &q.weight,
            &q.scales,
            q.biases.as_ref(),
            None,
            Some(&ids_s),
            true,
            spec,
            true,
        )
        .unwrap();
        assert_eq!(got.shape(), vec![rows as i32, 1, n as i32]);
        let mut want = Vec::new();
        let mut bound = Vec::new();
        for (p, e) in sorted.iter().enumerate() {
            let (y, b) = reference(&xv[p * k..(p + 1) * k], expert_rows(*e as usize), 1, k, n);
            want.extend(y);
            bound.extend(b);
        }
        check(&format!("{bits}-bit sorted layout"), &got, &want, &bound);
    }
}

/// erf in float64: Simpson's rule over `2 / sqrt(pi) * exp(-t^2)` (error far below float32's).
fn erf64(x: f64) -> f64 {
    let steps = 400;
    let h = x / steps as f64;
    let f = |t: f64| (-t * t).exp();
    let mut sum = f(0.0) + f(x);
    for i in 1..steps {
        sum += f(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
    }
    sum * h / 3.0 * 2.0 / std::f64::consts::PI.sqrt()
}

fn activate(x: f64, act: KernelActivation) -> f64 {
    match act {
        KernelActivation::None => x,
        KernelActivation::Gelu => 0.5 * x * (1.0 + erf64(x / 2f64.sqrt())),
        KernelActivation::GeluTanh => {
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            0.5 * x * (1.0 + inner.tanh())
        }
        KernelActivation::Relu => x.max(0.0),
        KernelActivation::Silu => x / (1.0 + (-x).exp()),
    }
}

#[test]
fn many_rows_with_bias_and_activation_match_float64_reference() {
    let acts = [
        KernelActivation::None,
        KernelActivation::Gelu,
        KernelActivation::GeluTanh,
        KernelActivation::Relu,
        KernelActivation::Silu,
    ];
    for (i, dtype) in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16]
        .into_iter()
        .enumerate()
    {
        // Sizes around the 12 x 32 (AVX-512) and 6 x 16 tiles, and a layer big enough for the
        // thread pool; from 16 rows on the kernel runs as the packed GEMM.
        for (m, k, n) in [(16, 13, 5), (29, 70, 45), (100, 384, 70), (40, 200, 33)] {
            let seed = 10 * i as u64 + m as u64;
            let (w, wv) = random_matrix(n, k, 500 + seed, dtype);
            let (x, xv) = random_matrix(m, k, 600 + seed, Dtype::Float32);
            let (b, bv) = random_matrix(1, n, 700 + seed, dtype);
            let b = b.reshape(&[n as i32]).unwrap();
            let (pre, bound) = reference(&xv, &wv, m, k, n);
            for act in acts {
                let got = ops::cpu_linear_fused(&x, &w, Some(&b), act)
                    .unwrap()
                    .expect("float32 x on the CPU takes the kernel");
                assert_eq!(got.shape(), vec![m as i32, n as i32]);
                let got = read(&got);
                for (j, g) in got.iter().enumerate() {
                    let z = pre[j] + bv[j % n];
                    let want = activate(z, act);
                    // The sum's float32 error, carried through an activation of slope <= 1.13,
                    // plus erf's 1.5e-7 (GELU).
                    let tol = 1.2 * (2e-6 * bound[j] + 1e-6) + 2e-7 * z.abs();
                    assert!(
                        (g - want).abs() <= tol,
                        "{dtype} m{m} k{k} n{n} {act:?}: element {j}: got {g}, want {want}"
                    );
                }
            }
        }
    }
}

/// A runtime LoRA term in the base layer's node (`ops::cpu_linear_low_rank`): `x·Wᵀ + (x·a)·b`
/// over dense (float32, bf16) and 4-bit weights, through the row kernels (1, 3 rows), the
/// threaded row split and the packed GEMM (17, 40 rows, dense), against float64; mismatched
/// factors are errors.
#[test]
fn low_rank_term_matches_float64_reference() {
    let mut case = 0u64;
    for (m, k, n, r) in [
        (1, 128, 33, 4),
        (3, 64, 70, 16),
        (17, 128, 9, 8),
        (40, 64, 128, 3),
    ] {
        for quantized in [None, Some(Dtype::Float32), Some(Dtype::Bfloat16)] {
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                if quantized.is_some() && dtype != Dtype::Float32 {
                    continue;
                }
                case += 1;
                let (w, wv) = random_matrix(n, k, 500 + case, quantized.unwrap_or(dtype));
                let (x, xv) = random_matrix(m, k, 600 + case, Dtype::Float32);
                let (a, av) = random_matrix(k, r, 700 + case, Dtype::Float32);
                let (b, bv) = random_matrix(r, n, 800 + case, Dtype::Float32);
                let (got, base) = match quantized {
                    None => (ops::cpu_linear_low_rank(&x, &w, None, &a, &b).unwrap(), wv),
                    Some(_) => {
                        let spec = QuantSpec::affine(64, 4);
                        let q = w.quantize(spec).unwrap();
                        let biases = q.biases.clone().unwrap();
                        let deq = dequantize_host(&q, 4, 64, n, k);
                        let got = ops::cpu_linear_low_rank(
                            &x,
                            &q.weight,
                            Some((&q.scales, &biases, spec)),
                            &a,
                            &b,
                        )
                        .unwrap();
                        (got, deq)
                    }
                };
                let got = got.expect("the CPU kernel applies");
                let (mut want, mut bound) = reference(&xv, &base, m, k, n);
                // + (x·a)·b, and its magnitude in the tolerance.
                let (xa, xa_bound) = reference(&xv, &transpose(&av, k, r), m, k, r);
                let (lr, lr_bound) = reference(&xa, &transpose(&bv, r, n), m, r, n);
                for i in 0..m * n {
                    want[i] += lr[i];
                    bound[i] +=
                        lr_bound[i] + xa_bound[i / n * r..(i / n + 1) * r].iter().sum::<f64>();
                }
                check(
                    &format!("low rank m{m} k{k} n{n} r{r} quantized {quantized:?} {dtype}"),
                    &got,
                    &want,
                    &bound,
                );
            }
        }
    }
    let (w, _) = random_matrix(8, 16, 1, Dtype::Float32);
    let (x, _) = random_matrix(2, 16, 2, Dtype::Float32);
    let (a, _) = random_matrix(16, 4, 3, Dtype::Float32);
    let (b, _) = random_matrix(3, 8, 4, Dtype::Float32);
    let err = ops::cpu_linear_low_rank(&x, &w, None, &a, &b)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the low-rank factors must be [16, r] and [r, 8]"),
        "{err}"
    );
}

/// `v` `[rows, cols]` row-major, transposed.
fn transpose(v: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..rows * cols)
        .map(|i| v[(i % rows) * cols + i / rows])
        .collect()
}
