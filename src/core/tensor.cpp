#include "dattn/tensor.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <new>
#include <sstream>
#include <vector>

#include "core/process_memory.hpp"
#include "dattn/errors.hpp"

namespace dattn {

namespace {

// DLPack >= 1.0 type codes that Debian's 0.6 header does not define yet.
constexpr std::uint8_t kDLBoolCode = 6;
constexpr std::uint8_t kDLFloat8E4M3FnCode = 10;

std::string join(std::span<const std::int64_t> xs) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < xs.size(); ++i) os << (i ? ", " : "") << xs[i];
  os << ']';
  return os.str();
}

}  // namespace

std::string_view platform_name(Platform p) {
  switch (p) {
    case Platform::cpu:
      return "cpu";
    case Platform::cuda:
      return "cuda";
    case Platform::rocm:
      return "rocm";
    case Platform::npu:
      return "npu";
    case Platform::xpu:
      return "xpu";
    case Platform::musa:
      return "musa";
  }
  return "?";
}

Platform parse_platform(std::string_view name, std::string_view field) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  for (Platform p : {Platform::cpu, Platform::cuda, Platform::rocm, Platform::npu, Platform::xpu,
                     Platform::musa})
    if (platform_name(p) == s) return p;
  throw InvalidArgument(std::string(field), std::string(field) + " = '" + std::string(name) +
                                                "' is not a platform; valid: cpu, cuda, rocm, "
                                                "npu, xpu, musa");
}

TensorView::TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                       Platform platform)
    : TensorView(data, dtype, std::span<const std::int64_t>(shape.begin(), shape.size()),
                 platform) {}

TensorView::TensorView(void* data, DType dtype, std::span<const std::int64_t> shape,
                       Platform platform)
    : data_(data), dtype_(dtype), platform_(platform) {
  if (shape.size() > kMaxDims)
    throw InvalidArgument("shape", "tensor rank " + std::to_string(shape.size()) +
                                       " exceeds the maximum of " + std::to_string(kMaxDims));
  ndim_ = static_cast<int>(shape.size());
  std::int64_t stride = 1;
  for (int i = ndim_ - 1; i >= 0; --i) {
    if (shape[std::size_t(i)] < 0)
      throw InvalidArgument("shape", "negative extent in shape " + join(shape));
    shape_[std::size_t(i)] = shape[std::size_t(i)];
    strides_[std::size_t(i)] = stride;
    stride *= std::max<std::int64_t>(shape[std::size_t(i)], 1);
  }
}

TensorView::TensorView(void* data, DType dtype, std::span<const std::int64_t> shape,
                       std::span<const std::int64_t> strides, Platform platform)
    : TensorView(data, dtype, shape, platform) {
  if (strides.size() != shape.size())
    throw InvalidArgument(
        "strides", "strides " + join(strides) + " do not match shape " + join(shape) + " in rank");
  std::copy(strides.begin(), strides.end(), strides_.begin());
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= shape_[std::size_t(i)];
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t expect = 1;
  for (int i = ndim_ - 1; i >= 0; --i) {
    if (shape_[std::size_t(i)] != 1 && strides_[std::size_t(i)] != expect) return false;
    expect *= shape_[std::size_t(i)];
  }
  return true;
}

TensorView TensorView::permuted(std::span<const int> perm) const {
  if (static_cast<int>(perm.size()) != ndim_)
    throw InvalidArgument("perm",
                          "permutation length does not match rank " + std::to_string(ndim_));
  TensorView out = *this;
  std::array<bool, kMaxDims> seen{};
  for (int i = 0; i < ndim_; ++i) {
    const int p = perm[std::size_t(i)];
    if (p < 0 || p >= ndim_ || seen[std::size_t(p)])
      throw InvalidArgument("perm", "not a permutation of 0.." + std::to_string(ndim_ - 1));
    seen[std::size_t(p)] = true;
    out.shape_[std::size_t(i)] = shape_[std::size_t(p)];
    out.strides_[std::size_t(i)] = strides_[std::size_t(p)];
  }
  return out;
}

TensorView TensorView::sliced(int dim, std::int64_t start, std::int64_t length) const {
  if (dim < 0 || dim >= ndim_ || start < 0 || length < 0 || start + length > size(dim))
    throw InvalidArgument("slice", "slice [" + std::to_string(start) + ", " +
                                       std::to_string(start + length) + ") of dim " +
                                       std::to_string(dim) + " is outside " + describe());
  TensorView out = *this;
  if (length > 0 && data_ != nullptr)
    out.data_ = static_cast<std::byte*>(data_) +
                start * stride(dim) * static_cast<std::int64_t>(dtype_size(dtype_));
  out.shape_[std::size_t(dim)] = length;
  return out;
}

TensorView TensorView::unsqueezed(int dim) const {
  if (dim < 0 || dim > ndim_ || ndim_ >= kMaxDims)
    throw InvalidArgument("dim", "dim: cannot insert a dim at " + std::to_string(dim) + " of " +
                                     describe() + " (at most " + std::to_string(kMaxDims) +
                                     " dims)");
  TensorView out = *this;
  for (int i = ndim_; i > dim; --i) {
    out.shape_[std::size_t(i)] = shape_[std::size_t(i - 1)];
    out.strides_[std::size_t(i)] = strides_[std::size_t(i - 1)];
  }
  out.shape_[std::size_t(dim)] = 1;
  out.strides_[std::size_t(dim)] = 0;
  out.ndim_ = ndim_ + 1;
  return out;
}

void* TensorView::element_ptr(std::span<const std::int64_t> index) const {
  std::int64_t off = 0;
  for (int i = 0; i < ndim_; ++i) off += index[std::size_t(i)] * strides_[std::size_t(i)];
  return static_cast<std::byte*>(data_) + off * static_cast<std::int64_t>(dtype_size(dtype_));
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << dtype_name(dtype_) << join(shape()) << " strides " << join(strides()) << ' '
     << platform_name(platform_);
  return os.str();
}

Tensor Tensor::empty(std::span<const std::int64_t> shape, DType dtype) {
  Tensor t;
  std::int64_t n = 1;
  for (std::int64_t s : shape) {
    if (s < 0) throw InvalidArgument("shape", "negative extent in shape " + join(shape));
    n *= s;
  }
  const std::size_t bytes = std::max<std::size_t>(64, std::size_t(n) * dtype_size(dtype));
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  // The process's result memory (core/process_memory.hpp): a large tensor is a mapping of its
  // own, never a block of the C heap that small long-lived objects could pin.
  std::byte* raw = static_cast<std::byte*>(detail::ProcessMemory::instance().allocate(rounded));
  t.storage_ = std::shared_ptr<std::byte[]>(
      raw, [](std::byte* p) { detail::ProcessMemory::instance().release(p); });
  t.view_ = TensorView(raw, dtype, shape);
  return t;
}

Tensor Tensor::empty(std::initializer_list<std::int64_t> shape, DType dtype) {
  return empty(std::span<const std::int64_t>(shape.begin(), shape.size()), dtype);
}

Tensor Tensor::zeros(std::span<const std::int64_t> shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  std::memset(t.data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::zeros(std::initializer_list<std::int64_t> shape, DType dtype) {
  return zeros(std::span<const std::int64_t>(shape.begin(), shape.size()), dtype);
}

Tensor Tensor::copy_of(const TensorView& src, DType dtype) {
  Tensor t = empty(src.shape(), dtype);
  copy_into(src, t.view());
  return t;
}

void copy_into(const TensorView& src, const TensorView& dst) {
  if (src.ndim() != dst.ndim() ||
      !std::equal(src.shape().begin(), src.shape().end(), dst.shape().begin()))
    throw InvalidArgument(
        "shape", "copy from " + src.describe() + " into " + dst.describe() + ": shapes differ");
  if (src.platform() != Platform::cpu || dst.platform() != Platform::cpu)
    throw Unsupported("platform", "copy_into needs CPU tensors");
  if (src.numel() == 0) return;
  if (src.ndim() == 0) {
    store_from_f32(dst.data(), dst.dtype(), 0, load_as_f32(src.data(), src.dtype(), 0));
    return;
  }
  // Row by row along the last dim: a memcpy when the dtypes match and both rows are
  // contiguous, else element by element (float types through f32).
  const int nd = src.ndim();
  const std::int64_t width = src.size(nd - 1), ss = src.stride(nd - 1), ds = dst.stride(nd - 1);
  const std::size_t es = dtype_size(src.dtype());
  const bool same = src.dtype() == dst.dtype();
  const bool rows_contiguous = same && (width == 1 || (ss == 1 && ds == 1));
  const bool as_float = is_float_input_dtype(dst.dtype()) || dst.dtype() == DType::FP8_E4M3;
  std::array<std::int64_t, TensorView::kMaxDims> idx{};
  const std::int64_t rows = src.numel() / width;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t so = 0, dof = 0;
    for (int i = 0; i < nd - 1; ++i) {
      so += idx[std::size_t(i)] * src.stride(i);
      dof += idx[std::size_t(i)] * dst.stride(i);
    }
    auto* dbytes = static_cast<std::byte*>(dst.data());
    const auto* sbytes = static_cast<const std::byte*>(src.data());
    if (rows_contiguous) {
      std::memcpy(dbytes + dof * std::int64_t(es), sbytes + so * std::int64_t(es),
                  std::size_t(width) * es);
    } else if (same && !as_float) {
      for (std::int64_t e = 0; e < width; ++e)
        std::memcpy(dbytes + (dof + e * ds) * std::int64_t(es),
                    sbytes + (so + e * ss) * std::int64_t(es), es);
    } else {
      for (std::int64_t e = 0; e < width; ++e)
        store_from_f32(dst.data(), dst.dtype(), dof + e * ds,
                       load_as_f32(src.data(), src.dtype(), so + e * ss));
    }
    for (int i = nd - 2; i >= 0; --i) {
      if (++idx[std::size_t(i)] < src.size(i)) break;
      idx[std::size_t(i)] = 0;
    }
  }
}

TensorView from_dlpack(const DLTensor& t) {
  if (t.dtype.lanes != 1)
    throw InvalidArgument("dlpack.dtype", "vector lanes = " + std::to_string(t.dtype.lanes) +
                                              " are not supported; valid: 1");
  DType dt;
  const int code = t.dtype.code, bits = t.dtype.bits;
  if (code == kDLFloat && bits == 32)
    dt = DType::F32;
  else if (code == kDLFloat && bits == 16)
    dt = DType::F16;
  else if (code == kDLBfloat && bits == 16)
    dt = DType::BF16;
  else if (code == kDLInt && bits == 8)
    dt = DType::I8;
  else if (code == kDLInt && bits == 32)
    dt = DType::I32;
  else if (code == kDLBoolCode && bits == 8)
    dt = DType::Bool;
  else if (code == kDLFloat8E4M3FnCode && bits == 8)
    dt = DType::FP8_E4M3;
  else
    throw InvalidArgument("dlpack.dtype", "DLPack dtype (code " + std::to_string(code) + ", bits " +
                                              std::to_string(bits) +
                                              ") is not supported; valid: float32, float16, "
                                              "bfloat16, int8, int32, bool, float8_e4m3fn");
  Platform p;
  switch (t.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:
    case kDLROCMHost:
      p = Platform::cpu;
      break;
    case kDLCUDA:
    case kDLCUDAManaged:
      p = Platform::cuda;
      break;
    case kDLROCM:
      p = Platform::rocm;
      break;
    default:
      throw InvalidArgument("dlpack.device", "DLPack device type " +
                                                 std::to_string(t.device.device_type) +
                                                 " has no dattn platform; valid: CPU, CUDA, ROCm");
  }
  if (t.ndim < 0 || t.ndim > TensorView::kMaxDims)
    throw InvalidArgument("dlpack.ndim", "ndim = " + std::to_string(t.ndim) + "; valid: 0.." +
                                             std::to_string(TensorView::kMaxDims));
  if (t.ndim > 0 && t.shape == nullptr)
    throw InvalidArgument("dlpack.shape", "shape is NULL with ndim = " + std::to_string(t.ndim) +
                                              "; a DLTensor of rank > 0 needs its shape (strides "
                                              "may be NULL: compact)");
  if (t.data == nullptr && t.byte_offset != 0)
    throw InvalidArgument("dlpack.byte_offset", "byte_offset = " + std::to_string(t.byte_offset) +
                                                    " with NULL data; valid: 0");
  std::span<const std::int64_t> shape(t.shape, std::size_t(t.ndim));
  void* data = t.data == nullptr ? nullptr : static_cast<std::byte*>(t.data) + t.byte_offset;
  if (t.strides == nullptr) return TensorView(data, dt, shape, p);
  return TensorView(data, dt, shape, std::span<const std::int64_t>(t.strides, std::size_t(t.ndim)),
                    p);
}

DLTensor to_dlpack(const TensorView& view, DLPackShapeStorage& storage, int device_id) {
  DLTensor t{};
  t.data = view.data();
  t.byte_offset = 0;
  t.ndim = view.ndim();
  switch (view.platform()) {
    case Platform::cpu:
      t.device = {kDLCPU, 0};
      break;
    case Platform::cuda:
      t.device = {kDLCUDA, device_id};
      break;
    case Platform::rocm:
      t.device = {kDLROCM, device_id};
      break;
    default:
      throw InvalidArgument("platform", "platform '" + std::string(platform_name(view.platform())) +
                                            "' has no DLPack device type; valid: cpu, cuda, rocm");
  }
  switch (view.dtype()) {
    case DType::F32:
      t.dtype = {kDLFloat, 32, 1};
      break;
    case DType::F16:
      t.dtype = {kDLFloat, 16, 1};
      break;
    case DType::BF16:
      t.dtype = {kDLBfloat, 16, 1};
      break;
    case DType::I8:
      t.dtype = {kDLInt, 8, 1};
      break;
    case DType::I32:
      t.dtype = {kDLInt, 32, 1};
      break;
    case DType::Bool:
      t.dtype = {kDLBoolCode, 8, 1};
      break;
    case DType::FP8_E4M3:
      t.dtype = {kDLFloat8E4M3FnCode, 8, 1};
      break;
  }
  for (int i = 0; i < view.ndim(); ++i) {
    storage.shape[std::size_t(i)] = view.size(i);
    storage.strides[std::size_t(i)] = view.stride(i);
  }
  t.shape = storage.shape.data();
  t.strides = storage.strides.data();
  return t;
}

}  // namespace dattn
