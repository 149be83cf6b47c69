// qmv.cu: mlxcel's decode GEMV, `qmv<...>`, called by the `extern "C"` entry points
// crates/mlxcel-core/src/cuda_kernels.rs generates (helpers: qmv_header.cuh).
//
//   out[m, n] = sum_k x[m, k] * (scale[n, k/gs] * q[n, k] + bias[n, k/gs])
//
// Arguments, in this order:
//   w      uint32 [N, K*BITS/32]  MLX affine packing, element j of a word at bits BITS*j..
//   scales T      [N, K/gs]
//   biases T      [N, K/gs]
//   x      T      [M, K]          (row-contiguous; M = rows of activations, 1 for decode)
//   out    T      [M, N]          (any shape with M*N elements; dtype = x's dtype)
//   n_rows, words_per_row, groups_per_row: N, K*BITS/32 and K/gs
// Integer template args: BITS (4 or 8), NW (warps per block), RPW (output rows per block),
//   NOALLOC (1: weights read with ld.global.nc.L1::no_allocate, 0: plain ld.global.nc),
//   FAST (4 bits only; 1: two elements per LOP3 with a ~2e-5 relative perturbation, see
//   qmv_header.cuh; use 0 for float32 outputs or when bit-faithful float math is wanted).
// Launch: threadgroup (NW*32, 1, 1), grid (ceil(N/RPW) * NW*32, M, 1)  (grid is in threads).
// N, K and the group size are arguments, so one compiled kernel serves every matrix of a model; gs must be a power of two >= 32 (MLX: 32, 64,
// 128). K must be a multiple of 32 and x 16-byte aligned (true for MLX-allocated rows).
//
// Work split: a block owns RPW consecutive output rows; its NW*32 threads stride along K in
// 16-byte chunks of packed weights (32 elements at 4 bits), so each warp reads 512 contiguous
// bytes of every row per step. A chunk never straddles a quantization group. Each thread
// converts its x chunk to float once and reuses it for all RPW rows; partial sums are reduced
// with warp shuffles and then across warps through a tiny shared array. No atomics.

template <int BITS, int NW, int RPW, int NOALLOC, int FAST, typename T>
__device__ __forceinline__ void qmv(const uint32_t* w, const T* scales, const T* biases,
                                    const T* x, T* out, int n_rows, int words_per_row,
                                    int groups_per_row) {
  constexpr int QMV_EPW = 32 / BITS;     // elements per uint32
  constexpr int QMV_EPC = 4 * QMV_EPW;   // elements per 16-byte chunk
  constexpr int QMV_NT = NW * 32;        // threads per block
  constexpr float QMV_OFF = (BITS == 4) ? 128.0f : 256.0f;
  constexpr bool QMV_FAST = (BITS == 4) && (FAST != 0);
  constexpr float QMV_HI_EXTRA = 0.26171875f;  // 0x4300 / 65536, see qmv_dot_word<4, 1>
  static_assert(BITS == 4 || BITS == 8, "qmv: BITS must be 4 or 8");
  static_assert(NW >= 1 && NW <= 32, "qmv: NW must be in 1..32");
  static_assert(RPW >= 1 && RPW <= QMV_NT, "qmv: RPW must be in 1..NW*32");

  const int k_len = words_per_row * QMV_EPW;
  const int chunks_per_row = words_per_row / 4;
  const int chunks_per_group = (k_len / groups_per_row) / QMV_EPC;
  const int gshift = 31 - __clz(chunks_per_group);

  const int tid = threadIdx.x;
  const int m = blockIdx.y;
  const int row0 = blockIdx.x * RPW;

  // Rows past the end are clamped for loading (always in bounds) and never stored.
  size_t wbase[RPW];
  int gbase[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int n = (row0 + r < n_rows) ? (row0 + r) : (n_rows - 1);
    wbase[r] = (size_t)n * (size_t)words_per_row;
    gbase[r] = n * groups_per_row;
  }
  const auto* xrow = x + (size_t)m * (size_t)k_len;

  float acc[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    acc[r] = 0.0f;
  }

#pragma unroll 2
  for (int c = tid; c < chunks_per_row; c += QMV_NT) {
    // Issue every weight load of this step first (RPW * 16 bytes in flight per thread).
    uint4 wv[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      wv[r] = qmv_load_w<NOALLOC>(w + wbase[r] + (size_t)c * 4);
    }
    const int g = c >> gshift;
    float sc[RPW];
    float bs[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      sc[r] = qmv_to_float(scales[gbase[r] + g]);
      bs[r] = qmv_to_float(biases[gbase[r] + g]);
    }

    float d[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      d[r] = 0.0f;
    }
    float xsum = 0.0f;
    float xhi = 0.0f;  // FAST: sum of the activations of elements 4..7 of every word
    const auto* xc = xrow + (size_t)c * QMV_EPC;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float xf[QMV_EPW];
      qmv_load_x(xc + k * QMV_EPW, xf);
      qmv_add_sums<QMV_FAST>(xf, xsum, xhi);
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        d[r] = qmv_dot_word<BITS, FAST>(qmv_word(wv[r], k), xf, d[r]);
      }
    }
    // d = sum (offset + q) x  ->  scale * (d - sum offset * x) + bias * xsum
    const float xoff = QMV_FAST ? fmaf(QMV_HI_EXTRA, xhi, QMV_OFF * xsum) : QMV_OFF * xsum;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      acc[r] = fmaf(sc[r], d[r] - xoff, fmaf(bs[r], xsum, acc[r]));
    }
  }

#pragma unroll
  for (int r = 0; r < RPW; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    }
  }

  __shared__ float qmv_red[NW][RPW];
  const int lane = tid & 31;
  const int warp = tid >> 5;
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      qmv_red[warp][r] = acc[r];
    }
  }
  __syncthreads();
  if (tid < RPW) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      s += qmv_red[i][tid];
    }
    const int n = row0 + tid;
    if (n < n_rows) {
      qmv_store(out + (size_t)m * (size_t)n_rows + n, s);
    }
  }
}
