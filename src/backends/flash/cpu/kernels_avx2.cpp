// FLASH tile kernels for AVX2 + FMA + F16C (8 f32 lanes): K.Q^T micro-tiles of 6 keys x 16
// query rows and P.V micro-tiles of 6 rows x 16 columns, 12 accumulators each.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>

#include "backends/flash/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

// The instruction set of every function below: GCC's target pragma, or clang's equivalent.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace dattn::flash {
namespace avx2_impl {

struct Vec {
  using reg = __m256;
  static constexpr int W = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float f) { return _mm256_set1_ps(f); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg r) { _mm256_storeu_ps(p, r); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  // x[t]: 2^23 + key t's code, as in avx512_vec.hpp.
  template <int G>
  static void store_codes(std::uint32_t* p, const reg (&x)[G]) {
    static_assert(G == 2 || G == 4);
    const auto bits = [&](int t) { return _mm256_castps_si256(x[t]); };
    __m256i codes = _mm256_and_si256(bits(0), _mm256_set1_epi32((1 << (32 / G)) - 1));
    if constexpr (G == 2) {
      codes = _mm256_or_si256(codes, _mm256_slli_epi32(bits(1), 16));
    } else {
      codes = _mm256_or_si256(codes, _mm256_slli_epi32(bits(1), 8));
      codes = _mm256_or_si256(
          codes, _mm256_or_si256(_mm256_slli_epi32(bits(2), 16), _mm256_slli_epi32(bits(3), 24)));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), codes);
  }
  static reg select_zero_if_neg_inf(reg x) {
    const reg is_neg_inf =
        _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
    return _mm256_andnot_ps(is_neg_inf, x);
  }
  // a > b ? x : y per lane (false for NaN).
  static reg select_gt(reg a, reg b, reg x, reg y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_GT_OQ));
  }
  // 2^x for x <= 0: 2^n * p(f), n = round(x), f in [-1/2, 1/2], p = kExp2Poly (relative error
  // < 2e-7); x < -126 (and -inf) gives 0, NaN stays NaN (vmaxps returns its second operand when
  // one is NaN, so x goes second).
  static reg exp2_nonpositive(reg x) {
    const reg lowest = _mm256_set1_ps(-126.0f);
    const reg hidden = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
    x = _mm256_max_ps(lowest, x);
    const reg n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const reg f = _mm256_sub_ps(x, n);
    reg p = _mm256_set1_ps(kExp2Poly[4]);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[3]));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[2]));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[1]));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[0]));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(hidden, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
  static reg load_bf16(const std::uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static reg load_f16(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(std::uint16_t* p, reg r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // Round to nearest even: add 0x7fff + the lowest kept bit, keep the high half; NaN keeps a
  // quiet NaN.
  static void store_bf16(std::uint16_t* p, reg r) {
    const __m256i u = _mm256_castps_si256(r);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(r, r, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    rounded = _mm256_blendv_epi8(rounded, quiet, nan);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

#include "backends/flash/cpu/tile_kernels_impl.hpp"

}  // namespace avx2_impl

namespace {
constexpr TileKernels kKernels = avx2_impl::make_tile_kernels<avx2_impl::Vec>("avx2");
}  // namespace

const TileKernels& avx2_kernels() {
  return kKernels;
}

}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
namespace dattn::flash {
const TileKernels& avx2_kernels() {
  return portable_kernels();
}
}  // namespace dattn::flash
#endif
