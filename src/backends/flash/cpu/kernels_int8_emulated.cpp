// The portable SAGE engines: portable_int8 (the engine of a CPU without AVX2) and the emulated
// twins of avx2_int8, avx_vnni and avx512_vnni (int8_impl.hpp's layouts and blocking with the
// instructions computed in portable C++, int8_emulated_ops.hpp), which the tests run on every
// machine. Their softmax and row conversions are the portable f32 ones; P.V is portable f32,
// or the emulated bf16 dot for the avx512_vnni twin (as its real twin on an AVX512-BF16 CPU).
// The AArch64 engines' twins: kernels_int8_neon_emulated.cpp.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/flash/kernels.hpp"

namespace dattn::flash {
namespace int8_emulated_impl {

#include "backends/flash/cpu/int8_impl.hpp"

#include "backends/flash/cpu/int8_emulated_ops.hpp"

// avx2_int8: signed bytes (the sign trick) for Q.K^T, int16 pairs for P.V's 8-bit codes.
using Avx2Int8 = EmulatedInt8Ops<8, 4, false, 6, 2>;
using AvxVnni = EmulatedInt8Ops<8, 4, true, 6>;
using Avx512Vnni = EmulatedInt8Ops<16, 4, true, 8>;
// The 16-bit integer-lane twins: int16 pairs for Q.K^T and P.V, exact channels (int8_impl.hpp).
template <int Lanes, int Keys>
struct EmulatedInt16Ops : EmulatedInt8Ops<Lanes, 2, false, Keys> {
  static constexpr bool kExact = true;
};
using Avx2Int16 = EmulatedInt16Ops<8, 4>;
using AvxVnniInt16 = EmulatedInt16Ops<8, 4>;
using Avx512VnniInt16 = EmulatedInt16Ops<16, 8>;

}  // namespace int8_emulated_impl

TileKernels int8_tile_kernels(std::string_view engine, const TileKernels& base,
                              const Int8Functions& f) {
  TileKernels k = base;
  k.engine = engine;
  k.row_align = std::lcm(base.row_align, f.align);
  if (f.col_align > 0) k.col_align = std::lcm(base.col_align, f.col_align);
  k.steps.qk = f.qk;
  k.steps.pv = f.pv;
  if (f.softmax_tile != nullptr) k.steps.softmax_tile = f.softmax_tile;
  k.formats = f.formats;
  k.loop.attend = nullptr;  // tile by tile: qk here, the softmax (the base's) and pv
  k.loop.panel_tiles = 1;
  k.loop.thread_begin = k.loop.thread_end = nullptr;
  return k;
}

using namespace int8_emulated_impl;

const TileKernels& avx2_int16_emulated_kernels() {
  static const TileKernels k = emulated_int8_pv16_kernels<Avx2Int16>("avx2_int16_emulated");
  return k;
}
const TileKernels& avx_vnni_int16_emulated_kernels() {
  static const TileKernels k = emulated_int8_pv16_kernels<AvxVnniInt16>("avx_vnni_int16_emulated");
  return k;
}
const TileKernels& avx512_vnni_int16_emulated_kernels() {
  static const TileKernels k =
      emulated_int8_pv16_kernels<Avx512VnniInt16>("avx512_vnni_int16_emulated");
  return k;
}

const TileKernels& portable_int8_pv16_kernels() {
  static const TileKernels k = emulated_int8_pv16_kernels<Avx2Int8>("portable_int8");
  return k;
}
const TileKernels& avx2_int8_emulated_pv16_kernels() {
  static const TileKernels k = emulated_int8_pv16_kernels<Avx2Int8>("avx2_int8_emulated");
  return k;
}
const TileKernels& avx_vnni_emulated_pv16_kernels() {
  static const TileKernels k = emulated_int8_pv16_kernels<AvxVnni>("avx_vnni_emulated");
  return k;
}
const TileKernels& avx512_vnni_emulated_pv16_kernels() {
  static const TileKernels k = emulated_int8_pv16_kernels<Avx512Vnni>("avx512_vnni_emulated");
  return k;
}

const TileKernels& portable_int8_pv8_kernels() {
  static const TileKernels k = emulated_int8_pv8_kernels<Avx2Int8>("portable_int8");
  return k;
}
const TileKernels& avx2_int8_emulated_pv8_kernels() {
  static const TileKernels k = emulated_int8_pv8_kernels<Avx2Int8>("avx2_int8_emulated");
  return k;
}
const TileKernels& avx_vnni_emulated_pv8_kernels() {
  static const TileKernels k = emulated_int8_pv8_kernels<AvxVnni>("avx_vnni_emulated");
  return k;
}
const TileKernels& avx512_vnni_emulated_pv8_kernels() {
  static const TileKernels k = emulated_int8_pv8_kernels<Avx512Vnni>("avx512_vnni_emulated");
  return k;
}

const TileKernels& portable_int8_kernels() {
  static const TileKernels k = emulated_int8_kernels<Avx2Int8>("portable_int8");
  return k;
}
const TileKernels& avx2_int8_emulated_kernels() {
  static const TileKernels k = emulated_int8_kernels<Avx2Int8>("avx2_int8_emulated");
  return k;
}
const TileKernels& avx_vnni_emulated_kernels() {
  static const TileKernels k = emulated_int8_kernels<AvxVnni>("avx_vnni_emulated");
  return k;
}
const TileKernels& avx512_vnni_emulated_kernels() {
  static const TileKernels k =
      emulated_int8_kernels<Avx512Vnni, &avx512_bf16_emulated_kernels>("avx512_vnni_emulated");
  return k;
}
const TileKernels& avx512_vnni_emulated_f32_pv_kernels() {
  static const TileKernels k = emulated_int8_kernels<Avx512Vnni>("avx512_vnni_emulated");
  return k;
}

}  // namespace dattn::flash
