// The sve engine at one vector length (DATTN_SVE_BITS), included by kernels_sve128.cpp,
// kernels_sve256.cpp and kernels_sve512.cpp: the shared tile kernels over sve_vec.hpp's vectors
// of W = bits / 32 lanes, micro-tiles of 6 keys x 3W query rows and 6 rows x 3W columns (18
// accumulators of SVE's 32 registers, as neon's), FMLA throughout. The file is compiled with
// -msve-vector-bits=BITS (CMakeLists.txt), its kernels inside an SVE target region: they run
// only where the engine table finds SVE at exactly this length (engines.cpp's sve_kernels()
// picks the build).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>

#include "backends/flash/kernels.hpp"

#define DATTN_SVE_CAT2(a, b) a##b
#define DATTN_SVE_CAT(a, b) DATTN_SVE_CAT2(a, b)
#define DATTN_SVE_NS DATTN_SVE_CAT(DATTN_SVE_CAT(sve, DATTN_SVE_BITS), _impl)
#define DATTN_SVE_KERNELS DATTN_SVE_CAT(DATTN_SVE_CAT(sve, DATTN_SVE_BITS), _kernels)

#if defined(__aarch64__)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("arch=armv8.2-a+sve"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+sve")
#endif
#include <arm_sve.h>

namespace dattn::flash {
namespace DATTN_SVE_NS {

#include "backends/flash/cpu/sve_vec.hpp"

#include "backends/flash/cpu/tile_kernels_impl.hpp"

constexpr TileKernels kKernels = make_tile_kernels<Vec>("sve");

}  // namespace DATTN_SVE_NS
}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace dattn::flash {
const TileKernels& DATTN_SVE_KERNELS() {
  return DATTN_SVE_NS::kKernels;
}
}  // namespace dattn::flash
#else
namespace dattn::flash {
const TileKernels& DATTN_SVE_KERNELS() {
  return portable_kernels();
}
}  // namespace dattn::flash
#endif
