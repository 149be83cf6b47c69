// rows.cu: two small kernels of a prompt's forward pass that MLX's CUDA backend would otherwise
// JIT-compile with NVRTC on a machine's first request (its `gather` for an embedding lookup and
// the fused `silu(gate) * up` that `mx::compile` builds): 2-4 s each on a fresh machine. As
// mlxcel kernels they ship compiled (kernels/prebuilt/).
//
// take_rows:   out[r, c] = table[ids[r], c]          table T [n_rows, row_len], ids int32 [n_ids]
//              (ids are checked against n_rows before the call; clamped so none reads outside)
// silu_halves: out[r, c] = silu(x[r, c]) * x[r, cols + c]     x T [rows, 2 * cols]
//              rounded to T after each op, as MLX's fused kernel of `g * sigmoid(g) * u` rounds
//
// Launch: threadgroup (256, 1, 1), grid = the output's element count (rounded up), one thread
// per output element.

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
  const float sig = qmv_round(out, 1.0f / (1.0f + expf(-g)));
  const float gated = qmv_round(out, g * sig);
  qmv_store(out + i, gated * u);
}
