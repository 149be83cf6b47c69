// decode.cu: the kernels of mlxcel's CUDA decode step (cpp/cuda_decode.cc) besides the GEMV of
// qmv.cu: one token of one sequence through a llama-shaped decoder as 5 kernels per layer,
// all added to MLX's CUDA graph by one primitive (decode on a GPU is bound by host time per
// graph node; the MLX graph of the same step has ~14 arrays per layer).
//
// Per layer, on T (bf16/f16) activations (GEMVs of affine 4/8-bit weights, or dense ones in T:
// dec_dmv3):
//   dec_qmv (PRE 1)  q|k|v = rms_norm(h) @ [Wq; Wk; Wv]^T      one launch over three matrices
//   dec_attention    biases, per-head q/k RMSNorm, rope; k and v written into the caches;
//                    split-K attention over chunks of the cached keys, the chunks merged by
//                    the last block of each key/value head
//   dec_qmv (RES 1)  h += attn @ Wo^T
//   dec_qmv (PRE 1, GLU 1)  a = silu(rms_norm(h) @ Wg^T) * (rms_norm(h) @ Wu^T)
//   dec_qmv (RES 1)  h += a @ Wd^T
// Each rounds to T where MLX's ops would, so the step matches the MLX graph to T's precision.

// ---- the GEMV over up to three matrices sharing K ------------------------------------------
// Segment s (0..2): packed weights w_s [n_s, words_per_row], scales/biases [n_s, groups], output
// o_s [n_s]; blocks [0, b_0) compute segment 0, the next b_1 segment 1, then segment 2, with
// b_s = ceil(n_s / RPW) (a segment with n_s = 0 has no blocks). One activation row.
// GLU 1: segment 0 is the MLP's gate, segment 1 its up projection (n_1 = n_0, o_1 unused), and
// o_0 gets silu(gate) * up (qmv's GLU), RPW/2 outputs per block.
template <int BITS, int NW, int RPW, int PRE, int RES, int GLU, typename T>
__device__ __forceinline__ void dec_qmv(const uint32_t* w0, const T* s0, const T* z0, T* o0,
                                        int n0, const uint32_t* w1, const T* s1, const T* z1,
                                        T* o1, int n1, const uint32_t* w2, const T* s2,
                                        const T* z2, T* o2, int n2, const T* x, const T* aux,
                                        const T* res, int words_per_row, int groups_per_row,
                                        float eps) {
  constexpr int FAST = BITS == 4 ? 1 : 0;
  if constexpr (GLU != 0) {
    qmv<BITS, NW, RPW, 1, 1, FAST, PRE, RES, T, 1, 1>(w0, s0, z0, x, aux, res, o0, n0,
                                                   words_per_row, groups_per_row, 1, eps,
                                                   blockIdx.x, w1, s1, z1);
    return;
  }
  const int b0 = (n0 + RPW - 1) / RPW;
  const int b1 = (n1 + RPW - 1) / RPW;
  int bx = blockIdx.x;
  // The block's segment, picked before the one inlined GEMV (a GEMV per branch would triple
  // the kernel's code and its compile time).
  const uint32_t* w = w0;
  const T* sc = s0;
  const T* z = z0;
  T* o = o0;
  int n = n0;
  if (bx >= b0 + b1) {
    w = w2, sc = s2, z = z2, o = o2, n = n2, bx -= b0 + b1;
  } else if (bx >= b0) {
    w = w1, sc = s1, z = z1, o = o1, n = n1, bx -= b0;
  }
  qmv<BITS, NW, RPW, 1, 1, FAST, PRE, RES, T, 0, 1>(w, sc, z, x, aux, res, o, n, words_per_row,
                                                    groups_per_row, 1, eps, bx);
}

// The same on tensor cores (qmv_tc.cu: 4-bit weights in groups of 64 or 128, K <= 16384):
// segments of RPW = 16*RT rows; GLU as dec_qmv's (8*RT outputs per block).
template <int NW, int RT, int PRE, int RES, int GLU, typename T>
__device__ __forceinline__ void dec_qmt(const uint32_t* w0, const T* s0, const T* z0, T* o0,
                                        int n0, const uint32_t* w1, const T* s1, const T* z1,
                                        T* o1, int n1, const uint32_t* w2, const T* s2,
                                        const T* z2, T* o2, int n2, const T* x, const T* aux,
                                        const T* res, int words_per_row, int groups_per_row,
                                        float eps) {
  mlxcel_follow_prior_grid();
  if constexpr (GLU != 0) {
    qmt<NW, RT, PRE, RES, 1, T>(w0, s0, z0, x, aux, res, o0, n0, words_per_row, groups_per_row,
                                eps, blockIdx.x, w1, s1, z1);
    return;
  }
  constexpr int RPW = 16 * RT;
  const int b0 = (n0 + RPW - 1) / RPW;
  const int b1 = (n1 + RPW - 1) / RPW;
  int bx = blockIdx.x;
  const uint32_t* w = w0;
  const T* sc = s0;
  const T* z = z0;
  T* o = o0;
  int n = n0;
  if (bx >= b0 + b1) {
    w = w2, sc = s2, z = z2, o = o2, n = n2, bx -= b0 + b1;
  } else if (bx >= b0) {
    w = w1, sc = s1, z = z1, o = o1, n = n1, bx -= b0;
  }
  qmt<NW, RT, PRE, RES, 0, T>(w, sc, z, x, aux, res, o, n, words_per_row, groups_per_row, eps,
                              bx);
}

// ---- helpers -------------------------------------------------------------------------------
constexpr int DEC_MAX_HEAD_DIM = 256;
// -inf (no math.h under NVRTC).
#define DEC_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float dec_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}
__device__ __forceinline__ float dec_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

// ---- the dense GEMV (weights in T) -------------------------------------------------------
// out[n] = sum_k in(x)[k] * w[n, k] (+ res[n]), in() as PRE says (qmv.cu), for w [N, K] in T
// with K a multiple of 8 and 16-byte aligned rows; the same work split as qmv: a block owns RPW
// rows, its threads stride along K in 16-byte chunks (8 values) of each row.
__device__ __forceinline__ void dec_unpack8(const uint4& v, float (&f)[8], const mlxcel_bf16*) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
  }
}
__device__ __forceinline__ void dec_unpack8(const uint4& v, float (&f)[8], const mlxcel_f16*) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = mlxcel_f16_bits_to_float((unsigned short)(u[i] & 0xFFFFu));
    f[2 * i + 1] = mlxcel_f16_bits_to_float((unsigned short)(u[i] >> 16));
  }
}

// GLU as qmv's: rows r < RPW/2 from w, the rest from w_up, RPW/2 outputs per block.
template <int NW, int RPW, int PRE, int RES, int GLU, typename T>
__device__ __forceinline__ void dec_dmv(const T* w, const T* x, const T* aux, const T* res, T* out,
                                        int n_rows, int k_len, float eps, int bx,
                                        const T* w_up = nullptr) {
  constexpr int NT = NW * 32;
  constexpr int OUTS = GLU ? RPW / 2 : RPW;
  const int tid = threadIdx.x;
  const int row0 = bx * OUTS;
  const T* rows[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int i = row0 + r % OUTS;
    const int n = (i < n_rows) ? i : (n_rows - 1);
    rows[r] = ((GLU && r >= OUTS) ? w_up : w) + (size_t)n * (size_t)k_len;
  }
  const float inv_rms = (PRE == 1) ? qmv_inv_rms<NW>(x, k_len, eps) : 1.0f;
  float acc[1][RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    acc[0][r] = 0.0f;
  }
  const int chunks = k_len / 8;
#pragma unroll 2
  for (int c = tid; c < chunks; c += NT) {
    uint4 wv[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      wv[r] = qmv_load_w<1>(reinterpret_cast<const uint32_t*>(rows[r] + c * 8));
    }
    float xf[8];
    qmv_input<PRE>(x, aux, c * 8, k_len, inv_rms, xf);
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      float wf[8];
      dec_unpack8(wv[r], wf, x);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[0][r] = fmaf(wf[j], xf[j], acc[0][r]);
      }
    }
  }
  qmv_finish<NW, RPW, 1, RES, GLU>(acc, res, out, n_rows, 1, row0, 0);
}

// The dense GEMV over up to three matrices sharing K (segments and GLU as dec_qmv's).
template <int NW, int RPW, int PRE, int RES, int GLU, typename T>
__device__ __forceinline__ void dec_dmv3(const T* w0, T* o0, int n0, const T* w1, T* o1, int n1,
                                         const T* w2, T* o2, int n2, const T* x, const T* aux,
                                         const T* res, int k_len, float eps) {
  mlxcel_follow_prior_grid();
  if constexpr (GLU != 0) {
    dec_dmv<NW, RPW, PRE, RES, 1, T>(w0, x, aux, res, o0, n0, k_len, eps, blockIdx.x, w1);
    return;
  }
  const int b0 = (n0 + RPW - 1) / RPW;
  const int b1 = (n1 + RPW - 1) / RPW;
  int bx = blockIdx.x;
  const T* w = w0;
  T* o = o0;
  int n = n0;
  if (bx >= b0 + b1) {
    w = w2, o = o2, n = n2, bx -= b0 + b1;
  } else if (bx >= b0) {
    w = w1, o = o1, n = n1, bx -= b0;
  }
  dec_dmv<NW, RPW, PRE, RES, 0, T>(w, x, aux, res, o, n, k_len, eps, bx);
}

// ---- attention: rope, the cache write, split-K attention and its combine, one launch -----
constexpr int DEC_MAX_GROUP = 16;  // query heads per key/value head

// One head of `src` (head_dim values of qkv) through its bias (nullable), the per-head RMSNorm
// (nullable, eps) and rope on the first 2*rot_half dims (inv_freq: rot_half angles per
// position; traditional: adjacent pairs, else halves), by one warp; store(d, value) takes the
// results. `row`: the warp's own head_dim floats of shared memory.
template <typename T, typename Store>
__device__ __forceinline__ void dec_rope_head(const T* src, const T* bias, const T* norm,
                                              const float* inv_freq, float* row, int head_dim,
                                              int rot_half, int traditional, int position,
                                              float eps, Store store) {
  const int lane = threadIdx.x & 31;
  float ss = 0.0f;
  for (int d = lane; d < head_dim; d += 32) {
    float v = qmv_to_float(src[d]);
    if (bias != nullptr) {
      v = qmv_round(src, v + qmv_to_float(bias[d]));
    }
    row[d] = v;
    ss = fmaf(v, v, ss);
  }
  if (norm != nullptr) {
    const float inv = rsqrtf(dec_warp_sum(ss) / (float)head_dim + eps);
    for (int d = lane; d < head_dim; d += 32) {
      row[d] = qmv_round(src, qmv_to_float(norm[d]) * qmv_round(src, row[d] * inv));
    }
  }
  __syncwarp();
  for (int j = lane; j < rot_half; j += 32) {
    const int i0 = traditional ? 2 * j : j;
    const int i1 = traditional ? 2 * j + 1 : j + rot_half;
    float sn, cs;
    sincosf((float)position * inv_freq[j], &sn, &cs);
    const float a = row[i0];
    const float b = row[i1];
    store(i0, a * cs - b * sn);
    store(i1, b * cs + a * sn);
  }
  for (int d = 2 * rot_half + lane; d < head_dim; d += 32) {
    store(d, row[d]);
  }
  // The warp's next head reuses `row`.
  __syncwarp();
}

// A sum over the 8 adjacent lanes that share one key or one value slice (the same in every one
// of them afterwards). Every lane of the warp takes part.
__device__ __forceinline__ float dec_lane8_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  return v;
}

// Grid (kv_heads, n_chunks), NT threads (128 or 256: MLXCEL_CUDA_DECODE_ATTN_THREADS; more
// warps split each latency-bound phase finer: the queries' rope, the softmax and the merge a
// head or an output per thread fewer each, the scores and values 2x the keys or slices a
// pass). Block (g, c) takes the query heads of
// key/value head g against keys [c*chunk, min(len, (c+1)*chunk)), len = position + 1:
//  0. it asks L2 for its chunk's key and value rows, so that the loads below wait on L2, not
//     on DRAM, while it ropes the queries;
//  1. the group's query heads of qkv = [q (heads*D) | k (kv_heads*D) | v (kv_heads*D)] through
//     bias, per-head RMSNorm and rope (dec_rope_head), into shared memory;
//  2. the block of the last chunk (the one holding `position`) writes head g's roped key and
//     its value (plus bias) into row `position` of the caches ([kv_heads, capacity, D]);
//  3. scores: DEC_KEY_LANES adjacent threads share a key, lane kl taking the 16-byte slices
//     d = 8*kl + 64*i of it, every load of two passes (2 * NT / DEC_KEY_LANES keys) issued
//     before the first multiply; the lanes' sums meet by shuffles;
//  4. softmax over the chunk, then the weighted values: DEC_KEY_LANES adjacent threads share an
//     8-value slice of the rows, lane kl taking keys kl, kl + 8, ... (four loads in flight),
//     DEC_HEAD_BATCH heads at a time; written to `partial` as the values [heads][n_chunks][D]
//     followed by the stats [heads][n_chunks][max score, sum of exp] (floats; scores scaled by
//     `scale`);
//  5. the group's last block to finish (counters[g], which it sets back to 0 for the next
//     layer) merges the chunks into out[h*D + d] for the group's heads, a thread per 4 outputs,
//     each chunk's weight exp(m_k - m) computed where its partial values are read.
// Each latency-bound step keeps its loads independent of each other: the kernel this replaced
// (a thread per key, its 16 loads of a 128-value row one after another; the values a column
// at a time) took 22 us per layer of an 8B model on an H100 for under a hundred cached rows.
// D a multiple of 8 (16-byte key loads), at most DEC_MAX_HEAD_DIM; chunk <= NT.
// Sums are taken in a fixed order, so the output does not depend on block timing.
constexpr int DEC_KEY_LANES = 8;
constexpr int DEC_KEY_SLICES = DEC_MAX_HEAD_DIM / (8 * DEC_KEY_LANES);
constexpr int DEC_HEAD_BATCH = 4;
template <typename T, int NT>
__device__ __forceinline__ void dec_attention(
    const T* qkv, const T* q_bias, const T* k_bias, const T* v_bias, const T* q_norm,
    const T* k_norm, const float* inv_freq, T* k_cache, T* v_cache, float* partial,
    int* counters, T* out, int heads, int kv_heads, int head_dim, int rot_half, int traditional,
    int position, int capacity, int chunk, int n_chunks, float eps, float scale) {
  static_assert(NT == 128 || NT == 256, "dec_attention: 4 or 8 warps");
  constexpr int WARPS = NT / 32;
  constexpr int KEYS_PER_PASS = NT / DEC_KEY_LANES;
  __shared__ __align__(16) float qs[DEC_MAX_GROUP * DEC_MAX_HEAD_DIM];
  __shared__ float p[DEC_MAX_GROUP][NT];
  __shared__ float stats[DEC_MAX_GROUP][2];
  __shared__ float rows[WARPS][DEC_MAX_HEAD_DIM];
  __shared__ int last;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int kl = tid & (DEC_KEY_LANES - 1);
  const int slot = tid / DEC_KEY_LANES;
  const int group = heads / kv_heads;
  const int g = blockIdx.x;
  const int c = blockIdx.y;
  const int len = position + 1;
  const int k0 = c * chunk;
  const int nk = min(len - k0, chunk);
  const T* keys = k_cache + ((size_t)g * capacity + k0) * head_dim;
  const T* values = v_cache + ((size_t)g * capacity + k0) * head_dim;
  float* partial_values = partial;
  float* partial_stats = partial + (size_t)heads * n_chunks * head_dim;

  // 0. The chunk's rows are contiguous: nk * D values of each cache.
  {
    const int bytes = nk * head_dim * (int)sizeof(T);
    for (int at = tid * 128; at < bytes; at += NT * 128) {
      mlxcel_prefetch_l2(reinterpret_cast<const char*>(keys) + at);
      mlxcel_prefetch_l2(reinterpret_cast<const char*>(values) + at);
    }
  }
  // Cached rows come from earlier steps; q|k|v (and the counters, the partials) from the
  // kernels just before.
  mlxcel_follow_prior_grid();
  // 1. Every block of the group ropes the group's queries itself (a few hundred values).
  for (int i = warp; i < group; i += WARPS) {
    const int h = g * group + i;
    float* dst = qs + i * head_dim;
    dec_rope_head(qkv + h * head_dim, q_bias != nullptr ? q_bias + h * head_dim : nullptr,
                  q_norm, inv_freq, rows[warp], head_dim, rot_half, traditional, position, eps,
                  [&](int d, float v) { dst[d] = qmv_round(qkv, v); });
  }
  // 2. The newest key and value; this block's threads read them back below (__syncthreads
  // orders a block's global writes before its reads), no other block reads that row.
  if (c == n_chunks - 1) {
    const size_t at = ((size_t)g * capacity + position) * head_dim;
    if (warp == 0) {
      dec_rope_head(qkv + (heads + g) * head_dim,
                    k_bias != nullptr ? k_bias + g * head_dim : nullptr, k_norm, inv_freq,
                    rows[0], head_dim, rot_half, traditional, position, eps,
                    [&](int d, float v) { qmv_store(k_cache + at + d, v); });
    } else if (warp == 1) {
      const T* vsrc = qkv + (heads + kv_heads + g) * head_dim;
      for (int d = lane; d < head_dim; d += 32) {
        float v = qmv_to_float(vsrc[d]);
        if (v_bias != nullptr) {
          v += qmv_to_float(v_bias[g * head_dim + d]);
        }
        qmv_store(v_cache + at + d, v);
      }
    }
  }
  __syncthreads();

  // 3. Scores, two passes of KEYS_PER_PASS keys at a time (the loop bounds are the
  // block's, so every lane reaches the shuffles).
  for (int j0 = 0; j0 < nk; j0 += 2 * KEYS_PER_PASS) {
    uint4 kv[2][DEC_KEY_SLICES];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = j0 + u * KEYS_PER_PASS + slot;
#pragma unroll
      for (int i = 0; i < DEC_KEY_SLICES; ++i) {
        const int d = 8 * kl + 8 * DEC_KEY_LANES * i;
        kv[u][i] = make_uint4(0u, 0u, 0u, 0u);
        if (j < nk && d < head_dim) {
          kv[u][i] = *reinterpret_cast<const uint4*>(keys + (size_t)j * head_dim + d);
        }
      }
    }
    for (int h0 = 0; h0 < group; h0 += DEC_HEAD_BATCH) {
      float s[2][DEC_HEAD_BATCH];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int b = 0; b < DEC_HEAD_BATCH; ++b) {
          s[u][b] = 0.0f;
        }
#pragma unroll
        for (int i = 0; i < DEC_KEY_SLICES; ++i) {
          const int d = 8 * kl + 8 * DEC_KEY_LANES * i;
          if (d < head_dim) {
            float kf[8];
            dec_unpack8(kv[u][i], kf, qkv);
#pragma unroll
            for (int b = 0; b < DEC_HEAD_BATCH; ++b) {
              if (h0 + b < group) {
                const float* q = qs + (h0 + b) * head_dim + d;
                const float4 qa = *reinterpret_cast<const float4*>(q);
                const float4 qb = *reinterpret_cast<const float4*>(q + 4);
                float a = s[u][b];
                a = fmaf(qa.x, kf[0], a);
                a = fmaf(qa.y, kf[1], a);
                a = fmaf(qa.z, kf[2], a);
                a = fmaf(qa.w, kf[3], a);
                a = fmaf(qb.x, kf[4], a);
                a = fmaf(qb.y, kf[5], a);
                a = fmaf(qb.z, kf[6], a);
                a = fmaf(qb.w, kf[7], a);
                s[u][b] = a;
              }
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int j = j0 + u * KEYS_PER_PASS + slot;
#pragma unroll
        for (int b = 0; b < DEC_HEAD_BATCH; ++b) {
          const float sum = dec_lane8_sum(s[u][b]);
          if (kl == b && h0 + b < group && j < nk) {
            p[h0 + b][j] = sum * scale;
          }
        }
      }
    }
  }
  __syncthreads();
  // 4. Softmax over the chunk, a warp per head.
  for (int h = warp; h < group; h += WARPS) {
    float m = DEC_NEG_INF;
    for (int j = lane; j < nk; j += 32) {
      m = fmaxf(m, p[h][j]);
    }
    m = dec_warp_max(m);
    float l = 0.0f;
    for (int j = lane; j < nk; j += 32) {
      const float e = __expf(p[h][j] - m);
      p[h][j] = e;
      l += e;
    }
    l = dec_warp_sum(l);
    if (lane == 0) {
      float* st = partial_stats + ((size_t)(g * group + h) * n_chunks + c) * 2;
      st[0] = m;
      st[1] = l;
    }
  }
  __syncthreads();
  // The weighted values: slice `slot` (+ KEYS_PER_PASS, ...) of D/8, keys kl + 8*n.
  const int slices = head_dim / 8;
  for (int s0 = 0; s0 < slices; s0 += KEYS_PER_PASS) {
    const int sl = s0 + slot;
    const bool on = sl < slices;
    for (int h0 = 0; h0 < group; h0 += DEC_HEAD_BATCH) {
      float acc[DEC_HEAD_BATCH][8];
#pragma unroll
      for (int b = 0; b < DEC_HEAD_BATCH; ++b) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          acc[b][e] = 0.0f;
        }
      }
      for (int j0 = 0; j0 < nk; j0 += 4 * DEC_KEY_LANES) {
        uint4 vv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int j = j0 + u * DEC_KEY_LANES + kl;
          vv[u] = make_uint4(0u, 0u, 0u, 0u);
          if (on && j < nk) {
            vv[u] = *reinterpret_cast<const uint4*>(values + (size_t)j * head_dim + 8 * sl);
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int j = j0 + u * DEC_KEY_LANES + kl;
          if (on && j < nk) {
            float vf[8];
            dec_unpack8(vv[u], vf, qkv);
#pragma unroll
            for (int b = 0; b < DEC_HEAD_BATCH; ++b) {
              if (h0 + b < group) {
                const float w = p[h0 + b][j];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                  acc[b][e] = fmaf(w, vf[e], acc[b][e]);
                }
              }
            }
          }
        }
      }
#pragma unroll
      for (int b = 0; b < DEC_HEAD_BATCH; ++b) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float sum = dec_lane8_sum(acc[b][e]);
          // Lane kl stores value kl of the slice: 8 lanes, 32 contiguous bytes.
          if (e == kl && on && h0 + b < group) {
            partial_values[((size_t)(g * group + h0 + b) * n_chunks + c) * head_dim + 8 * sl + e] =
                sum;
          }
        }
      }
    }
  }

  // 5. The last block of the group to get here merges the chunks (the threadFenceReduction
  // pattern: each block's partials are visible device-wide before it counts itself).
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    last = atomicAdd(counters + g, 1) == n_chunks - 1;
  }
  __syncthreads();
  if (!last) {
    return;
  }
  // Each head's largest chunk max m and 1 / sum_k l_k exp(m_k - m), a warp per head: each lane
  // folds its chunks online, then the lanes meet (the partials come from L2: __ldcg, as other
  // blocks wrote them).
  for (int i = warp; i < group; i += WARPS) {
    const float* st = partial_stats + (size_t)(g * group + i) * n_chunks * 2;
    float m = DEC_NEG_INF;
    float l = 0.0f;
    for (int k = lane; k < n_chunks; k += 32) {
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(st + 2 * k));
      const float mx = fmaxf(m, ml.x);
      l = l * __expf(m - mx) + ml.y * __expf(ml.x - mx);
      m = mx;
    }
    const float mx = dec_warp_max(m);
    l = dec_warp_sum(l * __expf(m - mx));
    if (lane == 0) {
      stats[i][0] = mx;
      stats[i][1] = 1.0f / l;
    }
  }
  __syncthreads();
  // A thread per 4 outputs: its float4 of every chunk's partial values, weighted by
  // exp(m_k - m), loads independent of each other.
  const int outs4 = group * head_dim / 4;
  for (int o = tid; o < outs4; o += NT) {
    const int i = 4 * o / head_dim;
    const int d = 4 * o - i * head_dim;
    const float* col = partial_values + (size_t)(g * group + i) * n_chunks * head_dim + d;
    const float* st = partial_stats + (size_t)(g * group + i) * n_chunks * 2;
    const float m = stats[i][0];
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int k = 0; k < n_chunks; ++k) {
      const float w = __expf(__ldcg(st + 2 * k) - m);
      const float4 v = __ldcg(reinterpret_cast<const float4*>(col + (size_t)k * head_dim));
      acc.x = fmaf(w, v.x, acc.x);
      acc.y = fmaf(w, v.y, acc.y);
      acc.z = fmaf(w, v.z, acc.z);
      acc.w = fmaf(w, v.w, acc.w);
    }
    const float inv = stats[i][1];
    T* dst = out + (size_t)g * group * head_dim + 4 * o;
    qmv_store(dst, acc.x * inv);
    qmv_store(dst + 1, acc.y * inv);
    qmv_store(dst + 2, acc.z * inv);
    qmv_store(dst + 3, acc.w * inv);
  }
  if (tid == 0) {
    counters[g] = 0;
  }
}
