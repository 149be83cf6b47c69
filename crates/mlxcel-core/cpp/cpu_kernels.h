// What mlxcel's CPU kernels (cpu_linear.cc, cpu_attention.cc) share: the worker pool.
#pragma once

#include <functional>

namespace mlxcel {

// Calls fn(i) for i in [0, tasks) on the pool (the caller takes a share); returns when done.
void parallel_for(int tasks, const std::function<void(int)>& fn);
// Threads of the pool, the caller included.
int parallel_threads();

}  // namespace mlxcel
