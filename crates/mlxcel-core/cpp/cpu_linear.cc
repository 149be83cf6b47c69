// `CpuLinear`: mlxcel's own CPU kernel for `y = x @ W^T`, registered with MLX as a primitive so
// it sits in the lazy graph like any MLX op.
//
// Why: MLX's Linux CPU backend runs quantized matmuls as a scalar single-threaded loop and dense
// float32 matmuls through the reference BLAS bundled with the `mlx-cpu` wheel, both at a few
// GFLOP/s. This kernel vectorises (AVX2/FMA/F16C when the CPU has them, chosen at run time),
// splits the output columns over a small thread pool, reads quantized codes, bf16 and f16 weights
// directly (no float32 copy of the weights), and keeps activations and accumulation in float32.
//
// Covered: x float32 [..., K]; W either MLX affine-quantized (2, 4 or 8 bits; scales and biases
// float32, bf16 or f16) or dense float32/bf16/f16 [N, K]. Everything else stays on MLX's kernels
// (the Rust side decides, see `mlxcel_core::ops::linear`).
#include "mlxcel-core/cpp/shim.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlxcel-core/cpp/cpu_kernels.h"

namespace mlxcel {

namespace mx = mlx::core;

namespace {

enum class ElemKind { F32, BF16, F16 };

struct LinearArgs {
  const float* x;     // [M, K]
  const float* xsum;  // [M, K / group_size], quantized weights only
  const void* w;
  const void* scales;
  const void* biases;
  float* out;  // [M, N]
  int64_t M, N;
  int K;
  int group_size;
  int bits;  // 0: dense
  ElemKind weight_kind;
  ElemKind scale_kind;
  // Set by `prepare_q8` when this product runs on int8 activations (`q8_rows`): x quantized per
  // block of 32 and laid out for the weight's bit width, and each int32 lane's block scale.
  const int8_t* xq;
  const float* xq_lane_scale;
  // Set by `prepare_f32_gemv` when a one-row product runs on the AVX-512 float kernel
  // (`f32_rows`): x in its 4-bit layout (8-bit products read `x`).
  bool avx512_gemv;
  const float* x_layout;
};

// The weight of a GEMM: dense (`bits` 0, elements of `kind`) or MLX affine-quantized.
struct GemmWeight {
  const void* w;
  ElemKind kind;
  const void* scales;
  const void* biases;
  ElemKind scale_kind;
  int group_size;
  int bits;
};

GemmWeight gemm_weight(const LinearArgs& a) {
  return {a.w, a.weight_kind, a.scales, a.biases, a.scale_kind, a.group_size, a.bits};
}

// Software prefetch. perf put half of the AVX-512 one-row kernels' samples on their weight loads: the
// hardware prefetchers do not run far enough ahead of two cores streaming weights, and decode
// read 11 GB/s where the same cores stream 22 GB/s from the same mapping. Each block of rows
// therefore asks for the lines it will read `kPrefetchBytes` (rounded up to whole blocks, so that
// every line of a later block is asked for once) ahead; prefetches past the end of the weight are
// harmless hints. 2 KiB was best of 1-16 KiB on SmolLM2 and the 1B shape (1.3-1.5x decode).
constexpr size_t kPrefetchBytes = 2048;

// The distance, in bytes, from a block of `span` bytes to the block it prefetches.
static inline size_t prefetch_distance(size_t span) {
  return span * std::max<size_t>(1, (kPrefetchBytes + span - 1) / span);
}

// Asks for `count` scales and biases from element `first` on.
static inline void prefetch_scales(const LinearArgs& a, size_t first, size_t count) {
  const size_t elem = a.scale_kind == ElemKind::F32 ? 4 : 2;
  const char* s = static_cast<const char*>(a.scales) + first * elem;
  const char* b = static_cast<const char*>(a.biases) + first * elem;
  for (size_t off = 0; off < count * elem; off += 64) {
    __builtin_prefetch(s + off);
    __builtin_prefetch(b + off);
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MLXCEL_HAVE_AVX2_KERNELS 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define MLXCEL_AVX2_REGION 1
#define MLXCEL_LANES 8
namespace avx2 {
#include "cpu_linear_kernels.inc"
#include "cpu_vec_math.inc"
#include "cpu_gemm_kernels.inc"
}
#undef MLXCEL_LANES
#undef MLXCEL_AVX2_REGION
#pragma GCC pop_options

// Only the many-row GEMM and the epilogue have an AVX-512 form: the few-row kernels are bound
// by reading the weights, not by arithmetic.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma,f16c")
#define MLXCEL_AVX512_REGION 1
#define MLXCEL_LANES 16
namespace avx512 {
#include "cpu_vec_math.inc"
#include "cpu_gemm_kernels.inc"
}
#undef MLXCEL_LANES
#undef MLXCEL_AVX512_REGION
#pragma GCC pop_options

// One-row products on int8 activations (`MLXCEL_CPU_ACTIVATIONS=q8`): VNNI dot products.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c")
// GCC 12 warns inside its own AVX-512 headers (`_mm512_undefined_ps` as a pass-through operand).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace vnni {
#include "cpu_gemv_avx512.inc"
}
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#define MLXCEL_LANES 8
namespace generic {
#include "cpu_linear_kernels.inc"
#include "cpu_vec_math.inc"
#include "cpu_gemm_kernels.inc"
}
#undef MLXCEL_LANES

using RowsFn = void (*)(const LinearArgs&, int64_t, int64_t);
using GemmFn = void (*)(const float*, const GemmWeight&, const float*, float*, int64_t, int64_t,
                        int, int);
using EpilogueFn = void (*)(float*, const float*, int64_t, int);

// The kernels of the best instruction set this CPU has.
struct Kernels {
  RowsFn rows = generic::run_rows;
  // One-row products on int8 activations; null where the CPU has no AVX-512 VNNI.
  RowsFn q8_rows = nullptr;
  void (*q8_quantize)(const float*, int, int, int8_t*, float*, float*) = nullptr;
  // One-row products on float activations with AVX-512 (on VNNI CPUs: the same region).
  RowsFn f32_gemv = nullptr;
  void (*f32_gemv_layout)(const float*, int, float*) = nullptr;
  GemmFn gemm = generic::gemm_run;
  EpilogueFn epilogue = generic::epilogue_row;
};

const Kernels& kernels() {
  static const Kernels k = [] {
    Kernels k;
#ifdef MLXCEL_HAVE_AVX2_KERNELS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      k.rows = avx2::run_rows;
      k.gemm = avx2::gemm_run;
      k.epilogue = avx2::epilogue_row;
      if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) {
        k.gemm = avx512::gemm_run;
        k.epilogue = avx512::epilogue_row;
        if (__builtin_cpu_supports("avx512vnni")) {
          k.q8_rows = vnni::q8_rows;
          k.q8_quantize = vnni::q8_quantize_row;
          k.f32_gemv = vnni::f32_rows;
          k.f32_gemv_layout = vnni::f32_gemv_layout;
        }
      }
    }
#endif
    return k;
  }();
  return k;
}

// From this many rows of x on, a product runs as the packed GEMM (cpu_gemm_kernels.inc; a
// quantized weight is dequantized panel by panel as it is packed); below, the row kernels,
// which read each weight once for all rows, are faster.
constexpr int64_t kGemmMinRows = 16;
// Quantized weights also pay for dequantizing each panel once per product, so the GEMM takes
// over from more rows (prompts and prefill chunks; short ones stay on the row kernels).
constexpr int64_t kQuantGemmMinRows = 64;

bool use_gemm(const LinearArgs& a) {
  return a.M >= (a.bits > 0 ? kQuantGemmMinRows : kGemmMinRows);
}

// A fixed set of worker threads that split one range at a time. The thread that submits the
// work (MLX's CPU stream thread, or the decode engine's caller) takes a share itself. A decode
// step issues a few hundred calls a few microseconds apart, so threads are never spawned per
// call and stay hot between calls: a worker spins on the job counter for a while
// (`kSpinNanos`) before it sleeps on a condition variable, and the submitter spins on the
// completion count the same way. Waking a sleeping thread costs tens of microseconds; a call's
// work is often less than that.
//
// Tasks are claimed, not assigned: the submitter waits for the tasks to be done, never for a
// worker to show up. On a machine with more runnable threads than cores a worker may not run
// for milliseconds; the submitter then does every task itself instead of spinning while the
// worker it waits for cannot get a core (that made the decode engine slower than MLX's graph
// on a loaded machine). A claim names its call's generation, so a worker arriving after its
// call has ended claims nothing from the next one. Spinning threads yield their core now and
// then, for the same reason.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int threads() const { return int(workers_.size()) + 1; }

  // Calls `fn(i)` for every i in [0, tasks), spread over the pool; returns when all are done.
  void run(int tasks, const std::function<void(int)>& fn) {
    if (workers_.empty() || tasks <= 1) {
      for (int i = 0; i < tasks; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> submit(submit_mu_);
    const uint32_t gen = ++last_generation_;
    // Close the previous call's claims before publishing this call's job. A worker that saw
    // the previous generation and then reads this job and count must find no open claim of its
    // generation: it would run one of this call's tasks under the old claim and count it on top
    // of this call's own run of it, so that the count reached `tasks` with a task still running
    // (the caller read half-written outputs; the next calls' counts overshot and hung). Whoever
    // reads the job below (acquire) sees this store.
    claim_.store((uint64_t(gen) << 32) | kClosed, std::memory_order_release);
    job_.store(&fn, std::memory_order_release);
    tasks_.store(tasks, std::memory_order_release);
    completed_.store(0, std::memory_order_relaxed);
    claim_.store(uint64_t(gen) << 32, std::memory_order_release);
    {
      // The counter changes under the mutex so a worker about to sleep cannot miss it.
      std::lock_guard<std::mutex> lock(mu_);
      generation_.store(gen, std::memory_order_release);
    }
    wake_.notify_all();
    drain(gen, fn, tasks);
    auto all_done = [&] { return completed_.load(std::memory_order_acquire) == tasks; };
    if (!spin_until(all_done)) {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, all_done);
    }
  }

 private:
  static constexpr int64_t kSpinNanos = 200000;
  // A claim index no call reaches (tasks are counted in an int).
  static constexpr uint64_t kClosed = 0x7FFFFFFF;

  static inline void cpu_relax() {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }

  // Spins until `ready()` or `kSpinNanos` pass, yielding the core every 256 rounds; whether it
  // became ready.
  template <class F>
  static bool spin_until(F ready) {
    auto start = std::chrono::steady_clock::now();
    for (int i = 0;; ++i) {
      if (ready()) return true;
      cpu_relax();
      if ((i & 255) == 255) {
        if (std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(kSpinNanos))
          return ready();
        std::this_thread::yield();
      }
    }
  }

  // Claims and runs tasks of call `gen` until none are left (or that call is over).
  void drain(uint32_t gen, const std::function<void(int)>& fn, int tasks) {
    uint64_t c = claim_.load(std::memory_order_acquire);
    for (;;) {
      if (uint32_t(c >> 32) != gen || int(uint32_t(c)) >= tasks) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
        continue;
      fn(int(uint32_t(c)));
      if (completed_.fetch_add(1, std::memory_order_acq_rel) + 1 == tasks) {
        { std::lock_guard<std::mutex> lock(mu_); }
        done_.notify_one();
      }
      c = claim_.load(std::memory_order_acquire);
    }
  }

  void worker_loop() {
    uint32_t seen = 0;
    for (;;) {
      auto fresh = [&] {
        return stop_.load(std::memory_order_acquire) ||
               generation_.load(std::memory_order_acquire) != seen;
      };
      if (!spin_until(fresh)) {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, fresh);
      }
      if (stop_.load()) return;
      seen = generation_.load(std::memory_order_acquire);
      // The job and count were stored before the generation was published; if a newer call has
      // replaced them meanwhile, `drain` finds the claim counter closed or on another
      // generation and runs nothing (`run` says why the order matters).
      drain(seen, *job_.load(std::memory_order_acquire), tasks_.load(std::memory_order_acquire));
    }
  }

  std::vector<std::thread> workers_;
  std::mutex submit_mu_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  uint32_t last_generation_ = 0;  // under submit_mu_
  std::atomic<const std::function<void(int)>*> job_{nullptr};
  std::atomic<int> tasks_{0};
  // The current call's generation (high 32 bits) and next unclaimed task (low 32 bits).
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> completed_{0};
  std::atomic<uint32_t> generation_{0};
  std::atomic<bool> stop_{false};
};

// Whether one-row quantized products run on int8 activations (`set_cpu_int8_activations`).
std::atomic<bool> int8_activations{false};

// Threads the policy asks for (MLXCEL_CPU_THREADS, set through `set_cpu_threads`); 0: default.
std::mutex pool_mu;
int requested_threads = 0;
Pool* started_pool = nullptr;

int pool_threads(int requested) {
  if (requested > 0) return std::min(requested, 64);
  unsigned hw = std::thread::hardware_concurrency();
  return int(std::clamp(hw, 1u, 16u));
}

Pool& pool() {
  // Leaked on purpose: joining threads during static destruction at process exit can deadlock
  // with MLX's own scheduler teardown.
  static Pool* p = [] {
    std::lock_guard<std::mutex> lock(pool_mu);
    started_pool = new Pool(pool_threads(requested_threads));
    return started_pool;
  }();
  return *p;
}

}  // namespace

void set_cpu_threads(int32_t threads) {
  if (threads < 0 || threads > 64) {
    throw std::invalid_argument("mlxcel: CPU kernel threads must be 0 (default) to 64, got " +
                                std::to_string(threads));
  }
  std::lock_guard<std::mutex> lock(pool_mu);
  if (started_pool != nullptr && started_pool->threads() != pool_threads(threads)) {
    throw std::runtime_error("mlxcel: the CPU kernel's thread pool already runs " +
                             std::to_string(started_pool->threads()) +
                             " threads and cannot change to " +
                             std::to_string(pool_threads(threads)) +
                             " (MLXCEL_CPU_THREADS: it is sized once per process, at its first use)");
  }
  requested_threads = threads;
}

void set_cpu_int8_activations(bool on) { int8_activations.store(on); }

// Shared with the other CPU kernels (cpu_kernels.h).
void parallel_for(int tasks, const std::function<void(int)>& fn) { pool().run(tasks, fn); }

int64_t cpu_pool_check(int32_t calls) {
  if (calls < 0) throw std::invalid_argument("mlxcel cpu_pool_check: negative call count");
  constexpr int kMaxTasks = 9;
  std::vector<std::atomic<int>> runs(size_t(calls) * kMaxTasks);
  for (auto& r : runs) r.store(0);
  int64_t bad = 0;
  auto exactly_once = [&](int call, int tasks) {
    for (int t = 0; t < tasks; ++t)
      if (runs[size_t(call) * kMaxTasks + t].load() != 1) return false;
    return true;
  };
  for (int c = 0; c < calls; ++c) {
    const int tasks = 2 + c % (kMaxTasks - 1);
    pool().run(tasks, [&, c](int t) {
      runs[size_t(c) * kMaxTasks + t].fetch_add(1);
      // A few hundred nanoseconds of work, like the decode engine's smallest tasks.
      volatile int spin = 0;
      for (int i = 0; i < 64 * (1 + t % 3); ++i) spin = spin + i;
    });
    if (!exactly_once(c, tasks)) ++bad;
  }
  // A task run late, after its call returned, shows up now.
  for (int c = 0; c < calls; ++c)
    if (!exactly_once(c, 2 + c % (kMaxTasks - 1))) ++bad;
  return bad;
}
int parallel_threads() { return pool().threads(); }

namespace {

// Runs independent products (one linear layer, or one per routed expert), splitting each one's
// output columns over the pool.
void run_parts(const std::vector<LinearArgs>& parts) {
  const RowsFn rows = kernels().rows;
  const RowsFn q8_rows = kernels().q8_rows;
  const RowsFn f32_gemv = kernels().f32_gemv;
  int64_t work = 0;
  for (const auto& a : parts) work += a.N * int64_t(a.K) * std::max<int64_t>(a.M, 1);
  // Work below ~64K weight elements x rows is not worth waking the pool for.
  const int threads = work < (int64_t(1) << 16) ? 1 : pool().threads();
  const int chunks = threads > 1 ? threads * 4 : 1;
  pool().run(int(parts.size()) * chunks, [&](int t) {
    const LinearArgs& a = parts[t / chunks];
    // Equal, even-sized spans of output columns (the blocked path pairs rows).
    const int64_t span = ((a.N + chunks - 1) / chunks + 1) & ~int64_t(1);
    const int64_t begin = int64_t(t % chunks) * span;
    const RowsFn kernel = a.xq ? q8_rows : a.avx512_gemv ? f32_gemv : rows;
    if (begin < a.N) kernel(a, begin, std::min(a.N, begin + span));
  });
}

// What a quantized product computes from its x before the kernel runs, kept alive for the call.
struct PartScratch {
  std::vector<float> sums;
  std::vector<int8_t> xq;
  std::vector<float> xq_lane_scale;
  std::vector<float> x_layout;
};

// sum(x) per quantization group of each row of `a.x` ([a.M, groups]), shared by every output
// column of a quantized product.
void group_sums(const LinearArgs& a, std::vector<float>& sums) {
  const int groups = a.K / a.group_size;
  sums.assign(size_t(a.M) * groups, 0.0f);
  for (int64_t m = 0; m < a.M; ++m)
    for (int g = 0; g < groups; ++g) {
      const float* xs = a.x + size_t(m) * a.K + size_t(g) * a.group_size;
      float s = 0.0f;
      for (int k = 0; k < a.group_size; ++k) s += xs[k];
      sums[size_t(m) * groups + g] = s;
    }
}

// The int8 activation of a one-row 4- or 8-bit product when the policy asks for it and the CPU
// has VNNI, with its group sums; whether it applies (other products keep float activations).
bool prepare_q8(LinearArgs& a, PartScratch& s) {
  const Kernels& k = kernels();
  if (!int8_activations.load(std::memory_order_relaxed) || !k.q8_rows || a.M != 1) return false;
  if (!(a.bits == 4 && a.K % 64 == 0) && a.bits != 8) return false;
  s.xq.resize(size_t(a.K));
  s.xq_lane_scale.resize(size_t(a.K) / (a.bits == 4 ? 8 : 4));
  std::vector<float> block_sums(size_t(a.K) / 32);
  k.q8_quantize(a.x, a.K, a.bits, s.xq.data(), s.xq_lane_scale.data(), block_sums.data());
  // The bias term's group sums from the rounded x (cpu_gemv_avx512.inc says why), in place of
  // `group_sums`' exact ones.
  const int blocks_per_group = a.group_size / 32;
  s.sums.resize(size_t(a.K / a.group_size));
  for (size_t g = 0; g < s.sums.size(); ++g) {
    float sum = 0.0f;
    for (int b = 0; b < blocks_per_group; ++b) sum += block_sums[g * blocks_per_group + b];
    s.sums[g] = sum;
  }
  a.xq = s.xq.data();
  a.xq_lane_scale = s.xq_lane_scale.data();
  a.xsum = s.sums.data();
  return true;
}

// The AVX-512 float kernel for a one-row 4- or 8-bit product (one the int8 path did not take).
void prepare_f32_gemv(LinearArgs& a, PartScratch& s) {
  const Kernels& k = kernels();
  if (!k.f32_gemv || a.M != 1 || (a.bits != 4 && a.bits != 8)) return;
  if (a.bits == 4) {
    // Whole chunks of 128 (a last part chunk is padded with zeros).
    s.x_layout.resize((size_t(a.K) + 127) / 128 * 128);
    k.f32_gemv_layout(a.x, a.K, s.x_layout.data());
    a.x_layout = s.x_layout.data();
  }
  a.avx512_gemv = true;
}

// Everything a quantized product's kernel reads besides x and the weight: group sums, and the
// int8 activation or the float kernel's layout of x where they apply.
void prepare_quantized(LinearArgs& a, PartScratch& s) {
  if (a.bits == 0 || prepare_q8(a, s)) return;
  group_sums(a, s.sums);
  a.xsum = s.sums.data();
  prepare_f32_gemv(a, s);
}

}  // namespace

void linear_parts(const LinearPart* parts, int count) {
  static const ElemKind kinds[3] = {ElemKind::F32, ElemKind::BF16, ElemKind::F16};
  std::vector<LinearArgs> args;
  std::vector<PartScratch> scratch(size_t(std::max(count, 0)));
  for (int i = 0; i < count; ++i) {
    const LinearPart& p = parts[i];
    if (p.M == 0 || p.N == 0) continue;
    LinearArgs a{};
    a.x = p.x;
    a.w = p.w;
    a.scales = p.scales;
    a.biases = p.biases;
    a.out = p.out;
    a.M = p.M;
    a.N = p.N;
    a.K = p.K;
    a.group_size = p.group_size;
    a.bits = p.bits;
    a.weight_kind = kinds[std::clamp(p.weight_kind, 0, 2)];
    a.scale_kind = kinds[std::clamp(p.scale_kind, 0, 2)];
    if (use_gemm(a)) {
      kernels().gemm(a.x, gemm_weight(a), nullptr, a.out, a.M, a.N, a.K, 0);
      continue;
    }
    prepare_quantized(a, scratch[size_t(i)]);
    args.push_back(a);
  }
  if (!args.empty()) run_parts(args);
}

namespace {

// The routed-expert form: pair p multiplies x row p / pairs_per_row by expert ids[p]'s matrix
// into output row p. Consecutive pairs on one expert with consecutive x rows (prefill, pairs
// sorted by expert) become one many-row product.
std::vector<LinearArgs> expert_parts(const LinearArgs& base, const uint32_t* ids, int64_t pairs,
                                     int64_t pairs_per_row, int64_t experts, size_t w_stride,
                                     size_t s_stride) {
  std::vector<LinearArgs> parts;
  for (int64_t p = 0; p < pairs;) {
    const uint32_t e = ids[p];
    int64_t m = 1;
    if (pairs_per_row == 1)
      while (p + m < pairs && ids[p + m] == e) ++m;
    if (e < experts) {  // an out-of-range id leaves its rows unset rather than read out of bounds
      LinearArgs a = base;
      a.x = base.x + size_t(p / pairs_per_row) * base.K;
      a.M = m;
      a.out = base.out + size_t(p) * base.N;
      a.w = static_cast<const uint8_t*>(base.w) + e * w_stride;
      a.scales = static_cast<const uint8_t*>(base.scales) + e * s_stride;
      a.biases = static_cast<const uint8_t*>(base.biases) + e * s_stride;
      parts.push_back(a);
    }
    p += m;
  }
  return parts;
}

// out [M, N] += (x [M, K] · a [K, R]) · b [R, N]: a runtime LoRA term (`a` = Aᵀ, `b` = the
// scaled Bᵀ), added in the same node as the base product so an adapted layer costs one graph
// node, not four. Its arithmetic is rank·(K + N) per row, a few percent of the base's; rows are
// split over the pool when there are several.
void add_low_rank(const float* x, const float* a, const float* b, float* out, int64_t M, int K,
                  int R, int64_t N) {
  auto rows = [&](int64_t begin, int64_t end) {
    std::vector<float> t(static_cast<size_t>(R));
    for (int64_t m = begin; m < end; ++m) {
      std::fill(t.begin(), t.end(), 0.0f);
      const float* xm = x + size_t(m) * K;
      for (int k = 0; k < K; ++k) {
        const float xv = xm[k];
        const float* ak = a + size_t(k) * R;
        for (int r = 0; r < R; ++r) t[r] += xv * ak[r];
      }
      float* om = out + size_t(m) * N;
      for (int r = 0; r < R; ++r) {
        const float tv = t[r];
        const float* br = b + size_t(r) * N;
        for (int64_t n = 0; n < N; ++n) om[n] += tv * br[n];
      }
    }
  };
  const int tasks = int(std::min<int64_t>(M, parallel_threads()));
  if (tasks <= 1) {
    rows(0, M);
    return;
  }
  const int64_t span = (M + tasks - 1) / tasks;
  parallel_for(tasks, [&](int t) { rows(int64_t(t) * span, std::min(M, int64_t(t + 1) * span)); });
}

ElemKind elem_kind(const mx::array& a, const char* what) {
  switch (a.dtype().val()) {
    case mx::Dtype::Val::float32: return ElemKind::F32;
    case mx::Dtype::Val::bfloat16: return ElemKind::BF16;
    case mx::Dtype::Val::float16: return ElemKind::F16;
    default:
      throw std::invalid_argument(std::string("mlxcel cpu_linear: ") + what +
                                  " must be float32, bfloat16 or float16");
  }
}

class CpuLinear : public CpuPrimitive {
 public:
  // `gathered`: inputs[4] holds routed-expert ids; `has_bias`: the input after the weight's
  // planes is the bias [N] added before the activation `act` (shim.h's codes); `has_lora`: the
  // last two inputs are a low-rank term's Aᵀ [K, R] and scaled Bᵀ [R, N] (no bias, no act).
  CpuLinear(mx::Stream stream, int group_size, int bits, bool gathered, bool has_bias, int act,
            bool has_lora = false)
      : CpuPrimitive(stream),
        group_size_(group_size),
        bits_(bits),
        gathered_(gathered),
        has_bias_(has_bias),
        act_(act),
        has_lora_(has_lora) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    for (const auto& in : inputs) {
      if (!in.flags().row_contiguous) {
        // Weights come from safetensors or MLX's quantize (row-major); x is made contiguous
        // when the node is built. Anything else is a caller bug, reported before any work.
        throw std::invalid_argument("mlxcel cpu_linear: an input is not row-contiguous");
      }
    }
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));

    LinearArgs a{};
    a.K = x.shape(-1);
    a.M = a.K == 0 ? 0 : int64_t(x.size() / a.K);
    a.N = w.shape(0);
    a.group_size = group_size_;
    a.bits = bits_;
    a.x = x.data<float>();
    a.w = w.data<void>();
    a.out = out.data<float>();
    a.weight_kind = bits_ == 0 ? elem_kind(w, "weight") : ElemKind::F32;
    if (bits_ > 0) {
      a.scales = inputs[2].data<void>();
      a.biases = inputs[3].data<void>();
      a.scale_kind = elem_kind(inputs[2], "scales");
    }

    // Routed experts: inputs[4] holds the expert of each (row, expert) pair.
    const bool gathered = gathered_;
    const size_t planes = bits_ > 0 ? 4 : 2;
    const float* bias = has_bias_ ? inputs[planes].data<float>() : nullptr;
    const float* lora_a = has_lora_ ? inputs[inputs.size() - 2].data<float>() : nullptr;
    const float* lora_b = has_lora_ ? inputs.back().data<float>() : nullptr;
    const int rank = has_lora_ ? inputs.back().shape(0) : 0;
    const int act = act_;
    const uint32_t* ids = gathered ? inputs[4].data<uint32_t>() : nullptr;
    const int64_t pairs = gathered ? int64_t(inputs[4].size()) : 0;
    const int64_t pairs_per_row = gathered && a.M > 0 ? std::max<int64_t>(1, pairs / a.M) : 1;
    const int64_t experts = gathered ? w.shape(0) : 0;
    if (gathered) {
      a.N = w.shape(1);
    }
    const size_t w_stride = gathered ? w.nbytes() / experts : 0;
    const size_t s_stride = gathered ? inputs[2].nbytes() / experts : 0;

    schedule(inputs, out, [a, ids, pairs, pairs_per_row, experts, w_stride, s_stride, bias, act,
                           lora_a, lora_b, rank]() {
      if (a.M == 0 || a.N == 0) return;
      if (!ids && use_gemm(a)) {
        if (!lora_a) {
          kernels().gemm(a.x, gemm_weight(a), bias, a.out, a.M, a.N, a.K, act);
          return;
        }
        // The low-rank term joins the product before the bias and activation.
        kernels().gemm(a.x, gemm_weight(a), nullptr, a.out, a.M, a.N, a.K, 0);
        add_low_rank(a.x, lora_a, lora_b, a.out, a.M, a.K, rank, a.N);
        if (bias || act) {
          const EpilogueFn epilogue = kernels().epilogue;
          for (int64_t m = 0; m < a.M; ++m) epilogue(a.out + size_t(m) * a.N, bias, a.N, act);
        }
        return;
      }
      std::vector<LinearArgs> parts =
          ids ? expert_parts(a, ids, pairs, pairs_per_row, experts, w_stride, s_stride)
              : std::vector<LinearArgs>{a};
      std::vector<PartScratch> scratch(parts.size());
      for (size_t i = 0; i < parts.size(); ++i) prepare_quantized(parts[i], scratch[i]);
      run_parts(parts);
      if (lora_a) add_low_rank(a.x, lora_a, lora_b, a.out, a.M, a.K, rank, a.N);
      if (bias || act) {
        const int64_t rows = ids ? pairs : a.M;
        const EpilogueFn epilogue = kernels().epilogue;
        for (int64_t m = 0; m < rows; ++m) epilogue(a.out + size_t(m) * a.N, bias, a.N, act);
      }
    });
  }

  const char* name() const override { return "MlxcelCpuLinear"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const CpuLinear&>(other);
    return group_size_ == o.group_size_ && bits_ == o.bits_ && gathered_ == o.gathered_ &&
           has_bias_ == o.has_bias_ && act_ == o.act_ && has_lora_ == o.has_lora_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    if (gathered_) {  // routed experts: [..ids, 1, N]
      mx::Shape shape = inputs[4].shape();
      shape.push_back(1);
      shape.push_back(inputs[1].shape(1));
      return {shape};
    }
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int group_size_;
  int bits_;
  bool gathered_;
  bool has_bias_;
  int act_;
  bool has_lora_;
};

}  // namespace

namespace {
[[noreturn]] void fail(const std::string& why) {
  throw std::invalid_argument("mlxcel cpu_linear: " + why);
}

// Checks an affine-quantized weight of `rows` x K (per expert when stacked) and its planes.
void check_quantized(const array& w, const array* scales, const array* biases, int K,
                     int group_size, int bits) {
  if (bits != 2 && bits != 4 && bits != 8) fail("bits must be 2, 4 or 8");
  if (group_size <= 0 || group_size % 32 != 0) fail("group size must be a multiple of 32");
  if (!scales || !biases) fail("affine quantization needs scales and biases");
  if (w.dtype() != mx::uint32) fail("packed weight must be uint32");
  if (int64_t(w.shape(-1)) * 32 / bits != K) fail("packed weight does not match K");
  if (K % group_size != 0) fail("K is not a multiple of the group size");
  mx::Shape sshape = w.shape();
  sshape.back() = K / group_size;
  if (scales->shape() != sshape || biases->shape() != sshape) fail("scales/biases shape");
  if (scales->dtype() != biases->dtype()) fail("scales and biases differ in dtype");
  elem_kind(*scales, "scales");
}
}  // namespace

namespace {
// The node of `cpu_linear` / `cpu_linear_low_rank`: `lora_a`/`lora_b` both null or both set.
Ptr make_cpu_linear(const array& x, const array& w, const array* scales, const array* biases,
                    int32_t group_size, int32_t bits, const array* bias, int32_t activation,
                    const array* lora_a, const array* lora_b) {
  if (x.dtype() != mx::float32) fail("x must be float32");
  if (x.ndim() < 1) fail("x must have at least one dimension");
  if (w.ndim() != 2) fail("the weight must be 2-D [out, in]");
  const int K = x.shape(-1);
  const int N = w.shape(0);
  std::vector<array> inputs;
  auto stream = mx::default_stream(mx::Device::cpu);
  inputs.push_back(mx::contiguous(x, false, stream));
  inputs.push_back(w);
  if (bits == 0) {
    elem_kind(w, "weight");
    if (w.shape(1) != K) fail("weight has " + std::to_string(w.shape(1)) + " columns, x has " +
                              std::to_string(K));
  } else {
    check_quantized(w, scales, biases, K, group_size, bits);
    inputs.push_back(*scales);
    inputs.push_back(*biases);
  }
  if (activation < 0 || activation > 4) fail("unknown activation code " + std::to_string(activation));
  if (bias) {
    if (bias->ndim() != 1 || bias->shape(0) != N) {
      fail("the bias must be [" + std::to_string(N) + "] (the weight's rows)");
    }
    elem_kind(*bias, "bias");
    inputs.push_back(mx::contiguous(mx::astype(*bias, mx::float32, stream), false, stream));
  }
  if (lora_a) {
    if (bias || activation != 0) fail("a low-rank term takes no bias or activation");
    if (lora_a->dtype() != mx::float32 || lora_b->dtype() != mx::float32) {
      fail("the low-rank factors must be float32");
    }
    if (lora_a->ndim() != 2 || lora_b->ndim() != 2 || lora_a->shape(0) != K ||
        lora_b->shape(1) != N || lora_a->shape(1) != lora_b->shape(0)) {
      fail("the low-rank factors must be [" + std::to_string(K) + ", r] and [r, " +
           std::to_string(N) + "]");
    }
    // The factors are evaluated once per adapter mix and stay row-major: taken as they are,
    // so that the term adds no graph node per step (a `contiguous` would, even as a no-op).
    auto factor = [&](const array& f) {
      return f.is_available() && f.flags().row_contiguous ? f : mx::contiguous(f, false, stream);
    };
    inputs.push_back(factor(*lora_a));
    inputs.push_back(factor(*lora_b));
  }
  mx::Shape out_shape = x.shape();
  out_shape.back() = N;
  return std::make_unique<array>(
      out_shape, mx::float32,
      std::make_shared<CpuLinear>(stream, group_size, bits, false, bias != nullptr, activation,
                                  lora_a != nullptr),
      std::move(inputs));
}
}  // namespace

Ptr cpu_linear(const array& x, const array& w, const array* scales, const array* biases,
               int32_t group_size, int32_t bits, const array* bias, int32_t activation) {
  return make_cpu_linear(x, w, scales, biases, group_size, bits, bias, activation, nullptr,
                         nullptr);
}

Ptr cpu_linear_low_rank(const array& x, const array& w, const array* scales,
                        const array* biases, int32_t group_size, int32_t bits,
                        const array& lora_a, const array& lora_b) {
  return make_cpu_linear(x, w, scales, biases, group_size, bits, nullptr, 0, &lora_a, &lora_b);
}

Ptr cpu_gather_linear(const array& x, const array& w, const array& scales, const array& biases,
                      const array& ids, int32_t group_size, int32_t bits) {
  if (x.dtype() != mx::float32) fail("x must be float32");
  if (x.ndim() < 1) fail("x must have at least one dimension");
  if (w.ndim() != 3) fail("the expert stack must be 3-D [experts, out, in]");
  if (ids.dtype() != mx::uint32 && ids.dtype() != mx::int32) fail("expert ids must be 32-bit");
  const int K = x.shape(-1);
  check_quantized(w, &scales, &biases, K, group_size, bits);
  const size_t rows = K == 0 ? 0 : x.size() / size_t(K);
  if (rows == 0 || ids.size() % rows != 0) {
    fail("expert ids (" + std::to_string(ids.size()) + ") are not a whole number per row of x (" +
         std::to_string(rows) + ")");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<array> inputs{mx::contiguous(x, false, stream), w, scales, biases,
                            mx::contiguous(mx::view(ids, mx::uint32, stream), false, stream)};
  mx::Shape out_shape = ids.shape();
  out_shape.push_back(1);
  out_shape.push_back(w.shape(1));
  return std::make_unique<array>(out_shape, mx::float32,
                                 std::make_shared<CpuLinear>(stream, group_size, bits, true, false, 0),
                                 std::move(inputs));
}

}  // namespace mlxcel
