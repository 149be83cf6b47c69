// decode_gemv.cu: the decode step's opt-in GEMV parts, in its module only when the policy asks
// for them (so the default module, and its shipped cubins, do not change): the streaming GEMV
// (`MLXCEL_CUDA_DECODE_GEMV`'s `s` shapes) and the L2 warming before attention
// (`MLXCEL_CUDA_DECODE_WARM`, at the end).
//
// The streaming GEMV is dec_qmv's product (same arguments, same folds, same float math per
// 16-byte chunk) with its blocks kept busy from the first byte to the last.
//
// dec_qmv gives each block one tile of RPW rows: the block normalises x, loads its rows once,
// reduces and exits, so most of its life is a chain of latencies (the RMSNorm pass over x, the
// loads, the block reduction) and the grid ends in a ragged wave (session 27's ncu: the q|k|v
// GEMV streams at 0.88 TB/s, gate|up at 1.5 of the H100's 2.9). Here the grid is what the GPU
// holds at once (the host launches min(tiles, resident blocks)) and each block walks tiles
// t = blockIdx.x, + gridDim.x, ...:
// - x is prepared once per block (PRE 1's RMSNorm and weight, rounded to T as dec_qmv does)
//   into shared memory, with each 16-byte chunk's sums (the FAST offset's xsum and xhi), so a
//   tile costs only its weights' loads and multiply-adds;
// - the weights of the next step (a tile's next chunk, or the next tile's first) are loaded
//   before this step's multiply-adds and reduction, so the loads of a block never stop;
// - a tile's RPW partial sums meet in a warp by a butterfly that halves the rows at each level
//   (log2(RPW) + 5 - log2(RPW) levels, RPW - 1 + 5 - log2(RPW) shuffles instead of 5 RPW),
//   then across warps through shared memory double-buffered by tile parity (one barrier a
//   tile).
// Dynamic shared memory: K * sizeof(T) bytes of prepared activations, laid out quad-major
// ([EPC / 8][chunks] uint4, so a warp's loads hit consecutive banks), then a float2 per chunk.
// RPW must be a power of two up to 32 (warp 0's lanes finish the tile).

// The dynamic shared memory a streaming GEMV over rows of `k_len` activations takes.
// (Host mirror: `stream_shared_bytes` in cpp/cuda_decode.cc.)
extern __shared__ uint4 dec_qmvs_dyn[];

// A T value rounded to T already, packed with its neighbour as T bits (low, high).
__device__ __forceinline__ uint32_t dec_pack2(const mlxcel_bf16*, float lo, float hi) {
  return (__float_as_uint(hi) & 0xFFFF0000u) | (__float_as_uint(lo) >> 16);
}
__device__ __forceinline__ uint32_t dec_pack2(const mlxcel_f16*, float lo, float hi) {
  return uint32_t(mlxcel_float_to_f16_bits(lo)) | (uint32_t(mlxcel_float_to_f16_bits(hi)) << 16);
}

template <int BITS, int NW, int RPW, int PRE, int RES, int GLU, typename T>
__device__ __forceinline__ void dec_qmvs(const uint32_t* w0, const T* s0, const T* z0, T* o0,
                                         int n0, const uint32_t* w1, const T* s1, const T* z1,
                                         T* o1, int n1, const uint32_t* w2, const T* s2,
                                         const T* z2, T* o2, int n2, const T* x, const T* aux,
                                         const T* res, int words_per_row, int groups_per_row,
                                         float eps) {
  constexpr int EPW = 32 / BITS;  // elements per weight word
  constexpr int EPC = 4 * EPW;    // elements per 16-byte chunk of a row
  constexpr int XQ = EPC / 8;     // 16-byte quads of activations per chunk
  constexpr int WPQ = 4 / XQ;     // weight words per quad of activations
  constexpr int NT = NW * 32;
  constexpr bool FAST = BITS == 4;
  constexpr float OFF = (BITS == 4) ? 128.0f : 256.0f;
  constexpr float HI_EXTRA = 0.26171875f;  // qmv_dot_word<4, 1>'s constant
  constexpr int OUTS = GLU ? RPW / 2 : RPW;
  constexpr int LOG = RPW == 1 ? 0 : RPW == 2 ? 1 : RPW == 4 ? 2 : RPW == 8 ? 3 : RPW == 16 ? 4 : 5;
  static_assert(BITS == 4 || BITS == 8, "dec_qmvs: 4 or 8 bits");
  static_assert((1 << LOG) == RPW && RPW <= 32, "dec_qmvs: RPW a power of two up to 32");
  static_assert(GLU == 0 || (RES == 0 && RPW >= 2), "dec_qmvs: GLU takes pairs of rows");
  static_assert(sizeof(T) == 2, "dec_qmvs: bf16 or f16 activations");

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int k_len = words_per_row * EPW;
  const int cpr = words_per_row / 4;  // 16-byte chunks per row
  const int gshift = 31 - __clz((k_len / groups_per_row) / EPC);
  const int steps = (cpr + NT - 1) / NT;  // a thread's chunks per tile
  uint4* sx = dec_qmvs_dyn;
  float2* sums = reinterpret_cast<float2*>(dec_qmvs_dyn + XQ * cpr);

  // Tiles: those of segment 0, then 1, then 2 (GLU: segment 0's outputs, gate and up rows).
  const int b0 = (n0 + OUTS - 1) / OUTS;
  const int b1 = GLU ? 0 : (n1 + RPW - 1) / RPW;
  const int b2 = GLU ? 0 : (n2 + RPW - 1) / RPW;
  const int tiles = b0 + b1 + b2;
  struct Tile {
    const uint32_t* w;
    const T* sc;
    const T* z;
    T* o;
    int n, row0;
  };
  auto tile_of = [&](int t) -> Tile {
    if (t < b0) {
      return Tile{w0, s0, z0, o0, n0, t * OUTS};
    }
    if (t < b0 + b1) {
      return Tile{w1, s1, z1, o1, n1, (t - b0) * RPW};
    }
    return Tile{w2, s2, z2, o2, n2, (t - b0 - b1) * RPW};
  };

  // One step: this thread's 16-byte chunk of each of the tile's rows, and their groups'
  // scales and biases (kept in T until used).
  struct Step {
    uint4 wv[RPW];
    T sc[RPW];
    T bs[RPW];
  };
  auto load = [&](int t, int s, Step& st) {
    const int c = tid + s * NT;
    if (c >= cpr) {
      return;
    }
    const Tile tl = tile_of(t);
    const int g = c >> gshift;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const bool up = GLU && r >= OUTS;
      const int i = tl.row0 + r % OUTS;
      const int n = i < tl.n ? i : tl.n - 1;  // rows past the end: loaded, never stored
      const uint32_t* w = up ? w1 : tl.w;
      st.wv[r] = qmv_load_w<1>(w + (size_t)n * (size_t)words_per_row + (size_t)c * 4);
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const bool up = GLU && r >= OUTS;
      const int i = tl.row0 + r % OUTS;
      const int n = i < tl.n ? i : tl.n - 1;
      st.sc[r] = (up ? s1 : tl.sc)[n * groups_per_row + g];
      st.bs[r] = (up ? z1 : tl.z)[n * groups_per_row + g];
    }
  };

  Step a, b;
  int t = blockIdx.x;
  int s = 0;
  // The first step's loads go out before x is prepared, which they then overlap.
  load(t, 0, a);

  // x prepared once: in(x) as dec_qmv's qmv_input makes it, as T bits, and each chunk's sums
  // in qmv_add_sums' order.
  const float inv_rms = PRE == 1 ? qmv_inv_rms<NW>(x, k_len, eps) : 1.0f;
  for (int c = tid; c < cpr; c += NT) {
    float xsum = 0.0f, xhi = 0.0f;
#pragma unroll
    for (int j = 0; j < XQ; ++j) {
      const int k = c * EPC + 8 * j;
      uint4 q = *reinterpret_cast<const uint4*>(x + k);
      float f[8];
      dec_unpack8(q, f, x);
      if constexpr (PRE == 1) {
        float wf[8];
        dec_unpack8(*reinterpret_cast<const uint4*>(aux + k), wf, x);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          f[e] = qmv_round(x, wf[e] * qmv_round(x, f[e] * inv_rms));
        }
        q = make_uint4(dec_pack2(x, f[0], f[1]), dec_pack2(x, f[2], f[3]),
                       dec_pack2(x, f[4], f[5]), dec_pack2(x, f[6], f[7]));
      }
      sx[j * cpr + c] = q;
#pragma unroll
      for (int kk = 0; kk < WPQ; ++kk) {
        float fw[EPW];
#pragma unroll
        for (int e = 0; e < EPW; ++e) {
          fw[e] = f[kk * EPW + e];
        }
        qmv_add_sums<FAST>(fw, xsum, xhi);
      }
    }
    sums[c] = make_float2(xsum, xhi);
  }
  __syncthreads();

  float acc[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    acc[r] = 0.0f;
  }
  auto consume = [&](int c, const Step& st) {
    const float2 sm = sums[c];
    const float xoff = FAST ? fmaf(HI_EXTRA, sm.y, OFF * sm.x) : OFF * sm.x;
    float d[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      d[r] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < XQ; ++j) {
      float xf[8];
      dec_unpack8(sx[j * cpr + c], xf, x);
#pragma unroll
      for (int kk = 0; kk < WPQ; ++kk) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          d[r] = qmv_dot_word<BITS, FAST ? 1 : 0>(qmv_word(st.wv[r], j * WPQ + kk),
                                                  xf + kk * EPW, d[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      acc[r] = fmaf(qmv_to_float(st.sc[r]), d[r] - xoff,
                    fmaf(qmv_to_float(st.bs[r]), sm.x, acc[r]));
    }
  };

  __shared__ float red[2][NW][RPW];
  int parity = 0;
  // Tile t's sums over the block, stored (RES: plus the residual; GLU: silu(gate) * up).
  auto finish = [&](int tt) {
    // Level i: lanes with bit i set keep the upper half of their rows and take their
    // partner's; after LOG levels lane L holds row sum_i bit_i(L) * (RPW >> (i + 1)).
#pragma unroll
    for (int i = 0; i < LOG; ++i) {
      const int half = RPW >> (i + 1);
      const bool upper = (lane >> i) & 1;
#pragma unroll
      for (int j = 0; j < half; ++j) {
        const float send = upper ? acc[j] : acc[j + half];
        const float keep = upper ? acc[j + half] : acc[j];
        acc[j] = keep + __shfl_xor_sync(0xffffffffu, send, 1 << i);
      }
    }
#pragma unroll
    for (int o = RPW; o < 32; o <<= 1) {
      acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], o);
    }
    if (lane < RPW) {
      int row = 0;
#pragma unroll
      for (int i = 0; i < LOG; ++i) {
        row += ((lane >> i) & 1) * (RPW >> (i + 1));
      }
      red[parity][tid >> 5][row] = acc[0];
    }
    __syncthreads();
    if (tid < 32) {
      float v = 0.0f;
      if (tid < RPW) {
#pragma unroll
        for (int wi = 0; wi < NW; ++wi) {
          v += red[parity][wi][tid];
        }
      }
      const Tile tl = tile_of(tt);
      const int n = tl.row0 + tid;
      if constexpr (GLU != 0) {
        // The projection's outputs rounded to T (MLX stores the gate|up product), then the
        // gate; lane r < OUTS takes its up row from lane r + OUTS.
        v = qmv_round(x, v);
        const float u = __shfl_down_sync(0xffffffffu, v, OUTS);
        if (tid < OUTS && n < tl.n) {
          qmv_store(tl.o + n, qmv_silu_gate(x, v, u));
        }
      } else if (tid < RPW && n < tl.n) {
        if constexpr (RES == 1) {
          v = qmv_round(x, v) + qmv_to_float(res[n]);  // MLX rounds the product, then the sum
        }
        qmv_store(tl.o + n, v);
      }
    }
    parity ^= 1;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      acc[r] = 0.0f;
    }
  };

  // One step on `cur`, the next one's loads into `nxt` first; false after the block's last.
  auto step = [&](Step& cur, Step& nxt) -> bool {
    int nt = t;
    int ns = s + 1;
    if (ns == steps) {
      ns = 0;
      nt += gridDim.x;
    }
    if (nt < tiles) {
      load(nt, ns, nxt);
    }
    const int c = tid + s * NT;
    if (c < cpr) {
      consume(c, cur);
    }
    if (ns == 0) {
      finish(t);
    }
    t = nt;
    s = ns;
    return t < tiles;
  };
  if (t < tiles) {
    while (step(a, b) && step(b, a)) {
    }
  }
}

// ---- warming L2 for the GEMVs after attention (`MLXCEL_CUDA_DECODE_WARM`) -----------------
// A layer's attention kernel is latency-bound: DRAM idles under it. Launched just before it,
// dec_warm asks L2 for the weights the GEMVs after it read first (cpp/cuda_decode.cc's
// `warm_ranges`: o's weights, scales and biases, then the first rows of gate and of up, up to
// half the L2) and ends at once: the prefetches complete while attention runs.
// `warm`: DEC_WARM_RANGES (address, bytes) pairs, bytes 0 for none. Any grid; each thread
// takes pieces of DEC_WARM_PIECE bytes, one bulk prefetch each on sm_90 (a line at a time
// before it).
constexpr int DEC_WARM_RANGES = 5;
constexpr unsigned DEC_WARM_PIECE = 16384;

__device__ __forceinline__ void dec_prefetch_l2_bulk(const char* p, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  for (unsigned at = 0; at < bytes; at += 128) {
    dec_prefetch_l2(p + at);
  }
#endif
}

__device__ __forceinline__ void dec_warm(const unsigned long long* warm) {
  const unsigned long long threads = (unsigned long long)gridDim.x * blockDim.x;
  const unsigned long long me = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (int r = 0; r < DEC_WARM_RANGES; ++r) {
    const char* base = reinterpret_cast<const char*>(warm[2 * r]);
    const unsigned long long n = warm[2 * r + 1] & ~15ull;  // whole 16-byte units
    for (unsigned long long at = me * DEC_WARM_PIECE; at < n; at += threads * DEC_WARM_PIECE) {
      dec_prefetch_l2_bulk(base + at, (unsigned)min((unsigned long long)DEC_WARM_PIECE, n - at));
    }
  }
}
