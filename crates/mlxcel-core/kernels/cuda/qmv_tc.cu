// qmv_tc.cu: the decode step's one-row GEMV over 4-bit weights on tensor cores, `qmt<...>`
// (decode.cu's dec_qmt calls it; the entry points are generated in src/cuda_kernels.rs).
//
//   out[n] = sum_k in(x)[k] * (scale[n, k/gs] * q[n, k] + bias[n, k/gs])  (+ res[n])
//
// with in() = x (PRE 0) or w * rms_norm(x) (PRE 1), RES and GLU as qmv.cu's.
//
// Why: qmv.cu spends ~2.5 instructions per weight (unpack, float FMA) and ~3.8 with its
// per-block reductions; at HBM rates that is more than the SMs can issue (ncu: 59% of issue
// slots busy at 28% of DRAM bandwidth). Here a weight costs under one instruction of unpacking,
// and the multiply-adds run as mma.sync.m16n8k16 (one instruction per 256 weights).
//
// Layout. A warp's tile is 16 weight rows; lane (g, t) = (lane / 4, lane % 4) loads words 2t
// and 2t+1 of a 64-element span of rows g and g+8 (one 8-byte load each: the quad reads the
// span's 32 contiguous bytes of a row). Those 16 nibbles of a row feed four mmas. One LOP3
// turns the nibbles at bits 4p and 16+4p of a word (elements p and p+4) into T's (OFF + q)
// pair (bf16 0x4300 = 128, f16 0x6400 = 1024, ulp 1 there: exact). In mma j (0..3), word
// W = 2t + j/2 of the span and p = 2(j%2) give
//   A = {pair(row g, p), pair(row g+8, p), pair(row g, p+1), pair(row g+8, p+1)}
//   B = {(x[8W+p], x[8W+p+4]), (x[8W+p+1], x[8W+p+5])}
// i.e. the k slots 2t, 2t+1, 2t+8, 2t+9 of the fragment are elements 8W + {p, p+4, p+1, p+5}
// alike in A and B (a sum is order-free). Every B column is the same x, so each lane's
// accumulators hold the whole span's sums of rows g and g+8: no shuffles.
// A span lies within one quantization group (gs 64 or 128; gs 32 stays on qmv.cu), so per span
//   acc += scale * C + (bias - OFF * scale) * sum(x over the span)
// (C = sum (OFF + q) x, exact products, float32 sums).
//
// The block: NW warps on RT tiles (16*RT rows), splitting K by spans (warp w: spans w, w+NW, ..).
// First it prepares x once into shared memory, already in B's register order (PRE applied and
// rounded to T as qmv_input does), with each span's sum; its first weight loads are issued
// before that pass so they overlap it. Weights stream through a ring of D = 8/RT spans per lane
// held in registers: a span's slot is reloaded with the span D*NW ahead as soon as it is used.
// The warps' sums meet in shared memory. GLU 1: tile r's rows g are gate rows and rows g+8 the
// up rows of the same outputs (8*RT outputs per block).
//
// Arguments as qmv's (one activation row), plus the dynamic shared memory the launch must give:
// qmt_smem_bytes(K) = 2K + K/16 bytes (K <= 16384 keeps it under the 48 KB default).
// Launch: threadgroup (NW*32, 1, 1), grid (ceil(N / (16*RT)) blocks, or ceil(N / (8*RT)) for GLU).

// Two activations already rounded to T as one register of T pairs (lo in the low half).
__device__ __forceinline__ uint32_t qmt_pack(const mlxcel_bf16*, float lo, float hi) {
  return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xFFFF0000u);
}
__device__ __forceinline__ uint32_t qmt_pack(const mlxcel_f16*, float lo, float hi) {
  return (uint32_t)mlxcel_float_to_f16_bits(lo) | ((uint32_t)mlxcel_float_to_f16_bits(hi) << 16);
}

template <int NW, int RT, int PRE, int RES, int GLU, typename T>
__device__ __forceinline__ void qmt(const uint32_t* w, const T* scales, const T* biases,
                                    const T* x, const T* aux, const T* res, T* out, int n_rows,
                                    int words_per_row, int groups_per_row, float eps, int bx,
                                    const uint32_t* w_up = nullptr, const T* scales_up = nullptr,
                                    const T* biases_up = nullptr) {
  static_assert(NW >= 1 && NW <= 16, "qmt: NW in 1..16");
  static_assert(RT == 1 || RT == 2, "qmt: RT 1 or 2");
  static_assert(PRE == 0 || PRE == 1, "qmt: PRE 0 or 1");
  static_assert(GLU == 0 || RES == 0, "qmt: GLU has no residual");
  using Ops = qmm_ops<T>;
  constexpr int NT = NW * 32;
  constexpr int D = 8 / RT;                  // spans in flight per lane
  constexpr int OUTS = GLU ? 8 * RT : 16 * RT;  // outputs per block
  constexpr float OFF = Ops::OFF;

  extern __shared__ uint4 qmt_dyn[];
  __shared__ float qmt_red[NW][16 * RT];
  __shared__ float qmt_rows[16 * RT];

  const int k_len = words_per_row * 8;
  const int n_spans = k_len >> 6;
  uint32_t* xb = reinterpret_cast<uint32_t*>(qmt_dyn);  // [n_spans][4 lanes t][8 words]
  float* xs = reinterpret_cast<float*>(xb + n_spans * 32);  // [n_spans]
  const int gshift = (k_len / groups_per_row == 128) ? 1 : 0;  // spans per group: 1 or 2

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int row0 = bx * OUTS;

  // This lane's rows (clamped into the matrix; rows past N are never stored): A = row g of the
  // tile, B = row g + 8 (GLU: the up matrix's row of the same output).
  const uint32_t* wa[RT];
  const uint32_t* wb[RT];
  const T* sa[RT];
  const T* ba[RT];
  const T* sb[RT];
  const T* bb[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    int ia = GLU ? row0 + 8 * r + g : row0 + 16 * r + g;
    int ib = GLU ? ia : ia + 8;
    ia = ia < n_rows ? ia : n_rows - 1;
    ib = ib < n_rows ? ib : n_rows - 1;
    wa[r] = w + (size_t)ia * words_per_row + 2 * t;
    wb[r] = (GLU ? w_up : w) + (size_t)ib * words_per_row + 2 * t;
    sa[r] = scales + (size_t)ia * groups_per_row;
    ba[r] = biases + (size_t)ia * groups_per_row;
    sb[r] = (GLU ? scales_up : scales) + (size_t)ib * groups_per_row;
    bb[r] = (GLU ? biases_up : biases) + (size_t)ib * groups_per_row;
  }

  // The ring: slot i holds one span's words of rows A and B and their scale/bias bits.
  uint2 qa[D][RT], qb[D][RT];
  uint32_t sab[D][RT][4];
  auto load = [&](int i, int s) {
    if (s < n_spans) {
      const int grp = s >> gshift;
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        qa[i][r] = *reinterpret_cast<const uint2*>(wa[r] + s * 8);
        qb[i][r] = *reinterpret_cast<const uint2*>(wb[r] + s * 8);
        sab[i][r][0] = sa[r][grp].bits;
        sab[i][r][1] = ba[r][grp].bits;
        sab[i][r][2] = sb[r][grp].bits;
        sab[i][r][3] = bb[r][grp].bits;
      }
    }
  };
#pragma unroll
  for (int i = 0; i < D; ++i) {
    load(i, warp + i * NW);
  }

  // x into shared memory in B's order; unit u = 4s + t covers elements 16u .. 16u+15 (words
  // 2t, 2t+1 of span s), the 4 units of a span on adjacent lanes (NT is a multiple of 32).
  const float inv_rms = (PRE == 1) ? qmv_inv_rms<NW>(x, k_len, eps) : 1.0f;
  for (int base = warp * 32; base < n_spans * 4; base += NT) {
    const int u = base + lane;
    float sum = 0.0f;
    if (u < n_spans * 4) {
      float lo[8], hi[8];
      qmv_input<PRE>(x, aux, 16 * u, k_len, inv_rms, lo);
      qmv_input<PRE>(x, aux, 16 * u + 8, k_len, inv_rms, hi);
      uint4 v0, v1;
      v0.x = qmt_pack(x, lo[0], lo[4]);
      v0.y = qmt_pack(x, lo[1], lo[5]);
      v0.z = qmt_pack(x, lo[2], lo[6]);
      v0.w = qmt_pack(x, lo[3], lo[7]);
      v1.x = qmt_pack(x, hi[0], hi[4]);
      v1.y = qmt_pack(x, hi[1], hi[5]);
      v1.z = qmt_pack(x, hi[2], hi[6]);
      v1.w = qmt_pack(x, hi[3], hi[7]);
      uint4* dst = reinterpret_cast<uint4*>(xb + u * 8);
      dst[0] = v0;
      dst[1] = v1;
      sum = qmv_sum(lo) + qmv_sum(hi);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (u < n_spans * 4 && (u & 3) == 0) {
      xs[u >> 2] = sum;
    }
  }
  __syncthreads();

  float acc_a[RT], acc_b[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    acc_a[r] = 0.0f;
    acc_b[r] = 0.0f;
  }
  for (int base = warp; base < n_spans; base += NW * D) {
#pragma unroll
    for (int i = 0; i < D; ++i) {
      const int s = base + i * NW;
      if (s < n_spans) {
        const uint4* xp = reinterpret_cast<const uint4*>(xb + (s * 4 + t) * 8);
        const uint4 x0 = xp[0];
        const uint4 x1 = xp[1];
        const float xsum = xs[s];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          const uint32_t a0 = qa[i][r].x, a1 = qa[i][r].y;
          const uint32_t b0 = qb[i][r].x, b1 = qb[i][r].y;
          {
            const uint32_t f[4] = {Ops::pair(a0, 0), Ops::pair(b0, 0), Ops::pair(a0, 4),
                                   Ops::pair(b0, 4)};
            Ops::mma(c, f, x0.x, x0.y);
          }
          {
            const uint32_t f[4] = {Ops::pair(a0, 8), Ops::pair(b0, 8), Ops::pair(a0, 12),
                                   Ops::pair(b0, 12)};
            Ops::mma(c, f, x0.z, x0.w);
          }
          {
            const uint32_t f[4] = {Ops::pair(a1, 0), Ops::pair(b1, 0), Ops::pair(a1, 4),
                                   Ops::pair(b1, 4)};
            Ops::mma(c, f, x1.x, x1.y);
          }
          {
            const uint32_t f[4] = {Ops::pair(a1, 8), Ops::pair(b1, 8), Ops::pair(a1, 12),
                                   Ops::pair(b1, 12)};
            Ops::mma(c, f, x1.z, x1.w);
          }
          const float s_a = qmm_to_float<T>(sab[i][r][0]);
          const float s_b = qmm_to_float<T>(sab[i][r][2]);
          const float z_a = fmaf(-OFF, s_a, qmm_to_float<T>(sab[i][r][1]));
          const float z_b = fmaf(-OFF, s_b, qmm_to_float<T>(sab[i][r][3]));
          acc_a[r] = fmaf(s_a, c[0], fmaf(z_a, xsum, acc_a[r]));
          acc_b[r] = fmaf(s_b, c[2], fmaf(z_b, xsum, acc_b[r]));
        }
      }
      load(i, s + NW * D);
    }
  }

  if (t == 0) {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      qmt_red[warp][16 * r + g] = acc_a[r];
      qmt_red[warp][16 * r + g + 8] = acc_b[r];
    }
  }
  __syncthreads();
  float total = 0.0f;
  if (tid < 16 * RT) {
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      total += qmt_red[i][tid];
    }
  }
  if constexpr (GLU != 0) {
    // The gate|up outputs rounded to T (MLX stores the product), then silu(gate) * up.
    if (tid < 16 * RT) {
      qmt_rows[tid] = qmv_round(out, total);
    }
    __syncthreads();
    const int o = row0 + tid;  // tile tid / 8, output tid % 8 of it
    if (tid < 8 * RT && o < n_rows) {
      const int at = 16 * (tid >> 3) + (tid & 7);
      qmv_store(out + o, qmv_silu_gate(out, qmt_rows[at], qmt_rows[at + 8]));
    }
  } else {
    const int n = row0 + tid;  // tile tid / 16, row tid % 16 of it
    if (tid < 16 * RT && n < n_rows) {
      if constexpr (RES == 1) {
        total = qmv_round(out, total) + qmv_to_float(res[n]);
      }
      qmv_store(out + n, total);
    }
  }
}
