// decode.cu: the kernels of mlxcel's CUDA decode step (cpp/cuda_decode.cc) besides the GEMV of
// qmv.cu: one token of one sequence through a llama-shaped decoder as ~7 kernels per layer,
// all added to MLX's CUDA graph by one primitive (decode on a GPU is bound by host time per
// graph node; the MLX graph of the same step has ~14 arrays per layer).
//
// Per layer, on T (bf16/f16) activations (GEMVs of affine 4/8-bit weights, or dense ones in T:
// dec_dmv3):
//   dec_qmv (PRE 1)  q|k|v = rms_norm(h) @ [Wq; Wk; Wv]^T      one launch over three matrices
//   dec_rope_kv      biases, per-head q/k RMSNorm, rope; k and v written into the caches
//   dec_attn         split-K attention partials over chunks of the cached keys
//   dec_attn_combine the chunks merged into one output row per query head
//   dec_qmv (RES 1)  h += attn @ Wo^T
//   dec_qmv (PRE 1)  g|u = rms_norm(h) @ [Wg; Wu]^T
//   dec_qmv (PRE 2, RES 1)  h += (silu(g) * u) @ Wd^T
// Each rounds to T where MLX's ops would, so the step matches the MLX graph to T's precision.

// ---- the GEMV over up to three matrices sharing K ------------------------------------------
// Segment s (0..2): packed weights w_s [n_s, words_per_row], scales/biases [n_s, groups], output
// o_s [n_s]; blocks [0, b_0) compute segment 0, the next b_1 segment 1, then segment 2, with
// b_s = ceil(n_s / RPW) (a segment with n_s = 0 has no blocks). One activation row.
template <int BITS, int NW, int RPW, int PRE, int RES, typename T>
__device__ __forceinline__ void dec_qmv(const uint32_t* w0, const T* s0, const T* z0, T* o0,
                                        int n0, const uint32_t* w1, const T* s1, const T* z1,
                                        T* o1, int n1, const uint32_t* w2, const T* s2,
                                        const T* z2, T* o2, int n2, const T* x, const T* aux,
                                        const T* res, int words_per_row, int groups_per_row,
                                        float eps) {
  constexpr int FAST = BITS == 4 ? 1 : 0;
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

// ---- rope and the cache write --------------------------------------------------------------
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

template <int NW, int RPW, int PRE, int RES, typename T>
__device__ __forceinline__ void dec_dmv(const T* w, const T* x, const T* aux, const T* res, T* out,
                                        int n_rows, int k_len, float eps, int bx) {
  constexpr int NT = NW * 32;
  const int tid = threadIdx.x;
  const int row0 = bx * RPW;
  const T* rows[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int n = (row0 + r < n_rows) ? (row0 + r) : (n_rows - 1);
    rows[r] = w + (size_t)n * (size_t)k_len;
  }
  const float inv_rms = (PRE == 1) ? qmv_inv_rms<NW>(x, k_len, eps) : 1.0f;
  float acc[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    acc[r] = 0.0f;
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
        acc[r] = fmaf(wf[j], xf[j], acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    acc[r] = dec_warp_sum(acc[r]);
  }
  __shared__ float red[NW][RPW];
  const int lane = tid & 31;
  const int warp = tid >> 5;
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      red[warp][r] = acc[r];
    }
  }
  __syncthreads();
  if (tid < RPW) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      s += red[i][tid];
    }
    const int n = row0 + tid;
    if (n < n_rows) {
      if constexpr (RES == 1) {
        s = qmv_round(out, s) + qmv_to_float(res[n]);
      }
      qmv_store(out + n, s);
    }
  }
}

// The dense GEMV over up to three matrices sharing K (segments as dec_qmv's).
template <int NW, int RPW, int PRE, int RES, typename T>
__device__ __forceinline__ void dec_dmv3(const T* w0, T* o0, int n0, const T* w1, T* o1, int n1,
                                         const T* w2, T* o2, int n2, const T* x, const T* aux,
                                         const T* res, int k_len, float eps) {
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
  dec_dmv<NW, RPW, PRE, RES, T>(w, x, aux, res, o, n, k_len, eps, bx);
}

// One warp per head: blocks [0, heads) take the query heads of qkv (written roped to q_out),
// blocks [heads, heads + kv_heads) the key heads (roped into row `position` of k_cache) and the
// value heads (into v_cache). qkv = [q (heads*D) | k (kv_heads*D) | v (kv_heads*D)], each
// projection's bias (nullable) added first, then the per-head RMSNorm (nullable, eps), then rope
// on the first 2*rot_half dims (inv_freq: rot_half angles per position; traditional: adjacent
// pairs, else halves). Caches are [kv_heads, capacity, D].
template <typename T>
__device__ __forceinline__ void dec_rope_kv(const T* qkv, const T* q_bias, const T* k_bias,
                                            const T* v_bias, const T* q_norm, const T* k_norm,
                                            const float* inv_freq, T* q_out, T* k_cache,
                                            T* v_cache, int heads, int kv_heads, int head_dim,
                                            int rot_half, int traditional, int position,
                                            int capacity, float eps) {
  __shared__ float row[DEC_MAX_HEAD_DIM];
  const int lane = threadIdx.x;
  const bool is_q = (int)blockIdx.x < heads;
  const int head = is_q ? blockIdx.x : blockIdx.x - heads;
  const T* src = qkv + (is_q ? 0 : heads * head_dim) + head * head_dim;
  const T* bias = is_q ? q_bias : k_bias;
  const T* norm = is_q ? q_norm : k_norm;
  float ss = 0.0f;
  for (int d = lane; d < head_dim; d += 32) {
    float v = qmv_to_float(src[d]);
    if (bias != nullptr) {
      v = qmv_round(src, v + qmv_to_float(bias[head * head_dim + d]));
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
  T* dst = is_q ? q_out + head * head_dim
                : k_cache + ((size_t)head * capacity + position) * head_dim;
  for (int j = lane; j < rot_half; j += 32) {
    const int i0 = traditional ? 2 * j : j;
    const int i1 = traditional ? 2 * j + 1 : j + rot_half;
    float sn, cs;
    sincosf((float)position * inv_freq[j], &sn, &cs);
    const float a = row[i0];
    const float b = row[i1];
    qmv_store(dst + i0, a * cs - b * sn);
    qmv_store(dst + i1, b * cs + a * sn);
  }
  for (int d = 2 * rot_half + lane; d < head_dim; d += 32) {
    qmv_store(dst + d, row[d]);
  }
  if (!is_q) {
    const T* vsrc = qkv + (heads + kv_heads) * head_dim + head * head_dim;
    T* vdst = v_cache + ((size_t)head * capacity + position) * head_dim;
    for (int d = lane; d < head_dim; d += 32) {
      float v = qmv_to_float(vsrc[d]);
      if (v_bias != nullptr) {
        v = v + qmv_to_float(v_bias[head * head_dim + d]);
      }
      qmv_store(vdst + d, v);
    }
  }
}

// ---- attention -----------------------------------------------------------------------------
constexpr int DEC_ATTN_THREADS = 128;
constexpr int DEC_MAX_GROUP = 16;  // query heads per key/value head

// Block (g, c), 128 threads: the query heads of kv head g against keys [c*chunk, min(len,
// (c+1)*chunk)) (chunk <= 128). Writes per (query head, chunk) the partial [max score, sum of
// exp, sum of exp * v (D values)] to `partial` ([heads][n_chunks][D + 2] floats). q is
// [heads*D], scores are scaled by `scale`. D a multiple of 8 (16-byte key loads).
template <typename T>
__device__ __forceinline__ void dec_attn(const T* q, const T* k_cache, const T* v_cache,
                                         float* partial, int heads, int kv_heads, int head_dim,
                                         int capacity, int len, int chunk, int n_chunks,
                                         float scale) {
  __shared__ float qs[DEC_MAX_GROUP * DEC_MAX_HEAD_DIM];
  __shared__ float p[DEC_MAX_GROUP][DEC_ATTN_THREADS];
  __shared__ float stats[DEC_MAX_GROUP][2];
  const int tid = threadIdx.x;
  const int group = heads / kv_heads;
  const int g = blockIdx.x;
  const int c = blockIdx.y;
  const int k0 = c * chunk;
  const int nk = min(len - k0, chunk);
  for (int i = tid; i < group * head_dim; i += DEC_ATTN_THREADS) {
    qs[i] = qmv_to_float(q[(size_t)g * group * head_dim + i]);
  }
  __syncthreads();
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
  const int lane = tid & 31;
  for (int h = tid >> 5; h < group; h += DEC_ATTN_THREADS / 32) {
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
  for (int i = tid; i < group * head_dim; i += DEC_ATTN_THREADS) {
    const int h = i / head_dim;
    const int d = i - h * head_dim;
    const T* vcol = v_cache + ((size_t)g * capacity + k0) * head_dim + d;
    float acc = 0.0f;
#pragma unroll 8
    for (int j = 0; j < nk; ++j) {
      acc = fmaf(p[h][j], qmv_to_float(vcol[(size_t)j * head_dim]), acc);
    }
    float* out = partial + ((size_t)(g * group + h) * n_chunks + c) * (head_dim + 2);
    out[2 + d] = acc;
    if (d == 0) {
      out[0] = stats[h][0];
      out[1] = stats[h][1];
    }
  }
}

// Block per query head: the chunks' partials merged, out[h*D + d] = attention output (T).
template <typename T>
__device__ __forceinline__ void dec_attn_combine(const float* partial, T* out, int head_dim,
                                                 int n_chunks) {
  const int h = blockIdx.x;
  const int stride = head_dim + 2;
  const float* base = partial + (size_t)h * n_chunks * stride;
  float m = DEC_NEG_INF;
  for (int c = 0; c < n_chunks; ++c) {
    m = fmaxf(m, base[c * stride]);
  }
  float l = 0.0f;
  for (int c = 0; c < n_chunks; ++c) {
    l = fmaf(base[c * stride + 1], __expf(base[c * stride] - m), l);
  }
  const float inv = 1.0f / l;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int c = 0; c < n_chunks; ++c) {
      acc = fmaf(base[c * stride + 2 + d], __expf(base[c * stride] - m), acc);
    }
    qmv_store(out + h * head_dim + d, acc * inv);
  }
}
