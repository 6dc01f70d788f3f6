// The 512-bit SAGE engine avx512_vnni: vpdpbusd on 512-bit registers (four unsigned-by-signed
// byte products per 32-bit lane, queries offset by 128), micro-tiles of 8 keys x 32 query rows
// (16 accumulators). Layouts: int8_impl.hpp, shared with the emulated twin
// (kernels_int8_emulated.cpp); Q's and K's codes, and V's as int16 pairs, made in vectors (the
// portable loops' codes, tests/test_sage.cpp, SageEngines). P.V on vdpbf16ps (the avx512_bf16
// engine's) where the CPU has AVX512-BF16, else (or with pv_dtype f32) the avx512 engine's f32; the
// softmax and row conversions are the AVX-512 f32 ones.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/flash/kernels.hpp"
#include "dattn/cpu_info.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(                                                      \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif

namespace dattn::flash {
namespace int8_avx512_impl {

#include "backends/flash/cpu/int8_impl.hpp"

struct Avx512Vnni {
  static constexpr int W = 16, G = 4, kKeys = 8;
  static constexpr bool kOffsetQ = true;
  using ireg = __m512i;
  static ireg zero() { return _mm512_setzero_si512(); }
  static ireg load(const std::uint32_t* p) { return _mm512_loadu_si512(p); }
  // vpdpbusd in inline assembly: GCC 12's register allocation of the intrinsic's accumulators
  // (__m512i against the builtin's int32 vectors) copied each accumulator once or twice per
  // instruction in these micro-kernels (66 vector moves per 16 vpdpbusd), none here.
  static ireg dpbusd(ireg acc, ireg u, ireg s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
  }
  static ireg dot(ireg acc, ireg q, std::uint32_t k) {
    return dpbusd(acc, q, _mm512_set1_epi32(std::int32_t(k)));
  }
  // P.V: unsigned P codes broadcast against signed V codes.
  static ireg dot_pv(ireg acc, ireg v, std::uint32_t p) {
    return dpbusd(acc, _mm512_set1_epi32(std::int32_t(p)), v);
  }
  // P.V in int16 pairs (pv_dtype int16): vpdpwssd (no saturation), P broadcast.
  static ireg dot_pv16(ireg acc, ireg v, std::uint32_t p) {
    const ireg pp = _mm512_set1_epi32(std::int32_t(p));
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(pp), "v"(v));
    return acc;
  }
  // int8_impl.hpp's code_of(x * inv) in vectors: round half to even (the default MXCSR mode, as
  // std::nearbyint), clamped to [-127, 127], 0 where x * inv is NaN.
  static __m512i codes16(__m512 x, __m512 inv) {
    const __m512 y = _mm512_mul_ps(x, inv);
    const __mmask16 ordered = _mm512_cmp_ps_mask(y, y, _CMP_ORD_Q);
    const __m512 c = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 cl =
        _mm512_min_ps(_mm512_max_ps(c, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    return _mm512_maskz_cvtps_epi32(ordered, cl);
  }
  // int8_pack_k's work for one key: its scale (quant_of_row) into *ks, its groups (d codes as
  // bytes, zeros past d up to the last group) into groups; returns the codes' sum.
  static std::int32_t pack_key_row(const float* x, int d, std::uint32_t* groups, float* ks) {
    __m512 mx = _mm512_setzero_ps();
    __mmask16 bad = 0;
    const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    for (int e = 0; e < d; e += 16) {
      const __mmask16 m = d - e >= 16 ? __mmask16(0xffff) : __mmask16((1u << (d - e)) - 1);
      const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + e));
      bad |= _mm512_mask_cmp_ps_mask(m, a, inf, _CMP_NLT_UQ);  // inf or NaN
      mx = _mm512_max_ps(mx, a);
    }
    const bool finite = bad == 0;
    const Quant qn = quant_of(finite ? _mm512_reduce_max_ps(mx) : 0.0f, finite);
    *ks = qn.scale;
    const __m512 inv = _mm512_set1_ps(qn.inv);
    __m512i sum = _mm512_setzero_si512();
    auto* bytes = reinterpret_cast<std::uint8_t*>(groups);
    for (int e = 0; e < d; e += 16) {
      const int n = std::min(16, d - e);
      const __mmask16 m = n == 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
      const __m512i c = codes16(_mm512_maskz_loadu_ps(m, x + e), inv);
      sum = _mm512_add_epi32(sum, c);
      const int stored = (n + 3) / 4 * 4;  // whole groups
      _mm_mask_storeu_epi8(bytes + e, __mmask16((1u << stored) - 1), _mm512_cvtepi32_epi8(c));
    }
    return _mm512_reduce_add_epi32(sum);
  }
  // int8_pack_q's groups for whole vectors of 16 rows: the codes of rows r (inv[r] their
  // multipliers) offset by 128, four elements to a group, zeros (128) past d, into
  // q[g * ldg + r]; returns the first row not done.
  static int pack_query_rows(const float* qt, std::int64_t ldqt, int rows_p, int d,
                             const float* inv, std::uint32_t* q, int ldg) {
    const int dg = (d + 3) / 4;
    const __m512i low = _mm512_set1_epi32(0xff), offset = _mm512_set1_epi32(128);
    int r = 0;
    for (; r + 16 <= rows_p; r += 16) {
      const __m512 vi = _mm512_loadu_ps(inv + r);
      for (int g = 0; g < dg; ++g) {
        __m512i w = _mm512_setzero_si512();
        for (int t = 0; t < 4; ++t) {
          const int e = 4 * g + t;
          const __m512i c =
              e < d ? codes16(_mm512_loadu_ps(qt + e * ldqt + r), vi) : _mm512_setzero_si512();
          w = _mm512_or_si512(
              w, _mm512_slli_epi32(_mm512_and_si512(_mm512_add_epi32(c, offset), low), 8 * t));
        }
        _mm512_storeu_si512(q + std::int64_t(g) * ldg + r, w);
      }
    }
    return r;
  }
  // int8pv_pack_v's work for whole vectors of 16 columns of a V tile whose codes go in int16 pairs
  // (pv_dtype int16, auto's here): each column's scale (max |v| / top; NaN where the column holds
  // a value that is not finite, 0 where it is all zeros) into vs[c], its codes (0 past `keys`) as
  // groups[g * dv + c] = code(2g) | code(2g + 1) << 16; returns the first column not done.
  static int pack_v_pairs(const float* v, std::int64_t ld, int keys, int dv, float top, float* vs,
                          std::uint32_t* groups) {
    const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    const __m512 lo = _mm512_set1_ps(-top), hi = _mm512_set1_ps(top);
    const __m512i low = _mm512_set1_epi32(0xffff);
    const auto codes = [&](const float* x, __m512 inv) {  // code_of with top
      const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x), inv);
      const __mmask16 ordered = _mm512_cmp_ps_mask(y, y, _CMP_ORD_Q);
      const __m512 c = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_maskz_cvtps_epi32(ordered, _mm512_min_ps(_mm512_max_ps(c, lo), hi));
    };
    int c = 0;
    for (; c + W <= dv; c += W) {
      __m512 mx = _mm512_setzero_ps();
      __mmask16 bad = 0;
      for (int j = 0; j < keys; ++j) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(v + j * ld + c));
        bad |= _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ);  // inf or NaN
        mx = _mm512_max_ps(mx, a);
      }
      alignas(64) float amax[W], mul[W];
      _mm512_store_ps(amax, mx);
      for (int i = 0; i < W; ++i) {  // int8pv_pack_v's scale and multiplier
        const Quant qn = quant_of(amax[i], (bad >> i & 1) == 0, top);
        vs[c + i] = qn.scale;
        mul[i] = qn.inv;
      }
      const __m512 vi = _mm512_load_ps(mul);
      for (int g = 0; g < kTileKeys / 2; ++g) {
        const int j = 2 * g;
        const __m512i c0 = j < keys ? codes(v + j * ld + c, vi) : zero();
        const __m512i c1 = j + 1 < keys ? codes(v + (j + 1) * ld + c, vi) : zero();
        _mm512_storeu_si512(groups + std::int64_t(g) * dv + c,
                            _mm512_or_si512(_mm512_and_si512(c0, low), _mm512_slli_epi32(c1, 16)));
      }
    }
    return c;
  }
  static void accumulate(float* o, ireg acc, float alpha, float ps, const float* vs) {
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(ps), _mm512_loadu_ps(vs));
    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), t,
                                        _mm512_mul_ps(_mm512_loadu_ps(o), _mm512_set1_ps(alpha))));
  }
  static void logits(float* st, ireg acc, std::int32_t corr, const float* qs, float ks, float kb,
                     const float* rt) {
    __m512 x = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(corr)));
    const __m512 b =
        rt != nullptr ? _mm512_add_ps(_mm512_set1_ps(kb), _mm512_loadu_ps(rt)) : _mm512_set1_ps(kb);
    x = _mm512_fmadd_ps(x, _mm512_mul_ps(_mm512_loadu_ps(qs), _mm512_set1_ps(ks)), b);
    _mm512_storeu_ps(st, _mm512_add_ps(_mm512_mul_ps(x, _mm512_setzero_ps()), x));
  }
};

// The 16-bit integer-lane engine avx512_vnni_int16 (compute int16, int8_impl.hpp's "16-bit
// integer lanes"): Q and K codes as int16 pairs on vpdpwssd, P.V on the same pairs (Pv16); the
// byte hooks above are not used for it (int8_impl.hpp, byte_codes()).
struct Avx512VnniInt16 : Avx512Vnni {
  static constexpr int G = 2;
  static constexpr bool kOffsetQ = false, kExact = true;
  // vpdpwssd is symmetric: the key group broadcast as P.V broadcasts P's.
  static ireg dot(ireg acc, ireg q, std::uint32_t k) { return dot_pv16(acc, q, k); }
};

constexpr Int8Functions kInt16 =
    int8pv_functions<Avx512VnniInt16, &avx512_kernels, Pv16<Avx512VnniInt16>>();

constexpr Int8Functions kBf16Pv = int8_functions<Avx512Vnni, &avx512_bf16_kernels>();
constexpr Int8Functions kF32Pv = int8_functions<Avx512Vnni, &avx512_kernels>();
constexpr Int8Functions kPv8 = int8pv_functions<Avx512Vnni, &avx512_kernels>();
constexpr Int8Functions kPv16 = int8pv_functions<Avx512Vnni, &avx512_kernels, Pv16<Avx512Vnni>>();

}  // namespace int8_avx512_impl
}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace dattn::flash {
const TileKernels& avx512_vnni_pv8_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx512_vnni", avx512_kernels(), int8_avx512_impl::kPv8);
  return k;
}
const TileKernels& avx512_vnni_pv16_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx512_vnni", avx512_kernels(), int8_avx512_impl::kPv16);
  return k;
}
const TileKernels& avx512_vnni_f32_pv_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx512_vnni", avx512_kernels(), int8_avx512_impl::kF32Pv);
  return k;
}
const TileKernels& avx512_vnni_int16_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx512_vnni_int16", avx512_kernels(), int8_avx512_impl::kInt16);
  return k;
}
const TileKernels& avx512_vnni_kernels() {
  if (!cpu_features().avx512_bf16) return avx512_vnni_f32_pv_kernels();
  static const TileKernels k =
      int8_tile_kernels("avx512_vnni", avx512_bf16_kernels(), int8_avx512_impl::kBf16Pv);
  return k;
}
}  // namespace dattn::flash
#else
namespace dattn::flash {
const TileKernels& avx512_vnni_f32_pv_kernels() {
  return avx512_vnni_emulated_f32_pv_kernels();
}
const TileKernels& avx512_vnni_pv8_kernels() {
  return avx512_vnni_emulated_pv8_kernels();
}
const TileKernels& avx512_vnni_pv16_kernels() {
  return avx512_vnni_emulated_pv16_kernels();
}
const TileKernels& avx512_vnni_kernels() {
  return avx512_vnni_emulated_kernels();
}
const TileKernels& avx512_vnni_int16_kernels() {
  return avx512_vnni_int16_emulated_kernels();
}
}  // namespace dattn::flash
#endif
