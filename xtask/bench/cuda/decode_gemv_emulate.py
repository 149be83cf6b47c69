"""Replays the decode step's streaming GEMV (decode_gemv.cu's dec_qmvs) thread by thread with the
kernel's index arithmetic, on MLX-packed affine weights, and compares it with an independent
reference (the weights dequantized, one matrix-vector product in float64). No GPU needed
(numpy).

    python3 xtask/bench/cuda/decode_gemv_emulate.py

What it replays: the tiles of up to three segments (or GLU's gate and up rows), each block
walking tiles blockIdx.x, + gridDim.x, ...; each thread's chunks c = tid + s * NT of a row with
their group (c >> gshift); x prepared once (PRE 1: the RMSNorm and its weight) with each
chunk's sums and the FAST offset (128 + q, the high element's 0.26171875 and q_lo / 65536);
the butterfly that leaves row sum_i bit_i(lane) * (RPW >> (i + 1)) in each lane; the warps'
sums in shared memory by tile parity; the RES and GLU stores. The grid is the host's
(`GemvLaunch::grid`: the fewest blocks giving no block more tiles than the resident ones would).
Fails above 1e-2 of the largest output (outputs are rounded to bf16), and a mutation of the
butterfly's row map or of the chunk's group must fail it.
"""
import sys

import numpy as np


def bf16(x):
    """Round-to-nearest-even to bfloat16, back as float32 (qmv_round, qmv_store)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


def quantize(w, bits, gs):
    """MLX affine packing: codes q in [0, 2^bits), w ~ scale * q + bias per group of gs."""
    n, k = w.shape
    g = w.reshape(n, k // gs, gs)
    lo, hi = g.min(-1), g.max(-1)
    scale = bf16(np.maximum(hi - lo, 1e-6) / (2**bits - 1))
    bias = bf16(lo)
    q = np.clip(np.round((g - bias[..., None]) / scale[..., None]), 0, 2**bits - 1).astype(np.uint32)
    q = q.reshape(n, k)
    per = 32 // bits
    words = np.zeros((n, k // per), dtype=np.uint32)
    for j in range(per):
        words |= q[:, j::per] << np.uint32(bits * j)
    return words, scale, bias


def dequantize(words, scale, bias, bits, gs):
    n = words.shape[0]
    per = 32 // bits
    q = np.zeros((n, words.shape[1] * per), dtype=np.float64)
    for j in range(per):
        q[:, j::per] = (words >> np.uint32(bits * j)) & np.uint32(2**bits - 1)
    k = q.shape[1]
    return (q.reshape(n, k // gs, gs) * scale[..., None] + bias[..., None]).reshape(n, k)


def dot_word(w, xf, bits):
    """qmv_dot_word<BITS, FAST = BITS == 4>: the word's (offset + q) . x, FAST's perturbation
    on the high element included."""
    if bits == 4:
        a0 = a1 = 0.0
        for p in range(4):
            lo = (w >> (4 * p)) & 0xF
            hi = (w >> (4 * p + 16)) & 0xF
            a0 += (128.0 + lo) * xf[p]
            a1 += (128.0 + 0.26171875 + hi + lo / 65536.0) * xf[p + 4]
        return a0 + a1
    return sum((256.0 + ((w >> (8 * j)) & 0xFF)) * xf[j] for j in range(4))


def streaming_gemv(segs, x, aux, res, bits, gs, nw, rpw, pre, glu, resident, mutate=None):
    """dec_qmvs over `segs` ([(words, scales, biases)]; GLU: [gate, up]); returns each segment's
    output (GLU: one)."""
    epw = 32 // bits
    epc = 4 * epw
    nt = nw * 32
    k_len = x.shape[0]
    words_per_row = k_len // epw
    cpr = words_per_row // 4
    gshift = int(np.log2(gs // epc))
    steps = (cpr + nt - 1) // nt
    outs = rpw // 2 if glu else rpw
    log = int(np.log2(rpw))
    ns = [s[0].shape[0] for s in segs]
    if glu:
        b = [(ns[0] + outs - 1) // outs]
    else:
        b = [(n + rpw - 1) // rpw for n in ns]
    tiles = sum(b)
    per_block = -(-tiles // resident)
    grid = tiles if tiles <= resident else -(-tiles // per_block)

    def tile_of(t):
        if glu:
            return 0, t * outs
        for i, bi in enumerate(b):
            if t < bi:
                return i, t * rpw
            t -= bi
        raise AssertionError

    # x prepared once per block (as T), each chunk's sums.
    if pre == 1:
        inv = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5)
        xp = bf16(aux * bf16(x * np.float32(inv)))
    else:
        xp = x.copy()
    sums = []
    for c in range(cpr):
        ch = xp[c * epc:(c + 1) * epc].astype(np.float64)
        hi = sum(ch[w * 8 + 4:w * 8 + 8].sum() for w in range(4)) if bits == 4 else 0.0
        sums.append((ch.sum(), hi))

    out = [np.zeros(n, dtype=np.float32) for n in ns]
    for blk in np.random.default_rng(5).permutation(grid):
        parity = 0
        red = np.zeros((2, nw, rpw))
        for t in range(blk, tiles, grid):
            seg, row0 = tile_of(t)
            acc = np.zeros((nt, rpw))
            for s in range(steps):
                for tid in range(nt):
                    c = tid + s * nt
                    if c >= cpr:
                        continue
                    g = c >> gshift
                    if mutate == "group":
                        g = c >> (gshift + 1)
                    xsum, xhi = sums[c]
                    xoff = 128.0 * xsum + 0.26171875 * xhi if bits == 4 else 256.0 * xsum
                    for r in range(rpw):
                        up = glu and r >= outs
                        words, sc, bs = segs[1 if up else seg]
                        i = row0 + r % outs
                        n = min(i, ns[seg] - 1)
                        d = 0.0
                        for k in range(4):
                            d += dot_word(int(words[n, c * 4 + k]), xp[c * epc + k * epw:], bits)
                        acc[tid, r] += sc[n, g] * (d - xoff) + bs[n, g] * xsum
            # The butterfly within each warp, then the warps' sums by parity.
            for w in range(nw):
                lanes = acc[w * 32:(w + 1) * 32].copy()
                for i in range(log):
                    half = rpw >> (i + 1)
                    new = lanes.copy()
                    for lane in range(32):
                        upper = (lane >> i) & 1
                        partner = lanes[lane ^ (1 << i)]
                        for j in range(half):
                            keep = lanes[lane, j + half] if upper else lanes[lane, j]
                            # What the partner (the other half) sends: the rows it drops.
                            got = partner[j + half] if upper else partner[j]
                            new[lane, j] = keep + got
                    lanes = new
                o = rpw
                while o < 32:
                    lanes[:, 0] = lanes[:, 0] + lanes[np.arange(32) ^ o, 0]
                    o <<= 1
                for lane in range(rpw):
                    row = sum(((lane >> i) & 1) * (rpw >> (i + 1)) for i in range(log))
                    if mutate == "row":
                        row = lane
                    red[parity, w, row] = lanes[lane, 0]
            v = red[parity].sum(0)
            if glu:
                vr = bf16(v.astype(np.float32))
                for r in range(outs):
                    if row0 + r < ns[0]:
                        g_, u_ = vr[r], vr[r + outs]
                        sig = bf16(1.0 / (1.0 + np.exp(-g_)))
                        out[0][row0 + r] = bf16(bf16(g_ * sig) * u_)
            else:
                for r in range(rpw):
                    n = row0 + r
                    if n < ns[seg]:
                        val = v[r]
                        if res is not None:
                            val = bf16(np.float32(val)) + res[n]
                        out[seg][n] = bf16(np.float32(val))
            parity ^= 1
    return out


def check(label, bits, gs, k, rows, nw, rpw, pre, glu, res, resident, rng, mutate=None):
    x = bf16(rng.standard_normal(k).astype(np.float32))
    aux = bf16((1 + 0.1 * rng.standard_normal(k)).astype(np.float32))
    segs, dense = [], []
    for n in rows:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        q = quantize(w, bits, gs)
        segs.append(q)
        dense.append(dequantize(*q, bits, gs))
    resid = bf16(rng.standard_normal(rows[0]).astype(np.float32)) if res else None
    got = streaming_gemv(segs, x, aux, resid, bits, gs, nw, rpw, pre, glu, resident, mutate)
    if pre == 1:
        inv = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5)
        xin = bf16(aux * bf16(x * np.float32(inv))).astype(np.float64)
    else:
        xin = x.astype(np.float64)
    if glu:
        g, u = dense[0] @ xin, dense[1] @ xin
        want = [g / (1 + np.exp(-g)) * u]
    else:
        want = [d @ xin for d in dense]
        if res:
            want[0] = want[0] + resid
    err = max(np.abs(a - b).max() for a, b in zip(got, want))
    scale = max(np.abs(b).max() for b in want)
    print(f"{label}: max |diff| {err / scale:.2e} of the largest output")
    return err / scale


def main():
    rng = np.random.default_rng(3)
    shapes = [
        # label, bits, gs, K, rows, NW, RPW, PRE, GLU, RES, resident blocks
        ("q|k|v 4-bit g64, 3 segments, tiles > blocks", 4, 64, 256, [40, 16, 16], 1, 8, 1, 0, 0, 3),
        ("o/down 4-bit g32, 3 steps, ragged last", 4, 32, 2560, [12], 1, 4, 0, 0, 1, 2),
        ("gate|up 4-bit g128 GLU, many tiles a block", 4, 128, 512, [36, 36], 2, 8, 1, 1, 0, 2),
        ("8-bit g64, PRE 1, 2 steps", 8, 64, 1536, [20], 1, 2, 1, 0, 0, 3),
        ("8-bit g32 GLU, RPW 2", 8, 32, 256, [9, 9], 1, 2, 1, 1, 0, 4),
    ]
    worst = 0.0
    for s in shapes:
        worst = max(worst, check(*s, rng))
    print(f"worst: {worst:.2e}")
    ok = worst < 1e-2
    # The checks must be able to fail: a wrong row map or group.
    for mutate in ("row", "group"):
        e = check(f"mutation {mutate}", *shapes[1][1:] if mutate == "group" else shapes[0][1:],
                  rng=rng, mutate=mutate)
        if e < 1e-2:
            print(f"mutation {mutate} was not caught")
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
