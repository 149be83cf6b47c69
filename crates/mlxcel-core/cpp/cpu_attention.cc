// `CpuAttention`: scaled dot-product attention on mlxcel's CPU pool, as an MLX primitive.
//
// Why: on MLX's CPU backend `fast::scaled_dot_product_attention` falls back to matmuls through
// the reference BLAS bundled with the `mlx-cpu` wheel (~2 GFLOP/s); once the linear layers run
// on mlxcel's kernel, attention dominates long prompts. This computes each query row directly:
// scores against every visible key, softmax, weighted sum of values, with the rows split over
// the thread pool. Float32 only; grouped-query heads; no mask or the causal mask aligned to
// the end; keys and values may be strided views (a slice of a KV cache buffer).
//
// Under an additive mask (encoders: key padding, sliding windows) each (batch, head) pair runs
// cpu_attention_kernels.inc instead, vectorised over the keys with the CPU's widest vectors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlxcel-core/cpp/cpu_kernels.h"
#include "mlxcel-core/cpp/shim.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace mlxcel {

namespace mx = mlx::core;

namespace {

struct AttentionArgs {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  int64_t B, Hq, Hk, L, S, D;
  // Element strides of the batch, head and sequence axes (the feature axis is contiguous).
  int64_t qs[3], ks[3], vs[3];
  float scale;
  bool causal;
  // The additive mask broadcast to [B, Hq, L, S] (null: none), element strides per axis.
  const float* mask;
  int64_t ms[4];
};

// One query row: out = softmax(scale * q . K^T) V over the keys it may see.
void attend_row(const AttentionArgs& a, int64_t b, int64_t hq, int64_t l,
                std::vector<float>& scores) {
  const int64_t hk = hq / (a.Hq / a.Hk);
  const float* q = a.q + b * a.qs[0] + hq * a.qs[1] + l * a.qs[2];
  const float* k = a.k + b * a.ks[0] + hk * a.ks[1];
  const float* v = a.v + b * a.vs[0] + hk * a.vs[1];
  float* out = a.out + ((b * a.Hq + hq) * a.L + l) * a.D;
  const int64_t visible = a.causal ? std::min(a.S, a.S - a.L + l + 1) : a.S;
  if (visible <= 0) {
    std::fill(out, out + a.D, 0.0f);
    return;
  }
  scores.resize(size_t(visible));
  attend_row_vec(q, k, a.ks[2], v, a.vs[2], visible, int(a.D), a.scale, scores.data(), out);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MLXCEL_HAVE_X86_KERNELS 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c")
#define MLXCEL_AVX512_REGION 1
#define MLXCEL_LANES 16
namespace avx512 {
#include "cpu_vec_math.inc"
#include "cpu_attention_kernels.inc"
}
#undef MLXCEL_LANES
#undef MLXCEL_AVX512_REGION
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define MLXCEL_AVX2_REGION 1
#define MLXCEL_LANES 8
namespace avx2 {
#include "cpu_vec_math.inc"
#include "cpu_attention_kernels.inc"
}
#undef MLXCEL_LANES
#undef MLXCEL_AVX2_REGION
#pragma GCC pop_options
#endif

#define MLXCEL_LANES 8
namespace generic {
#include "cpu_vec_math.inc"
#include "cpu_attention_kernels.inc"
}
#undef MLXCEL_LANES

using HeadFn = void (*)(const AttentionArgs&, int64_t, int64_t);

HeadFn masked_kernel() {
#ifdef MLXCEL_HAVE_X86_KERNELS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) {
    return avx512::attend_masked_head;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return avx2::attend_masked_head;
  }
#endif
  return generic::attend_masked_head;
}

void run_attention(const AttentionArgs& a) {
  if (a.mask) {
    static const HeadFn head = masked_kernel();
    const int64_t pairs = a.B * a.Hq;
    parallel_for(int(std::min<int64_t>(pairs, int64_t(parallel_threads()) * 8)), [&](int t) {
      const int64_t tasks = std::min<int64_t>(pairs, int64_t(parallel_threads()) * 8);
      for (int64_t p = t; p < pairs; p += tasks) head(a, p / a.Hq, p % a.Hq);
    });
    return;
  }
  const int64_t rows = a.B * a.Hq * a.L;
  const int tasks = int(std::min<int64_t>(rows, int64_t(parallel_threads()) * 4));
  parallel_for(tasks, [&](int t) {
    thread_local std::vector<float> scores;
    for (int64_t r = t; r < rows; r += tasks) {
      const int64_t l = r % a.L;
      const int64_t hq = (r / a.L) % a.Hq;
      const int64_t b = r / (a.L * a.Hq);
      attend_row(a, b, hq, l, scores);
    }
  });
}

void strides_of(const mx::array& x, int64_t (&out)[3]) {
  for (int i = 0; i < 3; ++i) out[i] = x.strides()[i];
}

class CpuAttention : public CpuPrimitive {
 public:
  CpuAttention(mx::Stream stream, float scale, bool causal)
      : CpuPrimitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const auto& q = inputs[0];
    const auto& k = inputs[1];
    const auto& v = inputs[2];
    for (const auto* x : {&q, &k, &v}) {
      if (x->strides()[3] != 1) {
        throw std::invalid_argument("mlxcel cpu_attention: the feature axis must be contiguous");
      }
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    AttentionArgs a{};
    a.q = q.data<float>();
    a.k = k.data<float>();
    a.v = v.data<float>();
    a.out = out.data<float>();
    a.B = q.shape(0);
    a.Hq = q.shape(1);
    a.L = q.shape(2);
    a.D = q.shape(3);
    a.Hk = k.shape(1);
    a.S = k.shape(2);
    strides_of(q, a.qs);
    strides_of(k, a.ks);
    strides_of(v, a.vs);
    a.scale = scale_;
    a.causal = causal_;
    if (inputs.size() == 4) {
      const auto& m = inputs[3];
      a.mask = m.data<float>();
      for (int i = 0; i < 4; ++i) a.ms[i] = m.strides()[i];
    }
    schedule(inputs, out, [a]() {
      if (a.B * a.Hq * a.L * a.D > 0) run_attention(a);
    });
  }

  const char* name() const override { return "MlxcelCpuAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CpuAttention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float scale_;
  bool causal_;
};

}  // namespace

Ptr cpu_attention(const array& q, const array& k, const array& v, const array* mask, float scale,
                  bool causal) {
  auto fail = [](const std::string& why) {
    throw std::invalid_argument("mlxcel cpu_attention: " + why);
  };
  for (const auto* x : {&q, &k, &v}) {
    if (x->dtype() != mx::float32) fail("q, k and v must be float32");
    if (x->ndim() != 4) fail("q, k and v must be [batch, heads, length, dim]");
  }
  if (k.shape() != v.shape()) fail("k and v differ in shape");
  if (q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3)) fail("q and k do not match");
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) {
    fail("query heads are not a multiple of key/value heads");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  // k and v are read through their strides (cache slices, head transposes); only their
  // feature axis must be contiguous, which eval_cpu checks before any work.
  std::vector<array> inputs{mx::contiguous(q, false, stream), k, v};
  if (mask) {
    if (causal) fail("a mask array and the causal mask together");
    if (!mx::issubdtype(mask->dtype(), mx::floating)) fail("the mask must be additive (float)");
    // A view: broadcast axes get stride 0, so a [B, 1, 1, S] padding mask is never expanded.
    inputs.push_back(mx::broadcast_to(mx::astype(*mask, mx::float32, stream),
                                      {q.shape(0), q.shape(1), q.shape(2), k.shape(2)}, stream));
  }
  return std::make_unique<array>(q.shape(), mx::float32,
                                 std::make_shared<CpuAttention>(stream, scale, causal),
                                 std::move(inputs));
}

}  // namespace mlxcel
