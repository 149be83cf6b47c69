#!/usr/bin/env python3
"""Where 4-bit prefill time goes on MLX's CUDA backend: one Llama-8B-shaped projection with a
512-row activation, timed as (a) MLX's quantized matmul, (b) dequantize to bf16 then a dense
matmul, (c) a dense matmul on weights already in bf16. Prints one line per shape; the ratio
a/(b) is what a dequantize-for-prefill path can gain at most per projection."""
import time

import mlx.core as mx


def timed(fn, reps=10):
    mx.eval(fn())  # compile / warm
    mx.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        outs = [fn() for _ in range(reps)]
        mx.eval(outs)
        mx.synchronize()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def main():
    rows = 512
    print(f"{'N x K':>14} {'qmm us':>9} {'deq+mm us':>10} {'deq us':>8} {'bf16 mm us':>11} {'qmm/(deq+mm)':>13}")
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]:
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        x = mx.random.normal((rows, k)).astype(mx.bfloat16)
        mx.eval(w, wq, s, b, x)
        q = timed(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4))
        d = timed(lambda: mx.dequantize(wq, s, b, group_size=64, bits=4))
        dm = timed(lambda: x @ mx.dequantize(wq, s, b, group_size=64, bits=4).T)
        mm = timed(lambda: x @ w.T)
        print(f"{n:>6} x {k:<6} {q:9.0f} {dm:10.0f} {d:8.0f} {mm:11.0f} {q / dm:12.1f}x", flush=True)


if __name__ == "__main__":
    main()
