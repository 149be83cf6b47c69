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
    qmv<BITS, NW, RPW, 1, 1, FAST, PRE, RES, T, 1>(w0, s0, z0, x, aux, res, o0, n0,
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
  qmv<BITS, NW, RPW, 1, 1, FAST, PRE, RES, T>(w, sc, z, x, aux, res, o, n, words_per_row,
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
constexpr int DEC_ATTN_THREADS = 128;
constexpr int DEC_ATTN_WARPS = DEC_ATTN_THREADS / 32;
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

// Grid (kv_heads, n_chunks), DEC_ATTN_THREADS threads. Block (g, c) takes the query heads of
// key/value head g against keys [c*chunk, min(len, (c+1)*chunk)), len = position + 1:
//  1. the group's query heads of qkv = [q (heads*D) | k (kv_heads*D) | v (kv_heads*D)] through
//     bias, per-head RMSNorm and rope (dec_rope_head), into shared memory;
//  2. the block of the last chunk (the one holding `position`) writes head g's roped key and
//     its value (plus bias) into row `position` of the caches ([kv_heads, capacity, D]);
//  3. scores, softmax and the weighted values over its chunk, written to `partial` as [max
//     score, sum of exp, sum of exp * v (D values)] per (query head, chunk) ([heads][n_chunks]
//     [D + 2] floats; scores scaled by `scale`);
//  4. the group's last block to finish (counters[g], which it sets back to 0 for the next
//     layer) merges the chunks into out[h*D + d] for the group's heads, every thread taking
//     outputs in turn (a warp per head with a serial chain of loads per output took 30-40 us
//     per layer on an H100 at 33 chunks).
// D a multiple of 8 (16-byte key loads), at most DEC_MAX_HEAD_DIM; chunk <= DEC_ATTN_THREADS.
template <typename T>
__device__ __forceinline__ void dec_attention(
    const T* qkv, const T* q_bias, const T* k_bias, const T* v_bias, const T* q_norm,
    const T* k_norm, const float* inv_freq, T* k_cache, T* v_cache, float* partial,
    int* counters, T* out, int heads, int kv_heads, int head_dim, int rot_half, int traditional,
    int position, int capacity, int chunk, int n_chunks, float eps, float scale) {
  __shared__ float qs[DEC_MAX_GROUP * DEC_MAX_HEAD_DIM];
  __shared__ float p[DEC_MAX_GROUP][DEC_ATTN_THREADS];
  __shared__ float stats[DEC_MAX_GROUP][2];
  __shared__ float rows[DEC_ATTN_WARPS][DEC_MAX_HEAD_DIM];
  __shared__ int last;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int group = heads / kv_heads;
  const int g = blockIdx.x;
  const int c = blockIdx.y;
  const int len = position + 1;
  const int k0 = c * chunk;
  const int nk = min(len - k0, chunk);

  // 1. Every block of the group ropes the group's queries itself (a few hundred values).
  for (int i = warp; i < group; i += DEC_ATTN_WARPS) {
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

  // 3. One key per thread: its scores against the group's queries.
  if (tid < nk) {
    const T* krow = k_cache + ((size_t)g * capacity + k0 + tid) * head_dim;
    float s[DEC_MAX_GROUP];
#pragma unroll
    for (int h = 0; h < DEC_MAX_GROUP; ++h) {
      s[h] = 0.0f;
    }
    for (int d = 0; d < head_dim; d += 8) {
      float kf[8];
      qmv_load_x<8>(krow + d, kf);
#pragma unroll
      for (int h = 0; h < DEC_MAX_GROUP; ++h) {
        if (h < group) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            s[h] = fmaf(qs[h * head_dim + d + j], kf[j], s[h]);
          }
        }
      }
    }
#pragma unroll
    for (int h = 0; h < DEC_MAX_GROUP; ++h) {
      if (h < group) {
        p[h][tid] = s[h] * scale;
      }
    }
  }
  __syncthreads();
  for (int h = warp; h < group; h += DEC_ATTN_WARPS) {
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
      stats[h][0] = m;
      stats[h][1] = l;
    }
  }
  __syncthreads();
  const int stride = head_dim + 2;
  for (int i = tid; i < group * head_dim; i += DEC_ATTN_THREADS) {
    const int h = i / head_dim;
    const int d = i - h * head_dim;
    const T* vcol = v_cache + ((size_t)g * capacity + k0) * head_dim + d;
    float acc = 0.0f;
#pragma unroll 8
    for (int j = 0; j < nk; ++j) {
      acc = fmaf(p[h][j], qmv_to_float(vcol[(size_t)j * head_dim]), acc);
    }
    float* dst = partial + ((size_t)(g * group + h) * n_chunks + c) * stride;
    dst[2 + d] = acc;
    if (d == 0) {
      dst[0] = stats[h][0];
      dst[1] = stats[h][1];
    }
  }

  // 4. The last block of the group to get here merges the chunks (the threadFenceReduction
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
  // Each head's largest chunk max m and 1 / sum_k l_k exp(m_k - m), one warp per head.
  for (int i = warp; i < group; i += DEC_ATTN_WARPS) {
    const float* base = partial + (size_t)(g * group + i) * n_chunks * stride;
    float m = DEC_NEG_INF;
    for (int k = lane; k < n_chunks; k += 32) {
      m = fmaxf(m, __ldcg(base + k * stride));
    }
    m = dec_warp_max(m);
    float l = 0.0f;
    for (int k = lane; k < n_chunks; k += 32) {
      l = fmaf(__ldcg(base + k * stride + 1), __expf(__ldcg(base + k * stride) - m), l);
    }
    l = dec_warp_sum(l);
    if (lane == 0) {
      stats[i][0] = m;
      stats[i][1] = 1.0f / l;
    }
  }
  // The outputs (group * head_dim, one thread each in turn) sum their chunks' partial values
  // weighted by exp(m_k - m) / l, over tiles of chunks whose weights sit in `p` (free now);
  // the running sums in `qs` (free too). Every load is independent of the others, so a thread
  // keeps several in flight (the partials come from L2: __ldcg, as other blocks wrote them).
  float* w = &p[0][0];
  const int tile = DEC_MAX_GROUP * DEC_ATTN_THREADS / group;
  const int outs = group * head_dim;
  for (int o = tid; o < outs; o += DEC_ATTN_THREADS) {
    qs[o] = 0.0f;
  }
  __syncthreads();
  for (int k0 = 0; k0 < n_chunks; k0 += tile) {
    const int nt = min(tile, n_chunks - k0);
    for (int j = tid; j < group * nt; j += DEC_ATTN_THREADS) {
      const int i = j / nt;
      const int k = j - i * nt;
      const float mk = __ldcg(partial + ((size_t)(g * group + i) * n_chunks + k0 + k) * stride);
      w[i * tile + k] = __expf(mk - stats[i][0]) * stats[i][1];
    }
    __syncthreads();
    for (int o = tid; o < outs; o += DEC_ATTN_THREADS) {
      const int i = o / head_dim;
      const int d = o - i * head_dim;
      const float* col = partial + ((size_t)(g * group + i) * n_chunks + k0) * stride + 2 + d;
      const float* wi = w + i * tile;
      float acc = 0.0f;
#pragma unroll 8
      for (int k = 0; k < nt; ++k) {
        acc = fmaf(__ldcg(col + (size_t)k * stride), wi[k], acc);
      }
      qs[o] += acc;
    }
    __syncthreads();
  }
  for (int o = tid; o < outs; o += DEC_ATTN_THREADS) {
    qmv_store(out + (size_t)g * outs + o, qs[o]);
  }
  if (tid == 0) {
    counters[g] = 0;
  }
}
