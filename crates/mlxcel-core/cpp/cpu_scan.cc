// `CpuSelectiveScan`: the selective state-space recurrence of Mamba-1 and Mamba-2 on mlxcel's
// CPU pool, as an MLX primitive; `CpuDeltaRuleScan` (below): RWKV-7's generalised delta rule.
//
// Why: on MLX's CPU backend the parallel forms of the scan (Mamba-1's Hillis-Steele scan over
// [B, T, inner, state] blocks, Mamba-2's chunked SSD of matmuls through the reference BLAS)
// move and multiply far more than the recurrence itself needs. This runs the recurrence
//
//   s[n] = exp(dt · A[h, n]) · s[n] + dt · x[p] · B[g, n],   y[p] = Σ_n s[n] · C[g, n]
//
// directly, position after position, one (batch, head, channel) row per task over the thread
// pool, in float32. Mamba-1 is the case H = inner channels, P = 1, one group; Mamba-2 has one
// decay per head (A's state axis broadcast), and G groups of B and C shared by H / G heads each.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlxcel-core/cpp/cpu_kernels.h"
#include "mlxcel-core/cpp/shim.h"

namespace mlxcel {

namespace mx = mlx::core;

namespace {

struct ScanArgs {
  const float* x;   // [B, L, H, P]
  const float* dt;  // [B, L, H]
  const float* a;   // [H, N]
  const float* bm;  // [B, L, G, N]
  const float* cm;  // [B, L, G, N]
  const float* h0;  // [B, H, P, N]
  float* out;       // [B, L·H·P + H·P·N]: y, then the last state
  int64_t B, L, H, P, G, N;
  bool per_head_decay;  // A[h, n] is the same for every n (Mamba-2)
};

// Channels of one head handled by one task (Mamba-1's many one-channel heads are grouped too).
constexpr int64_t kRowsPerTask = 16;

void scan_rows(const ScanArgs& a, int64_t b, int64_t h, int64_t p0, int64_t p1,
               std::vector<float>& state, std::vector<float>& decay) {
  const int64_t N = a.N, H = a.H, P = a.P, L = a.L;
  const int64_t g = h / (H / a.G);
  const int64_t per_batch = L * H * P + H * P * N;
  float* y_out = a.out + b * per_batch;
  float* s_out = y_out + L * H * P;
  const float* arow = a.a + h * N;
  decay.resize(size_t(N));
  for (int64_t p = p0; p < p1; ++p) {
    const float* s0 = a.h0 + ((b * H + h) * P + p) * N;
    state.assign(s0, s0 + N);
    float* s = state.data();
    for (int64_t t = 0; t < L; ++t) {
      const float d = a.dt[(b * L + t) * H + h];
      const float dx = d * a.x[((b * L + t) * H + h) * P + p];
      const float* bn = a.bm + ((b * L + t) * a.G + g) * N;
      const float* cn = a.cm + ((b * L + t) * a.G + g) * N;
      float y = 0.0f;
      if (a.per_head_decay) {
        const float e = std::exp(d * arow[0]);
        for (int64_t n = 0; n < N; ++n) {
          s[n] = e * s[n] + dx * bn[n];
          y += s[n] * cn[n];
        }
      } else {
        for (int64_t n = 0; n < N; ++n) decay[n] = std::exp(d * arow[n]);
        for (int64_t n = 0; n < N; ++n) {
          s[n] = decay[n] * s[n] + dx * bn[n];
          y += s[n] * cn[n];
        }
      }
      y_out[((t * H) + h) * P + p] = y;
    }
    std::memcpy(s_out + (h * P + p) * N, s, size_t(N) * sizeof(float));
  }
}

void run_scan(const ScanArgs& a) {
  const int64_t blocks = (a.P + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t tasks = a.B * a.H * blocks;
  parallel_for(int(tasks), [&](int task) {
    std::vector<float> state, decay;
    const int64_t blk = task % blocks;
    const int64_t h = (task / blocks) % a.H;
    const int64_t b = task / blocks / a.H;
    const int64_t p0 = blk * kRowsPerTask;
    scan_rows(a, b, h, p0, std::min(a.P, p0 + kRowsPerTask), state, decay);
  });
}

class CpuSelectiveScan : public CpuPrimitive {
 public:
  CpuSelectiveScan(mx::Stream stream, bool per_head_decay)
      : CpuPrimitive(stream), per_head_decay_(per_head_decay) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    for (const auto& in : inputs) {
      if (!in.flags().row_contiguous) {
        throw std::invalid_argument("mlxcel cpu_selective_scan: inputs must be contiguous");
      }
    }
    const auto& x = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    ScanArgs a{};
    a.x = x.data<float>();
    a.dt = inputs[1].data<float>();
    a.a = inputs[2].data<float>();
    a.bm = inputs[3].data<float>();
    a.cm = inputs[4].data<float>();
    a.h0 = inputs[5].data<float>();
    a.out = out.data<float>();
    a.B = x.shape(0);
    a.L = x.shape(1);
    a.H = x.shape(2);
    a.P = x.shape(3);
    a.G = inputs[3].shape(2);
    a.N = inputs[3].shape(3);
    a.per_head_decay = per_head_decay_;
    schedule(inputs, out, [a]() {
      if (a.B * a.H * a.P > 0) run_scan(a);
    });
  }

  const char* name() const override { return "MlxcelCpuSelectiveScan"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return per_head_decay_ == static_cast<const CpuSelectiveScan&>(other).per_head_decay_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& x = inputs[0];
    const auto n = inputs[3].shape(3);
    return {{x.shape(0), x.shape(1) * x.shape(2) * x.shape(3) + x.shape(2) * x.shape(3) * n}};
  }

 private:
  bool per_head_decay_;
};

}  // namespace

Ptr cpu_selective_scan(const array& x, const array& dt, const array& a, const array& bm,
                       const array& cm, const array& h0, bool per_head_decay) {
  auto fail = [](const std::string& why) {
    throw std::invalid_argument("mlxcel cpu_selective_scan: " + why);
  };
  for (const auto* t : {&x, &dt, &a, &bm, &cm, &h0}) {
    if (t->dtype() != mx::float32) fail("every input must be float32");
  }
  if (x.ndim() != 4 || dt.ndim() != 3 || a.ndim() != 2 || bm.ndim() != 4 || cm.ndim() != 4 ||
      h0.ndim() != 4) {
    fail("expected x [B, L, H, P], dt [B, L, H], A [H, N], B and C [B, L, G, N], h0 [B, H, P, N]");
  }
  const auto B = x.shape(0), L = x.shape(1), H = x.shape(2), P = x.shape(3);
  const auto G = bm.shape(2), N = bm.shape(3);
  if (dt.shape() != mx::Shape{B, L, H}) fail("dt does not match x");
  if (a.shape() != mx::Shape{H, N}) fail("A does not match x and B");
  if (bm.shape() != mx::Shape{B, L, G, N} || cm.shape() != bm.shape()) fail("B and C differ");
  if (G <= 0 || H % G != 0) fail("heads are not a multiple of the groups");
  if (h0.shape() != mx::Shape{B, H, P, N}) fail("the state does not match x and B");
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<array> inputs;
  for (const auto* t : {&x, &dt, &a, &bm, &cm, &h0}) {
    inputs.push_back(mx::contiguous(*t, false, stream));
  }
  return std::make_unique<array>(mx::Shape{B, L * H * P + H * P * N}, mx::float32,
                                 std::make_shared<CpuSelectiveScan>(stream, per_head_decay),
                                 std::move(inputs));
}

// ---------------------------------------------------------------------------------------------
// `CpuDeltaRuleScan`: RWKV-7's generalised delta rule, position after position, one
// (batch, head) per task:
//
//   S = S · diag(w) + v kᵀ + (S a) bᵀ,   y = S r        (S [Dv, Dk], the previous S in S a)

namespace {

struct DeltaArgs {
  const float* r;  // [B, L, H, D] each
  const float* w;
  const float* k;
  const float* v;
  const float* a;
  const float* b;
  const float* s0;  // [B, H, D, D]
  float* out;       // [B, L·H·D + H·D·D]: y, then the last state
  int64_t B, L, H, D;
};

void delta_head(const DeltaArgs& p, int64_t bi, int64_t h, std::vector<float>& s,
                std::vector<float>& sa) {
  const int64_t D = p.D, H = p.H, L = p.L;
  const int64_t per_batch = L * H * D + H * D * D;
  float* y_out = p.out + bi * per_batch;
  const float* s0 = p.s0 + (bi * H + h) * D * D;
  s.assign(s0, s0 + D * D);
  sa.resize(size_t(D));
  for (int64_t t = 0; t < L; ++t) {
    const int64_t row = ((bi * L + t) * H + h) * D;
    const float *r = p.r + row, *w = p.w + row, *k = p.k + row, *v = p.v + row,
                *a = p.a + row, *b = p.b + row;
    for (int64_t i = 0; i < D; ++i) {
      const float* si = s.data() + i * D;
      float acc = 0.0f;
      for (int64_t j = 0; j < D; ++j) acc += si[j] * a[j];
      sa[i] = acc;
    }
    float* y = y_out + (t * H + h) * D;
    for (int64_t i = 0; i < D; ++i) {
      float* si = s.data() + i * D;
      const float vi = v[i], sai = sa[i];
      float acc = 0.0f;
      for (int64_t j = 0; j < D; ++j) {
        si[j] = si[j] * w[j] + vi * k[j] + sai * b[j];
        acc += si[j] * r[j];
      }
      y[i] = acc;
    }
  }
  std::memcpy(y_out + L * H * D + h * D * D, s.data(), size_t(D * D) * sizeof(float));
}

class CpuDeltaRuleScan : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    for (const auto& in : inputs) {
      if (!in.flags().row_contiguous) {
        throw std::invalid_argument("mlxcel cpu_delta_rule_scan: inputs must be contiguous");
      }
    }
    out.set_data(mx::allocator::malloc(out.nbytes()));
    DeltaArgs p{};
    p.r = inputs[0].data<float>();
    p.w = inputs[1].data<float>();
    p.k = inputs[2].data<float>();
    p.v = inputs[3].data<float>();
    p.a = inputs[4].data<float>();
    p.b = inputs[5].data<float>();
    p.s0 = inputs[6].data<float>();
    p.out = out.data<float>();
    p.B = inputs[0].shape(0);
    p.L = inputs[0].shape(1);
    p.H = inputs[0].shape(2);
    p.D = inputs[0].shape(3);
    schedule(inputs, out, [p]() {
      parallel_for(int(p.B * p.H), [&](int task) {
        std::vector<float> s, sa;
        delta_head(p, task / p.H, task % p.H, s, sa);
      });
    });
  }

  const char* name() const override { return "MlxcelCpuDeltaRuleScan"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& r = inputs[0];
    const auto H = r.shape(2), D = r.shape(3);
    return {{r.shape(0), r.shape(1) * H * D + H * D * D}};
  }
};

}  // namespace

Ptr cpu_delta_rule_scan(const array& r, const array& w, const array& k, const array& v,
                        const array& a, const array& b, const array& s0) {
  auto fail = [](const std::string& why) {
    throw std::invalid_argument("mlxcel cpu_delta_rule_scan: " + why);
  };
  for (const auto* t : {&r, &w, &k, &v, &a, &b, &s0}) {
    if (t->dtype() != mx::float32) fail("every input must be float32");
  }
  if (r.ndim() != 4) fail("r must be [B, L, H, D]");
  for (const auto* t : {&w, &k, &v, &a, &b}) {
    if (t->shape() != r.shape()) fail("r, w, k, v, a and b differ in shape");
  }
  const auto B = r.shape(0), L = r.shape(1), H = r.shape(2), D = r.shape(3);
  if (s0.shape() != mx::Shape{B, H, D, D}) fail("the state must be [B, H, D, D]");
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<array> inputs;
  for (const auto* t : {&r, &w, &k, &v, &a, &b, &s0}) {
    inputs.push_back(mx::contiguous(*t, false, stream));
  }
  return std::make_unique<array>(mx::Shape{B, L * H * D + H * D * D}, mx::float32,
                                 std::make_shared<CpuDeltaRuleScan>(stream), std::move(inputs));
}

}  // namespace mlxcel
