// prelude.cuh: what mlxcel's CUDA kernels need from outside themselves, written out so that the
// kernel sources compile with NVRTC alone (no CUDA toolkit headers at run time). mlxcel builds
// prelude.cuh + qmv_header.cuh + qmv.cu + dequant.cu + generated `extern "C"` entry points into
// one module (crates/mlxcel-core/src/cuda_kernels.rs).

typedef decltype(sizeof(0)) size_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;

// Half-precision values as their bits: the kernels only load, store and convert them.
struct mlxcel_bf16 {
  unsigned short bits;
};
struct mlxcel_f16 {
  unsigned short bits;
};

__device__ __forceinline__ float mlxcel_bf16_bits_to_float(unsigned int bits) {
  return __uint_as_float(bits << 16);
}
__device__ __forceinline__ float mlxcel_f16_bits_to_float(unsigned short bits) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
  return f;
}
// Round to nearest even, as __float2bfloat16 does for finite values.
__device__ __forceinline__ unsigned short mlxcel_float_to_bf16_bits(float v) {
  const unsigned int u = __float_as_uint(v);
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ unsigned short mlxcel_float_to_f16_bits(float v) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
