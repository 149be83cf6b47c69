"""Replays the decode step's attention kernel (decode.cu's dec_attention: rope, the cache write,
split-K attention and the last block's merge) block by block, in a random block order, on flat
buffers with the kernel's index arithmetic, and compares it with an independent
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


def rope_head(src, inv_freq, traditional, position):
    """dec_rope_head without bias or norm: the head's roped values (before the store rounds)."""
    rot_half = len(inv_freq)
    row = src.astype(np.float32)
    out = row.copy()
    for j in range(rot_half):
        i0, i1 = (2 * j, 2 * j + 1) if traditional else (j, j + rot_half)
        theta = np.float32(position) * np.float32(inv_freq[j])
        sn, cs = np.sin(theta), np.cos(theta)
        a, b = row[i0], row[i1]
        out[i0] = a * cs - b * sn
        out[i1] = b * cs + a * sn
    return out


def attention(qkv, inv_freq, k_cache, v_cache, heads, kv_heads, head_dim, traditional, position,
              capacity, chunk, n_chunks, scale, rng):
    """dec_attention: blocks (g, c) run in a random order (as on a GPU); each ropes its group's
    queries, the last chunk's block writes the new key/value row first, each writes its chunk's
    partials, and the group's last block to finish (the counter) merges them."""
    group = heads // kv_heads
    length = position + 1
    stride = head_dim + 2
    partial = np.full(heads * n_chunks * stride, np.nan, np.float32)
    out = np.full(heads * head_dim, np.nan, np.float32)
    counters = np.zeros(kv_heads, np.int64)
    blocks = [(g, c) for g in range(kv_heads) for c in range(n_chunks)]
    for i in rng.permutation(len(blocks)):
        g, c = blocks[i]
        k0 = c * chunk
        nk = min(length - k0, chunk)
        qs = np.concatenate([
            bf16(rope_head(qkv[h * head_dim:(h + 1) * head_dim], inv_freq, traditional, position))
            for h in range(g * group, (g + 1) * group)])
        if c == n_chunks - 1:
            at = (g * capacity + position) * head_dim
            k_src = (heads + g) * head_dim
            v_src = (heads + kv_heads + g) * head_dim
            k_cache[at:at + head_dim] = bf16(
                rope_head(qkv[k_src:k_src + head_dim], inv_freq, traditional, position))
            v_cache[at:at + head_dim] = bf16(qkv[v_src:v_src + head_dim])
        p = np.zeros((group, nk), np.float32)
        for tid in range(nk):
            krow = (g * capacity + k0 + tid) * head_dim
            k = k_cache[krow:krow + head_dim]
            for h in range(group):
                p[h, tid] = np.float32(np.dot(qs[h * head_dim:(h + 1) * head_dim], k)) * scale
        for h in range(group):
            m = p[h].max()
            e = np.exp(p[h] - m).astype(np.float32)
            dst = ((g * group + h) * n_chunks + c) * stride
            partial[dst] = m
            partial[dst + 1] = e.sum(dtype=np.float32)
            for d in range(head_dim):
                vcol = (g * capacity + k0) * head_dim + d
                partial[dst + 2 + d] = np.float32(
                    sum(e[j] * v_cache[vcol + j * head_dim] for j in range(nk)))
        counters[g] += 1
        if counters[g] != n_chunks:
            continue
        counters[g] = 0
        for h in range(g * group, (g + 1) * group):
            base = h * n_chunks * stride
            ms = np.array([partial[base + k * stride] for k in range(n_chunks)])
            ls = np.array([partial[base + k * stride + 1] for k in range(n_chunks)])
            m = ms.max()
            w = np.exp(ms - m)
            inv = np.float32(1.0 / (ls * w).sum())
            # The kernel folds 1/l into each chunk's weight, then sums the weighted partials.
            wl = (w * inv).astype(np.float32)
            for d in range(head_dim):
                acc = sum(partial[base + k * stride + 2 + d] * wl[k] for k in range(n_chunks))
                out[h * head_dim + d] = bf16(acc)
    assert not counters.any(), "every group's counter is back at 0"
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
    # Each group's first query head attends mostly to the newest key (rope keeps the dot product
    # of a query and a key at one position), so a misplaced or missing newest row shows.
    group = heads // kv_heads
    for g in range(kv_heads):
        q0 = g * group * head_dim
        qkv[q_dim + g * head_dim:q_dim + (g + 1) * head_dim] = bf16(qkv[q0:q0 + head_dim] * 0.5)
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
    got = attention(qkv, inv_freq, k_cache, v_cache, heads, kv_heads, head_dim, traditional,
                    position, capacity, chunk, n_chunks, scale, rng)
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
