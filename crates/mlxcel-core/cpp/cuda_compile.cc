// Compiles mlxcel's CUDA kernels with NVRTC at run time, without linking CUDA: MLX's CUDA build
// links NVRTC and the driver (libnvrtc, libcuda), so their entry points are looked up in the
// running process. On any other build they are absent and these functions throw, which the Rust
// side reports as "CUDA kernels unavailable".
//
// Why not `fast::cuda_kernel`: MLX 0.32.4 recompiles such kernels with NVRTC in every process
// (1-2 s at the first call, measured on an H200) and regenerates their source on every call
// (host time in each decode step). mlxcel compiles once per machine (the image is cached on disk
// by the Rust side) and launches it through its own primitive (cuda_launch.cc).
#include "mlxcel-core/cpp/shim.h"

#include <dlfcn.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "mlxcel-core/src/ffi.rs.h"

namespace mlxcel {
namespace {

template <typename F>
F lookup(const char* symbol) {
  void* p = dlsym(RTLD_DEFAULT, symbol);
  if (p == nullptr) {
    throw std::runtime_error(std::string("mlxcel: ") + symbol +
                             " is not in the process (MLX is not its CUDA build)");
  }
  return reinterpret_cast<F>(p);
}

// The few NVRTC and driver signatures used here (all return an int status, 0 = success).
using nvrtcProgram = void*;
using CreateProgram = int (*)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                              const char* const*);
using CompileProgram = int (*)(nvrtcProgram, int, const char* const*);
using GetSize = int (*)(nvrtcProgram, size_t*);
using GetData = int (*)(nvrtcProgram, char*);
using DestroyProgram = int (*)(nvrtcProgram*);
using GetErrorString = const char* (*)(int);
using CuInit = int (*)(unsigned int);
using CuDeviceGet = int (*)(int*, int);
using CuDeviceGetAttribute = int (*)(int*, int, int);

constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;

void check(int status, const char* what) {
  if (status != 0) {
    auto describe = lookup<GetErrorString>("nvrtcGetErrorString");
    throw std::runtime_error(std::string("mlxcel: ") + what + " failed: " + describe(status));
  }
}

}  // namespace

int32_t cuda_device_arch() {
  int dev = 0, major = 0, minor = 0;
  if (lookup<CuInit>("cuInit")(0) != 0 || lookup<CuDeviceGet>("cuDeviceGet")(&dev, 0) != 0) {
    throw std::runtime_error("mlxcel: no CUDA device");
  }
  auto attr = lookup<CuDeviceGetAttribute>("cuDeviceGetAttribute");
  if (attr(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev) != 0 ||
      attr(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev) != 0) {
    throw std::runtime_error("mlxcel: cannot read the CUDA device's compute capability");
  }
  return major * 10 + minor;
}

rust::Vec<uint8_t> cuda_compile(rust::Str source, rust::Str name, int32_t arch) {
  auto create = lookup<CreateProgram>("nvrtcCreateProgram");
  auto compile = lookup<CompileProgram>("nvrtcCompileProgram");
  auto destroy = lookup<DestroyProgram>("nvrtcDestroyProgram");
  std::string src(source), file = std::string(name) + ".cu";
  nvrtcProgram prog = nullptr;
  check(create(&prog, src.c_str(), file.c_str(), 0, nullptr, nullptr), "nvrtcCreateProgram");
  struct Guard {
    nvrtcProgram* p;
    DestroyProgram destroy;
    ~Guard() { destroy(p); }
  } guard{&prog, destroy};
  // A cubin for this device (no JIT at load); NVRTC of MLX's CUDA build knows its architecture.
  std::string gpu = "--gpu-architecture=sm_" + std::to_string(arch);
  const char* options[] = {gpu.c_str(), "--std=c++17"};
  int status = compile(prog, 2, options);
  if (status != 0) {
    size_t size = 0;
    lookup<GetSize>("nvrtcGetProgramLogSize")(prog, &size);
    std::string log(size, '\0');
    lookup<GetData>("nvrtcGetProgramLog")(prog, log.data());
    throw std::runtime_error("mlxcel: NVRTC could not compile " + file + ":\n" + log);
  }
  size_t size = 0;
  check(lookup<GetSize>("nvrtcGetCUBINSize")(prog, &size), "nvrtcGetCUBINSize");
  std::string image(size, '\0');
  check(lookup<GetData>("nvrtcGetCUBIN")(prog, image.data()), "nvrtcGetCUBIN");
  rust::Vec<uint8_t> out;
  out.reserve(size);
  for (char c : image) out.push_back(static_cast<uint8_t>(c));
  return out;
}

}  // namespace mlxcel
