use mlxcel_core::ops::{self, QuantSpec};
use mlxcel_core::Dtype;
fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let (n, k, m, bits) = (args[0], args[1], args[2], args[3] as i32);
    let key = ops::random::key(1).unwrap();
    let w = ops::random::uniform(&[n as i32, k as i32], Dtype::Float32, &key)
        .unwrap()
        .astype(Dtype::Bfloat16)
        .unwrap();
    let spec = QuantSpec::affine(32, bits);
    let q = w.quantize(spec).unwrap();
    let x = ops::random::uniform(&[m as i32, k as i32], Dtype::Float32, &key).unwrap();
    ops::eval_all([&q.weight, &q.scales, q.biases.as_ref().unwrap(), &x]).unwrap();
    let iters = 200;
    let t = std::time::Instant::now();
    for _ in 0..iters {
        let y =
            ops::quantized_matmul(&x, &q.weight, &q.scales, q.biases.as_ref(), true, spec).unwrap();
        ops::eval_all([&y]).unwrap();
    }
    let dt = t.elapsed().as_secs_f64() / iters as f64;
    let bytes = (n * k * bits as usize / 8 + n * k / 32 * 4) as f64;
    println!(
        "{n}x{k} m{m} {bits}-bit: {:.1} us, {:.2} GB/s, {:.2} GFLOP/s",
        dt * 1e6,
        bytes / dt / 1e9,
        2.0 * (n * k * m) as f64 / dt / 1e9
    );
}
