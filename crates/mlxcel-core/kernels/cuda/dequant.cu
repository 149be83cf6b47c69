// dequant.cu: mlxcel's dequantization, `dequant<...>`, called by the `extern "C"` entry points
// crates/mlxcel-core/src/cuda_kernels.rs generates (helpers: qmv_header.cuh).
//
//   out[n, k] = scales[n, k/gs] * q[n, k] + biases[n, k/gs]      (float32 math, one rounding)
//
// Arguments, in this order:
//   w      uint32 [N, K*BITS/32]  MLX affine packing, element j of a word at bits BITS*j..
//   scales T      [N, K/gs]
//   biases T      [N, K/gs]
//   out    T      [N, K]
//   n_rows, words_per_row, groups_per_row: N, K*BITS/32 and K/gs
// Integer template arg: BITS (4 or 8).
// Launch: threadgroup (256, 1, 1) (exactly), grid (N*K*BITS/128, 1, 1) in threads: one thread
// per 16 bytes of packed weights (32 elements at 4 bits, 16 at 8), which never straddle a group
// (gs is a power of two >= 32). K must be a multiple of 32.
//
// Why: prefill runs quantized layers as dequantize + dense GEMM on GPUs, and MLX 0.32.4's
// dequantize moves ~1.1 TB/s on an H200; this one reads each 16-byte chunk in one load and
// writes its outputs in 16-byte stores, so it runs at the copy bandwidth.

template <int BITS, typename T>
__device__ __forceinline__ void dequant(const uint32_t* w, const T* scales, const T* biases,
                                        T* out, int n_rows, int words_per_row,
                                        int groups_per_row) {
  constexpr int DQ_EPW = 32 / BITS;   // elements per uint32
  constexpr int DQ_EPC = 4 * DQ_EPW;  // elements per 16-byte chunk
  constexpr int DQ_THREADS = 256;     // the launch's threadgroup (DEQUANT_THREADS in Rust)
  static_assert(BITS == 4 || BITS == 8, "dequant: BITS must be 4 or 8");

  const size_t n_chunks = (size_t)n_rows * (size_t)(words_per_row / 4);
  const size_t first_chunk = (size_t)blockIdx.x * DQ_THREADS;
  const size_t c = first_chunk + threadIdx.x;
  // The outputs gathered in registers, staged in shared memory, then written by the block as
  // one contiguous run (a block's chunks are consecutive, and so are their outputs): each store
  // instruction of a warp writes 512 contiguous bytes instead of 16 bytes every 64.
  constexpr int DQ_STORES = (int)(DQ_EPC * sizeof(T) / 16);
  __shared__ uint4 stage[DQ_THREADS * DQ_STORES];
  if (c < n_chunks) {
    const int chunks_per_row = words_per_row / 4;
    const int k_len = words_per_row * DQ_EPW;
    const int group_size = k_len / groups_per_row;
    const size_t n = c / (size_t)chunks_per_row;
    const int first = (int)(c - n * (size_t)chunks_per_row) * DQ_EPC;
    const size_t g = n * (size_t)groups_per_row + (size_t)(first / group_size);
    const float scale = qmv_to_float(scales[g]);
    const float bias = qmv_to_float(biases[g]);

    const uint4 chunk = *reinterpret_cast<const uint4*>(w + c * 4);
    const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
    uint4 packed[DQ_STORES];
    T* vals = reinterpret_cast<T*>(packed);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < DQ_EPW; ++j) {
        const float q = (float)((words[i] >> (BITS * j)) & ((1u << BITS) - 1u));
        qmv_store(vals + i * DQ_EPW + j, fmaf(scale, q, bias));
      }
    }
#pragma unroll
    for (int i = 0; i < DQ_STORES; ++i) {
      stage[threadIdx.x * DQ_STORES + i] = packed[i];
    }
  }
  __syncthreads();
  const size_t chunks_here = (n_chunks - first_chunk < (size_t)DQ_THREADS)
                                 ? n_chunks - first_chunk
                                 : (size_t)DQ_THREADS;
  uint4* dst = reinterpret_cast<uint4*>(out + first_chunk * DQ_EPC);
#pragma unroll
  for (int s = 0; s < DQ_STORES; ++s) {
    const size_t at = (size_t)s * DQ_THREADS + threadIdx.x;
    if (at < chunks_here * DQ_STORES) {
      dst[at] = stage[at];
    }
  }
}
