// FLASH tile kernels for AArch64's Advanced SIMD (NEON, 4 f32 lanes, mandatory on every AArch64
// CPU): K.Q^T micro-tiles of 6 keys x 12 query rows and P.V micro-tiles of 6 rows x 12 columns
// (3 vectors of 4 lanes: 18 accumulators of NEON's 32 registers; with 4 vectors the 24
// accumulators, 4 Q vectors and the 6 keys' lanes spill, 82-91% of the FMLA bound under llvm-mca
// on Neoverse N1 against 94% with 3: bench/mca_loops.py), FMLA by element throughout. bf16 and f16
// inputs are widened as the driver's panel packer does on x86 (bf16 by a shift, f16 by FCVTL).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>

#include "backends/flash/kernels.hpp"

#if defined(__aarch64__)
#include <arm_neon.h>

namespace dattn::flash {
namespace neon_impl {

#include "backends/flash/cpu/neon_vec.hpp"

#include "backends/flash/cpu/tile_kernels_impl.hpp"

}  // namespace neon_impl

namespace {
constexpr TileKernels kKernels = neon_impl::make_tile_kernels<neon_impl::Vec>("neon");
}  // namespace

const TileKernels& neon_kernels() {
  return kKernels;
}

}  // namespace dattn::flash
#else
namespace dattn::flash {
const TileKernels& neon_kernels() {
  return portable_kernels();
}
}  // namespace dattn::flash
#endif
