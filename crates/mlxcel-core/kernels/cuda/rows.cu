// rows.cu: small kernels of a prompt's forward pass. Most replace kernels that MLX's CUDA backend
// would otherwise JIT-compile with NVRTC on a machine's first request (its `gather` and
// `gather_axis` modules for lookups, the fused `silu(gate) * up` that `mx::compile` builds): 2-4 s
// each on a fresh machine. As mlxcel kernels they ship compiled (kernels/prebuilt/). One
// replaces several MLX kernels of each attention layer (`heads_rope`).
//
// take_rows:   out[r, c] = table[ids[r], c]          table T [n_rows, row_len], ids int32 [n_ids]
//              (ids are checked against n_rows before the call; clamped so none reads outside)
// silu_halves: out[r, c] = silu(x[r, c]) * x[r, cols + c]     x T [rows, 2 * cols]
//              rounded to T after each op, as MLX's fused kernel of `g * sigmoid(g) * u` rounds
// silu_mul:    out[i] = silu(gate[i]) * up[i]                  gate, up T [n] (separate
//              projections: routed experts), rounded as silu_halves
// take_along_rows: out[r, j] = values[r, ids[r, j]]            values T [rows, cols], ids uint32
//              [rows, k] (a router's chosen experts' scores; ids clamped to the row)
// route_topk:  a MoE router's choice for each row of logits float [rows, experts], one thread
//              a row: scores = softmax (scoring 0) or sigmoid (1) of the row; the k largest
//              of scores + bias (float [experts], when has_bias) in descending order, ties to
//              the lower expert (MLX's stable argsort of the negated choices), as ids uint32
//              [rows, k]; their scores, divided by their sum when normalize (plus 1e-20 for
//              sigmoid), times scale, as weights T [rows, k]. k <= ROUTE_MAX_K.
// heads_rope:  out[b, h, l, :] = rope(qkv[b, l, h, :], offset + l)   for heads h < rope_heads
//              out[b, h, l, :] = qkv[b, l, h, :]                     for the others
//              qkv T [batch, len, heads, head_dim] (a fused q|k|v projection's output),
//              out T [batch, heads, len, head_dim] (the layout attention reads), inv_freq float
//              [rot_half]. On a prompt this is one launch where MLX runs a rope kernel on the
//              queries and one on the keys, over strided views, plus copies into that layout.
//              Rope as MLX's kernel computes it: the first 2 * rot_half dims rotate, pair j by
//              the angle position * inv_freq[j], pairs (2j, 2j + 1) when traditional, else
//              (j, j + rot_half); float32 arithmetic, rounded to T once.
// heads_norm_rope: heads_rope with a per-head RMSNorm before the rope (Qwen3's and Gemma 3's
//              q_norm and k_norm, weights T [head_dim], one eps): heads h < n_q take q_norm,
//              n_q <= h < rope_heads k_norm. One thread per (b, h, l) row (the norm needs the
//              whole row); normalised as MLX's rms_norm rounds, x * rsqrt(mean(x^2) + eps)
//              rounded to T, times the weight rounded to T, then roped as heads_rope.
//
// Launch: threadgroup (256, 1, 1), grid = the output's element count (rounded up), one thread
// per output element; route_topk and heads_norm_rope: one thread per row.

template <typename T>
__device__ __forceinline__ void take_rows(const T* table, const int* ids, T* out, int n_ids,
                                          int row_len, int n_rows) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)n_ids * row_len) {
    return;
  }
  const long long r = i / row_len;
  const long long c = i - r * row_len;
  int id = ids[r];
  id = id < 0 ? 0 : (id >= n_rows ? n_rows - 1 : id);
  out[i] = table[(long long)id * row_len + c];
}

// silu(g) * u as MLX's fused kernel of `g * sigmoid(g) * u` computes it: rounded to T (`like`
// picks it) after the sigmoid and after the product with the gate; the caller rounds the last.
template <typename T>
__device__ __forceinline__ float silu_times(const T* like, float g, float u) {
  const float sig = qmv_round(like, 1.0f / (1.0f + expf(-g)));
  const float gated = qmv_round(like, g * sig);
  return gated * u;
}

template <typename T>
__device__ __forceinline__ void silu_halves(const T* x, T* out, int rows, int cols) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)rows * cols) {
    return;
  }
  const long long r = i / cols;
  const long long c = i - r * cols;
  const float g = qmv_to_float(x[r * 2 * cols + c]);
  const float u = qmv_to_float(x[r * 2 * cols + cols + c]);
  qmv_store(out + i, silu_times(out, g, u));
}

template <typename T>
__device__ __forceinline__ void silu_mul(const T* gate, const T* up, T* out, int n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) {
    return;
  }
  qmv_store(out + i, silu_times(out, qmv_to_float(gate[i]), qmv_to_float(up[i])));
}

template <typename T>
__device__ __forceinline__ void take_along_rows(const T* values, const uint32_t* ids, T* out,
                                                int rows, int cols, int k) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)rows * k) {
    return;
  }
  const long long r = i / k;
  uint32_t c = ids[i];
  c = c >= (uint32_t)cols ? (uint32_t)cols - 1 : c;
  out[i] = values[r * cols + c];
}

template <typename T>
__device__ __forceinline__ void heads_rope(const T* qkv, const float* inv_freq, T* out, int batch,
                                           int len, int heads, int head_dim, int rope_heads,
                                           int rot_half, int traditional, int offset) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)batch * heads * len * head_dim) {
    return;
  }
  // Output order: consecutive threads write (and read) consecutive dims of one head's row.
  const int d = (int)(i % head_dim);
  long long rest = i / head_dim;
  const int l = (int)(rest % len);
  rest /= len;
  const int h = (int)(rest % heads);
  const long long b = rest / heads;
  const T* src = qkv + ((b * len + l) * heads + h) * head_dim;
  if (h >= rope_heads || d >= 2 * rot_half) {
    out[i] = src[d];
    return;
  }
  // This dim's pair (i0, i1) and whether it is the pair's first member.
  const bool first = traditional ? (d & 1) == 0 : d < rot_half;
  const int j = traditional ? d >> 1 : (first ? d : d - rot_half);
  const int i0 = traditional ? 2 * j : j;
  const int i1 = traditional ? 2 * j + 1 : j + rot_half;
  float sn, cs;
  sincosf((float)(offset + l) * inv_freq[j], &sn, &cs);
  const float a = qmv_to_float(src[i0]);
  const float c = qmv_to_float(src[i1]);
  qmv_store(out + i, first ? a * cs - c * sn : c * cs + a * sn);
}

constexpr int ROUTE_MAX_K = 16;

template <typename T>
__device__ __forceinline__ void route_topk(const float* logits, const float* bias, uint32_t* ids,
                                           T* weights, int rows, int experts, int k, int scoring,
                                           int has_bias, int normalize, float scale) {
  const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) {
    return;
  }
  const float* x = logits + r * experts;
  float top = -3.402823466e38f, total = 0.0f;
  if (scoring == 0) {
    for (int e = 0; e < experts; ++e) {
      top = fmaxf(top, x[e]);
    }
    for (int e = 0; e < experts; ++e) {
      total += expf(x[e] - top);
    }
  }
  float best[ROUTE_MAX_K];
  int chosen[ROUTE_MAX_K];
  int count = 0;
  for (int e = 0; e < experts; ++e) {
    const float score = scoring == 0 ? expf(x[e] - top) / total : 1.0f / (1.0f + expf(-x[e]));
    const float choice = has_bias ? score + bias[e] : score;
    if (count == k && !(choice > best[k - 1])) {
      continue;  // not above the k-th: an equal choice keeps the earlier expert
    }
    int at = count < k ? count++ : k - 1;
    while (at > 0 && choice > best[at - 1]) {
      best[at] = best[at - 1];
      chosen[at] = chosen[at - 1];
      --at;
    }
    best[at] = choice;
    chosen[at] = e;
  }
  float picked[ROUTE_MAX_K], sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int e = chosen[j];
    picked[j] = scoring == 0 ? expf(x[e] - top) / total : 1.0f / (1.0f + expf(-x[e]));
    sum += picked[j];
  }
  const float denominator = scoring == 0 ? sum : sum + 1e-20f;
  for (int j = 0; j < k; ++j) {
    ids[r * k + j] = (uint32_t)chosen[j];
    const float w = normalize ? picked[j] / denominator : picked[j];
    qmv_store(weights + r * k + j, w * scale);
  }
}

template <typename T>
__device__ __forceinline__ void heads_norm_rope(const T* qkv, const T* q_norm, const T* k_norm,
                                                const float* inv_freq, T* out, int batch, int len,
                                                int heads, int head_dim, int n_q, int rope_heads,
                                                int rot_half, int traditional, int offset,
                                                float eps) {
  const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= (long long)batch * heads * len) {
    return;
  }
  // Output rows in order (b, h, l).
  const int l = (int)(row % len);
  const int h = (int)((row / len) % heads);
  const long long b = row / ((long long)len * heads);
  const T* src = qkv + ((b * len + l) * heads + h) * head_dim;
  T* dst = out + row * head_dim;
  if (h >= rope_heads) {
    for (int d = 0; d < head_dim; ++d) {
      dst[d] = src[d];
    }
    return;
  }
  const T* w = h < n_q ? q_norm : k_norm;
  float ss = 0.0f;
  for (int d = 0; d < head_dim; ++d) {
    const float v = qmv_to_float(src[d]);
    ss = fmaf(v, v, ss);
  }
  const float inv = rsqrtf(ss / (float)head_dim + eps);
  // The normalised value of dim d, rounded as MLX's rms_norm output is.
  auto normed = [&](int d) {
    return qmv_round(dst, qmv_to_float(w[d]) * qmv_round(dst, qmv_to_float(src[d]) * inv));
  };
  const float position = (float)(offset + l);
  for (int j = 0; j < rot_half; ++j) {
    const int i0 = traditional ? 2 * j : j;
    const int i1 = traditional ? 2 * j + 1 : j + rot_half;
    float sn, cs;
    sincosf(position * inv_freq[j], &sn, &cs);
    const float a = normed(i0);
    const float c = normed(i1);
    qmv_store(dst + i0, a * cs - c * sn);
    qmv_store(dst + i1, c * cs + a * sn);
  }
  for (int d = 2 * rot_half; d < head_dim; ++d) {
    qmv_store(dst + d, normed(d));
  }
}
