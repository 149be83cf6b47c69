// Implementation of the bridge declared in src/ffi.rs. Every function may throw: cxx catches the
// exception and returns it to Rust as `Err`. Keep these wrappers free of policy: argument
// conversion and one MLX call each.
#include "mlxcel-core/cpp/shim.h"

#include <cstring>
#include <functional>
#include <optional>
#include <stdexcept>
#include <thread>
#include <algorithm>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "mlx/primitives.h"
#include "mlxcel-core/src/ffi.rs.h"
#include "mlxcel-core/cpp/cuda_api.h"

namespace mlxcel {

namespace mx = mlx::core;

namespace {

mx::Dtype to_mlx(Dtype d) {
  switch (d) {
    case Dtype::Bool: return mx::bool_;
    case Dtype::Uint8: return mx::uint8;
    case Dtype::Uint16: return mx::uint16;
    case Dtype::Uint32: return mx::uint32;
    case Dtype::Uint64: return mx::uint64;
    case Dtype::Int8: return mx::int8;
    case Dtype::Int16: return mx::int16;
    case Dtype::Int32: return mx::int32;
    case Dtype::Int64: return mx::int64;
    case Dtype::Float16: return mx::float16;
    case Dtype::Bfloat16: return mx::bfloat16;
    case Dtype::Float32: return mx::float32;
    case Dtype::Float64: return mx::float64;
    case Dtype::Complex64: return mx::complex64;
  }
  throw std::invalid_argument("mlxcel: unknown dtype code " + std::to_string(int32_t(d)));
}

Dtype from_mlx(mx::Dtype d) {
  switch (d.val()) {
    case mx::Dtype::Val::bool_: return Dtype::Bool;
    case mx::Dtype::Val::uint8: return Dtype::Uint8;
    case mx::Dtype::Val::uint16: return Dtype::Uint16;
    case mx::Dtype::Val::uint32: return Dtype::Uint32;
    case mx::Dtype::Val::uint64: return Dtype::Uint64;
    case mx::Dtype::Val::int8: return Dtype::Int8;
    case mx::Dtype::Val::int16: return Dtype::Int16;
    case mx::Dtype::Val::int32: return Dtype::Int32;
    case mx::Dtype::Val::int64: return Dtype::Int64;
    case mx::Dtype::Val::float16: return Dtype::Float16;
    case mx::Dtype::Val::bfloat16: return Dtype::Bfloat16;
    case mx::Dtype::Val::float32: return Dtype::Float32;
    case mx::Dtype::Val::float64: return Dtype::Float64;
    case mx::Dtype::Val::complex64: return Dtype::Complex64;
  }
  throw std::invalid_argument("mlxcel: MLX dtype has no mlxcel equivalent");
}

mx::Device::DeviceType to_mlx(DeviceKind k) {
  return k == DeviceKind::Gpu ? mx::Device::gpu : mx::Device::cpu;
}

mx::Shape shape_of(rust::Slice<const int32_t> s) { return mx::Shape(s.begin(), s.end()); }
std::vector<int> ints(rust::Slice<const int32_t> s) { return std::vector<int>(s.begin(), s.end()); }
std::string str(rust::Str s) { return std::string(s); }
Ptr wrap(mx::array a) { return std::make_unique<array>(std::move(a)); }
std::optional<array> opt(const array* a) {
  return a ? std::optional<array>(*a) : std::nullopt;
}
std::unique_ptr<ArrayVec> wrap_vec(std::vector<array> items) {
  auto v = std::make_unique<ArrayVec>();
  v->items = std::move(items);
  return v;
}

using UnaryFn = std::function<array(const array&)>;
using BinaryFn = std::function<array(const array&, const array&)>;
using ReduceFn = std::function<array(const array&, const std::vector<int>&, bool)>;
#include "ops_table.inc"

template <typename Map>
const typename Map::mapped_type& lookup(const Map& table, rust::Str name, const char* family) {
  auto it = table.find(str(name));
  if (it == table.end()) {
    throw std::invalid_argument(std::string("mlxcel: no ") + family + " op named " + str(name));
  }
  return it->second;
}

}  // namespace

rust::String mlx_version() { return rust::String(mx::version()); }

DeviceKind default_device_kind() {
  return mx::default_device().type == mx::Device::gpu ? DeviceKind::Gpu : DeviceKind::Cpu;
}
void set_default_device_kind(DeviceKind kind) { mx::set_default_device(mx::Device(to_mlx(kind))); }
bool device_available(DeviceKind kind) { return mx::is_available(mx::Device(to_mlx(kind))); }
size_t device_memory_bytes(DeviceKind kind) {
  // Total memory as the backend reports it (0 when it does not).
  const auto& info = mx::device_info(mx::Device(to_mlx(kind)));
  for (const char* key : {"total_memory", "memory_size"}) {
    auto it = info.find(key);
    if (it != info.end()) {
      if (auto v = std::get_if<size_t>(&it->second)) return *v;
    }
  }
  return 0;
}
size_t active_memory() { return mx::get_active_memory(); }
size_t peak_memory() { return mx::get_peak_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
size_t cache_memory() { return mx::get_cache_memory(); }
size_t set_cache_limit(size_t bytes) { return mx::set_cache_limit(bytes); }
size_t set_memory_limit(size_t bytes) { return mx::set_memory_limit(bytes); }
void clear_cache() { mx::clear_cache(); }

Ptr array_clone(const array& a) { return std::make_unique<array>(a); }

namespace {
void check_byte_count(size_t bytes, rust::Slice<const int32_t> shape, mx::Dtype dt) {
  size_t count = 1;
  for (auto d : shape) {
    if (d < 0) throw std::invalid_argument("mlxcel: negative dimension in shape");
    count *= size_t(d);
  }
  if (count * dt.size() != bytes) {
    throw std::invalid_argument("mlxcel: " + std::to_string(bytes) +
                                " bytes do not fill a tensor of " + std::to_string(count) +
                                " elements of " + std::to_string(dt.size()) + " bytes");
  }
}
}  // namespace

// Copies large tensors with several threads: one core's memcpy (with the page faults of a
// freshly mapped file and of a fresh MLX allocation) is far below what memory and the page
// cache deliver, and a checkpoint is gigabytes of such copies.
static void parallel_copy(void* dst, const void* src, size_t bytes) {
  constexpr size_t kMinPerThread = size_t(8) << 20;
  const size_t hw = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::min<size_t>({hw, size_t(8), bytes / kMinPerThread});
  if (threads <= 1) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const size_t span = (bytes + threads - 1) / threads;
  std::vector<std::thread> workers;
  for (size_t t = 1; t < threads; ++t) {
    const size_t begin = t * span;
    const size_t len = std::min(span, bytes - std::min(bytes, begin));
    if (len == 0) break;
    workers.emplace_back([=] {
      std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, len);
    });
  }
  std::memcpy(dst, src, std::min(span, bytes));
  for (auto& w : workers) w.join();
}

Ptr array_from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape,
                     Dtype dtype) {
  auto dt = to_mlx(dtype);
  check_byte_count(data.size(), shape, dt);
  // One copy, straight into an MLX-owned buffer (public allocator API), so the array never
  // points at memory Rust may free or unmap.
  auto buffer = mx::allocator::malloc(data.size());
  if (data.size() > 0) parallel_copy(buffer.buffer().raw_ptr(), data.data(), data.size());
  return wrap(array(std::move(buffer), shape_of(shape), dt));
}

Ptr array_from_file_on_device(int32_t fd, uint64_t offset, size_t nbytes,
                              rust::Slice<const int32_t> shape, Dtype dtype, int32_t readers,
                              bool pooled) {
  auto dt = to_mlx(dtype);
  check_byte_count(nbytes, shape, dt);
  auto a = cuda::read_file_to_device(fd, offset, nbytes, shape_of(shape), dt, readers, pooled);
  return a ? wrap(std::move(*a)) : nullptr;
}

namespace {
// Whether the allocator in this libmlx is MLX's common CPU allocator, whose buffers are a size
// header followed by the data: checked on a real allocation (the CUDA and Metal allocators lay
// buffers out differently; there borrowing falls back to a copy).
bool cpu_allocator_wraps_foreign_memory() {
  static const bool wraps = [] {
    auto probe = mx::allocator::malloc(64);
    auto buffer = probe.buffer();
    return buffer.raw_ptr() == static_cast<char*>(buffer.ptr()) + sizeof(size_t);
  }();
  return wraps;
}
}  // namespace

Ptr array_borrowing_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape,
                          Dtype dtype, rust::Box<BorrowedBytesOwner> owner) {
  auto dt = to_mlx(dtype);
  check_byte_count(data.size(), shape, dt);
  // std::function needs a copyable callable; the shared_ptr makes the owner's drop happen once,
  // when MLX calls the deleter (after the last array using the memory is gone, or right after
  // its copy when the allocator cannot wrap foreign memory).
  auto hold = std::make_shared<rust::Box<BorrowedBytesOwner>>(std::move(owner));
  if (!cpu_allocator_wraps_foreign_memory() || data.size() == 0) {
    // Copy (the deleter runs right after it).
    return wrap(array(const_cast<uint8_t*>(data.data()), shape_of(shape), dt,
                      [hold](void*) mutable { hold.reset(); }));
  }
  // MLX's CPU allocator keeps each allocation's size in the 8 bytes before the data and its
  // Buffer points at that header (raw_ptr() = ptr + 8); `array(void*, ...)` always copies on
  // it. A Buffer pointing 8 bytes before the borrowed bytes gives MLX exactly that view; the
  // Data is not owned (no free), its deleter drops the owner. Checkpoint tensors never start
  // in the first 8 bytes of a file, so those 8 bytes are mapped too.
  auto* start = const_cast<uint8_t*>(data.data()) - sizeof(size_t);
  mx::allocator::Data borrowed(mx::allocator::Buffer(start),
                               [hold](mx::allocator::Buffer) mutable { hold.reset(); });
  return wrap(array(std::move(borrowed), shape_of(shape), dt));
}

bool array_is_donatable(const array& a) { return a.is_donatable(); }
bool array_is_row_contiguous(const array& a) { return a.flags().row_contiguous; }

size_t array_data_address(const array& a) {
  return reinterpret_cast<size_t>(a.data<void>());
}

Ptr array_scalar_f64(double value, Dtype dtype) {
  // Converted on the host at construction: no op, no device (a CPU-stream astype here would
  // make every GPU graph using the scalar wait on the CPU stream).
  auto dt = to_mlx(dtype);
  if (dt == mx::bool_) return wrap(array(value != 0.0, dt));
  if (mx::issubdtype(dt, mx::integer)) return wrap(array(static_cast<int64_t>(value), dt));
  if (dt == mx::float64) return wrap(array(value, dt));
  return wrap(array(static_cast<float>(value), dt));
}

rust::Vec<int32_t> array_shape(const array& a) {
  rust::Vec<int32_t> out;
  for (auto d : a.shape()) out.push_back(d);
  return out;
}
Dtype array_dtype(const array& a) { return from_mlx(a.dtype()); }
size_t array_size(const array& a) { return a.size(); }
size_t array_nbytes(const array& a) { return a.nbytes(); }
bool array_is_available(const array& a) { return a.is_available(); }

void array_copy_to_host(const array& a, rust::Slice<uint8_t> out) {
  // Wait for the array itself first: adding an op here would queue behind work scheduled after
  // it (a decode step queued before this token is read) and serialise the pipeline. Only views
  // (transposes, slices, broadcasts) are then copied into a dense row-major array.
  array dense = a;
  dense.eval();
  if (!dense.flags().row_contiguous) {
    dense = mx::contiguous(dense, false);
    dense.eval();
  }
  if (!dense.flags().row_contiguous) {
    throw std::runtime_error("mlxcel: contiguous() did not produce a row-major array");
  }
  if (dense.nbytes() != out.size()) {
    throw std::invalid_argument("mlxcel: host buffer of " + std::to_string(out.size()) +
                                " bytes for an array of " + std::to_string(dense.nbytes()));
  }
  if (out.size() > 0) std::memcpy(out.data(), dense.data<uint8_t>(), out.size());
}

void array_eval(const array& a) {
  array copy = a;
  copy.eval();
}
double array_item_f64(const array& a) {
  if (a.size() != 1) throw std::invalid_argument("mlxcel: item() needs a one-element array");
  array x = mx::astype(mx::reshape(a, {}), mx::float64, mx::Device::cpu);
  x.eval();
  return x.item<double>();
}

std::unique_ptr<ArrayVec> new_array_vec() { return std::make_unique<ArrayVec>(); }
void array_vec_push(ArrayVec& v, const array& a) { v.items.push_back(a); }
size_t array_vec_len(const ArrayVec& v) { return v.items.size(); }
Ptr array_vec_get(const ArrayVec& v, size_t index) {
  if (index >= v.items.size()) throw std::out_of_range("mlxcel: array list index out of range");
  return std::make_unique<array>(v.items[index]);
}
void eval_all(const ArrayVec& v) { mx::eval(v.items); }
void async_eval_all(const ArrayVec& v) { mx::async_eval(v.items); }

// "Name count" lines, one per primitive kind, over the arrays `eval` of `v` would compute (not yet
// evaluated or scheduled); a multi-output primitive counts once. Diagnoses per-step host cost.
rust::String graph_census(const ArrayVec& v) {
  std::unordered_set<std::uintptr_t> seen;
  std::map<std::string, size_t> counts;
  std::vector<array> todo(v.items.begin(), v.items.end());
  while (!todo.empty()) {
    array a = std::move(todo.back());
    todo.pop_back();
    if (!seen.insert(a.id()).second || a.status() != array::Status::unscheduled ||
        !a.has_primitive()) {
      continue;
    }
    for (auto& s : a.siblings()) seen.insert(s.id());
    counts[a.primitive().name()] += 1;
    for (auto& in : a.inputs()) todo.push_back(in);
  }
  std::string out;
  for (auto& [name, n] : counts) out += name + " " + std::to_string(n) + "\n";
  return rust::String(out);
}

Ptr unary_op(rust::Str name, const array& a) { return wrap(lookup(UNARY_OPS, name, "unary")(a)); }
Ptr binary_op(rust::Str name, const array& a, const array& b) {
  return wrap(lookup(BINARY_OPS, name, "binary")(a, b));
}
Ptr reduce_op(rust::Str name, const array& a, rust::Slice<const int32_t> axes, bool keepdims) {
  return wrap(lookup(REDUCE_OPS, name, "reduce")(a, ints(axes), keepdims));
}

Ptr zeros(rust::Slice<const int32_t> shape, Dtype dtype) {
  return wrap(mx::zeros(shape_of(shape), to_mlx(dtype)));
}
Ptr ones(rust::Slice<const int32_t> shape, Dtype dtype) {
  return wrap(mx::ones(shape_of(shape), to_mlx(dtype)));
}
Ptr full(rust::Slice<const int32_t> shape, const array& value, Dtype dtype) {
  return wrap(mx::full(shape_of(shape), value, to_mlx(dtype)));
}
Ptr arange(double start, double stop, double step, Dtype dtype) {
  return wrap(mx::arange(start, stop, step, to_mlx(dtype)));
}

Ptr astype(const array& a, Dtype dtype) { return wrap(mx::astype(a, to_mlx(dtype))); }
Ptr view_as(const array& a, Dtype dtype) { return wrap(mx::view(a, to_mlx(dtype))); }
Ptr reshape(const array& a, rust::Slice<const int32_t> shape) {
  return wrap(mx::reshape(a, shape_of(shape)));
}
Ptr transpose(const array& a, rust::Slice<const int32_t> axes) {
  return wrap(mx::transpose(a, ints(axes)));
}
Ptr broadcast_to(const array& a, rust::Slice<const int32_t> shape) {
  return wrap(mx::broadcast_to(a, shape_of(shape)));
}
Ptr expand_dims(const array& a, rust::Slice<const int32_t> axes) {
  return wrap(mx::expand_dims(a, ints(axes)));
}
Ptr squeeze(const array& a, rust::Slice<const int32_t> axes) {
  return wrap(mx::squeeze(a, ints(axes)));
}
Ptr contiguous(const array& a) { return wrap(mx::contiguous(a, false)); }
Ptr slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop,
          rust::Slice<const int32_t> strides) {
  return wrap(mx::slice(a, shape_of(start), shape_of(stop), shape_of(strides)));
}
Ptr slice_dynamic(const array& a, const array& start, rust::Slice<const int32_t> axes,
                  rust::Slice<const int32_t> sizes) {
  return wrap(mx::slice(a, start, ints(axes), shape_of(sizes)));
}
Ptr slice_update(const array& src, const array& update, rust::Slice<const int32_t> start,
                 rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides) {
  return wrap(mx::slice_update(src, update, shape_of(start), shape_of(stop), shape_of(strides)));
}
Ptr slice_update_dynamic(const array& src, const array& update, const array& start,
                         rust::Slice<const int32_t> axes) {
  return wrap(mx::slice_update(src, update, start, ints(axes)));
}
Ptr concatenate(const ArrayVec& arrays, int32_t axis) {
  return wrap(mx::concatenate(arrays.items, axis));
}
Ptr stack(const ArrayVec& arrays, int32_t axis) { return wrap(mx::stack(arrays.items, axis)); }
std::unique_ptr<ArrayVec> split_at(const array& a, rust::Slice<const int32_t> indices,
                                   int32_t axis) {
  return wrap_vec(mx::split(a, shape_of(indices), axis));
}
std::unique_ptr<ArrayVec> split_equal(const array& a, int32_t parts, int32_t axis) {
  return wrap_vec(mx::split(a, parts, axis));
}
Ptr take(const array& a, const array& indices, int32_t axis) {
  return wrap(mx::take(a, indices, axis));
}
Ptr take_along_axis(const array& a, const array& indices, int32_t axis) {
  return wrap(mx::take_along_axis(a, indices, axis));
}
Ptr put_along_axis(const array& a, const array& indices, const array& values, int32_t axis) {
  return wrap(mx::put_along_axis(a, indices, values, axis));
}
Ptr where_(const array& cond, const array& x, const array& y) {
  return wrap(mx::where(cond, x, y));
}

Ptr addmm(const array& c, const array& a, const array& b, float alpha, float beta) {
  return wrap(mx::addmm(c, a, b, alpha, beta));
}
Ptr softmax(const array& a, rust::Slice<const int32_t> axes, bool precise) {
  return wrap(mx::softmax(a, ints(axes), precise));
}
Ptr argmax(const array& a, int32_t axis, bool keepdims) {
  return wrap(mx::argmax(a, axis, keepdims));
}
Ptr argmin(const array& a, int32_t axis, bool keepdims) {
  return wrap(mx::argmin(a, axis, keepdims));
}
Ptr argpartition(const array& a, int32_t kth, int32_t axis) {
  return wrap(mx::argpartition(a, kth, axis));
}
Ptr topk(const array& a, int32_t k, int32_t axis) { return wrap(mx::topk(a, k, axis)); }
Ptr sort(const array& a, int32_t axis) { return wrap(mx::sort(a, axis)); }
Ptr argsort(const array& a, int32_t axis) { return wrap(mx::argsort(a, axis)); }
Ptr cumsum(const array& a, int32_t axis, bool reverse, bool inclusive) {
  return wrap(mx::cumsum(a, axis, reverse, inclusive));
}
Ptr clip(const array& a, const array* lo, const array* hi) {
  return wrap(mx::clip(a, opt(lo), opt(hi)));
}
Ptr conv1d(const array& input, const array& weight, int32_t stride, int32_t padding,
           int32_t dilation, int32_t groups) {
  return wrap(mx::conv1d(input, weight, stride, padding, dilation, groups));
}

std::unique_ptr<ArrayVec> quantize(const array& w, int32_t group_size, int32_t bits,
                                   rust::Str mode) {
  return wrap_vec(mx::quantize(w, group_size, bits, str(mode)));
}
Ptr dequantize(const array& w, const array& scales, const array* biases, int32_t group_size,
               int32_t bits, rust::Str mode, int32_t out_dtype) {
  std::optional<mx::Dtype> dt;
  if (out_dtype >= 0) dt = to_mlx(static_cast<Dtype>(out_dtype));
  return wrap(mx::dequantize(w, scales, opt(biases), group_size, bits, str(mode), std::nullopt, dt));
}
Ptr quantized_matmul(const array& x, const array& w, const array& scales, const array* biases,
                     bool transpose, int32_t group_size, int32_t bits, rust::Str mode) {
  return wrap(
      mx::quantized_matmul(x, w, scales, opt(biases), transpose, group_size, bits, str(mode)));
}
Ptr gather_qmm(const array& x, const array& w, const array& scales, const array* biases,
               const array* lhs_indices, const array* rhs_indices, bool transpose,
               int32_t group_size, int32_t bits, rust::Str mode, bool sorted_indices) {
  return wrap(mx::gather_qmm(x, w, scales, opt(biases), opt(lhs_indices), opt(rhs_indices),
                             transpose, group_size, bits, str(mode), std::nullopt,
                             sorted_indices));
}
Ptr gather_mm(const array& a, const array& b, const array* lhs_indices, const array* rhs_indices,
              bool sorted_indices) {
  return wrap(mx::gather_mm(a, b, opt(lhs_indices), opt(rhs_indices), sorted_indices));
}

namespace {
// act(gate) * up for the gated MLPs. Scalars carry the input's dtype: a float32 scalar would
// promote half-precision activations to float32.
array scalar(float v, const array& like) { return array(v, like.dtype()); }
array silu_mul(const array& g, const array& u) { return g * mx::sigmoid(g) * u; }
array gelu_tanh_mul(const array& g, const array& u) {
  // 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) u
  auto inner = (g + scalar(0.044715f, g) * g * g * g) * scalar(0.7978845608f, g);
  return scalar(0.5f, g) * g * (scalar(1.0f, g) + mx::tanh(inner)) * u;
}
array gelu_mul(const array& g, const array& u) {
  return scalar(0.5f, g) * g * (scalar(1.0f, g) + mx::erf(g * scalar(0.70710678f, g))) * u;
}
std::vector<array> silu_mul_fn(const std::vector<array>& in) { return {silu_mul(in[0], in[1])}; }
std::vector<array> gelu_tanh_mul_fn(const std::vector<array>& in) {
  return {gelu_tanh_mul(in[0], in[1])};
}
std::vector<array> gelu_mul_fn(const std::vector<array>& in) { return {gelu_mul(in[0], in[1])}; }
}  // namespace

Ptr gated_activation(rust::Str kind, const array& gate, const array& up, bool fused) {
  using Fn = std::function<std::vector<array>(const std::vector<array>&)>;
  // mx::compile traces each function once per input shape/dtype and runs it as one fused
  // kernel; the traced functions are static, so the cache lives for the process.
  static const Fn silu_c = mx::compile(silu_mul_fn);
  static const Fn gelu_tanh_c = mx::compile(gelu_tanh_mul_fn);
  static const Fn gelu_c = mx::compile(gelu_mul_fn);
  auto k = str(kind);
  const Fn* compiled = nullptr;
  std::vector<array> (*plain)(const std::vector<array>&) = nullptr;
  if (k == "silu") {
    compiled = &silu_c;
    plain = silu_mul_fn;
  } else if (k == "gelu_tanh") {
    compiled = &gelu_tanh_c;
    plain = gelu_tanh_mul_fn;
  } else if (k == "gelu") {
    compiled = &gelu_c;
    plain = gelu_mul_fn;
  } else {
    throw std::invalid_argument("mlxcel: unknown gated activation `" + k + "`");
  }
  std::vector<array> in{gate, up};
  return wrap((fused ? (*compiled)(in) : plain(in))[0]);
}

Ptr rms_norm(const array& x, const array* weight, float eps) {
  return wrap(mx::fast::rms_norm(x, opt(weight), eps));
}
Ptr layer_norm(const array& x, const array* weight, const array* bias, float eps) {
  return wrap(mx::fast::layer_norm(x, opt(weight), opt(bias), eps));
}
Ptr rope(const array& x, int32_t dims, bool traditional, float base, bool has_base, float scale,
         int32_t offset, const array* freqs) {
  std::optional<float> b;
  if (has_base) b = base;
  return wrap(mx::fast::rope(x, dims, traditional, b, scale, offset, opt(freqs)));
}
Ptr rope_offsets(const array& x, int32_t dims, bool traditional, float base, bool has_base,
                 float scale, const array& offsets, const array* freqs) {
  std::optional<float> b;
  if (has_base) b = base;
  return wrap(mx::fast::rope(x, dims, traditional, b, scale, offsets, opt(freqs)));
}
Ptr scaled_dot_product_attention(const array& q, const array& k, const array& v, float scale,
                                 rust::Str mask_mode, const array* mask, const array* sinks) {
  return wrap(
      mx::fast::scaled_dot_product_attention(q, k, v, scale, str(mask_mode), opt(mask), opt(sinks)));
}

Ptr random_key(uint64_t seed) { return wrap(mx::random::key(seed)); }
Ptr random_split(const array& key, int32_t parts) { return wrap(mx::random::split(key, parts)); }
Ptr random_categorical(const array& logits, int32_t axis, const array& key) {
  return wrap(mx::random::categorical(logits, axis, key));
}
Ptr random_uniform(rust::Slice<const int32_t> shape, Dtype dtype, const array& key) {
  return wrap(mx::random::uniform(shape_of(shape), to_mlx(dtype), key));
}

std::unique_ptr<CustomKernel> custom_kernel_new(rust::Str backend, rust::Str name,
                                                const rust::Vec<rust::String>& input_names,
                                                const rust::Vec<rust::String>& output_names,
                                                rust::Str source, rust::Str header) {
  std::vector<std::string> in, out;
  for (auto& s : input_names) in.emplace_back(std::string(s));
  for (auto& s : output_names) out.emplace_back(std::string(s));
  auto k = std::make_unique<CustomKernel>();
  if (str(backend) == "metal") {
    k->fn = mx::fast::metal_kernel(str(name), in, out, str(source), str(header));
  } else if (str(backend) == "cuda") {
    k->fn = mx::fast::cuda_kernel(str(name), in, out, str(source), str(header));
  } else {
    throw std::invalid_argument("mlxcel: custom kernel backend must be metal or cuda, got " +
                                str(backend));
  }
  return k;
}

namespace {
// Output shapes (concatenated, split by `ndims`) and dtypes of a custom kernel call.
std::pair<std::vector<mx::Shape>, std::vector<mx::Dtype>> kernel_outputs(
    rust::Slice<const int32_t> output_shapes, rust::Slice<const int32_t> output_ndims,
    rust::Slice<const Dtype> output_dtypes, rust::Slice<const int32_t> grid,
    rust::Slice<const int32_t> threadgroup) {
  if (grid.size() != 3 || threadgroup.size() != 3) {
    throw std::invalid_argument("mlxcel: grid and threadgroup need three dimensions");
  }
  if (output_ndims.size() != output_dtypes.size()) {
    throw std::invalid_argument("mlxcel: custom kernel argument lists differ in length");
  }
  std::vector<mx::Shape> shapes;
  size_t at = 0;
  for (auto nd : output_ndims) {
    if (nd < 0 || at + size_t(nd) > output_shapes.size()) {
      throw std::invalid_argument("mlxcel: custom kernel output shapes are malformed");
    }
    shapes.emplace_back(output_shapes.begin() + at, output_shapes.begin() + at + nd);
    at += nd;
  }
  std::vector<mx::Dtype> dtypes;
  for (auto d : output_dtypes) dtypes.push_back(to_mlx(d));
  return {std::move(shapes), std::move(dtypes)};
}
}  // namespace

std::unique_ptr<ArrayVec> custom_kernel_call(const CustomKernel& kernel, const ArrayVec& inputs,
                                             rust::Slice<const int32_t> output_shapes,
                                             rust::Slice<const int32_t> output_ndims,
                                             rust::Slice<const Dtype> output_dtypes,
                                             rust::Slice<const int32_t> grid,
                                             rust::Slice<const int32_t> threadgroup,
                                             const rust::Vec<rust::String>& template_names,
                                             rust::Slice<const int32_t> template_values) {
  auto [shapes, dtypes] =
      kernel_outputs(output_shapes, output_ndims, output_dtypes, grid, threadgroup);
  if (template_names.size() != template_values.size()) {
    throw std::invalid_argument("mlxcel: custom kernel argument lists differ in length");
  }
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs;
  for (size_t i = 0; i < template_names.size(); ++i) {
    targs.emplace_back(std::string(template_names[i]), int(template_values[i]));
  }
  return wrap_vec(kernel.fn(inputs.items, shapes, dtypes, {grid[0], grid[1], grid[2]},
                            {threadgroup[0], threadgroup[1], threadgroup[2]}, targs, std::nullopt,
                            false, {}));
}

std::unique_ptr<CudaBinary> cuda_binary_new(rust::Slice<const uint8_t> image, rust::Str kernel) {
  auto b = std::make_unique<CudaBinary>();
  b->image.assign(reinterpret_cast<const char*>(image.data()), image.size());
  b->kernel = str(kernel);
  return b;
}

std::unique_ptr<ArrayVec> cuda_binary_call(const CudaBinary& binary, const ArrayVec& inputs,
                                           rust::Slice<const int32_t> output_shapes,
                                           rust::Slice<const int32_t> output_ndims,
                                           rust::Slice<const Dtype> output_dtypes,
                                           rust::Slice<const int32_t> scalars,
                                           rust::Slice<const int32_t> grid,
                                           rust::Slice<const int32_t> threadgroup) {
  auto [shapes, dtypes] =
      kernel_outputs(output_shapes, output_ndims, output_dtypes, grid, threadgroup);
  std::vector<int32_t> ints(scalars.begin(), scalars.end());
  std::array<int32_t, 3> g{grid[0], grid[1], grid[2]};
  std::array<int32_t, 3> t{threadgroup[0], threadgroup[1], threadgroup[2]};
  if (auto out = launch_cuda_binary(binary, inputs.items, shapes, dtypes, ints, g, t)) {
    return wrap_vec(std::move(*out));
  }
  std::vector<mx::fast::ScalarArg> args(ints.begin(), ints.end());
  return wrap_vec(mx::fast::precompiled_cuda_kernel(
      binary.kernel, binary.image, inputs.items, shapes, dtypes, args,
      {grid[0], grid[1], grid[2]}, {threadgroup[0], threadgroup[1], threadgroup[2]},
      /*shared_memory=*/0, /*init_value=*/std::nullopt, /*ensure_row_contiguous=*/true));
}

// ---- distributed ----
// Thin wrappers over mlx::core::distributed: the backend's errors (no peer, a peer gone, a
// shape the group cannot reduce) are exceptions and reach Rust as `Err`.

bool distributed_is_available(rust::Str backend) {
  return mx::distributed::is_available(str(backend));
}

std::unique_ptr<DistGroup> distributed_init(bool strict, rust::Str backend) {
  return std::make_unique<DistGroup>(DistGroup{mx::distributed::init(strict, str(backend))});
}

std::unique_ptr<DistGroup> group_clone(const DistGroup& g) {
  return std::make_unique<DistGroup>(g);
}
int32_t group_rank(const DistGroup& g) { return g.group.rank(); }
int32_t group_size(const DistGroup& g) { return g.group.size(); }

std::unique_ptr<DistGroup> group_split(const DistGroup& g, int32_t color, int32_t key) {
  return std::make_unique<DistGroup>(DistGroup{g.group.split(color, key)});
}

Ptr dist_all_sum(const array& x, const DistGroup& g) {
  return wrap(mx::distributed::all_sum(x, g.group));
}
Ptr dist_all_max(const array& x, const DistGroup& g) {
  return wrap(mx::distributed::all_max(x, g.group));
}
Ptr dist_all_gather(const array& x, const DistGroup& g) {
  return wrap(mx::distributed::all_gather(x, g.group));
}
Ptr dist_send(const array& x, int32_t dst, const DistGroup& g) {
  return wrap(mx::distributed::send(x, dst, g.group));
}
Ptr dist_recv(rust::Slice<const int32_t> shape, Dtype dtype, int32_t src, const DistGroup& g) {
  return wrap(mx::distributed::recv(shape_of(shape), to_mlx(dtype), src, g.group));
}

std::unique_ptr<ArrayVec> depends(const ArrayVec& inputs, const ArrayVec& dependencies) {
  return wrap_vec(mx::depends(inputs.items, dependencies.items));
}

}  // namespace mlxcel
