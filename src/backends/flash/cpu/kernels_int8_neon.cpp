// The AArch64 SAGE engines on int8_impl.hpp's layouts and blocking, 4 int32 lanes, micro-tiles of
// 8 keys x 8 query rows (16 accumulators of NEON's 32 registers):
// - neon_dotprod (Armv8.2's dot product, every Neoverse and Graviton 2 on): SDOT, four
//   signed-by-signed byte products per lane (no query offset); P.V's 8-bit codes in int16 pairs
//   (P codes reach 255, which SDOT's signed bytes do not hold);
// - neon_i8mm (Armv8.6's I8MM: Graviton 3 and 4, Grace, Axion): USDOT, four unsigned-by-signed
//   byte products per lane (queries offset by 128, as x86's vpdpbusd), and P.V's 8-bit codes on
//   USDOT too (pv_dtype int8: four products per lane where FMLA makes one).
// Integers are exact, so the emulated twins (kernels_int8_neon_emulated.cpp: the same W, G, offset
// and blocking in portable C++) give these engines' bits; only the twins run where the CPU lacks
// the instructions. P.V by default is the neon engine's f32 FMLA (pv_dtype auto and f32): NEON's
// 16-bit integer multiply-adds (SMLAL) make four products per instruction as FMLA does, so int16
// lanes buy no speed there; pv_dtype int16 and int8 run the integer P.V all the same. The
// softmax and row conversions are neon's.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/flash/kernels.hpp"

#if defined(__aarch64__)
#include <arm_neon.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("arch=armv8.2-a+dotprod+i8mm"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")
#endif

namespace dattn::flash {
namespace int8_neon_impl {

#include "backends/flash/cpu/int8_impl.hpp"

// What both engines share: the lanes, the int16-pair P.V and the f32 steps after the dots (the
// same operations in the same order as EmulatedInt8Ops, so the twins round alike).
struct NeonInt8Base {
  static constexpr int W = 4, G = 4, kKeys = 8;
  using ireg = int32x4_t;
  static ireg zero() { return vdupq_n_s32(0); }
  static ireg load(const std::uint32_t* p) { return vreinterpretq_s32_u32(vld1q_u32(p)); }
  // int8_impl.hpp's kLaneGroups: SDOT / USDOT by element, 4 key groups to a vector.
  static constexpr bool kLaneGroups = true;
  using greg = uint32x4_t;
  static greg load_groups(const std::uint32_t* p) { return vld1q_u32(p); }
  static int8x16_t broadcast_s8(std::uint32_t k) { return vreinterpretq_s8_u32(vdupq_n_u32(k)); }
  // int16 pairs: lane i += lo(p) * lo(v[i]) + hi(p) * hi(v[i]) (SMULL, SMULL2, ADDP: exact).
  static ireg dot_pairs(ireg acc, ireg v, std::uint32_t p) {
    const int16x8_t pp = vreinterpretq_s16_u32(vdupq_n_u32(p));
    const int16x8_t vv = vreinterpretq_s16_s32(v);
    const int32x4_t lo = vmull_s16(vget_low_s16(vv), vget_low_s16(pp));
    const int32x4_t hi = vmull_high_s16(vv, pp);
    return vaddq_s32(acc, vpaddq_s32(lo, hi));
  }
  static ireg dot_pv16(ireg acc, ireg v, std::uint32_t p) { return dot_pairs(acc, v, p); }
  static void accumulate(float* o, ireg acc, float alpha, float ps, const float* vs) {
    const float32x4_t scale = vmulq_f32(vdupq_n_f32(ps), vld1q_f32(vs));
    const float32x4_t kept = vmulq_f32(vld1q_f32(o), vdupq_n_f32(alpha));
    vst1q_f32(o, vfmaq_f32(kept, vcvtq_f32_s32(acc), scale));
  }
  // int8_impl.hpp's code_of(x * inv) in vectors: FCVTNS rounds to nearest with ties to even (as
  // std::nearbyint in the default mode) and gives 0 for NaN; clamped to [-127, 127].
  static int32x4_t codes4(float32x4_t x, float32x4_t inv) {
    const int32x4_t c = vcvtnq_s32_f32(vmulq_f32(x, inv));
    return vminq_s32(vmaxq_s32(c, vdupq_n_s32(-127)), vdupq_n_s32(127));
  }
  // int8_pack_k's work for one key: its scale (quant_of_row) into *ks, its codes as bytes into
  // groups (zeros past d up to the last group); returns the codes' sum.
  static std::int32_t pack_key_row(const float* x, int d, std::uint32_t* groups, float* ks) {
    const float32x4_t inf = vdupq_n_f32(std::numeric_limits<float>::infinity());
    float32x4_t mx = vdupq_n_f32(0.0f);
    uint32x4_t bad = vdupq_n_u32(0);
    int e = 0;
    for (; e + 4 <= d; e += 4) {
      const float32x4_t a = vabsq_f32(vld1q_f32(x + e));
      bad = vorrq_u32(bad, vmvnq_u32(vcltq_f32(a, inf)));  // inf or NaN
      mx = vmaxq_f32(mx, a);
    }
    bool finite = vmaxvq_u32(bad) == 0;
    float amax = finite ? vmaxvq_f32(mx) : 0.0f;
    for (; e < d; ++e) {
      finite = finite && std::isfinite(x[e]);
      amax = std::max(amax, std::fabs(x[e]));
    }
    const Quant qn = quant_of(finite ? amax : 0.0f, finite);
    *ks = qn.scale;
    const float32x4_t inv = vdupq_n_f32(qn.inv);
    auto* bytes = reinterpret_cast<std::int8_t*>(groups);
    int32x4_t sum = vdupq_n_s32(0);
    e = 0;
    for (; e + 16 <= d; e += 16) {
      int32x4_t c[4];
      for (int t = 0; t < 4; ++t) {
        c[t] = codes4(vld1q_f32(x + e + 4 * t), inv);
        sum = vaddq_s32(sum, c[t]);
      }
      const int16x8_t lo = vcombine_s16(vmovn_s32(c[0]), vmovn_s32(c[1]));
      const int16x8_t hi = vcombine_s16(vmovn_s32(c[2]), vmovn_s32(c[3]));
      vst1q_s8(bytes + e, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
    }
    std::int32_t total = vaddvq_s32(sum);
    for (; e < (d + 3) / 4 * 4; ++e) {
      const int code = e < d ? code_of(x[e], qn.inv) : 0;
      bytes[e] = static_cast<std::int8_t>(code);
      total += code;
    }
    return total;
  }
  // int8_pack_q's groups for whole vectors of 4 rows: the codes of rows r (inv[r] their
  // multipliers; offset by 128 for USDOT's unsigned queries), four elements to a group, zeros
  // (128 offset) past d, into q[g * ldg + r]; returns the first row not done.
  template <bool OffsetQ>
  static int pack_query_rows_of(const float* qt, std::int64_t ldqt, int rows_p, int d,
                                const float* inv, std::uint32_t* q, int ldg) {
    const int dg = (d + 3) / 4;
    const uint32x4_t low = vdupq_n_u32(0xff);
    const int32x4_t offset = vdupq_n_s32(OffsetQ ? 128 : 0);
    int r = 0;
    for (; r + 4 <= rows_p; r += 4) {
      const float32x4_t vi = vld1q_f32(inv + r);
      for (int g = 0; g < dg; ++g) {
        uint32x4_t w = vdupq_n_u32(0);
        for (int t = 0; t < 4; ++t) {
          const int e = 4 * g + t;
          const int32x4_t c = e < d ? codes4(vld1q_f32(qt + e * ldqt + r), vi) : vdupq_n_s32(0);
          const uint32x4_t b = vandq_u32(vreinterpretq_u32_s32(vaddq_s32(c, offset)), low);
          w = vorrq_u32(w, vshlq_u32(b, vdupq_n_s32(8 * t)));
        }
        vst1q_u32(q + std::int64_t(g) * ldg + r, w);
      }
    }
    return r;
  }
  static void logits(float* st, ireg acc, std::int32_t corr, const float* qs, float ks, float kb,
                     const float* rt) {
    const int32x4_t n = vsubq_s32(acc, vdupq_n_s32(corr));  // modulo 2^32, as the twins
    const float32x4_t scale = vmulq_f32(vld1q_f32(qs), vdupq_n_f32(ks));
    const float32x4_t add =
        rt != nullptr ? vaddq_f32(vdupq_n_f32(kb), vld1q_f32(rt)) : vdupq_n_f32(kb);
    const float32x4_t x = vfmaq_f32(add, vcvtq_f32_s32(n), scale);
    vst1q_f32(st, vfmaq_f32(x, x, vdupq_n_f32(0.0f)));  // NaN where not finite
  }
};

struct NeonDotprod : NeonInt8Base {
  static constexpr bool kOffsetQ = false;
  static constexpr int kPvGroup = 2;
  static int pack_query_rows(const float* qt, std::int64_t ldqt, int rows_p, int d,
                             const float* inv, std::uint32_t* q, int ldg) {
    return pack_query_rows_of<false>(qt, ldqt, rows_p, d, inv, q, ldg);
  }
  static ireg dot(ireg acc, ireg q, std::uint32_t k) {
    return vdotq_s32(acc, vreinterpretq_s8_s32(q), broadcast_s8(k));
  }
  static ireg dot_pv(ireg acc, ireg v, std::uint32_t p) { return dot_pairs(acc, v, p); }
  template <int L>
  static ireg dot_lane(ireg acc, ireg q, greg kv) {
    return vdotq_laneq_s32(acc, vreinterpretq_s8_s32(q), vreinterpretq_s8_u32(kv), L);
  }
};

struct NeonI8mm : NeonInt8Base {
  static constexpr bool kOffsetQ = true;
  static int pack_query_rows(const float* qt, std::int64_t ldqt, int rows_p, int d,
                             const float* inv, std::uint32_t* q, int ldg) {
    return pack_query_rows_of<true>(qt, ldqt, rows_p, d, inv, q, ldg);
  }
  static ireg dot(ireg acc, ireg q, std::uint32_t k) {
    return vusdotq_s32(acc, vreinterpretq_u8_s32(q), broadcast_s8(k));
  }
  template <int L>
  static ireg dot_lane(ireg acc, ireg q, greg kv) {
    return vusdotq_laneq_s32(acc, vreinterpretq_u8_s32(q), vreinterpretq_s8_u32(kv), L);
  }
  // P.V: the unsigned P codes broadcast against the signed V codes.
  static ireg dot_pv(ireg acc, ireg v, std::uint32_t p) {
    return vusdotq_s32(acc, vreinterpretq_u8_u32(vdupq_n_u32(p)), vreinterpretq_s8_s32(v));
  }
};

// Instantiated here, inside the target region; nothing of it runs before the engine is chosen.
constexpr Int8Functions kDotprod = int8_functions<NeonDotprod, &neon_kernels>();
constexpr Int8Functions kI8mm = int8_functions<NeonI8mm, &neon_kernels>();
constexpr Int8Functions kDotprodPv8 = int8pv_functions<NeonDotprod, &neon_kernels>();
constexpr Int8Functions kI8mmPv8 = int8pv_functions<NeonI8mm, &neon_kernels>();
constexpr Int8Functions kDotprodPv16 =
    int8pv_functions<NeonDotprod, &neon_kernels, Pv16<NeonDotprod>>();
constexpr Int8Functions kI8mmPv16 = int8pv_functions<NeonI8mm, &neon_kernels, Pv16<NeonI8mm>>();

}  // namespace int8_neon_impl
}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace dattn::flash {
// Outside the target region: the engine table may build these on any CPU.
#define DATTN_NEON_INT8(fn, name, functions)                                \
  const TileKernels& fn() {                                                 \
    static const TileKernels k =                                            \
        int8_tile_kernels(name, neon_kernels(), int8_neon_impl::functions); \
    return k;                                                               \
  }
DATTN_NEON_INT8(neon_dotprod_kernels, "neon_dotprod", kDotprod)
DATTN_NEON_INT8(neon_i8mm_kernels, "neon_i8mm", kI8mm)
DATTN_NEON_INT8(neon_dotprod_pv8_kernels, "neon_dotprod", kDotprodPv8)
DATTN_NEON_INT8(neon_i8mm_pv8_kernels, "neon_i8mm", kI8mmPv8)
DATTN_NEON_INT8(neon_dotprod_pv16_kernels, "neon_dotprod", kDotprodPv16)
DATTN_NEON_INT8(neon_i8mm_pv16_kernels, "neon_i8mm", kI8mmPv16)
#undef DATTN_NEON_INT8
}  // namespace dattn::flash
#else
namespace dattn::flash {
const TileKernels& neon_dotprod_kernels() {
  return neon_dotprod_emulated_kernels();
}
const TileKernels& neon_i8mm_kernels() {
  return neon_i8mm_emulated_kernels();
}
const TileKernels& neon_dotprod_pv8_kernels() {
  return neon_dotprod_emulated_pv8_kernels();
}
const TileKernels& neon_i8mm_pv8_kernels() {
  return neon_i8mm_emulated_pv8_kernels();
}
const TileKernels& neon_dotprod_pv16_kernels() {
  return neon_dotprod_emulated_pv16_kernels();
}
const TileKernels& neon_i8mm_pv16_kernels() {
  return neon_i8mm_emulated_pv16_kernels();
}
}  // namespace dattn::flash
#endif
