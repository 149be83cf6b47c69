// The C++ side of the mlxcel-core bridge: thin, fallible wrappers over MLX's C++ API.
// Each function may throw; cxx turns the exception into a Rust `Err` (every bridge function is
// declared `Result<..>` in src/ffi.rs).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/distributed/distributed.h"
#include "mlx/distributed/ops.h"
#include "rust/cxx.h"

namespace mlxcel {

using mlx::core::array;
struct BorrowedBytesOwner;
enum class Dtype : int32_t;
enum class DeviceKind : int32_t;

struct ArrayVec {
  std::vector<array> items;
};

struct CustomKernel {
  mlx::core::fast::CustomKernelFunction fn;
};

// A compiled CUDA module image (cubin) holding one `extern "C"` kernel (see cuda_compile.cc) and
// the gather kernels of kernels/cuda/gather.cu; launched by cuda_launch.cc.
struct CudaBinary {
  std::string image;
  std::string kernel;
  // Loaded at the first call, then fixed: the kernel and mlxcel_gather_{1,2,4,8}.
  mutable std::mutex mutex;
  mutable void* function = nullptr;
  mutable void* gather[4] = {};
  // The loaded module (a CUmodule), for modules holding several kernels (the decode step's).
  mutable void* module = nullptr;
};

using Ptr = std::unique_ptr<array>;

// A group of processes of MLX's distributed layer (mlx::core::distributed::Group).
struct DistGroup {
  mlx::core::distributed::Group group;
};

// The CPU decode engine (cpu_decode.cc); its state is defined there.
struct CpuDecoderState;
struct CpuDecoder {
  std::unique_ptr<CpuDecoderState> state;
  CpuDecoder();
  ~CpuDecoder();
};
std::unique_ptr<CpuDecoder> cpu_decoder_new(int32_t hidden, int32_t heads, int32_t kv_heads,
                                            int32_t head_dim, int32_t layers, float eps,
                                            float attn_scale, rust::Slice<const float> inv_freq,
                                            bool traditional);
void cpu_decoder_set_linear(CpuDecoder& d, int32_t layer, int32_t role, const array& w,
                            const array* scales, const array* biases, const array* bias,
                            int32_t group_size, int32_t bits);
void cpu_decoder_set_norm(CpuDecoder& d, int32_t layer, int32_t role, const array& w);
void cpu_decoder_finish(CpuDecoder& d);
int64_t cpu_decoder_vocab(const CpuDecoder& d);
void cpu_decoder_step(CpuDecoder& d, const array& x, rust::Slice<const size_t> keys,
                      rust::Slice<const size_t> values, rust::Slice<const int64_t> capacity,
                      int64_t position, rust::Slice<float> logits);
// The CUDA decode step (cuda_decode.cc); its state is defined there and shared with the steps
// in flight.
struct CudaDecoderState;
struct CudaDecoder {
  std::shared_ptr<CudaDecoderState> state;
  CudaDecoder();
  ~CudaDecoder();
};
std::unique_ptr<CudaDecoder> cuda_decoder_new(const CudaBinary& binary, bool f16, int32_t hidden,
                                              int32_t heads, int32_t kv_heads, int32_t head_dim,
                                              int32_t layers, float eps, float attn_scale,
                                              rust::Slice<const float> inv_freq, bool traditional,
                                              rust::Slice<const int32_t> shapes,
                                              bool overlap);
void cuda_decoder_set_linear(CudaDecoder& d, int32_t layer, int32_t role, const array& w,
                             const array* scales, const array* biases, const array* bias,
                             int32_t group_size, int32_t bits);
void cuda_decoder_set_routing(CudaDecoder& d, int32_t layer, int32_t top_k, bool normalize,
                              float weight_scale);
void cuda_decoder_set_norm(CudaDecoder& d, int32_t layer, int32_t role, const array& w);
void cuda_decoder_finish(CudaDecoder& d);
bool cuda_decoder_overlapped(const CudaDecoder& d);
std::unique_ptr<array> cuda_decoder_step(const CudaDecoder& d, const array& x,
                                         const ArrayVec& keys, const ArrayVec& values,
                                         int64_t position);
bool array_is_donatable(const array& a);
bool array_is_row_contiguous(const array& a);

rust::String mlx_version();
DeviceKind default_device_kind();
void set_default_device_kind(DeviceKind kind);
bool device_available(DeviceKind kind);
size_t device_memory_bytes(DeviceKind kind);
size_t active_memory();
size_t peak_memory();
void reset_peak_memory();
size_t cache_memory();
size_t set_cache_limit(size_t bytes);
size_t set_memory_limit(size_t bytes);
void clear_cache();

Ptr array_clone(const array& a);
Ptr array_from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, Dtype dtype);
// The bytes at `offset` of the open file `fd` in a new array in device memory on MLX's CUDA
// backend, read by `readers` threads (kept for the process when `pooled`; cuda_load.cc), or
// null where the CUDA driver is not in the process.
Ptr array_from_file_on_device(int32_t fd, uint64_t offset, size_t nbytes,
                              rust::Slice<const int32_t> shape, Dtype dtype, int32_t readers,
                              bool pooled);
Ptr array_borrowing_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape,
                          Dtype dtype, rust::Box<BorrowedBytesOwner> owner);
size_t array_data_address(const array& a);
Ptr array_scalar_f64(double value, Dtype dtype);
rust::Vec<int32_t> array_shape(const array& a);
Dtype array_dtype(const array& a);
size_t array_size(const array& a);
size_t array_nbytes(const array& a);
bool array_is_available(const array& a);
void array_copy_to_host(const array& a, rust::Slice<uint8_t> out);
void array_eval(const array& a);
double array_item_f64(const array& a);

std::unique_ptr<ArrayVec> new_array_vec();
void array_vec_push(ArrayVec& v, const array& a);
size_t array_vec_len(const ArrayVec& v);
Ptr array_vec_get(const ArrayVec& v, size_t index);
void eval_all(const ArrayVec& v);
void async_eval_all(const ArrayVec& v);
rust::String graph_census(const ArrayVec& v);

Ptr unary_op(rust::Str name, const array& a);
Ptr binary_op(rust::Str name, const array& a, const array& b);
Ptr reduce_op(rust::Str name, const array& a, rust::Slice<const int32_t> axes, bool keepdims);

Ptr zeros(rust::Slice<const int32_t> shape, Dtype dtype);
Ptr ones(rust::Slice<const int32_t> shape, Dtype dtype);
Ptr full(rust::Slice<const int32_t> shape, const array& value, Dtype dtype);
Ptr arange(double start, double stop, double step, Dtype dtype);

Ptr astype(const array& a, Dtype dtype);
Ptr view_as(const array& a, Dtype dtype);
Ptr reshape(const array& a, rust::Slice<const int32_t> shape);
Ptr transpose(const array& a, rust::Slice<const int32_t> axes);
Ptr broadcast_to(const array& a, rust::Slice<const int32_t> shape);
Ptr expand_dims(const array& a, rust::Slice<const int32_t> axes);
Ptr squeeze(const array& a, rust::Slice<const int32_t> axes);
Ptr contiguous(const array& a);
Ptr slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop,
          rust::Slice<const int32_t> strides);
Ptr slice_dynamic(const array& a, const array& start, rust::Slice<const int32_t> axes,
                  rust::Slice<const int32_t> sizes);
Ptr slice_update(const array& src, const array& update, rust::Slice<const int32_t> start,
                 rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides);
Ptr slice_update_dynamic(const array& src, const array& update, const array& start,
                         rust::Slice<const int32_t> axes);
Ptr concatenate(const ArrayVec& arrays, int32_t axis);
Ptr stack(const ArrayVec& arrays, int32_t axis);
std::unique_ptr<ArrayVec> split_at(const array& a, rust::Slice<const int32_t> indices, int32_t axis);
std::unique_ptr<ArrayVec> split_equal(const array& a, int32_t parts, int32_t axis);
Ptr take(const array& a, const array& indices, int32_t axis);
Ptr take_along_axis(const array& a, const array& indices, int32_t axis);
Ptr put_along_axis(const array& a, const array& indices, const array& values, int32_t axis);
Ptr where_(const array& cond, const array& x, const array& y);

Ptr addmm(const array& c, const array& a, const array& b, float alpha, float beta);
Ptr softmax(const array& a, rust::Slice<const int32_t> axes, bool precise);
Ptr argmax(const array& a, int32_t axis, bool keepdims);
Ptr argmin(const array& a, int32_t axis, bool keepdims);
Ptr argpartition(const array& a, int32_t kth, int32_t axis);
Ptr topk(const array& a, int32_t k, int32_t axis);
Ptr sort(const array& a, int32_t axis);
Ptr argsort(const array& a, int32_t axis);
Ptr cumsum(const array& a, int32_t axis, bool reverse, bool inclusive);
Ptr clip(const array& a, const array* lo, const array* hi);
Ptr conv1d(const array& input, const array& weight, int32_t stride, int32_t padding,
           int32_t dilation, int32_t groups);

std::unique_ptr<ArrayVec> quantize(const array& w, int32_t group_size, int32_t bits, rust::Str mode);
Ptr dequantize(const array& w, const array& scales, const array* biases, int32_t group_size,
               int32_t bits, rust::Str mode, int32_t out_dtype);
Ptr quantized_matmul(const array& x, const array& w, const array& scales, const array* biases,
                     bool transpose, int32_t group_size, int32_t bits, rust::Str mode);
Ptr gather_qmm(const array& x, const array& w, const array& scales, const array* biases,
               const array* lhs_indices, const array* rhs_indices, bool transpose,
               int32_t group_size, int32_t bits, rust::Str mode, bool sorted_indices);
Ptr gather_mm(const array& a, const array& b, const array* lhs_indices, const array* rhs_indices,
              bool sorted_indices);
// act(x @ W^T + bias) on mlxcel's own CPU kernel (cpu_linear.cc); bits 0 means W is dense; bias
// [N] may be null; activation: 0 none, 1 GELU (erf), 2 GELU (tanh), 3 ReLU, 4 SiLU.
Ptr cpu_linear(const array& x, const array& w, const array* scales, const array* biases,
               int32_t group_size, int32_t bits, const array* bias, int32_t activation);
// x @ W^T + (x @ lora_a) @ lora_b in one node of the same kernel: a runtime LoRA term over a dense
// or affine-quantized base, lora_a = Aᵀ [K, r] and lora_b = scaled Bᵀ [r, N], float32.
Ptr cpu_linear_low_rank(const array& x, const array& w, const array* scales,
                        const array* biases, int32_t group_size, int32_t bits,
                        const array& lora_a, const array& lora_b);
// The routed-expert form: row i of x against expert ids[i, j] of the stack w [E, N, K] for each
// of the ids per row; out [..ids, 1, N] (cpu_linear.cc).
Ptr cpu_gather_linear(const array& x, const array& w, const array& scales, const array& biases,
                      const array& ids, int32_t group_size, int32_t bits);

Ptr gated_activation(rust::Str kind, const array& gate, const array& up, bool fused);
// Attention on mlxcel's CPU pool (cpu_attention.cc): float32; no mask, causal, or an additive
// float mask broadcastable to [B, Hq, L, S] (`mask` non-null, then `causal` must be false).
Ptr cpu_attention(const array& q, const array& k, const array& v, const array* mask, float scale,
                  bool causal);
// The selective state-space recurrence on mlxcel's CPU pool (cpu_scan.cc): float32 x [B, L, H, P],
// dt [B, L, H], A [H, N] (the same for every n when `per_head_decay`), B and C [B, L, G, N],
// initial state [B, H, P, N]; out [B, L·H·P + H·P·N]: y [L, H, P] then the last state per row.
Ptr cpu_selective_scan(const array& x, const array& dt, const array& a, const array& bm,
                       const array& cm, const array& h0, bool per_head_decay);
// RWKV-7's generalised delta rule on mlxcel's CPU pool (cpu_scan.cc): float32 r, w, k, v, a, b
// [B, L, H, D], state [B, H, D(v), D(k)]; out [B, L·H·D + H·D·D]: y [L, H, D] then the last state.
Ptr cpu_delta_rule_scan(const array& r, const array& w, const array& k, const array& v,
                        const array& a, const array& b, const array& s0);
Ptr rms_norm(const array& x, const array* weight, float eps);
Ptr layer_norm(const array& x, const array* weight, const array* bias, float eps);
Ptr rope(const array& x, int32_t dims, bool traditional, float base, bool has_base, float scale,
         int32_t offset, const array* freqs);
// Rope with one offset per batch row (`offsets` [B] int32): rows at different positions.
Ptr rope_offsets(const array& x, int32_t dims, bool traditional, float base, bool has_base,
                 float scale, const array& offsets, const array* freqs);
Ptr scaled_dot_product_attention(const array& q, const array& k, const array& v, float scale,
                                 rust::Str mask_mode, const array* mask, const array* sinks);

Ptr random_key(uint64_t seed);
Ptr random_split(const array& key, int32_t parts);
Ptr random_categorical(const array& logits, int32_t axis, const array& key);
Ptr random_uniform(rust::Slice<const int32_t> shape, Dtype dtype, const array& key);

std::unique_ptr<CustomKernel> custom_kernel_new(rust::Str backend, rust::Str name,
                                                const rust::Vec<rust::String>& input_names,
                                                const rust::Vec<rust::String>& output_names,
                                                rust::Str source, rust::Str header);
// The runtime policy's values for the C++ kernels (set by mlxcel_core::policy::install).
// Threads of the CPU kernel's pool (0: default), before its first use (cpu_linear.cc).
void set_cpu_threads(int32_t threads);
// Runs `calls` back-to-back calls of the CPU kernel's thread pool with 2-9 tasks each; returns
// how many calls did not run each of their tasks exactly once before returning (0 when sound).
int64_t cpu_pool_check(int32_t calls);
// One-row 4/8-bit CPU products on int8-quantized activations (cpu_gemv_avx512.inc).
void set_cpu_int8_activations(bool on);
// Launch mlxcel's CUDA kernels through MLX's precompiled_cuda_kernel (cuda_launch.cc).
void set_cuda_launch_mlx(bool through_mlx);
// Copies `bytes` into `a`'s device buffer from byte `offset` with the CUDA driver, after all
// queued device work and before returning (cuda_launch.cc); false when MLX's CUDA backend is not
// in the process. The caller checks that nothing else holds `a`.
bool write_device_bytes(const mlx::core::array& a, size_t offset,
                        rust::Slice<const uint8_t> bytes);
int32_t cuda_device_arch();
rust::Vec<uint8_t> cuda_compile(rust::Str source, rust::Str name, int32_t arch);
std::unique_ptr<CudaBinary> cuda_binary_new(rust::Slice<const uint8_t> image, rust::Str kernel);
// The outputs of `binary`'s kernel as mlxcel's own primitive (cuda_launch.cc), or nullopt when
// MLX's CUDA entry points it needs are not in the process.
std::optional<std::vector<mlx::core::array>> launch_cuda_binary(
    const CudaBinary& binary, const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::Shape> output_shapes,
    const std::vector<mlx::core::Dtype>& output_dtypes, const std::vector<int32_t>& scalars,
    const std::array<int32_t, 3>& grid, const std::array<int32_t, 3>& threadgroup);
std::unique_ptr<ArrayVec> cuda_binary_call(const CudaBinary& binary,
                                           const ArrayVec& inputs,
                                           rust::Slice<const int32_t> output_shapes,
                                           rust::Slice<const int32_t> output_ndims,
                                           rust::Slice<const Dtype> output_dtypes,
                                           rust::Slice<const int32_t> scalars,
                                           rust::Slice<const int32_t> grid,
                                           rust::Slice<const int32_t> threadgroup);
std::unique_ptr<ArrayVec> custom_kernel_call(const CustomKernel& kernel, const ArrayVec& inputs,
                                             rust::Slice<const int32_t> output_shapes,
                                             rust::Slice<const int32_t> output_ndims,
                                             rust::Slice<const Dtype> output_dtypes,
                                             rust::Slice<const int32_t> grid,
                                             rust::Slice<const int32_t> threadgroup,
                                             const rust::Vec<rust::String>& template_names,
                                             rust::Slice<const int32_t> template_values);

// ---- distributed (mlx::core::distributed; distributed.cc) ----
bool distributed_is_available(rust::Str backend);
std::unique_ptr<DistGroup> distributed_init(bool strict, rust::Str backend);
std::unique_ptr<DistGroup> group_clone(const DistGroup& g);
int32_t group_rank(const DistGroup& g);
int32_t group_size(const DistGroup& g);
std::unique_ptr<DistGroup> group_split(const DistGroup& g, int32_t color, int32_t key);
Ptr dist_all_sum(const array& x, const DistGroup& g);
Ptr dist_all_max(const array& x, const DistGroup& g);
Ptr dist_all_gather(const array& x, const DistGroup& g);
Ptr dist_send(const array& x, int32_t dst, const DistGroup& g);
Ptr dist_recv(rust::Slice<const int32_t> shape, Dtype dtype, int32_t src, const DistGroup& g);
// `inputs` unchanged, but evaluated only after `dependencies` (mlx::core::depends).
std::unique_ptr<ArrayVec> depends(const ArrayVec& inputs, const ArrayVec& dependencies);

}  // namespace mlxcel
