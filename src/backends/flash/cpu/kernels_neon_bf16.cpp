// The neon_bf16 engine (Armv8.6's BF16 extension: Graviton 3 and 4, Grace, Axion, Apple M2 and
// later): Q.K^T and P.V with BFDOT on bf16 pairs (f32 accumulation), the layouts and blocking of
// bf16_dot_impl.hpp on 4-lane vectors (micro-tiles of 8 keys x 8 query rows and 8 rows x 8
// columns: 16 accumulators of NEON's 32 registers), the contract of the x86 bf16 engines (Q, K, V
// and P rounded to bf16 to nearest even). The softmax is the neon engine's f32 one writing P's
// pairs itself (softmax_tile_pairs), the row conversions are neon's. BFDOT's own arithmetic
// (products added in round-to-odd, denormals flushed: neon_bf16_emulated_ops.hpp) is modelled by
// the emulated twin neon_bf16_emulated (kernels_bf16_emulated.cpp), which runs on every machine.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numbers>
#include <type_traits>
#include <utility>

#include "backends/flash/kernels.hpp"
#include "dattn/dtype.hpp"

#if defined(__aarch64__)
#include <arm_neon.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("arch=armv8.2-a+bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+bf16")
#endif

namespace dattn::flash {
namespace neon_bf16_impl {

// The f32 vector type and the softmax step of the neon engine (its bits), in a namespace of its
// own: tile_kernels_impl.hpp's qk and pv would meet bf16_dot_impl.hpp's.
namespace f32_softmax {
#include "backends/flash/cpu/neon_vec.hpp"
#include "backends/flash/cpu/tile_kernels_impl.hpp"
}  // namespace f32_softmax

struct NeonBf16Ops {
  using reg = float32x4_t;
  static constexpr int W = 4;
  static reg zero() { return vdupq_n_f32(0.0f); }
  static reg set1(float f) { return vdupq_n_f32(f); }
  static reg load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, reg r) { vst1q_f32(p, r); }
  static reg mul(reg a, reg b) { return vmulq_f32(a, b); }
  static reg fma(reg a, reg b, reg c) { return vfmaq_f32(c, a, b); }
  static reg not_finite_to_nan(reg a) { return vfmaq_f32(a, a, vdupq_n_f32(0.0f)); }
  // BFDOT: lane i += a[2i] * b[0] + a[2i + 1] * b[1], b the pair broadcast (LD1R from memory).
  static reg dot(reg acc, const std::uint32_t* pairs, std::uint32_t b) {
    return vbfdotq_f32(acc, vreinterpretq_bf16_u32(vld1q_u32(pairs)),
                       vreinterpretq_bf16_u32(vdupq_n_u32(b)));
  }
  // BFDOT by element: lane i += a[2i] * b[2L] + a[2i + 1] * b[2L + 1] (bf16_dot_impl.hpp's
  // kLanePairs: no broadcast of its own per pair).
  static constexpr bool kLanePairs = true;
  using preg = uint32x4_t;
  static preg load_pairs(const std::uint32_t* p) { return vld1q_u32(p); }
  template <int L>
  static reg dot_lane(reg acc, const std::uint32_t* pairs, preg b) {
    return vbfdotq_laneq_f32(acc, vreinterpretq_bf16_u32(vld1q_u32(pairs)),
                             vreinterpretq_bf16_u32(b), L);
  }
  static void pack16_consecutive(const float* src, std::uint32_t* dst) {
    for (int i = 0; i < 4; ++i) {
      const float32x4x2_t eo = vld2q_f32(src + 8 * i);  // even and odd elements
      f32_softmax::Vec::store_bf16_pairs(dst + 4 * i, eo.val[0], eo.val[1]);
    }
  }
  static void pack16_interleaved(const float* even, const float* odd, std::uint32_t* dst) {
    for (int i = 0; i < 4; ++i)
      f32_softmax::Vec::store_bf16_pairs(dst + 4 * i, vld1q_f32(even + 4 * i),
                                         odd != nullptr ? vld1q_f32(odd + 4 * i) : zero());
  }
};
using Dot = NeonBf16Ops;

// In this order: each builds on the ones before.
#include "backends/flash/cpu/bf16_pairs.hpp"

#include "backends/flash/cpu/bf16_dot_impl.hpp"

// Instantiated here, inside the target region; nothing of it runs before the engine is chosen.
constexpr Bf16Functions kFunctions =
    bf16_dot_functions<Dot, &f32_softmax::softmax_tile_pairs<f32_softmax::Vec>>();

}  // namespace neon_bf16_impl
}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace dattn::flash {
// Outside the target region: the engine table may build this on any CPU.
const TileKernels& neon_bf16_kernels() {
  static const TileKernels k =
      bf16_tile_kernels("neon_bf16", neon_kernels(), neon_bf16_impl::kFunctions);
  return k;
}
}  // namespace dattn::flash
#else
namespace dattn::flash {
const TileKernels& neon_bf16_kernels() {
  return neon_bf16_emulated_kernels();
}
}  // namespace dattn::flash
#endif
