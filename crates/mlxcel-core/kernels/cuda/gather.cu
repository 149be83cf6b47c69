// gather.cu: copies a strided array into a row-contiguous one, element by element. Every module
// mlxcel builds carries these entry points: its kernels read their inputs row-contiguous, and
// the launcher (cpp/cuda_launch.cc) copies an input that is not through them first, as MLX's
// `ensure_row_contiguous` does for its own custom kernels.
//
//   out[i] = in[sum_d index_d(i) * strides[d]]      for i < n, over `ndim` <= 8 dimensions
//
// Launch: threadgroup (256, 1, 1), grid ceil(n / 256) blocks; `in` already includes the array's
// offset. Shapes and strides travel by value in one struct (element units).

struct mlxcel_layout {
  long long shape[8];
  long long strides[8];
  int ndim;
};

template <typename T>
__device__ __forceinline__ void mlxcel_gather(const T* in, T* out, long long n,
                                              mlxcel_layout layout) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) {
    return;
  }
  long long rest = i, at = 0;
  for (int d = layout.ndim - 1; d >= 0; --d) {
    at += (rest % layout.shape[d]) * layout.strides[d];
    rest /= layout.shape[d];
  }
  out[i] = in[at];
}

extern "C" __global__ void mlxcel_gather_1(const unsigned char* in, unsigned char* out,
                                           long long n, mlxcel_layout layout) {
  mlxcel_gather(in, out, n, layout);
}
extern "C" __global__ void mlxcel_gather_2(const unsigned short* in, unsigned short* out,
                                           long long n, mlxcel_layout layout) {
  mlxcel_gather(in, out, n, layout);
}
extern "C" __global__ void mlxcel_gather_4(const unsigned int* in, unsigned int* out, long long n,
                                           mlxcel_layout layout) {
  mlxcel_gather(in, out, n, layout);
}
extern "C" __global__ void mlxcel_gather_8(const unsigned long long* in, unsigned long long* out,
                                           long long n, mlxcel_layout layout) {
  mlxcel_gather(in, out, n, layout);
}
