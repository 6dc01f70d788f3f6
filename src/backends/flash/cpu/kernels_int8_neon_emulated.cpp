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

using namespace int8_neon_emulated_impl;

const TileKernels& neon_dotprod_emulated_kernels() {
  static const TileKernels k = emulated_int8_kernels<NeonDotprod>("neon_dotprod_emulated");
  return k;
}
const TileKernels& neon_i8mm_emulated_kernels() {
  static const TileKernels k = emulated_int8_kernels<NeonI8mm>("neon_i8mm_emulated");
  return k;
}
const TileKernels& neon_dotprod_emulated_pv8_kernels() {
  static const TileKernels k = emulated_int8_pv8_kernels<NeonDotprod>("neon_dotprod_emulated");
  return k;
}
const TileKernels& neon_i8mm_emulated_pv8_kernels() {
  static const TileKernels k = emulated_int8_pv8_kernels<NeonI8mm>("neon_i8mm_emulated");
  return k;
}
const TileKernels& neon_dotprod_emulated_pv16_kernels() {
  static const TileKernels k = emulated_int8_pv16_kernels<NeonDotprod>("neon_dotprod_emulated");
  return k;
}
const TileKernels& neon_i8mm_emulated_pv16_kernels() {
  static const TileKernels k = emulated_int8_pv16_kernels<NeonI8mm>("neon_i8mm_emulated");
  return k;
}

}  // namespace dattn::flash
