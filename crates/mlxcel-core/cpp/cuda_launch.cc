// Launches mlxcel's compiled CUDA kernels as nodes of MLX's CUDA graphs through a primitive of
// mlxcel's own (`MlxcelKernel`), instead of `fast::precompiled_cuda_kernel`.
//
// Why: every `precompiled_cuda_kernel` call in MLX 0.32.4 copies the module image (10-40 KB)
// into the new primitive and hashes all of it into the kernel's name, and its evaluation then
// rebuilds that name and looks the module up by it. An 8B model's decode step makes ~130 such
// calls, and decode on a GPU is bound by host time per graph node. Here a call stores a pointer
// to the loaded kernel and its launch shape; evaluation allocates the outputs and adds one
// kernel node.
//
// How: the primitive uses the same entry points of MLX's CUDA backend as MLX's custom kernels
// (`cu::get_command_encoder`, `CommandEncoder::set_input_array` / `set_output_array` /
// `add_kernel_node_raw` / `add_completed_handler`, and `malloc_async`, which the library keeps
// local: it is found through the library's ELF symbol table). mlxcel builds against the mlx-cpu wheel,
// whose headers cannot be compiled without CUDA and whose library does not export them, so they
// are looked up in the process by their mangled names (MLX 0.32.4; a member function takes the
// encoder as its first argument). When any is missing (another MLX build), or with
// MLXCEL_CUDA_LAUNCH=mlx, calls go through `fast::precompiled_cuda_kernel` as before.
// Modules are loaded with the driver API (MLX's CUDA build links libcuda) at the kernel's first
// call, while the graph is built: a failure there is an error for the caller, not an exception
// inside MLX's evaluation (which aborts the process).
#include "mlxcel-core/cpp/shim.h"

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "mlx/primitives.h"
#include "mlxcel-core/cpp/cuda_api.h"
#include "mlxcel-core/src/ffi.rs.h"

namespace mlxcel {

namespace mx = mlx::core;

namespace cuda {

namespace {

// The address of `symbol`, a function local to the shared library that defines `anchor` (not
// exported, so not visible to dlsym), from the library's ELF symbol table; null if absent (e.g. a
// stripped library).
void* local_symbol(const void* anchor, const char* symbol) {
  Dl_info info{};
  if (dladdr(anchor, &info) == 0 || info.dli_fname == nullptr) {
    return nullptr;
  }
  int fd = open(info.dli_fname, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return nullptr;
  }
  struct stat st {};
  void* map = fstat(fd, &st) == 0 ? mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0)
                                  : MAP_FAILED;
  close(fd);
  if (map == MAP_FAILED) {
    return nullptr;
  }
  void* found = nullptr;
  const auto* base = static_cast<const char*>(map);
  const auto size = static_cast<size_t>(st.st_size);
  const auto* header = reinterpret_cast<const Elf64_Ehdr*>(base);
  const bool elf64 = size >= sizeof(Elf64_Ehdr) && header->e_ident[EI_CLASS] == ELFCLASS64 &&
                     header->e_shoff + size_t(header->e_shnum) * sizeof(Elf64_Shdr) <= size;
  const auto* sections = elf64 ? reinterpret_cast<const Elf64_Shdr*>(base + header->e_shoff)
                               : nullptr;
  for (int i = 0; elf64 && found == nullptr && i < header->e_shnum; ++i) {
    const Elf64_Shdr& table = sections[i];
    if (table.sh_type != SHT_SYMTAB || table.sh_link >= header->e_shnum ||
        table.sh_offset + table.sh_size > size) {
      continue;
    }
    const Elf64_Shdr& names = sections[table.sh_link];
    const auto* symbols = reinterpret_cast<const Elf64_Sym*>(base + table.sh_offset);
    for (size_t j = 0; j < table.sh_size / sizeof(Elf64_Sym); ++j) {
      const Elf64_Sym& sym = symbols[j];
      if (ELF64_ST_TYPE(sym.st_info) == STT_FUNC && sym.st_name < names.sh_size &&
          names.sh_offset + names.sh_size <= size &&
          std::strcmp(base + names.sh_offset + sym.st_name, symbol) == 0) {
        found = static_cast<char*>(info.dli_fbase) + sym.st_value;
        break;
      }
    }
  }
  munmap(map, size);
  return found;
}

// Set by `set_cuda_launch_mlx` (the runtime policy's MLXCEL_CUDA_LAUNCH=mlx).
std::atomic<bool> launch_through_mlx{false};

}  // namespace

const LaunchApi* resolved_launch_api() {
  static const LaunchApi* api = []() -> const LaunchApi* {
    static LaunchApi a;
    bool found = true;
    auto get = [&found](auto& slot, const char* symbol) { resolve_symbol(slot, symbol, found); };
    get(a.command_encoder, "_ZN3mlx4core2cu19get_command_encoderENS0_6StreamE");
    get(a.set_input, "_ZN3mlx4core2cu14CommandEncoder15set_input_arrayERKNS0_5arrayE");
    get(a.set_output, "_ZN3mlx4core2cu14CommandEncoder16set_output_arrayERKNS0_5arrayE");
    get(a.add_kernel,
        "_ZN3mlx4core2cu14CommandEncoder19add_kernel_node_rawEP9CUfunc_st4dim3S5_S5_jPPv");
    get(a.add_completed_handler,
        "_ZN3mlx4core2cu14CommandEncoder21add_completed_handlerESt8functionIFvvEE");
    a.malloc_async = reinterpret_cast<decltype(a.malloc_async)>(
        a.command_encoder == nullptr
            ? nullptr
            : local_symbol(reinterpret_cast<const void*>(a.command_encoder),
                           "_ZN3mlx4core2cu12malloc_asyncEmRNS1_14CommandEncoderE"));
    found = found && a.malloc_async != nullptr;
    get(a.init, "cuInit");
    get(a.ctx_get_current, "cuCtxGetCurrent");
    get(a.ctx_set_current, "cuCtxSetCurrent");
    get(a.device_get, "cuDeviceGet");
    get(a.primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    get(a.module_load_data, "cuModuleLoadData");
    get(a.module_get_function, "cuModuleGetFunction");
    get(a.get_error_string, "cuGetErrorString");
    get(a.memcpy_htod, "cuMemcpyHtoD_v2");
    get(a.ctx_synchronize, "cuCtxSynchronize");
    return found ? &a : nullptr;
  }();
  return api;
}

namespace {

// The entry points for new launches: null when not all are in the process or the policy
// launches through MLX.
const LaunchApi* launch_api() {
  if (launch_through_mlx.load(std::memory_order_relaxed)) {
    return nullptr;
  }
  return resolved_launch_api();
}

}  // namespace

void check(const LaunchApi& api, int status, const std::string& what) {
  if (status != 0) {
    const char* text = nullptr;
    api.get_error_string(status, &text);
    throw std::runtime_error("mlxcel: " + what + " failed: " +
                             (text != nullptr ? text : std::to_string(status)));
  }
}

void use_mlx_context(const LaunchApi& api) {
  CUcontext context = nullptr;
  int status = api.ctx_get_current(&context);
  if (status == CUDA_ERROR_NOT_INITIALIZED) {
    check(api, api.init(0), "cuInit");
    status = api.ctx_get_current(&context);
  }
  check(api, status, "cuCtxGetCurrent");
  if (context == nullptr) {
    CUdevice device = 0;
    check(api, api.device_get(&device, 0), "cuDeviceGet");
    check(api, api.primary_ctx_retain(&context, device), "cuDevicePrimaryCtxRetain");
    check(api, api.ctx_set_current(context), "cuCtxSetCurrent");
  }
}

namespace {

// Kernel `name` of a loaded module; an error naming it when absent.
CUfunction module_function(const LaunchApi& api, CUmodule module, const std::string& name) {
  CUfunction f = nullptr;
  check(api, api.module_get_function(&f, module, name.c_str()), "finding kernel " + name);
  return f;
}

}  // namespace

void load(const LaunchApi& api, const CudaBinary& binary) {
  std::lock_guard<std::mutex> lock(binary.mutex);
  if (binary.function != nullptr) {
    return;
  }
  use_mlx_context(api);
  CUmodule module = nullptr;
  check(api, api.module_load_data(&module, binary.image.data()),
        "loading the module of " + binary.kernel);
  for (int i = 0; i < 4; ++i) {
    binary.gather[i] = module_function(api, module, "mlxcel_gather_" + std::to_string(1 << i));
  }
  binary.function = module_function(api, module, binary.kernel);
  binary.module = module;
}

void* function(const LaunchApi& api, const CudaBinary& binary, const std::string& name) {
  load(api, binary);
  return module_function(api, binary.module, name);
}

void* device_pointer(const mx::array& a) {
  return static_cast<char*>(*static_cast<void* const*>(a.buffer().ptr())) + a.offset();
}

namespace {

constexpr int MAX_GATHER_DIMS = 8;
constexpr unsigned int GATHER_THREADS = 256;

// Matches `mlxcel_layout` in kernels/cuda/gather.cu.
struct GatherLayout {
  long long shape[MAX_GATHER_DIMS];
  long long strides[MAX_GATHER_DIMS];
  int ndim;
};

}  // namespace

mx::array row_contiguous_copy(const LaunchApi& api, void* encoder, const CudaBinary& binary,
                              const mx::array& in) {
  mx::array copy(in.shape(), in.dtype(), nullptr, {});
  copy.set_data(api.malloc_async(copy.nbytes(), *static_cast<mx::cu::CommandEncoder*>(encoder)));
  GatherLayout layout{};
  layout.ndim = static_cast<int>(in.ndim());
  for (int d = 0; d < layout.ndim; ++d) {
    layout.shape[d] = in.shape(d);
    layout.strides[d] = in.strides()[d];
  }
  void* source = device_pointer(in);
  void* target = device_pointer(copy);
  long long n = static_cast<long long>(in.size());
  void* params[] = {&source, &target, &n, &layout};
  int which = in.itemsize() == 1 ? 0 : in.itemsize() == 2 ? 1 : in.itemsize() == 4 ? 2 : 3;
  unsigned int blocks = static_cast<unsigned int>((n + GATHER_THREADS - 1) / GATHER_THREADS);
  api.set_input(encoder, in);
  api.set_output(encoder, copy);
  api.add_kernel(encoder, binary.gather[which], Dim3{blocks, 1, 1}, Dim3{GATHER_THREADS, 1, 1},
                 Dim3{1, 1, 1}, 0, params);
  api.add_completed_handler(encoder, [copy]() {});
  return copy;
}

namespace {

class MlxcelKernel : public mx::Primitive {
 public:
  MlxcelKernel(mx::Stream stream, const CudaBinary& binary, Dim3 blocks, Dim3 threads,
               std::vector<int32_t> scalars)
      : mx::Primitive(stream),
        binary_(binary),
        blocks_(blocks),
        threads_(threads),
        scalars_(std::move(scalars)) {}

  void eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxcel: CUDA kernel " + binary_.kernel + " scheduled on the CPU");
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    // Created only when the entry points were found (see launch_cuda_binary).
    const LaunchApi& api = *resolved_launch_api();
    void* encoder = api.command_encoder(stream());
    std::vector<mx::array> args;
    args.reserve(inputs.size());
    auto& enc = *static_cast<mx::cu::CommandEncoder*>(encoder);
    for (const auto& in : inputs) {
      args.push_back(in.flags().row_contiguous ? in : row_contiguous_copy(api, encoder, binary_, in));
    }
    for (auto& out : outputs) {
      out.set_data(api.malloc_async(out.nbytes(), enc));
    }
    // Kernel parameters: pointers to each argument's value (the graph node copies them).
    std::vector<void*> addresses;
    addresses.reserve(args.size() + outputs.size());
    for (const auto& a : args) {
      api.set_input(encoder, a);
      addresses.push_back(device_pointer(a));
    }
    for (const auto& out : outputs) {
      api.set_output(encoder, out);
      addresses.push_back(device_pointer(out));
    }
    std::vector<void*> params;
    params.reserve(addresses.size() + scalars_.size());
    for (auto& address : addresses) {
      params.push_back(&address);
    }
    for (auto& scalar : scalars_) {
      params.push_back(&scalar);
    }
    api.add_kernel(encoder, binary_.function, blocks_, threads_, Dim3{1, 1, 1}, 0, params.data());
  }

  const char* name() const override { return "MlxcelKernel"; }

 private:
  const CudaBinary& binary_;
  Dim3 blocks_;
  Dim3 threads_;
  std::vector<int32_t> scalars_;
};

}  // namespace

}  // namespace cuda

using namespace cuda;

bool write_device_bytes(const mx::array& a, size_t offset, rust::Slice<const uint8_t> bytes) {
  const LaunchApi* api = resolved_launch_api();
  if (api == nullptr || a.buffer().ptr() == nullptr) {
    return false;
  }
  if (offset > a.nbytes() || bytes.size() > a.nbytes() - offset) {
    throw std::invalid_argument("mlxcel: device write of " + std::to_string(bytes.size()) +
                                " bytes at " + std::to_string(offset) + " past the end of a " +
                                std::to_string(a.nbytes()) + "-byte array");
  }
  use_mlx_context(*api);
  // Kernels that read the old bytes may still be queued on MLX's streams (evaluating an array
  // waits for its producers, not for its readers): wait for all work first. A copy from
  // pageable memory may return before its DMA lands, so wait for it too before MLX's next
  // kernel can read the slot. Both waits cost microseconds when the device is idle, which it
  // is here: the caller has just waited for the router output that chose these experts.
  check(*api, api->ctx_synchronize(), "cuCtxSynchronize");
  // Not `a.data()`: on a device buffer that moves the array to unified memory for the host.
  check(*api, api->memcpy_htod(static_cast<char*>(device_pointer(a)) + offset, bytes.data(),
                               bytes.size()),
        "cuMemcpyHtoD");
  check(*api, api->ctx_synchronize(), "cuCtxSynchronize");
  return true;
}

void set_cuda_launch_mlx(bool through_mlx) {
  launch_through_mlx.store(through_mlx, std::memory_order_relaxed);
}

std::optional<std::vector<mx::array>> launch_cuda_binary(
    const CudaBinary& binary, const std::vector<mx::array>& inputs,
    std::vector<mx::Shape> output_shapes, const std::vector<mx::Dtype>& output_dtypes,
    const std::vector<int32_t>& scalars, const std::array<int32_t, 3>& grid,
    const std::array<int32_t, 3>& threadgroup) {
  const LaunchApi* api = launch_api();
  if (api == nullptr) {
    return std::nullopt;
  }
  load(*api, binary);
  // What evaluation relies on, checked now (an exception there would abort the process).
  for (const auto& in : inputs) {
    if (in.size() == 0 || in.ndim() > MAX_GATHER_DIMS ||
        (in.itemsize() != 1 && in.itemsize() != 2 && in.itemsize() != 4 && in.itemsize() != 8)) {
      throw std::invalid_argument("mlxcel: kernel " + binary.kernel +
                                  " takes non-empty inputs of at most 8 dimensions");
    }
  }
  Dim3 threads{}, blocks{};
  unsigned int* t[] = {&threads.x, &threads.y, &threads.z};
  unsigned int* b[] = {&blocks.x, &blocks.y, &blocks.z};
  for (int i = 0; i < 3; ++i) {
    if (grid[i] <= 0 || threadgroup[i] <= 0) {
      throw std::invalid_argument("mlxcel: kernel " + binary.kernel + " launched on an empty grid");
    }
    *t[i] = static_cast<unsigned int>(threadgroup[i]);
    *b[i] = static_cast<unsigned int>((grid[i] + threadgroup[i] - 1) / threadgroup[i]);
  }
  auto primitive = std::make_shared<MlxcelKernel>(mx::default_stream(mx::default_device()), binary,
                                                   blocks, threads, scalars);
  return mx::array::make_arrays(std::move(output_shapes), output_dtypes, primitive, inputs);
}

}  // namespace mlxcel
