// FLASH tile kernels in portable C++ (one lane; the compiler may vectorise): the path for
// machines without AVX2, and the baseline the ISA kernels are tested against.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>

#include "backends/flash/kernels.hpp"

namespace dattn::flash {
namespace portable_impl {

struct Vec {
  using reg = float;
  static constexpr int W = 1;
  static reg zero() { return 0.0f; }
  static reg set1(float f) { return f; }
  static reg load(const float* p) { return *p; }
  static void store(float* p, reg r) { *p = r; }
  static reg fma(reg a, reg b, reg c) { return std::fma(a, b, c); }
  static reg mul(reg a, reg b) { return a * b; }
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg max(reg a, reg b) { return std::max(a, b); }
  static reg min(reg a, reg b) { return a < b ? a : b; }
  static reg div(reg a, reg b) { return a / b; }
  // x[t]: 2^23 + key t's code, as in avx512_vec.hpp.
  template <int G>
  static void store_codes(std::uint32_t* p, const reg (&x)[G]) {
    std::uint32_t codes = 0;
    for (int t = 0; t < G; ++t)
      codes |= (std::bit_cast<std::uint32_t>(x[t]) & ((1u << (32 / G)) - 1)) << (32 / G * t);
    *p = codes;
  }
  static reg select_zero_if_neg_inf(reg x) {
    return x == -std::numeric_limits<float>::infinity() ? 0.0f : x;
  }
  static reg select_gt(reg a, reg b, reg x, reg y) { return a > b ? x : y; }
  static reg exp2_nonpositive(reg x) { return x < -126.0f ? 0.0f : std::exp2(x); }
  static reg load_bf16(const std::uint16_t* p) { return bf16_to_f32(*p); }
  static reg load_f16(const std::uint16_t* p) { return f16_to_f32(*p); }
  static void store_bf16(std::uint16_t* p, reg r) { *p = f32_to_bf16(r); }
  static void store_f16(std::uint16_t* p, reg r) { *p = f32_to_f16(r); }
};

#include "backends/flash/cpu/tile_kernels_impl.hpp"

}  // namespace portable_impl

namespace {
constexpr TileKernels kKernels = portable_impl::make_tile_kernels<portable_impl::Vec>("portable");
}  // namespace

const TileKernels& portable_kernels() {
  return kKernels;
}

}  // namespace dattn::flash
