// The emulated twin of the avx512_bf16 engine: the same packed layouts and blocking
// (bf16_dot_impl.hpp) with VDPBF16PS computed in portable C++, lane by lane, in the
// instruction's order (Intel SDM: srcdest += src1.odd * src2.odd, then += src1.even *
// src2.even, each an f32 FMA with denormal inputs read as zero and denormal results flushed to
// zero, round to nearest even). It runs on every machine, so the packing, blocking, masking and
// edge tiles of the bf16 engine are tested everywhere. The softmax and row conversions are the
// portable f32 ones.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "backends/flash/kernels.hpp"

namespace dattn::flash {
namespace bf16_emulated_impl {

struct Dot {
  static constexpr int W = 16;
  struct reg {
    float v[W];
  };
  static reg zero() { return set1(0.0f); }
  static reg set1(float f) {
    reg r;
    for (float& x : r.v) x = f;
    return r;
  }
  static reg load(const float* p) {
    reg r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, const reg& r) {
    for (int i = 0; i < W; ++i) p[i] = r.v[i];
  }
  static reg mul(const reg& a, const reg& b) {
    reg r;
    for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i];
    return r;
  }
  static reg not_finite_to_nan(const reg& a) {
    reg r;
    for (int i = 0; i < W; ++i) r.v[i] = std::fma(a.v[i], 0.0f, a.v[i]);
    return r;
  }
  // A bf16 input with a zero exponent (zero or denormal) reads as a signed zero.
  static float daz(std::uint32_t bits16) {
    if ((bits16 & 0x7f80u) == 0) bits16 &= 0x8000u;
    return bf16_to_f32(static_cast<std::uint16_t>(bits16));
  }
  static float ftz(float x) {
    return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
  }
  static reg dot(reg acc, const std::uint32_t* pairs, std::uint32_t b) {
    const float b_even = daz(b & 0xffffu), b_odd = daz(b >> 16);
    for (int i = 0; i < W; ++i) {
      const float a_even = daz(pairs[i] & 0xffffu), a_odd = daz(pairs[i] >> 16);
      float x = ftz(acc.v[i]);
      x = ftz(std::fma(a_odd, b_odd, x));
      x = ftz(std::fma(a_even, b_even, x));
      acc.v[i] = x;
    }
    return acc;
  }
};

#include "backends/flash/cpu/bf16_dot_impl.hpp"

}  // namespace bf16_emulated_impl

const TileKernels& avx512_bf16_emulated_kernels() {
  static const TileKernels k =
      bf16_tile_kernels("avx512_bf16_emulated", portable_kernels(),
                        bf16_emulated_impl::bf16_dot_functions<bf16_emulated_impl::Dot>());
  return k;
}

}  // namespace dattn::flash
