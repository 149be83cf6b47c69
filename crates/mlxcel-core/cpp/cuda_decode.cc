// mlxcel's CUDA decode step: one token of one sequence through a llama-shaped decoder (the
// decoders the CPU decode engine covers) as one MLX primitive, `CudaDecodeStep`, whose
// evaluation adds every kernel of the step (kernels/cuda/decode.cu: 5 per layer) to MLX's CUDA
// graph.
//
// Why: decode on a GPU is bound by MLX's host time per array (~8 us each on an H200 host); the
// MLX graph of an 8B decode step has ~460 arrays, so the step costs ~3.7 ms of host time however
// fast its kernels are. Here the step is one array, and the kernels are graph nodes added
// directly (a few microseconds each, no array bookkeeping).
//
// How: the weights are held here as MLX arrays (evaluated once by `finish`); each step takes the
// embedded token and the layers' key/value buffers (`[1, kv_heads, capacity, head_dim]`, which
// the caller owns exclusively: row `position` is written in place by the rope kernel) and returns
// the logits. Scratch space is one stream-ordered allocation per step. Every node reads and
// writes that scratch array, so MLX's encoder chains the nodes in order; the first node also
// depends on the inputs, the last one is the producer of the logits and of the caches.
//
// Overlapped launches (`overlap`, MLXCEL_CUDA_DECODE_OVERLAP): the step's kernels go into a
// graph of their own, each joined to the one before by a programmatic edge (Hopper's
// programmatic dependent launch), and that graph into MLX's as one child node. A kernel then
// launches while the one before it finishes, issues its weights' first loads and waits
// (prelude.cuh's mlxcel_follow_prior_grid) instead of starting only after the previous grid
// has drained: the step's ~160-340 kernel boundaries each cost a launch and a first memory
// latency otherwise. `cuda_decoder_finish` checks once that the driver builds and instantiates
// such a graph, and keeps the plain chain when it does not.
#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "mlxcel-core/cpp/cuda_api.h"
#include "mlxcel-core/cpp/shim.h"
#include "mlxcel-core/src/ffi.rs.h"

namespace mlxcel {

namespace mx = mlx::core;
using namespace cuda;

namespace {

// Projection roles (as `LinearRole` in src/cpu_decode.rs) and norm roles (`NormRole`).
// ROLE_QKV and ROLE_GATE_UP: the fused `[q | k | v]` and `[gate | up]` projections (MLX loads
// fuse them on a GPU), which replace the separate ones. A routed-expert layer has ROLE_ROUTER
// (`[experts, hidden]`) and the expert stacks ROLE_EXPERT_* (`[experts, rows, words]`) instead
// of the MLP's roles.
enum {
  ROLE_Q,
  ROLE_K,
  ROLE_V,
  ROLE_O,
  ROLE_GATE,
  ROLE_UP,
  ROLE_DOWN,
  ROLE_HEAD,
  ROLE_QKV,
  ROLE_GATE_UP,
  ROLE_ROUTER,
  ROLE_EXPERT_GATE,
  ROLE_EXPERT_UP,
  ROLE_EXPERT_DOWN,
  ROLES
};
enum { NORM_INPUT, NORM_POST, NORM_Q, NORM_K, NORM_FINAL };
// The GEMV kinds of decode.cu: RMSNorm in; residual out; RMSNorm in and silu(gate) * up out.
enum { GEMV_RMS, GEMV_RES, GEMV_GLU };
// The largest K of a tensor-core GEMV (its shared memory: 2K + K/16 bytes).
constexpr int TC_MAX_K = 16384;

constexpr int MAX_HEAD_DIM = 256;      // DEC_MAX_HEAD_DIM of decode.cu
constexpr int MAX_GROUP = 16;          // DEC_MAX_GROUP
constexpr int MAX_CHUNK = 128;         // keys per attention block (a score each per thread)
// decode_moe.cu's DEC_ROUTE_THREADS, DEC_MOE_THREADS, DEC_MOE_MAX_TOP_K and
// DEC_MOE_MAX_EXPERTS.
constexpr unsigned ROUTE_THREADS = 256;
constexpr unsigned MOE_THREADS = 128;
constexpr int MAX_TOP_K = 32;
constexpr int MAX_EXPERTS = 1024;

// A projection: affine `bits`-bit (4 or 8) with scales and biases, or dense in the activations'
// dtype (`bits` 16, no scales); `[rows, words]`, or a stack of experts' `[experts, rows, words]`.
struct QLinear {
  std::optional<mx::array> w, scales, biases, bias;
  int bits = 0;
  bool dense() const { return bits == 16; }
  int experts() const { return w->ndim() == 3 ? w->shape(0) : 1; }
  int rows() const { return w->shape(-2); }
  int words() const { return w->shape(-1); }
  int groups() const { return dense() ? 0 : scales->shape(-1); }
  int cols() const { return dense() ? w->shape(-1) : words() * 32 / bits; }
  // uint32 words per row however the weights are stored (dense: pairs of values).
  int words32() const { return dense() ? cols() / 2 : words(); }
  // Its kernels' row in CudaDecoderState::gemv: 4-bit, 8-bit, dense.
  int table() const { return dense() ? 2 : bits == 8 ? 1 : 0; }
  // Whether the tensor-core GEMV (qmv_tc.cu) takes it: 4-bit in groups of 64 or 128, and K
  // small enough for the kernel's shared copy of x (2K + K/16 bytes, under 48 KB).
  bool tensor_core_ok() const {
    if (bits != 4) {
      return false;
    }
    const int group_size = cols() / groups();
    return (group_size == 64 || group_size == 128) && cols() <= TC_MAX_K;
  }
};

// How a routed-expert layer weighs its experts: softmax over the router's logits, the top_k
// kept (renormalised when `normalize`), times `scale`. top_k 0: the layer has a dense MLP.
struct Routing {
  int top_k = 0;
  bool normalize = false;
  float scale = 1.0f;
};

struct Layer {
  QLinear linear[ROLES];  // ROLE_HEAD unused
  std::optional<mx::array> norm[4];
  Routing routing;
  bool moe() const { return routing.top_k > 0; }
};

// One kernel's arguments: 8-byte slots (pointers, or an int in the low 4 bytes), and the
// pointers to them that a graph node takes (it copies the values when added).
struct Args {
  std::vector<uint64_t> slots;
  std::vector<void*> ptrs;
  Args& ptr(const void* p) {
    slots.push_back(reinterpret_cast<uint64_t>(p));
    return *this;
  }
  Args& i32(int32_t v) {
    uint64_t s = 0;
    std::memcpy(&s, &v, sizeof v);
    slots.push_back(s);
    return *this;
  }
  Args& f32(float v) {
    int32_t bits;
    std::memcpy(&bits, &v, sizeof v);
    return i32(bits);
  }
  void** params() {
    ptrs.clear();
    for (auto& s : slots) {
      ptrs.push_back(&s);
    }
    return ptrs.data();
  }
};

int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace

struct CudaDecoderState {
  const CudaBinary* binary = nullptr;
  mx::Dtype dtype = mx::bfloat16;
  int hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, layers = 0;
  float eps = 0, scale = 0;
  bool traditional = false;
  std::vector<float> inv_freq;
  std::optional<mx::array> inv_freq_dev;
  // (warps, rows per block) of each GEMV kind (DECODER_GEMV_SHAPES in src/cuda_kernels.rs).
  int shape[3][2] = {};
  // (warps, rows per block) of the tensor-core GEMVs of every kind; warps 0: none.
  int tc_shape[2] = {};
  std::vector<Layer> layer;
  QLinear head;
  std::optional<mx::array> final_norm;
  // Kernels, loaded by `finish`: GEMVs by [4-bit, 8-bit, dense][kind], then attention, then
  // those of routed-expert layers (decode_moe.cu; the expert GEMVs by format as the GEMVs).
  void* gemv[3][3] = {};
  // The tensor-core GEMVs by kind (4-bit weights `QLinear::tensor_core_ok` takes).
  void* gemv_tc[3] = {};
  void* attention = nullptr;
  void* route = nullptr;
  void* moe_glu[3] = {};
  void* moe_down[3] = {};
  // One int32 per key/value head, 0 between launches: dec_attention's count of the blocks
  // done (its last block sets it back). Steps run one at a time on MLX's stream.
  std::optional<mx::array> counters;
  int inter = 0;  // widest MLP
  // Routed-expert layers: most experts, most kept per token, widest top_k * expert width.
  int experts = 0, top_k = 0, moe_inter = 0;
  // Lane groups per block of the expert GEMVs (DEC_MOE_THREADS / their LPR).
  int moe_groups = 16;
  // Attention blocks per step the chunking aims at (MLXCEL_CUDA_DECODE_ATTN_BLOCKS, or
  // policy::default_decode_attn_blocks of the model).
  int attn_blocks = 264;
  // Threads per attention block (dec_attention's NT: MLXCEL_CUDA_DECODE_ATTN_THREADS).
  unsigned attn_threads = 128;
  // The routing in the router GEMV's last block (MLXCEL_CUDA_DECODE_FUSED_ROUTE): the fused
  // kernels by router format as `gemv`, loaded by `finish` when the option is on.
  bool fused_route = false;
  void* router[3] = {};
  // The kernels in a child graph joined by programmatic edges (see the file's comment).
  bool overlap = false;
  bool finished = false;

  std::string where(int l) const {
    return l < 0 ? std::string("the output head") : "layer " + std::to_string(l);
  }
};

CudaDecoder::CudaDecoder() = default;
CudaDecoder::~CudaDecoder() = default;

namespace {

// A matrix's GEMV: up to three matrices of equal K (and packing) in one launch.
struct Segment {
  const QLinear* linear;
  void* out;
};

// The scratch parts of a routed-expert layer: the experts' normed input, the router's logits,
// the chosen experts' ids (int32) and weights (float), their silu(gate) * up rows.
struct Moe {
  char* xn;
  char* logits;
  char* ids;
  char* weights;
  char* act;
};

// The driver's graph entry points and MLX's `CommandEncoder::add_graph_node(graph, key,
// updatable)`, for overlapped launches; null when any is missing.
struct CUgraphEdgeData {
  unsigned char from_port, to_port, type, reserved[5];
};
// CUDA_KERNEL_NODE_PARAMS_v2.
struct KernelNodeParams {
  CUfunction func;
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  void** params;
  void** extra;
  void* kernel;
  CUcontext ctx;
};
constexpr unsigned char GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1;
constexpr unsigned char GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1;

struct OverlapApi {
  int (*graph_create)(void** graph, unsigned flags);
  int (*graph_destroy)(void* graph);
  int (*add_kernel_node)(void** node, void* graph, void* const* deps, size_t n_deps,
                         const KernelNodeParams* params);
  int (*add_dependencies)(void* graph, void* const* from, void* const* to,
                          const CUgraphEdgeData* edges, size_t n);
  int (*add_child_graph_node)(void** node, void* graph, void* const* deps, size_t n_deps,
                              void* child);
  int (*instantiate)(void** exec, void* graph, unsigned long long flags);
  int (*exec_destroy)(void* exec);
  void (*add_graph_node)(void* encoder, void* graph, const std::string& key, bool updatable);
};

const OverlapApi* overlap_api() {
  static const OverlapApi* api = []() -> const OverlapApi* {
    static OverlapApi a;
    bool found = true;
    auto get = [&found](auto& slot, const char* symbol) { resolve_symbol(slot, symbol, found); };
    get(a.graph_create, "cuGraphCreate");
    get(a.graph_destroy, "cuGraphDestroy");
    get(a.add_kernel_node, "cuGraphAddKernelNode_v2");
    get(a.add_dependencies, "cuGraphAddDependencies_v2");
    get(a.add_child_graph_node, "cuGraphAddChildGraphNode");
    get(a.instantiate, "cuGraphInstantiateWithFlags");
    get(a.exec_destroy, "cuGraphExecDestroy");
    get(a.add_graph_node,
        "_ZN3mlx4core2cu14CommandEncoder14add_graph_nodeEP10CUgraph_stRKNSt7__cxx1112basic_"
        "stringIcSt11char_traitsIcESaIcEEEb");
    return found ? &a : nullptr;
  }();
  return api;
}

// A graph being built, destroyed with its holder.
struct OwnedGraph {
  const OverlapApi& api;
  void* graph = nullptr;
  explicit OwnedGraph(const OverlapApi& a) : api(a) {}
  ~OwnedGraph() {
    if (graph != nullptr) {
      api.graph_destroy(graph);
    }
  }
  OwnedGraph(const OwnedGraph&) = delete;
  OwnedGraph& operator=(const OwnedGraph&) = delete;
};

// Adds a node launching `function` to `graph`, after `prior` (null: none) by a programmatic
// edge; returns a driver status.
int add_overlapped_kernel(const OverlapApi& api, void* graph, void* prior, void** node,
                          CUfunction function, Dim3 grid, Dim3 block, unsigned shared_bytes,
                          void** params) {
  const KernelNodeParams p{function, grid.x,      grid.y,  grid.z,  block.x, block.y,
                           block.z,  shared_bytes, params, nullptr, nullptr, nullptr};
  int status = api.add_kernel_node(node, graph, nullptr, 0, &p);
  if (status == 0 && prior != nullptr) {
    const CUgraphEdgeData edge{GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, 0,
                               GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, {}};
    status = api.add_dependencies(graph, &prior, node, &edge, 1);
  }
  return status;
}

// Whether this driver builds and instantiates a graph holding two kernels joined by a
// programmatic edge as a child node (what an overlapped step gives MLX); `function` is any
// kernel of the module (never launched).
bool overlap_supported(const OverlapApi& api, CUfunction function) {
  OwnedGraph child(api), parent(api);
  if (api.graph_create(&child.graph, 0) != 0 || api.graph_create(&parent.graph, 0) != 0) {
    return false;
  }
  uint64_t slot = 0;
  void* params[32];
  for (auto& p : params) {
    p = &slot;
  }
  void* first = nullptr;
  void* second = nullptr;
  void* node = nullptr;
  void* exec = nullptr;
  const Dim3 one{1, 1, 1};
  const bool built =
      add_overlapped_kernel(api, child.graph, nullptr, &first, function, one, one, 0, params) ==
          0 &&
      add_overlapped_kernel(api, child.graph, first, &second, function, one, one, 0, params) ==
          0 &&
      api.add_child_graph_node(&node, parent.graph, nullptr, 0, child.graph) == 0 &&
      api.instantiate(&exec, parent.graph, 0) == 0;
  if (exec != nullptr) {
    api.exec_destroy(exec);
  }
  return built;
}

class CudaDecodeStep : public mx::Primitive {
 public:
  CudaDecodeStep(mx::Stream stream, std::shared_ptr<const CudaDecoderState> state, int position)
      : mx::Primitive(stream), state_(std::move(state)), position_(position) {}

  void eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("mlxcel: the CUDA decode step was scheduled on the CPU");
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const CudaDecoderState& st = *state_;
    const LaunchApi& api = *resolved_launch_api();
    encoder_ = api.command_encoder(stream());
    api_ = &api;
    inputs_ = &inputs;
    auto& enc = *static_cast<mx::cu::CommandEncoder*>(encoder_);
    first_ = true;
    std::optional<OwnedGraph> graph;
    if (st.overlap) {
      const OverlapApi& overlap = *overlap_api();
      graph.emplace(overlap);
      check(api, overlap.graph_create(&graph->graph, 0), "cuGraphCreate");
      graph_ = &*graph;
      prior_ = nullptr;
      nodes_ = 0;
    } else {
      graph_ = nullptr;
    }

    mx::array x = inputs[0];
    if (!x.flags().row_contiguous) {
      x = row_contiguous_copy(api, encoder_, *st.binary, x);
    }
    x_ = &x;
    mx::array& logits = outputs[0];
    logits.set_data(api.malloc_async(logits.nbytes(), enc));
    logits_ = &logits;

    const int len = position_ + 1;
    const int q_dim = st.heads * st.head_dim;
    const int kv_dim = st.kv_heads * st.head_dim;
    int chunk = ceil_div(len * st.kv_heads, st.attn_blocks);
    chunk = std::min(MAX_CHUNK, std::max(16, chunk));
    const int n_chunks = ceil_div(len, chunk);

    // The scratch arena: 256-byte aligned parts.
    size_t bytes = 0;
    auto part = [&bytes](size_t n) {
      size_t at = bytes;
      bytes += (n + 255) & ~size_t(255);
      return at;
    };
    const size_t elt = mx::size_of(st.dtype);
    const size_t h_at = part(st.hidden * elt);
    const size_t qkv_at = part(size_t(q_dim + 2 * kv_dim) * elt);
    const size_t attn_at = part(size_t(q_dim) * elt);
    const size_t gu_at = part(size_t(std::max(st.inter, st.moe_inter)) * elt);
    // dec_attention's partials: each (head, chunk)'s D weighted values, then its 2 stats.
    const size_t partial_at = part(size_t(st.heads) * n_chunks * (st.head_dim + 2) * 4);
    // Routed-expert layers: the experts' normed input, the router's logits, the chosen ids and
    // their weights.
    const size_t xn_at = part(st.top_k > 0 ? st.hidden * elt : 0);
    const size_t logits_at = part(size_t(st.experts) * elt);
    const size_t ids_at = part(size_t(st.top_k) * 4);
    const size_t weights_at = part(size_t(st.top_k) * 4);
    arena_.emplace(mx::Shape{static_cast<int>(bytes)}, mx::uint8, nullptr,
                   std::vector<mx::array>{});
    arena_->set_data(api.malloc_async(bytes, enc));
    char* base = static_cast<char*>(device_pointer(*arena_));
    char* h = base + h_at;
    char* qkv = base + qkv_at;
    char* attn = base + attn_at;
    char* gu = base + gu_at;  // silu(gate) * up (of each chosen expert)
    char* partial = base + partial_at;
    const Moe moe{base + xn_at, base + logits_at, base + ids_at, base + weights_at, gu};

    const void* h_in = device_pointer(x);
    for (int l = 0; l < st.layers; ++l) {
      const Layer& ly = st.layer[l];
      const mx::array& kc = inputs[1 + l];
      const mx::array& vc = inputs[1 + st.layers + l];
      const int capacity = kc.shape(2);
      const QLinear& fused_qkv = ly.linear[ROLE_QKV];
      const char* q_bias = static_cast<const char*>(ptr(ly.linear[ROLE_Q].bias));
      const char* k_bias = static_cast<const char*>(ptr(ly.linear[ROLE_K].bias));
      const char* v_bias = static_cast<const char*>(ptr(ly.linear[ROLE_V].bias));
      if (fused_qkv.w) {
        gemv(GEMV_RMS, {Segment{&fused_qkv, qkv}}, h_in, ptr(ly.norm[NORM_INPUT]), nullptr);
        if (fused_qkv.bias) {
          q_bias = static_cast<const char*>(device_pointer(*fused_qkv.bias));
          k_bias = q_bias + q_dim * elt;
          v_bias = q_bias + size_t(q_dim + kv_dim) * elt;
        }
      } else {
        gemv(GEMV_RMS,
             {Segment{&ly.linear[ROLE_Q], qkv}, Segment{&ly.linear[ROLE_K], qkv + q_dim * elt},
              Segment{&ly.linear[ROLE_V], qkv + size_t(q_dim + kv_dim) * elt}},
             h_in, ptr(ly.norm[NORM_INPUT]), nullptr);
      }
      Args at;
      at.ptr(qkv)
          .ptr(q_bias)
          .ptr(k_bias)
          .ptr(v_bias)
          .ptr(ptr(ly.norm[NORM_Q]))
          .ptr(ptr(ly.norm[NORM_K]))
          .ptr(device_pointer(*st.inv_freq_dev))
          .ptr(device_pointer(kc))
          .ptr(device_pointer(vc))
          .ptr(partial)
          .ptr(device_pointer(*st.counters))
          .ptr(attn)
          .i32(st.heads)
          .i32(st.kv_heads)
          .i32(st.head_dim)
          .i32(static_cast<int>(st.inv_freq.size()))
          .i32(st.traditional ? 1 : 0)
          .i32(position_)
          .i32(capacity)
          .i32(chunk)
          .i32(n_chunks)
          .f32(st.eps)
          .f32(st.scale);
      launch(st.attention, Dim3{unsigned(st.kv_heads), unsigned(n_chunks), 1},
             Dim3{st.attn_threads, 1, 1}, at);
      gemv(GEMV_RES, {Segment{&ly.linear[ROLE_O], h}}, attn, nullptr, h_in);
      h_in = h;
      if (ly.moe()) {
        experts(ly, moe, h);
        continue;
      }
      const QLinear& fused_gate_up = ly.linear[ROLE_GATE_UP];
      const int inter = ly.linear[ROLE_DOWN].cols();
      if (fused_gate_up.w) {
        glu(fused_gate_up, 0, fused_gate_up, inter, inter, gu, h, ptr(ly.norm[NORM_POST]));
      } else {
        glu(ly.linear[ROLE_GATE], 0, ly.linear[ROLE_UP], 0, inter, gu, h,
            ptr(ly.norm[NORM_POST]));
      }
      gemv(GEMV_RES, {Segment{&ly.linear[ROLE_DOWN], h}}, gu, nullptr, h);
    }
    gemv(GEMV_RMS, {Segment{&st.head, device_pointer(logits)}}, h, ptr(st.final_norm), nullptr,
         /*last=*/true);
    if (graph) {
      // The child node stands for every kernel: it reads the inputs and writes the arena, the
      // logits and the caches. Its key tells MLX's graph cache the child's topology (a chain of
      // `nodes_` kernels) for updating the instantiated graph in place.
      set_dependencies(true);
      graph->api.add_graph_node(encoder_, graph->graph, "(mlxcelpdl" + std::to_string(nodes_) + ")",
                                true);
      graph_ = nullptr;
    }
    api.add_completed_handler(encoder_, [arena = *arena_]() {});
    arena_.reset();
  }

  const char* name() const override { return "CudaDecodeStep"; }

 private:
  static const void* ptr(const std::optional<mx::array>& a) {
    return a ? device_pointer(*a) : nullptr;
  }

  // Adds one kernel node after the previous one (see the file's comment on dependencies); the
  // step's `last` node stands for the whole step: what reads the logits or the caches waits for
  // it.
  void launch(void* function, Dim3 grid, Dim3 block, Args& args, bool last = false,
              unsigned shared_bytes = 0) {
    if (graph_ != nullptr) {
      void* node = nullptr;
      check(*api_,
            add_overlapped_kernel(graph_->api, graph_->graph, prior_, &node, function, grid,
                                  block, shared_bytes, args.params()),
            "adding a kernel of the decode step to its graph");
      prior_ = node;
      ++nodes_;
      return;
    }
    set_dependencies(last);
    api_->add_kernel(encoder_, function, grid, block, Dim3{1, 1, 1}, shared_bytes,
                     args.params());
  }

  // What MLX's encoder makes the next node depend on and produce: the inputs (first node), the
  // arena (every node), the logits and the caches (`last`).
  void set_dependencies(bool last) {
    const LaunchApi& api = *api_;
    const CudaDecoderState& st = *state_;
    if (first_) {
      // The embedding as read (a row-contiguous copy's node when it had to be copied), and the
      // caches, which earlier graphs may still be writing.
      api.set_input(encoder_, *x_);
      for (const auto& in : *inputs_) {
        api.set_input(encoder_, in);
      }
      first_ = false;
    }
    api.set_input(encoder_, *arena_);
    api.set_output(encoder_, *arena_);
    if (last) {
      api.set_output(encoder_, *logits_);
      for (int i = 1; i < 1 + 2 * st.layers; ++i) {
        api.set_output(encoder_, (*inputs_)[i]);
      }
    }
  }

  // The kernel and launch shape of a GEMV of `kind` over `m` (and matrices like it).
  struct GemvLaunch {
    void* function;
    int warps, rows;
    unsigned shared_bytes;
  };
  GemvLaunch pick(const QLinear& m, int kind) const {
    const CudaDecoderState& st = *state_;
    if (st.gemv_tc[kind] != nullptr && m.tensor_core_ok()) {
      const int k = m.cols();
      return {st.gemv_tc[kind], st.tc_shape[0], st.tc_shape[1], unsigned(2 * k + k / 16)};
    }
    return {st.gemv[m.table()][kind], st.shape[kind][0], st.shape[kind][1], 0};
  }

  // The GEMV of `kind` over `segments` (matrices of one K): consecutive segments of equal
  // packing share a launch. `aux`: the RMSNorm weight (GEMV_RMS); `res`: the residual.
  void gemv(int kind, std::initializer_list<Segment> segments, const void* x, const void* aux,
            const void* res, bool last = false) {
    const CudaDecoderState& st = *state_;
    std::vector<Segment> all(segments);
    for (size_t i = 0; i < all.size();) {
      const QLinear& first = *all[i].linear;
      const GemvLaunch how = pick(first, kind);
      const int rpw = how.rows;
      size_t j = i + 1;
      while (j < all.size() && j - i < 3 && all[j].linear->bits == first.bits &&
             all[j].linear->cols() == first.cols() &&
             all[j].linear->groups() == first.groups()) {
        ++j;
      }
      Args a;
      unsigned blocks = 0;
      for (size_t s = 0; s < 3; ++s) {
        const QLinear* m = i + s < j ? all[i + s].linear : nullptr;
        a.ptr(m ? device_pointer(*m->w) : nullptr);
        if (!first.dense()) {
          a.ptr(m ? device_pointer(*m->scales) : nullptr)
              .ptr(m ? device_pointer(*m->biases) : nullptr);
        }
        a.ptr(m ? all[i + s].out : nullptr).i32(m ? m->rows() : 0);
        blocks += m ? unsigned(ceil_div(m->rows(), rpw)) : 0;
      }
      tail_args(a, first, x, aux, res);
      launch(how.function, Dim3{blocks, 1, 1}, Dim3{unsigned(how.warps * 32), 1, 1}, a,
             last && j == all.size(), how.shared_bytes);
      i = j;
    }
  }

  // The MLP's silu(gate) * up (`inter` values) into `out`, from rows [gate_row, gate_row +
  // inter) of `gate` and [up_row, up_row + inter) of `up` (the fused gate|up matrix twice, or
  // the two matrices) applied to rms_norm(x) * aux: one launch of the GLU GEMV.
  void glu(const QLinear& gate, int gate_row, const QLinear& up, int up_row, int inter,
           void* out, const void* x, const void* aux) {
    const CudaDecoderState& st = *state_;
    const size_t elt = mx::size_of(st.dtype);
    const GemvLaunch how = pick(gate, GEMV_GLU);
    const int rpw = how.rows;
    // A row's bytes of weights and of scales (and biases).
    auto rows_of = [&](const QLinear& m, int row) {
      const size_t w_row = m.dense() ? size_t(m.cols()) * elt : size_t(m.words()) * 4;
      const size_t g_row = size_t(m.groups()) * elt;
      const char* w = static_cast<const char*>(device_pointer(*m.w)) + row * w_row;
      const char* s = m.dense() ? nullptr
                                : static_cast<const char*>(device_pointer(*m.scales)) + row * g_row;
      const char* z = m.dense() ? nullptr
                                : static_cast<const char*>(device_pointer(*m.biases)) + row * g_row;
      return std::array<const void*, 3>{w, s, z};
    };
    const auto g = rows_of(gate, gate_row);
    const auto u = rows_of(up, up_row);
    Args a;
    a.ptr(g[0]);
    if (!gate.dense()) {
      a.ptr(g[1]).ptr(g[2]);
    }
    a.ptr(out).i32(inter).ptr(u[0]);
    if (!gate.dense()) {
      a.ptr(u[1]).ptr(u[2]);
    }
    a.ptr(nullptr).i32(inter).ptr(nullptr);
    if (!gate.dense()) {
      a.ptr(nullptr).ptr(nullptr);
    }
    a.ptr(nullptr).i32(0);
    tail_args(a, gate, x, aux, nullptr);
    const unsigned blocks = unsigned(ceil_div(inter, rpw / 2));
    const unsigned threads = unsigned(how.warps * 32);
    launch(how.function, Dim3{blocks, 1, 1}, Dim3{threads, 1, 1}, a, false, how.shared_bytes);
  }

  // A routed-expert feed-forward on `h` (in place): the router's GEMV, then decode_moe.cu's
  // routing, the chosen experts' silu(gate) * up and their weighted down projections with the
  // residual.
  void experts(const Layer& ly, const Moe& m, char* h) {
    const CudaDecoderState& st = *state_;
    const QLinear& router = ly.linear[ROLE_ROUTER];
    const QLinear& gate = ly.linear[ROLE_EXPERT_GATE];
    const QLinear& up = ly.linear[ROLE_EXPERT_UP];
    const QLinear& down = ly.linear[ROLE_EXPERT_DOWN];
    const void* norm = ptr(ly.norm[NORM_POST]);
    const int top_k = ly.routing.top_k;
    const int inter = gate.rows();
    const GemvLaunch how = pick(router, GEMV_RMS);
    void* fused = st.router[router.table()];
    if (fused != nullptr && how.function == st.gemv[router.table()][GEMV_RMS]) {
      // The router's GEMV with the routing in its last block (dec_router): its counter follows
      // the attention's.
      Args r;
      r.ptr(device_pointer(*router.w))
          .ptr(ptr(router.scales))
          .ptr(ptr(router.biases))
          .ptr(m.logits)
          .ptr(h)
          .ptr(norm)
          .i32(router.dense() ? router.cols() : router.words())
          .i32(router.groups())
          .f32(st.eps)
          .ptr(m.xn)
          .ptr(m.ids)
          .ptr(m.weights)
          .ptr(static_cast<int*>(device_pointer(*st.counters)) + st.kv_heads)
          .i32(router.rows())
          .i32(top_k)
          .i32(ly.routing.normalize ? 1 : 0)
          .f32(ly.routing.scale);
      launch(fused, Dim3{unsigned(ceil_div(router.rows(), how.rows)), 1, 1},
             Dim3{unsigned(how.warps * 32), 1, 1}, r);
    } else {
      route(ly, m, h, norm);
    }
    Args g;
    for (const QLinear* q : {&gate, &up}) {
      g.ptr(device_pointer(*q->w)).ptr(ptr(q->scales)).ptr(ptr(q->biases));
    }
    g.ptr(m.ids).ptr(m.xn).ptr(m.act).i32(inter).i32(gate.words32()).i32(gate.groups()).i32(top_k);
    launch(st.moe_glu[gate.table()], Dim3{unsigned(ceil_div(top_k * inter, st.moe_groups)), 1, 1},
           Dim3{MOE_THREADS, 1, 1}, g);
    // Rows per block: the block's lane groups cover every kept expert of each row.
    const int outs = std::max(1, st.moe_groups / top_k);
    Args d;
    d.ptr(device_pointer(*down.w))
        .ptr(ptr(down.scales))
        .ptr(ptr(down.biases))
        .ptr(m.ids)
        .ptr(m.weights)
        .ptr(m.act)
        .ptr(h)
        .ptr(h)
        .i32(st.hidden)
        .i32(down.words32())
        .i32(down.groups())
        .i32(top_k)
        .i32(outs);
    launch(st.moe_down[down.table()], Dim3{unsigned(ceil_div(st.hidden, outs)), 1, 1},
           Dim3{MOE_THREADS, 1, 1}, d);
  }

  // The router's GEMV, then decode_moe.cu's routing as a one-block kernel of its own.
  void route(const Layer& ly, const Moe& m, char* h, const void* norm) {
    const CudaDecoderState& st = *state_;
    const QLinear& router = ly.linear[ROLE_ROUTER];
    const int top_k = ly.routing.top_k;
    gemv(GEMV_RMS, {Segment{&router, m.logits}}, h, norm, nullptr);
    Args r;
    r.ptr(m.logits)
        .ptr(h)
        .ptr(norm)
        .ptr(m.xn)
        .ptr(m.ids)
        .ptr(m.weights)
        .i32(router.rows())
        .i32(top_k)
        .i32(ly.routing.normalize ? 1 : 0)
        .f32(ly.routing.scale)
        .i32(st.hidden)
        .f32(st.eps);
    launch(st.route, Dim3{1, 1, 1}, Dim3{ROUTE_THREADS, 1, 1}, r);
  }

  // The arguments every GEMV kernel of decode.cu ends with: the input, the norm weight, the
  // residual, K (as `m`'s packing gives it) and eps.
  void tail_args(Args& a, const QLinear& m, const void* x, const void* aux,
                 const void* res) const {
    a.ptr(x).ptr(aux).ptr(res);
    if (m.dense()) {
      a.i32(m.cols());
    } else {
      a.i32(m.words()).i32(m.groups());
    }
    a.f32(state_->eps);
  }

  std::shared_ptr<const CudaDecoderState> state_;
  int position_;
  // Set during eval_gpu only.
  const LaunchApi* api_ = nullptr;
  void* encoder_ = nullptr;
  const std::vector<mx::array>* inputs_ = nullptr;
  const mx::array* x_ = nullptr;
  const mx::array* logits_ = nullptr;
  std::optional<mx::array> arena_;
  bool first_ = false;
  // Overlapped launches: the step's graph, its last kernel node and its node count.
  OwnedGraph* graph_ = nullptr;
  void* prior_ = nullptr;
  int nodes_ = 0;
};

void check_vector(const mx::array& a, int n, mx::Dtype dtype, const std::string& what) {
  if (a.ndim() != 1 || a.shape(0) != n || a.dtype() != dtype) {
    throw std::invalid_argument("mlxcel: cuda decoder: " + what + " must be [" +
                                std::to_string(n) + "] in the activations' dtype");
  }
}

}  // namespace

std::unique_ptr<CudaDecoder> cuda_decoder_new(const CudaBinary& binary, bool f16, int32_t hidden,
                                              int32_t heads, int32_t kv_heads, int32_t head_dim,
                                              int32_t layers, float eps, float attn_scale,
                                              rust::Slice<const float> inv_freq, bool traditional,
                                              rust::Slice<const int32_t> shapes,
                                              bool overlap) {
  if (hidden <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 || layers <= 0 ||
      heads % kv_heads != 0) {
    throw std::invalid_argument("mlxcel: cuda decoder: invalid shape");
  }
  if (head_dim > MAX_HEAD_DIM || head_dim % 8 != 0 || heads / kv_heads > MAX_GROUP ||
      size_t(2) * inv_freq.size() > size_t(head_dim) || shapes.size() != 12 ||
      (shapes[8] != 8 && shapes[8] != 16 && shapes[8] != 32) || shapes[9] < 1 ||
      (shapes[11] != 128 && shapes[11] != 256)) {
    throw std::invalid_argument(
        "mlxcel: cuda decoder: head_dim a multiple of 8 up to 256, at most 16 query heads per "
        "key/value head, rope within the head, 8, 16 or 32 lanes per expert row, at least one "
        "attention block of 128 or 256 threads");
  }
  auto d = std::make_unique<CudaDecoder>();
  auto st = std::make_shared<CudaDecoderState>();
  st->binary = &binary;
  st->dtype = f16 ? mx::float16 : mx::bfloat16;
  st->hidden = hidden;
  st->heads = heads;
  st->kv_heads = kv_heads;
  st->head_dim = head_dim;
  st->layers = layers;
  st->eps = eps;
  st->scale = attn_scale;
  st->traditional = traditional;
  st->inv_freq.assign(inv_freq.begin(), inv_freq.end());
  for (int k = 0; k < 3; ++k) {
    st->shape[k][0] = shapes[2 * k];
    st->shape[k][1] = shapes[2 * k + 1];
  }
  st->tc_shape[0] = shapes[6];
  st->tc_shape[1] = shapes[7];
  st->moe_groups = int(MOE_THREADS) / shapes[8];
  st->attn_blocks = shapes[9];
  st->fused_route = shapes[10] != 0;
  st->attn_threads = unsigned(shapes[11]);
  st->overlap = overlap;
  st->layer.resize(layers);
  d->state = std::move(st);
  return d;
}

void cuda_decoder_set_linear(CudaDecoder& d, int32_t layer, int32_t role, const mx::array& w,
                             const mx::array* scales, const mx::array* biases,
                             const mx::array* bias, int32_t group_size, int32_t bits) {
  auto& st = *d.state;
  if (st.finished) {
    throw std::logic_error("mlxcel: cuda decoder: already finished");
  }
  const bool is_head = layer < 0 && role == ROLE_HEAD;
  if (!is_head &&
      (layer < 0 || layer >= st.layers || role < 0 || role >= ROLES || role == ROLE_HEAD)) {
    throw std::invalid_argument("mlxcel: cuda decoder: no projection " + std::to_string(role) +
                                " in " + st.where(layer));
  }
  // Expert stacks are `[experts, rows, words]`, every other projection `[rows, words]`.
  const bool stacked =
      role == ROLE_EXPERT_GATE || role == ROLE_EXPERT_UP || role == ROLE_EXPERT_DOWN;
  const int ndim = stacked ? 3 : 2;
  const bool dense = scales == nullptr && biases == nullptr && bits == 0 && w.ndim() == ndim &&
                     w.dtype() == st.dtype && w.shape(-1) % 8 == 0;
  const bool quantized =
      scales != nullptr && biases != nullptr && (bits == 4 || bits == 8) &&
      (group_size == 32 || group_size == 64 || group_size == 128) && w.ndim() == ndim &&
      w.dtype() == mx::uint32 && scales->dtype() == st.dtype && biases->dtype() == st.dtype &&
      scales->ndim() == ndim && scales->shape(0) == w.shape(0) &&
      (ndim == 2 || scales->shape(1) == w.shape(1)) &&
      scales->shape(-1) * group_size == w.shape(-1) * 32 / bits &&
      biases->shape() == scales->shape();
  if (!dense && !quantized) {
    throw std::invalid_argument("mlxcel: cuda decoder: projection " + std::to_string(role) +
                                " of " + st.where(layer) + " must be " +
                                (stacked ? "a stack of experts, " : "") +
                                "affine 4/8-bit (group 32/64/128, scales and biases in "
                                "the activations' dtype) or dense in the activations' dtype");
  }
  if (bias != nullptr && role != ROLE_Q && role != ROLE_K && role != ROLE_V && role != ROLE_QKV) {
    throw std::invalid_argument("mlxcel: cuda decoder: only q/k/v projections take a bias");
  }
  QLinear q;
  q.w = w;
  if (quantized) {
    q.scales = *scales;
    q.biases = *biases;
  }
  if (bias != nullptr) {
    check_vector(*bias, w.shape(0), st.dtype, "the bias of projection " + std::to_string(role));
    q.bias = *bias;
  }
  q.bits = dense ? 16 : bits;
  (is_head ? st.head : st.layer[layer].linear[role]) = std::move(q);
}

void cuda_decoder_set_routing(CudaDecoder& d, int32_t layer, int32_t top_k, bool normalize,
                              float weight_scale) {
  auto& st = *d.state;
  if (st.finished) {
    throw std::logic_error("mlxcel: cuda decoder: already finished");
  }
  if (layer < 0 || layer >= st.layers || top_k < 1 || top_k > MAX_TOP_K) {
    throw std::invalid_argument("mlxcel: cuda decoder: routing of " + st.where(layer) +
                                ": 1 to " + std::to_string(MAX_TOP_K) + " experts per token");
  }
  st.layer[layer].routing = Routing{top_k, normalize, weight_scale};
}

void cuda_decoder_set_norm(CudaDecoder& d, int32_t layer, int32_t role, const mx::array& w) {
  auto& st = *d.state;
  if (st.finished) {
    throw std::logic_error("mlxcel: cuda decoder: already finished");
  }
  if (layer < 0 && role == NORM_FINAL) {
    check_vector(w, st.hidden, st.dtype, "the final norm");
    st.final_norm = w;
    return;
  }
  if (layer < 0 || layer >= st.layers || role < 0 || role > NORM_K) {
    throw std::invalid_argument("mlxcel: cuda decoder: no norm " + std::to_string(role) + " in " +
                                st.where(layer));
  }
  const int n = role >= NORM_Q ? st.head_dim : st.hidden;
  check_vector(w, n, st.dtype, "norm " + std::to_string(role) + " of " + st.where(layer));
  st.layer[layer].norm[role] = w;
}

void cuda_decoder_finish(CudaDecoder& d) {
  auto& st = *d.state;
  const LaunchApi* api = resolved_launch_api();
  if (api == nullptr) {
    throw std::runtime_error("mlxcel: cuda decoder: MLX's CUDA entry points are not available");
  }
  const int q_dim = st.heads * st.head_dim;
  const int kv_dim = st.kv_heads * st.head_dim;
  std::vector<mx::array> all;
  auto need = [&](const QLinear& m, int rows, int cols, const std::string& what) {
    if (!m.w || (rows > 0 && m.rows() != rows) || m.cols() != cols) {
      throw std::invalid_argument("mlxcel: cuda decoder: " + what + " missing or of the wrong shape");
    }
    all.push_back(*m.w);
    if (!m.dense()) {
      all.push_back(*m.scales);
      all.push_back(*m.biases);
    }
    if (m.bias) {
      all.push_back(*m.bias);
    }
  };
  // One GLU launch reads the gate and the up projection with one packing.
  auto same_format = [](const QLinear& gate, const QLinear& up, const std::string& at) {
    if (gate.bits != up.bits || gate.groups() != up.groups()) {
      throw std::invalid_argument("mlxcel: cuda decoder: gate and up" + at +
                                  " must have the same quantization");
    }
  };
  auto need_mlp = [&](const Layer& ly, const std::string& at) {
    const int inter = ly.linear[ROLE_DOWN].w ? ly.linear[ROLE_DOWN].cols() : 0;
    if (inter <= 0 || inter % 8 != 0) {
      throw std::invalid_argument("mlxcel: cuda decoder: the MLP width" + at +
                                  " must be a multiple of 8");
    }
    if (ly.linear[ROLE_GATE_UP].w) {
      need(ly.linear[ROLE_GATE_UP], 2 * inter, st.hidden, "gate_up" + at);
    } else {
      need(ly.linear[ROLE_GATE], inter, st.hidden, "gate" + at);
      need(ly.linear[ROLE_UP], inter, st.hidden, "up" + at);
      same_format(ly.linear[ROLE_GATE], ly.linear[ROLE_UP], at);
    }
    need(ly.linear[ROLE_DOWN], st.hidden, inter, "down" + at);
    st.inter = std::max(st.inter, inter);
  };
  auto need_experts = [&](const Layer& ly, const std::string& at) {
    const QLinear& router = ly.linear[ROLE_ROUTER];
    const QLinear& down = ly.linear[ROLE_EXPERT_DOWN];
    need(router, 0, st.hidden, "the router" + at);
    const int experts = router.rows();
    const int inter = down.w ? down.cols() : 0;
    const int top_k = ly.routing.top_k;
    if (experts > MAX_EXPERTS || top_k > experts || inter <= 0 || inter % 8 != 0) {
      throw std::invalid_argument("mlxcel: cuda decoder: the experts" + at + " (" +
                                  std::to_string(experts) + ", " + std::to_string(top_k) +
                                  " per token, width " + std::to_string(inter) +
                                  "): at most " + std::to_string(MAX_EXPERTS) +
                                  " experts and a width a multiple of 8");
    }
    for (int role : {ROLE_EXPERT_GATE, ROLE_EXPERT_UP, ROLE_EXPERT_DOWN}) {
      const QLinear& m = ly.linear[role];
      if (m.w && m.experts() != experts) {
        throw std::invalid_argument("mlxcel: cuda decoder: an expert stack" + at + " has " +
                                    std::to_string(m.experts()) + " experts, the router " +
                                    std::to_string(experts));
      }
    }
    need(ly.linear[ROLE_EXPERT_GATE], inter, st.hidden, "the experts' gate" + at);
    need(ly.linear[ROLE_EXPERT_UP], inter, st.hidden, "the experts' up" + at);
    same_format(ly.linear[ROLE_EXPERT_GATE], ly.linear[ROLE_EXPERT_UP], at);
    need(down, st.hidden, inter, "the experts' down" + at);
    st.experts = std::max(st.experts, experts);
    st.top_k = std::max(st.top_k, top_k);
    st.moe_inter = std::max(st.moe_inter, top_k * inter);
  };
  for (int l = 0; l < st.layers; ++l) {
    const Layer& ly = st.layer[l];
    const std::string at = " of " + st.where(l);
    if (ly.linear[ROLE_QKV].w) {
      need(ly.linear[ROLE_QKV], q_dim + 2 * kv_dim, st.hidden, "qkv" + at);
    } else {
      need(ly.linear[ROLE_Q], q_dim, st.hidden, "q" + at);
      need(ly.linear[ROLE_K], kv_dim, st.hidden, "k" + at);
      need(ly.linear[ROLE_V], kv_dim, st.hidden, "v" + at);
    }
    need(ly.linear[ROLE_O], st.hidden, q_dim, "o" + at);
    if (ly.moe()) {
      need_experts(ly, at);
    } else {
      need_mlp(ly, at);
    }
    if (!ly.norm[NORM_INPUT] || !ly.norm[NORM_POST] || bool(ly.norm[NORM_Q]) != bool(ly.norm[NORM_K])) {
      throw std::invalid_argument("mlxcel: cuda decoder: norms" + at + " missing");
    }
    for (const auto& n : ly.norm) {
      if (n) {
        all.push_back(*n);
      }
    }
  }
  need(st.head, 0, st.hidden, "the output head");
  if (!st.final_norm) {
    throw std::invalid_argument("mlxcel: cuda decoder: the final norm is missing");
  }
  all.push_back(*st.final_norm);
  // A model without rope still passes the kernel a valid (unread) pointer.
  const int rot_half = static_cast<int>(st.inv_freq.size());
  st.inv_freq_dev = rot_half > 0
                        ? mx::array(st.inv_freq.data(), mx::Shape{rot_half}, mx::float32)
                        : mx::zeros({1}, mx::float32);
  all.push_back(*st.inv_freq_dev);
  // dec_attention's counter per key/value head, then dec_router's.
  std::vector<int32_t> zeros(st.kv_heads + 1, 0);
  st.counters = mx::array(zeros.data(), mx::Shape{st.kv_heads + 1}, mx::int32);
  all.push_back(*st.counters);
  // Contiguous, evaluated weights: the kernels read them by address.
  mx::eval(all);
  for (auto& a : all) {
    if (!a.flags().row_contiguous) {
      throw std::invalid_argument("mlxcel: cuda decoder: a weight is not row-contiguous");
    }
  }
  const std::string t = st.dtype == mx::float16 ? "float16" : "bfloat16";
  const char* kinds[3] = {"rms", "res", "glu"};
  const char* tables[3] = {"qmv_b4", "qmv_b8", "dmv"};
  // The module has the GEMVs of the weight formats the model uses only.
  bool used[3] = {};
  auto use = [&used](const QLinear& m) {
    if (m.w) {
      used[m.table()] = true;
    }
  };
  for (const Layer& ly : st.layer) {
    for (const QLinear& m : ly.linear) {
      use(m);
    }
  }
  use(st.head);
  for (int b = 0; b < 3; ++b) {
    for (int k = 0; k < 3 && used[b]; ++k) {
      st.gemv[b][k] = function(*api, *st.binary,
                               std::string("mlxcel_dec_") + tables[b] + "_" + kinds[k] + "_" + t);
    }
  }
  if (used[0] && st.tc_shape[0] > 0) {
    for (int k = 0; k < 3; ++k) {
      st.gemv_tc[k] =
          function(*api, *st.binary, std::string("mlxcel_dec_qmt_b4_") + kinds[k] + "_" + t);
    }
  }
  st.attention = function(*api, *st.binary, "mlxcel_dec_attention_" + t);
  if (st.overlap) {
    const OverlapApi* overlap = overlap_api();
    st.overlap = overlap != nullptr && overlap_supported(*overlap, st.attention);
  }
  if (st.top_k > 0) {
    st.route = function(*api, *st.binary, "mlxcel_dec_route_" + t);
    const char* formats[3] = {"b4", "b8", "dense"};
    for (int b = 0; b < 3; ++b) {
      if (used[b]) {
        st.moe_glu[b] =
            function(*api, *st.binary, std::string("mlxcel_dec_moe_glu_") + formats[b] + "_" + t);
        st.moe_down[b] =
            function(*api, *st.binary, std::string("mlxcel_dec_moe_down_") + formats[b] + "_" + t);
        if (st.fused_route) {
          st.router[b] =
              function(*api, *st.binary, std::string("mlxcel_dec_router_") + formats[b] + "_" + t);
        }
      }
    }
  }
  st.finished = true;
}

bool cuda_decoder_overlapped(const CudaDecoder& d) { return d.state->finished && d.state->overlap; }

std::unique_ptr<array> cuda_decoder_step(const CudaDecoder& d, const mx::array& x,
                                         const ArrayVec& keys, const ArrayVec& values,
                                         int64_t position) {
  const auto& st = *d.state;
  if (!st.finished) {
    throw std::logic_error("mlxcel: cuda decoder: step before finish");
  }
  if (x.shape() != mx::Shape{1, 1, st.hidden} || x.dtype() != st.dtype) {
    throw std::invalid_argument("mlxcel: cuda decoder: the token's embedding must be [1, 1, " +
                                std::to_string(st.hidden) + "] in the activations' dtype");
  }
  if (keys.items.size() != size_t(st.layers) || values.items.size() != size_t(st.layers)) {
    throw std::invalid_argument("mlxcel: cuda decoder: one key and one value buffer per layer");
  }
  std::vector<mx::array> inputs{x};
  for (const auto* list : {&keys, &values}) {
    for (const auto& c : list->items) {
      const bool ok = c.ndim() == 4 && c.shape(0) == 1 && c.shape(1) == st.kv_heads &&
                      c.shape(3) == st.head_dim && c.dtype() == st.dtype &&
                      position >= 0 && position < c.shape(2) &&
                      c.status() != mx::array::Status::unscheduled && c.flags().row_contiguous;
      if (!ok) {
        throw std::invalid_argument(
            "mlxcel: cuda decoder: a cache buffer must be an evaluated, row-contiguous [1, " +
            std::to_string(st.kv_heads) + ", capacity > position, " +
            std::to_string(st.head_dim) + "] array in the activations' dtype");
      }
      inputs.push_back(c);
    }
  }
  const int vocab = st.head.rows();
  auto primitive = std::make_shared<CudaDecodeStep>(mx::default_stream(mx::default_device()),
                                                    d.state, static_cast<int>(position));
  return std::make_unique<array>(
      mx::array(mx::Shape{1, 1, vocab}, st.dtype, std::move(primitive), std::move(inputs)));
}

}  // namespace mlxcel
