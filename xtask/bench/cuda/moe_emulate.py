"""Replays the decode step's routed-expert kernels (decode_moe.cu: dec_route, dec_moe_glu,
dec_moe_down) lane group by lane group on flat buffers with the kernels' index arithmetic (the
packed words, scales and biases each lane reads, the chunk and group each belongs to, the
(slot, row) item each lane group owns, the block's rows and slots in the down kernel), and
compares them with an independent reference: the stacks dequantized as MLX's `dequantize`
defines them, softmax routing with argsort, SwiGLU experts and their weighted sum, in float64.
No GPU needed (numpy).

    python3 xtask/bench/cuda/moe_emulate.py

Prints the largest difference per case, relative to the largest output, and fails above 2e-2
(the kernels round to bf16 where the graph does: 2^-8 relative per rounding).
"""
import sys

import numpy as np

LPR, THREADS = 8, 128
GROUPS = THREADS // LPR


def bf16(x):
    """Round-to-nearest-even to bfloat16, back as float32 (the kernels' qmv_store/qmv_round)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


def quantize(w, bits, gs):
    """MLX affine packing of w [..., K]: (words uint32 [..., K*bits/32], scales, biases)."""
    *lead, k = w.shape
    g = w.reshape(*lead, k // gs, gs)
    lo, hi = g.min(-1), g.max(-1)
    levels = (1 << bits) - 1
    scales = bf16(np.maximum(hi - lo, 1e-6) / levels)
    biases = bf16(lo)
    q = np.clip(np.round((g - biases[..., None]) / scales[..., None]), 0, levels).astype(np.uint64)
    q = q.reshape(*lead, k)
    per = 32 // bits
    q = q.reshape(*lead, k // per, per)
    words = np.zeros(q.shape[:-1], dtype=np.uint64)
    for j in range(per):
        words |= q[..., j] << np.uint64(bits * j)
    return words.astype(np.uint32), scales, biases


def dequantize(words, scales, biases, bits, gs):
    per = 32 // bits
    mask = (1 << bits) - 1
    q = np.stack([(words.astype(np.uint64) >> np.uint64(bits * j)) & np.uint64(mask)
                  for j in range(per)], -1).reshape(*words.shape[:-1], -1).astype(np.float64)
    s = np.repeat(scales.astype(np.float64), gs, -1)
    b = np.repeat(biases.astype(np.float64), gs, -1)
    return q * s + b


def group_dot(stack, bits, words_per_row, groups, row, x):
    """dec_moe_dot for one weight row (flat index `row` of the stack) by one lane group."""
    w, s, b = stack
    chunks = words_per_row // 4
    if bits == 16:
        flat = w.reshape(-1)
        wrow = flat[row * words_per_row * 2:(row + 1) * words_per_row * 2]
    else:
        fw, fs, fb = w.reshape(-1), s.reshape(-1), b.reshape(-1)
        gshift = (chunks // groups).bit_length() - 1
    lanes = []
    for sub in range(LPR):
        acc = 0.0
        for c in range(sub, chunks, LPR):
            if bits == 16:
                acc += float(np.dot(wrow[c * 8:c * 8 + 8].astype(np.float64),
                                    x[c * 8:c * 8 + 8]))
                continue
            per = 32 // bits
            g = c >> gshift
            d, xsum = 0.0, 0.0
            for k in range(4):
                word = int(fw[row * words_per_row + c * 4 + k])
                xs = x[c * 4 * per + k * per:c * 4 * per + (k + 1) * per]
                q = [(word >> (bits * j)) & ((1 << bits) - 1) for j in range(per)]
                d += float(np.dot(q, xs))
                xsum += float(xs.sum())
            acc += float(fs[row * groups + g]) * d + float(fb[row * groups + g]) * xsum
        lanes.append(acc)
    return sum(lanes)  # the group's shuffle reduction


def silu_gate(g, u):
    sig = bf16(1.0 / (1.0 + np.exp(-np.float32(g))))
    return bf16(bf16(np.float32(g) * sig) * np.float32(u))


def kernels(h, norm, router, stacks, fmt, experts, top_k, normalize, scale, eps):
    """dec_qmv (router) + dec_route + dec_moe_glu + dec_moe_down on flat buffers."""
    bits, gs = fmt
    hidden = h.size
    inv = 1.0 / np.sqrt(np.mean(h.astype(np.float64) ** 2) + eps)
    xn = bf16(norm * bf16(h * inv))
    logits = bf16(router @ xn)
    m = logits.max()
    total = np.exp(logits - m).sum()
    score = logits.astype(np.float32).copy()
    ids, kept = [], []
    for _ in range(top_k):
        at = int(np.argmax(score))  # the first of equal maxima
        ids.append(at)
        kept.append(np.exp(score[at] - m) / total)
        score[at] = -np.inf
    kept = np.array(kept)
    weights = bf16((kept / kept.sum() if normalize else kept) * scale)
    gate, up, down = stacks
    inter = gate[0].shape[1]
    wpr = (hidden // 2) if bits == 16 else hidden * bits // 32
    groups = 0 if bits == 16 else hidden // gs
    act = np.zeros(top_k * inter, dtype=np.float32)
    blocks = -(-top_k * inter // GROUPS)
    for blk in range(blocks):
        for grp in range(GROUPS):
            item = blk * GROUPS + grp
            if item >= top_k * inter:
                continue
            slot = item // inter
            r = item - slot * inter
            row = ids[slot] * inter + r
            g = group_dot(gate, bits, wpr, groups, row, xn)
            u = group_dot(up, bits, wpr, groups, row, xn)
            act[item] = silu_gate(bf16(g), bf16(u))
    wpr_d = (inter // 2) if bits == 16 else inter * bits // 32
    groups_d = 0 if bits == 16 else inter // gs
    outs = max(1, GROUPS // top_k)
    out = np.zeros(hidden, dtype=np.float32)
    for blk in range(-(-hidden // outs)):
        row0 = blk * outs
        part = {}
        for grp in range(GROUPS):
            for item in range(grp, top_k * outs, GROUPS):
                slot = item // outs
                n = min(row0 + item - slot * outs, hidden - 1)
                row = ids[slot] * hidden + n
                a = act[slot * inter:(slot + 1) * inter]
                part[item] = bf16(group_dot(down, bits, wpr_d, groups_d, row, a))
        for t in range(outs):
            if row0 + t < hidden:
                s = sum(float(bf16(weights[sl] * part[sl * outs + t])) for sl in range(top_k))
                out[row0 + t] = bf16(bf16(s) + h[row0 + t])
    return out


def reference(h, norm, router, dense, top_k, normalize, scale, eps):
    """The MoE feed-forward with its residual, float64 (softmax routing by argsort)."""
    x = h.astype(np.float64)
    xn = norm * x / np.sqrt(np.mean(x ** 2) + eps)
    logits = router.astype(np.float64) @ xn
    p = np.exp(logits - logits.max())
    p /= p.sum()
    ids = np.argsort(-p, kind="stable")[:top_k]
    w = p[ids] / p[ids].sum() if normalize else p[ids]
    gate, up, down = dense
    y = np.zeros_like(x)
    for e, we in zip(ids, w):
        g, u = gate[e] @ xn, up[e] @ xn
        y += we * scale * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return x + y


def case(name, hidden, inter, experts, top_k, fmt, normalize, scale, rng):
    bits, gs = fmt
    h = bf16(rng.standard_normal(hidden))
    norm = bf16(1 + 0.1 * rng.standard_normal(hidden))
    router = bf16(rng.standard_normal((experts, hidden)) * 0.5)
    raw = [rng.standard_normal((experts, inter, hidden)) / np.sqrt(hidden),
           rng.standard_normal((experts, inter, hidden)) / np.sqrt(hidden),
           rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter)]
    if bits == 16:
        dense = [bf16(w) for w in raw]
        # Dense rows travel as uint32 pairs of values; the emulation reads the values.
        stacks = [(w, None, None) for w in dense]
    else:
        stacks = [quantize(w.astype(np.float32), bits, gs) for w in raw]
        dense = [dequantize(*st, bits, gs) for st in stacks]
    got = kernels(h, norm, router, stacks, fmt, experts, top_k, normalize, scale, 1e-6)
    want = reference(h, norm, router, dense, top_k, normalize, scale, 1e-6)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"{name}: max |kernels - reference| = {err:.2e} of the largest output")
    return err


def main():
    rng = np.random.default_rng(3)
    worst = 0.0
    for args in [
        ("4-bit g64, 8 experts top 2, renormalised", 64, 64, 8, 2, (4, 64), True, 1.0),
        ("4-bit g32, 16 experts top 3, kept as is", 128, 96, 16, 3, (4, 32), False, 1.0),
        ("8-bit g64, 32 experts top 8, scaled", 128, 64, 32, 8, (8, 64), True, 2.5),
        ("4-bit g64, 128 experts top 8 (Qwen3-30B-A3B's routing)", 256, 128, 128, 8, (4, 64),
         True, 1.0),
        ("dense, 8 experts top 2", 64, 64, 8, 2, (16, 0), True, 1.0),
    ]:
        worst = max(worst, case(*args, rng=rng))
    if worst > 2e-2:
        print("FAILED")
        sys.exit(1)


if __name__ == "__main__":
    main()
