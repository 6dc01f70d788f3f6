// The per-engine hot loops of the FLASH backend. The driver (flash.cpp) packs tiles and keeps
// the online-softmax state; these functions do the arithmetic.
//
// The logits are computed transposed, S^T = K . Q^T, so that K and V tiles stay row-major
// (converting a tile is a copy, never a transposition) and the softmax runs across query rows
// in SIMD lanes with no horizontal reductions.
//
// Layout contracts of the f32 tiles the driver hands over (row-major, strides in floats):
//   K   [keys][d]        key rows of one tile, converted to f32; columns d.. up to ldk zero
//   QT  [d][rows_p]      query rows transposed, pre-scaled by softmax_scale;
//                        rows_p a multiple of row_align, padding rows zero
//   ST  [keys][rows_p]   logits in natural units (-inf = hidden; a dot product that is not
//                        finite is stored as NaN), then probabilities
//
// Natural units, not log2 ones: a finite additive mask as low as -FLT_MAX (torch.finfo.min)
// must stay finite, and scaling it by log2(e) would overflow to -inf (docs/semantics.md).
//   V   [keys][dv]       value rows; dv a multiple of col_align, columns past the real dv zero
//   O   [rows_p][dv]     running un-normalised output (rows past `rows` are scratch)
//
// K and V panels. The driver converts the key rows of a call once (not once per query block):
// for every (segment, KV head) it packs the keys tile by tile, kTileKeys keys per tile, into a
// per-call panel in the engine's format, and hands qk and pv a tile of it. The f32 engines'
// format is the f32 rows themselves (K [keys][ldk], V [keys][ldv], padded strides; pack_k and
// pack_v are nullptr and the driver converts straight into the panel); the bf16 engines pack
// the f32 rows into bf16 pairs (bf16_dot_impl.hpp, amx_impl.hpp), each tile `k_tile_bytes` /
// `v_tile_bytes` bytes, 64-byte aligned.
//
// Engines that compute in their own operand formats (the bf16 engines) also own a per-thread
// workspace of workspace_bytes() bytes, 64-byte aligned, that the driver passes to pack_q (once
// per work item, after QT is filled), qk and pv. Such engines take QT unscaled and multiply the
// logits by `logit_scale` (given to pack_q) in f32 after the dot products, so that the bf16
// operands of bf16 inputs are the inputs themselves, exactly. The f32 engines have no
// workspace (nullptr) and get QT pre-scaled.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "dattn/dtype.hpp"

namespace dattn::flash {

// Keys per tile (and per tile of a K/V panel).
inline constexpr int kTileKeys = 64;
// How far above a row's largest logit its softmax reference m is set when it rises (natural
// units): probabilities of the largest logits are e^-8, far from f32's and bf16's underflow.
inline constexpr float kMaxHeadroom = 8.0f;

struct TileKernels {
  std::string_view engine;  // the engine's name (engines.hpp)
  int row_align;            // query rows per S^T micro-tile (and softmax lane group)
  int col_align;            // output columns per P.V micro-tile

  // ST = K . QT for `keys` keys and `rows_p` rows (rows_p % row_align == 0) over `d`; an entry
  // that is not finite becomes NaN. `k` is a K tile of the panel (f32 rows of stride ldk for
  // the f32 engines).
  void (*qk)(const void* k, std::int64_t ldk, const float* qt, std::int64_t ldqt, float* st,
             std::int64_t ldst, int keys, int rows_p, int d, void* ws);
  // One online-softmax step over a tile: for every row r (a column of ST) updates the running
  // reference m[r] (an upper bound of the row's logits so far: raised lazily, to the tile's max
  // plus kMaxHeadroom, only when a logit passes it) and sum l[r], turns the column into
  // e^(s - m_new) and sets alpha[r] = e^(m_old - m_new), the factor that rescales the row's
  // earlier output (exactly 1 when m did not move). A NaN or +inf logit makes l[r] NaN for
  // good.
  void (*softmax_tile)(float* st, std::int64_t ldst, int keys, int rows_p, float* m, float* l,
                       float* alpha);
  // O[r] = O[r] * alpha[r] + sum_j PT[j][r] V[j] for `rows` rows (dv % col_align == 0); `v` is
  // a V tile of the panel (f32 rows of stride ldv for the f32 engines). O has room for
  // round_up(rows, row_align) rows.
  void (*pv)(const float* pt, std::int64_t ldpt, const void* v, std::int64_t ldv, float* o,
             std::int64_t ldo, const float* alpha, int rows, int keys, int dv, void* ws);
  // dst[0..n) = src[0..n) * scale for a contiguous row of f32, bf16 or f16.
  void (*load_row)(const void* src, DType dtype, std::int64_t n, float scale, float* dst);
  // dst[0..n) = src[0..n) * scale rounded (to nearest even) to a contiguous f32, bf16 or f16
  // row.
  void (*store_row)(const float* src, float scale, std::int64_t n, DType dtype, void* dst);

  // Engines with their own operand formats (nullptr / 0 for the f32 engines):
  // the workspace size for tiles of up to `rows_p` rows and kTileKeys keys with head sizes d
  // and dv (padded), and the per-work-item packing of QT [d][rows_p] (stride ldqt) into it.
  std::size_t (*workspace_bytes)(int rows_p, int d, int dv) = nullptr;
  void (*pack_q)(const float* qt, std::int64_t ldqt, int rows_p, int d, int dv, float logit_scale,
                 void* ws) = nullptr;
  // The bytes of one packed K tile (head size d) and V tile (dv, padded), multiples of 64;
  // pack_k / pack_v pack `keys` (<= kTileKeys) f32 rows of stride ld into one.
  std::size_t (*k_tile_bytes)(int d) = nullptr;
  std::size_t (*v_tile_bytes)(int dv) = nullptr;
  void (*pack_k)(const float* k, std::int64_t ld, int keys, int d, void* tile) = nullptr;
  void (*pack_v)(const float* v, std::int64_t ld, int keys, int dv, void* tile) = nullptr;
  // Per-thread set-up before a thread's first qk/pv of a run and tear-down after its last
  // (AMX: load the tile configuration / release the tiles); nullptr when not needed.
  void (*thread_begin)() = nullptr;
  void (*thread_end)() = nullptr;
};

// The parts of a TileKernels a bf16 engine supplies (cpu/bf16_dot_impl.hpp,
// cpu/amx_impl.hpp), and the table they make with the softmax and row conversions of `base`.
struct Bf16Functions {
  decltype(TileKernels::qk) qk;
  decltype(TileKernels::pv) pv;
  decltype(TileKernels::workspace_bytes) workspace_bytes;
  decltype(TileKernels::pack_q) pack_q;
  decltype(TileKernels::k_tile_bytes) k_tile_bytes;
  decltype(TileKernels::v_tile_bytes) v_tile_bytes;
  decltype(TileKernels::pack_k) pack_k;
  decltype(TileKernels::pack_v) pack_v;
  int align;
  decltype(TileKernels::thread_begin) thread_begin = nullptr;
  decltype(TileKernels::thread_end) thread_end = nullptr;
};
inline TileKernels bf16_tile_kernels(std::string_view engine, const TileKernels& base,
                                     const Bf16Functions& f) {
  TileKernels k = base;
  k.engine = engine;
  k.row_align = k.col_align = f.align;
  k.qk = f.qk;
  k.pv = f.pv;
  k.workspace_bytes = f.workspace_bytes;
  k.pack_q = f.pack_q;
  k.k_tile_bytes = f.k_tile_bytes;
  k.v_tile_bytes = f.v_tile_bytes;
  k.pack_k = f.pack_k;
  k.pack_v = f.pack_v;
  k.thread_begin = f.thread_begin;
  k.thread_end = f.thread_end;
  return k;
}

const TileKernels& portable_kernels();
const TileKernels& avx2_kernels();
const TileKernels& avx512_kernels();
// bf16 pair products accumulated in f32: vdpbf16ps, and its emulation in portable C++ (the
// same layouts, the same order of operations).
const TileKernels& avx512_bf16_kernels();
const TileKernels& avx512_bf16_emulated_kernels();
// AMX tiles (tdpbf16ps: bf16 pair products accumulated in f32), and the twin that emulates the
// tile registers and instructions in portable C++ (the same layouts, blocking and order).
const TileKernels& amx_kernels();
const TileKernels& amx_emulated_kernels();
// The amx engine on emulated tiles with its AVX-512 BF16 vector parts; nullptr where the CPU
// lacks them (amx_emulated_kernels() picks it where it can).
const TileKernels* amx_emulated_tiles_avx512_kernels();

}  // namespace dattn::flash
