//! Checks and times mlxcel's CUDA kernels (`mlxcel_core::cuda_kernels`) against MLX's own ops,
//! on the GPU machine (`xtask/bench/gpu.sh stage` ships it; see xtask/bench/cuda/README.md):
//!
//!     cuda_kernels            correctness on assorted shapes, then timings on Llama-8B shapes
//!     cuda_kernels --source   print the generated module source (to compile-check with NVRTC)
//!     cuda_kernels --scan     the selective scan's check only
//!     cuda_kernels --mma      the tensor-core batch GEMV's check and timings only (the full
//!                             run includes them when MLXCEL_CUDA_QMV_MMA=1)
//!     cuda_kernels --gather   the routed-expert product's (MoE prefill) check and timings only
//!     cuda_kernels --rows     rows.cu's checks (embedding rows, SiLU gating, a router's
//!                             chosen scores, a prompt's rope into heads) and the rope's timing
//!                             on the Llama-8B prompt shape
//!
//! Reference: MLX's `dequantize` and `quantized_matmul` on the same planes. The dequantized
//! values must be bit-equal (both compute `scale * q + bias` in float32 and round once); the GEMV
//! must agree within the output dtype's rounding over K terms. The selective scan is checked
//! against the recurrence written out in MLX ops, position by position (float32, relative 1e-5). The last line is
//! `CUDA_KERNELS ok` or `CUDA_KERNELS fail <why>`.

use std::time::Instant;

use mlxcel_core::ops::{self, QuantMode, QuantSpec};
use mlxcel_core::policy::{self, RuntimePolicy};
use mlxcel_core::{cuda_kernels, Array, Dtype};

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn random(shape: &[i32], dtype: Dtype, seed: u64) -> R<Array> {
    let n: usize = shape.iter().map(|&d| d as usize).product();
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect();
    Ok(Array::from_slice(&values, shape)?.astype(dtype)?)
}

fn max_abs(a: &Array, b: &Array) -> R<(f32, f32)> {
    let a = a.astype(Dtype::Float32)?.to_vec::<f32>()?;
    let b = b.astype(Dtype::Float32)?.to_vec::<f32>()?;
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f32::max);
    Ok((diff, scale))
}

/// Median seconds per call of `f` over 5 repetitions of `iters` calls evaluated together.
fn time(iters: usize, f: &dyn Fn() -> R<Array>) -> R<f64> {
    ops::eval_all(&(0..3).map(|_| f()).collect::<R<Vec<_>>>()?)?;
    let mut per = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        let outs = (0..iters).map(|_| f()).collect::<R<Vec<_>>>()?;
        ops::eval_all(&outs)?;
        per.push(start.elapsed().as_secs_f64() / iters as f64);
    }
    per.sort_by(f64::total_cmp);
    Ok(per[2])
}

/// Seconds per call of mlxcel's GEMV (`cuda_kernels::qmv`, under the installed policy) and of
/// MLX's `quantized_matmul` on the same operands.
fn time_qmv_and_mlx(
    x: &Array,
    wq: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
) -> R<(f64, f64)> {
    let ours = time(200, &|| Ok(cuda_kernels::qmv(x, wq, scales, biases, spec)?))?;
    let mlx = time(200, &|| {
        Ok(ops::quantized_matmul(
            x,
            wq,
            scales,
            Some(biases),
            true,
            spec,
        )?)
    })?;
    Ok((ours, mlx))
}

/// The recurrence of `ops::selective_scan` in MLX ops, one position at a time: `y` `[B, L, H, P]`
/// and the last state.
fn scan_reference(
    x: &Array,
    dt: &Array,
    a: &Array,
    bm: &Array,
    cm: &Array,
    h0: &Array,
) -> R<(Array, Array)> {
    let (b, l, h) = (x.dim(0)?, x.dim(1)?, x.dim(2)?);
    let (g, n) = (bm.dim(2)?, bm.dim(3)?);
    // Each head's group of B and C: [B, L, H, N].
    let per_head = |m: &Array| -> R<Array> {
        Ok(m.reshape(&[b, l, g, 1, n])?
            .broadcast_to(&[b, l, g, h / g, n])?
            .reshape(&[b, l, h, n])?)
    };
    let (bh, ch) = (per_head(bm)?, per_head(cm)?);
    let mut s = h0.clone();
    let mut ys = Vec::new();
    for t in 0..l {
        let at = |m: &Array| m.slice_axis(1, t, t + 1)?.squeeze(&[1]);
        let d = at(dt)?.reshape(&[b, h, 1, 1])?;
        let decay = d.multiply(&a.reshape(&[1, h, 1, n])?)?.exp()?;
        let input = d
            .multiply(&at(x)?.expand_dims(&[-1])?)?
            .multiply(&at(&bh)?.expand_dims(&[2])?)?;
        s = decay.multiply(&s)?.add(&input)?;
        ys.push(
            s.multiply(&at(&ch)?.expand_dims(&[2])?)?
                .sum(&[-1], false)?,
        );
    }
    Ok((ops::stack(&ys, 1)?, s))
}

/// The CUDA selective scan on Mamba-2-like (one decay per head, grouped B/C, N = 128) and
/// Mamba-1-like (one channel per head, N = 16) shapes, prefill lengths and one-position steps.
fn check_scan() -> R<Vec<String>> {
    let mut failures = Vec::new();
    let f32 = Dtype::Float32;
    for (b, l, h, p, g, n, per_head) in [
        (1, 37, 24, 64, 1, 128, true),
        (2, 1, 24, 64, 2, 128, true),
        (2, 19, 96, 1, 1, 16, false),
        (1, 1, 512, 1, 1, 16, false),
        (1, 9, 4, 8, 4, 200, true),
    ] {
        let seed = (b * l * h * p * n) as u64;
        let x = random(&[b, l, h, p], f32, seed)?;
        // dt > 0 and A < 0, as softplus and -exp(A_log) give them.
        let dt = random(&[b, l, h], f32, seed + 1)?
            .abs()?
            .multiply(&Array::scalar(0.5, f32)?)?;
        let mut a = random(&[h, n], f32, seed + 2)?
            .abs()?
            .add(&Array::scalar(0.1, f32)?)?
            .negative()?;
        if per_head {
            a = a.slice_axis(1, 0, 1)?.broadcast_to(&[h, n])?;
        }
        let bm = random(&[b, l, g, n], f32, seed + 3)?;
        let cm = random(&[b, l, g, n], f32, seed + 4)?;
        let h0 = random(&[b, h, p, n], f32, seed + 5)?;
        let packed = cuda_kernels::selective_scan(&x, &dt, &a, &bm, &cm, &h0, per_head)?;
        let ys = l * h * p;
        let y = packed.slice_axis(1, 0, ys)?.reshape(&[b, l, h, p])?;
        let state = packed
            .slice_axis(1, ys, ys + h * p * n)?
            .reshape(&[b, h, p, n])?;
        let (y_ref, state_ref) = scan_reference(&x, &dt, &a, &bm, &cm, &h0)?;
        for (what, ours, mlx) in [("y", &y, &y_ref), ("state", &state, &state_ref)] {
            let (diff, scale) = max_abs(ours, mlx)?;
            let label = format!("scan B{b} L{l} H{h} P{p} G{g} N{n} {what}");
            println!("{label}: max|ours - MLX| {diff:.3e} (output scale {scale:.2})");
            if diff.is_nan() || diff > 1e-5 * scale.max(1.0) {
                failures.push(label);
            }
        }
    }
    Ok(failures)
}

/// Runs `f` under the installed policy as `change` alters it, then puts the policy back.
fn with_policy<T>(change: impl FnOnce(&mut RuntimePolicy), f: impl FnOnce() -> R<T>) -> R<T> {
    let before = policy::current();
    let mut altered = before.clone();
    change(&mut altered);
    policy::install(&altered)?;
    let result = f();
    policy::install(&before)?;
    result
}

/// Runs `f` with `MLXCEL_CUDA_QMV_MMA` set to `on`.
fn with_mma<T>(on: bool, f: impl FnOnce() -> R<T>) -> R<T> {
    with_policy(|p| p.cuda_qmv_mma = on, f)
}

/// Runs `f` with `MLXCEL_CUDA_GATHER` on.
fn with_gather<T>(f: impl FnOnce() -> R<T>) -> R<T> {
    with_policy(|p| p.cuda_gather = true, f)
}

/// A 4-bit affine matrix `[n, k]` quantized from random values: weight, scales, biases.
fn quantized(n: i32, k: i32, group_size: i32, dtype: Dtype, seed: u64) -> R<[Array; 3]> {
    let spec = QuantSpec {
        mode: QuantMode::Affine,
        group_size,
        bits: 4,
    };
    let q = random(&[n, k], dtype, seed)?.quantize(spec)?;
    let biases = q.biases.expect("affine has biases");
    ops::eval_all(&[q.weight.clone(), q.scales.clone(), biases.clone()])?;
    Ok([q.weight, q.scales, biases])
}

/// The tensor-core GEMV over decode batches (`gemv_mma`, both block shapes, and `qmv` with
/// `MLXCEL_CUDA_QMV_MMA=1`, with and without a residual) against MLX's `quantized_matmul`.
fn check_mma() -> R<Vec<String>> {
    let mut failures = Vec::new();
    for (n, k) in [(48, 64), (4096, 4096), (14336, 4096), (4096, 14336)] {
        for group_size in [32, 64, 128] {
            if k % group_size != 0 {
                continue;
            }
            for dtype in [Dtype::Bfloat16, Dtype::Float16] {
                let spec = QuantSpec {
                    mode: QuantMode::Affine,
                    group_size,
                    bits: 4,
                };
                let [wq, scales, biases] =
                    quantized(n, k, group_size, dtype, (n + k + group_size) as u64)?;
                for rows in [2, 3, 8, 9, 16] {
                    let x = random(&[rows, k], dtype, 100 + rows as u64)?;
                    // MLX 0.32.4's CUTLASS quantized matmul (several rows) is wrong for K = 64
                    // (../shared/device/README.md): there the reference is mlxcel's one-row
                    // GEMV per row, itself checked against MLX's one-row product above.
                    let mlx = if k < 512 {
                        with_mma(false, || {
                            Ok(cuda_kernels::qmv(&x, &wq, &scales, &biases, spec)?)
                        })?
                    } else {
                        ops::quantized_matmul(&x, &wq, &scales, Some(&biases), true, spec)?
                    };
                    let what = format!("{rows}x{k} @ {n}x{k} 4-bit g{group_size} {}", dtype.name());
                    for shape in cuda_kernels::QMV_MMA_SHAPES {
                        let ours =
                            cuda_kernels::gemv_mma(&x, &wq, &scales, &biases, None, Some(shape))?;
                        let label = format!("qmv_mma {}x{} {what}", shape.0, shape.1);
                        if !close(&label, &ours, &mlx, dtype, 4.0)? {
                            failures.push(label);
                        }
                    }
                    // Through the dispatch, as layers call it, with a residual now and then.
                    let res = random(&[rows, n], dtype, 7)?.mul_scalar(10.0)?;
                    let folded = rows % 2 == 1;
                    let ours = with_mma(true, || {
                        let residual = folded.then_some(&res);
                        let input = cuda_kernels::GemvInput::Plain;
                        Ok(cuda_kernels::gemv(
                            &x, &wq, &scales, &biases, spec, input, residual,
                        )?)
                    })?;
                    let (reference, bound) = if folded {
                        (res.add(&mlx)?, 8.0)
                    } else {
                        (mlx, 4.0)
                    };
                    let label = format!(
                        "qmv_mma dispatch{} {what}",
                        if folded { "+residual" } else { "" }
                    );
                    if !close(&label, &ours, &reference, dtype, bound)? {
                        failures.push(label);
                    }
                }
            }
        }
    }
    Ok(failures)
}

/// Decode-batch GEMVs of 8 rows: the tensor-core kernel (both block shapes) against the
/// one-row kernel launched per row (today's default for batches) and MLX's quantized matmul,
/// in microseconds and GB/s of weights (packed words, scales and biases) moved.
fn speed_mma() -> R<()> {
    let bf16 = Dtype::Bfloat16;
    let spec = QuantSpec {
        mode: QuantMode::Affine,
        group_size: 64,
        bits: 4,
    };
    for (n, k) in [(14336, 4096), (4096, 14336), (4096, 4096), (6144, 4096)] {
        let [wq, scales, biases] = quantized(n, k, 64, bf16, 21)?;
        let bytes = (wq.nbytes() + scales.nbytes() + biases.nbytes()) as f64;
        let gbs = |t: f64| bytes / t / 1e9;
        for rows in [2, 4, 8, 16] {
            let x = random(&[rows, k], bf16, 22)?;
            ops::eval_all(std::slice::from_ref(&x))?;
            let mut line = format!("{n}x{k} 4-bit g64 bf16, {rows} rows:");
            for shape in cuda_kernels::QMV_MMA_SHAPES {
                let t = time(200, &|| {
                    Ok(cuda_kernels::gemv_mma(
                        &x,
                        &wq,
                        &scales,
                        &biases,
                        None,
                        Some(shape),
                    )?)
                })?;
                line += &format!(
                    " mma {}x{} {:.1} us ({:.0} GB/s);",
                    shape.0,
                    shape.1,
                    t * 1e6,
                    gbs(t)
                );
            }
            let (per_row, mlx) =
                with_mma(false, || time_qmv_and_mlx(&x, &wq, &scales, &biases, spec))?;
            line += &format!(
                " one-row kernel per row {:.1} us ({:.0} GB/s); MLX {:.1} us ({:.0} GB/s)",
                per_row * 1e6,
                gbs(per_row),
                mlx * 1e6,
                gbs(mlx)
            );
            println!("{line}");
        }
    }
    Ok(())
}

/// `rows` expert ids in `0..experts`, sorted, skewed so that some experts get many rows, some
/// one, and some none (a router's choices over a prompt look like that).
fn sorted_ids(rows: i32, experts: i32, seed: u64) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut ids: Vec<u32> = (0..rows)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 11) as f64 / (1u64 << 53) as f64;
            ((u * u * experts as f64) as u32).min(experts as u32 - 1)
        })
        .collect();
    ids.sort_unstable();
    ids
}

/// The routed-expert product over rows sorted by expert (`gather_qmm_sorted`, every block
/// shape) against each expert's rows times its dequantized matrix in float32 on MLX's CPU (the
/// GPU's float32 matmul runs in TF32), and through `ops::gather_qmm` as MoE prefill calls it.
/// Shapes: small and ragged ones (few rows, features not a multiple of a block's, every group
/// size), and Qwen3-30B-A3B's gate/up and down projections over a 512-token prompt's 4096
/// (token, expert) rows.
fn check_gather() -> R<Vec<String>> {
    let mut failures = Vec::new();
    let cases = [
        // (experts, N, K, group size, rows)
        (8, 96, 256, 32, 77),
        (3, 40, 384, 64, 5),
        (4, 48, 128, 128, 16),
        (16, 72, 512, 64, 333),
        (128, 768, 2048, 64, 4096),
        (128, 2048, 768, 64, 4096),
    ];
    for (experts, n, k, group_size, rows) in cases {
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            if experts == 128 && dtype == Dtype::Float16 {
                continue; // the big shapes once
            }
            let spec = QuantSpec {
                mode: QuantMode::Affine,
                group_size,
                bits: 4,
            };
            let seed = (experts * n + k + rows) as u64;
            let q = random(&[experts, n, k], dtype, seed)?.quantize(spec)?;
            let (wq, scales) = (q.weight, q.scales);
            let biases = q.biases.expect("affine has biases");
            let x = random(&[rows, 1, k], dtype, seed + 1)?;
            let ids_host = sorted_ids(rows, experts, seed + 2);
            let ids = Array::from_slice(&ids_host, &[rows])?;
            ops::eval_all(&[wq.clone(), scales.clone(), biases.clone(), x.clone()])?;
            // Each expert's run of rows against its matrix, float32 on the CPU.
            mlxcel_core::set_default_device(mlxcel_core::Device::Cpu)?;
            let mut parts = Vec::new();
            let mut start = 0;
            while start < rows as usize {
                let e = ids_host[start];
                let end = start + ids_host[start..].iter().take_while(|&&i| i == e).count();
                let at = |a: &Array| a.slice_axis(0, e as i32, e as i32 + 1)?.squeeze(&[0]);
                let w = ops::dequantize(&at(&wq)?, &at(&scales)?, Some(&at(&biases)?), spec, None)?
                    .astype(Dtype::Float32)?;
                let xs = x
                    .slice_axis(0, start as i32, end as i32)?
                    .reshape(&[(end - start) as i32, k])?
                    .astype(Dtype::Float32)?;
                parts.push(xs.matmul(&w.transpose(&[1, 0])?)?);
                start = end;
            }
            let reference = ops::concatenate(&parts, 0)?.reshape(&[rows, 1, n])?;
            ops::eval_all(std::slice::from_ref(&reference))?;
            mlxcel_core::set_default_device(mlxcel_core::Device::Gpu)?;
            let what = format!(
                "{rows} rows @ {experts}x{n}x{k} 4-bit g{group_size} {}",
                dtype.name()
            );
            for shape in cuda_kernels::QMV_MMA_SHAPES {
                let ours =
                    cuda_kernels::gather_qmm_sorted(&x, &wq, &scales, &biases, &ids, Some(shape))?;
                let label = format!("qmm_gather {}x{} {what}", shape.0, shape.1);
                if ours.shape() != reference.shape()
                    || !close(&label, &ours, &reference, dtype, 2.0)?
                {
                    failures.push(label);
                }
            }
            // As SwitchGlu calls it (ops::gather_qmm with sorted ids picks the kernel under
            // MLXCEL_CUDA_GATHER=1).
            let ours = with_gather(|| {
                Ok(ops::gather_qmm(
                    &x,
                    &wq,
                    &scales,
                    Some(&biases),
                    None,
                    Some(&ids),
                    true,
                    spec,
                    true,
                )?)
            })?;
            let label = format!("ops::gather_qmm sorted {what}");
            if ours.shape() != reference.shape() || !close(&label, &ours, &reference, dtype, 2.0)? {
                failures.push(label);
            }
        }
    }
    Ok(failures)
}

/// Qwen3-30B-A3B's expert projections over a 512-token prompt (4096 sorted rows, 128 experts):
/// the gathered kernel against the path it replaces (mlxcel's dequantize of the whole stack,
/// then MLX's gathered matmul), in microseconds.
fn speed_gather() -> R<()> {
    let bf16 = Dtype::Bfloat16;
    let spec = QuantSpec {
        mode: QuantMode::Affine,
        group_size: 64,
        bits: 4,
    };
    for (n, k) in [(768, 2048), (2048, 768)] {
        let (experts, rows) = (128, 4096);
        let q = random(&[experts, n, k], bf16, 31)?.quantize(spec)?;
        let (wq, scales) = (q.weight, q.scales);
        let biases = q.biases.expect("affine has biases");
        let x = random(&[rows, 1, k], bf16, 32)?;
        let ids = Array::from_slice(&sorted_ids(rows, experts, 33), &[rows])?;
        ops::eval_all(&[
            wq.clone(),
            scales.clone(),
            biases.clone(),
            x.clone(),
            ids.clone(),
        ])?;
        let mut line = format!("gather {rows} rows @ {experts}x{n}x{k} 4-bit g64 bf16:");
        for shape in cuda_kernels::QMV_MMA_SHAPES {
            let t = time(20, &|| {
                Ok(cuda_kernels::gather_qmm_sorted(
                    &x,
                    &wq,
                    &scales,
                    &biases,
                    &ids,
                    Some(shape),
                )?)
            })?;
            line += &format!(" qmm_gather {}x{} {:.1} us;", shape.0, shape.1, t * 1e6);
        }
        let t = time(20, &|| {
            // ops::dequantize, as SwitchLinear's dequantized path calls it (mlxcel's kernel
            // takes 2-D planes; a stack goes to MLX's).
            let w = ops::dequantize(&wq, &scales, Some(&biases), spec, Some(bf16))?
                .transpose(&[0, 2, 1])?;
            Ok(ops::gather_mm(&x, &w, None, Some(&ids), true)?)
        })?;
        line += &format!(" dequantize + MLX gather_mm {:.1} us", t * 1e6);
        println!("{line}");
    }
    Ok(())
}

/// rows.cu: the embedding lookup against MLX's `take` (bit-equal, every table dtype, ids with
/// repeats and a 2-D shape), `silu(gate) * up` of `[gate | up]` and of separate gate and up
/// against MLX's compiled kernel, a router's chosen scores against `take_along_axis`
/// (bit-equal), and the prompt's rope into heads. The SiLU kernels round to the dtype after the
/// sigmoid, the product with the gate and the product with up, but MLX's sigmoid rounds inside
/// too: measured up to 1.5 units in the last place in bf16 (H100), 1 in f16.
fn check_rows() -> R<Vec<String>> {
    let mut failures = Vec::new();
    let ids: Vec<i32> = vec![3, 0, 1000, 3, 517, 999, 42, 7];
    let ids = Array::from_slice(&ids, &[2, 4])?;
    for dtype in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
        let table = random(&[1001, 96], dtype, 5)?;
        let q = table.quantize(QuantSpec {
            mode: QuantMode::Affine,
            group_size: 32,
            bits: 4,
        })?;
        for (what, t) in [
            ("table", &table),
            ("packed", &q.weight),
            ("scales", &q.scales),
        ] {
            let ours = cuda_kernels::take_rows(t, &ids)?;
            let mlx = t.take(&ids, 0)?;
            let label = format!("take_rows {what} {} of {}", t.dtype()?.name(), dtype.name());
            // Bit patterns compared as 32-bit words (half-precision rows pair up: 96 per row).
            let bits = |a: &Array| -> R<Vec<u32>> {
                Ok(a.reshape(&[-1])?
                    .contiguous()?
                    .view(Dtype::Uint32)?
                    .to_vec::<u32>()?)
            };
            let same = ours.shape() == mlx.shape() && bits(&ours)? == bits(&mlx)?;
            println!("{label}: {}", if same { "equal" } else { "DIFFERENT" });
            if !same {
                failures.push(label);
            }
        }
        for rows in [1, 7, 512] {
            let x = random(&[rows, 2 * 1408], dtype, rows as u64)?;
            let ours = cuda_kernels::silu_halves(&x)?;
            let parts = x.split_at(&[1408], -1)?;
            // MLX's own fused kernel (`ops::gated_activation` would take mlxcel's silu_mul).
            let mlx =
                ops::gated_activation_as(ops::GatedActivation::Silu, &parts[0], &parts[1], true)?;
            let label = format!("silu_halves {rows}x{} {}", 2 * 1408, dtype.name());
            if !close(&label, &ours, &mlx, dtype, 2.0)? {
                failures.push(label);
            }
        }
    }
    for dtype in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
        // Separate gate and up (a MoE prompt's experts) against MLX's compiled kernel.
        let (gate, up) = (
            random(&[300, 768], dtype, 21)?,
            random(&[300, 768], dtype, 22)?,
        );
        let ours = cuda_kernels::silu_mul(&gate, &up)?;
        let mlx = ops::gated_activation_as(ops::GatedActivation::Silu, &gate, &up, true)?;
        let label = format!("silu_mul 300x768 {}", dtype.name());
        if !close(&label, &ours, &mlx, dtype, 2.0)? {
            failures.push(label);
        }
        // A router's chosen experts' scores: bit-equal to MLX's take_along_axis.
        let scores = random(&[300, 128], dtype, 23)?;
        let ids: Vec<u32> = (0..300 * 8)
            .map(|i| ((i * 37 + i / 8) % 128) as u32)
            .collect();
        let ids = Array::from_slice(&ids, &[300, 8])?;
        let ours = cuda_kernels::take_along_rows(&scores, &ids)?;
        let mlx = scores.take_along_axis(&ids, -1)?;
        let (diff, _) = max_abs(&ours, &mlx)?;
        let label = format!("take_along_rows 300x128 top-8 {}", dtype.name());
        println!("{label}: max|ours - MLX| {diff:.3e}");
        if diff != 0.0 {
            failures.push(label);
        }
    }
    failures.extend(check_heads_rope()?);
    failures.extend(check_route()?);
    Ok(failures)
}

/// rows.cu's `route_topk` against MLX's ops for the same router (on the GPU MLX's argsort is a
/// stable full sort, so the top k come in descending order, ties to the lower expert, as the
/// kernel gives them): ids equal, weights within float32 rounding of the output dtype.
fn check_route() -> R<Vec<String>> {
    let mut failures = Vec::new();
    let (rows, experts, k) = (300, 128, 8);
    let logits = random(&[rows, experts], Dtype::Float32, 31)?.mul_scalar(4.0)?;
    let bias = random(&[experts], Dtype::Float32, 32)?.mul_scalar(0.05)?;
    for (sigmoid, with_bias, normalize, scale) in [
        (false, false, true, 1.0f32),
        (false, false, false, 2.5),
        (true, true, true, 1.0),
    ] {
        for dtype in [Dtype::Bfloat16, Dtype::Float32] {
            let spec = cuda_kernels::RouteSpec {
                top_k: k,
                sigmoid,
                normalize,
                scale,
            };
            let (ids, weights) =
                cuda_kernels::route_topk(&logits, with_bias.then_some(&bias), spec, dtype)?;
            let scores = if sigmoid {
                logits.sigmoid()?
            } else {
                logits.softmax(&[-1], true)?
            };
            let choice = if with_bias {
                scores.add(&bias)?
            } else {
                scores.clone()
            };
            let want_ids = choice.negative()?.argsort(-1)?.slice_axis(-1, 0, k)?;
            let mut want = scores.take_along_axis(&want_ids, -1)?;
            if normalize {
                let sum = want.sum(&[-1], true)?;
                want = want.divide(&if sigmoid { sum.add_scalar(1e-20)? } else { sum })?;
            }
            let want = want.mul_scalar(scale as f64)?.astype(dtype)?;
            let label = format!(
                "route_topk {rows}x{experts} top-{k} sigmoid {sigmoid} bias {with_bias} \
                 normalize {normalize} scale {scale} {}",
                dtype.name()
            );
            let same_ids =
                ids.to_vec::<u32>()? == want_ids.astype(Dtype::Uint32)?.to_vec::<u32>()?;
            if !same_ids {
                println!("{label}: ids DIFFER");
            }
            if !same_ids || !close(&label, &weights, &want, dtype, 2.0)? {
                failures.push(label);
            }
        }
    }
    Ok(failures)
}

/// What `heads_rope` replaces: the fused projection `[B, L, heads, D]` transposed into heads,
/// MLX's rope on the queries and on the keys (periods given, as llama3 scaling gives them),
/// the values as they are, in one `[B, heads, L, D]` array.
fn mlx_heads_rope(
    qkv: &Array,
    periods: &Array,
    (nq, nk): (i32, i32),
    traditional: bool,
    offset: i32,
) -> R<Array> {
    let spec = ops::Rope {
        dims: periods.size() as i32 * 2,
        traditional,
        base: 10_000.0,
        scale: 1.0,
        freqs: Some(periods),
    };
    let parts = qkv.transpose(&[0, 2, 1, 3])?.split_at(&[nq, nq + nk], 1)?;
    Ok(ops::concatenate(
        &[
            parts[0].rope(&spec, offset)?,
            parts[1].rope(&spec, offset)?,
            parts[2].clone(),
        ],
        1,
    )?)
}

/// Llama-3-like periods for `rot_half` rotated pairs (base 500000, stretched from pair 8 on).
fn rope_periods(rot_half: i32) -> R<(Array, Array)> {
    let periods: Vec<f32> = (0..rot_half)
        .map(|j| 500_000f32.powf(j as f32 / rot_half as f32) * if j >= 8 { 8.0 } else { 1.0 })
        .collect();
    let inv: Vec<f32> = periods.iter().map(|p| 1.0 / p).collect();
    Ok((
        Array::from_slice(&periods, &[rot_half])?,
        Array::from_slice(&inv, &[rot_half])?,
    ))
}

/// rows.cu's `heads_rope` against [`mlx_heads_rope`]: both rope in float32 and round once, so
/// within one unit in the last place. Full and partial rotation, halves and adjacent pairs,
/// positions from 0 and from 4093, a batch of 2.
fn check_heads_rope() -> R<Vec<String>> {
    let mut failures = Vec::new();
    for dtype in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
        for (b, l, (nq, nk), d, rot_half, traditional, offset) in [
            (1, 37, (8, 2), 64, 32, false, 0),
            (2, 5, (4, 4), 128, 64, false, 4093),
            (1, 300, (6, 2), 80, 16, true, 17),
        ] {
            let heads = nq + 2 * nk;
            let qkv = random(&[b, l, heads, d], dtype, (l * d) as u64)?;
            let (periods, inv) = rope_periods(rot_half)?;
            let spec = cuda_kernels::HeadsRope {
                inv_freq: &inv,
                traditional,
                query_heads: nq,
                kv_heads: nk,
                norms: None,
            };
            let ours = cuda_kernels::heads_rope(&qkv, &spec, offset as usize)?;
            // With Qwen3's per-head q/k RMSNorms first (heads_norm_rope): MLX's rms_norm on each
            // operand, then the same rope.
            let (q_norm, k_norm) = (
                random(&[d], dtype, 41)?.add_scalar(1.0)?,
                random(&[d], dtype, 42)?.add_scalar(1.0)?,
            );
            let normed_spec = cuda_kernels::HeadsRope {
                norms: Some((&q_norm, &k_norm, 1e-6)),
                ..spec
            };
            let ours_normed = cuda_kernels::heads_rope(&qkv, &normed_spec, offset as usize)?;
            let parts = qkv.transpose(&[0, 2, 1, 3])?.split_at(&[nq, nq + nk], 1)?;
            let normed = ops::concatenate(
                &[
                    parts[0].rms_norm(Some(&q_norm), 1e-6)?,
                    parts[1].rms_norm(Some(&k_norm), 1e-6)?,
                    parts[2].clone(),
                ],
                1,
            )?
            .transpose(&[0, 2, 1, 3])?;
            let mlx_normed = mlx_heads_rope(&normed, &periods, (nq, nk), traditional, offset)?;
            let label_normed = format!(
                "heads_norm_rope {b}x{l}x{heads}x{d} from {offset} {}",
                dtype.name()
            );
            if ours_normed.shape() != mlx_normed.shape()
                || !close(&label_normed, &ours_normed, &mlx_normed, dtype, 2.0)?
            {
                failures.push(label_normed);
            }
            let mlx = mlx_heads_rope(&qkv, &periods, (nq, nk), traditional, offset)?;
            let label = format!(
                "heads_rope {b}x{l}x{heads}x{d} rot {} {} from {offset} {}",
                2 * rot_half,
                if traditional { "pairs" } else { "halves" },
                dtype.name()
            );
            if ours.shape() != mlx.shape() || !close(&label, &ours, &mlx, dtype, 1.0)? {
                failures.push(label);
            }
        }
    }
    Ok(failures)
}

/// `heads_rope` against the MLX ops it replaces (made contiguous, as attention's inputs are
/// read) on the Llama-3.1-8B prompt shape: 512 positions of 32 query and 8 key/value heads.
fn speed_rows() -> R<()> {
    let (nq, nk, d) = (32, 8, 128);
    for l in [512, 2048] {
        let qkv = random(&[1, l, nq + 2 * nk, d], Dtype::Bfloat16, 3)?;
        let (periods, inv) = rope_periods(d / 2)?;
        let spec = cuda_kernels::HeadsRope {
            inv_freq: &inv,
            traditional: false,
            query_heads: nq,
            kv_heads: nk,
            norms: None,
        };
        let ours = time(50, &|| Ok(cuda_kernels::heads_rope(&qkv, &spec, 0)?))?;
        let mlx = time(50, &|| {
            Ok(mlx_heads_rope(&qkv, &periods, (nq, nk), false, 0)?.contiguous()?)
        })?;
        println!(
            "heads_rope 1x{l}x{}x{d} bf16: mlxcel {:.1} us, MLX rope + copies {:.1} us",
            nq + 2 * nk,
            ours * 1e6,
            mlx * 1e6
        );
    }
    Ok(())
}

fn check() -> R<Vec<String>> {
    let mut failures = check_scan()?;
    failures.extend(check_rows()?);
    failures.extend(check_gather()?);
    // The tensor-core batch GEMV when it is switched on (else `--mma` checks it alone).
    if policy::current().cuda_qmv_mma {
        failures.extend(check_mma()?);
    }
    let dtypes = [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32];
    for (n, k) in [(64, 256), (1001, 384), (4096, 4096), (1024, 4096)] {
        for bits in [4, 8] {
            for group_size in [32, 64, 128] {
                for dtype in dtypes {
                    let spec = QuantSpec {
                        mode: QuantMode::Affine,
                        group_size,
                        bits,
                    };
                    let w = random(&[n, k], dtype, (n * k + bits + group_size) as u64)?;
                    let q = w.quantize(spec)?;
                    let (wq, scales) = (q.weight, q.scales);
                    let biases = q.biases.expect("affine has biases");
                    let ours = cuda_kernels::dequantize(&wq, &scales, &biases, spec, dtype)?;
                    let mlx = ops::dequantize(&wq, &scales, Some(&biases), spec, Some(dtype))?;
                    let (diff, _) = max_abs(&ours, &mlx)?;
                    let label =
                        format!("dequant {n}x{k} {bits}-bit g{group_size} {}", dtype.name());
                    println!("{label}: max|ours - MLX| {diff:.3e}");
                    if diff != 0.0 {
                        failures.push(label);
                    }
                    if group_size == 64 {
                        failures.extend(check_folds(&wq, &scales, &biases, spec, dtype)?);
                    }
                    for rows in [1, 3, 8, 13] {
                        let x = random(&[rows, k], dtype, 99)?;
                        let ours = cuda_kernels::qmv(&x, &wq, &scales, &biases, spec)?;
                        let mlx =
                            ops::quantized_matmul(&x, &wq, &scales, Some(&biases), true, spec)?;
                        let label = format!(
                            "qmv {rows}x{k} @ {n}x{k} {bits}-bit g{group_size} {}",
                            dtype.name()
                        );
                        // Both round to the output dtype once, after float32 sums in different
                        // orders: allow a few units in its last place.
                        if !close(&label, &ours, &mlx, dtype, 4.0)? {
                            failures.push(label);
                        }
                    }
                }
            }
        }
    }
    Ok(failures)
}

/// Whether `ours` is within `ulps` units in the last place of `dtype` (relative to the output's
/// scale) of `mlx`; prints the difference.
fn close(label: &str, ours: &Array, mlx: &Array, dtype: Dtype, ulps: f32) -> R<bool> {
    let (diff, scale) = max_abs(ours, mlx)?;
    let ulp = match dtype {
        Dtype::Bfloat16 => 2f32.powi(-8),
        Dtype::Float16 => 2f32.powi(-11),
        _ => 2f32.powi(-20),
    };
    println!("{label}: max|ours - MLX| {diff:.3e} (output scale {scale:.2})");
    Ok(diff <= ulps * ulp * scale.max(1.0))
}

/// The GEMV with its folded ops (RMSNorm or silu-gate before, residual after) against MLX's
/// `rms_norm` / compiled gate, `quantized_matmul` and `add` one by one. The folded ops round
/// where MLX's do, but their float math differs in the last bit now and then (e.g. a fast
/// `exp`), which moves single activations by one unit: a looser bound than the plain GEMV's.
fn check_folds(
    wq: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
    dtype: Dtype,
) -> R<Vec<String>> {
    let mut failures = Vec::new();
    let (n, k) = (wq.dim(0)?, wq.dim(1)? * 32 / spec.bits);
    let mlx_matmul = |x: &Array| ops::quantized_matmul(x, wq, scales, Some(biases), true, spec);
    for rows in [1, 3, 8, 13] {
        let x = random(&[rows, k], dtype, 5)?.mul_scalar(3.0)?;
        let gate_up = random(&[rows, 2 * k], dtype, 6)?.mul_scalar(4.0)?;
        let norm_w = random(&[k], dtype, 7)?.add_scalar(1.0)?;
        let res = random(&[rows, n], dtype, 8)?.mul_scalar(10.0)?;
        let eps = 1e-5;
        let normed = x.rms_norm(Some(&norm_w), eps)?;
        let halves = gate_up.split_at(&[k], -1)?;
        let silu = ops::GatedActivation::Silu;
        let gated = ops::gated_activation_as(silu, &halves[0], &halves[1], true)?;
        let rms = cuda_kernels::GemvInput::RmsNorm {
            weight: &norm_w,
            eps,
        };
        let cases = [
            ("rmsnorm", &x, rms, None, mlx_matmul(&normed)?),
            (
                "rmsnorm+residual",
                &x,
                rms,
                Some(&res),
                res.add(&mlx_matmul(&normed)?)?,
            ),
            (
                "silugate",
                &gate_up,
                cuda_kernels::GemvInput::SiluGated,
                None,
                mlx_matmul(&gated)?,
            ),
            (
                "silugate+residual",
                &gate_up,
                cuda_kernels::GemvInput::SiluGated,
                Some(&res),
                res.add(&mlx_matmul(&gated)?)?,
            ),
            (
                "residual",
                &x,
                cuda_kernels::GemvInput::Plain,
                Some(&res),
                res.add(&mlx_matmul(&x)?)?,
            ),
        ];
        // Not row-contiguous: the launcher copies it first (gather.cu).
        let x_t = random(&[k, rows], dtype, 9)?.t()?;
        let ours = cuda_kernels::qmv(&x_t, wq, scales, biases, spec)?;
        let label = format!(
            "qmv transposed x {rows}x{k} @ {n}x{k} {}-bit {}",
            spec.bits,
            dtype.name()
        );
        if !close(&label, &ours, &mlx_matmul(&x_t)?, dtype, 4.0)? {
            failures.push(label);
        }
        for (what, input, fold, residual, mlx) in cases {
            let ours = cuda_kernels::gemv(input, wq, scales, biases, spec, fold, residual)?;
            let label = format!(
                "qmv {what} {rows}x{k} @ {n}x{k} {}-bit g{} {}",
                spec.bits,
                spec.group_size,
                dtype.name()
            );
            if !close(&label, &ours, &mlx, dtype, 8.0)? {
                failures.push(label);
            }
        }
    }
    Ok(failures)
}

fn speed() -> R<()> {
    let spec = QuantSpec {
        mode: QuantMode::Affine,
        group_size: 64,
        bits: 4,
    };
    for (n, k) in [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)] {
        let w = random(&[n, k], Dtype::Bfloat16, 7)?;
        let q = w.quantize(spec)?;
        let (wq, scales) = (q.weight, q.scales);
        let biases = q.biases.expect("affine has biases");
        let x1 = random(&[1, k], Dtype::Bfloat16, 8)?;
        let x512 = random(&[512, k], Dtype::Bfloat16, 9)?;
        ops::eval_all(&[
            wq.clone(),
            scales.clone(),
            biases.clone(),
            x1.clone(),
            x512.clone(),
        ])?;
        let bf16 = Dtype::Bfloat16;
        let ours_dq = time(50, &|| {
            Ok(cuda_kernels::dequantize(&wq, &scales, &biases, spec, bf16)?)
        })?;
        let mlx_dq = time(50, &|| {
            Ok(ops::dequantize(
                &wq,
                &scales,
                Some(&biases),
                spec,
                Some(bf16),
            )?)
        })?;
        let (ours_mv, mlx_mv) = time_qmv_and_mlx(&x1, &wq, &scales, &biases, spec)?;
        // The folded variants: what decode runs for a block's first projection (RMSNorm in)
        // and its down projection (silu-gate in, residual out).
        let norm_w = random(&[k], Dtype::Bfloat16, 10)?;
        let gate_up = random(&[1, 2 * k], Dtype::Bfloat16, 11)?;
        let res = random(&[1, n], Dtype::Bfloat16, 12)?;
        ops::eval_all(&[norm_w.clone(), gate_up.clone(), res.clone()])?;
        let rms = cuda_kernels::GemvInput::RmsNorm {
            weight: &norm_w,
            eps: 1e-5,
        };
        let gated = cuda_kernels::GemvInput::SiluGated;
        let mut line = format!("{n}x{k} 4-bit g64 folded GEMVs (rmsnorm in / silu-gate in + residual out), by warps x rows per block:");
        let mut plain = format!("{n}x{k} 4-bit g64 plain GEMV by warps x rows per block:");
        for shape in [(2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)] {
            let t = time(200, &|| {
                let input = cuda_kernels::GemvInput::Plain;
                Ok(cuda_kernels::gemv_shaped(
                    &x1, &wq, &scales, &biases, spec, input, None, shape,
                )?)
            })?;
            plain += &format!(" {}x{} {:.1} us", shape.0, shape.1, t * 1e6);
        }
        println!("{plain}");
        for shape in [(4, 4), (4, 8), (8, 8), (8, 16), (16, 16)] {
            let norm_in = time(200, &|| {
                Ok(cuda_kernels::gemv_shaped(
                    &x1, &wq, &scales, &biases, spec, rms, None, shape,
                )?)
            })?;
            let gate_in = time(200, &|| {
                Ok(cuda_kernels::gemv_shaped(
                    &gate_up,
                    &wq,
                    &scales,
                    &biases,
                    spec,
                    gated,
                    Some(&res),
                    shape,
                )?)
            })?;
            line += &format!(
                " {}x{} {:.1}/{:.1} us",
                shape.0,
                shape.1,
                norm_in * 1e6,
                gate_in * 1e6
            );
        }
        println!("{line}");
        // Decode batches: the GEMV with several activation rows (MLXCEL_CUDA_QMV_ROWS sets how
        // many share a block's weight reads) against MLX's quantized matmul.
        let mut batch = format!("{n}x{k} 4-bit g64 GEMV by activation rows, ours/MLX:");
        for rows in [1, 2, 4, 8, 16] {
            let x = random(&[rows, k], Dtype::Bfloat16, 13)?;
            ops::eval_all(std::slice::from_ref(&x))?;
            let ours = time(100, &|| {
                Ok(cuda_kernels::qmv(&x, &wq, &scales, &biases, spec)?)
            })?;
            let mlx = time(100, &|| {
                Ok(ops::quantized_matmul(
                    &x,
                    &wq,
                    &scales,
                    Some(&biases),
                    true,
                    spec,
                )?)
            })?;
            batch += &format!(" {rows}: {:.1}/{:.1} us", ours * 1e6, mlx * 1e6);
        }
        println!("{batch}");
        let gemm = time(30, &|| {
            let dense = cuda_kernels::dequantize(&wq, &scales, &biases, spec, bf16)?;
            Ok(x512.matmul(&dense.t()?)?)
        })?;
        let moved = (wq.nbytes() + scales.nbytes() + biases.nbytes() + (n * k * 2) as usize) as f64;
        println!(
            "{n}x{k} 4-bit g64: dequantize {:.0} us ({:.2} TB/s) vs MLX {:.0} us; GEMV {:.1} us \
             vs MLX {:.1} us; 512-row prefill matmul (ours + GEMM) {:.0} us",
            ours_dq * 1e6,
            moved / ours_dq / 1e12,
            mlx_dq * 1e6,
            ours_mv * 1e6,
            mlx_mv * 1e6,
            gemm * 1e6
        );
    }
    Ok(())
}

fn main() -> R<()> {
    // The `MLXCEL_*` runtime variables (launch shapes for `--source`, for instance).
    let policy = RuntimePolicy::from_env()?;
    policy::install(&policy)?;
    if std::env::args().any(|a| a == "--source") {
        print!("{}", cuda_kernels::module_source());
        return Ok(());
    }
    // `--prebuild DIR`: the kernels shipped compiled (crates/mlxcel-core/kernels/prebuilt/),
    // compiled for this GPU into DIR.
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--prebuild") {
        let dir = args.get(i + 1).ok_or("--prebuild DIR")?;
        for file in cuda_kernels::prebuild(std::path::Path::new(dir))? {
            println!("{}", file.display());
        }
        return Ok(());
    }
    // ops::dequantize and ops::quantized_matmul must be MLX's here, the references (the
    // cuda_kernels functions called directly stay mlxcel's).
    policy::install(&RuntimePolicy {
        cuda_dequant: false,
        cuda_qmv: None,
        ..policy
    })?;
    let started = Instant::now();
    if std::env::args().any(|a| a == "--scan") {
        // The selective scan's check alone.
        let failures = check_scan()?;
        println!(
            "CUDA_KERNELS {}",
            if failures.is_empty() {
                "ok".to_string()
            } else {
                format!("fail {}", failures.join("; "))
            }
        );
        return Ok(());
    }
    // One kernel family alone: its check, then its timings.
    type Part = (&'static str, fn() -> R<Vec<String>>, fn() -> R<()>);
    let parts: [Part; 3] = [
        // The tensor-core batch GEMV.
        ("--mma", check_mma, speed_mma),
        // The routed-expert product.
        ("--gather", check_gather, speed_gather),
        // rows.cu's kernels (the rope's timing).
        ("--rows", check_rows, speed_rows),
    ];
    for (flag, check_part, speed_part) in parts {
        if std::env::args().any(|a| a == flag) {
            let result = check_part().and_then(|failures| {
                speed_part()?;
                Ok(failures)
            });
            report(result);
            return Ok(());
        }
    }
    if std::env::args().any(|a| a == "--speed") {
        // Timings only (after a checked run of the same build).
        return speed();
    }
    let result = check().and_then(|failures| {
        println!(
            "checks took {:.1} s (first use compiles or loads the module)",
            started.elapsed().as_secs_f64()
        );
        speed()?;
        if policy::current().cuda_qmv_mma {
            speed_mma()?;
        }
        Ok(failures)
    });
    report(result);
    Ok(())
}

/// The run's last line, which the GPU scripts look for: `CUDA_KERNELS ok`, or what failed.
fn report(result: R<Vec<String>>) {
    match result {
        Ok(f) if f.is_empty() => println!("CUDA_KERNELS ok"),
        Ok(f) => println!("CUDA_KERNELS fail {}", f.join("; ")),
        Err(e) => println!("CUDA_KERNELS fail {e}"),
    }
}
