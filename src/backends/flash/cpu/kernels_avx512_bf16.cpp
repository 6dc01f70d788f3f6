// The avx512_bf16 engine: Q.K^T and P.V with vdpbf16ps on bf16 pairs (f32 accumulation),
// micro-tiles of 8 keys x 32 rows and 8 rows x 32 columns; the softmax is the AVX-512 f32 one
// writing P's bf16 pairs itself (softmax_tile_pairs, below), the row conversions are the AVX-512
// f32 ones. Layouts and blocking: bf16_dot_impl.hpp, shared with the emulated twin
// (kernels_bf16_emulated.cpp), which the tests run on every machine.
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

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(                                                               \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c"))), \
    apply_to = function)
#else
// GCC 12's AVX-512 headers trip its own uninitialized-value warnings (_mm512_undefined_*).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The note that __m512 returns change the ABI without AVX-512: every function passing __m512
// lives in this region and is internal to this file, so no call crosses the two ABIs.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
#endif

namespace dattn::flash {
namespace avx512_bf16_impl {

// In this order: each builds on the ones before.
#include "backends/flash/cpu/avx512_bf16_ops.hpp"
using Dot = Avx512Bf16Ops;

#include "backends/flash/cpu/bf16_pairs.hpp"

#include "backends/flash/cpu/bf16_dot_impl.hpp"

// The AVX-512 f32 softmax step (the avx512 engine's, the same bits) with P written as bf16 pairs
// as Dot packs them. In a namespace of its own: tile_kernels_impl.hpp's qk and pv would meet
// bf16_dot_impl.hpp's.
namespace f32_softmax {
#include "backends/flash/cpu/avx512_vec.hpp"
struct SoftmaxVec : Vec {
  static void store_bf16_pairs(std::uint32_t* p, reg even, reg odd) {
    Dot::store_pairs16(p, even, odd);
  }
};
#include "backends/flash/cpu/tile_kernels_impl.hpp"
}  // namespace f32_softmax

// Instantiated here, inside the target region; nothing of it runs before the engine is chosen.
constexpr Bf16Functions kFunctions =
    bf16_dot_functions<Dot, &f32_softmax::softmax_tile_pairs<f32_softmax::SoftmaxVec>>();

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
