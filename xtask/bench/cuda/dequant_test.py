#!/usr/bin/env python3
"""Correctness + speed of mlxcel's dequantize CUDA kernel (dequant.cu + qmv_header.cuh), launched
as mlxcel launches it (crates/mlxcel-core/src/cuda_dequant.rs), against mx.dequantize on
Llama-3.1-8B shapes, and the prefill matmul it feeds (512 rows: dequantize + bf16 GEMM).

    timeout 170 python dequant_test.py

Reference: the float32 value scale * q + bias from mx.dequantize on float32 planes, rounded
once to the output dtype. The kernel computes it with one fused multiply-add, so it may land one
unit in the last place of the output dtype away when the float32 product rounds across a
rounding boundary; anything further is a failure. Last line: DEQUANT_RESULT ok | fail <why>.
"""

import hashlib
import os
import statistics
import sys
import time

import mlx.core as mx

HERE = os.path.dirname(os.path.abspath(__file__))
KDIR = HERE if os.path.isfile(os.path.join(HERE, "dequant.cu")) else os.path.join(
    HERE, "..", "..", "..", "crates", "mlxcel-core", "kernels", "cuda")
SRC = open(os.path.join(KDIR, "dequant.cu")).read()
HDR = open(os.path.join(KDIR, "qmv_header.cuh")).read()
TAG = hashlib.sha1((SRC + "\0" + HDR).encode()).hexdigest()[:10]
THREADS = 256
# (N, K): q/o proj, k/v proj, gate/up, down, fused q/k/v, fused gate/up.
SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (28672, 4096)]
ULP = {mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11, mx.float32: 2.0**-23}
kernels = {}


def dequant(w, s, b, bits, dtype):
    key = str(dtype)
    if key not in kernels:
        kernels[key] = mx.fast.cuda_kernel(
            name=f"dequant_test_{key.split('.')[-1]}_{TAG}",
            input_names=["w", "scales", "biases"],
            output_names=["out"],
            source=SRC,
            header=HDR,
            ensure_row_contiguous=True,
        )
    n, words = w.shape
    chunks = n * (words // 4)
    return kernels[key](
        inputs=[w, s, b],
        template=[("BITS", bits)],
        grid=((chunks + THREADS - 1) // THREADS * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(n, words * 32 // bits)],
        output_dtypes=[dtype],
    )[0]


def timeit(fn, iters=50, reps=5):
    mx.eval([fn() for _ in range(5)])
    mx.synchronize()
    per = []
    for _ in range(reps):
        outs = [fn() for _ in range(iters)]
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        per.append((time.perf_counter() - t0) / iters)
        del outs
    return statistics.median(per)


def main():
    failures = []
    print("== correctness ==", flush=True)
    for (n, k) in [(64, 256), (1001, 384)] + SHAPES[:2]:
        for bits in (4, 8):
            for gs in (32, 64, 128):
                for dtype in (mx.bfloat16, mx.float16, mx.float32):
                    wf = mx.random.normal((n, k), key=mx.random.key(n + k + bits + gs))
                    wq, s, b = mx.quantize(wf.astype(dtype), group_size=gs, bits=bits)
                    want32 = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32),
                                           group_size=gs, bits=bits)
                    got = dequant(wq, s, b, bits, dtype)
                    want = want32.astype(dtype)
                    err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32))
                    tol = ULP[dtype] * mx.abs(want32) * 2 + 1e-6 * mx.max(mx.abs(want32))
                    bad = int(mx.sum(err > tol).item())
                    mlx_own = mx.dequantize(wq, s, b, group_size=gs, bits=bits)
                    same = float(mx.mean((got == mlx_own).astype(mx.float32)).item())
                    line = (f"{n}x{k} {bits}-bit g{gs} {str(dtype).split('.')[-1]}: "
                            f"max|err| {mx.max(err).item():.3e}, {bad} beyond 1 ulp, "
                            f"{100 * same:.2f}% bit-equal to mx.dequantize")
                    print(line, flush=True)
                    if bad or got.shape != want.shape:
                        failures.append(line)

    print("== speed (bf16 out, 4-bit g64) ==", flush=True)
    for (n, k) in SHAPES:
        wf = mx.random.normal((n, k), key=mx.random.key(7)).astype(mx.bfloat16)
        wq, s, b = mx.quantize(wf, group_size=64, bits=4)
        x = mx.random.normal((512, k), key=mx.random.key(8)).astype(mx.bfloat16)
        mx.eval(wq, s, b, x)
        t_ours = timeit(lambda: dequant(wq, s, b, 4, mx.bfloat16))
        t_mlx = timeit(lambda: mx.dequantize(wq, s, b, group_size=64, bits=4))
        t_gemm_ours = timeit(lambda: x @ dequant(wq, s, b, 4, mx.bfloat16).T)
        t_gemm_mlx = timeit(lambda: x @ mx.dequantize(wq, s, b, group_size=64, bits=4).T)
        t_qmm = timeit(lambda: mx.quantized_matmul(x, wq, s, b, group_size=64, bits=4))
        moved = wq.nbytes + s.nbytes + b.nbytes + n * k * 2
        print(f"{n}x{k}: dequantize {1e6 * t_ours:.0f} us ({moved / t_ours / 1e12:.2f} TB/s) "
              f"vs MLX {1e6 * t_mlx:.0f} us; 512-row prefill matmul {1e6 * t_gemm_ours:.0f} us "
              f"vs MLX dequantize+GEMM {1e6 * t_gemm_mlx:.0f} us vs quantized_matmul "
              f"{1e6 * t_qmm:.0f} us", flush=True)

    if failures:
        print("DEQUANT_RESULT fail " + "; ".join(failures[:3]), flush=True)
        return 1
    print("DEQUANT_RESULT ok", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # a compile error carries the NVRTC log
        print(f"DEQUANT_RESULT fail {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
