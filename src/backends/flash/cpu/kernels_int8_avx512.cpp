// The 512-bit SAGE engine avx512_vnni: vpdpbusd on 512-bit registers (four unsigned-by-signed
// byte products per 32-bit lane, queries offset by 128), micro-tiles of 8 keys x 32 query rows
// (16 accumulators). Layouts: int8_impl.hpp, shared with the emulated twin
// (kernels_int8_emulated.cpp). P.V on vdpbf16ps (the avx512_bf16 engine's) where the CPU has
// AVX512-BF16, else (or with pv_dtype f32) the avx512 engine's f32; the softmax and row
// conversions are the AVX-512 f32 ones.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

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
  static ireg dot(ireg acc, ireg q, std::uint32_t k) {
    return _mm512_dpbusd_epi32(acc, q, _mm512_set1_epi32(std::int32_t(k)));
  }
  static void logits(float* st, ireg acc, std::int32_t corr, const float* qs, float ks, float kb) {
    __m512 x = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(corr)));
    x = _mm512_fmadd_ps(_mm512_mul_ps(x, _mm512_loadu_ps(qs)), _mm512_set1_ps(ks),
                        _mm512_set1_ps(kb));
    _mm512_storeu_ps(st, _mm512_add_ps(_mm512_mul_ps(x, _mm512_setzero_ps()), x));
  }
};

constexpr Int8Functions kBf16Pv = int8_functions<Avx512Vnni, &avx512_bf16_kernels>();
constexpr Int8Functions kF32Pv = int8_functions<Avx512Vnni, &avx512_kernels>();

}  // namespace int8_avx512_impl
}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace dattn::flash {
const TileKernels& avx512_vnni_f32_pv_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx512_vnni", avx512_kernels(), int8_avx512_impl::kF32Pv);
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
const TileKernels& avx512_vnni_kernels() {
  return avx512_vnni_emulated_kernels();
}
}  // namespace dattn::flash
#endif
