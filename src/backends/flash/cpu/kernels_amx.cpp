// The amx engine: Q.K^T and P.V on AMX tiles (tdpbf16ps, f32 accumulation), 2 x 2 tiles per
// 32 x 32 block; the packing, scaling and O rescaling in AVX-512 BF16, the row softmax the
// AVX-512 one writing bf16 pairs (below), the row conversions the AVX-512 f32 ones. Layouts and
// blocking: amx_impl.hpp, shared with the emulated twin (kernels_amx_emulated.cpp), which the tests
// run on every machine.
//
// Each thread loads its tile configuration before its first tile instruction of a run and
// releases the tiles after its last (InnerLoop::thread_begin / thread_end); the process asks
// Linux for the tile state once, before the engine is offered (core/amx_permission.hpp).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>
#include <vector>

#include "backends/flash/kernels.hpp"
#include "core/amx_permission.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/dtype.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(                                                              \
    __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512dq,avx512vl," \
                          "avx512bf16,avx2,fma,f16c"))),                                   \
    apply_to = function)
#else
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC push_options
#pragma GCC target( \
    "amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
#endif

namespace dattn::flash {
namespace amx_impl {

#include "backends/flash/cpu/avx512_bf16_ops.hpp"
#include "backends/flash/cpu/bf16_pairs.hpp"

// The tile instructions take their tile numbers as literals (GCC pastes them into the
// assembly), hence the if-constexpr ladders. GCC 12's tile loads are asm statements that do not
// tell the compiler they read memory: a compiler barrier before each keeps the vector stores
// that fill the operands (packing, transposition, O rescaling) ahead of them.
struct Tiles {
  static inline thread_local bool configured = false;
  static void begin() {
    _tile_loadconfig(detail::kAmxTileConfig.data());
    configured = true;
  }
  static void end() {
    if (!configured) return;
    _tile_release();
    configured = false;
  }
  static void ensure() {
    if (!configured) begin();
  }
  template <int t>
  static void zero() {
    if constexpr (t == 0) _tile_zero(0);
    if constexpr (t == 1) _tile_zero(1);
    if constexpr (t == 2) _tile_zero(2);
    if constexpr (t == 3) _tile_zero(3);
    static_assert(t >= 0 && t < 4);
  }
  template <int t>
  static void load(const void* p, long stride) {
    __asm__ volatile("" ::: "memory");
    if constexpr (t == 0) _tile_loadd(0, p, stride);
    if constexpr (t == 1) _tile_loadd(1, p, stride);
    if constexpr (t == 2) _tile_loadd(2, p, stride);
    if constexpr (t == 3) _tile_loadd(3, p, stride);
    if constexpr (t == 4) _tile_loadd(4, p, stride);
    if constexpr (t == 5) _tile_loadd(5, p, stride);
    if constexpr (t == 6) _tile_loadd(6, p, stride);
    if constexpr (t == 7) _tile_loadd(7, p, stride);
    static_assert(t >= 0 && t < 8);
  }
  template <int t>
  static void store(void* p, long stride) {
    if constexpr (t == 0) _tile_stored(0, p, stride);
    if constexpr (t == 1) _tile_stored(1, p, stride);
    if constexpr (t == 2) _tile_stored(2, p, stride);
    if constexpr (t == 3) _tile_stored(3, p, stride);
    static_assert(t >= 0 && t < 4);
  }
  template <int c, int a, int b>
  static void dp() {
    if constexpr (c == 0 && a == 4 && b == 6) _tile_dpbf16ps(0, 4, 6);
    if constexpr (c == 1 && a == 4 && b == 7) _tile_dpbf16ps(1, 4, 7);
    if constexpr (c == 2 && a == 5 && b == 6) _tile_dpbf16ps(2, 5, 6);
    if constexpr (c == 3 && a == 5 && b == 7) _tile_dpbf16ps(3, 5, 7);
    static_assert((c == 0 && a == 4 && b == 6) || (c == 1 && a == 4 && b == 7) ||
                  (c == 2 && a == 5 && b == 6) || (c == 3 && a == 5 && b == 7));
  }
  // amx_int8: TDPBSSD (signed bytes, int32 accumulators); used only where the CPU has AMX-INT8.
  template <int c, int a, int b>
  static void dp_int8() {
    if constexpr (c == 0 && a == 4 && b == 6) _tile_dpbssd(0, 4, 6);
    if constexpr (c == 1 && a == 4 && b == 7) _tile_dpbssd(1, 4, 7);
    if constexpr (c == 2 && a == 5 && b == 6) _tile_dpbssd(2, 5, 6);
    if constexpr (c == 3 && a == 5 && b == 7) _tile_dpbssd(3, 5, 7);
    static_assert((c == 0 && a == 4 && b == 6) || (c == 1 && a == 4 && b == 7) ||
                  (c == 2 && a == 5 && b == 6) || (c == 3 && a == 5 && b == 7));
  }
};

#include "backends/flash/cpu/amx_emulated_tiles.hpp"
#include "backends/flash/cpu/amx_impl.hpp"
#include "backends/flash/cpu/int8_impl.hpp"
// int8_impl.hpp before: its codes and scales.
#include "backends/flash/cpu/amx_int8_impl.hpp"

// The row softmax of the AVX-512 kernels, its probabilities from a degree-3 exponential on
// x - floor(x) (kExp2PolyBf16) and rounded to bf16 by vcvtneps2bf16 (round to nearest even, NaN
// kept) instead of in integer steps.
#include "backends/flash/cpu/avx512_vec.hpp"
struct SoftmaxVec : Vec {
  static reg exp2_nonpositive_bf16(reg x) { return exp2_poly<true>(x, kExp2PolyBf16); }
  static void store_bf16(std::uint16_t* p, reg r) {
    // A vector cast, as in avx512_bf16_ops.hpp.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(r));  // NOLINT
  }
  // r0 then r1 as 32 bf16 from one vcvtne2ps2bf16 (two micro-ops, where two vcvtneps2bf16
  // take four) and one store.
  static void store_bf16_pair(std::uint16_t* p, reg r0, reg r1) {
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(r1, r0));  // NOLINT
  }
};
#include "backends/flash/cpu/tile_kernels_impl.hpp"

constexpr Bf16Functions kFunctions =
    amx_functions<Tiles, Avx512Bf16Ops>(&softmax_rows_pairs<SoftmaxVec>);
// The same engine on emulated tiles: amx_emulated where the CPU has AVX-512 BF16.
constexpr Bf16Functions kEmulatedTileFunctions =
    amx_functions<EmulatedTiles, Avx512Bf16Ops>(&softmax_rows_pairs<SoftmaxVec>);
// amx_int8, and its twin on emulated tiles with these vector parts.
constexpr Bf16Functions kInt8Functions =
    amx_int8_functions<Tiles, Avx512Bf16Ops>(&softmax_rows_pairs<SoftmaxVec>);
constexpr Bf16Functions kInt8EmulatedTileFunctions =
    amx_int8_functions<EmulatedTiles, Avx512Bf16Ops>(&softmax_rows_pairs<SoftmaxVec>);

}  // namespace amx_impl
}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace dattn::flash {
// Outside the target region: the engine table may build this on any CPU; nothing of it runs
// unless the engine is available (engines.cpp).
const TileKernels& amx_kernels() {
  static const TileKernels k = bf16_tile_kernels("amx", avx512_kernels(), amx_impl::kFunctions);
  return k;
}
const TileKernels* amx_emulated_tiles_avx512_kernels() {
  const CpuFeatures& f = cpu_features();
  if (!(f.avx2 && f.fma && f.f16c && f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl &&
        f.avx512_bf16))
    return nullptr;
  static const TileKernels k =
      bf16_tile_kernels("amx_emulated", avx512_kernels(), amx_impl::kEmulatedTileFunctions);
  return &k;
}
const TileKernels& amx_int8_kernels() {
  static const TileKernels k =
      bf16_tile_kernels("amx_int8", avx512_kernels(), amx_impl::kInt8Functions);
  return k;
}
const TileKernels* amx_int8_emulated_tiles_avx512_kernels() {
  if (amx_emulated_tiles_avx512_kernels() == nullptr) return nullptr;
  static const TileKernels k = bf16_tile_kernels("amx_int8_emulated", avx512_kernels(),
                                                 amx_impl::kInt8EmulatedTileFunctions);
  return &k;
}
}  // namespace dattn::flash
#else
namespace dattn::flash {
const TileKernels& amx_kernels() {
  return amx_emulated_kernels();
}
const TileKernels* amx_emulated_tiles_avx512_kernels() {
  return nullptr;
}
const TileKernels& amx_int8_kernels() {
  return amx_int8_emulated_kernels();
}
const TileKernels* amx_int8_emulated_tiles_avx512_kernels() {
  return nullptr;
}
}  // namespace dattn::flash
#endif
