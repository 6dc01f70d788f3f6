// The per-ISA hot loops of the FLASH backend. The driver (flash.cpp) packs tiles and keeps the
// online-softmax state; these functions do the arithmetic on f32 tiles.
//
// The logits are computed transposed, S^T = K . Q^T, so that K and V tiles stay row-major
// (converting a tile is a copy, never a transposition) and the softmax runs across query rows
// in SIMD lanes with no horizontal reductions.
//
// Layout contracts (all f32, row-major, strides in floats):
//   K   [keys][d]        key rows of one tile, converted to f32
//   QT  [d][rows_p]      query rows transposed, pre-scaled by softmax_scale;
//                        rows_p a multiple of row_align, padding rows zero
//   ST  [keys][rows_p]   logits in natural units (-inf = hidden; a dot product that is not
//                        finite is stored as NaN), then probabilities
//
// Natural units, not log2 ones: a finite additive mask as low as -FLT_MAX (torch.finfo.min)
// must stay finite, and scaling it by log2(e) would overflow to -inf (docs/semantics.md).
//   V   [keys][dv]       value rows; dv a multiple of col_align
//   O   [rows][dv]       running un-normalised output
#pragma once

#include <cstdint>

#include "backends/flash/isa.hpp"
#include "dattn/dtype.hpp"

namespace dattn::flash {

struct TileKernels {
  Isa isa;
  int row_align;  // query rows per S^T micro-tile (and softmax lane group)
  int col_align;  // output columns per P.V micro-tile

  // ST = K . QT for `keys` keys and `rows_p` rows (rows_p % row_align == 0) over `d`; an entry
  // that is not finite becomes NaN.
  void (*qk)(const float* k, std::int64_t ldk, const float* qt, std::int64_t ldqt, float* st,
             std::int64_t ldst, int keys, int rows_p, int d);
  // One online-softmax step over a tile: for every row r (a column of ST) updates the running
  // max m[r] and sum l[r], turns the column into e^(s - m_new) and sets alpha[r] =
  // e^(m_old - m_new), the factor that rescales the row's earlier output. A NaN or +inf logit
  // makes l[r] NaN for good.
  void (*softmax_tile)(float* st, std::int64_t ldst, int keys, int rows_p, float* m, float* l,
                       float* alpha);
  // O[r] = O[r] * alpha[r] + sum_j PT[j][r] V[j] for `rows` rows (dv % col_align == 0).
  void (*pv)(const float* pt, std::int64_t ldpt, const float* v, std::int64_t ldv, float* o,
             std::int64_t ldo, const float* alpha, int rows, int keys, int dv);
  // dst[0..n) = src[0..n) * scale for a contiguous row of f32, bf16 or f16.
  void (*load_row)(const void* src, DType dtype, std::int64_t n, float scale, float* dst);
  // dst[0..n) = src[0..n) * scale rounded (to nearest even) to a contiguous f32, bf16 or f16
  // row.
  void (*store_row)(const float* src, float scale, std::int64_t n, DType dtype, void* dst);
};

const TileKernels& portable_kernels();
const TileKernels& avx2_kernels();
const TileKernels& avx512_kernels();
const TileKernels& kernels_for(Isa isa);

}  // namespace dattn::flash
