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

// Asks L2 for the 128-byte line holding p (no register waits on it).
__device__ __forceinline__ void mlxcel_prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t mlxcel_smem_addr(const void* p) {
  uint32_t a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 16 bytes global -> shared without a register (cp.async, sm_80 and later), zero-filled when
// !valid (nothing is read then); a thread's copies land once it has committed them as a group
// and waited for all but N of its groups.
__device__ __forceinline__ void mlxcel_cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n)
               : "memory");
}
__device__ __forceinline__ void mlxcel_cp_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void mlxcel_cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Programmatic dependent launch (sm_90 and later; nothing on older GPUs). A kernel that a graph
// edge of the programmatic kind follows may let the next kernel start launching before it
// ends: `mlxcel_release_next_grid` says this block has started, and once every block has, the
// next grid's blocks take the SM room this one frees and run what does not read its outputs
// (their weights' first loads). `mlxcel_wait_prior_grid` then holds them until this grid has
// completed and its writes are visible. Launched after an ordinary edge, both do nothing.
__device__ __forceinline__ void mlxcel_wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void mlxcel_release_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Both, in the order the decode step's kernels use them: a kernel waits for the one before it
// to complete before it lets the one after it launch, so no more than two grids of the step
// are ever resident, and what a kernel reads before its wait was written at least two kernels
// earlier.
__device__ __forceinline__ void mlxcel_follow_prior_grid() {
  mlxcel_wait_prior_grid();
  mlxcel_release_next_grid();
}
