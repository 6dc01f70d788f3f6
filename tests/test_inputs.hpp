// Random inputs and comparisons shared by the tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "dattn/attention.hpp"
#include "dattn/tensor.hpp"

namespace dattn::testing {

// True in the sanitizer builds (make asan: GCC's ASan + UBSan; clang's through __has_feature).
// There the suites keep every code path but not every size: the long accuracy and conformance
// cases run fewer shapes (each head size and dtype path once), as each says where it does so.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_UNDEFINED__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

// False where DATTN_TEST_TWINS=0 (make test-aarch64's runs under qemu): the long accuracy loops
// over every engine then leave the emulated twins out. A twin computes in portable C++, the same
// code on every architecture, and `make test` runs those loops with the twins natively; the
// tests that hold a real instruction to its twin name the twin and run regardless.
inline bool twins_in_engine_loops() {
  const char* v = std::getenv("DATTN_TEST_TWINS");
  return v == nullptr || std::string_view(v) != "0";
}

// A tensor of `shape` filled with N(0, 1) values rounded to `dtype`.
inline Tensor random_tensor(std::initializer_list<std::int64_t> shape, DType dtype,
                            std::uint32_t seed, float stddev = 1.0f) {
  Tensor t = Tensor::empty(shape, dtype);
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  for (std::int64_t i = 0; i < t.numel(); ++i) store_from_f32(t.data(), dtype, i, dist(rng));
  return t;
}

// A tensor filled with NaN: the padding around views, to catch stray reads and writes.
inline Tensor nan_tensor(std::initializer_list<std::int64_t> shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  for (std::int64_t i = 0; i < t.numel(); ++i)
    store_from_f32(t.data(), dtype, i, std::numeric_limits<float>::quiet_NaN());
  return t;
}

inline Tensor bool_tensor(std::initializer_list<std::int64_t> shape, std::uint32_t seed,
                          double p_true) {
  Tensor t = Tensor::empty(shape, DType::Bool);
  std::mt19937 rng(seed);
  std::bernoulli_distribution dist(p_true);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<std::uint8_t>()[i] = dist(rng) ? 1 : 0;
  return t;
}

inline Tensor int32_tensor(const std::vector<std::int32_t>& values) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(values.size())}, DType::I32);
  if (!values.empty()) std::memcpy(t.data(), values.data(), values.size() * sizeof(std::int32_t));
  return t;
}

// All elements of a view as f64, in row-major order of its shape.
inline std::vector<double> to_vector(const TensorView& v) {
  const Tensor c = Tensor::copy_of(v, DType::F32);
  std::vector<double> out(static_cast<std::size_t>(c.numel()));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = c.data_as<float>()[i];
  return out;
}

struct Difference {
  double max_abs = 0.0;
  double normwise_rel = 0.0;  // ||a - b|| / ||b||
  bool nan = false;
};

inline Difference compare(const TensorView& got, const TensorView& want) {
  const auto a = to_vector(got), b = to_vector(want);
  Difference d;
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      if (std::isnan(a[i]) != std::isnan(b[i])) d.nan = true;
      continue;
    }
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) d.max_abs = std::numeric_limits<double>::infinity();
      continue;
    }
    const double diff = std::fabs(a[i] - b[i]);
    d.max_abs = std::max(d.max_abs, diff);
    num += diff * diff;
    den += b[i] * b[i];
  }
  d.normwise_rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return d;
}

inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// A layer config for `backend` with the given heads and head size.
inline AttentionConfig layer_config(std::string backend, std::int64_t hq, std::int64_t hkv,
                                    std::int64_t d, bool causal = false) {
  AttentionConfig c;
  c.num_heads = hq;
  c.num_kv_heads = hkv;
  c.head_size = d;
  c.causal = causal;
  c.backend = std::move(backend);
  return c;
}

// A [1, S, H, E] view as [S, H, E] (THD), same memory.
inline TensorView without_batch_dim(const TensorView& t) {
  const std::array<std::int64_t, 3> shape{t.size(1), t.size(2), t.size(3)};
  const std::array<std::int64_t, 3> strides{t.stride(1), t.stride(2), t.stride(3)};
  return TensorView(t.data(), t.dtype(), shape, strides, t.platform());
}

// The largest normwise error a backend may have against the f64 reference when its inputs
// and output are in `dtype`: the rounding of the output itself, with room for f32 accumulation.
inline double tolerance_for(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return 1e-5;
    case DType::BF16:
      return 1.6e-2;
    case DType::F16:
      return 2e-3;
    default:
      return 0.0;
  }
}

}  // namespace dattn::testing
