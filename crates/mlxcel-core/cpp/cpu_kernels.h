// What mlxcel's CPU kernels (cpu_linear.cc, cpu_attention.cc) share: the worker pool and the
// base of their MLX primitives.
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mlxcel {

// Calls fn(i) for i in [0, tasks) on the pool (the caller takes a share); returns when done.
void parallel_for(int tasks, const std::function<void(int)>& fn);
// Threads of the pool, the caller included.
int parallel_threads();

// One query row of attention: out [D] = softmax(scale * q . K^T) V over `n` key/value rows whose
// D features are contiguous, rows `ks`/`vs` floats apart; `scores` is n floats of scratch.
// Vectorised with the CPU's instruction set (cpu_decode.cc).
void attend_row_vec(const float* q, const float* k, int64_t ks, const float* v, int64_t vs,
                    int64_t n, int D, float scale, float* scores, float* out);

// One product `out = x @ W^T` for `linear_parts`: x float32 [M, K] row-major; W dense [N, K]
// (`bits` 0) or MLX affine-quantized (`bits` 2, 4 or 8, `group_size` a multiple of 32, scales
// and biases [N, K / group_size]). Element kinds: 0 float32, 1 bfloat16, 2 float16.
struct LinearPart {
  const float* x;
  const void* w;
  const void* scales;
  const void* biases;
  float* out;
  int64_t M, N;
  int K;
  int group_size;
  int bits;
  int weight_kind;
  int scale_kind;
};
// Computes independent products at once on the pool (the CPU linear kernel's arithmetic),
// each one's output columns split over the threads: one pool call for all of them.
void linear_parts(const LinearPart* parts, int count);

// An MLX primitive computed by an mlxcel CPU kernel. `eval_cpu` validates and fills its
// arguments on the calling thread (errors there reach Rust as `Err`), then `schedule`s the work
// on MLX's CPU stream like MLX's own CPU ops.
class CpuPrimitive : public mlx::core::UnaryPrimitive {
 public:
  using mlx::core::UnaryPrimitive::UnaryPrimitive;

  void eval_gpu(const std::vector<mlx::core::array>&, mlx::core::array&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU stream only");
  }

 protected:
  // Queues `work` on the stream, keeping every input and output buffer alive until it has run,
  // whatever happens to the graph meanwhile.
  void schedule(const std::vector<mlx::core::array>& inputs, mlx::core::array& out,
                std::function<void()> work) {
    std::vector<std::shared_ptr<mlx::core::array::Data>> keep;
    for (const auto& in : inputs) keep.push_back(in.data_shared_ptr());
    keep.push_back(out.data_shared_ptr());
    auto& encoder = mlx::core::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([work = std::move(work), keep = std::move(keep)]() { work(); });
  }
};

}  // namespace mlxcel
