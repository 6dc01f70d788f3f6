// Strided tensor views (non-owning) and a small owning tensor for tools and tests.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include <dlpack/dlpack.h>

#include "dattn/dtype.hpp"

namespace dattn {

// Where a tensor lives. The impl dispatches on the platform of Q.
enum class Platform : std::uint8_t { cpu, cuda, rocm, npu, xpu, musa };

std::string_view platform_name(Platform p);
// Case-insensitive; throws InvalidArgument naming `field` and the valid names.
Platform parse_platform(std::string_view name, std::string_view field = "platform");

// A non-owning strided view: data pointer, dtype, platform, shape and strides in *elements*.
// Any strides are allowed (including 0 for broadcast and negative), so Q/K/V may be read
// straight out of a fused QKV projection.
class TensorView {
 public:
  static constexpr int kMaxDims = 6;

  TensorView() = default;
  // Contiguous row-major view.
  TensorView(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
             Platform platform = Platform::cpu);
  TensorView(void* data, DType dtype, std::span<const std::int64_t> shape,
             Platform platform = Platform::cpu);
  // Explicit strides (elements); `strides.size()` must equal `shape.size()`.
  TensorView(void* data, DType dtype, std::span<const std::int64_t> shape,
             std::span<const std::int64_t> strides, Platform platform = Platform::cpu);

  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  Platform platform() const { return platform_; }
  int ndim() const { return ndim_; }
  std::span<const std::int64_t> shape() const { return {shape_.data(), std::size_t(ndim_)}; }
  std::span<const std::int64_t> strides() const { return {strides_.data(), std::size_t(ndim_)}; }
  std::int64_t size(int dim) const { return shape_[static_cast<std::size_t>(dim)]; }
  std::int64_t stride(int dim) const { return strides_[static_cast<std::size_t>(dim)]; }
  std::int64_t numel() const;
  bool is_contiguous() const;
  bool empty() const { return data_ == nullptr && ndim_ == 0; }

  // Same memory, dims reordered: result dim i is this view's dim perm[i].
  TensorView permuted(std::span<const int> perm) const;
  // Same memory, dim `dim` restricted to [start, start + length).
  TensorView sliced(int dim, std::int64_t start, std::int64_t length) const;
  // Same memory, a size-1 dim of stride 0 inserted at `dim` (0 <= dim <= ndim() < kMaxDims):
  // [T, H, D].unsqueezed(0) is [1, T, H, D].
  TensorView unsqueezed(int dim) const;
  // Pointer to the element at `index` (one coordinate per dim).
  void* element_ptr(std::span<const std::int64_t> index) const;

  // "f32[2, 16, 8, 64] strides [8192, 512, 64, 1] cpu"
  std::string describe() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Platform platform_ = Platform::cpu;
  int ndim_ = 0;
  std::array<std::int64_t, kMaxDims> shape_{};
  std::array<std::int64_t, kMaxDims> strides_{};
};

// An owning, contiguous, 64-byte aligned CPU tensor. Copies share the storage.
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(std::span<const std::int64_t> shape, DType dtype);
  static Tensor empty(std::initializer_list<std::int64_t> shape, DType dtype);
  static Tensor zeros(std::span<const std::int64_t> shape, DType dtype);
  static Tensor zeros(std::initializer_list<std::int64_t> shape, DType dtype);
  // A contiguous copy of any CPU view, converted to `dtype` (float types via f32).
  static Tensor copy_of(const TensorView& src, DType dtype);
  static Tensor copy_of(const TensorView& src) { return copy_of(src, src.dtype()); }

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: views are what APIs take
  void* data() const { return view_.data(); }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(view_.data());
  }
  DType dtype() const { return view_.dtype(); }
  std::span<const std::int64_t> shape() const { return view_.shape(); }
  std::int64_t numel() const { return view_.numel(); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype()); }

 private:
  std::shared_ptr<std::byte[]> storage_;
  TensorView view_;
};

// Copies `src` into `dst` element by element (same shape, any strides, float types converted
// through f32; bool/int copied by value).
void copy_into(const TensorView& src, const TensorView& dst);

// ---- DLPack (DLTensor from <dlpack/dlpack.h>) ----
// Wraps a DLTensor without copying. Throws InvalidArgument for lanes != 1, unsupported dtype
// codes, ndim above TensorView::kMaxDims, or devices dattn has no platform for.
TensorView from_dlpack(const DLTensor& t);
// A DLTensor describing `view`. Shape and strides point into `storage`, which must outlive it.
struct DLPackShapeStorage {
  std::array<std::int64_t, TensorView::kMaxDims> shape{};
  std::array<std::int64_t, TensorView::kMaxDims> strides{};
};
DLTensor to_dlpack(const TensorView& view, DLPackShapeStorage& storage, int device_id = 0);

}  // namespace dattn
