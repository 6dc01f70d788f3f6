// VIDEO_SPARSE: block-sparse attention over a video token layout (docs/semantics.md, "Video token
// layout and VIDEO_SPARSE") on FLASH's engines and their inner loops.
//
// A call: tile the sequence (cached per layout), select key blocks per (batch, head, query
// block), then for each (batch, KV head) convert that head's K and V rows once, in tile order,
// into one buffer: f32 rows for the f32 engines (so every selected block is a contiguous run of
// rows and neighbouring selected tiles merge into longer runs, cut into 64-key chunks per work
// item), each key block's tiles in the engine's format for the others; and run the engine's
// inner loop (flash/kernels.hpp, the contract) for each query block over its selected blocks
// only. Query rows are gathered from and written back to their sequence rows; padding rows
// output zero. The driver half shared with FLASH (item scratch, query and key-tile packing, SAGE's
// smoothing with qk_dtype int8, the parallel region) is flash/item_driver.hpp.
#include "backends/sparse/video_sparse.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <numbers>
#include <sstream>
#include <variant>

#include "backends/flash/engines.hpp"
#include "backends/flash/item_driver.hpp"
#include "backends/flash/kernels.hpp"
#include "backends/flash/tile_io.hpp"
#include "backends/flash/tile_plan.hpp"
#include "core/process_memory.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"
#include "dattn/video_sparse.hpp"

namespace dattn {

namespace sparse {
namespace {

using i64 = std::int64_t;
using flash::DriverThread;
using flash::ItemScratch;
using flash::ItemShape;
using flash::kBlockKeys;
using flash::kStridePad;
using flash::load_elements;
using flash::round_up;
using flash::ScratchLayout;
using flash::Smoothing;
using flash::TileKernels;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Rows of the per-thread query tile; larger query blocks run in several chunks.
constexpr i64 kMaxRows = 128;

class SparsePlan final : public Plan {
 public:
  SparsePlan(std::uint64_t signature, const TileKernels& k) : Plan(signature), kernels(k) {}
  std::string to_string() const override {
    std::ostringstream os;
    os << "VIDEO_SPARSE plan: engine " << kernels.engine << ", query chunks of up to " << kMaxRows
       << " rows, key chunks of " << kBlockKeys << ", " << threads
       << " thread(s), K/V of one head converted once per call ("
       << (kernels.formats.pack_k != nullptr
               ? "into the engine's tiles, " + std::to_string(k_tile_bytes + v_tile_bytes) +
                     " B per tile of up to " + std::to_string(kBlockKeys) + " keys of a block)"
               : std::to_string((ld_k + ld_v) * sizeof(float)) + " B per key row)");
    return os.str();
  }
  std::size_t scratch_bytes_per_thread() const override { return scratch_floats * sizeof(float); }
  std::string engine() const override { return std::string(kernels.engine); }

  const TileKernels& kernels;
  i64 dv_padded = 0, ld_k = 0, ld_v = 0;
  // Every work item's scratch (item_driver.hpp); engines with their own operand formats: the
  // bytes of one K and one V tile.
  ItemShape shape;
  std::size_t k_tile_bytes = 0, v_tile_bytes = 0;
  // SAGE's smoothing (qk_dtype int8 with smooth_k) per (batch item, KV head), with balance_qk,
  // and its rotation (rotate).
  bool smooth_k = false, balance_qk = false, rotate = false;
  int exact = 0;  // 16-bit integer lanes: the exact channels the smoothing moves to the end
  bool smoothing() const { return smooth_k || rotate; }
  int threads = 1;
  std::size_t scratch_floats = 0;
};

// One unit of work: up to kMaxRows valid query rows (tile positions) of one block and head.
struct Item {
  i64 head, qblock, first, count;  // rows: positions rows[first .. first + count)
};

// A run of packed key rows [j0, j0 + n).
struct Piece {
  i64 j0, n;
};

// Per-thread scratch: a work item's (item_driver.hpp) and, after it, a coarse output row and
// the key chunks' slots.
struct Tile {
  ItemScratch item;
  float* coarse;
  // One key chunk per slot (the f32 engines hold up to panel_tiles at once): its gathered f32
  // rows (K [kBlockKeys][ld_k], V [kBlockKeys][ld_v]) and which of them are visible. Engines
  // with their own operand format read the call's packed tiles and use slot 0 to stage them.
  struct Slot {
    float *k, *v;
    char* ok;
  };
  std::array<Slot, flash::kMaxPanelTiles> slots;
  // ld_k, ld_v: the packed rows' strides (gathered chunks keep them).
  static std::size_t floats(const ItemShape& shape, i64 ld_k, i64 ld_v, int slots) {
    ScratchLayout count;
    (void)carve(count, shape, ld_k, ld_v, slots);
    return count.floats();
  }
  static Tile carve(ScratchLayout& at, const ItemShape& shape, i64 ld_k, i64 ld_v, int slots) {
    Tile t{shape.carve(at), nullptr, {}};
    t.coarse = at.take(std::max(shape.d, shape.dv_padded));
    for (int n = 0; n < slots; ++n) {
      Slot& slot = t.slots[std::size_t(n)];
      slot.k = at.take(kBlockKeys * ld_k);
      slot.v = at.take(kBlockKeys * ld_v);
      slot.ok = reinterpret_cast<char*>(at.take(kBlockKeys / i64(sizeof(float)) + 1));
    }
    return t;
  }
};

// Everything one call needs, shared by the threads.
struct Call {
  const AttentionProblem& p;
  const SparsePlan& plan;
  const CallTiling& tiling;
  const BlockMap& map;
  const PooledBlocks* pooled;  // for the gate's coarse branch
  const std::optional<TensorView>& gate;
  float* k_packed;  // [used_k][ld_k], tile order, one KV head (f32 engines)
  float* v_packed;  // [used_k][ld_v]
  // Engines with their own operand format: one KV head's keys packed once per call in that
  // format, each key block in tiles of up to kBlockKeys keys (K then V, tile_bytes each);
  // block kb's tiles are [block_tile0[kb], block_tile0[kb + 1]).
  unsigned char* tiles = nullptr;
  std::size_t tile_bytes = 0;
  std::vector<i64> block_tile0;
  std::vector<char> key_ok;     // per key position of the batch item: visible
  std::vector<i64> rows;        // valid query positions, grouped by block
  std::vector<i64> block_row0;  // first entry of each query block in `rows`
  float qscale = 1;
  // SAGE's smoothing of the KV head being run (plan.smooth_k): the batch item's visible key
  // rows, the parts' sums, the smoothing (smooth_finish).
  std::vector<i64> visible_keys;
  std::vector<Smoothing::Sums> smooth_parts;
  Smoothing::Data smoothing;
  std::optional<Smoothing> smoothed;

  const TileKernels& kk() const { return plan.kernels; }

  bool own_format() const { return kk().formats.own(); }
  // This thread's tile scratch: the f32 engines' gathered chunks need a slot per tile the
  // engine holds; engines with their own format read the call's tiles and use slot 0's rows
  // only to stage pack_tiles.
  Tile carve(ScratchLayout& layout) const {
    return Tile::carve(layout, plan.shape, plan.ld_k, plan.ld_v,
                       own_format() ? 1 : kk().loop.panel_tiles);
  }

  // Converts key positions [pos0, pos1) of KV head hk of batch b into the packed buffers.
  void pack(i64 b, i64 hk, i64 pos0, i64 pos1) const {
    pack_rows(b, hk, pos0, pos1, k_packed + pos0 * plan.ld_k, v_packed + pos0 * plan.ld_v);
  }
  // Key block kb of KV head hk into its tiles in the engine's format, through the f32 rows of
  // one tile at `stage_k` / `stage_v` (kBlockKeys rows each).
  void pack_tiles(i64 b, i64 hk, std::size_t kb, float* stage_k, float* stage_v) const {
    const VideoBlock& block = tiling.keys.blocks()[kb];
    i64 tile = block_tile0[kb];
    for (i64 j0 = block.begin; j0 < block.end; j0 += kBlockKeys, ++tile) {
      const i64 n = std::min(kBlockKeys, block.end - j0);
      pack_rows(b, hk, j0, j0 + n, stage_k, stage_v);
      flash::pack_key_tile(kk(), stage_k, plan.ld_k, stage_v, plan.ld_v, n, p.d, plan.dv_padded,
                           plan.k_tile_bytes, smoothed ? &*smoothed : nullptr, 0, qscale,
                           tiles + std::size_t(tile) * tile_bytes);
    }
  }
  // SAGE's smoothing (item_driver.hpp, Smoothing) of KV head hk of batch item b, over its
  // visible keys (one run: the selected blocks gather keys from all over the grid) and the
  // valid query rows of its query heads, finite rows only, in parts that threads sum at once
  // (smooth_part), then added up (smooth_finish). smooth_keys() lists the batch item's visible
  // key rows first.
  void smooth_keys() {
    visible_keys.clear();
    for (i64 pos = 0; pos < i64(key_ok.size()); ++pos)
      if (key_ok[std::size_t(pos)]) visible_keys.push_back(tiling.keys.order()[std::size_t(pos)]);
  }
  void smooth_part(i64 b, i64 hk, std::size_t part, float* row) {
    const i64 parts = i64(smooth_parts.size()), group = p.group_size(), nq = i64(rows.size());
    const i64 keys = i64(visible_keys.size()), queries = group * nq;
    Smoothing::Sums& sums = smooth_parts[part];
    sums.reset(p.d, 1);
    const i64 n = i64(part);
    for (i64 j = keys * n / parts; j < keys * (n + 1) / parts; ++j) {
      const RowRef kr = p.k_row(visible_keys[std::size_t(j)]);
      const TensorView& kt = *kr.view;
      load_elements(kk(), kt, b * kt.stride(0) + kr.row * kt.stride(1) + hk * kt.stride(2), p.d,
                    1.0f, row);
      sums.key(row, p.d, 0);
    }
    for (i64 i = queries * n / parts; i < queries * (n + 1) / parts; ++i) {  // head by head
      const i64 h = hk * group + i / nq;
      const RowRef qr = p.q_row(tiling.queries.order()[std::size_t(rows[std::size_t(i % nq)])]);
      const TensorView& q = *qr.view;
      load_elements(kk(), q, b * q.stride(0) + qr.row * q.stride(1) + h * q.stride(2), p.d, 1.0f,
                    row);
      sums.query(row, p.d);
    }
  }
  void smooth_finish() {
    Smoothing::Sums& total = smooth_parts[0];
    for (std::size_t n = 1; n < smooth_parts.size(); ++n) total.add(smooth_parts[n]);
    if (plan.smooth_k)
      Smoothing::finish(total, smoothing, p.d, plan.balance_qk, plan.exact);
    else
      smoothing.identity(p.d, 1);
    smoothing.rotate = plan.rotate;
    smoothed = smoothing.view(p.d);
  }

  // Key positions [pos0, pos1) as f32 rows from kd0 / vd0 on (strides ld_k / ld_v).
  void pack_rows(i64 b, i64 hk, i64 pos0, i64 pos1, float* kd0, float* vd0) const {
    const i64 d = p.d, dv = p.dv;
    for (i64 pos = pos0; pos < pos1; ++pos) {
      float* kd = kd0 + (pos - pos0) * plan.ld_k;
      float* vd = vd0 + (pos - pos0) * plan.ld_v;
      if (!key_ok[std::size_t(pos)]) {  // hidden: zeros, so that 0-weights never meet a NaN
        std::fill(kd, kd + plan.ld_k, 0.0f);
        std::fill(vd, vd + plan.ld_v, 0.0f);
        continue;
      }
      const i64 row = tiling.keys.order()[std::size_t(pos)];
      const RowRef kr = p.k_row(row), vr = p.v_row(row);
      const TensorView& kt = *kr.view;
      const TensorView& vt = *vr.view;
      load_elements(kk(), kt, b * kt.stride(0) + kr.row * kt.stride(1) + hk * kt.stride(2), d, 1.0f,
                    kd);
      std::fill(kd + d, kd + plan.ld_k, 0.0f);
      load_elements(kk(), vt, b * vt.stride(0) + vr.row * vt.stride(1) + hk * vt.stride(2), dv,
                    1.0f, vd);
      std::fill(vd + dv, vd + plan.ld_v, 0.0f);
    }
  }

  // The chunks of one item as the engine's key tiles (flash::ItemKeys); KeyTile::j0 is the
  // slot that holds the chunk.
  struct SelectedChunks {
    const Call& call;
    Tile& s;
    const std::vector<Piece>& pieces;
    const std::vector<std::pair<std::size_t, std::size_t>>& chunks;  // [first, end) pieces
    int rows;
    std::size_t c = 0;  // the next chunk
    std::array<flash::KeyTile, flash::kMaxPanelTiles> ring{};

    void prefetch_chunk(std::size_t n) const {
      for (std::size_t i = chunks[n].first; i < chunks[n].second; ++i)
        call.prefetch(pieces[i].j0, pieces[i].n);
    }
    static const flash::KeyTile* next(void* ctx, int n) {
      auto& t = *static_cast<SelectedChunks*>(ctx);
      const Call& call = t.call;
      const SparsePlan& plan = call.plan;
      const int slot_index = n % call.kk().loop.panel_tiles;
      Tile::Slot& slot = t.s.slots[std::size_t(slot_index)];
      for (; t.c < t.chunks.size();) {
        const std::size_t c = t.c++;
        if (c + 2 < t.chunks.size()) t.prefetch_chunk(c + 2);
        i64 keys = 0;
        for (std::size_t i = t.chunks[c].first; i < t.chunks[c].second; ++i) {
          const Piece& piece = t.pieces[i];
          std::copy_n(call.k_packed + piece.j0 * plan.ld_k, piece.n * plan.ld_k,
                      slot.k + keys * plan.ld_k);
          std::copy_n(call.v_packed + piece.j0 * plan.ld_v, piece.n * plan.ld_v,
                      slot.v + keys * plan.ld_v);
          std::copy_n(call.key_ok.data() + piece.j0, piece.n, slot.ok + keys);
          keys += piece.n;
        }
        bool any = false, all = true;
        for (i64 jj = 0; jj < keys; ++jj) {
          any = any || slot.ok[jj];
          all = all && slot.ok[jj];
        }
        if (!any) continue;
        flash::KeyTile& tile = t.ring[std::size_t(slot_index)];
        tile = {slot.k, slot.v, int(keys), !all, slot_index};
        return &tile;
      }
      return nullptr;
    }
    static void logits(void* ctx, const flash::KeyTile& tile, float* st, i64 rs, i64 ks) {
      auto& t = *static_cast<SelectedChunks*>(ctx);
      const char* ok = t.s.slots[std::size_t(tile.j0)].ok;
      for (i64 jj = 0; jj < tile.keys; ++jj)
        if (!ok[jj])
          for (i64 r = 0; r < t.rows; ++r) st[r * rs + jj * ks] = kNegInf;
    }
  };

  // The selected key blocks of one item as tiles packed once per call (engines with their own
  // operand format): no gathering or packing per item. KeyTile::j0 is the tile's first key
  // position; tiles without a visible key are left out.
  struct TileRef {
    i64 tile, j0, n;
    bool all;  // every key visible
  };
  struct SelectedTiles {
    const Call& call;
    const std::vector<TileRef>& refs;
    int rows;
    std::array<flash::KeyTile, flash::kMaxPanelTiles> ring{};

    const unsigned char* at(std::size_t n) const {
      return call.tiles + std::size_t(refs[n].tile) * call.tile_bytes;
    }
    static const flash::KeyTile* next(void* ctx, int n) {
      auto& t = *static_cast<SelectedTiles*>(ctx);
      if (std::size_t(n) >= t.refs.size()) return nullptr;
      // No software prefetch: each tile is 2 x 16 KiB or so of contiguous bytes, which the
      // hardware streams; a whole tile's prefetches two tiles ahead measured no better.
      const TileRef& r = t.refs[std::size_t(n)];
      const unsigned char* k = t.at(std::size_t(n));
      flash::KeyTile& tile = t.ring[std::size_t(n % t.call.kk().loop.panel_tiles)];
      tile = {k, k + t.call.plan.k_tile_bytes, int(r.n), !r.all, r.j0};
      return &tile;
    }
    static void logits(void* ctx, const flash::KeyTile& tile, float* st, i64 rs, i64 ks) {
      auto& t = *static_cast<SelectedTiles*>(ctx);
      const char* ok = t.call.key_ok.data() + tile.j0;
      for (i64 jj = 0; jj < tile.keys; ++jj)
        if (!ok[jj])
          for (i64 r = 0; r < t.rows; ++r) st[r * rs + jj * ks] = kNegInf;
    }
  };

  void process(i64 b, const Item& it, float* scratch) const {
    const i64 d = p.d, nrows = it.count;
    ScratchLayout layout(scratch);
    Tile s = carve(layout);
    const i64 h = it.head;
    const i64* positions = rows.data() + it.first;
    const auto load_query = [&](i64 r, float* dst, float scale) {  // row r: positions[r]
      const RowRef qr = p.q_row(tiling.queries.order()[std::size_t(positions[r])]);
      const TensorView& q = *qr.view;
      load_elements(kk(), q, b * q.stride(0) + qr.row * q.stride(1) + h * q.stride(2), d, scale,
                    dst);
    };
    const Smoothing* sm = smoothed ? &*smoothed : nullptr;
    const flash::ItemState state = flash::begin_item(kk(), plan.shape, s.item, nrows, plan.ld_k,
                                                     plan.ld_v, qscale, sm, load_query);

    const auto& kblocks = tiling.keys.blocks();
    const auto selected = map.selected(b, h, it.qblock);
    if (own_format()) {
      thread_local std::vector<TileRef> refs;
      refs.clear();
      for (const std::int32_t kb : selected) {
        const VideoBlock& block = kblocks[std::size_t(kb)];
        i64 tile = block_tile0[std::size_t(kb)];
        for (i64 j0 = block.begin; j0 < block.end; j0 += kBlockKeys, ++tile) {
          const i64 n = std::min(kBlockKeys, block.end - j0);
          const char* ok = key_ok.data() + j0;
          const bool any = std::find(ok, ok + n, 1) != ok + n;
          if (any) refs.push_back({tile, j0, n, std::find(ok, ok + n, 0) == ok + n});
        }
      }
      SelectedTiles produce{*this, refs, int(nrows)};
      flash::attend(kk(), {&SelectedTiles::next, &SelectedTiles::logits, &produce}, state);
    } else {
      attend_chunks(selected, s, int(nrows), state);
    }
    flash::end_item(s.item, nrows, sm);

    const bool gated = gate.has_value();
    if (gated) coarse(b, h, it.qblock, s.coarse);
    const flash::OutputRows out(p, kk());
    for (i64 r = 0; r < nrows; ++r) {
      const i64 row = tiling.queries.order()[std::size_t(positions[r])];
      float* o_row = s.item.o + r * s.item.ld_o;
      const float m = s.item.m[r], l = s.item.l[r];
      if (gated && l > 0.0f) {  // fine / l + gate * coarse, then written as it is
        add_gated(b, h, row, 1.0f / l, o_row, s.coarse);
        out.finish(o_row, m, l, b, h, row, 1.0f);
      } else {
        out.finish(o_row, m, l, b, h, row);
      }
    }
  }

  // The f32 engines' inner loop over the selected blocks of one item, gathered into chunks.
  void attend_chunks(std::span<const std::int32_t> selected, Tile& s, int nrows,
                     const flash::ItemState& state) const {
    const auto& kblocks = tiling.keys.blocks();
    // Chunks of at most kBlockKeys packed rows; neighbouring selected blocks are one run.
    // The selected runs are cut and packed into chunks of kBlockKeys keys (the last one
    // shorter), each copied from the packed buffer into scratch before the kernels run on it:
    // selected blocks lie anywhere in tens of MiB, and one sequential copy per chunk (which the
    // hardware streams, helped by a software prefetch two chunks ahead) costs less than the
    // kernels' strided first touches of rows in memory (44 -> 64 GFLOP/s on one thread of
    // wan-480p top-k). Short clipped tiles, which top-k favours, share chunks.
    thread_local std::vector<Piece> pieces;
    thread_local std::vector<std::pair<std::size_t, std::size_t>> chunks;  // [first, end) pieces
    pieces.clear(), chunks.clear();
    i64 filled = kBlockKeys;
    for (std::size_t n = 0; n < selected.size();) {
      const i64 begin = kblocks[std::size_t(selected[n])].begin;
      i64 end = kblocks[std::size_t(selected[n])].end;
      for (++n; n < selected.size() && kblocks[std::size_t(selected[n])].begin == end; ++n)
        end = kblocks[std::size_t(selected[n])].end;
      for (i64 j0 = begin; j0 < end;) {
        if (filled == kBlockKeys) {
          chunks.push_back({pieces.size(), pieces.size()});
          filled = 0;
        }
        const i64 take = std::min(kBlockKeys - filled, end - j0);
        pieces.push_back({j0, take});
        chunks.back().second = pieces.size();
        filled += take;
        j0 += take;
      }
    }
    // The engine's inner loop (flash/kernels.hpp, the contract) over the chunks, produced one
    // by one: gathered, chunks with no visible key skipped, and the hook hiding the keys a
    // chunk holds but may not show.
    SelectedChunks produce{*this, s, pieces, chunks, nrows};
    const flash::ItemKeys keys{&SelectedChunks::next, &SelectedChunks::logits, &produce};
    if (chunks.size() > 1) produce.prefetch_chunk(1);
    flash::attend(kk(), keys, state);
  }

  // Asks for packed rows [j0, j0 + n) of K and V while the current chunk computes.
  void prefetch(i64 j0, i64 n) const {
    const auto* k = reinterpret_cast<const char*>(k_packed + j0 * plan.ld_k);
    const auto* v = reinterpret_cast<const char*>(v_packed + j0 * plan.ld_v);
    for (i64 off = 0; off < n * plan.ld_k * i64(sizeof(float)); off += 64)
      __builtin_prefetch(k + off, 0, 2);
    for (i64 off = 0; off < n * plan.ld_v * i64(sizeof(float)); off += 64)
      __builtin_prefetch(v + off, 0, 2);
  }

  // softmax(pooled q . pooled k x scale) . pooled V over the key blocks with valid keys.
  void coarse(i64 b, i64 h, i64 qb, float* out) const {
    const i64 nq = pooled->qblocks, nk = pooled->kblocks, hk = h / p.group_size();
    std::fill(out, out + p.dv, 0.0f);
    const float* pq = pooled->q.data() + ((b * p.hq + h) * nq + qb) * p.d;
    double mx = -std::numeric_limits<double>::infinity();
    std::vector<double> score(std::size_t(nk), -std::numeric_limits<double>::infinity());
    for (i64 kb = 0; kb < nk; ++kb) {
      if (pooled->k_rows[std::size_t(b * nk + kb)] == 0) continue;
      const float* pk = pooled->k.data() + ((b * p.hkv + hk) * nk + kb) * p.d;
      double sc = 0;
      for (i64 e = 0; e < p.d; ++e) sc += double(pq[e]) * pk[e];
      score[std::size_t(kb)] = sc * p.softmax_scale;
      mx = std::max(mx, score[std::size_t(kb)]);
    }
    if (mx == -std::numeric_limits<double>::infinity()) return;
    double sum = 0;
    std::vector<double> acc(std::size_t(p.dv), 0.0);
    for (i64 kb = 0; kb < nk; ++kb) {
      if (score[std::size_t(kb)] == -std::numeric_limits<double>::infinity()) continue;
      const double w = std::exp(score[std::size_t(kb)] - mx);
      sum += w;
      const float* pv = pooled->v.data() + ((b * p.hkv + hk) * nk + kb) * p.dv;
      for (i64 e = 0; e < p.dv; ++e) acc[std::size_t(e)] += w * pv[e];
    }
    for (i64 e = 0; e < p.dv; ++e) out[e] = static_cast<float>(acc[std::size_t(e)] / sum);
  }

  // o_row = o_row * inv + gate(b, row, h) * coarse.
  void add_gated(i64 b, i64 h, i64 row, float inv, float* o_row, const float* c) const {
    const TensorView& g = *gate;
    const i64 base = b * g.stride(0) + row * g.stride(1) + h * g.stride(2);
    const i64 step = g.ndim() == 4 ? g.stride(3) : 0;
    for (i64 e = 0; e < p.dv; ++e)
      o_row[e] = o_row[e] * inv + load_as_f32(g.data(), g.dtype(), base + e * step) * c[e];
  }

  void write_zero(i64 b, i64 h, i64 i) const { flash::OutputRows(p, kk()).write_zero(b, h, i); }
};

void check_gate(const TensorView& g, const AttentionProblem& p) {
  const bool rank_ok = g.ndim() == 3 || (g.ndim() == 4 && g.size(3) == p.dv);
  if (!rank_ok || g.size(0) != p.batch || g.size(1) != p.sq || g.size(2) != p.hq ||
      !is_float_input_dtype(g.dtype()))
    throw InvalidArgument("gate", "gate: got " + g.describe() + "; valid: [" +
                                      std::to_string(p.batch) + ", " + std::to_string(p.sq) + ", " +
                                      std::to_string(p.hq) + "] or [..., " + std::to_string(p.dv) +
                                      "] of f32, bf16 or f16");
}

class VideoSparseImpl final : public Impl {
 public:
  VideoSparseImpl(const Backend& backend, const ImplConfig& config)
      : Impl(backend, config),
        cap_(flash::options_cap(config.backend_kwargs, "VIDEO_SPARSE")),
        compute_(flash::parse_compute_dtype(config.backend_kwargs)) {
    (void)VideoSparseOptions::from(config.backend_kwargs, nullptr);  // bad options fail here
    // qk_dtype (SAGE's meaning): int8, the selected blocks on SAGE's engines (8-bit Q.K^T, P.V
    // by pv_dtype, K smoothed per batch item and KV head by smooth_k and balance_qk as SAGE's);
    // int16 (as compute_dtype int16), on the 16-bit integer-lane engines (K smoothed, the
    // channels of largest spread exact, no rotation unless asked); f32, compute_dtype f32;
    // auto, compute_dtype's.
    const std::optional<flash::ComputeDtype> qk =
        flash::parse_qk_dtype(config.backend_kwargs, true);
    if (qk) compute_ = *qk;
    const bool integer =
        compute_ == flash::ComputeDtype::int8 || compute_ == flash::ComputeDtype::int16;
    if (integer) {
      smooth_k_ = flash::parse_bool_option(config.backend_kwargs, "smooth_k");
      balance_qk_ = flash::parse_bool_option(config.backend_kwargs, "balance_qk");
      rotate_ = flash::parse_bool_option(
          config.backend_kwargs, "rotate",
          flash::kRotateByDefault && compute_ == flash::ComputeDtype::int8);
    }
    if (compute_ == flash::ComputeDtype::int8) {
      pv_ = flash::parse_pv_dtype(config.backend_kwargs);
      (void)flash::int8_engine_kernels(
          flash::select_engine(cap_, DType::F32, flash::ComputeDtype::int8), pv_);
    } else if (compute_ == flash::ComputeDtype::int16) {
      pv_ = flash::parse_pv_dtype(config.backend_kwargs);
      if (pv_ != flash::PvDtype::automatic && pv_ != flash::PvDtype::int16)
        throw InvalidArgument("pv_dtype",
                              "backend option pv_dtype: with qk_dtype int16 P.V runs on 16-bit "
                              "integer codes; valid: auto, int16");
    }
  }

  std::unique_ptr<Plan> plan(const AttentionProblem& p) const override {
    // One key range per batch item (the claims exclude several documents; this guards it).
    for (std::size_t a = 0; a < p.segments.size(); ++a)
      for (std::size_t c = a + 1; c < p.segments.size(); ++c)
        if (p.segments[a].batch == p.segments[c].batch &&
            (p.segments[a].k_begin != p.segments[c].k_begin ||
             p.segments[a].k_end != p.segments[c].k_end))
          throw Unsupported("supports_multi_doc_packed_varlen",
                            "backend VIDEO_SPARSE needs one key range per batch item");
    // FLASH's engines, chosen the same way (the isa option or DATTN_ISA, compute_dtype, the
    // operands' dtype).
    const flash::Engine& engine = flash::select_engine(cap_, flash::operand_dtype(p), compute_);
    auto plan =
        std::make_unique<SparsePlan>(p.signature, engine.compute == flash::ComputeDtype::int8
                                                      ? flash::int8_engine_kernels(engine, pv_)
                                                      : engine.kernels());
    const TileKernels& kk = plan->kernels;
    plan->dv_padded = round_up(std::max<i64>(p.dv, 1), kk.col_align);
    plan->ld_k = round_up(p.d, 16) + kStridePad;
    plan->ld_v = plan->dv_padded + kStridePad;
    plan->threads = std::max(p.threads, 1);
    plan->shape = ItemShape::of(kk, kMaxRows, p.d, plan->dv_padded);
    if (kk.formats.own()) {
      plan->k_tile_bytes = kk.formats.k_tile_bytes(int(p.d));
      plan->v_tile_bytes = kk.formats.v_tile_bytes(int(plan->dv_padded));
    }
    const bool integer =
        engine.compute == flash::ComputeDtype::int8 || engine.compute == flash::ComputeDtype::int16;
    plan->smooth_k = integer && smooth_k_ && kk.formats.own();
    plan->balance_qk = plan->smooth_k && balance_qk_;
    plan->rotate = integer && rotate_ && kk.formats.own();
    plan->exact = flash::smoothing_exact_channels(engine, plan->rotate, p.d);
    plan->scratch_floats = Tile::floats(plan->shape, plan->ld_k, plan->ld_v,
                                        kk.formats.own() ? 1 : kk.loop.panel_tiles);
    return plan;
  }

 protected:
  void run_cpu(const Plan& base, const AttentionProblem& p) const override {
    const auto& plan = static_cast<const SparsePlan&>(base);
    const VideoSparseOptions o =
        VideoSparseOptions::from(config().backend_kwargs, p.backend_options);
    if (o.gate) check_gate(*o.gate, p);
    const std::shared_ptr<const CallTiling> tiling = tiling_for(p, o);
    const CallTiling& t = *tiling;
    std::optional<PooledBlocks> pooled;
    if (o.selection == BlockSelection::topk || o.gate)
      pooled = pool_blocks(p, t, o.gate.has_value());
    const BlockMap map = select_blocks(p, t, o, pooled ? &*pooled : nullptr);

    // This call's packed K/V buffer of one head (tens of MiB for a video), leased from the
    // process's buffers (core/process_memory.hpp: shared by every layer, concurrent calls each
    // get their own and never wait for each other's; in huge pages, since top-k reads it in
    // scattered blocks and 4 KiB pages would cost a TLB miss on nearly every page touched).
    // f32 engines: f32 rows; engines with their own format: each key block's tiles.
    const i64 used_k = t.keys.used_len();
    const auto& qblocks = t.queries.blocks();
    const auto& kblocks = t.keys.blocks();
    const bool own_format = plan.kernels.formats.own();
    std::vector<i64> block_tile0(kblocks.size() + 1, 0);
    for (std::size_t kb = 0; kb < kblocks.size(); ++kb)
      block_tile0[kb + 1] =
          block_tile0[kb] + (kblocks[kb].end - kblocks[kb].begin + kBlockKeys - 1) / kBlockKeys;
    const std::size_t tile_bytes = plan.k_tile_bytes + plan.v_tile_bytes;
    const detail::ProcessMemory::Lease lease = detail::ProcessMemory::instance().lease(
        own_format ? std::size_t(block_tile0.back()) * tile_bytes
                   : std::size_t(used_k * (plan.ld_k + plan.ld_v)) * sizeof(float));
    float* packed = lease.as<float>();
    Call call{p,      plan,    t,       map,         pooled ? &*pooled : nullptr,
              o.gate, nullptr, nullptr, nullptr,     0,
              {},     {},      {},      {},          1.0f,
              {},     {},      {},      std::nullopt};
    if (own_format) {
      call.tiles = reinterpret_cast<unsigned char*>(packed);
      call.tile_bytes = tile_bytes;
      call.block_tile0 = std::move(block_tile0);
    } else {
      call.k_packed = packed;
      call.v_packed = packed + used_k * plan.ld_k;
    }
    call.qscale = static_cast<float>(p.softmax_scale);
    for (i64 b = 0; b < p.batch; ++b) {
      // Valid query rows (inside a segment, used), visible keys (key range, mask).
      std::vector<char> q_ok(std::size_t(p.sq), 0);
      call.key_ok.assign(std::size_t(used_k), 0);
      for (const Segment& s : p.segments) {
        if (s.batch != b) continue;
        for (i64 i = s.q_begin; i < s.q_end; ++i)
          q_ok[std::size_t(i)] = !p.zero_masked_query_rows || p.mask.keeps_key(b, i);
        for (i64 j = s.k_begin; j < std::min(s.k_end, used_k); ++j)
          call.key_ok[std::size_t(t.keys.position()[std::size_t(j)])] = p.mask.keeps_key(b, j);
      }
      for (i64 i = 0; i < p.sq; ++i)
        if (!q_ok[std::size_t(i)] || t.queries.position()[std::size_t(i)] >= t.queries.used_len())
          for (i64 h = 0; h < p.hq; ++h) call.write_zero(b, h, i);
      call.rows.clear();
      call.block_row0.assign(qblocks.size() + 1, 0);
      for (std::size_t qb = 0; qb < qblocks.size(); ++qb) {
        call.block_row0[qb] = static_cast<i64>(call.rows.size());
        for (i64 pos = qblocks[qb].begin; pos < qblocks[qb].end; ++pos)
          if (q_ok[std::size_t(t.queries.order()[std::size_t(pos)])]) call.rows.push_back(pos);
      }
      call.block_row0[qblocks.size()] = static_cast<i64>(call.rows.size());
      if (plan.smoothing()) {
        call.smooth_keys();
        call.smooth_parts.resize(std::size_t(2 * plan.threads));
      }
      for (i64 hk = 0; hk < p.hkv; ++hk) {
        const std::vector<Item> items = items_for(call, b, hk);
        const auto count = static_cast<i64>(items.size());
        const auto nkb = static_cast<i64>(kblocks.size());
        // One fault-guarded region (item_driver.hpp): the smoothing, this head's K/V, its items.
        flash::run_parallel(plan.threads, plan.scratch_floats, 0, [&](DriverThread& thread) {
          if (plan.smoothing()) {
            thread.loop(0, i64(call.smooth_parts.size()), 1, [&](i64 part) {
              call.smooth_part(b, hk, std::size_t(part), thread.scratch());
            });
            thread.loop(0, 1, 1, [&](i64) { call.smooth_finish(); });
          }
          thread.loop(0, nkb, 4, [&](i64 kb) {
            if (own_format) {
              ScratchLayout layout(thread.scratch());
              const Tile stage = call.carve(layout);
              call.pack_tiles(b, hk, std::size_t(kb), stage.slots[0].k, stage.slots[0].v);
            } else {
              call.pack(b, hk, kblocks[std::size_t(kb)].begin, kblocks[std::size_t(kb)].end);
            }
          });
          thread.with_engine(plan.kernels, [&] {
            thread.loop(0, count, 1,
                        [&](i64 n) { call.process(b, items[std::size_t(n)], thread.scratch()); });
          });
        });
      }
    }
  }

 private:
  // The work of KV head hk: every (query head of its group, query block, chunk), the blocks
  // that see the most keys first so that dynamic scheduling ends evenly.
  static std::vector<Item> items_for(const Call& c, i64 b, i64 hk) {
    std::vector<std::pair<i64, Item>> weighted;
    const auto& kblocks = c.tiling.keys.blocks();
    const i64 group = c.p.group_size();
    for (i64 h = hk * group; h < (hk + 1) * group; ++h)
      for (std::size_t qb = 0; qb + 1 < c.block_row0.size(); ++qb) {
        i64 keys = 0;
        for (std::int32_t kb : c.map.selected(b, h, i64(qb)))
          keys += kblocks[std::size_t(kb)].size();
        for (i64 r = c.block_row0[qb]; r < c.block_row0[qb + 1]; r += kMaxRows) {
          const i64 n = std::min(kMaxRows, c.block_row0[qb + 1] - r);
          weighted.push_back({keys * n, Item{h, i64(qb), r, n}});
        }
      }
    std::stable_sort(weighted.begin(), weighted.end(),
                     [](const auto& a, const auto& z) { return a.first > z.first; });
    std::vector<Item> items;
    items.reserve(weighted.size());
    for (const auto& w : weighted) items.push_back(w.second);
    return items;
  }

  // Tilings are computed once per (layout, lengths, tile, dense block) and reused by every
  // denoising step and layer that runs this impl.
  std::shared_ptr<const CallTiling> tiling_for(const AttentionProblem& p,
                                               const VideoSparseOptions& o) const {
    Key key{p.video_layout ? std::optional(*p.video_layout) : std::nullopt, p.sq, p.skv, o.tile,
            o.dense_block};
    std::lock_guard lock(cache_mutex_);
    for (const auto& [k, v] : cache_)
      if (k == key) return v;
    auto made = std::make_shared<const CallTiling>(tile_call(p, o));
    if (cache_.size() >= 8) cache_.erase(cache_.begin());
    cache_.emplace_back(std::move(key), made);
    return made;
  }

  struct Key {
    std::optional<VideoTokenLayout> layout;
    i64 sq, skv;
    TileShape tile;
    i64 dense_block;
    bool operator==(const Key&) const = default;
  };

  // The f32 engine at or below DATTN_ISA's cap (VIDEO_SPARSE's tiles use no engine workspace).
  const flash::Engine* cap_;  // nullptr: automatic
  flash::ComputeDtype compute_;
  flash::PvDtype pv_ = flash::PvDtype::automatic;
  bool smooth_k_ = true, balance_qk_ = true;  // with an integer qk_dtype
  bool rotate_ = flash::kRotateByDefault;     // with an integer qk_dtype
  mutable std::mutex cache_mutex_;
  mutable std::vector<std::pair<Key, std::shared_ptr<const CallTiling>>> cache_;
};

// Approximate; no causal calls and no 3-D/4-D masks (key padding only).
BackendCapabilities video_sparse_capabilities() {
  BackendCapabilities c;
  c.exact = false;
  c.accept_output_buffer = true;
  c.supports_causal = false;
  c.supports_dense_attention_mask = false;
  c.supports_attention_mask = true;
  c.supported_platforms = std::vector<Platform>{Platform::cpu};
  return c;
}

class VideoSparseBackend final : public Backend {
 public:
  VideoSparseBackend() : Backend(video_sparse_capabilities()) {}
  std::string name() const override { return "VIDEO_SPARSE"; }
  std::string description() const override {
    return "block-sparse video attention over the video token layout (sliding tile, top-k, "
           "explicit maps) on FLASH's kernels; approximate, chosen only explicitly";
  }
  int priority() const override { return 10; }
  void validate_configuration() const override { (void)flash::process_cap(); }
  void validate_available() const override { (void)flash::process_cap(); }
  std::unique_ptr<Impl> make_impl(const ImplConfig& config) const override {
    return std::make_unique<VideoSparseImpl>(*this, config);
  }
  std::optional<std::vector<std::string>> option_names() const override {
    return std::vector<std::string>{
        "selection", "tile",      "window",        "dense_block",  "topk",  "sparsity",
        "gate",      "block_map", "block_indices", "block_counts", "isa",   "compute_dtype",
        "qk_dtype",  "pv_dtype",  "smooth_k",      "balance_qk",   "rotate"};
  }
};

}  // namespace
}  // namespace sparse

std::shared_ptr<const Backend> make_video_sparse_backend() {
  return std::make_shared<sparse::VideoSparseBackend>();
}

}  // namespace dattn
