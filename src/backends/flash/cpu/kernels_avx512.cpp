// FLASH tile kernels for AVX-512 (16 f32 lanes): micro-tiles of 6 keys x 64 rows (K.Q^T)
// and 6 rows x 64 columns (P.V), 24 of the 32 registers as accumulators.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numbers>

#include "backends/flash/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

// The instruction set of every function below: GCC's target pragma, or clang's equivalent.
#if defined(__clang__)
#pragma clang attribute push(                                                    \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"))), \
    apply_to = function)
#else
// GCC 12's AVX-512 headers trip its own uninitialized-value warnings (_mm512_undefined_*).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
#endif

namespace dattn::flash {
namespace avx512_impl {

#include "backends/flash/cpu/avx512_vec.hpp"

#include "backends/flash/cpu/tile_kernels_impl.hpp"

}  // namespace avx512_impl

namespace {
constexpr TileKernels kKernels = avx512_impl::make_tile_kernels<avx512_impl::Vec>("avx512");
}  // namespace

const TileKernels& avx512_kernels() {
  return kKernels;
}

}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
namespace dattn::flash {
const TileKernels& avx512_kernels() {
  return portable_kernels();
}
}  // namespace dattn::flash
#endif
