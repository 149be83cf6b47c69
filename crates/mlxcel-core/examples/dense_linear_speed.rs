//! GFLOP/s of a dense float32 linear layer on mlxcel's CPU kernel (the packed GEMM from 16
//! rows on), with or without its bias and GELU epilogue: `dense_linear_speed N K M [gelu]`.
use mlxcel_core::ops::{self, KernelActivation};
use mlxcel_core::Dtype;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize| args[i].parse::<usize>().expect("N K M as numbers");
    let (n, k, m) = (num(0), num(1), num(2));
    let act = match args.get(3).map(String::as_str) {
        Some("gelu") => KernelActivation::Gelu,
        _ => KernelActivation::None,
    };
    let key = ops::random::key(1).unwrap();
    let w = ops::random::uniform(&[n as i32, k as i32], Dtype::Float32, &key).unwrap();
    let b = ops::random::uniform(&[n as i32], Dtype::Float32, &key).unwrap();
    let x = ops::random::uniform(&[m as i32, k as i32], Dtype::Float32, &key).unwrap();
    ops::eval_all([&w, &b, &x]).unwrap();
    let iters = (2e11 / (2.0 * (n * k * m) as f64)).clamp(3.0, 2000.0) as usize;
    let t = std::time::Instant::now();
    for _ in 0..iters {
        let y = ops::cpu_linear_fused(&x, &w, Some(&b), act)
            .unwrap()
            .expect("the CPU kernel applies");
        ops::eval_all([&y]).unwrap();
    }
    let dt = t.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{n}x{k} m{m} {act:?}: {:.1} us, {:.1} GFLOP/s",
        dt * 1e6,
        2.0 * (n * k * m) as f64 / dt / 1e9
    );
}
