// The avx512_bf16 engine: Q.K^T and P.V with vdpbf16ps on bf16 pairs (f32 accumulation),
// micro-tiles of 4 keys x 32 rows and 4 rows x 32 columns; the softmax and row conversions are
// the AVX-512 f32 ones. Layouts and blocking: bf16_dot_impl.hpp, shared with the emulated twin
// (kernels_bf16_emulated.cpp), which the tests run on every machine.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "backends/flash/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(                                                      \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c"))), \
    apply_to = function)
#else
// GCC 12's AVX-512 headers trip its own uninitialized-value warnings (_mm512_undefined_*).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The note that __m512 returns change the ABI without AVX-512: every function passing __m512
// lives in this region and is internal to this file, so no call crosses the two ABIs.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
#endif

namespace dattn::flash {
namespace avx512_bf16_impl {

struct Dot {
  using reg = __m512;
  static constexpr int W = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float f) { return _mm512_set1_ps(f); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg r) { _mm512_storeu_ps(p, r); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg not_finite_to_nan(reg a) { return _mm512_fmadd_ps(a, _mm512_setzero_ps(), a); }
  static reg dot(reg acc, const std::uint32_t* pairs, std::uint32_t b) {
    const __m512i a = _mm512_loadu_si512(pairs);
    const __m512i bb = _mm512_set1_epi32(static_cast<int>(b));
    // A vector cast (same 64 bytes), not std::bit_cast: a template instantiated outside this
    // target region would pass __m512 values without AVX-512 (clang refuses that).
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)bb);  // NOLINT(readability-casting)
  }
};

#include "backends/flash/cpu/bf16_dot_impl.hpp"

// Instantiated here, inside the target region; nothing of it runs before the engine is chosen.
constexpr Bf16DotFunctions kFunctions = bf16_dot_functions<Dot>();

}  // namespace avx512_bf16_impl
}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace dattn::flash {
// Outside the target region: the engine table may build this on any CPU.
const TileKernels& avx512_bf16_kernels() {
  static const TileKernels k =
      bf16_tile_kernels("avx512_bf16", avx512_kernels(), avx512_bf16_impl::kFunctions);
  return k;
}
}  // namespace dattn::flash
#else
namespace dattn::flash {
const TileKernels& avx512_bf16_kernels() {
  return avx512_bf16_emulated_kernels();
}
}  // namespace dattn::flash
#endif
