// The 256-bit SAGE engines: avx2_int8 (int8 codes in 16-bit lanes, vpmaddwd + vpaddd: two
// products per 32-bit lane and instruction, exact, no saturation) and avx_vnni (vpdpbusd on
// 256-bit registers: four unsigned-by-signed byte products per lane, queries offset by 128);
// micro-tiles of 6 keys x 16 query rows (12 accumulators). Layouts: int8_impl.hpp, shared with
// the emulated twins (kernels_int8_emulated.cpp). P.V, the softmax and the row conversions are
// the avx2 engine's (f32).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "backends/flash/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif

namespace dattn::flash {
namespace int8_avx2_impl {

#include "backends/flash/cpu/int8_impl.hpp"

struct Avx2Lanes {
  static constexpr int W = 8, kKeys = 4;
  using ireg = __m256i;
  static ireg zero() { return _mm256_setzero_si256(); }
  static ireg load(const std::uint32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static void logits(float* st, ireg acc, std::int32_t corr, const float* qs, float ks, float kb) {
    __m256 x = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, _mm256_set1_epi32(corr)));
    x = _mm256_fmadd_ps(_mm256_mul_ps(x, _mm256_loadu_ps(qs)), _mm256_set1_ps(ks),
                        _mm256_set1_ps(kb));
    _mm256_storeu_ps(st, _mm256_add_ps(_mm256_mul_ps(x, _mm256_setzero_ps()), x));
  }
};

struct Avx2Int8 : Avx2Lanes {
  static constexpr int G = 2;
  static constexpr bool kOffsetQ = false;
  static ireg dot(ireg acc, ireg q, std::uint32_t k) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(q, _mm256_set1_epi32(std::int32_t(k))));
  }
};

struct AvxVnni : Avx2Lanes {
  static constexpr int G = 4;
  static constexpr bool kOffsetQ = true;
  static ireg dot(ireg acc, ireg q, std::uint32_t k) {
    return _mm256_dpbusd_avx_epi32(acc, q, _mm256_set1_epi32(std::int32_t(k)));
  }
};

constexpr Int8Functions kAvx2Int8 = int8_functions<Avx2Int8, &avx2_kernels>();
constexpr Int8Functions kAvxVnni = int8_functions<AvxVnni, &avx2_kernels>();

}  // namespace int8_avx2_impl
}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace dattn::flash {
// Outside the target region: the engine table may build these on any CPU.
const TileKernels& avx2_int8_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx2_int8", avx2_kernels(), int8_avx2_impl::kAvx2Int8);
  return k;
}
const TileKernels& avx_vnni_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx_vnni", avx2_kernels(), int8_avx2_impl::kAvxVnni);
  return k;
}
}  // namespace dattn::flash
#else
namespace dattn::flash {
const TileKernels& avx2_int8_kernels() {
  return avx2_int8_emulated_kernels();
}
const TileKernels& avx_vnni_kernels() {
  return avx_vnni_emulated_kernels();
}
}  // namespace dattn::flash
#endif
