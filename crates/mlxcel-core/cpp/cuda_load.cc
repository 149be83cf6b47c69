// cuda_load.cc: checkpoint tensors read straight into device memory on MLX's CUDA backend.
//
// MLX's own way (`array_from_bytes`) copies a tensor into a fresh unified-memory buffer on the
// host, whose pages the device then faults over one by one on first use: on the Llama-3.1-8B
// 4-bit shape that copy ran at ~3 GB/s and was most of the load (docs/performance.md, session
// 18), and a driver copy from the mapped file (pageable memory) was no faster. Here a tensor's
// bytes are read from the file (pread, no mapping) into pinned staging buffers that live for the
// process, and copied from them into stream-ordered device memory (MLX's `malloc_async`, the
// memory its kernels write their outputs to) with asynchronous driver copies: LANES reader
// threads, each with DEPTH buffers, so reads, copies and the next reads overlap.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mlxcel-core/cpp/cuda_api.h"

namespace mlxcel::cuda {

namespace {

using CUstream = void*;
using CUevent = void*;
constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;

// The driver entry points of the staged copies (the rest come from `LaunchApi`).
struct CopyApi {
  int (*mem_host_alloc)(void**, size_t, unsigned);
  int (*memcpy_htod_async)(void* device, const void* host, size_t bytes, CUstream);
  int (*stream_create)(CUstream*, unsigned);
  int (*stream_synchronize)(CUstream);
  int (*event_create)(CUevent*, unsigned);
  int (*event_record)(CUevent, CUstream);
  int (*event_synchronize)(CUevent);
};

const CopyApi* copy_api() {
  static const CopyApi* api = []() -> const CopyApi* {
    static CopyApi a;
    bool found = true;
    auto get = [&found](auto& slot, const char* symbol) { resolve_symbol(slot, symbol, found); };
    get(a.mem_host_alloc, "cuMemHostAlloc");
    get(a.memcpy_htod_async, "cuMemcpyHtoDAsync_v2");
    get(a.stream_create, "cuStreamCreate");
    get(a.stream_synchronize, "cuStreamSynchronize");
    get(a.event_create, "cuEventCreate");
    get(a.event_record, "cuEventRecord");
    get(a.event_synchronize, "cuEventSynchronize");
    return found ? &a : nullptr;
  }();
  return api;
}

// Each reader owns 2 pinned buffers of 2 MiB (allocated at its first use, then kept for the
// process: pinned memory is slow to allocate). On an H100 host the Llama-3.1-8B 4-bit shape's
// 4.5 GB took 0.58-0.80 s to build with 4 readers of 2 x 8 MiB, 0.53-0.60 s with 8 of 2 x 4
// MiB, and 0.45-0.51 s with 8 of 2 x 2 MiB (smaller stages spread a tensor over more readers
// and leave a shorter tail; 4 to 16 readers measured alike, 24 slower: session 25). How many
// read a tensor is the runtime policy's (MLXCEL_CUDA_LOAD_READERS).
constexpr int MAX_LANES = 32;
constexpr int DEPTH = 2;
constexpr size_t STAGE_BYTES = size_t(2) << 20;

struct Lane {
  CUstream stream = nullptr;
  void* buffer[DEPTH] = {};
  CUevent copied[DEPTH] = {};
};

struct Staging {
  std::mutex busy;  // one tensor at a time owns the buffers
  std::vector<Lane> lanes;
};

// The staging buffers, with at least `lanes` readers' (the caller holds `busy`).
void ensure_lanes(const LaunchApi& api, const CopyApi& copy, Staging& st, int lanes) {
  while (static_cast<int>(st.lanes.size()) < lanes) {
    Lane lane;
    check(api, copy.stream_create(&lane.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    for (int b = 0; b < DEPTH; ++b) {
      check(api, copy.mem_host_alloc(&lane.buffer[b], STAGE_BYTES, 0), "cuMemHostAlloc");
      check(api, copy.event_create(&lane.copied[b], CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    }
    st.lanes.push_back(lane);
  }
}

Staging& staging() {
  static Staging* s = new Staging;  // lives for the process
  return *s;
}

// Reads exactly `len` bytes at `offset` of `fd` into `to`.
void read_fully(int fd, char* to, size_t len, uint64_t offset) {
  size_t done = 0;
  while (done < len) {
    const ssize_t got = pread(fd, to + done, len - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got <= 0) {
      throw std::runtime_error(got == 0 ? "the file ends at byte " + std::to_string(offset + done)
                                        : std::string("read failed: ") + std::strerror(errno));
    }
    done += static_cast<size_t>(got);
  }
}

// Lane `index` of `lanes` copies the stages index, index + lanes, ... of the tensor.
void run_lane(const LaunchApi& api, const CopyApi& copy, Lane& lane, int index, int lanes, int fd,
              uint64_t offset, size_t nbytes, char* device) {
  use_mlx_context(api);
  int k = 0;
  for (size_t at = size_t(index) * STAGE_BYTES; at < nbytes; at += size_t(lanes) * STAGE_BYTES) {
    const size_t len = std::min(STAGE_BYTES, nbytes - at);
    const int b = k++ % DEPTH;
    // The buffer's previous copy must have left it (an event never recorded is complete).
    check(api, copy.event_synchronize(lane.copied[b]), "cuEventSynchronize");
    read_fully(fd, static_cast<char*>(lane.buffer[b]), len, offset + at);
    check(api, copy.memcpy_htod_async(device + at, lane.buffer[b], len, lane.stream),
          "cuMemcpyHtoDAsync");
    check(api, copy.event_record(lane.copied[b], lane.stream), "cuEventRecord");
  }
  check(api, copy.stream_synchronize(lane.stream), "cuStreamSynchronize");
}

}  // namespace

std::optional<mx::array> read_file_to_device(int fd, uint64_t offset, size_t nbytes,
                                             const mx::Shape& shape, mx::Dtype dtype,
                                             int readers) {
  const LaunchApi* api = resolved_launch_api();
  const CopyApi* copy = copy_api();
  if (api == nullptr || copy == nullptr || nbytes == 0) {
    return std::nullopt;
  }
  use_mlx_context(*api);
  auto stream = mx::default_stream(mx::Device(mx::Device::gpu));
  auto* encoder = static_cast<mx::cu::CommandEncoder*>(api->command_encoder(stream));
  mx::array out(api->malloc_async(nbytes, *encoder), shape, dtype);
  // The allocation is ordered on MLX's stream (and may reuse a buffer its queued work just
  // freed): wait for that stream before other streams write into it.
  check(*api, api->ctx_synchronize(), "cuCtxSynchronize");
  char* device = static_cast<char*>(device_pointer(out));
  Staging& st = staging();
  std::lock_guard<std::mutex> hold(st.busy);
  const int lanes = static_cast<int>(std::min<size_t>(
      std::clamp(readers, 1, MAX_LANES), (nbytes + STAGE_BYTES - 1) / STAGE_BYTES));
  ensure_lanes(*api, *copy, st, lanes);
  std::vector<std::string> errors(lanes);
  auto lane_body = [&](int i) {
    try {
      run_lane(*api, *copy, st.lanes[i], i, lanes, fd, offset, nbytes, device);
    } catch (const std::exception& e) {
      errors[i] = e.what();
      // Leave the lane's stream idle before its buffers are reused.
      copy->stream_synchronize(st.lanes[i].stream);
    }
  };
  std::vector<std::thread> helpers;
  for (int i = 1; i < lanes; ++i) {
    helpers.emplace_back(lane_body, i);
  }
  lane_body(0);
  for (auto& h : helpers) {
    h.join();
  }
  for (const auto& e : errors) {
    if (!e.empty()) {
      throw std::runtime_error("mlxcel: reading " + std::to_string(nbytes) + " bytes at byte " +
                               std::to_string(offset) + " into device memory: " + e);
    }
  }
  return out;
}

}  // namespace mlxcel::cuda
