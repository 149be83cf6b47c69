//! `MLXCEL_CPU_ACTIVATIONS=q8`: one-row 4- and 8-bit products on int8 activations (AVX-512 VNNI,
//! cpp/cpu_gemv_avx512.inc). The kernel is checked against the arithmetic it claims, written out
//! here in f64 from MLX's own quantized planes (x rounded to int8 per block of 32, half to even,
//! scale max|x| / 127), on every layout it reads: 4-bit (full 128-element chunks and a 64-element
//! tail) and 8-bit (64-element chunks and a 32-element tail), groups of 32, 64 and 128, scales in
//! float32, bfloat16 and float16. SmolLM2 decodes through it on the CPU decode engine within a
//! measured band of llama.cpp on the same GGUF (which quantizes its activations the same way).
//! Its own test binary, because the installed policy is process-wide.

use mlxcel_arch::generate::{argmax_token, Session};
use mlxcel_core::{ops::QuantSpec, Array, Dtype, RuntimePolicy};
use mlxcel_loading::{load_model, LoadOptions, Loaded};
use mlxcel_tests::{fetched_smollm2, floats};

/// The policy is process-wide and the tests switch it between float and int8: one at a time.
static ONE_POLICY: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn policy(int8: bool) -> RuntimePolicy {
    RuntimePolicy {
        cpu_decode: true,
        cpu_int8_activations: int8,
        ..RuntimePolicy::default()
    }
}

fn load(dir: &std::path::Path, int8: bool, tokenizer: bool) -> Loaded {
    load_model(
        dir,
        &LoadOptions {
            skip_tokenizer: !tokenizer,
            policy: Some(policy(int8)),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Deterministic values in [-1, 1) with occasional large ones (activations have outliers, which
/// is what makes per-block scaling matter).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let v = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            if i % 37 == 5 {
                v * 8.0
            } else {
                v
            }
        })
        .collect()
}

/// A quantized weight read back from MLX's planes: codes, and scales and biases as f32.
struct Planes {
    codes: Vec<u32>,
    scales: Vec<f32>,
    biases: Vec<f32>,
    k: usize,
    bits: usize,
    group_size: usize,
}

impl Planes {
    /// Code of element `e` of row `row`.
    fn code(&self, row: usize, e: usize) -> u32 {
        let w = self.codes[row * self.k * self.bits / 32 + e * self.bits / 32];
        (w >> ((e * self.bits) % 32)) & ((1 << self.bits) - 1)
    }

    /// Index of the scale and bias of element `e` of row `row`.
    fn group(&self, row: usize, e: usize) -> usize {
        row * (self.k / self.group_size) + e / self.group_size
    }

    /// sum_b (s_g d_b) sum_{k in b} q_k xq_k + sum_g b_g sum_{b in g} d_b sum_{k in b} xq_k,
    /// in f64: the int8 path's arithmetic.
    fn int8_product(&self, x: &[f32], row: usize) -> f64 {
        let mut y = 0f64;
        for b in 0..self.k / 32 {
            // The kernel's rounding: x * (127 / amax) in f32, ties to even.
            let block = &x[b * 32..b * 32 + 32];
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let inv = if amax > 0.0 { 127.0f32 / amax } else { 0.0 };
            let d = f64::from(amax / 127.0f32);
            let (mut dot, mut sum) = (0i64, 0i64);
            for (i, v) in block.iter().enumerate() {
                let q = i64::from((v * inv).round_ties_even() as i32);
                dot += i64::from(self.code(row, b * 32 + i)) * q;
                sum += q;
            }
            let g = self.group(row, b * 32);
            y += d
                * (f64::from(self.scales[g]) * dot as f64 + f64::from(self.biases[g]) * sum as f64);
        }
        y
    }

    /// The exact float product of the dequantized row.
    fn float_product(&self, x: &[f32], row: usize) -> f64 {
        (0..self.k)
            .map(|e| {
                let g = self.group(row, e);
                let w = f64::from(self.scales[g]) * f64::from(self.code(row, e))
                    + f64::from(self.biases[g]);
                w * f64::from(x[e])
            })
            .sum()
    }
}

/// `x @ W^T` through the installed policy's one-row product, for `n` rows of a random `K`-wide
/// weight (seeded by `seed`) quantized at `bits`/`gs` with scales and biases in `sdtype`; with
/// the weight's planes read back for the reference arithmetic.
fn one_row_product(
    x: &[f32],
    n: usize,
    bits: i32,
    gs: i32,
    sdtype: Dtype,
    seed: u64,
) -> (Vec<f32>, Planes) {
    let k = x.len();
    let spec = QuantSpec::affine(gs, bits);
    let w = values(n * k, seed);
    let w = Array::from_slice(&w, &[n as i32, k as i32]).unwrap();
    let q = w.quantize(spec).unwrap();
    let scales = q.scales.astype(sdtype).unwrap();
    let biases = q.biases.clone().unwrap().astype(sdtype).unwrap();
    let xa = Array::from_slice(x, &[1, k as i32]).unwrap();
    let got =
        mlxcel_core::ops::quantized_matmul(&xa, &q.weight, &scales, Some(&biases), true, spec)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
    let f32s = |a: &Array| a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    let planes = Planes {
        codes: q.weight.to_vec::<u32>().unwrap(),
        scales: f32s(&scales),
        biases: f32s(&biases),
        k,
        bits: bits as usize,
        group_size: gs as usize,
    };
    (got, planes)
}

#[test]
fn int8_products_compute_the_int8_arithmetic() {
    let _one = ONE_POLICY.lock().unwrap_or_else(|e| e.into_inner());
    mlxcel_core::policy::install(&policy(true)).unwrap();
    if !has_vnni() {
        eprintln!("skip: this CPU has no AVX-512 VNNI; q8 products keep float32 activations");
        return;
    }
    let n = 24;
    // (bits, group size, K, scale dtype): full chunks and tails of both layouts.
    let cases = [
        (4, 32, 576, Dtype::Bfloat16),
        (4, 64, 1536, Dtype::Float16),
        (4, 128, 640, Dtype::Float32),
        (4, 32, 64, Dtype::Float16),
        (8, 32, 576, Dtype::Float16),
        (8, 64, 1536, Dtype::Bfloat16),
        (8, 32, 96, Dtype::Float32),
    ];
    for (case, &(bits, gs, k, sdtype)) in cases.iter().enumerate() {
        let x = values(k, 1 + case as u64);
        let (got, planes) = one_row_product(&x, n, bits, gs, sdtype, 100 + case as u64);
        let want: Vec<f64> = (0..n).map(|r| planes.int8_product(&x, r)).collect();
        let exact: Vec<f64> = (0..n).map(|r| planes.float_product(&x, r)).collect();
        let magnitude = exact.iter().fold(0f64, |m, v| m.max(v.abs()));
        let what = format!("{bits}-bit g{gs} K={k} {sdtype:?} scales");
        let (mut off_int8, mut off_float) = (0f64, 0f64);
        for i in 0..n {
            off_int8 = off_int8.max((f64::from(got[i]) - want[i]).abs());
            off_float = off_float.max((f64::from(got[i]) - exact[i]).abs());
        }
        eprintln!(
            "{what}: max |kernel - int8 arithmetic| {off_int8:.2e}, |kernel - float| {off_float:.2e}, outputs up to {magnitude:.2}"
        );
        // Float32 accumulation of exact integer block sums: a few ulps of the output.
        assert!(
            off_int8 <= 2e-5 * magnitude,
            "{what}: kernel is not the int8 arithmetic"
        );
        // The rounding of x shows: the test tells the two paths apart.
        assert!(
            off_float > 10.0 * off_int8,
            "{what}: the int8 path did not run"
        );
    }
}

/// The default float32-activation one-row product (`f32_rows` on AVX-512 CPUs, the row kernel
/// elsewhere) against the dequantized product in f64, on every layout the 4-bit permute kernel
/// reads: whole 128-element chunks, part chunks of 32, 64 and 96 elements, and groups of 32, 64
/// and 128 spanning four, two or one of a chunk's lane sets.
#[test]
fn float_products_are_exact_on_every_layout() {
    let _one = ONE_POLICY.lock().unwrap_or_else(|e| e.into_inner());
    mlxcel_core::policy::install(&policy(false)).unwrap();
    // Odd: the kernel takes rows in pairs, and a last row alone.
    let n = 25;
    let cases = [
        (4, 32, 576, Dtype::Bfloat16),
        (4, 64, 1536, Dtype::Float16),
        (4, 128, 640, Dtype::Float32),
        (4, 32, 96, Dtype::Float16),
        (4, 32, 32, Dtype::Bfloat16),
        (4, 64, 2112, Dtype::Bfloat16),
        (8, 32, 576, Dtype::Float16),
        (8, 64, 1536, Dtype::Bfloat16),
        (8, 32, 96, Dtype::Float32),
    ];
    for (case, &(bits, gs, k, sdtype)) in cases.iter().enumerate() {
        let x = values(k, 7 + case as u64);
        let (got, planes) = one_row_product(&x, n, bits, gs, sdtype, 300 + case as u64);
        let exact: Vec<f64> = (0..n).map(|r| planes.float_product(&x, r)).collect();
        let magnitude = exact.iter().fold(0f64, |m, v| m.max(v.abs()));
        let off = (0..n).fold(0f64, |m, i| m.max((f64::from(got[i]) - exact[i]).abs()));
        let what = format!("{bits}-bit g{gs} K={k} {sdtype:?} scales");
        eprintln!("{what}: max |kernel - float| {off:.2e}, outputs up to {magnitude:.2}");
        // Float32 sums of exact products (the int8 path is ~1e-3 of the outputs away).
        assert!(
            off <= 4e-6 * magnitude,
            "{what}: the float product is off by {off:.2e}"
        );
    }
}

/// SmolLM2's prompt fed one token at a time (every product a one-row decode product), each
/// position's top-5 logits against llama.cpp's on the same GGUF (`llama_cpp_top5.json`, whose
/// dot products quantize activations the same way); returns the largest error relative to
/// max(|logit|, 1) and the positions whose top-1 differs.
fn smollm2_against_llama_cpp(loaded: &Loaded, int8: bool) -> (f64, usize) {
    let dir = mlxcel_tests::fixtures_dir().join("real/smollm2");
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join(f)).unwrap()).unwrap()
    };
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let golden = read("llama_cpp_top5.json");
    let prompt = ids(&read("greedy.json")["chats"][0]["prompt_ids"]);
    mlxcel_core::policy::install(&policy(int8)).unwrap();
    let mut session = Session::new(&loaded.model);
    let (_, mut logits) = session.prefill(&prompt[..1], None).unwrap();
    let (mut worst, mut flips) = (0f64, 0);
    for pos in 0..prompt.len() {
        if pos > 0 {
            logits = session.step(prompt[pos]).unwrap();
        }
        let row = floats(&logits);
        let want_ids = ids(&golden["top5_ids"][pos]);
        for (k, id) in want_ids.iter().enumerate() {
            let want = golden["top5_logits"][pos][k].as_f64().unwrap();
            worst = worst.max((f64::from(row[*id as usize]) - want).abs() / want.abs().max(1.0));
        }
        flips += usize::from(argmax_token(&logits).unwrap() != want_ids[0]);
    }
    (worst, flips)
}

#[test]
fn smollm2_int8_decode_tracks_llama_cpp() {
    let _one = ONE_POLICY.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dir) = fetched_smollm2() else {
        eprintln!("skip: SmolLM2 not fetched");
        return;
    };
    if !has_vnni() {
        eprintln!("skip: this CPU has no AVX-512 VNNI");
        return;
    }
    let loaded = load(&dir, true, false);
    let (float, float_flips) = smollm2_against_llama_cpp(&loaded, false);
    let (int8, int8_flips) = smollm2_against_llama_cpp(&loaded, true);
    eprintln!(
        "SmolLM2 decode vs llama.cpp top-5 logits: float {float:.2e} ({float_flips} top-1 flips), int8 activations {int8:.2e} ({int8_flips})"
    );
    // llama.cpp rounds activations the same way but its hidden states differ (f16 keys and
    // values, its own accumulation order), so the roundings do not coincide and the two errors
    // add: measured 7.0e-2 float, 1.1e-1 int8, one top-1 flip each (the near tie
    // tests/smollm2.rs describes). A layout or scaling mistake moves logits by whole units.
    assert!(int8 <= 0.15, "int8 activations vs llama.cpp: {int8:.2e}");
    assert!(
        int8_flips <= 1,
        "int8 activations: {int8_flips} top-1 flips against llama.cpp"
    );
}
