#include "core/tensor_checks.hpp"

#include <algorithm>
#include <array>
#include <string>

#include "dattn/errors.hpp"

namespace dattn::detail {
namespace {

using i64 = std::int64_t;

[[noreturn]] void invalid(std::string_view field, const std::string& msg) {
  throw InvalidArgument(std::string(field), std::string(field) + ": " + msg);
}

// The lowest and highest byte offsets of the view's elements from data(), or false when they
// overflow int64. Requires numel > 0.
bool extent(const TensorView& t, i64& low, i64& high) {
  const i64 es = i64(dtype_size(t.dtype()));
  low = 0;
  high = 0;
  for (int i = 0; i < t.ndim(); ++i) {
    if (t.size(i) <= 1) continue;
    i64 reach = 0;  // (size - 1) * |stride| * element size
    const i64 stride = t.stride(i);
    if (stride == INT64_MIN) return false;
    if (__builtin_mul_overflow(t.size(i) - 1, stride < 0 ? -stride : stride, &reach) ||
        __builtin_mul_overflow(reach, es, &reach))
      return false;
    if (stride < 0 ? __builtin_sub_overflow(low, reach, &low)
                   : __builtin_add_overflow(high, reach, &high))
      return false;
  }
  return !__builtin_add_overflow(high, es, &high);  // one past the last element's last byte
}

}  // namespace

void check_view_memory(const TensorView& t, std::string_view field) {
  i64 n = 1;
  for (int i = 0; i < t.ndim(); ++i)
    if (__builtin_mul_overflow(n, t.size(i), &n))
      invalid(field, "the element count of " + t.describe() + " overflows int64");
  if (n == 0) return;
  const auto address = reinterpret_cast<std::uintptr_t>(t.data());
  if (address == 0)
    invalid(field, "has a null data pointer and " + std::to_string(n) + " elements");
  if (address % dtype_size(t.dtype()) != 0)
    invalid(field, "data pointer " + std::to_string(address) + " is not aligned to its " +
                       std::to_string(dtype_size(t.dtype())) + "-byte elements");
  i64 low = 0, high = 0;
  if (!extent(t, low, high))
    invalid(field, "the byte extent of shape and strides overflows int64: " + t.describe());
  // Neither end of the span may wrap around the address space.
  if (std::uintptr_t(-low) > address || std::uintptr_t(high) > UINTPTR_MAX - address)
    invalid(field, "shape and strides reach outside the address space: " + t.describe());
}

ByteSpan byte_span(const TensorView& t) {
  if (t.numel() == 0) return {};
  i64 low = 0, high = 0;
  if (!extent(t, low, high)) return {};  // check_view_memory refuses it first
  const auto address = reinterpret_cast<std::uintptr_t>(t.data());
  return {address - std::uintptr_t(-low), address + std::uintptr_t(high)};
}

bool has_internal_overlap(const TensorView& t) {
  for (int i = 0; i < t.ndim(); ++i)
    if (t.size(i) > 1 && t.stride(i) == 0) return true;
  return false;
}

bool is_non_overlapping_and_dense(const TensorView& t) {
  std::array<int, TensorView::kMaxDims> dims{};
  int n = 0;
  for (int i = 0; i < t.ndim(); ++i)
    if (t.size(i) > 1) dims[std::size_t(n++)] = i;
  std::sort(dims.begin(), dims.begin() + n,
            [&](int a, int b) { return t.stride(a) < t.stride(b); });
  i64 expect = 1;
  for (int k = 0; k < n; ++k) {
    const int i = dims[std::size_t(k)];
    if (t.stride(i) != expect) return false;
    expect *= t.size(i);
  }
  return true;
}

void check_output_internal_overlap(const TensorView& out, std::string_view out_field) {
  if (has_internal_overlap(out))
    invalid(out_field,
            "overlaps itself (a stride 0 on a dim longer than 1, e.g. an expanded "
            "tensor): several results would be written to one element; got " +
                out.describe());
}

void check_output_overlap(const TensorView& out, std::string_view out_field,
                          const TensorView& input, std::string_view input_field,
                          bool same_view_ok) {
  if (out.numel() == 0 || input.numel() == 0) return;
  const bool same = out.data() == input.data() && out.dtype() == input.dtype() &&
                    out.ndim() == input.ndim() &&
                    std::equal(out.shape().begin(), out.shape().end(), input.shape().begin()) &&
                    std::equal(out.strides().begin(), out.strides().end(), input.strides().begin());
  if (same) {
    if (same_view_ok) return;
    invalid(out_field, "is the same memory as " + std::string(input_field) +
                           ", which is still read while " + std::string(out_field) + " is written");
  }
  if (!is_non_overlapping_and_dense(out) || !is_non_overlapping_and_dense(input)) return;
  const ByteSpan a = byte_span(out), b = byte_span(input);
  if (a.begin < b.end && b.begin < a.end)
    invalid(out_field, "overlaps the memory of " + std::string(input_field) +
                           " (their byte ranges intersect); give an output buffer of its own");
}

}  // namespace dattn::detail
