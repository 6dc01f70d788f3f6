// The emulated twins of the bf16-dot engines. avx512_bf16_emulated, of the avx512_bf16 engine: the
// same packed layouts and blocking (bf16_dot_impl.hpp) with VDPBF16PS computed in portable C++,
// lane by lane, in the instruction's order (Intel SDM: srcdest += src1.odd * src2.odd, then +=
// src1.even * src2.even, each an f32 FMA with denormal inputs read as zero and denormal results
// flushed to zero, round to nearest even). It runs on every machine, so the packing, blocking,
// masking and edge tiles of the bf16 engine are tested everywhere. The softmax and row conversions
// are the portable f32 ones. neon_bf16_emulated, of the neon_bf16 engine: the same layouts on
// 4-lane vectors with BFDOT's arithmetic (neon_bf16_emulated_ops.hpp: round-to-odd additions),
// which the tests compare with the real instruction under qemu-aarch64.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "backends/flash/kernels.hpp"
#include "dattn/dtype.hpp"

namespace dattn::flash {
namespace bf16_emulated_impl {

// In this order: each builds on the ones before.
#include "backends/flash/cpu/bf16_pairs.hpp"

#include "backends/flash/cpu/bf16_emulated_ops.hpp"
using Dot = EmulatedBf16Ops;

#include "backends/flash/cpu/bf16_dot_impl.hpp"

}  // namespace bf16_emulated_impl

namespace neon_bf16_emulated_impl {

#include "backends/flash/cpu/bf16_pairs.hpp"

#include "backends/flash/cpu/neon_bf16_emulated_ops.hpp"
using Dot = EmulatedNeonBf16Ops;

#include "backends/flash/cpu/bf16_dot_impl.hpp"

}  // namespace neon_bf16_emulated_impl

const TileKernels& avx512_bf16_emulated_kernels() {
  static const TileKernels k =
      bf16_tile_kernels("avx512_bf16_emulated", portable_kernels(),
                        bf16_emulated_impl::bf16_dot_functions<bf16_emulated_impl::Dot>());
  return k;
}

const TileKernels& neon_bf16_emulated_kernels() {
  static const TileKernels k = bf16_tile_kernels(
      "neon_bf16_emulated", portable_kernels(),
      neon_bf16_emulated_impl::bf16_dot_functions<neon_bf16_emulated_impl::Dot>());
  return k;
}

}  // namespace dattn::flash
