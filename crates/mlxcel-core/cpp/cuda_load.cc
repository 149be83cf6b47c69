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
#include <condition_variable>
#include <cstring>
#include <functional>
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
constexpr size_t MIN_POOLED_STAGE = size_t(256) << 10;

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

// Lane `index` of `lanes` copies the stages index, index + lanes, ... of the tensor, each of
// `stage` bytes (at most STAGE_BYTES).
void run_lane(const LaunchApi& api, const CopyApi& copy, Lane& lane, int index, int lanes,
              size_t stage, int fd, uint64_t offset, size_t nbytes, char* device) {
  use_mlx_context(api);
  int k = 0;
  for (size_t at = size_t(index) * stage; at < nbytes; at += size_t(lanes) * stage) {
    const size_t len = std::min(stage, nbytes - at);
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

// The reader threads of the pooled load (MLXCEL_CUDA_LOAD_POOL): lanes 1.. of every tensor's
// read (the caller is lane 0), started at their first use and kept for the process. A model
// has ~740 tensors: starting and joining 7 threads for each costs more than its smaller
// tensors' reads.
class Readers {
 public:
  // Runs body(0) here and body(1) .. body(lanes - 1) on the readers; returns when all are done.
  // One call at a time (the caller holds Staging::busy).
  void run(int lanes, const std::function<void(int)>& body) {
    if (lanes <= 1) {
      body(0);  // a tensor of one stage: waking the readers would only put them back to sleep
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(threads_) < lanes - 1) {
        const int index = 1 + static_cast<int>(threads_++);
        std::thread([this, index] { serve(index); }).detach();
      }
      job_ = &body;
      job_lanes_ = lanes;
      pending_ = lanes - 1;
      ++generation_;
    }
    wake_.notify_all();
    body(0);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void serve(int index) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= job_lanes_) {
          continue;  // not one of this tensor's lanes
        }
        job = job_;
      }
      (*job)(index);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) {
        done_.notify_all();
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  size_t threads_ = 0;
  uint64_t generation_ = 0;
  const std::function<void(int)>* job_ = nullptr;
  int job_lanes_ = 0;
  int pending_ = 0;
};

Readers& reader_pool() {
  static Readers* r = new Readers;  // lives for the process, as its threads do
  return *r;
}

}  // namespace

std::optional<mx::array> read_file_to_device(int fd, uint64_t offset, size_t nbytes,
                                             const mx::Shape& shape, mx::Dtype dtype,
                                             int readers, bool pooled) {
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
  readers = std::clamp(readers, 1, MAX_LANES);
  // Pooled, a tensor smaller than `readers` full stages is cut into `readers` smaller ones
  // (not under MIN_POOLED_STAGE), so scales, biases and norms are read by several threads too.
  const size_t stage =
      pooled ? std::clamp((nbytes + readers - 1) / readers, MIN_POOLED_STAGE, STAGE_BYTES)
             : STAGE_BYTES;
  const int lanes =
      static_cast<int>(std::min<size_t>(readers, (nbytes + stage - 1) / stage));
  ensure_lanes(*api, *copy, st, lanes);
  std::vector<std::string> errors(lanes);
  const std::function<void(int)> lane_body = [&](int i) {
    try {
      run_lane(*api, *copy, st.lanes[i], i, lanes, stage, fd, offset, nbytes, device);
    } catch (const std::exception& e) {
      errors[i] = e.what();
      // Leave the lane's stream idle before its buffers are reused.
      copy->stream_synchronize(st.lanes[i].stream);
    }
  };
  if (pooled) {
    reader_pool().run(lanes, lane_body);
  } else {
    std::vector<std::thread> helpers;
    for (int i = 1; i < lanes; ++i) {
      helpers.emplace_back(lane_body, i);
    }
    lane_body(0);
    for (auto& h : helpers) {
      h.join();
    }
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
