// The emulated twins of the AArch64 SAGE engines (kernels_int8_neon.cpp): neon_dotprod's SDOT
// (signed bytes, P.V's 8-bit codes in int16 pairs) and neon_i8mm's USDOT (unsigned-by-signed
// bytes, queries offset by 128), 4 lanes, int8_impl.hpp's layouts and blocking with the
// instructions computed in portable C++ (int8_emulated_ops.hpp), which the tests run on every
// machine. Their softmax and row conversions are the portable f32 ones. A file of its own beside
// kernels_int8_emulated.cpp: the two compile side by side.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/flash/kernels.hpp"

namespace dattn::flash {
namespace int8_neon_emulated_impl {

#include "backends/flash/cpu/int8_impl.hpp"

#include "backends/flash/cpu/int8_emulated_ops.hpp"

using NeonDotprod = EmulatedInt8Ops<4, 4, false, 8, 2>;
using NeonI8mm = EmulatedInt8Ops<4, 4, true, 8>;

}  // namespace int8_neon_emulated_impl

namespace {
using namespace int8_neon_emulated_impl;
template <class I>
TileKernels make(std::string_view name) {
  return int8_tile_kernels(name, portable_kernels(), int8_functions<I, &portable_kernels>());
}
template <class I>
TileKernels make_pv8(std::string_view name) {
  return int8_tile_kernels(name, portable_kernels(), int8pv_functions<I, &portable_kernels>());
}
template <class I>
TileKernels make_pv16(std::string_view name) {
  return int8_tile_kernels(name, portable_kernels(),
                           int8pv_functions<I, &portable_kernels, Pv16<I>>());
}
}  // namespace

const TileKernels& neon_dotprod_emulated_kernels() {
  static const TileKernels k = make<NeonDotprod>("neon_dotprod_emulated");
  return k;
}
const TileKernels& neon_i8mm_emulated_kernels() {
  static const TileKernels k = make<NeonI8mm>("neon_i8mm_emulated");
  return k;
}
const TileKernels& neon_dotprod_emulated_pv8_kernels() {
  static const TileKernels k = make_pv8<NeonDotprod>("neon_dotprod_emulated");
  return k;
}
const TileKernels& neon_i8mm_emulated_pv8_kernels() {
  static const TileKernels k = make_pv8<NeonI8mm>("neon_i8mm_emulated");
  return k;
}
const TileKernels& neon_dotprod_emulated_pv16_kernels() {
  static const TileKernels k = make_pv16<NeonDotprod>("neon_dotprod_emulated");
  return k;
}
const TileKernels& neon_i8mm_emulated_pv16_kernels() {
  static const TileKernels k = make_pv16<NeonI8mm>("neon_i8mm_emulated");
  return k;
}

}  // namespace dattn::flash
