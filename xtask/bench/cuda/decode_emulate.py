"""Replays the decode step's attention kernel (decode.cu's dec_attention: rope, the cache write,
split-K attention and the last block's merge) block by block, in a random block order, on flat
buffers with the kernel's index arithmetic, and compares it with an independent
reference: rope as MLX applies it (halves or adjacent pairs, the first 2*rot_half dims), grouped
attention over the cached keys, softmax in float64. No GPU needed (numpy).

    python3 xtask/bench/cuda/decode_emulate.py [128|256]

The argument is the block's thread count (dec_attention's NT, MLXCEL_CUDA_DECODE_ATTN_THREADS;
default 128): it sets the keys a scores pass and the value slices a pass take.

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


KEY_LANES = 8        # DEC_KEY_LANES: adjacent threads sharing a key or a value slice
THREADS = int(sys.argv[1]) if len(sys.argv) > 1 else 128  # dec_attention's NT
assert THREADS in (128, 256)
KEYS_PER_PASS = THREADS // KEY_LANES
KEY_SLICES = 256 // (8 * KEY_LANES)
HEAD_BATCH = 4


def lane8_sum(parts):
    """dec_lane8_sum: the xor-1, -2, -4 shuffle tree over 8 lanes' float32 values."""
    a = [np.float32(x) for x in parts]
    for o in (1, 2, 4):
        a = [np.float32(a[i] + a[i ^ o]) for i in range(8)]
    assert all(x == a[0] or (np.isnan(x) and np.isnan(a[0])) for x in a)
    return a[0]


def attention(qkv, inv_freq, k_cache, v_cache, heads, kv_heads, head_dim, traditional, position,
              capacity, chunk, n_chunks, scale, rng):
    """dec_attention: blocks (g, c) run in a random order (as on a GPU); each ropes its group's
    queries, the last chunk's block writes the new key/value row first, each writes its chunk's
    partials, and the group's last block to finish (the counter) merges them. Lanes are
    replayed with the kernel's index arithmetic: which key, which 16-byte slice, which slot of
    `partial`."""
    group = heads // kv_heads
    length = position + 1
    partial = np.full(heads * n_chunks * (head_dim + 2), np.nan, np.float32)
    stats_at = heads * n_chunks * head_dim
    out = np.full(heads * head_dim, np.nan, np.float32)
    counters = np.zeros(kv_heads, np.int64)
    blocks = [(g, c) for g in range(kv_heads) for c in range(n_chunks)]
    for bi in rng.permutation(len(blocks)):
        g, c = blocks[bi]
        k0 = c * chunk
        nk = min(length - k0, chunk)
        keys = (g * capacity + k0) * head_dim
        values = keys
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
        # 3. Scores: thread tid = 8 * slot + kl takes key j0 + u * NT/8 + slot, slices
        # d = 8*kl + 64*i.
        p = np.full((group, THREADS), np.nan, np.float32)
        for j0 in range(0, nk, 2 * KEYS_PER_PASS):
            for u in range(2):
                for slot in range(KEYS_PER_PASS):
                    j = j0 + u * KEYS_PER_PASS + slot
                    if j >= nk:
                        continue
                    for h in range(group):
                        parts = []
                        for kl in range(KEY_LANES):
                            a = np.float32(0)
                            for i in range(KEY_SLICES):
                                d = 8 * kl + 8 * KEY_LANES * i
                                if d < head_dim:
                                    k = k_cache[keys + j * head_dim + d:keys + j * head_dim + d + 8]
                                    q = qs[h * head_dim + d:h * head_dim + d + 8]
                                    a = np.float32(a + np.dot(q, k))
                            parts.append(a)
                        p[h, j] = lane8_sum(parts) * scale
        # 4. Softmax and the weighted values: slice sl = s0 + slot, keys kl + 8 n.
        for h in range(group):
            m = p[h, :nk].max()
            e = np.exp(p[h, :nk] - m).astype(np.float32)
            p[h, :nk] = e
            st = stats_at + ((g * group + h) * n_chunks + c) * 2
            partial[st] = m
            partial[st + 1] = e.sum(dtype=np.float32)
        slices = head_dim // 8
        for s0 in range(0, slices, KEYS_PER_PASS):
            for slot in range(KEYS_PER_PASS):
                sl = s0 + slot
                if sl >= slices:
                    continue
                for h in range(group):
                    acc = np.zeros((KEY_LANES, 8), np.float32)
                    for j0 in range(0, nk, 4 * KEY_LANES):
                        for u in range(4):
                            for kl in range(KEY_LANES):
                                j = j0 + u * KEY_LANES + kl
                                if j < nk:
                                    row = values + j * head_dim + 8 * sl
                                    acc[kl] += p[h, j] * v_cache[row:row + 8]
                    for e_ in range(8):
                        dst = ((g * group + h) * n_chunks + c) * head_dim + 8 * sl + e_
                        partial[dst] = lane8_sum(acc[:, e_])
        counters[g] += 1
        if counters[g] != n_chunks:
            continue
        counters[g] = 0
        # 5. The merge: per head, lanes fold chunks lane, lane + 32, ... online, then meet.
        for i in range(group):
            h = g * group + i
            st = stats_at + h * n_chunks * 2
            lane_m = np.full(32, -np.inf, np.float32)
            lane_l = np.zeros(32, np.float32)
            for k in range(n_chunks):
                lane = k % 32
                mk, lk = partial[st + 2 * k], partial[st + 2 * k + 1]
                mx = max(lane_m[lane], mk)
                lane_l[lane] = lane_l[lane] * np.exp(lane_m[lane] - mx) + lk * np.exp(mk - mx)
                lane_m[lane] = mx
            m = lane_m.max()
            inv = np.float32(1.0 / (lane_l * np.exp(lane_m - m)).sum(dtype=np.float32))
            for o4 in range(head_dim // 4):
                d = 4 * o4
                acc = np.zeros(4, np.float32)
                for k in range(n_chunks):
                    w = np.float32(np.exp(partial[st + 2 * k] - m))
                    col = (h * n_chunks + k) * head_dim + d
                    acc += w * partial[col:col + 4]
                out[h * head_dim + d:h * head_dim + d + 4] = bf16(acc * inv)
    assert not counters.any(), "every group's counter is back at 0"
    assert not np.isnan(out).any(), "every output was written"
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
        check(8, 2, 80, 40, False, 77, 128, 5),
        check(8, 2, 128, 64, False, 70, 128, 6),
        check(16, 1, 256, 32, True, 41, 64, 7),
        check(16, 16, 16, 8, False, 2000, 2048, 8),
    )
    if worst > 1e-2:
        print(f"decode_emulate: FAIL ({worst:.2e})")
        sys.exit(1)
    print("decode_emulate: ok")


if __name__ == "__main__":
    main()
