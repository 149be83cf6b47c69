// decode_moe.cu: the routed-expert layers of mlxcel's CUDA decode step (cpp/cuda_decode.cc),
// after decode.cu in the decoder module of a model with mixture-of-experts layers (the module
// of a model without them is built without this file, so its source and cached cubins stay
// those of decode.cu alone).
//
// A softmax-routed MoE feed-forward (Qwen3-MoE, Mixtral: no shared expert) as 3 kernels, none
// of which waits on the host for the router's choice (the MLX graph of the same layer reads
// nothing back either, but costs ~30 arrays of host time):
//   dec_router       logits = rms_norm(h) @ Wr^T (decode.cu's GEMV, E rows), and in its last
//                    block: xn = rms_norm(h) as the experts read it; softmax over the E logits
//                    in float32, the top k, renormalised if asked, times a scale, rounded to T
//                    (or the GEMV, then dec_route doing the same in a kernel of its own)
//   dec_moe_glu      a[s] = silu(xn @ Wg[e_s]^T) * (xn @ Wu[e_s]^T)   for each slot s < k
//   dec_moe_down     h += sum_s w_s * (a[s] @ Wd[e_s]^T)
// Each rounds to T where the MLX graph (nn/moe.rs) does: the projections' outputs, silu and
// the product, each expert's output, its product with the (T) weight, the sum, the residual.
//
// Expert stacks are `[E, rows, words]` (MLX's `switch_mlp` layout), affine 4/8-bit with scales
// and biases `[E, rows, groups]`, or dense in T (BITS 16, `words` then counting pairs of T).
// Work split of the expert GEMVs: a lane group of LPR lanes (8 by default; 16 or 32 with the
// policy's MLXCEL_CUDA_DECODE_MOE_LANES) owns one (slot, row) dot product and strides along K
// in 16-byte chunks (32 elements at 4 bits), so every row is read as whole 128-byte lines
// however short K is (an expert's down projection has K = 768 in Qwen3-30B-A3B: 24 chunks,
// which a 32-lane split would leave a quarter idle). The block's lane groups:
// DEC_MOE_THREADS / LPR.

constexpr int DEC_MOE_THREADS = 128;    // threads per block of the expert kernels
constexpr int DEC_MOE_MAX_TOP_K = 32;
constexpr int DEC_MOE_MAX_EXPERTS = 1024;
constexpr int DEC_ROUTE_THREADS = 256;
// dec_moe_dot's chunks a round for weights in registers (STAGE 0): 2. Deeper loads cost more
// registers than the waits they save (H100, Qwen3-30B-A3B 4-bit shape, session 30: 321 tok/s
// at 2, 304 at 4, 308 at 8).
constexpr int DEC_MOE_DEPTH = 2;

// The lanes of this thread's lane group, for shuffles that stay inside it (groups of one warp
// may run different trip counts).
template <int LPR>
__device__ __forceinline__ unsigned dec_moe_group_mask() {
  const unsigned lane = threadIdx.x & 31;
  return LPR == 32 ? 0xffffffffu : ((1u << LPR) - 1u) << (lane & ~unsigned(LPR - 1));
}

// One 16-byte chunk of each of R weight rows (wv[r], with its group's scale sv[r] and bias
// bv[r] for affine BITS 4/8) dotted with the chunk's activations `xc` (32 / 16 / 8 values of T
// at 4 / 8 / 16 bits), added to acc[r]. `up`: qmv_up(words).
template <int BITS, int R, typename T>
__device__ __forceinline__ void dec_moe_chunk(const uint4 (&wv)[R], const T (&sv)[R],
                                              const T (&bv)[R], const T* xc, uint32_t up,
                                              float (&acc)[R]) {
  if constexpr (BITS == 16) {
    float xf[8];
    qmv_load_x<8>(xc, xf);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float wf[8];
      dec_unpack8(wv[r], wf, xc);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[r] = fmaf(wf[j], xf[j], acc[r]);
      }
    }
  } else {
    constexpr bool FAST = BITS == 4;
    constexpr int EPW = 32 / BITS;  // elements per word
    constexpr float OFF = BITS == 4 ? 128.0f : 256.0f;
    constexpr float HI_EXTRA = 0.26171875f;  // qmv_dot_word<4, 1>'s constant
    float d[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      d[r] = 0.0f;
    }
    float xsum = 0.0f, xhi = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float xf[EPW];
      qmv_load_x<EPW>(xc + k * EPW, xf);
      qmv_add_sums<FAST>(xf, xsum, xhi);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        d[r] = qmv_dot_word<BITS, FAST ? 1 : 0>(qmv_word(wv[r], k), xf, d[r], up);
      }
    }
    const float xoff = FAST ? fmaf(HI_EXTRA, xhi, OFF * xsum) : OFF * xsum;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[r] = fmaf(qmv_to_float(sv[r]), d[r] - xoff, fmaf(qmv_to_float(bv[r]), xsum, acc[r]));
    }
  }
}

// R weight rows (w[r], with their scales s[r] and biases b[r] for affine BITS 4/8) dotted with
// x (K values of T), by one lane group: the sums in every lane of the group. `words`: uint32
// words per row (16-byte chunks: words / 4); `gshift`: log2 of chunks per quantization group.
// A lane takes chunks lane, lane + LPR, ... in rounds of DEPTH chunks whose loads (R 16-byte
// weight loads each, and their groups' scales and biases) are all issued before any is used,
// so a lane waits for memory ceil(steps / DEPTH) times (Qwen3-30B-A3B 4-bit: 8 steps a lane
// for gate|up, 3 for down). STAGE 0 (MLXCEL_CUDA_DECODE_MOE_STAGE): a round's weights land in
// registers, DEC_MOE_DEPTH of them; STAGE n: cp.async copies n chunks a round into shared
// memory, which holds no registers while they are in flight (a round can then cover a whole
// row of Qwen3-30B-A3B's experts). Any STAGE sums the chunks in the same order (the same bits).
template <int BITS, int LPR, int R, int STAGE, typename T>
__device__ __forceinline__ void dec_moe_dot(const uint32_t* const (&w)[R], const T* const (&s)[R],
                                            const T* const (&b)[R], const T* x, int words,
                                            int gshift, float (&acc)[R]) {
  constexpr int DEPTH = STAGE != 0 ? STAGE : DEC_MOE_DEPTH;  // chunk steps a round
  constexpr int EPC = BITS == 16 ? 8 : 128 / BITS;  // elements per 16-byte chunk
  constexpr int SCALED = BITS == 16 ? 1 : DEPTH;    // steps with scales and biases to hold
  constexpr int HELD = STAGE != 0 ? 1 : DEPTH;      // steps with weights in registers
  const int chunks = words / 4;
  const uint32_t up = qmv_up(words);
  const int tid = threadIdx.x;
  // Thread tid's round of weights: [u][r][tid] (consecutive threads, consecutive 16 bytes).
  __shared__ uint4 staged[STAGE != 0 ? DEPTH * R * DEC_MOE_THREADS : 1];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[r] = 0.0f;
  }
  for (int c0 = tid & (LPR - 1); c0 < chunks; c0 += DEPTH * LPR) {
    uint4 wv[HELD][R];
    T sv[SCALED][R];
    T bv[SCALED][R];
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) {
      const int c = c0 + u * LPR;
      if (c < chunks) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if constexpr (STAGE != 0) {
            mlxcel_cp_async16(mlxcel_smem_addr(&staged[(u * R + r) * DEC_MOE_THREADS + tid]),
                              w[r] + (size_t)c * 4, true);
          } else {
            wv[u][r] = qmv_load_w<1>(w[r] + (size_t)c * 4);
          }
          if constexpr (BITS != 16) {
            sv[u][r] = s[r][c >> gshift];
            bv[u][r] = b[r][c >> gshift];
          }
        }
      }
    }
    if constexpr (STAGE != 0) {
      mlxcel_cp_commit();
      mlxcel_cp_wait<0>();  // each thread reads back only what it copied
    }
#pragma unroll
    for (int u = 0; u < DEPTH; ++u) {
      const int c = c0 + u * LPR;
      if (c >= chunks) {
        break;
      }
      uint4 wr[R];
      T sr[R], br[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if constexpr (STAGE != 0) {
          wr[r] = staged[(u * R + r) * DEC_MOE_THREADS + tid];
        } else {
          wr[r] = wv[u][r];
        }
        if constexpr (BITS != 16) {
          sr[r] = sv[u][r];
          br[r] = bv[u][r];
        }
      }
      dec_moe_chunk<BITS, R>(wr, sr, br, x + c * EPC, up, acc);
    }
  }
  const unsigned mask = dec_moe_group_mask<LPR>();
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1) {
      acc[r] += __shfl_xor_sync(mask, acc[r], o);
    }
  }
}

// log2 of the 16-byte chunks per quantization group (0 for dense weights).
template <int BITS>
__device__ __forceinline__ int dec_moe_gshift(int words, int groups) {
  if constexpr (BITS == 16) {
    return 0;
  } else {
    const int chunks_per_group = (words / 4) / groups;
    return 31 - __clz(chunks_per_group);
  }
}

// The routing of one token by one block of NW warps (what follows the router's GEMV), after
// the block's RMS of h:
//  - warps 1..NW-1: xn = norm * rms_norm(h), rounded as the GEMVs' PRE 1 rounds it (the
//    experts' input), 8 values a thread;
//  - warp 0, meanwhile: p = softmax(logits) in float32, the top_k experts by logit (the lowest
//    id first among equal ones) into ids[0..top_k), their p (divided by the kept p's sum when
//    `normalize`) times `scale`, rounded to T, into weights[].
// Every pass issues its loads before its stores: for the compiler a store may alias the next
// load, and it would otherwise wait for each load in turn (with 128 threads, 16 round trips to
// L2 for a 2048-wide h). The logits are read from L2 (__ldcg): dec_router's other blocks wrote
// them during this grid.
// NW >= 2, experts <= DEC_MOE_MAX_EXPERTS, top_k <= min(experts, DEC_MOE_MAX_TOP_K),
// hidden % 8 == 0.
template <int NW, typename T>
__device__ __forceinline__ void dec_route_block(const T* logits, const T* h, const T* norm, T* xn,
                                                int* ids, float* weights, int experts,
                                                int top_k, int normalize, float scale,
                                                int hidden, float eps) {
  static_assert(NW >= 2, "dec_route_block: warp 0 routes, the others normalise");
  __shared__ float score[DEC_MOE_MAX_EXPERTS];
  const int tid = threadIdx.x;
  const float inv = qmv_inv_rms<NW>(h, hidden, eps);
  if (tid >= 32) {
    constexpr int NT = (NW - 1) * 32;
    constexpr int U = 4;
    const int chunks = hidden / 8;
    for (int c0 = tid - 32; c0 < chunks; c0 += U * NT) {
      float hv[U][8], nv[U][8];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * NT;
        if (c < chunks) {
          qmv_load_x<8>(h + 8 * c, hv[u]);
          qmv_load_x<8>(norm + 8 * c, nv[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * NT;
        if (c < chunks) {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            qmv_store(xn + 8 * c + e, nv[u][e] * qmv_round(h, hv[u][e] * inv));
          }
        }
      }
    }
    return;
  }
  const int lane = tid;
  const unsigned short* logit_bits = reinterpret_cast<const unsigned short*>(logits);
  float m = DEC_NEG_INF;
  for (int i0 = lane; i0 < experts; i0 += 4 * 32) {
    float v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + 32 * u;
      v[u] = i < experts ? qmm_to_float<T>(__ldcg(logit_bits + i)) : DEC_NEG_INF;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + 32 * u;
      if (i < experts) {
        score[i] = v[u];
        m = fmaxf(m, v[u]);
      }
    }
  }
  m = dec_warp_max(m);
  float total = 0.0f;
  for (int i = lane; i < experts; i += 32) {
    total += __expf(score[i] - m);
  }
  total = dec_warp_sum(total);
  __syncwarp();
  float kept[DEC_MOE_MAX_TOP_K];
  float kept_sum = 0.0f;
  for (int s = 0; s < top_k; ++s) {
    float best = DEC_NEG_INF;
    int at = experts;
    for (int i = lane; i < experts; i += 32) {
      const float v = score[i];
      if (v > best) {  // ascending i: the lowest id wins a tie within a lane
        best = v;
        at = i;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oa = __shfl_xor_sync(0xffffffffu, at, o);
      if (ob > best || (ob == best && oa < at)) {
        best = ob;
        at = oa;
      }
    }
    // A NaN or every logit -inf picks no expert: id 0 keeps the expert kernels in bounds
    // (the logits, hence the output, are NaN or degenerate as on the graph).
    at = at < experts ? at : 0;
    const float p = __expf(best - m) / total;
    kept[s] = p;
    kept_sum += p;
    if (lane == 0) {
      ids[s] = at;
    }
    // Every lane has read score[at] before it is struck out.
    __syncwarp();
    if (lane == (at & 31)) {
      score[at] = DEC_NEG_INF;
    }
    __syncwarp();
  }
  if (lane == 0) {
    for (int s = 0; s < top_k; ++s) {
      const float p = normalize ? kept[s] / kept_sum : kept[s];
      weights[s] = qmv_round(h, p * scale);
    }
  }
}

// The routing as a kernel of its own after the router's GEMV: one block of DEC_ROUTE_THREADS
// (MLXCEL_CUDA_DECODE_FUSED_ROUTE=0, or a router on tensor cores).
template <typename T>
__device__ __forceinline__ void dec_route(const T* logits, const T* h, const T* norm, T* xn,
                                          int* ids, float* weights, int experts, int top_k,
                                          int normalize, float scale, int hidden, float eps) {
  mlxcel_follow_prior_grid();
  dec_route_block<DEC_ROUTE_THREADS / 32>(logits, h, norm, xn, ids, weights, experts, top_k,
                                          normalize, scale, hidden, eps);
}

// The router's GEMV (logits = rms_norm(h) * norm @ Wr^T over E rows: decode.cu's dec_qmv for
// affine BITS 4/8, dec_dmv3 for dense weights in T, BITS 16 with `words` then K; the same
// bodies the separate path launches, so the logits are the same bits) with the routing folded
// into its last block: each block counts itself done once its logits are visible device-wide
// (counter, which the last block sets back to 0 for the next layer), and the last one routes
// (dec_route_block). One kernel boundary fewer per layer than the GEMV and dec_route.
template <int BITS, int NW, int RPW, typename T>
__device__ __forceinline__ void dec_router(const uint32_t* w, const T* s, const T* z, T* logits,
                                           const T* h, const T* norm, int words, int groups,
                                           float eps, T* xn, int* ids, float* weights,
                                           int* counter, int experts, int top_k, int normalize,
                                           float scale) {
  __shared__ int last;
  int hidden;
  if constexpr (BITS == 16) {
    hidden = words;
    dec_dmv3<NW, RPW, 1, 0, 0, T>(reinterpret_cast<const T*>(w), logits, experts, nullptr,
                                  nullptr, 0, nullptr, nullptr, 0, h, norm, nullptr, hidden, eps);
  } else {
    hidden = words * (32 / BITS);
    dec_qmv<BITS, NW, RPW, 1, 0, 0, T>(w, s, z, logits, experts, nullptr, nullptr, nullptr,
                                       nullptr, 0, nullptr, nullptr, nullptr, nullptr, 0, h,
                                       norm, nullptr, words, groups, eps);
  }
  // The threadFenceReduction pattern, as dec_attention's merge.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
  }
  __syncthreads();
  if (!last) {
    return;
  }
  dec_route_block<NW>(logits, h, norm, xn, ids, weights, experts, top_k, normalize, scale,
                      hidden, eps);
  if (threadIdx.x == 0) {
    *counter = 0;
  }
}

// a[s * inter + r] = silu(x @ Wg[e]^T)[r] * (x @ Wu[e]^T)[r], e = ids[s], for every slot s <
// top_k and row r < inter; one lane group per (s, r). Grid: ceil(top_k * inter / groups)
// blocks of DEC_MOE_THREADS.
template <int BITS, int LPR, int STAGE, typename T>
__device__ __forceinline__ void dec_moe_glu(const uint32_t* gw, const T* gs, const T* gb,
                                            const uint32_t* uw, const T* us, const T* ub,
                                            const int* ids, const T* x, T* out, int inter,
                                            int words, int groups, int top_k) {
  mlxcel_follow_prior_grid();
  const int item = blockIdx.x * (DEC_MOE_THREADS / LPR) + (int)(threadIdx.x / LPR);
  if (item >= top_k * inter) {
    return;  // the whole lane group: its shuffles name its own lanes only
  }
  const int slot = item / inter;
  const int r = item - slot * inter;
  const size_t row = (size_t)ids[slot] * (size_t)inter + (size_t)r;
  const size_t wo = row * (size_t)words;
  const size_t go = row * (size_t)groups;
  const uint32_t* w[2] = {gw + wo, uw + wo};
  const T* s[2] = {gs + go, us + go};
  const T* b[2] = {gb + go, ub + go};
  float acc[2];
  dec_moe_dot<BITS, LPR, 2, STAGE>(w, s, b, x, words, dec_moe_gshift<BITS>(words, groups), acc);
  if ((threadIdx.x & (LPR - 1)) == 0) {
    qmv_store(out + item, qmv_silu_gate(x, qmv_round(x, acc[0]), qmv_round(x, acc[1])));
  }
}

// out[n] = res[n] + sum_s weights[s] * (a[s] @ Wd[e_s]^T)[n] for the block's `outs` rows n
// (a: [top_k, K], K = the experts' width), each expert's output rounded to T, then its
// product with its weight, then the sum and the residual, as the graph rounds them. Lane group
// g takes the (slot, row) pairs g, g + groups, ... of the block's top_k * outs; the block sums
// each row's slots in slot order (no atomics: the same bits every run). out may be res.
// Grid: ceil(n_rows / outs) blocks of DEC_MOE_THREADS; top_k * outs <= 2 * DEC_MOE_MAX_TOP_K.
template <int BITS, int LPR, int STAGE, typename T>
__device__ __forceinline__ void dec_moe_down(const uint32_t* dw, const T* ds, const T* db,
                                             const int* ids, const float* weights, const T* a,
                                             const T* res, T* out, int n_rows, int words,
                                             int groups, int top_k, int outs) {
  __shared__ float part[2 * DEC_MOE_MAX_TOP_K];
  const int row0 = blockIdx.x * outs;
  const int k_len = BITS == 16 ? 2 * words : words * (32 / BITS);
  const int gshift = dec_moe_gshift<BITS>(words, groups);
  // The routing was written two kernels back (dec_route, before dec_moe_glu), so the block can
  // ask L2 for its experts' rows while dec_moe_glu finishes (read past L1: this SM's L1 may
  // hold an earlier layer's ids).
  for (int item = (int)(threadIdx.x / LPR); item < top_k * outs;
       item += (DEC_MOE_THREADS / LPR)) {
    const int slot = item / outs;
    const int n = min(row0 + item - slot * outs, n_rows - 1);
    const size_t row = (size_t)__ldcg(ids + slot) * (size_t)n_rows + (size_t)n;
    const char* bytes = reinterpret_cast<const char*>(dw + row * (size_t)words);
    for (int at = (int)(threadIdx.x & (LPR - 1)) * 128; at < words * 4; at += LPR * 128) {
      mlxcel_prefetch_l2(bytes + at);
    }
  }
  mlxcel_follow_prior_grid();
  for (int item = (int)(threadIdx.x / LPR); item < top_k * outs;
       item += (DEC_MOE_THREADS / LPR)) {
    const int slot = item / outs;
    const int n = min(row0 + item - slot * outs, n_rows - 1);
    const size_t row = (size_t)ids[slot] * (size_t)n_rows + (size_t)n;
    const uint32_t* w[1] = {dw + row * (size_t)words};
    const T* s[1] = {ds + row * (size_t)groups};
    const T* b[1] = {db + row * (size_t)groups};
    float acc[1];
    dec_moe_dot<BITS, LPR, 1, STAGE>(w, s, b, a + (size_t)slot * (size_t)k_len, words, gshift,
                                     acc);
    if ((threadIdx.x & (LPR - 1)) == 0) {
      part[item] = qmv_round(a, acc[0]);
    }
  }
  __syncthreads();
  const int t = threadIdx.x;
  if (t < outs && row0 + t < n_rows) {
    float sum = 0.0f;
    for (int s = 0; s < top_k; ++s) {
      sum += qmv_round(a, weights[s] * part[s * outs + t]);
    }
    const int n = row0 + t;
    qmv_store(out + n, qmv_round(a, sum) + qmv_to_float(res[n]));
  }
}
