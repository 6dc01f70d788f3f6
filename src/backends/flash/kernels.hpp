// The per-engine hot loops of the FLASH backend, and the contract between them and the drivers
// that feed them (FLASH, flash.cpp; VIDEO_SPARSE, video_sparse.cpp; the half of the driver they
// share is item_driver.hpp).
//
// The contract. A driver owns what is shared: packing K and V once per call into tiles of the
// engine's format, the work list and the threads, which key tiles a work item visits (causal and
// position limits, masks that hide whole tiles, block-sparse maps), the per-tile logits hook that
// applies what a tile's positions and masks hide or add, and the row writer. An engine owns a
// work item's inner loop (InnerLoop::attend): given the item's packed queries and a producer
// of its key tiles (ItemKeys), it computes the online softmax and P.V in the layout that suits
// its instructions, calls the hook on the tiles that need it, and leaves the item's running
// (O, m, l) for the driver to write. The f32 engines and avx512_bf16 use attend_tile_by_tile
// below (S^T in SIMD lanes, their qk / softmax_tile / pv per tile); the amx engine has its own
// (S rows as tiles, key panels of several tiles, cpu/amx_impl.hpp).
//
// The tile-by-tile engines compute the logits transposed, S^T = K . Q^T, so that K and V tiles
// stay row-major (converting a tile is a copy, never a transposition) and the softmax runs
// across query rows in SIMD lanes with no horizontal reductions.
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

// 2^f on [-1/2, 1/2] as 1 + f (c0 + f (c1 + f (c2 + f (c3 + f c4)))): a degree-5 polynomial
// fitted for the least largest relative error (9.2e-8; 1.9e-7 evaluated in f32, under two
// ulps), the vector exponentials' core (exp2_nonpositive of the SIMD kernels).
inline constexpr float kExp2Poly[5] = {6.931470037e-01f, 2.402224243e-01f, 5.550733581e-02f,
                                       9.671482258e-03f, 1.326463651e-03f};
// 2^f on [0, 1) as 1 + f (c0 + f (c1 + f c2)), fitted for the least largest relative error
// (8.6e-5, a forty-fifth of bf16's half ulp): the exponential of probabilities rounded to bf16
// next (the amx engine's row softmax, which reduces x to floor(x) + f).
inline constexpr float kExp2PolyBf16[3] = {6.951168180e-01f, 2.276449353e-01f, 7.706709951e-02f};

// The 16-bit integer-lane engines (compute int16, cpu/int8_impl.hpp with I::kExact): of a head
// of d channels, the last int16_exact_channels(d) are exact f32 terms beside the codes of the
// others (the driver moves the channels of largest spread there, item_driver.hpp, Smoothing), and
// the others' codes are at most int16_code_top(coded) in magnitude: coded channels in pairs sum
// at most 2 * ceil(coded / 2) * top^2 <= 2^31 - 1 in an int32 lane, so no lane can wrap (4095,
// 13-bit codes, up to 128 coded channels; 2919 at 256; 2063 at 512).
inline constexpr int int16_exact_channels(int d) {
  return d >= 32 ? 4 : 0;
}
inline float int16_code_top(int coded) {
  const double pairs = double((coded + 1) / 2);
  const double limit = 2147483647.0 / (2.0 * (pairs > 0 ? pairs : 1.0));
  double top = 4095.0;
  if (top * top > limit) {
    top = 1.0;  // the largest integer whose square is within the limit
    for (double step = 2048.0; step >= 1.0; step /= 2.0)
      if ((top + step) * (top + step) <= limit) top += step;
  }
  return float(top);
}

struct TileKernels;
// Query rows per work item on a small L2 unless an engine asks for more (InnerLoop::item_rows).
inline constexpr int kDefaultItemRows = 128;
// The most tiles an engine holds at once (InnerLoop::panel_tiles).
inline constexpr int kMaxPanelTiles = 8;

// One key tile of a work item as its driver hands it to the engine.
struct KeyTile {
  const void* k;  // the K tile in the engine's format (f32 rows of stride ItemState::ld_k for
  const void* v;  // the f32 engines); the V tile likewise
  int keys;       // 1..kTileKeys
  // The driver must see the tile's logits before the softmax (ItemKeys::logits): some of its
  // keys lie past a row's position limit, or a mask hides or shifts some of them.
  bool hook;
  // The driver's reference for its hook (FLASH: the tile's first key; VIDEO_SPARSE: the slot
  // that holds the gathered chunk, or for engines with their own format the tile's first key
  // position).
  std::int64_t j0;
  // Keys of the tile the hook hides from every row (bit j: key j), besides what positions and
  // masks hide: SAGE packs a tile that holds two populations twice (item_driver.hpp, Smoothing),
  // each copy showing one part. Set only with `hook`.
  std::uint64_t hide = 0;
};

// The key tiles of one work item, produced on demand. tile(ctx, n) returns tile n (asked for in
// order n = 0, 1, ...) or nullptr after the last; a returned tile stays valid until
// InnerLoop::panel_tiles later calls. logits(ctx, tile, s, row_stride, key_stride) sees the
// tile's logits in natural units (scaled, not yet exponentiated), s[r * row_stride + j *
// key_stride] for the item's rows r < rows and the tile's keys j < keys: it sets those a row
// may not see to -inf and adds additive mask terms. Natural units, so that a finite mask as low
// as -FLT_MAX stays finite (see below).
struct ItemKeys {
  const KeyTile* (*tile)(void* ctx, int n);
  void (*logits)(void* ctx, const KeyTile& tile, float* s, std::int64_t row_stride,
                 std::int64_t key_stride);
  void* ctx;
};

// A work item's state: its queries (QT, and the engine's workspace after pack_q), f32 scratch
// for one tile's S^T, and its running output: O [rows_p][ld_o] (un-normalised), m and l per row
// (natural units; the row writer's rule, tile_io.hpp), alpha scratch per row. O, m and l come in
// as zeros, -inf and zeros.
struct ItemState {
  const float* qt;
  float* st;
  std::int64_t ld_rows;  // of qt and st
  float* o;
  std::int64_t ld_o;
  float *m, *l, *alpha;
  int rows, rows_p, d, dv;  // dv: padded to col_align
  std::int64_t ld_k, ld_v;  // the f32 engines' K and V tile strides
  void* ws;
};

// A TileKernels is split into the contracts its users need. The drivers (flash.cpp,
// sparse/video_sparse.cpp, through item_driver.hpp) read only `rows_io`, `formats` and `loop`
// (with engine, row_align and col_align); `steps` and `row_softmax` are the engines' own parts,
// which their inner loops (attend_tile_by_tile below, cpu/amx_impl.hpp) call.

// Rows converted between the call's tensors and f32 (tile_io.hpp: load_elements, OutputRows).
struct RowConversions {
  // dst[0..n) = src[0..n) * scale for a contiguous row of f32, bf16 or f16.
  void (*load_row)(const void* src, DType dtype, std::int64_t n, float scale, float* dst);
  // dst[0..n) = src[0..n) * scale rounded (to nearest even) to a contiguous f32, bf16 or f16
  // row.
  void (*store_row)(const float* src, float scale, std::int64_t n, DType dtype, void* dst);
};

// The operand formats a driver packs Q, K and V into for engines with their own formats (all
// nullptr for the f32 engines, which read f32 rows of stride ItemState::ld_k / ld_v).
struct OperandFormats {
  // The workspace size for tiles of up to `rows_p` rows and kTileKeys keys with head sizes d
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
  // The int8 engines' per-key logit terms: bias[j] (natural units) added to every logit of key j
  // of a packed K tile (SAGE's query smoothing), and the tile's run (which of the row terms
  // below its logits get); nullptr for the others.
  void (*set_key_bias)(void* tile, const float* bias, int keys, int run) = nullptr;
  // The int8 engines' per-row logit terms of the work item packed last (after pack_q): every
  // logit of row r in a tile of run n >= 1 gets terms[n * rows_p + r] (natural units) added
  // (SAGE's exact q . (mean_n - mean_0)); tiles of run 0 get none (terms[0..rows_p) are the
  // driver's). The array stays the driver's and must live until the item ends. nullptr (and
  // pack_q) resets them: no tile gets a term.
  void (*set_row_terms)(void* ws, const float* terms) = nullptr;

  bool own() const { return pack_k != nullptr; }
};

// The steps of the engines that work tile by tile on S^T (attend_tile_by_tile).
struct TileSteps {
  // ST = K . QT for `keys` keys and `rows_p` rows (rows_p % row_align == 0) over `d`; an entry
  // that is not finite becomes NaN. `k` is a K tile of the panel (f32 rows of stride ldk for
  // the f32 engines).
  void (*qk)(const void* k, std::int64_t ldk, const float* qt, std::int64_t ldqt, float* st,
             std::int64_t ldst, int keys, int rows_p, int d, void* ws) = nullptr;
  // One online-softmax step over a tile: for every row r (a column of ST) updates the running
  // reference m[r] (an upper bound of the row's logits so far: raised lazily, to the tile's max
  // plus kMaxHeadroom, only when a logit passes it) and sum l[r], turns the column into
  // e^(s - m_new) and sets alpha[r] = e^(m_old - m_new), the factor that rescales the row's
  // earlier output (exactly 1 when m did not move). A NaN or +inf logit makes l[r] NaN for
  // good. `ws` is the engine's workspace: an engine whose P.V takes P in another format writes
  // P there instead, leaving ST the logits (integer codes: softmax_tile_codes; avx512_bf16's
  // bf16 pairs: softmax_tile_pairs), and its pv ignores `pt`; the f32 engines ignore `ws`.
  void (*softmax_tile)(float* st, std::int64_t ldst, int keys, int rows_p, float* m, float* l,
                       float* alpha, void* ws) = nullptr;
  // O[r] = O[r] * alpha[r] + sum_j PT[j][r] V[j] for `rows` rows (dv % col_align == 0); `v` is
  // a V tile of the panel (f32 rows of stride ldv for the f32 engines). O has room for
  // round_up(rows, row_align) rows.
  void (*pv)(const float* pt, std::int64_t ldpt, const void* v, std::int64_t ldv, float* o,
             std::int64_t ldo, const float* alpha, int rows, int keys, int dv, void* ws) = nullptr;
  // softmax_tile (the same m, l and alpha, the same bits) with the probabilities written as the
  // integer P.V's codes instead of into ST, which keeps the logits (cpu/int8_impl.hpp, pv_dtype
  // int8 and int16): row r's scale ps[r] = pmax / top and codes round(p / ps[r]) in [0, top],
  // pmax the probability of the tile's largest logit (scale 0 where that is 0 or NaN), `group`
  // (2 or 4) keys' codes in one 32-bit group at 32 / group bits each, group g of row r at
  // codes[g * ldg + r], every group of a kTileKeys tile written (keys past `keys` code 0). Each
  // f32 engine supplies one for the 8-bit engines built on it.
  void (*softmax_tile_codes)(float* st, std::int64_t ldst, int keys, int rows_p, float* m, float* l,
                             float* alpha, std::uint32_t* codes, int ldg, float* ps, int group,
                             float top) = nullptr;
};

// The online softmax over S rows (the layout of engines that compute S = Q.K^T, query rows as
// rows: the amx engines).
struct RowSoftmax {
  // For each of `rows` rows of s (stride lds) over keys [0, keys): with `raw` the entries are
  // unscaled dot products x (a logit is x * scale; an x that is not finite poisons the row, as
  // qk's NaN rule), else natural-unit logits (scaled, hooked; -inf = hidden, scale ignored).
  // Updates m, l and alpha by softmax_tile's rule and leaves the probabilities in s, zeros up
  // to keys rounded up to 16 (s has room for them). The scale is folded into the exponent's
  // multiply where |m log2(e)| <= 1024 (its rounding then costs at most 6e-5).
  void (*softmax_rows)(float* s, std::int64_t lds, int rows, int keys, float scale, bool raw,
                       float* m, float* l, float* alpha) = nullptr;
  // softmax_rows with the probabilities written to p instead, as bf16 pairs over keys (round
  // to nearest even; row stride ldp pairs), zeros up to `pairs` pairs per row (a multiple of 8
  // at least keys / 2): one pass where a bf16 engine would otherwise convert s afterwards. s
  // keeps the logits (and the padding's).
  void (*softmax_rows_pairs)(float* s, std::int64_t lds, int rows, int keys, float scale, bool raw,
                             float* m, float* l, float* alpha, std::uint32_t* p, std::int64_t ldp,
                             int pairs) = nullptr;
};

// How a driver runs the engine's inner loop on a work item.
struct InnerLoop {
  // A work item's inner loop (the contract above); nullptr: attend_tile_by_tile. panel_tiles:
  // how many tiles of ItemKeys the engine holds at once.
  void (*attend)(const TileKernels& kk, const ItemKeys& keys, const ItemState& s) = nullptr;
  int panel_tiles = 1;
  // Per-thread set-up before a thread's first work item of a run and tear-down after its last
  // (AMX: load the tile configuration / release the tiles); nullptr when not needed.
  void (*thread_begin)() = nullptr;
  void (*thread_end)() = nullptr;
  // Query rows per work item the engine is tuned for (tile_plan.hpp, item_rows): item_rows
  // where a core's L2 is smaller than 1 MiB or unknown, item_rows_large_l2 where it holds 1 MiB
  // or more. More rows use each K/V tile more often while it is in L2, at the price of a larger
  // per-thread scratch.
  int item_rows = kDefaultItemRows;
  int item_rows_large_l2 = 2 * kDefaultItemRows;

  bool tile_by_tile() const { return attend == nullptr; }
};

struct TileKernels {
  std::string_view engine;  // the engine's name (engines.hpp)
  int row_align;            // query rows per S^T micro-tile (and softmax lane group)
  int col_align;            // output columns per P.V micro-tile
  RowConversions rows_io;
  OperandFormats formats{};
  TileSteps steps{};
  RowSoftmax row_softmax{};
  InnerLoop loop{};
};

// The inner loop of the engines that work tile by tile on S^T: qk, the hook where the tile asks
// for it, softmax_tile, pv. No software prefetch of the next tile: a panel's tiles lie back to
// back, which the hardware prefetchers follow; prefetching the next tile into L2 in parts between
// these steps cost 3% in `dattn bench` on an Intel Xeon (flux-1024 f32, 1 thread: 133.3 -> 137.7
// GFLOP/s without; sd35-1024 124.9 -> 128.2) and 30% in a harness of this loop, its prefetches
// taking the fill buffers that qk's own misses need (the Zen 5 figures were measured without).
inline void attend_tile_by_tile(const TileKernels& kk, const ItemKeys& keys, const ItemState& s) {
  for (int n = 0;; ++n) {
    const KeyTile* t = keys.tile(keys.ctx, n);
    if (t == nullptr) return;
    kk.steps.qk(t->k, s.ld_k, s.qt, s.ld_rows, s.st, s.ld_rows, t->keys, s.rows_p, s.d, s.ws);
    if (t->hook) keys.logits(keys.ctx, *t, s.st, 1, s.ld_rows);
    kk.steps.softmax_tile(s.st, s.ld_rows, t->keys, s.rows_p, s.m, s.l, s.alpha, s.ws);
    kk.steps.pv(s.st, s.ld_rows, t->v, s.ld_v, s.o, s.ld_o, s.alpha, s.rows, t->keys, s.dv, s.ws);
  }
}

// Runs a work item on the engine's inner loop.
inline void attend(const TileKernels& kk, const ItemKeys& keys, const ItemState& s) {
  if (kk.loop.attend != nullptr)
    kk.loop.attend(kk, keys, s);
  else
    attend_tile_by_tile(kk, keys, s);
}

// The parts of a TileKernels a bf16 engine supplies (cpu/bf16_dot_impl.hpp,
// cpu/amx_impl.hpp), and the table they make with the softmax and row conversions of `base`.
struct Bf16Functions {
  decltype(TileSteps::qk) qk;
  decltype(TileSteps::pv) pv;
  OperandFormats formats;
  int align;
  decltype(InnerLoop::thread_begin) thread_begin = nullptr;
  decltype(InnerLoop::thread_end) thread_end = nullptr;
  decltype(InnerLoop::attend) attend = nullptr;
  int panel_tiles = 1;
  // Query rows per work item whatever the L2 (0: base's item_rows / item_rows_large_l2).
  int item_rows = 0;
  // The engine's own softmax_rows_pairs (nullptr: base's).
  decltype(RowSoftmax::softmax_rows_pairs) softmax_rows_pairs = nullptr;
  // The engine's own softmax step (nullptr: base's): one that writes P's pairs into the
  // engine's workspace for its pv.
  decltype(TileSteps::softmax_tile) softmax_tile = nullptr;
};
inline TileKernels bf16_tile_kernels(std::string_view engine, const TileKernels& base,
                                     const Bf16Functions& f) {
  TileKernels k = base;
  k.engine = engine;
  k.row_align = k.col_align = f.align;
  k.steps.qk = f.qk;
  k.steps.pv = f.pv;
  k.formats = f.formats;
  k.loop.thread_begin = f.thread_begin;
  k.loop.thread_end = f.thread_end;
  k.loop.attend = f.attend;
  k.loop.panel_tiles = f.panel_tiles;
  if (f.item_rows > 0) k.loop.item_rows = k.loop.item_rows_large_l2 = f.item_rows;
  if (f.softmax_rows_pairs != nullptr) k.row_softmax.softmax_rows_pairs = f.softmax_rows_pairs;
  if (f.softmax_tile != nullptr) k.steps.softmax_tile = f.softmax_tile;
  return k;
}

// The parts of a TileKernels an 8-bit Q.K^T engine supplies (cpu/int8_impl.hpp): its qk and
// formats for Q and K; P.V, the softmax and the row conversions are its base engine's, whose
// workspace and V format it carries.
struct Int8Functions {
  decltype(TileSteps::qk) qk;
  decltype(TileSteps::pv) pv;
  OperandFormats formats;
  int align;          // query rows per qk micro-tile
  int col_align = 0;  // output columns per pv micro-tile where it has its own (0: the base's)
  // The softmax step where P.V needs its own (integer codes), else nullptr: the base's.
  decltype(TileSteps::softmax_tile) softmax_tile = nullptr;
};
// The f32 engines' padding of V rows in scratch and panels (tile_io.hpp's kStridePad), which an
// 8-bit engine on an f32 base keeps in its V tiles.
inline constexpr std::int64_t kInt8StridePad = 16;
TileKernels int8_tile_kernels(std::string_view engine, const TileKernels& base,
                              const Int8Functions& f);

const TileKernels& portable_kernels();
const TileKernels& avx2_kernels();
const TileKernels& avx512_kernels();
// AArch64's Advanced SIMD (NEON): f32 FMLA on 128-bit vectors (the portable kernels elsewhere).
const TileKernels& neon_kernels();
// SVE's FMLA at 128-, 256- and 512-bit vectors (cpu/kernels_sve_impl.hpp: one build per length;
// the portable kernels elsewhere), and the sve engine's: the build for this process's length
// (the portable kernels where there is none, the engine then unavailable).
const TileKernels& sve128_kernels();
const TileKernels& sve256_kernels();
const TileKernels& sve512_kernels();
const TileKernels& sve_kernels();
// bf16 pair products accumulated in f32: vdpbf16ps, and its emulation in portable C++ (the
// same layouts, the same order of operations).
const TileKernels& avx512_bf16_kernels();
const TileKernels& avx512_bf16_emulated_kernels();
// BFDOT (AArch64's BF16) on the same layouts in 4-lane vectors, and its twin computing BFDOT's
// round-to-odd arithmetic in portable C++ (cpu/neon_bf16_emulated_ops.hpp).
const TileKernels& neon_bf16_kernels();
const TileKernels& neon_bf16_emulated_kernels();
// The SAGE engines (8-bit Q.K^T, cpu/int8_impl.hpp): signed bytes with vpmaddubsw's sign trick
// on AVX2, its portable C++ twin, and vpdpbusd on 256-bit (AVX-VNNI) and 512-bit (AVX512-VNNI)
// registers, each with a portable twin computing the same integers in the same layouts. P.V: f32 on
// the AVX2/portable bases; avx512_vnni's on vdpbf16ps where the CPU has AVX512-BF16 (its twin on
// the emulated bf16 dot), f32 AVX-512 otherwise or with pv_dtype f32.
const TileKernels& portable_int8_kernels();
const TileKernels& avx2_int8_kernels();
const TileKernels& avx2_int8_emulated_kernels();
const TileKernels& avx_vnni_kernels();
const TileKernels& avx_vnni_emulated_kernels();
const TileKernels& avx512_vnni_kernels();  // P.V in bf16 where the CPU can, else f32
const TileKernels& avx512_vnni_f32_pv_kernels();
const TileKernels& avx512_vnni_emulated_kernels();  // P.V on the emulated bf16 dot
const TileKernels& avx512_vnni_emulated_f32_pv_kernels();
// AArch64 (cpu/kernels_int8_neon.cpp): SDOT (neon_dotprod) and USDOT (neon_i8mm) on the neon f32
// base, each with its twin; with P.V in 8 bits and in 16-bit integer lanes.
const TileKernels& neon_dotprod_kernels();
const TileKernels& neon_dotprod_emulated_kernels();
const TileKernels& neon_i8mm_kernels();
const TileKernels& neon_i8mm_emulated_kernels();
const TileKernels& neon_dotprod_pv8_kernels();
const TileKernels& neon_dotprod_emulated_pv8_kernels();
const TileKernels& neon_i8mm_pv8_kernels();
const TileKernels& neon_i8mm_emulated_pv8_kernels();
const TileKernels& neon_dotprod_pv16_kernels();
const TileKernels& neon_dotprod_emulated_pv16_kernels();
const TileKernels& neon_i8mm_pv16_kernels();
const TileKernels& neon_i8mm_emulated_pv16_kernels();
// The same engines with P.V in 8 bits (pv_dtype int8, int8_impl.hpp: P codes per row and tile, V
// codes per tile and column, the engine's own integer dot) on their f32 bases.
const TileKernels& portable_int8_pv8_kernels();
const TileKernels& avx2_int8_pv8_kernels();
const TileKernels& avx2_int8_emulated_pv8_kernels();
const TileKernels& avx_vnni_pv8_kernels();
const TileKernels& avx_vnni_emulated_pv8_kernels();
const TileKernels& avx512_vnni_pv8_kernels();
const TileKernels& avx512_vnni_emulated_pv8_kernels();
// And with P.V in 16-bit integer lanes (pv_dtype int16: P codes 0..4095, V codes -4095..4095 as
// int16 pairs; vpmaddwd on AVX2, vpdpwssd on AVX-VNNI and AVX512-VNNI).
const TileKernels& portable_int8_pv16_kernels();
const TileKernels& avx2_int8_pv16_kernels();
const TileKernels& avx2_int8_emulated_pv16_kernels();
const TileKernels& avx_vnni_pv16_kernels();
const TileKernels& avx_vnni_emulated_pv16_kernels();
const TileKernels& avx512_vnni_pv16_kernels();
const TileKernels& avx512_vnni_emulated_pv16_kernels();
// The 16-bit integer-lane engines (compute int16: FLASH's compute_dtype int16, SAGE's and
// VIDEO_SPARSE's qk_dtype int16; int8_impl.hpp's "16-bit integer lanes"): Q.K^T and P.V on int16
// pairs, vpmaddwd + vpaddd on AVX2, vpdpwssd on AVX-VNNI and AVX512-VNNI, each with its twin.
const TileKernels& avx2_int16_kernels();
const TileKernels& avx2_int16_emulated_kernels();
const TileKernels& avx_vnni_int16_kernels();
const TileKernels& avx_vnni_int16_emulated_kernels();
const TileKernels& avx512_vnni_int16_kernels();
const TileKernels& avx512_vnni_int16_emulated_kernels();
// AMX tiles (tdpbf16ps: bf16 pair products accumulated in f32), and the twin that emulates the
// tile registers and instructions in portable C++ (the same layouts, blocking and order).
const TileKernels& amx_kernels();
const TileKernels& amx_emulated_kernels();
// The amx engine on emulated tiles with its AVX-512 BF16 vector parts; nullptr where the CPU
// lacks them (amx_emulated_kernels() picks it where it can).
const TileKernels* amx_emulated_tiles_avx512_kernels();
// The SAGE engine on AMX: Q.K^T with tdpbssd (int8 groups, int32 tiles), P.V on bf16 tiles
// (cpu/amx_int8_impl.hpp), and its twin on emulated tiles; the twin with the AVX-512 BF16
// vector parts, or nullptr where the CPU lacks them.
const TileKernels& amx_int8_kernels();
const TileKernels& amx_int8_emulated_kernels();
const TileKernels* amx_int8_emulated_tiles_avx512_kernels();

}  // namespace dattn::flash
