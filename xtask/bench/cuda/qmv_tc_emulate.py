#!/usr/bin/env python3
"""Lane-level emulation of qmv_tc.cu's `qmt` (crates/mlxcel-core/kernels/cuda), no GPU needed.

    pip install numpy && python3 xtask/bench/cuda/qmv_tc_emulate.py

Replays the kernel's index plumbing lane by lane: the 8-byte weight loads (lane 4g+t: words
2t, 2t+1 of a 64-element span of rows g and g+8), the nibble pairs under T's magic exponent
(OFF + q), the activations prepared into shared memory in B's register order with each span's
sum, mma.sync.m16n8k16 fragments as the PTX ISA lays them out ("Matrix Fragments for
mma.m16n8k16 with floating point type"), the per-span scale/bias fold with the offset removed
through the span sum, the split of K over warps, the cross-warp sum, and the GLU layout (rows
g: gate, g+8: up). Compares with x @ (scale * q + bias)^T in float64 (GLU: silu(gate) * up)
over tails (N not a multiple of 16, spans not a multiple of the warps), gs 64/128, 1 or 2 row
tiles. It checks the indexing, not the hardware semantics it assumes (the PTX ISA's).
"""

import sys

import numpy as np

rng = np.random.default_rng(0)
OFF = 128.0


def pair(word, shift):
    """The two elements T's (OFF + q) pair holds: bits shift.. and 16+shift.. of the word."""
    lo = (int(word) >> shift) & 0xF
    hi = (int(word) >> (16 + shift)) & 0xF
    return (OFF + lo, OFF + hi)


def mma(c, a_regs, b_regs):
    """D = A B + C for one warp: a_regs[lane] = 4 (lo, hi) pairs, b_regs[lane] = 2 pairs,
    c[lane] = 4 floats; returns the new c."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = a_regs[lane]
        for i, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col], A[row, col + 1] = a[i]
        b = b_regs[lane]
        B[2 * t, g], B[2 * t + 1, g] = b[0]
        B[2 * t + 8, g], B[2 * t + 9, g] = b[1]
    D = A @ B
    out = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        cc = c[lane]
        out.append([cc[0] + D[g, 2 * t], cc[1] + D[g, 2 * t + 1], cc[2] + D[g + 8, 2 * t], cc[3] + D[g + 8, 2 * t + 1]])
    return out


def run(N, K, gs, NW, RT, glu):
    words = K // 8
    groups = K // gs
    mats = 2 if glu else 1
    q = rng.integers(0, 16, size=(mats, N, K))
    w = np.zeros((mats, N, words), dtype=np.uint64)
    for j in range(8):
        w |= q[:, :, j::8].astype(np.uint64) << np.uint64(4 * j)
    w = w.astype(np.uint32)
    sc = rng.standard_normal((mats, N, groups))
    bi = rng.standard_normal((mats, N, groups))
    x = rng.standard_normal(K)
    deq = np.repeat(sc, gs, axis=2) * q + np.repeat(bi, gs, axis=2)
    prod = deq @ x
    if glu:
        gate, up = prod[0], prod[1]
        ref = gate / (1 + np.exp(-gate)) * up
    else:
        ref = prod[0]

    n_spans = K // 64
    gshift = 1 if gs == 128 else 0
    # The block's shared x: unit u = 4s + t -> 8 words of (lo, hi) pairs; span sums.
    xb = {}
    xs = np.zeros(n_spans)
    for u in range(n_spans * 4):
        lo = x[16 * u:16 * u + 8]
        hi = x[16 * u + 8:16 * u + 16]
        xb[u] = [(lo[0], lo[4]), (lo[1], lo[5]), (lo[2], lo[6]), (lo[3], lo[7]),
                 (hi[0], hi[4]), (hi[1], hi[5]), (hi[2], hi[6]), (hi[3], hi[7])]
        xs[u >> 2] += lo.sum() + hi.sum()

    OUTS = 8 * RT if glu else 16 * RT
    out = np.full(N, np.nan)
    for bx in range((N + OUTS - 1) // OUTS):
        row0 = bx * OUTS
        red = np.zeros((NW, 16 * RT))
        for warp in range(NW):
            acc_a = np.zeros((32, RT))
            acc_b = np.zeros((32, RT))
            for s in range(warp, n_spans, NW):
                grp = s >> gshift
                for r in range(RT):
                    a_words, b_words, sabs = [], [], []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        ia = row0 + 8 * r + g if glu else row0 + 16 * r + g
                        ib = ia if glu else ia + 8
                        ia, ib = min(ia, N - 1), min(ib, N - 1)
                        mb = 1 if glu else 0
                        a_words.append(w[0, ia, s * 8 + 2 * t:s * 8 + 2 * t + 2])
                        b_words.append(w[mb, ib, s * 8 + 2 * t:s * 8 + 2 * t + 2])
                        sabs.append((sc[0, ia, grp], bi[0, ia, grp], sc[mb, ib, grp], bi[mb, ib, grp]))
                    c = [[0.0] * 4 for _ in range(32)]
                    for j, (wi, sh) in enumerate([(0, 0), (0, 8), (1, 0), (1, 8)]):
                        a_regs = [[pair(a_words[l][wi], sh), pair(b_words[l][wi], sh),
                                   pair(a_words[l][wi], sh + 4), pair(b_words[l][wi], sh + 4)] for l in range(32)]
                        b_regs = [[xb[s * 4 + (l & 3)][2 * j], xb[s * 4 + (l & 3)][2 * j + 1]] for l in range(32)]
                        c = mma(c, a_regs, b_regs)
                    for lane in range(32):
                        s_a, z_a, s_b, z_b = sabs[lane]
                        acc_a[lane, r] += s_a * c[lane][0] + (z_a - OFF * s_a) * xs[s]
                        acc_b[lane, r] += s_b * c[lane][2] + (z_b - OFF * s_b) * xs[s]
                        # Every B column is the same x: the lane's other column agrees.
                        assert abs(c[lane][0] - c[lane][1]) < 1e-9 and abs(c[lane][2] - c[lane][3]) < 1e-9
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                if t == 0:
                    for r in range(RT):
                        red[warp, 16 * r + g] = acc_a[lane, r]
                        red[warp, 16 * r + g + 8] = acc_b[lane, r]
        total = red.sum(axis=0)
        if glu:
            for tid in range(8 * RT):
                o = row0 + tid
                if o < N:
                    at = 16 * (tid >> 3) + (tid & 7)
                    gt, u = total[at], total[at + 8]
                    out[o] = gt / (1 + np.exp(-gt)) * u
        else:
            for tid in range(16 * RT):
                if row0 + tid < N:
                    out[row0 + tid] = total[tid]
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    return err


def main():
    cases = [
        (40, 256, 64, 2, 1, False),
        (40, 256, 128, 3, 2, False),
        (16, 64, 64, 4, 1, False),
        (50, 448, 64, 8, 2, False),
        (24, 320, 64, 2, 1, True),
        (30, 384, 128, 4, 2, True),
    ]
    worst = 0.0
    for case in cases:
        err = run(*case)
        worst = max(worst, err)
        print(f"N={case[0]} K={case[1]} gs={case[2]} NW={case[3]} RT={case[4]} glu={case[5]}: {err:.2e}")
    ok = worst < 1e-12
    print("ok" if ok else "FAILED", f"(worst {worst:.2e})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
