"""Replays the decode step's rope/cache-write, attention and combine kernels (decode.cu) block by
block on flat buffers, with the kernels' index arithmetic, and compares them with an independent
reference: rope as MLX applies it (halves or adjacent pairs, the first 2*rot_half dims), grouped
attention over the cached keys, softmax in float64. No GPU needed (numpy).

    python3 xtask/bench/cuda/decode_emulate.py

Prints the largest difference per shape, relative to the largest output, and fails above 1e-2
(the outputs are rounded to bf16 as the kernels store them: 2^-8 relative).
"""
import sys

import numpy as np


def bf16(x):
    """Round-to-nearest-even to bfloat16, back as float32 (the kernels' qmv_store)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


def rope_kv(qkv, inv_freq, k_cache, v_cache, heads, kv_heads, head_dim, traditional, position,
            capacity):
    """dec_rope_kv: blocks [0, heads) queries, then key/value heads; flat caches."""
    rot_half = len(inv_freq)
    q_out = np.zeros(heads * head_dim, np.float32)
    for block in range(heads + kv_heads):
        is_q = block < heads
        head = block if is_q else block - heads
        src = (0 if is_q else heads * head_dim) + head * head_dim
        row = qkv[src:src + head_dim].astype(np.float32)
        dst = head * head_dim if is_q else (head * capacity + position) * head_dim
        out = q_out if is_q else k_cache
        for j in range(rot_half):
            i0, i1 = (2 * j, 2 * j + 1) if traditional else (j, j + rot_half)
            theta = np.float32(position) * np.float32(inv_freq[j])
            sn, cs = np.sin(theta), np.cos(theta)
            a, b = row[i0], row[i1]
            out[dst + i0] = bf16(a * cs - b * sn)
            out[dst + i1] = bf16(b * cs + a * sn)
        for d in range(2 * rot_half, head_dim):
            out[dst + d] = bf16(row[d])
        if not is_q:
            vsrc = (heads + kv_heads) * head_dim + head * head_dim
            vdst = (head * capacity + position) * head_dim
            v_cache[vdst:vdst + head_dim] = bf16(qkv[vsrc:vsrc + head_dim])
    return q_out


def attn(q, k_cache, v_cache, heads, kv_heads, head_dim, capacity, length, chunk, n_chunks,
         scale):
    """dec_attn: block (g, c) over keys [c*chunk, ...), partials [heads][n_chunks][D + 2]."""
    group = heads // kv_heads
    partial = np.zeros(heads * n_chunks * (head_dim + 2), np.float32)
    for g in range(kv_heads):
        for c in range(n_chunks):
            k0 = c * chunk
            nk = min(length - k0, chunk)
            qs = q[g * group * head_dim:(g + 1) * group * head_dim].astype(np.float32)
            p = np.zeros((group, nk), np.float32)
            for tid in range(nk):
                krow = (g * capacity + k0 + tid) * head_dim
                k = k_cache[krow:krow + head_dim]
                for h in range(group):
                    p[h, tid] = np.float32(np.dot(qs[h * head_dim:(h + 1) * head_dim], k)) * scale
            for h in range(group):
                m = p[h].max()
                e = np.exp(p[h] - m).astype(np.float32)
                l = e.sum(dtype=np.float32)
                for d in range(head_dim):
                    vcol = (g * capacity + k0) * head_dim + d
                    acc = np.float32(sum(e[j] * v_cache[vcol + j * head_dim] for j in range(nk)))
                    out = ((g * group + h) * n_chunks + c) * (head_dim + 2)
                    partial[out + 2 + d] = acc
                    partial[out] = m
                    partial[out + 1] = l
    return partial


def combine(partial, heads, head_dim, n_chunks):
    """dec_attn_combine: one block per query head."""
    stride = head_dim + 2
    out = np.zeros(heads * head_dim, np.float32)
    for h in range(heads):
        base = h * n_chunks * stride
        ms = np.array([partial[base + c * stride] for c in range(n_chunks)])
        ls = np.array([partial[base + c * stride + 1] for c in range(n_chunks)])
        m = ms.max()
        w = np.exp(ms - m)
        l = (ls * w).sum()
        for d in range(head_dim):
            acc = sum(partial[base + c * stride + 2 + d] * w[c] for c in range(n_chunks))
            out[h * head_dim + d] = bf16(acc / l)
    return out


def reference(qkv, inv_freq, k_hist, v_hist, heads, kv_heads, head_dim, traditional, position,
              scale):
    """Rope and grouped attention as MLX computes them, float64 (k_hist/v_hist: the rows before
    `position`, [kv_heads, position, D])."""
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    q = qkv[:q_dim].reshape(heads, head_dim).astype(np.float64)
    k = qkv[q_dim:q_dim + kv_dim].reshape(kv_heads, head_dim).astype(np.float64)
    v = qkv[q_dim + kv_dim:].reshape(kv_heads, head_dim).astype(np.float64)
    rot = 2 * len(inv_freq)
    theta = position * np.asarray(inv_freq, np.float64)

    def rope(x):
        y = x.copy()
        if traditional:
            a, b = x[:, 0:rot:2], x[:, 1:rot:2]
            y[:, 0:rot:2] = a * np.cos(theta) - b * np.sin(theta)
            y[:, 1:rot:2] = b * np.cos(theta) + a * np.sin(theta)
        else:
            a, b = x[:, :rot // 2], x[:, rot // 2:rot]
            y[:, :rot // 2] = a * np.cos(theta) - b * np.sin(theta)
            y[:, rot // 2:rot] = b * np.cos(theta) + a * np.sin(theta)
        return y

    q, k = rope(q), rope(k)
    keys = np.concatenate([k_hist, k[:, None, :]], axis=1)
    values = np.concatenate([v_hist, v[:, None, :]], axis=1)
    group = heads // kv_heads
    out = np.zeros((heads, head_dim))
    for h in range(heads):
        s = keys[h // group] @ q[h] * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ values[h // group]
    return out.reshape(-1)


def check(heads, kv_heads, head_dim, rot_half, traditional, length, capacity, seed):
    rng = np.random.default_rng(seed)
    position = length - 1
    inv_freq = (10000.0 ** (-np.arange(rot_half) * 2.0 / (2 * rot_half))).astype(np.float32)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    qkv = bf16(rng.standard_normal(q_dim + 2 * kv_dim).astype(np.float32) * 2)
    k_cache = np.zeros(kv_heads * capacity * head_dim, np.float32)
    v_cache = np.zeros_like(k_cache)
    k_hist = bf16(rng.standard_normal((kv_heads, position, head_dim)).astype(np.float32) * 2)
    v_hist = bf16(rng.standard_normal((kv_heads, position, head_dim)).astype(np.float32))
    for g in range(kv_heads):
        for r in range(position):
            at = (g * capacity + r) * head_dim
            k_cache[at:at + head_dim] = k_hist[g, r]
            v_cache[at:at + head_dim] = v_hist[g, r]
    scale = np.float32(head_dim ** -0.5)
    # The host's chunking (cuda_decode.cc): about 264 blocks, 16..128 keys each.
    chunk = min(128, max(16, -(-length * kv_heads // 264)))
    n_chunks = -(-length // chunk)
    q = rope_kv(qkv, inv_freq, k_cache, v_cache, heads, kv_heads, head_dim, traditional,
                position, capacity)
    partial = attn(q, k_cache, v_cache, heads, kv_heads, head_dim, capacity, length, chunk,
                   n_chunks, scale)
    got = combine(partial, heads, head_dim, n_chunks)
    want = reference(qkv, inv_freq, k_hist, v_hist, heads, kv_heads, head_dim, traditional,
                     position, scale)
    rel = np.abs(got - want).max() / np.abs(want).max()
    print(f"heads {heads}/{kv_heads} D {head_dim} rot {2 * rot_half} "
          f"{'traditional' if traditional else 'halves'} len {length} chunk {chunk}x{n_chunks}: "
          f"max |Δ| {rel:.2e} of the largest output")
    return rel


def main():
    worst = max(
        check(4, 2, 16, 8, False, 263, 512, 1),
        check(4, 2, 16, 4, True, 40, 256, 2),
        check(8, 2, 32, 16, False, 300, 512, 3),
        check(4, 4, 64, 16, False, 129, 256, 4),
    )
    if worst > 1e-2:
        print(f"decode_emulate: FAIL ({worst:.2e})")
        sys.exit(1)
    print("decode_emulate: ok")


if __name__ == "__main__":
    main()
