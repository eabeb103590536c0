// See shim.h. One MLX call per function; argument conversion only.
#include "mlxcel/cpp/shim.h"

#include <algorithm>
#include <cstring>
#include <dlfcn.h>
#include <functional>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <map>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "mlxcel/src/mlx/ffi.rs.h"
#include "mlx/backend/common/utils.h"
#include "mlx/fast_primitives.h"
#include "mlx/scheduler.h"
#include "mlx/backend/cpu/encoder.h"

#include <chrono>
#include <condition_variable>

namespace mx = mlx::core;

namespace mlxcel {

namespace {

mx::Shape to_shape(rust::Slice<const int32_t> s) { return mx::Shape(s.begin(), s.end()); }
std::vector<int> to_ints(rust::Slice<const int32_t> s) { return std::vector<int>(s.begin(), s.end()); }

ArrayPtr wrap(array a) { return std::make_unique<array>(std::move(a)); }

mx::Dtype to_mx(Dtype d) {
  switch (d) {
    case Dtype::Bool: return mx::bool_;
    case Dtype::U8: return mx::uint8;
    case Dtype::U16: return mx::uint16;
    case Dtype::U32: return mx::uint32;
    case Dtype::I8: return mx::int8;
    case Dtype::I32: return mx::int32;
    case Dtype::I64: return mx::int64;
    case Dtype::F16: return mx::float16;
    case Dtype::BF16: return mx::bfloat16;
    case Dtype::F32: return mx::float32;
    default: break;
  }
  throw std::invalid_argument("unknown dtype code");
}

Dtype from_mx(mx::Dtype d) {
  switch (d.val()) {
    case mx::Dtype::Val::bool_: return Dtype::Bool;
    case mx::Dtype::Val::uint8: return Dtype::U8;
    case mx::Dtype::Val::uint16: return Dtype::U16;
    case mx::Dtype::Val::uint32: return Dtype::U32;
    case mx::Dtype::Val::int8: return Dtype::I8;
    case mx::Dtype::Val::int32: return Dtype::I32;
    case mx::Dtype::Val::int64: return Dtype::I64;
    case mx::Dtype::Val::float16: return Dtype::F16;
    case mx::Dtype::Val::bfloat16: return Dtype::BF16;
    case mx::Dtype::Val::float32: return Dtype::F32;
    default: return Dtype::Unsupported;
  }
}

mx::Stream to_stream(const StreamRef& s) {
  return mx::Stream(s.index, mx::Device(s.gpu ? mx::Device::gpu : mx::Device::cpu, s.device_index));
}

StreamRef from_stream(const mx::Stream& s) {
  StreamRef r;
  r.index = s.index;
  r.gpu = s.device.type == mx::Device::gpu;
  r.device_index = s.device.index;
  return r;
}

void check_gpu_index(int32_t index) {
  int n = mx::is_available(mx::Device::gpu) ? mx::device_count(mx::Device::gpu) : 0;
  if (index < 0 || index >= n) {
    std::ostringstream msg;
    msg << "invalid GPU index " << index << ": " << n << " GPU(s) visible";
    throw std::out_of_range(msg.str());
  }
}

std::string info_string(const std::unordered_map<std::string, std::variant<std::string, size_t>>& m,
                        const char* key) {
  auto it = m.find(key);
  if (it == m.end()) return "";
  if (auto p = std::get_if<std::string>(&it->second)) return *p;
  return std::to_string(std::get<size_t>(it->second));
}

uint64_t info_size(const std::unordered_map<std::string, std::variant<std::string, size_t>>& m,
                   const char* key) {
  auto it = m.find(key);
  if (it == m.end()) return 0;
  if (auto p = std::get_if<size_t>(&it->second)) return *p;
  return 0;
}

}  // namespace

// ---- version, devices, streams ----
rust::String mlx_version() { return rust::String(mx::version()); }
rust::String mlx_library_path() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&mx::version), &info) && info.dli_fname) return rust::String(info.dli_fname);
  return rust::String();
}

rust::String backend_name() {
  if (mx::cu::is_available()) return "cuda";
  if (mx::metal::is_available()) return "metal";
  return "cpu";
}

static bool gpu_available() { return mx::is_available(mx::Device::gpu); }

int32_t gpu_device_count() { return gpu_available() ? mx::device_count(mx::Device::gpu) : 0; }

DeviceInfo gpu_device_info(int32_t index) {
  check_gpu_index(index);
  const auto& m = mx::device_info(mx::Device(mx::Device::gpu, index));
  DeviceInfo d;
  d.name = info_string(m, "device_name");
  d.architecture = info_string(m, "architecture");
  d.total_memory = info_size(m, "total_memory");
  if (d.total_memory == 0) d.total_memory = info_size(m, "memory_size");
  d.free_memory = info_size(m, "free_memory");
  d.pci_bus_id = info_string(m, "pci_bus_id");
  d.uuid = info_string(m, "uuid");
  return d;
}

StreamRef default_stream_ref(bool gpu) {
  return from_stream(mx::default_stream(gpu ? mx::Device(mx::Device::gpu) : mx::Device(mx::Device::cpu)));
}

StreamRef new_stream_on_gpu(int32_t index) {
  check_gpu_index(index);
  return from_stream(mx::new_stream(mx::Device(mx::Device::gpu, index)));
}

StreamRef new_cpu_stream() { return from_stream(mx::new_stream(mx::Device(mx::Device::cpu))); }

void set_default_stream_ref(const StreamRef& s) {
  auto st = to_stream(s);
  mx::set_default_device(st.device);
  mx::set_default_stream(st);
}

void set_default_device_cpu() { mx::set_default_device(mx::Device(mx::Device::cpu)); }

void synchronize_stream(const StreamRef& s) { mx::synchronize(to_stream(s)); }
void synchronize_default() { mx::synchronize(); }

// ---- memory ----
uint64_t active_memory() { return mx::get_active_memory(); }
uint64_t peak_memory() { return mx::get_peak_memory(); }
uint64_t cache_memory() { return mx::get_cache_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
uint64_t set_memory_limit(uint64_t limit) { return mx::set_memory_limit(limit); }
uint64_t memory_limit() { return mx::get_memory_limit(); }
uint64_t set_cache_limit(uint64_t limit) { return mx::set_cache_limit(limit); }
void clear_cache() { mx::clear_cache(); }

// ---- array basics ----
ArrayPtr from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, Dtype dtype) {
  auto dt = to_mx(dtype);
  auto sh = to_shape(shape);
  size_t n = 1;
  for (auto d : sh) {
    if (d < 0) throw std::invalid_argument("negative dimension in shape");
    n *= static_cast<size_t>(d);
  }
  size_t expect = n * dt.size();
  if (expect != data.size()) {
    std::ostringstream msg;
    msg << "from_bytes: " << data.size() << " bytes given, shape needs " << expect;
    throw std::invalid_argument(msg.str());
  }
  auto buf = mx::allocator::malloc(std::max<size_t>(expect, 1));
  if (expect > 0) std::memcpy(buf.buffer().raw_ptr(), data.data(), expect);
  return wrap(array(std::move(buf), std::move(sh), dt));
}

ArrayPtr host_array(rust::Slice<const int32_t> shape, Dtype dtype) {
  auto dt = to_mx(dtype);
  auto sh = to_shape(shape);
  size_t n = dt.size();
  for (auto d : sh) {
    if (d < 0) throw std::invalid_argument("negative dimension in shape");
    n *= static_cast<size_t>(d);
  }
  // the allocator's host-visible memory (unified memory on CUDA), as from_bytes uses;
  // not touched here, so that the thread writing it first is the one that pays for it
  auto buf = mx::allocator::malloc(std::max<size_t>(n, 1));
  return wrap(array(std::move(buf), std::move(sh), dt));
}

uint64_t host_data_address(const array& a) {
  if (a.status() != array::Status::available || !a.flags().row_contiguous) {
    throw std::invalid_argument("host_data_address: not a constant, row-contiguous array");
  }
  return reinterpret_cast<uint64_t>(a.data<uint8_t>());
}

ArrayPtr scalar_f32(float v, Dtype dtype) { return wrap(array(v, to_mx(dtype))); }
ArrayPtr scalar_i32(int32_t v) { return wrap(array(v, mx::int32)); }
ArrayPtr full(rust::Slice<const int32_t> shape, float v, Dtype dtype) {
  return wrap(mx::full(to_shape(shape), v, to_mx(dtype)));
}
ArrayPtr arange(double start, double stop, double step, Dtype dtype) {
  return wrap(mx::arange(start, stop, step, to_mx(dtype)));
}
ArrayPtr clone_array(const array& a) { return wrap(a); }

rust::Vec<int32_t> shape(const array& a) {
  rust::Vec<int32_t> out;
  for (auto d : a.shape()) out.push_back(d);
  return out;
}
Dtype dtype(const array& a) { return from_mx(a.dtype()); }
size_t ndim(const array& a) { return a.ndim(); }
size_t size(const array& a) { return a.size(); }
size_t nbytes(const array& a) { return a.nbytes(); }

rust::Vec<uint8_t> to_bytes(const array& a) {
  // Wait for `a` alone (not for work queued after it, e.g. the next decode step
  // started with async_eval); only a non-contiguous array needs a copy op.
  array c = a;
  c.eval();
  if (!c.flags().row_contiguous) {
    c = mx::contiguous(c);
    c.eval();
  }
  rust::Vec<uint8_t> out;
  size_t n = c.nbytes();
  out.reserve(n);
  const uint8_t* p = c.data<uint8_t>();
  for (size_t i = 0; i < n; ++i) out.push_back(p[i]);
  return out;
}

void eval_one(const array& a) {
  array c = a;
  c.eval();
}
void eval_many(const ArrayVec& v) { mx::eval(v.items); }
void async_eval_many(const ArrayVec& v) { mx::async_eval(v.items); }

rust::String describe(const array& a) {
  std::ostringstream s;
  s << a;
  return rust::String(s.str());
}

// ---- array lists ----
std::unique_ptr<ArrayVec> array_vec_new() { return std::make_unique<ArrayVec>(); }
void array_vec_push(ArrayVec& v, const array& a) { v.items.push_back(a); }
size_t array_vec_len(const ArrayVec& v) { return v.items.size(); }
ArrayPtr array_vec_get(const ArrayVec& v, size_t i) { return wrap(v.items.at(i)); }

// ---- element-wise, reductions ----
ArrayPtr unary(const array& a, UnaryOp op) {
  switch (op) {
    case UnaryOp::Exp: return wrap(mx::exp(a));
    case UnaryOp::Log: return wrap(mx::log(a));
    case UnaryOp::Sqrt: return wrap(mx::sqrt(a));
    case UnaryOp::Rsqrt: return wrap(mx::rsqrt(a));
    case UnaryOp::Negative: return wrap(mx::negative(a));
    case UnaryOp::Sigmoid: return wrap(mx::sigmoid(a));
    case UnaryOp::Silu: return wrap(mx::multiply(a, mx::sigmoid(a)));
    case UnaryOp::Abs: return wrap(mx::abs(a));
    case UnaryOp::Tanh: return wrap(mx::tanh(a));
    case UnaryOp::Sin: return wrap(mx::sin(a));
    case UnaryOp::Cos: return wrap(mx::cos(a));
    case UnaryOp::Floor: return wrap(mx::floor(a));
    case UnaryOp::Square: return wrap(mx::square(a));
    case UnaryOp::Reciprocal: return wrap(mx::reciprocal(a));
    case UnaryOp::LogicalNot: return wrap(mx::logical_not(a));
    case UnaryOp::IsNan: return wrap(mx::isnan(a));
  }
  throw std::invalid_argument("unknown unary op");
}

ArrayPtr binary(const array& a, const array& b, BinaryOp op) {
  switch (op) {
    case BinaryOp::Add: return wrap(mx::add(a, b));
    case BinaryOp::Subtract: return wrap(mx::subtract(a, b));
    case BinaryOp::Multiply: return wrap(mx::multiply(a, b));
    case BinaryOp::Divide: return wrap(mx::divide(a, b));
    case BinaryOp::Maximum: return wrap(mx::maximum(a, b));
    case BinaryOp::Minimum: return wrap(mx::minimum(a, b));
    case BinaryOp::Power: return wrap(mx::power(a, b));
    case BinaryOp::Remainder: return wrap(mx::remainder(a, b));
    case BinaryOp::Equal: return wrap(mx::equal(a, b));
    case BinaryOp::NotEqual: return wrap(mx::not_equal(a, b));
    case BinaryOp::Greater: return wrap(mx::greater(a, b));
    case BinaryOp::GreaterEqual: return wrap(mx::greater_equal(a, b));
    case BinaryOp::Less: return wrap(mx::less(a, b));
    case BinaryOp::LessEqual: return wrap(mx::less_equal(a, b));
    case BinaryOp::LogicalAnd: return wrap(mx::logical_and(a, b));
    case BinaryOp::LogicalOr: return wrap(mx::logical_or(a, b));
    case BinaryOp::BitwiseXor: return wrap(mx::bitwise_xor(a, b));
    case BinaryOp::BitwiseAnd: return wrap(mx::bitwise_and(a, b));
    case BinaryOp::LeftShift: return wrap(mx::left_shift(a, b));
    case BinaryOp::RightShift: return wrap(mx::right_shift(a, b));
  }
  throw std::invalid_argument("unknown binary op");
}

ArrayPtr reduce(const array& a, ReduceOp op, rust::Slice<const int32_t> axes_, bool keepdims) {
  auto axes = to_ints(axes_);
  switch (op) {
    case ReduceOp::Sum: return wrap(mx::sum(a, axes, keepdims));
    case ReduceOp::Mean: return wrap(mx::mean(a, axes, keepdims));
    case ReduceOp::Max: return wrap(mx::max(a, axes, keepdims));
    case ReduceOp::Min: return wrap(mx::min(a, axes, keepdims));
    case ReduceOp::Prod: return wrap(mx::prod(a, axes, keepdims));
    case ReduceOp::LogSumExp: return wrap(mx::logsumexp(a, axes, keepdims));
    case ReduceOp::All: return wrap(mx::all(a, axes, keepdims));
    case ReduceOp::Any: return wrap(mx::any(a, axes, keepdims));
  }
  throw std::invalid_argument("unknown reduce op");
}

ArrayPtr astype(const array& a, Dtype dtype) { return wrap(mx::astype(a, to_mx(dtype))); }
ArrayPtr view_as(const array& a, Dtype dtype) { return wrap(mx::view(a, to_mx(dtype))); }
ArrayPtr where_(const array& cond, const array& x, const array& y) { return wrap(mx::where(cond, x, y)); }
ArrayPtr softmax(const array& a, int32_t axis, bool precise) { return wrap(mx::softmax(a, axis, precise)); }
ArrayPtr cumsum(const array& a, int32_t axis, bool reverse, bool inclusive) {
  return wrap(mx::cumsum(a, axis, reverse, inclusive));
}
ArrayPtr depends_on(const array& a, const array& dep) { return wrap(mx::depends({a}, {dep}).at(0)); }
ArrayPtr argmax(const array& a, int32_t axis, bool keepdims) { return wrap(mx::argmax(a, axis, keepdims)); }
ArrayPtr topk(const array& a, int32_t k, int32_t axis) { return wrap(mx::topk(a, k, axis)); }
ArrayPtr sort(const array& a, int32_t axis) { return wrap(mx::sort(a, axis)); }
ArrayPtr argsort(const array& a, int32_t axis) { return wrap(mx::argsort(a, axis)); }
ArrayPtr argpartition(const array& a, int32_t kth, int32_t axis) {
  return wrap(mx::argpartition(a, kth, axis));
}

// ---- shapes and indexing ----
ArrayPtr matmul(const array& a, const array& b) { return wrap(mx::matmul(a, b)); }
ArrayPtr addmm(const array& c, const array& a, const array& b) { return wrap(mx::addmm(c, a, b)); }
ArrayPtr reshape(const array& a, rust::Slice<const int32_t> s) { return wrap(mx::reshape(a, to_shape(s))); }
ArrayPtr transpose(const array& a, rust::Slice<const int32_t> axes) {
  return wrap(mx::transpose(a, to_ints(axes)));
}
ArrayPtr expand_dims(const array& a, int32_t axis) { return wrap(mx::expand_dims(a, axis)); }
ArrayPtr squeeze(const array& a, int32_t axis) { return wrap(mx::squeeze(a, axis)); }
ArrayPtr broadcast_to(const array& a, rust::Slice<const int32_t> s) {
  return wrap(mx::broadcast_to(a, to_shape(s)));
}
ArrayPtr slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop,
               rust::Slice<const int32_t> strides) {
  return wrap(mx::slice(a, to_shape(start), to_shape(stop), to_shape(strides)));
}
ArrayPtr slice_dynamic(const array& a, const array& start, rust::Slice<const int32_t> axes,
                       rust::Slice<const int32_t> slice_size) {
  return wrap(mx::slice(a, start, to_ints(axes), to_shape(slice_size)));
}
namespace {

// See `unowned_slices` in shim.h. Evaluated on whatever stream the read runs on; it sets
// up its views and runs no kernel. One op, however many views.
class UnownedSlices : public mx::Primitive {
 public:
  UnownedSlices(mx::Stream s, std::vector<mx::Shape> starts)
      : mx::Primitive(s), starts_(std::move(starts)) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    views(inputs, outputs);
  }
  void eval_gpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    views(inputs, outputs);
  }
  const char* name() const override { return "UnownedSlice"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  void views(const std::vector<array>& inputs, std::vector<array>& outputs) {
    const array& in = inputs[0];
    const auto& st = in.strides();
    for (size_t o = 0; o < outputs.size(); ++o) {
      array& out = outputs[o];
      const mx::Shape& start = starts_[o];
      // strides, offset and data size as MLX's own slice computes them (unit steps)
      int64_t offset = 0;
      size_t data_end = 1;
      for (size_t i = 0; i < start.size(); ++i) {
        offset += int64_t(start[i]) * st[i];
        if (in.shape(i) > 1) data_end += size_t(int64_t(start[i] + out.shape(i) - 1) * st[i]);
      }
      size_t data_size = data_end - size_t(offset);
      auto [no_bsx_size, row, col] = mx::check_contiguity(out.shape(), st);
      auto flags = in.flags();
      flags.row_contiguous = row;
      flags.col_contiguous = col;
      flags.contiguous = no_bsx_size == data_size;
      // a Data of its own over the same buffer, which frees nothing
      out.set_data(mx::allocator::Data(in.buffer(), [](mx::allocator::Buffer) {}), data_size, st,
                   flags, in.offset() + offset * int64_t(in.itemsize()));
    }
    // MLX keeps every input of an evaluated op until the device is done with the op (its
    // "temporaries"), and a buffer still referenced then cannot be reused by the next
    // update: this op hands its input back now. Each output's input list (`inputs` is the
    // evaluated one's, what MLX's eval passes) gets the output itself instead, which MLX
    // skips as an input sharing the output's data (the others it keeps are these views,
    // which hold no reference to the buffer); the graph is detached right after evaluation.
    for (auto& out : outputs) out.inputs()[0] = out;
  }

  std::vector<mx::Shape> starts_;
};

}  // namespace

std::unique_ptr<ArrayVec> unowned_slices(const array& a, rust::Slice<const int32_t> starts,
                                         rust::Slice<const int32_t> stops) {
  const size_t nd = a.ndim();
  if (nd == 0 || starts.size() != stops.size() || starts.size() == 0 || starts.size() % nd != 0) {
    throw std::invalid_argument("unowned_slices: start and stop need one entry per axis per view");
  }
  std::vector<mx::Shape> shapes, begins;
  for (size_t v = 0; v < starts.size() / nd; ++v) {
    mx::Shape shape(nd), begin(nd);
    for (size_t i = 0; i < nd; ++i) {
      const int32_t lo = starts[v * nd + i], hi = stops[v * nd + i];
      if (lo < 0 || hi > a.shape(i) || lo > hi) {
        throw std::invalid_argument("unowned_slice: axis " + std::to_string(i) + " range " +
                                    std::to_string(lo) + ".." + std::to_string(hi) +
                                    " is outside 0.." + std::to_string(a.shape(i)));
      }
      shape[i] = hi - lo;
      begin[i] = lo;
    }
    shapes.push_back(std::move(shape));
    begins.push_back(std::move(begin));
  }
  auto s = mx::default_stream(mx::default_device());
  std::vector<mx::Dtype> dtypes(shapes.size(), a.dtype());
  auto out = std::make_unique<ArrayVec>();
  out->items = array::make_arrays(std::move(shapes), dtypes,
                                  std::make_shared<UnownedSlices>(s, std::move(begins)), {a});
  return out;
}

ArrayPtr unowned_slice(const array& a, rust::Slice<const int32_t> start,
                       rust::Slice<const int32_t> stop) {
  if (start.size() != a.ndim() || stop.size() != a.ndim()) {
    throw std::invalid_argument("unowned_slice: start and stop need one entry per axis");
  }
  return wrap(unowned_slices(a, start, stop)->items[0]);
}

uint64_t buffer_id(const array& a) {
  if (!a.data_shared_ptr()) return 0;
  return reinterpret_cast<uint64_t>(a.buffer().ptr());
}
// whether a's contents are there: evaluated and, where an asynchronous evaluation queued
// it, run by the device (its event signalled); never waits
bool is_available(const array& a) { return a.is_available(); }
// whether a was handed to an evaluation (queued or run), or made from data
bool is_scheduled(const array& a) { return a.status() != array::Status::unscheduled; }
// whether a and b are one array (one node of a graph), not two with equal contents
bool same_array(const array& a, const array& b) { return a.id() == b.id(); }

ArrayPtr slice_update(const array& src, const array& update, rust::Slice<const int32_t> start,
                      rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides) {
  return wrap(mx::slice_update(src, update, to_shape(start), to_shape(stop), to_shape(strides)));
}
ArrayPtr slice_update_dynamic(const array& src, const array& update, const array& start,
                              rust::Slice<const int32_t> axes) {
  return wrap(mx::slice_update(src, update, start, to_ints(axes)));
}
ArrayPtr concatenate(const ArrayVec& v, int32_t axis) { return wrap(mx::concatenate(v.items, axis)); }
ArrayPtr stack(const ArrayVec& v, int32_t axis) { return wrap(mx::stack(v.items, axis)); }
std::unique_ptr<ArrayVec> split_sections(const array& a, rust::Slice<const int32_t> indices, int32_t axis) {
  auto out = std::make_unique<ArrayVec>();
  out->items = mx::split(a, to_shape(indices), axis);
  return out;
}
ArrayPtr take(const array& a, const array& indices, int32_t axis) { return wrap(mx::take(a, indices, axis)); }
ArrayPtr take_along_axis(const array& a, const array& indices, int32_t axis) {
  return wrap(mx::take_along_axis(a, indices, axis));
}
ArrayPtr put_along_axis(const array& a, const array& indices, const array& values, int32_t axis) {
  return wrap(mx::put_along_axis(a, indices, values, axis));
}
ArrayPtr scatter(const array& a, const ArrayVec& indices, const array& updates, rust::Slice<const int32_t> axes) {
  return wrap(mx::scatter(a, indices.items, updates, to_ints(axes)));
}
ArrayPtr repeat(const array& a, int32_t repeats, int32_t axis) { return wrap(mx::repeat(a, repeats, axis)); }
ArrayPtr contiguous(const array& a) { return wrap(mx::contiguous(a)); }
ArrayPtr copy_to_stream(const array& a, const StreamRef& s) { return wrap(mx::copy(a, to_stream(s))); }

// ---- fast kernels ----
namespace {
// Set by `set_fast_ops_as_gpu` (op counting): MLX's fast ops on a CPU stream are built as
// the single fused op a GPU stream gets, not expanded into their fallback ops.
thread_local bool g_fast_as_gpu = false;

// The stream MLX builds an op on by default, when fast ops on it are to be built as on a GPU.
std::optional<mx::Stream> fast_as_gpu_stream() {
  if (!g_fast_as_gpu) return std::nullopt;
  auto s = mx::default_stream(mx::default_device());
  if (s.device != mx::Device::cpu) return std::nullopt;
  return s;
}

// A stand-in for a fused MLX primitive (`RMSNorm`, `RoPE`, `ScaledDotProductAttention`, named
// like it) over the inputs MLX's GPU path gives that primitive. MLX does not export the
// fused primitives, and the CPU backend could not evaluate them: this one throws when
// evaluated.
class FusedAsGpu : public mx::Primitive {
 public:
  FusedAsGpu(mx::Stream s, const char* name) : mx::Primitive(s), name_(name) {}
  void eval_cpu(const std::vector<array>&, std::vector<array>&) override { fail(); }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override { fail(); }
  const char* name() const override { return name_; }

 private:
  [[noreturn]] void fail() const {
    throw std::runtime_error(std::string(name_) +
                             " was built as on a GPU to count ops (set_fast_ops_as_gpu): it cannot be evaluated");
  }
  const char* name_;
};

// `real`'s shape and dtype as the fused op `name` over `inputs`, when fast ops are built as on
// a GPU; else `real`.
ArrayPtr fused_or(array real, const char* name, std::vector<array> inputs) {
  if (auto s = fast_as_gpu_stream()) {
    auto shape = real.shape();
    auto t = real.dtype();
    return wrap(array(std::move(shape), t, std::make_shared<FusedAsGpu>(*s, name), std::move(inputs)));
  }
  return wrap(std::move(real));
}

bool as_gpu() { return fast_as_gpu_stream().has_value(); }

// The inputs MLX's RoPE gets on a GPU.
std::vector<array> rope_inputs(const array& x, const array& offset, const std::optional<array>& freqs) {
  if (!as_gpu()) return {};
  std::vector<array> in = {x, offset.dtype().size() != 4 ? mx::astype(offset, mx::int32) : offset};
  if (freqs) in.push_back(mx::astype(*freqs, mx::float32));
  return in;
}

// The inputs MLX's fused attention gets on a GPU (no sinks, not training; a bool mask as it is).
std::vector<array> sdpa_inputs(const array& real, const array& q, const array& k, const array& v,
                               const std::optional<array>& mask) {
  if (!as_gpu()) return {};
  auto t = real.dtype();
  std::vector<array> in = {mx::astype(q, t), mx::astype(k, t), mx::astype(v, t)};
  if (mask) {
    auto m = mask->dtype() == mx::bool_ ? *mask : mx::astype(*mask, t);
    auto shape = q.shape();
    shape.back() = k.shape(-2);
    in.push_back(mx::broadcast_to(m, shape));
  }
  return in;
}
}  // namespace

void set_fast_ops_as_gpu(bool on) { g_fast_as_gpu = on; }
bool fast_ops_as_gpu() { return g_fast_as_gpu; }

// Each fast op runs MLX's own (its checks, output shape and dtype); with fast ops built as on
// a GPU (on a CPU stream) the fallback ops it built are dropped for the fused stand-in.
ArrayPtr rms_norm(const array& x, const array& weight, float eps) {
  auto real = mx::fast::rms_norm(x, weight, eps);
  auto t = real.dtype();
  return fused_or(std::move(real), "RMSNorm",
                  as_gpu() ? std::vector<array>{mx::astype(x, t), mx::astype(weight, t)} : std::vector<array>{});
}
ArrayPtr rms_norm_no_weight(const array& x, float eps) {
  auto real = mx::fast::rms_norm(x, std::nullopt, eps);
  auto t = real.dtype();
  return fused_or(std::move(real), "RMSNorm",
                  as_gpu() ? std::vector<array>{mx::astype(x, t), array(1, t)} : std::vector<array>{});
}
ArrayPtr rope(const array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset) {
  return fused_or(mx::fast::rope(x, dims, traditional, base, scale, offset), "RoPE",
                  rope_inputs(x, array(offset, mx::int32), std::nullopt));
}
ArrayPtr rope_array_offset(const array& x, int32_t dims, bool traditional, float base, float scale,
                           const array& offset) {
  return fused_or(mx::fast::rope(x, dims, traditional, base, scale, offset), "RoPE",
                  rope_inputs(x, offset, std::nullopt));
}
ArrayPtr rope_freqs(const array& x, int32_t dims, bool traditional, float scale, const array& offset,
                    const array& freqs) {
  return fused_or(mx::fast::rope(x, dims, traditional, std::nullopt, scale, offset, freqs), "RoPE",
                  rope_inputs(x, offset, freqs));
}
ArrayPtr sdpa(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode) {
  auto real = mx::fast::scaled_dot_product_attention(q, k, v, scale, std::string(mask_mode));
  auto in = sdpa_inputs(real, q, k, v, std::nullopt);
  return fused_or(std::move(real), "ScaledDotProductAttention", std::move(in));
}
ArrayPtr sdpa_masked(const array& q, const array& k, const array& v, float scale, const array& mask) {
  auto real = mx::fast::scaled_dot_product_attention(q, k, v, scale, "array", mask);
  auto in = sdpa_inputs(real, q, k, v, mask);
  return fused_or(std::move(real), "ScaledDotProductAttention", std::move(in));
}

// ---- op counting ----
rust::Vec<OpTally> count_ops(const ArrayVec& outputs, const ArrayVec& stop) {
  std::unordered_set<std::uintptr_t> seen;
  std::unordered_set<std::uintptr_t> ops;
  for (const auto& a : stop.items) seen.insert(a.id());
  std::map<std::string, uint64_t> tally;
  std::vector<array> todo(outputs.items.begin(), outputs.items.end());
  while (!todo.empty()) {
    array a = std::move(todo.back());
    todo.pop_back();
    // constants, weights and arrays an earlier eval scheduled are inputs, not ops
    if (!seen.insert(a.id()).second || !a.has_primitive() || a.status() != array::Status::unscheduled) {
      continue;
    }
    // the outputs of one multi-output op (siblings) are one op. (Not keyed by primitive:
    // separate calls of one compiled function share theirs.)
    auto op = a.id();
    for (const auto& sib : a.siblings()) op = std::min(op, sib.id());
    if (ops.insert(op).second) {
      ++tally[a.primitive().name()];
    }
    for (const auto& in : a.inputs()) todo.push_back(in);
  }
  rust::Vec<OpTally> out;
  for (const auto& [name, count] : tally) out.push_back(OpTally{rust::String(name), count});
  return out;
}

// ---- fused (compiled) element-wise ops ----
namespace {
// Times this thread traced a compiled op (the impl bodies run only while MLX traces).
thread_local uint64_t g_compile_traces = 0;

std::vector<array> swiglu_impl(const std::vector<array>& in) {
  ++g_compile_traces;
  const array& g = in[0];
  return {mx::multiply(mx::multiply(g, mx::sigmoid(g)), in[1])};
}
}  // namespace

uint64_t compile_traces() { return g_compile_traces; }

ArrayPtr swiglu(const array& gate, const array& up) {
  // A plain function pointer gives MLX a stable identity for its compile cache.
  static auto fn = mx::compile(&swiglu_impl, /*shapeless=*/true);
  return wrap(fn({gate, up})[0]);
}

// ---- compiled-kernel cache support ----
KernelIdentity kernel_identity(const array& out) {
  if (!out.has_primitive() || std::string(out.primitive().name()) != "CustomKernel") {
    throw std::invalid_argument("kernel_identity: the array is not the output of a custom kernel");
  }
  const auto& k = static_cast<const mx::fast::CustomKernel&>(out.primitive());
  const auto st = k.state();
  const std::string& name = std::get<0>(st);
  const std::string& source = std::get<1>(st);
  // as MLX's CustomKernel::eval_gpu names the module it compiles (and caches on disk)
  std::ostringstream module;
  module << name << "_" << std::hex << std::hash<std::string>{}(source);
  KernelIdentity id;
  id.kernel_name = rust::String(name);
  id.module_name = rust::String(module.str());
  id.source = rust::String(source);
  return id;
}

namespace {
// NVRTC's C API, declared here (no CUDA headers at build time); nvrtcProgram is a pointer.
using nvrtcProgram = void*;
struct Nvrtc {
  void* handle = nullptr;
  std::string path;
  int (*version)(int*, int*) = nullptr;
  int (*create)(nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*) = nullptr;
  int (*destroy)(nvrtcProgram*) = nullptr;
  int (*add_name)(nvrtcProgram, const char*) = nullptr;
  int (*compile)(nvrtcProgram, int, const char* const*) = nullptr;
  int (*log_size)(nvrtcProgram, size_t*) = nullptr;
  int (*log)(nvrtcProgram, char*) = nullptr;
  int (*lowered)(nvrtcProgram, const char*, const char**) = nullptr;
  int (*cubin_size)(nvrtcProgram, size_t*) = nullptr;
  int (*cubin)(nvrtcProgram, char*) = nullptr;
  int (*ptx_size)(nvrtcProgram, size_t*) = nullptr;
  int (*ptx)(nvrtcProgram, char*) = nullptr;
  const char* (*error_string)(int) = nullptr;
};

const Nvrtc& nvrtc(const std::string& library) {
  static std::mutex mu;
  static std::unordered_map<std::string, Nvrtc> loaded;
  std::lock_guard<std::mutex> lock(mu);
  auto it = loaded.find(library);
  if (it != loaded.end()) return it->second;
  Nvrtc n;
  std::vector<std::string> names;
  if (!library.empty()) {
    names.push_back(library);
  } else {
    names = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
  }
  for (const auto& name : names) {
    // the one MLX's CUDA library already loaded first, then the loader's search path
    n.handle = dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD);
    if (!n.handle) n.handle = dlopen(name.c_str(), RTLD_NOW);
    if (n.handle) break;
  }
  if (n.handle) {
    auto sym = [&](auto& f, const char* s) { f = reinterpret_cast<std::decay_t<decltype(f)>>(dlsym(n.handle, s)); };
    sym(n.version, "nvrtcVersion");
    sym(n.create, "nvrtcCreateProgram");
    sym(n.destroy, "nvrtcDestroyProgram");
    sym(n.add_name, "nvrtcAddNameExpression");
    sym(n.compile, "nvrtcCompileProgram");
    sym(n.log_size, "nvrtcGetProgramLogSize");
    sym(n.log, "nvrtcGetProgramLog");
    sym(n.lowered, "nvrtcGetLoweredName");
    sym(n.cubin_size, "nvrtcGetCUBINSize");
    sym(n.cubin, "nvrtcGetCUBIN");
    sym(n.ptx_size, "nvrtcGetPTXSize");
    sym(n.ptx, "nvrtcGetPTX");
    sym(n.error_string, "nvrtcGetErrorString");
    void* any = reinterpret_cast<void*>(n.version);
    Dl_info info;
    if (any && dladdr(any, &info) && info.dli_fname) n.path = info.dli_fname;
    if (!(n.version && n.create && n.destroy && n.add_name && n.compile && n.log_size && n.log &&
          n.lowered && n.cubin_size && n.cubin && n.ptx_size && n.ptx && n.error_string)) {
      n.handle = nullptr;  // (an unrelated library of that name: treated as absent)
    }
  }
  return loaded.emplace(library, n).first->second;
}

const Nvrtc& nvrtc_or_throw(rust::Str library) {
  const auto& n = nvrtc(std::string(library));
  if (!n.handle) {
    throw std::runtime_error(library.empty() ? std::string("NVRTC (libnvrtc.so.13/.12) is not loadable")
                                             : "NVRTC library " + std::string(library) + " is not loadable");
  }
  return n;
}

void nvrtc_check(const Nvrtc& n, int rc, const char* what) {
  if (rc != 0) throw std::runtime_error(std::string(what) + " failed: " + n.error_string(rc));
}
}  // namespace

int32_t nvrtc_version(rust::Str library) {
  const auto& n = nvrtc_or_throw(library);
  int major = 0, minor = 0;
  nvrtc_check(n, n.version(&major, &minor), "nvrtcVersion");
  return major * 1000 + minor * 10;
}

rust::String nvrtc_library_path(rust::Str library) { return rust::String(nvrtc_or_throw(library).path); }

NvrtcOutput nvrtc_compile(rust::Str library, rust::Str source, rust::Str file,
                          rust::Slice<const rust::String> names, rust::Slice<const rust::String> options,
                          bool cubin) {
  const auto& n = nvrtc_or_throw(library);
  std::string src(source), fname(file);
  nvrtcProgram prog = nullptr;
  nvrtc_check(n, n.create(&prog, src.c_str(), fname.c_str(), 0, nullptr, nullptr), "nvrtcCreateProgram");
  std::unique_ptr<nvrtcProgram, std::function<void(nvrtcProgram*)>> guard(&prog, [&n](nvrtcProgram* p) { n.destroy(p); });
  std::vector<std::string> exprs;
  for (const auto& nm : names) exprs.emplace_back(std::string(nm));
  for (const auto& e : exprs) nvrtc_check(n, n.add_name(prog, e.c_str()), "nvrtcAddNameExpression");
  std::vector<std::string> opts;
  for (const auto& o : options) opts.emplace_back(std::string(o));
  std::vector<const char*> args;
  for (const auto& o : opts) args.push_back(o.c_str());
  int rc = n.compile(prog, int(args.size()), args.data());
  if (rc != 0) {
    size_t size = 0;
    n.log_size(prog, &size);
    std::string log(size, '\0');
    if (size) n.log(prog, log.data());
    throw std::runtime_error(std::string("nvrtcCompileProgram failed: ") + n.error_string(rc) + "\n" + log);
  }
  NvrtcOutput out;
  for (const auto& e : exprs) {
    const char* low = nullptr;
    nvrtc_check(n, n.lowered(prog, e.c_str(), &low), "nvrtcGetLoweredName");
    out.lowered.push_back(rust::String(low ? low : ""));
  }
  size_t size = 0;
  nvrtc_check(n, cubin ? n.cubin_size(prog, &size) : n.ptx_size(prog, &size), "nvrtcGetCUBINSize");
  std::vector<char> bin(size);
  if (size) nvrtc_check(n, cubin ? n.cubin(prog, bin.data()) : n.ptx(prog, bin.data()), "nvrtcGetCUBIN");
  out.binary.reserve(size);
  for (char c : bin) out.binary.push_back(static_cast<uint8_t>(c));
  return out;
}

// ---- custom kernels ----
namespace {
// The op MLX made at a custom kernel variant's first call (its `CustomKernel` primitive:
// the generated source, launch sizes), shared by later calls' arrays as MLX's `compile`
// shares primitives between replays. The primitive's class is not exported by libmlx,
// so it is reused, not constructed here.
struct KernelVariant {
  std::shared_ptr<mx::Primitive> primitive;
  std::string name;
  size_t inputs;
  std::vector<mx::Dtype> dtypes;
};
}  // namespace

std::unique_ptr<ArrayVec> cuda_kernel(uint64_t variant, bool reuse, rust::Str name,
                                      rust::Slice<const rust::String> input_names,
                                      rust::Slice<const rust::String> output_names, rust::Str source,
                                      rust::Str header, const ArrayVec& inputs,
                                      rust::Slice<const int32_t> out_shapes,
                                      rust::Slice<const int32_t> out_ndims, Dtype out_dtype,
                                      rust::Slice<const rust::String> tnames, rust::Slice<const int32_t> tvals,
                                      Dtype tdtype, rust::Slice<const int32_t> grid,
                                      rust::Slice<const int32_t> threadgroup, int32_t shared_memory) {
  if (tnames.size() != tvals.size() || grid.size() != 3 || threadgroup.size() != 3) {
    throw std::invalid_argument("cuda_kernel: template names/values or grid/threadgroup sizes differ");
  }
  if (out_ndims.size() != output_names.size() || out_ndims.empty()) {
    throw std::invalid_argument("cuda_kernel: one shape per output name needed");
  }
  std::vector<mx::Shape> shapes;
  size_t off = 0;
  for (int32_t nd : out_ndims) {
    if (nd < 0 || off + size_t(nd) > out_shapes.size()) {
      throw std::invalid_argument("cuda_kernel: output shapes shorter than their ranks");
    }
    shapes.emplace_back(out_shapes.begin() + off, out_shapes.begin() + off + nd);
    off += size_t(nd);
  }
  if (off != out_shapes.size()) {
    throw std::invalid_argument("cuda_kernel: output shapes longer than their ranks");
  }
  // A decode step calls a few kernels per layer: building an op through MLX's kernel
  // function generates and formats the whole source every time (several µs a call on a
  // GPU box's host), so a variant seen before with the same launch gets the op MLX made
  // for it the first time. Per thread, as MLX's streams are.
  thread_local std::unordered_map<uint64_t, KernelVariant> variants;
  uint64_t launch = variant;
  for (int32_t v : {grid[0], grid[1], grid[2], threadgroup[0], threadgroup[1], threadgroup[2], shared_memory}) {
    launch = (launch ^ uint32_t(v)) * 0x100000001b3ull;
  }
  if (auto v = reuse ? variants.find(launch) : variants.end(); v != variants.end()) {
    const KernelVariant& k = v->second;
    if (k.inputs != inputs.items.size() || k.dtypes.size() != shapes.size() || k.dtypes[0] != to_mx(out_dtype) ||
        k.name != std::string_view(name.data(), name.size())) {
      throw std::invalid_argument("cuda_kernel: a variant key was reused for another kernel");
    }
    auto out = std::make_unique<ArrayVec>();
    out->items = mx::array::make_arrays(std::move(shapes), k.dtypes, k.primitive, inputs.items);
    return out;
  }
  // Keyed by name and dynamic shared memory (the caller names each source differently,
  // and MLX fixes a function's shared memory when it is made): no copy or hash of the
  // source here.
  static std::unordered_map<std::string, mx::fast::CustomKernelFunction> kernels;
  std::string key(name);
  key += '#';
  key += std::to_string(shared_memory);
  auto it = kernels.find(key);
  if (it == kernels.end()) {
    std::vector<std::string> in_names, out_names;
    for (const auto& n : input_names) in_names.emplace_back(std::string(n));
    for (const auto& n : output_names) out_names.emplace_back(std::string(n));
    auto fn = mx::fast::cuda_kernel(std::string(name), in_names, out_names, std::string(source),
                                    std::string(header), /*ensure_row_contiguous=*/true, shared_memory);
    it = kernels.emplace(std::move(key), std::move(fn)).first;
  }
  std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs;
  targs.emplace_back("T", to_mx(tdtype));
  for (size_t i = 0; i < tnames.size(); ++i) targs.emplace_back(std::string(tnames[i]), int(tvals[i]));
  std::vector<mx::Dtype> dtypes(shapes.size(), to_mx(out_dtype));
  auto out = std::make_unique<ArrayVec>();
  out->items = it->second(inputs.items, shapes, dtypes, {grid[0], grid[1], grid[2]},
                          {threadgroup[0], threadgroup[1], threadgroup[2]}, targs, std::nullopt, false, {});
  if (reuse && !out->items.empty() && out->items[0].has_primitive()) {
    variants.emplace(launch, KernelVariant{out->items[0].primitive_ptr(), std::string(name),
                                        inputs.items.size(), dtypes});
  }
  return out;
}

// ---- kernels launched by one op ----
namespace {

// y[i] = x[i] + 1 for i < n (PTX, compiled by the driver when loaded)
const char kAddOnePtx[] = R"(.version 7.5
.target sm_75
.address_size 64
.visible .entry mlxcel_add_one(.param .u64 x, .param .u64 y, .param .u32 n) {
  .reg .pred p;
  .reg .b32 r<6>;
  .reg .f32 f<3>;
  .reg .b64 d<8>;
  ld.param.u64 d1, [x];
  ld.param.u64 d2, [y];
  ld.param.u32 r1, [n];
  mov.u32 r2, %ctaid.x;
  mov.u32 r3, %ntid.x;
  mov.u32 r4, %tid.x;
  mad.lo.s32 r5, r2, r3, r4;
  setp.ge.u32 p, r5, r1;
  @p bra DONE;
  cvta.to.global.u64 d3, d1;
  cvta.to.global.u64 d4, d2;
  mul.wide.u32 d5, r5, 4;
  add.s64 d6, d3, d5;
  add.s64 d7, d4, d5;
  ld.global.f32 f1, [d6];
  add.f32 f2, f1, 0f3F800000;
  st.global.f32 [d7], f2;
DONE:
  ret;
}
)";

// CUDA's dim3, passed by value as the encoder's functions take it
struct Dim3 {
  unsigned x, y, z;
};

// MLX's CUDA command encoder (mlx/backend/cuda/device.h), reached through the exported
// symbols of the loaded CUDA library (this shim links against whichever MLX library is
// present at build time, where they may not exist): member functions called with the
// encoder as their first argument, as the Itanium C++ ABI passes `this`.
struct EncoderApi {
  void* (*encoder)(mx::Stream) = nullptr;
  void (*set_input)(void*, const array&) = nullptr;
  void (*set_output)(void*, const array&) = nullptr;
  void (*add_kernel)(void*, void*, Dim3, Dim3, Dim3, uint32_t, void**) = nullptr;
  int (*module_load)(void**, const void*) = nullptr;
  int (*get_function)(void**, void*, const char*) = nullptr;
  std::string missing;
};

// `f` = the function `name` of `lib`; a name not found is added to `missing`
template <class F>
void find_function(F& f, void* lib, const char* name, std::string& missing) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f) missing += std::string(missing.empty() ? "" : ", ") + name;
}

// mlx::core::cu::get_command_encoder(Stream), mangled
constexpr const char* kGetCommandEncoder = "_ZN3mlx4core2cu19get_command_encoderENS0_6StreamE";

const EncoderApi& encoder_api() {
  static const EncoderApi api = [] {
    EncoderApi a;
    auto sym = [&](auto& f, void* lib, const char* s) { find_function(f, lib, s, a.missing); };
    sym(a.encoder, RTLD_DEFAULT, kGetCommandEncoder);
    sym(a.set_input, RTLD_DEFAULT, "_ZN3mlx4core2cu14CommandEncoder15set_input_arrayERKNS0_5arrayE");
    sym(a.set_output, RTLD_DEFAULT, "_ZN3mlx4core2cu14CommandEncoder16set_output_arrayERKNS0_5arrayE");
    sym(a.add_kernel, RTLD_DEFAULT,
        "_ZN3mlx4core2cu14CommandEncoder19add_kernel_node_rawEP9CUfunc_st4dim3S5_S5_jPPv");
    void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!cuda) cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (cuda) {
      sym(a.module_load, cuda, "cuModuleLoadData");
      sym(a.get_function, cuda, "cuModuleGetFunction");
    } else {
      a.missing += std::string(a.missing.empty() ? "" : ", ") + "libcuda.so.1";
    }
    return a;
  }();
  return api;
}

class LaunchChain : public mx::UnaryPrimitive {
 public:
  LaunchChain(mx::Stream s, int k) : mx::UnaryPrimitive(s), k_(k) {}

  void eval_cpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("launch_chain runs on a CUDA stream only");
  }
  void eval_gpu(const std::vector<array>& inputs, array& out) override {
    const auto& api = encoder_api();
    if (!api.missing.empty()) throw std::runtime_error("launch_chain: not found: " + api.missing);
    void* enc = api.encoder(stream());
    // (loaded on the thread that evaluates, whose CUDA context MLX made current)
    thread_local void* fn = nullptr;
    if (!fn) {
      void* module = nullptr;
      if (int rc = api.module_load(&module, kAddOnePtx); rc != 0) {
        throw std::runtime_error("launch_chain: cuModuleLoadData failed: " + std::to_string(rc));
      }
      if (int rc = api.get_function(&fn, module, "mlxcel_add_one"); rc != 0) {
        throw std::runtime_error("launch_chain: cuModuleGetFunction failed: " + std::to_string(rc));
      }
    }
    const array& x = inputs[0];
    if (!x.flags().row_contiguous) throw std::runtime_error("launch_chain: a row-contiguous input needed");
    // (MLX's own ops allocate with its stream-ordered device allocator, which it does not
    // export; this buffer may be unified memory, which changes the device's time, not the
    // host's)
    out.set_data(mx::allocator::malloc(out.nbytes()));
    uint32_t n = uint32_t(x.size());
    Dim3 block{256, 1, 1}, grid{(n + 255) / 256, 1, 1}, cluster{1, 1, 1};
    const void* dst = out.data<void>();
    for (int i = 0; i < k_; ++i) {
      // the encoder orders a kernel node after the last writer of each buffer named
      // before it, and forgets the names once the node is added: so before every node
      api.set_input(enc, i == 0 ? x : out);
      api.set_output(enc, out);
      const void* src = i == 0 ? x.data<void>() : dst;
      void* params[] = {&src, &dst, &n};
      api.add_kernel(enc, fn, grid, block, cluster, 0, params);
    }
  }
  const char* name() const override { return "LaunchChain"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  int k_;
};

}  // namespace

ArrayPtr launch_chain(const array& x, int32_t k, const StreamRef& s) {
  if (x.dtype() != mx::float32 || k < 1) throw std::invalid_argument("launch_chain: float32 input and k >= 1");
  return wrap(array(x.shape(), mx::float32, std::make_shared<LaunchChain>(to_stream(s), k),
                    std::vector<array>{x}));
}
rust::String launch_chain_unavailable() { return rust::String(encoder_api().missing); }

// ---- a graph evaluated as one op ----
namespace {

// MLX's CUDA encoder's commit functions (see EncoderApi), looked up on first use
struct CommitApi {
  void* (*encoder)(mx::Stream) = nullptr;
  bool (*needs_commit)(void*) = nullptr;
  void (*commit)(void*) = nullptr;
  void (*add_completed_handler)(void*, std::function<void()>) = nullptr;
  std::string missing;
};

const CommitApi& commit_api() {
  static const CommitApi api = [] {
    CommitApi a;
    auto sym = [&](auto& f, const char* s) { find_function(f, RTLD_DEFAULT, s, a.missing); };
    sym(a.encoder, kGetCommandEncoder);
    sym(a.needs_commit, "_ZN3mlx4core2cu14CommandEncoder12needs_commitEv");
    sym(a.commit, "_ZN3mlx4core2cu14CommandEncoder6commitEv");
    sym(a.add_completed_handler, "_ZN3mlx4core2cu14CommandEncoder21add_completed_handlerESt8functionIFvvEE");
    return a;
  }();
  return api;
}

// The ops of a graph (`tape_`: each op's first output, inputs before their readers),
// evaluated in one op: MLX's evaluation loop (its tape, events, fences and status per
// array) runs once for all of them, and each op's own `eval_gpu`/`eval_cpu` encodes its
// kernels as it would. The outputs take the buffers of `exports_`. An op an earlier
// evaluation already ran (one shared with another graph) is skipped. Each op's arrays are
// marked evaluated and detached once it has run, as MLX's loop leaves them, and the buffers it
// would hold (each op's inputs') are held until the device is done with them (on CUDA by
// the command buffer's completion handler; on the CPU by a task queued after the ops').
class FusedGraph : public mx::Primitive {
 public:
  FusedGraph(mx::Stream s, std::vector<array> tape, std::vector<array> exports)
      : mx::Primitive(s), tape_(std::move(tape)), exports_(std::move(exports)) {}

  void eval_cpu(const std::vector<array>&, std::vector<array>& outputs) override { run(outputs, false); }
  void eval_gpu(const std::vector<array>&, std::vector<array>& outputs) override { run(outputs, true); }
  const char* name() const override { return "FusedGraph"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  void run(std::vector<array>& outputs, bool gpu) {
    const CommitApi& api = commit_api();
    void* enc = nullptr;
    if (gpu) {
      if (!api.missing.empty()) throw std::runtime_error("fused graph: not found: " + api.missing);
      enc = api.encoder(stream());
    }
    // the outputs' event (an asynchronous evaluation attaches it before this runs): an
    // op's array held elsewhere is not read before the device has run it
    const mx::Event event = outputs[0].event();
    std::vector<std::shared_ptr<array::Data>> keep;
    for (auto& slot : tape_) {
      // (taken out of the tape, as MLX's loop pops its tape: an output the tape held would
      // not be updated in place by the op reading it, a KV cache's second write)
      array a = std::move(slot);
      if (a.status() != array::Status::unscheduled) continue;
      auto outs = a.outputs();
      if (gpu) {
        a.primitive().eval_gpu(a.inputs(), outs);
      } else {
        a.primitive().eval_cpu(a.inputs(), outs);
      }
      // as MLX's loop keeps them: the inputs' buffers (not an input's whose buffer an
      // output took over), and the outputs' of a multi-output op
      for (const auto& in : a.inputs()) {
        if (in.data_shared_ptr() != a.data_shared_ptr()) keep.push_back(in.data_shared_ptr());
      }
      if (outs.size() > 1) {
        for (const auto& o : outs) keep.push_back(o.data_shared_ptr());
      }
      // evaluated and detached at once, as MLX's loop leaves each op: it holds its inputs
      // no longer than there
      for (auto& o : outs) {
        if (event.valid()) o.attach_event(event);
        o.set_status(array::Status::evaluated);
      }
      if (!a.is_tracer()) a.detach();
      // as MLX's loop does after each op: a full command buffer goes to the device, so
      // that it starts on the first kernels while the host encodes the rest
      if (gpu && api.needs_commit(enc)) {
        auto s = stream();
        mx::scheduler::notify_new_task(s);
        api.add_completed_handler(enc, [s]() { mx::scheduler::notify_task_completion(s); });
        api.commit(enc);
      }
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      outputs[i].copy_shared_buffer(exports_[i]);
    }
    tape_.clear();
    exports_.clear();
    if (gpu) {
      api.add_completed_handler(enc, [keep = std::move(keep)]() {});
    } else {
      mx::cpu::get_command_encoder(stream()).dispatch([keep = std::move(keep)]() {});
    }
  }

  std::vector<array> tape_;
  std::vector<array> exports_;
};

}  // namespace

std::unique_ptr<ArrayVec> fuse_graph(const ArrayVec& outputs) {
  // the ops: arrays with a primitive that no evaluation has scheduled, reached from the
  // outputs; everything else (weights, evaluated arrays) is read as it is
  auto is_op = [](const array& a) { return a.has_primitive() && a.status() == array::Status::unscheduled; };
  auto out = std::make_unique<ArrayVec>();
  auto first = std::find_if(outputs.items.begin(), outputs.items.end(), is_op);
  if (first == outputs.items.end()) {
    out->items = outputs.items;
    return out;
  }
  const mx::Stream stream = first->primitive().stream();
  // Inputs of the fused op: only arrays of another stream, whose events MLX's loop must
  // wait for. The others are ordered by the stream and kept alive by the ops that read
  // them; an input the fused op held would also keep an op from updating its buffer in
  // place (a KV cache write whose pool no one else holds).
  auto other_stream = [&](const array& a) {
    return (a.has_primitive() && a.primitive().stream() != stream) ||
           (a.event().valid() && a.event().stream() != stream);
  };
  std::unordered_set<std::uintptr_t> seen;
  std::vector<array> tape;
  std::vector<array> inputs;
  // iterative depth-first walk, each op appended after its inputs (the arrays are alive
  // through `outputs` for the whole walk, so it holds pointers, not handles)
  std::vector<std::pair<const array*, bool>> todo;
  for (const auto& o : outputs.items) todo.emplace_back(&o, false);
  while (!todo.empty()) {
    auto [a, expanded] = todo.back();
    todo.pop_back();
    if (expanded) {
      tape.push_back(*a);
      continue;
    }
    if (!seen.insert(a->id()).second) continue;
    if (!is_op(*a)) {
      if (other_stream(*a)) inputs.push_back(*a);
      continue;
    }
    for (const auto& sib : a->siblings()) seen.insert(sib.id());
    if (a->primitive().stream() != stream) {
      throw std::invalid_argument(std::string("fuse_graph: ops on two streams (") + a->primitive().name() + ")");
    }
    if (a->is_tracer()) throw std::invalid_argument("fuse_graph: an array being traced by a transform");
    todo.emplace_back(a, true);
    for (const auto& in : a->inputs()) {
      if (!seen.count(in.id())) todo.emplace_back(&in, false);
    }
  }
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (const auto& o : outputs.items) {
    shapes.push_back(o.shape());
    dtypes.push_back(o.dtype());
  }
  out->items = array::make_arrays(std::move(shapes), std::move(dtypes),
                                  std::make_shared<FusedGraph>(stream, std::move(tape), outputs.items),
                                  std::move(inputs));
  return out;
}

// ---- quantization ----
ArrayPtr quantized_matmul(const array& x, const array& w, const array& scales, const array& biases,
                          bool transpose, int32_t group_size, int32_t bits) {
  return wrap(mx::quantized_matmul(x, w, scales, biases, transpose, group_size, bits));
}
ArrayPtr dequantize(const array& w, const array& scales, const array& biases, int32_t group_size,
                    int32_t bits) {
  // on a GPU one fused op (MLX's `Quantize` primitive, dequantizing): counted so when fast
  // ops are built as on a GPU
  return fused_or(mx::dequantize(w, scales, biases, group_size, bits), "Quantize",
                  as_gpu() ? std::vector<array>{w, scales, biases} : std::vector<array>{});
}
ArrayPtr gather_mm(const array& a, const array& b, const array& rhs_indices, bool sorted) {
  return wrap(mx::gather_mm(a, b, std::nullopt, rhs_indices, sorted));
}
ArrayPtr gather_qmm(const array& x, const array& w, const array& scales, const array& biases,
                    const array& rhs_indices, int32_t group_size, int32_t bits, bool sorted) {
  return wrap(mx::gather_qmm(x, w, scales, biases, std::nullopt, rhs_indices, true, group_size, bits,
                             "affine", std::nullopt, sorted));
}
std::unique_ptr<ArrayVec> quantize(const array& w, int32_t group_size, int32_t bits) {
  auto out = std::make_unique<ArrayVec>();
  out->items = mx::quantize(w, group_size, bits);
  return out;
}

// ---- random ----
ArrayPtr random_key(uint64_t seed) { return wrap(mx::random::key(seed)); }
std::unique_ptr<ArrayVec> random_split(const array& key, int32_t num) {
  auto keys = mx::random::split(key, num);
  auto out = std::make_unique<ArrayVec>();
  for (int i = 0; i < num; ++i) out->items.push_back(mx::take(keys, i, 0));
  return out;
}
ArrayPtr random_uniform(rust::Slice<const int32_t> shape, Dtype dtype, const array& key) {
  return wrap(mx::random::uniform(to_shape(shape), to_mx(dtype), key));
}
ArrayPtr random_normal(rust::Slice<const int32_t> shape, Dtype dtype, float loc, float scale,
                       const array& key) {
  return wrap(mx::random::normal(to_shape(shape), to_mx(dtype), loc, scale, key));
}
ArrayPtr random_categorical(const array& logits, int32_t axis, const array& key) {
  return wrap(mx::random::categorical(logits, axis, key));
}

// ---- arrays the host fills later (HostFill) ----
struct HostFillSlot {
  std::mutex m;
  std::condition_variable cv;
  std::vector<uint8_t> data;
  // given (or cancelled: data empty) — the task stops waiting
  bool done = false;
};

namespace {

class HostFillPrimitive : public mx::UnaryPrimitive {
 public:
  HostFillPrimitive(mx::Stream s, std::shared_ptr<HostFillSlot> slot, double timeout_s)
      : mx::UnaryPrimitive(s), slot_(std::move(slot)), timeout_s_(timeout_s) {}

  void eval_cpu(const std::vector<array>&, array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    // enqueued on the stream directly, not through the CPU command encoder: a waiting
    // task must not count as one of MLX's active tasks (evaluation waits for those when
    // there are many, which would wait for the host that is still building)
    mx::scheduler::enqueue(stream(), [slot = slot_, out, t = timeout_s_]() mutable {
      std::unique_lock<std::mutex> lk(slot->m);
      slot->cv.wait_for(lk, std::chrono::duration<double>(t), [&] { return slot->done; });
      slot->done = true;
      uint8_t* dst = out.data<uint8_t>();
      if (slot->data.size() == out.nbytes()) {
        std::memcpy(dst, slot->data.data(), out.nbytes());
      } else {
        std::memset(dst, 0, out.nbytes());
      }
      slot->data.clear();
      slot->data.shrink_to_fit();
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("HostFill is evaluated on a CPU stream");
  }
  const char* name() const override { return "HostFill"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }

 private:
  std::shared_ptr<HostFillSlot> slot_;
  double timeout_s_;
};

mx::Stream host_fill_stream() {
  thread_local std::optional<mx::Stream> s;
  if (!s) s = mx::new_stream(mx::Device(mx::Device::cpu));
  return *s;
}

}  // namespace

std::unique_ptr<HostFill> host_fill_new(rust::Slice<const int32_t> shape, Dtype dtype,
                                        double timeout_s) {
  auto slot = std::make_shared<HostFillSlot>();
  array a(to_shape(shape), to_mx(dtype),
          std::make_shared<HostFillPrimitive>(host_fill_stream(), slot, timeout_s),
          std::vector<array>{});
  mx::async_eval({a});
  return std::make_unique<HostFill>(std::move(slot), std::move(a));
}
ArrayPtr host_fill_array(const HostFill& h) { return wrap(h.arr); }
bool host_fill_provide(const HostFill& h, rust::Slice<const uint8_t> data) {
  if (data.size() != h.arr.nbytes()) {
    throw std::invalid_argument("host_fill_provide: " + std::to_string(data.size()) +
                                " bytes for an array of " + std::to_string(h.arr.nbytes()));
  }
  {
    std::lock_guard<std::mutex> lk(h.slot->m);
    if (h.slot->done) return false;
    h.slot->data.assign(data.begin(), data.end());
    h.slot->done = true;
  }
  h.slot->cv.notify_all();
  return true;
}
void host_fill_cancel(const HostFill& h) {
  {
    std::lock_guard<std::mutex> lk(h.slot->m);
    h.slot->done = true;
  }
  h.slot->cv.notify_all();
}

// ---- distributed ----
bool distributed_available(rust::Str backend) { return mx::distributed::is_available(std::string(backend)); }
std::unique_ptr<Group> distributed_init(rust::Str backend, bool strict) {
  return std::make_unique<Group>(mx::distributed::init(strict, std::string(backend)));
}
int32_t group_rank(const Group& g) { return g.group.rank(); }
int32_t group_size(const Group& g) { return g.group.size(); }
ArrayPtr all_sum(const array& x, const Group& g, const StreamRef& s) {
  return wrap(mx::distributed::all_sum(x, g.group, to_stream(s)));
}
ArrayPtr all_gather(const array& x, const Group& g, const StreamRef& s) {
  return wrap(mx::distributed::all_gather(x, g.group, to_stream(s)));
}

}  // namespace mlxcel
