// qmv_mma.cu: the decode GEMV over a batch of 2..16 activation rows (concurrent decode steps)
// on tensor cores, `qmv_mma<...>`, called by the `extern "C"` entry points
// crates/mlxcel-core/src/cuda_kernels.rs generates (helpers: qmv_header.cuh).
//
//   out[m, n] = sum_k x[m, k] * (scale[n, k/gs] * q[n, k] + bias[n, k/gs])  (+ res[m, n])
//
// for 4-bit MLX affine weights and T = bf16 or f16. Each weight is read once for all rows (the
// many-row variant of qmv.cu does float FMAs per row, which measured slower than re-reading
// the weights per row); the multiply-adds run as mma.sync.m16n8k16 with float32 accumulation.
//
// Exactness: the weights are not dequantized to T (that would round scale * q + bias). The
// mma's A operand holds the integer codes q (0..15, exact in bf16/f16), B the activations as
// they are, so the mma accumulates sum_{k in group} q * x in float32 (products exact); per
// group the block then adds scale * that + bias * sum_{k in group} x, where the activation sum
// comes from a second mma whose A is all ones (also exact products, float32 sums).
//
// Arguments, in this order:
//   w      uint32 [N, K/8]   MLX affine packing, element j of a word at bits 4j..4j+3
//   scales T      [N, K/gs]
//   biases T      [N, K/gs]
//   x      T      [M, K]     (row-contiguous, 16-byte aligned rows)
//   res    T      [M, N]     (RES 1; else unused)
//   out    T      [M, N]
//   n_rows, words_per_row, groups_per_row, m_rows: N, K/8, K/gs and M (1..8*NT)
// Template args: NW (warps per block), RT (16-row tiles of output features per block), NT
//   (8-row tiles of activation rows: 1 for M <= 8, 2 for M <= 16), RES, T. NW * RT <= 8 keeps
//   the static shared memory (NW * RT KB per stage, plus the reduction) under 48 KB.
// Launch: threadgroup (NW*32, 1, 1), grid (ceil(N / (16*RT)) * NW*32, 1, 1) (grid in threads).
// Limits: gs 32, 64 or 128; K a multiple of gs (and of 32).
//
// Work split: a block owns 16*RT consecutive output features; its NW warps split K in steps
// of 128 elements (4 chunks of 32, each chunk one 16-byte run per weight row), warp w taking
// steps w, w+NW, ... Each warp streams its weight tiles global -> shared with cp.async through
// a ring of QMM_STAGES stages (16*RT rows x 64 bytes each, XOR-swizzled so ldmatrix reads are
// free of bank conflicts) and loads its activations straight into registers one step ahead
// (L2-resident: every block reads them). One ldmatrix.x4 gives a lane, for a 16-row tile and
// two chunks, word t of rows g and g+8 (lane = 4g + t), i.e. 8 elements of each row.
//
// Element permutation inside a chunk (the sum over a group is order-free, so any permutation
// applied alike to A and B is exact): lane (g, t) holds word t of the chunk, elements 8t..8t+7.
// (w >> s) & 0x000F000F puts elements s/4 and s/4+4 in the two halves of a register, so
//   mma 1 takes  A = {e0,e4 | e1,e5} (a0/a1 rows g/g+8, a2/a3 rows g/g+8)   B = {x0,x4 | x1,x5}
//   mma 2 takes  A = {e2,e6 | e3,e7}                                       B = {x2,x6 | x3,x7}
// (the logical k columns 2t, 2t+1, 2t+8, 2t+9 of the fragment layout are elements 8t + {0, 4,
// 1, 5} in mma 1 and 8t + {2, 6, 3, 7} in mma 2; B's pairs come from one 16-byte load of x and
// two PRMTs per register). A chunk never straddles a group (gs >= 32), so neither does an mma.
// Each nibble pair becomes T's (OFF + q) by one LOP3 under a fixed exponent (bf16 0x4300 =
// 128, f16 0x6400 = 1024, both with ulp 1 there), and one packed FMA (v * 1 - OFF) makes it
// exactly q.
//
// mma columns are activation rows m: lane (g, t) reads x row g (+8 for the second n-tile) and
// its accumulators hold rows m = 2t, 2t+1 of output features g and g+8 — exactly the columns
// of the all-ones mma's result it holds, so the per-group fold needs no data exchange. Rows
// m >= M read row M-1 (in bounds) and are never stored; features n >= N read row N-1.
// Scales and biases are loaded a step ahead as raw bits, lane t of a row taking group t of
// the step (at most 4), and handed to its row's other lanes by a shuffle at the group's fold.
// The warps' partial sums meet in shared memory; the block stores out[m, n] row-major.

#define QMM_STAGES 4
#define QMM_CHUNKS 4  // 32-element chunks per step (128 elements: a multiple of every gs)

__device__ __forceinline__ void qmm_ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

__device__ __forceinline__ uint32_t qmm_prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ uint4 qmm_zero4() {
  uint4 z;
  z.x = z.y = z.z = z.w = 0u;
  return z;
}

// One block's product: output features n0 .. n0 + 16*RT - 1 of one matrix against activation
// rows m_begin .. m_end - 1 (at most 8*NT of them; row m of x and of out/res), stored into
// out[m, n] (row-major [.., n_rows]). The block's shared memory is free again when it returns,
// so a block may call it several times (qmm_gather: one call per expert of its rows).
template <int NW, int RT, int NT, int RES, typename T>
__device__ __forceinline__ void qmm_tile(const uint32_t* w, const T* scales, const T* biases,
                                         const T* x, const T* res, T* out, int n_rows,
                                         int words_per_row, int groups_per_row, int n0,
                                         int m_begin, int m_end) {
  static_assert(NW >= 1 && NW <= 8, "qmv_mma: NW in 1..8");
  static_assert(RT == 1 || RT == 2 || RT == 4, "qmv_mma: RT 1, 2 or 4");
  static_assert(NT == 1 || NT == 2, "qmv_mma: NT 1 or 2");
  using Ops = qmm_ops<T>;
  constexpr int ROWS = 16 * RT;                       // output features per block
  constexpr int ROW_BYTES = QMM_CHUNKS * 16;          // one step of one weight row
  constexpr int STAGE_BYTES = ROWS * ROW_BYTES;       // one step of the block's rows
  constexpr int COPIES = ROWS * QMM_CHUNKS / 32;      // 16-byte copies per lane per step
  constexpr int MCOLS = 8 * NT;                       // activation rows per block (padded)
  static_assert(COPIES * 32 == ROWS * QMM_CHUNKS, "qmv_mma: whole copies per lane");

  __shared__ alignas(128) unsigned char qmm_w[NW][QMM_STAGES][STAGE_BYTES];
  // Padded by one column against bank conflicts.
  __shared__ float qmm_red[NW][ROWS][MCOLS + 1];
  static_assert(sizeof(qmm_w) + sizeof(qmm_red) <= 48 * 1024, "qmv_mma: static shared memory");

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int k_len = words_per_row * 8;
  const int chunks_per_row = words_per_row / 4;
  const int steps = (chunks_per_row + QMM_CHUNKS - 1) / QMM_CHUNKS;
  const int gs = k_len / groups_per_row;
  const int chunks_per_group = gs / 32;  // 1, 2 or 4: divides QMM_CHUNKS

  // This lane's copies: row idx >> 2, chunk idx & 3 of each step (4 lanes cover a row's 64
  // contiguous bytes), rows past N clamped; the chunk's slot is swizzled by the row.
  const uint32_t* csrc[COPIES];
  uint32_t cdst[COPIES];
  int cchunk[COPIES];
  const uint32_t wbase = mlxcel_smem_addr(&qmm_w[warp][0][0]);
#pragma unroll
  for (int i = 0; i < COPIES; ++i) {
    const int idx = i * 32 + lane;
    const int row = idx >> 2, ch = idx & 3;
    const int n = (n0 + row < n_rows) ? (n0 + row) : (n_rows - 1);
    csrc[i] = w + (size_t)n * (size_t)words_per_row;  // + the chunk's words at issue
    cchunk[i] = ch;
    cdst[i] = row * ROW_BYTES + ((ch ^ ((row >> 1) & 3)) * 16);
  }
  // This lane's ldmatrix rows: matrix i = lane >> 3 (rows lo/hi of a tile, chunk +0/+1).
  const int lm_row = ((lane >> 3) & 1) * 8 + (lane & 7);
  const int lm_chunk = lane >> 4;

  // This lane's activation rows (B columns g and g + 8), clamped into the block's rows.
  const T* xrow[NT];
#pragma unroll
  for (int h = 0; h < NT; ++h) {
    const int m = (m_begin + g + 8 * h < m_end) ? (m_begin + g + 8 * h) : (m_end - 1);
    xrow[h] = x + (size_t)m * (size_t)k_len + 8 * t;
  }

  // Issue step s of this warp into stage `stage` (or an empty group past the end).
  auto issue = [&](int s, int stage) {
    if (s < steps) {
#pragma unroll
      for (int i = 0; i < COPIES; ++i) {
        const int c = s * QMM_CHUNKS + cchunk[i];
        const bool valid = c < chunks_per_row;
        mlxcel_cp_async16(wbase + stage * STAGE_BYTES + cdst[i], csrc[i] + (valid ? c * 4 : 0),
                          valid);
      }
    }
    mlxcel_cp_commit();
  };
  // The raw scale and bias bits of step s's groups for features g and g+8 of each row tile:
  // lane t holds group min(t, groups in the step - 1) of the step (a step starts a group: gs
  // divides 128), handed to the other lanes of its row by a shuffle at the fold. The loads are
  // issued a step ahead; the bits are converted only when used.
  auto load_sb = [&](int s, uint32_t (&sb)[RT][4]) {
    const int first = s * (QMM_CHUNKS / chunks_per_group);
    const int in_step = QMM_CHUNKS / chunks_per_group;
    int grp = first + (t < in_step ? t : in_step - 1);
    grp = grp < groups_per_row ? grp : groups_per_row - 1;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const int nl = n0 + r * 16 + g;
      const int na = (nl < n_rows) ? nl : (n_rows - 1);
      const int nb = (nl + 8 < n_rows) ? (nl + 8) : (n_rows - 1);
      const size_t ia = (size_t)na * groups_per_row + grp;
      const size_t ib = (size_t)nb * groups_per_row + grp;
      sb[r][0] = scales[ia].bits;
      sb[r][1] = biases[ia].bits;
      sb[r][2] = scales[ib].bits;
      sb[r][3] = biases[ib].bits;
    }
  };
  // The activations of step s (zeros past K).
  auto load_x = [&](int s, uint4 (&xv)[QMM_CHUNKS][NT]) {
#pragma unroll
    for (int c = 0; c < QMM_CHUNKS; ++c) {
      const int chunk = s * QMM_CHUNKS + c;
#pragma unroll
      for (int h = 0; h < NT; ++h) {
        const uint32_t* p = reinterpret_cast<const uint32_t*>(xrow[h] + chunk * 32);
        xv[c][h] = (s < steps && chunk < chunks_per_row) ? qmv_load_w<0>(p) : qmm_zero4();
      }
    }
  };

  float acc[RT][NT][4];
  float cq[RT][NT][4];  // sum q * x over the current group
  float cs[NT][4];      // sum x over the current group (columns 2t, 2t+1 in [0], [1])
#pragma unroll
  for (int h = 0; h < NT; ++h) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      cs[h][i] = 0.0f;
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        acc[r][h][i] = 0.0f;
        cq[r][h][i] = 0.0f;
      }
    }
  }
  const uint32_t ones[4] = {Ops::ONES, Ops::ONES, Ops::ONES, Ops::ONES};

  // Prologue: the first QMM_STAGES - 1 steps in flight.
#pragma unroll
  for (int p = 0; p < QMM_STAGES - 1; ++p) {
    issue(warp + p * NW, p);
  }
  uint4 xv[QMM_CHUNKS][NT];
  load_x(warp, xv);
  uint32_t sbv[RT][4];
  load_sb(warp, sbv);

  for (int i = 0, s = warp; s < steps; ++i, s += NW) {
    issue(s + (QMM_STAGES - 1) * NW, (i + QMM_STAGES - 1) % QMM_STAGES);
    uint4 xn[QMM_CHUNKS][NT];
    load_x(s + NW, xn);
    uint32_t sbn[RT][4];
    load_sb(s + NW, sbn);
    mlxcel_cp_wait<QMM_STAGES - 1>();
    __syncwarp();
    const uint32_t stage = wbase + (i % QMM_STAGES) * STAGE_BYTES;
#pragma unroll
    for (int pair = 0; pair < QMM_CHUNKS / 2; ++pair) {
      // Words t of rows g, g+8 of chunks 2*pair, 2*pair+1, for every row tile.
      uint32_t wr[RT][4];
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const int row = r * 16 + lm_row;
        const int ch = 2 * pair + lm_chunk;
        qmm_ldmatrix_x4(stage + row * ROW_BYTES + ((ch ^ ((row >> 1) & 3)) * 16), wr[r]);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int c = 2 * pair + half;
        const int chunk = s * QMM_CHUNKS + c;
        if (chunk >= chunks_per_row) {
          break;  // warp-uniform: the rest of the step is past K
        }
        uint32_t b[NT][4];
#pragma unroll
        for (int h = 0; h < NT; ++h) {
          const uint4 v = xv[c][h];
          b[h][0] = qmm_prmt(v.x, v.z, 0x5410u);  // x0, x4
          b[h][1] = qmm_prmt(v.x, v.z, 0x7632u);  // x1, x5
          b[h][2] = qmm_prmt(v.y, v.w, 0x5410u);  // x2, x6
          b[h][3] = qmm_prmt(v.y, v.w, 0x7632u);  // x3, x7
          Ops::mma(cs[h], ones, b[h][0], b[h][1]);
          Ops::mma(cs[h], ones, b[h][2], b[h][3]);
        }
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const uint32_t lo = wr[r][2 * half], hi = wr[r][2 * half + 1];
          const uint32_t a1[4] = {Ops::codes(lo, 0), Ops::codes(hi, 0), Ops::codes(lo, 4),
                                  Ops::codes(hi, 4)};
          const uint32_t a2[4] = {Ops::codes(lo, 8), Ops::codes(hi, 8), Ops::codes(lo, 12),
                                  Ops::codes(hi, 12)};
#pragma unroll
          for (int h = 0; h < NT; ++h) {
            Ops::mma(cq[r][h], a1, b[h][0], b[h][1]);
            Ops::mma(cq[r][h], a2, b[h][2], b[h][3]);
          }
        }
        if ((chunk + 1) % chunks_per_group == 0) {
          // The group ends: fold its scale and bias in, per output feature g, g+8 of a tile
          // (warp-uniform: every lane shuffles).
          const int from = (lane & ~3) | (c / chunks_per_group);
#pragma unroll
          for (int r = 0; r < RT; ++r) {
            const float sa = qmm_to_float<T>(__shfl_sync(0xffffffffu, sbv[r][0], from));
            const float ba = qmm_to_float<T>(__shfl_sync(0xffffffffu, sbv[r][1], from));
            const float sb = qmm_to_float<T>(__shfl_sync(0xffffffffu, sbv[r][2], from));
            const float bb = qmm_to_float<T>(__shfl_sync(0xffffffffu, sbv[r][3], from));
#pragma unroll
            for (int h = 0; h < NT; ++h) {
              acc[r][h][0] = fmaf(sa, cq[r][h][0], fmaf(ba, cs[h][0], acc[r][h][0]));
              acc[r][h][1] = fmaf(sa, cq[r][h][1], fmaf(ba, cs[h][1], acc[r][h][1]));
              acc[r][h][2] = fmaf(sb, cq[r][h][2], fmaf(bb, cs[h][0], acc[r][h][2]));
              acc[r][h][3] = fmaf(sb, cq[r][h][3], fmaf(bb, cs[h][1], acc[r][h][3]));
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                cq[r][h][e] = 0.0f;
              }
            }
          }
#pragma unroll
          for (int h = 0; h < NT; ++h) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              cs[h][e] = 0.0f;
            }
          }
        }
      }
    }
    // Every lane has read this stage before a later issue overwrites it.
    __syncwarp();
#pragma unroll
    for (int c = 0; c < QMM_CHUNKS; ++c) {
#pragma unroll
      for (int h = 0; h < NT; ++h) {
        xv[c][h] = xn[c][h];
      }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sbv[r][e] = sbn[r][e];
      }
    }
  }
  mlxcel_cp_wait<0>();

  // Accumulator e of tile (r, h): feature r*16 + g (+8 for e >= 2), activation row
  // h*8 + 2t + (e & 1).
#pragma unroll
  for (int r = 0; r < RT; ++r) {
#pragma unroll
    for (int h = 0; h < NT; ++h) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        qmm_red[warp][r * 16 + g + (e >> 1) * 8][h * 8 + 2 * t + (e & 1)] = acc[r][h][e];
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < ROWS * MCOLS; e += NW * 32) {
    const int j = e / ROWS;  // the block's activation column
    const int m = m_begin + j;
    const int nl = e % ROWS;
    const int n = n0 + nl;
    if (m < m_end && n < n_rows) {
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < NW; ++i) {
        s += qmm_red[i][nl][j];
      }
      const size_t at = (size_t)m * (size_t)n_rows + n;
      if constexpr (RES == 1) {
        // MLX rounds the product, then the sum.
        s = qmv_round(out, s) + qmv_to_float(res[at]);
      }
      qmv_store(out + at, s);
    }
  }
  // Every thread has read the partial sums before a next call overwrites them.
  __syncthreads();
}

// The decode-batch GEMV: block blockIdx.x takes output features 16*RT*blockIdx.x.. against
// all m_rows (<= 8*NT) activation rows.
template <int NW, int RT, int NT, int RES, typename T>
__device__ __forceinline__ void qmv_mma(const uint32_t* w, const T* scales, const T* biases,
                                        const T* x, const T* res, T* out, int n_rows,
                                        int words_per_row, int groups_per_row, int m_rows) {
  qmm_tile<NW, RT, NT, RES, T>(w, scales, biases, x, res, out, n_rows, words_per_row,
                               groups_per_row, blockIdx.x * 16 * RT, 0, m_rows);
}

// ---- the routed-expert product over rows sorted by expert (MoE prefill) ----------------------
//
//   out[m, n] = sum_k x[m, k] * (scale[e, n, k/gs] * q[e, n, k] + bias[e, n, k/gs]),  e = ids[m]
//
// for a stack of E 4-bit matrices w [E, N, K/8] (scales/biases [E, N, K/gs]) and M activation
// rows whose expert ids are non-decreasing (mlxcel_arch's SwitchGlu sorts its (token, expert)
// pairs): each expert's rows are contiguous, so a block of 16 rows meets one expert, or a few
// at its boundaries, and reads each of their weights once for all its rows of that expert
// (MLX's gathered matmul re-reads them per row, or the prefill dequantized the whole stack).
// Ids at or past E are clamped to E - 1 (defined memory; callers pass a router's ids).
// Launch: threadgroup (NW*32, 1, 1), grid (ceil(M / 16) * NW*32, ceil(N / (16*RT)), 1) (in
// threads): blockIdx.x the 16-row tile of M, blockIdx.y the 16*RT-feature tile of N, so the
// blocks running together share features and stream the rows.
template <int NW, int RT, typename T>
__device__ __forceinline__ void qmm_gather(const uint32_t* w, const T* scales, const T* biases,
                                           const T* x, const uint32_t* ids, T* out, int n_rows,
                                           int words_per_row, int groups_per_row, int m_rows,
                                           int experts) {
  constexpr int MT = 16;  // rows per block: NT = 2 activation tiles
  const int m_tile = blockIdx.x * MT;
  const int m_last = (m_tile + MT < m_rows) ? (m_tile + MT) : m_rows;
  const int n0 = blockIdx.y * 16 * RT;
  const size_t w_stride = (size_t)n_rows * (size_t)words_per_row;
  const size_t g_stride = (size_t)n_rows * (size_t)groups_per_row;
  // The tile's runs of equal ids, in order (every thread walks the same ids: uniform).
  for (int m = m_tile; m < m_last;) {
    const uint32_t id = ids[m];
    int end = m + 1;
    while (end < m_last && ids[end] == id) {
      ++end;
    }
    const size_t e = id < (uint32_t)experts ? id : (uint32_t)(experts - 1);
    qmm_tile<NW, RT, 2, 0, T>(w + e * w_stride, scales + e * g_stride, biases + e * g_stride, x,
                              nullptr, out, n_rows, words_per_row, groups_per_row, n0, m, end);
    m = end;
  }
}
