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
