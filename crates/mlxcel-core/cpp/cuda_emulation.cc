// cuda_emulation.cc: rows.cu's kernels run on the CPU, one emulated thread after another, for
// the CPU tests of their index arithmetic and rounding (`cuda_kernels::tests`): a machine
// without a GPU can then check a kernel's output against MLX's own op before the GPU check
// (`cuda_kernels` example) confirms it. Only kernels without shared memory, barriers or warp
// operations can run this way; bf16 and float32 element types.
//
// The kernel source is included as it is compiled by NVRTC, with the few CUDA built-ins it uses
// defined here for the host. Nothing in the library calls these functions: the tests declare
// them, so the linker leaves this object out of every other binary.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace mlxcel_emulated {

#define __device__
#define __forceinline__ inline

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
// Per test thread: tests run emulated kernels in parallel.
thread_local Dim3 blockIdx, blockDim, threadIdx;

struct mlxcel_bf16 {
  unsigned short bits;
};
using uint32_t = std::uint32_t;

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using ::expf;
using ::fmaf;
using ::fmaxf;
using ::sincosf;

// As prelude.cuh and qmv_header.cuh define them for the GPU (round to nearest even).
inline float qmv_to_float(mlxcel_bf16 v) { return __uint_as_float(unsigned(v.bits) << 16); }
inline float qmv_to_float(float v) { return v; }
inline unsigned short float_to_bf16_bits(float v) {
  const unsigned u = __float_as_uint(v);
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void qmv_store(mlxcel_bf16* p, float v) { p->bits = float_to_bf16_bits(v); }
inline void qmv_store(float* p, float v) { *p = v; }
inline float qmv_round(const mlxcel_bf16*, float v) {
  return qmv_to_float(mlxcel_bf16{float_to_bf16_bits(v)});
}
inline float qmv_round(const float*, float v) { return v; }

#include "../kernels/cuda/rows.cu"

#undef __device__
#undef __forceinline__

// Runs `body` as a launch of `threads` threads in blocks of 256 (rows.cu's launch shape).
template <typename Body>
void launch(long long threads, Body body) {
  blockDim = Dim3{256, 1, 1};
  const long long blocks = (threads + 255) / 256;
  for (long long b = 0; b < blocks; ++b) {
    blockIdx = Dim3{unsigned(b), 0, 0};
    for (unsigned t = 0; t < 256; ++t) {
      threadIdx = Dim3{t, 0, 0};
      body();
    }
  }
}

// Runs `body<T>()` with T bf16 when `bf16`, else float32.
template <typename Body>
void with_type(int bf16, Body body) {
  if (bf16 != 0) {
    body(mlxcel_bf16{});
  } else {
    body(0.0f);
  }
}

}  // namespace mlxcel_emulated

// rows.cu's kernels on the CPU; `bf16` picks bf16 elements, else float32.
extern "C" void mlxcel_emulate_heads_rope(int bf16, const void* qkv, const float* inv_freq,
                                          void* out, int batch, int len, int heads, int head_dim,
                                          int rope_heads, int rot_half, int traditional,
                                          int offset) {
  using namespace mlxcel_emulated;
  with_type(bf16, [&](auto like) {
    using T = decltype(like);
    launch((long long)batch * heads * len * head_dim, [&] {
      heads_rope<T>(static_cast<const T*>(qkv), inv_freq, static_cast<T*>(out), batch, len,
                    heads, head_dim, rope_heads, rot_half, traditional, offset);
    });
  });
}

extern "C" void mlxcel_emulate_silu_halves(int bf16, const void* x, void* out, int rows,
                                           int cols) {
  using namespace mlxcel_emulated;
  with_type(bf16, [&](auto like) {
    using T = decltype(like);
    launch((long long)rows * cols, [&] {
      silu_halves<T>(static_cast<const T*>(x), static_cast<T*>(out), rows, cols);
    });
  });
}

extern "C" void mlxcel_emulate_silu_mul(int bf16, const void* gate, const void* up, void* out,
                                        int n) {
  using namespace mlxcel_emulated;
  with_type(bf16, [&](auto like) {
    using T = decltype(like);
    launch(n, [&] {
      silu_mul<T>(static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out),
                  n);
    });
  });
}

extern "C" void mlxcel_emulate_take_along_rows(int bf16, const void* values,
                                               const std::uint32_t* ids, void* out, int rows,
                                               int cols, int k) {
  using namespace mlxcel_emulated;
  with_type(bf16, [&](auto like) {
    using T = decltype(like);
    launch((long long)rows * k, [&] {
      take_along_rows<T>(static_cast<const T*>(values), ids, static_cast<T*>(out), rows, cols,
                         k);
    });
  });
}

extern "C" void mlxcel_emulate_route_topk(int bf16, const float* logits, const float* bias,
                                          std::uint32_t* ids, void* weights, int rows,
                                          int experts, int k, int scoring, int has_bias,
                                          int normalize, float scale) {
  using namespace mlxcel_emulated;
  with_type(bf16, [&](auto like) {
    using T = decltype(like);
    launch(rows, [&] {
      route_topk<T>(logits, bias, ids, static_cast<T*>(weights), rows, experts, k, scoring,
                    has_bias, normalize, scale);
    });
  });
}

extern "C" void mlxcel_emulate_heads_norm_rope(int bf16, const void* qkv, const void* q_norm,
                                               const void* k_norm, const float* inv_freq,
                                               void* out, int batch, int len, int heads,
                                               int head_dim, int n_q, int rope_heads,
                                               int rot_half, int traditional, int offset,
                                               float eps) {
  using namespace mlxcel_emulated;
  with_type(bf16, [&](auto like) {
    using T = decltype(like);
    launch((long long)batch * heads * len, [&] {
      heads_norm_rope<T>(static_cast<const T*>(qkv), static_cast<const T*>(q_norm),
                         static_cast<const T*>(k_norm), inv_freq, static_cast<T*>(out), batch,
                         len, heads, head_dim, n_q, rope_heads, rot_half, traditional, offset,
                         eps);
    });
  });
}
