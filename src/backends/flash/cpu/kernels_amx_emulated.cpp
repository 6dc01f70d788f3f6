// The emulated twin of the amx engine: the same layouts, blocking and order (amx_impl.hpp) with
// the eight tile registers as thread-local arrays and TDPBF16PS computed in portable C++ in the
// instruction's order (Intel SDM: for each row m, pair k and column n, C[m][n] +=
// A[m].even * B[k].even, then += A[m].odd * B[k].odd, f32 FMAs with bf16 denormal inputs read as
// zero). It runs on every machine, so the packing, blocking, masking and edge tiles of the AMX
// engine are tested everywhere. Where the CPU has AVX-512 BF16 its vector parts and softmax are
// the real engine's (kernels_amx.cpp); elsewhere the portable ones.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

#include "backends/flash/kernels.hpp"
#include "dattn/dtype.hpp"

namespace dattn::flash {
namespace amx_emulated_impl {

// In this order: each builds on the ones before.
#include "backends/flash/cpu/bf16_pairs.hpp"

#include "backends/flash/cpu/bf16_emulated_ops.hpp"

#include "backends/flash/cpu/amx_emulated_tiles.hpp"

#include "backends/flash/cpu/amx_impl.hpp"

#include "backends/flash/cpu/int8_impl.hpp"

#include "backends/flash/cpu/amx_int8_impl.hpp"

}  // namespace amx_emulated_impl

// On CPUs with AVX-512 BF16 the twin is the amx engine itself with emulated tiles (the real
// engine's packing, transposition, scaling and softmax); elsewhere it is all portable.
const TileKernels& amx_emulated_kernels() {
  static const TileKernels k = [] {
    if (const TileKernels* vector = amx_emulated_tiles_avx512_kernels()) return *vector;
    return bf16_tile_kernels(
        "amx_emulated", portable_kernels(),
        amx_emulated_impl::amx_functions<amx_emulated_impl::EmulatedTiles,
                                         amx_emulated_impl::EmulatedBf16Ops>());
  }();
  return k;
}

// amx_int8's twin: on CPUs with AVX-512 BF16 the real engine's vector parts with emulated tiles
// (kernels_amx.cpp), elsewhere all portable.
const TileKernels& amx_int8_emulated_kernels() {
  static const TileKernels k = [] {
    if (const TileKernels* vector = amx_int8_emulated_tiles_avx512_kernels()) return *vector;
    return bf16_tile_kernels(
        "amx_int8_emulated", portable_kernels(),
        amx_emulated_impl::amx_int8_functions<amx_emulated_impl::EmulatedTiles,
                                              amx_emulated_impl::EmulatedBf16Ops>());
  }();
  return k;
}

}  // namespace dattn::flash
