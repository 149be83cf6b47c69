// The entry points of MLX's CUDA backend and of the CUDA driver that mlxcel's kernels are
// launched through (found in the process at run time: cuda_launch.cc says why and how), shared by
// the one-kernel primitive (cuda_launch.cc) and the decode step (cuda_decode.cc).
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "mlx/array.h"
#include "mlxcel-core/cpp/shim.h"

namespace mlx::core::cu {
class CommandEncoder;
}

namespace mlxcel::cuda {

namespace mx = mlx::core;

// CUDA's dim3: the same layout, hence the same calling convention when passed by value.
struct Dim3 {
  unsigned int x, y, z;
};
using CUfunction = void*;
using CUmodule = void*;
using CUcontext = void*;
using CUdevice = int;
constexpr int CUDA_ERROR_NOT_INITIALIZED = 3;

struct LaunchApi {
  // MLX's CUDA backend.
  void* (*command_encoder)(mx::Stream);
  void (*set_input)(void* encoder, const mx::array&);
  void (*set_output)(void* encoder, const mx::array&);
  void (*add_kernel)(void* encoder, CUfunction, Dim3 grid, Dim3 block, Dim3 cluster,
                     uint32_t shared_bytes, void** params);
  void (*add_completed_handler)(void* encoder, std::function<void()>);
  // Stream-ordered device memory, as MLX's kernels allocate their outputs (`allocator::malloc`
  // hands out managed memory, which a kernel's first write migrates page by page: prefill's
  // dequantized layers ran at a seventh of their speed in it).
  mx::allocator::Data (*malloc_async)(size_t, mx::cu::CommandEncoder&);
  // The driver.
  int (*init)(unsigned int);
  int (*ctx_get_current)(CUcontext*);
  int (*ctx_set_current)(CUcontext);
  int (*device_get)(CUdevice*, int);
  int (*primary_ctx_retain)(CUcontext*, CUdevice);
  int (*module_load_data)(CUmodule*, const void*);
  int (*module_get_function)(CUfunction*, CUmodule, const char*);
  int (*get_error_string)(int, const char**);
  int (*memcpy_htod)(void* device, const void* host, size_t bytes);
  int (*ctx_synchronize)();
};

// Points `slot` at the process's `symbol` (found with dlsym: MLX's CUDA backend and the driver
// it loaded), clearing `found` when the symbol is missing.
template <typename F>
void resolve_symbol(F& slot, const char* symbol, bool& found) {
  void* p = dlsym(RTLD_DEFAULT, symbol);
  found = found && p != nullptr;
  slot = reinterpret_cast<F>(p);
}

// The entry points when all are in the process, else null.
const LaunchApi* resolved_launch_api();

// Throws an error naming `what` when `status` is not CUDA_SUCCESS.
void check(const LaunchApi& api, int status, const std::string& what);

// Makes MLX's context (the device's primary context) current on this thread.
void use_mlx_context(const LaunchApi& api);

// Loads `binary`'s module into the current context (MLX's: the device's primary context), once.
void load(const LaunchApi& api, const CudaBinary& binary);

// Kernel `name` of `binary`'s module (loaded first if need be).
void* function(const LaunchApi& api, const CudaBinary& binary, const std::string& name);

// The device address of `a`'s first element: MLX's CUDA buffers begin with their device pointer
// (`cu::CudaBuffer::data`) and an array's offset is in bytes (see `gpu_ptr` in MLX's
// backend/cuda/utils.h).
void* device_pointer(const mx::array& a);

// `nbytes` bytes at byte `offset` of the open file `fd` in a new array of `shape` and `dtype`
// in device memory, read by `readers` threads (kept for the process when `pooled`) through
// pinned staging buffers (cuda_load.cc);
// nullopt when the driver entry points are not in the process.
std::optional<mx::array> read_file_to_device(int fd, uint64_t offset, size_t nbytes,
                                             const mx::Shape& shape, mx::Dtype dtype,
                                             int readers, bool pooled);

// `in` copied to a fresh row-contiguous array by the gather kernel of `binary`'s module (see
// kernels/cuda/gather.cu), as a node of `encoder`'s graph; the copy lives until the graph has run.
mx::array row_contiguous_copy(const LaunchApi& api, void* encoder, const CudaBinary& binary,
                              const mx::array& in);

}  // namespace mlxcel::cuda
