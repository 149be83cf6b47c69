// qmv.cu: mlxcel's decode GEMV, `qmv<...>`, called by the `extern "C"` entry points
// crates/mlxcel-core/src/cuda_kernels.rs generates (helpers: qmv_header.cuh).
//
//   out[m, n] = sum_k in(x)[m, k] * (scale[n, k/gs] * q[n, k] + bias[n, k/gs])  (+ res[m, n])
//
// with the activations prepared on load by PRE (the op that would otherwise run before the
// product as its own kernel and graph node; decode on a GPU is bound by MLX's host time per
// node, so every node folded in here is host time saved):
//   PRE 0  in(x) = x                                          x [M, K]
//   PRE 1  in(x) = w * rms_norm(x) (MLX's fast::rms_norm)     x [M, K], aux = w [K], eps
//   PRE 2  in(x) = silu(g) * u, g = x[:, :K], u = x[:, K:]    x [M, 2K] (a fused gate|up output)
// and RES 1 adds a residual after the product (the residual add of a pre-norm block). Each
// folded op rounds to T where MLX's kernel would, so results match the unfused ops closely.
//
// Arguments, in this order:
//   w      uint32 [N, K*BITS/32]  MLX affine packing, element j of a word at bits BITS*j..
//   scales T      [N, K/gs]
//   biases T      [N, K/gs]
//   x      T      [M, K] or [M, 2K] (PRE 2) (row-contiguous; M = rows of activations)
//   aux    T      [K] (PRE 1; else unused)
//   res    T      [M, N] (RES 1; else unused)
//   out    T      [M, N]          (any shape with M*N elements; dtype = x's dtype)
//   n_rows, words_per_row, groups_per_row, m_rows: N, K*BITS/32, K/gs and M; eps (PRE 1)
//   bx     the block's index along the output rows (blockIdx.x, or less where one launch covers
//          several matrices: decode.cu)
// Integer template args: BITS (4 or 8), NW (warps per block), RPW (output rows per block),
//   MB (activation rows per block: each weight chunk is loaded once and used for all MB rows,
//   so a decode batch reads the matrix ceil(M/MB) times instead of M times),
//   NOALLOC (1: weights read with ld.global.nc.L1::no_allocate, 0: plain ld.global.nc),
//   FAST (4 bits only; 1: two elements per LOP3 with a ~2e-5 relative perturbation, see
//   qmv_header.cuh; use 0 for float32 outputs or when bit-faithful float math is wanted),
//   PRE and RES as above.
// Launch: threadgroup (NW*32, 1, 1), grid (ceil(N/RPW) * NW*32, ceil(M/MB), 1)  (grid is in
// threads).
// N, K and the group size are arguments, so one compiled kernel serves every matrix of a model; gs must be a power of two >= 32 (MLX: 32, 64,
// 128). K must be a multiple of 32 and x 16-byte aligned (true for MLX-allocated rows).
//
// Work split: a block owns RPW consecutive output rows; its NW*32 threads stride along K in
// 16-byte chunks of packed weights (32 elements at 4 bits), so each warp reads 512 contiguous
// bytes of every row per step. A chunk never straddles a quantization group. Each thread
// converts its x chunk to float once and reuses it for all RPW rows; partial sums are reduced
// with warp shuffles and then across warps through a tiny shared array. No atomics. PRE 1 has
// every block compute its row's sum of squares first (K values from L2: cheap next to the
// weights it streams).

// silu(g) * u for g and u already in T, rounded to T after each op as MLX's graph
// (`silu(gate) * up`, silu = x * sigmoid(x)) would.
template <typename T>
__device__ __forceinline__ float qmv_silu_gate(const T* like, float g, float u) {
  const float sig = qmv_round(like, __fdividef(1.0f, 1.0f + __expf(-g)));
  return qmv_round(like, qmv_round(like, g * sig) * u);
}

// N activations starting at element `k` of row `xrow`, prepared as PRE says.
template <int PRE, int N, typename T>
__device__ __forceinline__ void qmv_input(const T* xrow, const T* aux, int k, int k_len,
                                          float inv_rms, float (&xf)[N]) {
  qmv_load_x(xrow + k, xf);
  if constexpr (PRE == 1) {
    float wf[N];
    qmv_load_x(aux + k, wf);
#pragma unroll
    for (int j = 0; j < N; j += 2) {
      // round(w * round(x * inv_rms)), two at a time
      float a = xf[j] * inv_rms, b = xf[j + 1] * inv_rms;
      qmv_round2(xrow, a, b);
      a = wf[j] * a;
      b = wf[j + 1] * b;
      qmv_round2(xrow, a, b);
      xf[j] = a;
      xf[j + 1] = b;
    }
  } else if constexpr (PRE == 2) {
    float uf[N];
    qmv_load_x(xrow + k_len + k, uf);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      xf[j] = qmv_silu_gate(xrow, xf[j], uf[j]);
    }
  }
}

// 1 / sqrt(mean(x^2) + eps) over a row of k_len activations, in every thread of the block.
template <int NW, typename T>
__device__ __forceinline__ float qmv_inv_rms(const T* xrow, int k_len, float eps) {
  __shared__ float qmv_ss[NW];
  float ss = 0.0f;
  for (int k = threadIdx.x * 8; k < k_len; k += NW * 32 * 8) {
    float f[8];
    qmv_load_x(xrow + k, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      ss = fmaf(f[j], f[j], ss);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ss += __shfl_xor_sync(0xffffffffu, ss, o);
  }
  if ((threadIdx.x & 31) == 0) {
    qmv_ss[threadIdx.x >> 5] = ss;
  }
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    total += qmv_ss[i];
  }
  // Every thread has read the partial sums before the next call overwrites them.
  __syncthreads();
  return rsqrtf(total / (float)k_len + eps);
}

// The end of a GEMV block: acc[b][r] (each thread's partial sums of output row r for activation
// row b) reduced over the block, then stored for rows row0.. of `out` ([m_rows, n_rows]), with
// RES adding the residual. GLU (one activation row): rows r < RPW/2 are gate rows, the rest
// the up rows of the same outputs, and output row0 + r gets silu(gate_r) * up_r.
template <int NW, int RPW, int MB, int RES, int GLU, typename T>
__device__ __forceinline__ void qmv_finish(float (&acc)[MB][RPW], const T* res, T* out,
                                           int n_rows, int m_rows, int row0, int m0) {
  static_assert(GLU == 0 || (MB == 1 && RES == 0 && RPW % 2 == 0),
                "qmv: GLU takes one activation row, an even RPW and no residual");
#pragma unroll
  for (int b = 0; b < MB; ++b) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        acc[b][r] += __shfl_xor_sync(0xffffffffu, acc[b][r], o);
      }
    }
  }
  __shared__ float qmv_red[NW][MB * RPW];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  if (lane == 0) {
#pragma unroll
    for (int b = 0; b < MB; ++b) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        qmv_red[warp][b * RPW + r] = acc[b][r];
      }
    }
  }
  __syncthreads();
  float s = 0.0f;
  if (tid < MB * RPW) {
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      s += qmv_red[i][tid];
    }
  }
  if constexpr (GLU != 0) {
    // The projection's outputs rounded to T (MLX stores the gate|up product), then the gate.
    constexpr int HALF = RPW / 2;
    __shared__ float qmv_rows[RPW];
    if (tid < RPW) {
      qmv_rows[tid] = qmv_round(out, s);
    }
    __syncthreads();
    const int n = row0 + tid;
    if (tid < HALF && n < n_rows) {
      qmv_store(out + n, qmv_silu_gate(out, qmv_rows[tid], qmv_rows[tid + HALF]));
    }
  } else if (tid < MB * RPW) {
    const int m = m0 + tid / RPW;
    const int n = row0 + tid % RPW;
    if (n < n_rows && m < m_rows) {
      const size_t at = (size_t)m * (size_t)n_rows + n;
      if constexpr (RES == 1) {
        // MLX rounds the product, then the sum.
        s = qmv_round(out, s) + qmv_to_float(res[at]);
      }
      qmv_store(out + at, s);
    }
  }
}

// GLU 1 (decode.cu, one activation row): the block's rows are RPW/2 gate rows of (w, scales,
// biases) and the same RPW/2 rows of the up matrix (w_up, scales_up, biases_up), and it stores
// silu(gate) * up for its RPW/2 outputs (n_rows = the gate's rows): the MLP's gate|up
// projection whose down projection then reads one plain row.
// PDL 1 (the decode step, launched after a programmatic edge): the block issues its first
// step's weight loads (or, without HOIST, asks L2 for them), then waits for the kernel before
// it (prelude.cuh's mlxcel_follow_prior_grid) before reading anything that kernel writes.
template <int BITS, int NW, int RPW, int MB, int NOALLOC, int FAST, int PRE, int RES,
          typename T, int GLU = 0, int PDL = 0>
__device__ __forceinline__ void qmv(const uint32_t* w, const T* scales, const T* biases,
                                    const T* x, const T* aux, const T* res, T* out, int n_rows,
                                    int words_per_row, int groups_per_row, int m_rows, float eps,
                                    int bx, const uint32_t* w_up = nullptr,
                                    const T* scales_up = nullptr, const T* biases_up = nullptr) {
  constexpr int QMV_EPW = 32 / BITS;     // elements per uint32
  constexpr int QMV_EPC = 4 * QMV_EPW;   // elements per 16-byte chunk
  constexpr int QMV_NT = NW * 32;        // threads per block
  constexpr float QMV_OFF = (BITS == 4) ? 128.0f : 256.0f;
  constexpr bool QMV_FAST = (BITS == 4) && (FAST != 0);
  constexpr float QMV_HI_EXTRA = 0.26171875f;  // 0x4300 / 65536, see qmv_dot_word<4, 1>
  constexpr int OUTS = GLU ? RPW / 2 : RPW;    // output rows per block
  static_assert(BITS == 4 || BITS == 8, "qmv: BITS must be 4 or 8");
  static_assert(NW >= 1 && NW <= 32, "qmv: NW must be in 1..32");
  static_assert(RPW >= 1 && RPW <= QMV_NT, "qmv: RPW must be in 1..NW*32");
  static_assert(MB >= 1 && MB * RPW <= QMV_NT, "qmv: MB * RPW must be in 1..NW*32");
  static_assert(PRE >= 0 && PRE <= 2 && (RES == 0 || RES == 1), "qmv: PRE 0..2, RES 0/1");

  const int k_len = words_per_row * QMV_EPW;
  const int chunks_per_row = words_per_row / 4;
  const int chunks_per_group = (k_len / groups_per_row) / QMV_EPC;
  const int gshift = 31 - __clz(chunks_per_group);

  const int tid = threadIdx.x;
  const int m0 = blockIdx.y * MB;
  const int row0 = bx * OUTS;
  const uint32_t up = qmv_up(words_per_row);

  // Rows past the end are clamped for loading (always in bounds) and never stored. Row r reads
  // the up matrix where GLU says so (r is a constant of every unrolled loop: no select).
  size_t wbase[RPW];
  int gbase[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int i = row0 + r % OUTS;
    const int n = (i < n_rows) ? i : (n_rows - 1);
    wbase[r] = (size_t)n * (size_t)words_per_row;
    gbase[r] = n * groups_per_row;
  }
  auto w_of = [&](int r) { return (GLU && r >= OUTS) ? w_up : w; };
  auto scales_of = [&](int r) { return (GLU && r >= OUTS) ? scales_up : scales; };
  auto biases_of = [&](int r) { return (GLU && r >= OUTS) ? biases_up : biases; };

  // One step's weights (16 bytes of each row) and its rows' group scales and biases.
  // Scales and biases stay in T until used: converting them here would wait for their loads
  // before the RMSNorm pass.
  struct Step {
    uint4 wv[RPW];
    T sc[RPW];
    T bs[RPW];
  };
  auto load = [&](int c, Step& st) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      st.wv[r] = qmv_load_w<NOALLOC>(w_of(r) + wbase[r] + (size_t)c * 4);
    }
    const int g = c >> gshift;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      st.sc[r] = scales_of(r)[gbase[r] + g];
      st.bs[r] = biases_of(r)[gbase[r] + g];
    }
  };
  // With an RMSNorm in, the first step's loads go out before its pass over x, which they then
  // overlap (the pass reads x from L2 while the weights come from memory). Only there: the
  // held step costs registers (the 16-row silu-gate kernels would spill more).
  constexpr bool HOIST = PRE == 1;
  Step first;
  if (HOIST && tid < chunks_per_row) {
    load(tid, first);
  }
  if constexpr (PDL != 0) {
    if (!HOIST && tid < chunks_per_row) {
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        mlxcel_prefetch_l2(w_of(r) + wbase[r] + (size_t)tid * 4);
      }
    }
    mlxcel_follow_prior_grid();
  }

  // The block's activation rows; rows past M repeat the last one and are never stored.
  const T* xrows[MB];
  float inv_rms[MB];
#pragma unroll
  for (int b = 0; b < MB; ++b) {
    const int m = (m0 + b < m_rows) ? (m0 + b) : (m_rows - 1);
    xrows[b] = x + (size_t)m * (size_t)(PRE == 2 ? 2 * k_len : k_len);
    inv_rms[b] = (PRE == 1) ? qmv_inv_rms<NW>(xrows[b], k_len, eps) : 1.0f;
  }

  float acc[MB][RPW];
#pragma unroll
  for (int b = 0; b < MB; ++b) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      acc[b][r] = 0.0f;
    }
  }

  auto consume = [&](int c, const Step& st) {
    float d[MB][RPW];
    float xsum[MB];
    float xhi[MB];  // FAST: sum of the activations of elements 4..7 of every word
#pragma unroll
    for (int b = 0; b < MB; ++b) {
      xsum[b] = 0.0f;
      xhi[b] = 0.0f;
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        d[b][r] = 0.0f;
      }
    }
#pragma unroll
    for (int k = 0; k < 4 && MB == 1; ++k) {
      // One activation row: unpack and multiply in one pass (qmv_dot_word).
      float xf[QMV_EPW];
      qmv_input<PRE>(xrows[0], aux, c * QMV_EPC + k * QMV_EPW, k_len, inv_rms[0], xf);
      qmv_add_sums<QMV_FAST>(xf, xsum[0], xhi[0]);
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        d[0][r] = qmv_dot_word<BITS, FAST>(qmv_word(st.wv[r], k), xf, d[0][r], up);
      }
    }
#pragma unroll
    for (int k = 0; k < 4 && MB > 1; ++k) {
      // Each activation row's inputs once per word, then each weight word unpacked once and
      // used by every row (see qmv_unpack_word).
      float xf[MB][QMV_EPW];
#pragma unroll
      for (int b = 0; b < MB; ++b) {
        qmv_input<PRE>(xrows[b], aux, c * QMV_EPC + k * QMV_EPW, k_len, inv_rms[b], xf[b]);
        qmv_add_sums<QMV_FAST>(xf[b], xsum[b], xhi[b]);
      }
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        float q[QMV_EPW];
        qmv_unpack_word<BITS, FAST>(qmv_word(st.wv[r], k), q, up);
#pragma unroll
        for (int b = 0; b < MB; ++b) {
          d[b][r] = qmv_dot_unpacked<BITS, FAST>(q, xf[b], d[b][r]);
        }
      }
    }
    // d = sum (offset + q) x  ->  scale * (d - sum offset * x) + bias * xsum
#pragma unroll
    for (int b = 0; b < MB; ++b) {
      const float xoff =
          QMV_FAST ? fmaf(QMV_HI_EXTRA, xhi[b], QMV_OFF * xsum[b]) : QMV_OFF * xsum[b];
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        acc[b][r] = fmaf(qmv_to_float(st.sc[r]), d[b][r] - xoff,
                         fmaf(qmv_to_float(st.bs[r]), xsum[b], acc[b][r]));
      }
    }
  };

  int c0 = tid;
  if constexpr (HOIST) {
    if (c0 < chunks_per_row) {
      consume(c0, first);
    }
    c0 += QMV_NT;
  }
#pragma unroll 2
  for (int c = c0; c < chunks_per_row; c += QMV_NT) {
    // Every weight load of this step is issued first (RPW * 16 bytes in flight per thread);
    // each weight chunk is read once for all MB activation rows.
    Step st;
    load(c, st);
    consume(c, st);
  }
  qmv_finish<NW, RPW, MB, RES, GLU>(acc, res, out, n_rows, m_rows, row0, m0);
}
