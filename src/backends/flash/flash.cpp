// FLASH: tiled online-softmax attention (the FlashAttention-2 algorithm) on the CPU.
//
// plan(): splits the problem's segments into work items (a block of query rows x the heads of
// one GQA group, which share K/V tiles), splits key ranges when there are few items (a cut
// that depends on the problem, never on the thread count), and sizes the per-thread scratch.
// run(): all threads pack a wave's K/V panels (once per call, in the engine's format), then take
// its work items; each packs its Q rows once (transposed; pre-scaled by the softmax scale for
// the f32 engines) and hands the engine's inner loop (kernels.hpp, the contract) the key tiles
// its rows can see: causal/piecewise limits are per-row key prefixes, so tiles past every row's
// limit are never produced, nor tiles a mask hides entirely; the others ask for the logits hook
// (hide) where positions or a mask act on some of their keys. Split items are merged by LSE at
// the end. The engine is chosen per plan from the cap (DATTN_ISA or the isa option), the input
// dtype and the compute_dtype option (engines.hpp).
#include "backends/flash/flash.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <numbers>
#include <optional>
#include <sstream>
#include <variant>
#include <vector>

#include "backends/flash/engines.hpp"
#include "backends/flash/item_driver.hpp"
#include "backends/flash/kernels.hpp"
#include "backends/flash/tile_io.hpp"
#include "backends/flash/tile_plan.hpp"
#include "core/kv_quant.hpp"
#include "core/paged_problem.hpp"
#include "core/process_memory.hpp"
#include "core/threads.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/errors.hpp"
#include "dattn/paged.hpp"

namespace dattn {

namespace flash {
namespace {

using i64 = std::int64_t;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct WorkItem {
  std::size_t segment;
  std::size_t group = 0;  // its K/V panel group (segment, KV head): PanelGroup
  i64 q0, q1;             // query rows
  i64 h0, h1;             // query heads, inside one KV group
  // Split-KV: this item covers keys [k0, k1) of the segment and leaves its unnormalised
  // (O, m, l) in partial slot `partial` for the merge; -1 = whole key range, writes the output.
  i64 k0 = 0, k1 = std::numeric_limits<i64>::max();
  i64 partial = -1;
};

// The split items of one query block, merged after they all ran.
struct MergeGroup {
  WorkItem rows;      // the query block (rows and heads)
  i64 first_partial;  // its slots: [first_partial, first_partial + splits)
  i64 splits;
};

// What SAGE knows of one panel group's rows before it packs them (Worker::prepare): which of
// its keys some computed query row of the group can see (empty: all of them; the others are
// packed as zeros, so that neither their codes' scales nor the statistics see what they hold),
// and the smoothing (item_driver.hpp, Smoothing) with plan.smooth_k.
struct GroupStats {
  std::vector<char> seen;
  Smoothing::Data smoothing;
};

struct PaddingRows {
  i64 batch, i0, i1;
};

// The keys of one (segment, KV head), packed once per call into kBlockKeys-key tiles of the
// engine's format (kernels.hpp, "K and V panels"); `offset` is its first tile's byte offset in
// its wave's panel buffer.
struct PanelGroup {
  std::size_t segment;
  i64 hk, tiles;
  std::size_t offset;
  i64 spare = 0;  // SAGE: slots after the tiles for the second copies of split tiles
};

// Consecutive panel groups whose panels fit kPanelBudget together, and the work items that read
// them: a run packs a wave's panels (all threads), then runs its items (all threads).
struct Wave {
  std::size_t group_begin, group_end;
  i64 item_begin, item_end;
  i64 tile_begin, tile_end;  // into FlashPlan::panel_tiles
};
// Panel bytes per wave: K and V of about 220k keys of D 128 in f32, 440k in bf16.
constexpr std::size_t kPanelBudget = std::size_t(64) << 20;

class FlashPlan final : public Plan {
 public:
  FlashPlan(std::uint64_t signature, const Engine& engine, const TileKernels& engine_kernels)
      : Plan(signature), chosen(engine), kernels(engine_kernels) {}

  std::string to_string() const override {
    std::ostringstream os;
    std::size_t panel_bytes = 0;
    for (const Wave& w : waves) panel_bytes = std::max(panel_bytes, wave_bytes(w));
    os << "FLASH plan: engine " << kernels.engine << " (" << compute_dtype_name(chosen.compute)
       << " compute), " << items.size() << " work items of up to " << block.rows_per_head
       << " rows x " << block.heads << " heads, key tiles of " << kBlockKeys << ", " << threads
       << " thread(s), " << scratch_floats * sizeof(float) / 1024 << " KiB scratch per thread, K/V "
       << "packed once per call into " << groups.size() << " panel(s) in " << waves.size()
       << " wave(s) of up to " << (panel_bytes + 1023) / 1024 << " KiB";
    if (!merges.empty())
      os << ", split-KV: " << merges.size() << " query blocks x " << merges[0].splits
         << " key ranges";
    if (chosen.compute == ComputeDtype::int16)
      os << ", Q and K as 13-bit codes per row and key in 16-bit integer lanes with "
         << int16_exact_channels(int(head_size)) << " exact channels"
         << (smooth_k ? ", K smoothed" : "") << (balance_qk ? ", channels balanced" : "")
         << (rotate ? ", rotated" : "") << ", P.V in 16-bit integers";
    if (chosen.compute == ComputeDtype::int8)
      os << ", Q and K as int8 per row and key" << (smooth_k ? ", K smoothed" : "")
         << (balance_qk ? ", channels balanced" : "") << (rotate ? ", rotated" : "")
         << (pv_int_bits == 8    ? ", P.V in 8 bits on "
             : pv_int_bits == 16 ? ", P.V in 16-bit integers on "
                                 : ", P.V on ")
         << (!kernels.loop.tile_by_tile() ? std::string("bf16 tiles")
                                          : std::string(kernels.engine));
    return os.str();
  }

  // The engine that runs (SAGE's pv_dtype f32 on amx_int8 runs avx512_vnni's kernels).
  std::string engine() const override { return std::string(kernels.engine); }
  std::size_t scratch_bytes_per_thread() const override {
    return scratch_floats * sizeof(float) +
           std::size_t(block.heads * block.rows_per_head) * sizeof(i64);
  }

  const Engine& chosen;
  const TileKernels& kernels;
  // SAGE: each (segment, KV head)'s mean key is subtracted before K is quantized (softmax
  // ignores it; the LSE gets it back), docs/semantics.md "SAGE".
  bool smooth_k = false;
  bool balance_qk = false;  // and each channel balanced between Q and K (SmoothQuant)
  bool rotate = false;      // Q and K turned by rotation:: (item_driver.hpp) before their codes
  bool smoothing() const { return smooth_k || rotate; }
  // The engine computes on integers (SAGE's int8, or 16-bit lanes): its statistics and
  // smoothing run before its keys are packed.
  bool integer() const {
    return chosen.compute == ComputeDtype::int8 || chosen.compute == ComputeDtype::int16;
  }
  i64 head_size = 0;
  int pv_int_bits = 0;  // SAGE's P.V in integers (pv_dtype int8 / int16 or auto's choice): 8 / 16
  RowBlock block{1, 1};
  i64 dv_padded = 0;
  int threads = 1;
  std::vector<WorkItem> items;
  std::vector<PaddingRows> padding;
  ItemShape shape;  // every work item's scratch (item_driver.hpp)
  std::size_t scratch_floats = 0;
  // Split-KV, when there are fewer than kSplitUnits query blocks: partial results of
  // `partial_rows` rows x (dv + 2) floats per slot (`partial_floats` in all), merged by groups.
  // Each run leases its own partials from the process's buffers (core/process_memory.hpp), so
  // concurrent runs of one plan neither share nor wait for them, and the plan holds none.
  std::vector<MergeGroup> merges;
  i64 partial_rows = 0;
  std::size_t partial_floats = 0;

  // K/V panels: one group per (segment, KV head) in item order, cut into waves.
  std::size_t k_tile_bytes = 0, v_tile_bytes = 0;  // one packed tile
  i64 ld_k = 0, ld_v = 0;                          // f32 engines: the rows' strides
  std::vector<PanelGroup> groups;
  std::vector<std::pair<std::size_t, i64>> panel_tiles;  // (group, tile) in wave order
  std::vector<Wave> waves;
  std::size_t panel_buffer_bytes = 0;  // the largest wave's, with its tiles' non-finite V keys
  // After a wave's tiles in its buffer: per tile slot (a group's slot t at group.offset /
  // tile_bytes() + t), the keys whose V row held a NaN or inf (zero_nonfinite_rows), as bits.
  std::size_t nonfinite_offset = 0;

  std::size_t tile_bytes() const { return k_tile_bytes + v_tile_bytes; }
  std::size_t slot_of(const PanelGroup& group, i64 tile) const {
    return group.offset / tile_bytes() + std::size_t(tile);
  }
  std::size_t wave_bytes(const Wave& w) const {
    return std::size_t(w.tile_end - w.tile_begin) * tile_bytes();
  }
};

// Per-thread scratch: a work item's (item_driver.hpp) and, after it, the f32 rows of one K and
// one V tile staged for the engine's packing (strides FlashPlan::ld_k / ld_v), and the item's
// per-row key ends.
struct Scratch {
  ItemScratch item;
  float *k, *v;
  i64* kend;

  static Scratch carve(ScratchLayout& at, const ItemShape& shape, i64 ld_k, i64 ld_v,
                       i64* row_ends) {
    Scratch s{shape.carve(at), nullptr, nullptr, row_ends};
    s.k = at.take(kBlockKeys * ld_k);
    s.v = at.take(kBlockKeys * ld_v);
    return s;
  }
  static std::size_t floats(const ItemShape& shape, i64 ld_k, i64 ld_v) {
    ScratchLayout count;
    (void)carve(count, shape, ld_k, ld_v, nullptr);
    return count.floats();
  }
};

class Worker {
 public:
  // `quantized`: K and V (and the joint ones) of `p` are int8/fp8 codes of a dense call with
  // kv_cache_dtype fp8/int8, scaled per (batch, 64-token block, head): {k, v, joint k, joint v}.
  // `partials`: this run's split-KV partial slots (plan.partial_floats floats), if any.
  // `stats`: for the int8 engines (SAGE), one per panel group (prepare()).
  Worker(const AttentionProblem& p, const FlashPlan& plan,
         const std::array<const detail::QuantizedKv*, 4>* quantized = nullptr,
         float* partials = nullptr, unsigned char* panel = nullptr,
         std::vector<GroupStats>* stats = nullptr)
      : p_(p),
        plan_(plan),
        kk_(plan.kernels),
        quantized_(quantized),
        partials_(partials),
        panel_(panel),
        stats_(stats) {
    // laser_input_scale f: (q / f)(k / f)(scale f^2) = q k scale and (v / f) f = v, exactly
    // for powers of two; in f32 nothing overflows, so the factor cancels out here.
    qscale_ = static_cast<float>(p.softmax_scale);
  }

  // Packs tile `tile` of panel group `g` (the wave's panel buffer): K and V rows converted to
  // f32 straight into it (f32 engines) or through this thread's scratch into the engine's
  // format.
  void pack_tile(std::size_t g, i64 tile, DriverThread& thread) const {
    const PanelGroup& group = plan_.groups[g];
    const Segment& seg = p_.segments[group.segment];
    const i64 j0 = seg.k_begin + tile * kBlockKeys, n = std::min(kBlockKeys, seg.k_end - j0);
    unsigned char* at = panel_ + group.offset + std::size_t(tile) * plan_.tile_bytes();
    const i64 d = p_.d;
    const i64 ahead = std::min(kBlockKeys, seg.k_end - j0 - n);  // the next tile's rows
    if (!kk_.formats.own()) {
      auto* k = reinterpret_cast<float*>(at);
      auto* v = reinterpret_cast<float*>(at + plan_.k_tile_bytes);
      convert_rows(false, group.segment, seg.batch, group.hk, j0, n, d, k, plan_.ld_k, ahead);
      convert_rows(true, group.segment, seg.batch, group.hk, j0, n, p_.dv, v, plan_.ld_v, ahead);
      nonfinite_v(group, tile) = zero_nonfinite_rows(v, plan_.ld_v, n, p_.dv);
      return;
    }
    ScratchLayout layout(thread.scratch());
    const Scratch s = Scratch::carve(layout, plan_.shape, plan_.ld_k, plan_.ld_v, nullptr);
    convert_rows(false, group.segment, seg.batch, group.hk, j0, n, d, s.k, plan_.ld_k, ahead);
    convert_rows(true, group.segment, seg.batch, group.hk, j0, n, p_.dv, s.v, plan_.ld_v, ahead);
    if (stats_ != nullptr && !(*stats_)[g].seen.empty()) {  // keys no query sees: zeros
      const char* seen = (*stats_)[g].seen.data() + (j0 - seg.k_begin);
      for (i64 jj = 0; jj < n; ++jj) {
        if (seen[jj] != 0) continue;
        std::fill(s.k + jj * plan_.ld_k, s.k + (jj + 1) * plan_.ld_k, 0.0f);
        std::fill(s.v + jj * plan_.ld_v, s.v + (jj + 1) * plan_.ld_v, 0.0f);
      }
    }
    // Before the V tile's codes and scales (SAGE) see the row.
    nonfinite_v(group, tile) = zero_nonfinite_rows(s.v, plan_.ld_v, n, p_.dv);
    const std::optional<Smoothing> sm = smoothing_of(g);
    const int split = split_of(g, tile);
    if (split >= 0) {  // the second copy first, from rows not yet smoothed
      const Smoothing::Split& sp = (*stats_)[g].smoothing.splits[std::size_t(split)];
      thread_local std::vector<float> rows;
      rows.assign(s.k, s.k + n * plan_.ld_k);
      unsigned char* spare =
          panel_ + group.offset + std::size_t(group.tiles + split) * plan_.tile_bytes();
      pack_key_tile(kk_, rows.data(), plan_.ld_k, s.v, plan_.ld_v, n, d, plan_.dv_padded,
                    plan_.k_tile_bytes, &*sm, sp.second_run, qscale_, spare);
    }
    pack_key_tile(kk_, s.k, plan_.ld_k, s.v, plan_.ld_v, n, d, plan_.dv_padded, plan_.k_tile_bytes,
                  sm ? &*sm : nullptr, sm ? sm->run_of(tile) : 0, qscale_, at);
  }

  // Tile `tile` of `group`'s keys whose V row held a NaN or inf (pack_tile; item_driver.hpp,
  // zero_nonfinite_rows): the hook makes the logits of them that a row sees NaN.
  std::uint64_t& nonfinite_v(const PanelGroup& group, i64 tile) const {
    auto* keys = reinterpret_cast<std::uint64_t*>(panel_ + plan_.nonfinite_offset);
    return keys[plan_.slot_of(group, tile)];
  }

  // Which of panel group g's split tiles `tile` is (its spare slot), or -1.
  int split_of(std::size_t g, i64 tile) const {
    if (stats_ == nullptr || !plan_.smooth_k) return -1;
    const auto& splits = (*stats_)[g].smoothing.splits;
    for (std::size_t n = 0; n < splits.size(); ++n)
      if (splits[n].tile == tile) return int(n);
    return -1;
  }

  // Panel group g's smoothing (plan.smooth_k), computed by prepare().
  std::optional<Smoothing> smoothing_of(std::size_t g) const {
    if (stats_ == nullptr || !plan_.smoothing()) return std::nullopt;
    return (*stats_)[g].smoothing.view(p_.d);
  }

  // What SAGE learns of panel group g before its keys are packed (GroupStats): which keys some
  // query row of the group computes with can see (positions, the key mask, a 4-D mask over the
  // KV head's query heads), and with plan.smooth_k the smoothing (item_driver.hpp, Smoothing;
  // docs/semantics.md, "SAGE") over those keys and the rows that are computed (not padding, not
  // past every key), finite ones only.
  void prepare(std::size_t g, DriverThread& thread) const {
    GroupStats& st = (*stats_)[g];
    const PanelGroup& group = plan_.groups[g];
    const Segment& seg = p_.segments[group.segment];
    const i64 b = seg.batch, nq = seg.q_end - seg.q_begin, nk = seg.k_end - seg.k_begin;
    const i64 heads = p_.group_size(), h0 = group.hk * heads, d = p_.d;
    // Each query row's key end (process()'s rule); rows that see no key are not computed.
    thread_local std::vector<i64> ends;
    ends.resize(std::size_t(nq));
    i64 end_all = seg.k_begin;
    for (i64 i = seg.q_begin; i < seg.q_end; ++i) {
      const i64 limit = p_.key_position_limit(seg.q_pos0 + (i - seg.q_begin));
      i64 visible = nk;
      if (limit != std::numeric_limits<i64>::max())
        visible = std::clamp<i64>(limit - seg.k_pos0, 0, nk);
      if (p_.zero_masked_query_rows && !p_.mask.keeps_key(b, i)) visible = 0;
      ends[std::size_t(i - seg.q_begin)] = seg.k_begin + visible;
      end_all = std::max(end_all, seg.k_begin + visible);
    }
    const MaskView& mask = p_.mask;
    const bool dense = mask.kind == MaskKind::keep_dense || mask.kind == MaskKind::additive;
    st.seen.clear();
    // With a 4-D mask, the query rows (per head) that see some key; the others output zeros.
    thread_local std::vector<char> row_sees;
    row_sees.assign(dense ? std::size_t(heads * nq) : 0, 0);
    if (end_all < seg.k_end || mask.kind != MaskKind::none) {
      st.seen.assign(std::size_t(nk), 0);
      if (!dense) {
        for (i64 j = seg.k_begin; j < end_all; ++j)
          st.seen[std::size_t(j - seg.k_begin)] = mask.keeps_key(b, j) ? 1 : 0;
      } else {
        const TensorView& m = mask.view;
        for (i64 h = h0; h < h0 + heads; ++h)
          for (i64 i = seg.q_begin; i < seg.q_end; ++i) {
            const i64 base = b * m.stride(0) + h * m.stride(1) + i * m.stride(2);
            char& sees = row_sees[std::size_t((h - h0) * nq + (i - seg.q_begin))];
            for (i64 j = seg.k_begin; j < ends[std::size_t(i - seg.q_begin)]; ++j) {
              char& seen = st.seen[std::size_t(j - seg.k_begin)];
              if (seen != 0 && sees != 0) continue;
              const i64 at = base + j * m.stride(3);
              const bool visible = mask.kind == MaskKind::keep_dense
                                       ? static_cast<const std::uint8_t*>(m.data())[at] != 0
                                       : load_as_f32(m.data(), m.dtype(), at) != kNegInf;
              seen = seen != 0 || visible;
              sees = sees != 0 || visible;
            }
          }
      }
    }
    if (!plan_.smooth_k) {
      if (plan_.rotate) st.smoothing.identity(d, group.tiles);
      st.smoothing.rotate = plan_.rotate;
      return;
    }
    thread_local Smoothing::Sums sums;
    sums.reset(d, group.tiles);
    float* row = thread.scratch();
    for (i64 j = seg.k_begin; j < seg.k_end; ++j) {
      if (!st.seen.empty() && st.seen[std::size_t(j - seg.k_begin)] == 0) continue;
      const auto [t, at, scale] = kv_row(false, group.segment, b, j, group.hk);
      load_elements(*t, at, d, scale, row);
      sums.key(row, d, (j - seg.k_begin) / kBlockKeys);
    }
    for (i64 h = h0; h < h0 + heads; ++h)
      for (i64 i = seg.q_begin; i < seg.q_end; ++i) {
        if (ends[std::size_t(i - seg.q_begin)] == seg.k_begin) continue;
        if (dense && row_sees[std::size_t((h - h0) * nq + (i - seg.q_begin))] == 0) continue;
        const RowRef qr = p_.q_row(i);
        const TensorView& q = *qr.view;
        load_elements(q, b * q.stride(0) + qr.row * q.stride(1) + h * q.stride(2), d, 1.0f, row);
        sums.query(row, d);
      }
    Smoothing::finish(sums, st.smoothing, d, plan_.balance_qk,
                      smoothing_exact_channels(plan_.chosen, plan_.rotate, d));
    st.smoothing.rotate = plan_.rotate;
    // Tiles holding two populations (item_driver.hpp, Smoothing::split_tiles).
    thread_local std::vector<float> rows;
    rows.resize(std::size_t(kBlockKeys * d));
    Smoothing::split_tiles(
        st.smoothing, d,
        [&](i64 tile, float* dst, bool* counts) {
          const i64 j0 = seg.k_begin + tile * kBlockKeys, n = std::min(kBlockKeys, seg.k_end - j0);
          for (i64 jj = 0; jj < n; ++jj) {
            const i64 j = j0 + jj;
            const auto [t, at, scale] = kv_row(false, group.segment, b, j, group.hk);
            load_elements(*t, at, d, scale, dst + jj * d);
            counts[jj] = (st.seen.empty() || st.seen[std::size_t(j - seg.k_begin)] != 0) &&
                         Smoothing::Sums::finite(dst + jj * d, d);
          }
          return int(n);
        },
        rows.data());
  }

  void process(const WorkItem& w, DriverThread& thread) const {
    const Segment& seg = p_.segments[w.segment];
    const i64 b = seg.batch, nq = w.q1 - w.q0, rows = nq * (w.h1 - w.h0);
    const i64 d = p_.d;
    ScratchLayout layout(thread.scratch());
    const Scratch s =
        Scratch::carve(layout, plan_.shape, plan_.ld_k, plan_.ld_v, thread.row_ends());

    // Each row sees a prefix [k_begin, kend) of the segment's keys (positions are linear).
    i64 kmax = seg.k_begin, kmin = seg.k_end;
    for (i64 r = 0; r < rows; ++r) {
      const i64 i = w.q0 + r % nq;
      const i64 limit = p_.key_position_limit(seg.q_pos0 + (i - seg.q_begin));
      const i64 span = seg.k_end - seg.k_begin;
      i64 visible = span;
      if (limit != std::numeric_limits<i64>::max())
        visible = std::clamp<i64>(limit - seg.k_pos0, 0, span);
      if (p_.zero_masked_query_rows && !p_.mask.keeps_key(b, i)) visible = 0;
      s.kend[r] = seg.k_begin + visible;
      kmax = std::max(kmax, s.kend[r]);
      kmin = std::min(kmin, s.kend[r]);
    }

    // A key-padding mask usually hides a tail of keys: stop at the last kept one.
    if (p_.mask.kind == MaskKind::keep_keys)
      while (kmax > seg.k_begin && !p_.mask.keeps_key(b, kmax - 1)) --kmax;
    const i64 k_first = std::max(seg.k_begin, w.k0);
    kmax = std::min(kmax, w.k1);

    // Row r is query w.q0 + r % nq of head w.h0 + r / nq.
    const auto load_query = [&](i64 r, float* dst, float scale) {
      const i64 h = w.h0 + r / nq;
      const RowRef qr = p_.q_row(w.q0 + r % nq);
      const TensorView& q = *qr.view;
      load_elements(q, b * q.stride(0) + qr.row * q.stride(1) + h * q.stride(2), d, scale, dst);
    };
    const std::optional<Smoothing> sm = smoothing_of(w.group);
    const ItemState state = begin_item(kk_, plan_.shape, s.item, rows, plan_.ld_k, plan_.ld_v,
                                       qscale_, sm ? &*sm : nullptr, load_query);
    // The engine's inner loop over the tiles this item's rows can see (kernels.hpp, the
    // contract); this driver produces them from the call's panel and applies positions and
    // masks through the logits hook.
    ItemTiles tiles{*this, w, s, b, k_first, kmax, kmin, plan_.groups[w.group]};
    const ItemKeys keys{&ItemTiles::next, &ItemTiles::logits, &tiles};
    attend(kk_, keys, state);
    end_item(s.item, rows, sm ? &*sm : nullptr);

    if (w.partial >= 0) {
      float* slot = partials_ + w.partial * plan_.partial_rows * (p_.dv + 2);
      for (i64 r = 0; r < rows; ++r) {
        float* row = slot + r * (p_.dv + 2);
        std::copy(s.item.o + r * s.item.ld_o, s.item.o + r * s.item.ld_o + p_.dv, row);
        row[p_.dv] = s.item.m[r];
        row[p_.dv + 1] = s.item.l[r];
      }
      return;
    }
    for (i64 r = 0; r < rows; ++r)
      write_row(s.item.o + r * s.item.ld_o, s.item.m[r], s.item.l[r], b, w.h0 + r / nq,
                w.q0 + r % nq);
  }

  // The key tiles of one work item (ItemKeys): tiles of the call's panel from k_first to kmax,
  // skipping those a mask hides entirely; a tile past some row's limit, or under a mask, asks
  // for the hook.
  struct ItemTiles {
    const Worker& worker;
    const WorkItem& w;
    const Scratch& s;
    i64 b, j0, kmax, kmin;
    const PanelGroup& group;
    std::array<KeyTile, kMaxPanelTiles> ring{};  // the engine holds up to panel_tiles of them
    std::optional<KeyTile> second{};             // a split tile's second copy, next

    static const KeyTile* next(void* ctx, int n) {
      auto& t = *static_cast<ItemTiles*>(ctx);
      const Worker& wk = t.worker;
      const FlashPlan& plan = wk.plan_;
      const Segment& seg = wk.p_.segments[t.w.segment];
      if (t.second) {
        KeyTile& tile = t.ring[std::size_t(n % wk.kk_.loop.panel_tiles)];
        tile = *t.second;
        t.second.reset();
        return &tile;
      }
      for (; t.j0 < t.kmax; t.j0 += kBlockKeys) {
        const i64 keys = std::min(kBlockKeys, t.kmax - t.j0);
        if (wk.tile_hidden_by_mask(t.w, t.s, t.b, t.j0, keys)) continue;
        // K and V tiles come from the call's panel, converted once per call with padded
        // strides: reading them in place, H * D elements apart, cost more in cache-set
        // conflicts and TLB misses than a copy (measured on flux-1024: 47% -> 58% of peak with
        // 24 heads), and converting them per work item cost as much again.
        const unsigned char* at =
            wk.panel_ + t.group.offset +
            std::size_t((t.j0 - seg.k_begin) / kBlockKeys) * plan.tile_bytes();
        // No software prefetch of the next tile (kernels.hpp, attend_tile_by_tile).
        const i64 index = (t.j0 - seg.k_begin) / kBlockKeys;
        KeyTile& tile = t.ring[std::size_t(n % wk.kk_.loop.panel_tiles)];
        tile = {at, at + plan.k_tile_bytes, int(keys),
                t.j0 + keys > t.kmin || wk.p_.mask.kind != MaskKind::none ||
                    wk.nonfinite_v(t.group, index) != 0,
                t.j0};
        if (const int split = wk.split_of(t.w.group, index); split >= 0) {
          // Two copies, each hiding the other's keys (item_driver.hpp, Smoothing).
          const std::uint64_t part =
              (*wk.stats_)[t.w.group].smoothing.splits[std::size_t(split)].second;
          const std::uint64_t all = keys == 64 ? ~std::uint64_t(0) : (std::uint64_t(1) << keys) - 1;
          const unsigned char* spare =
              wk.panel_ + t.group.offset + std::size_t(t.group.tiles + split) * plan.tile_bytes();
          tile.hook = true;
          tile.hide = part;
          t.second = KeyTile{spare, spare + plan.k_tile_bytes, int(keys), true, t.j0, all & ~part};
        }
        t.j0 += kBlockKeys;
        return &tile;
      }
      return nullptr;
    }
    static void logits(void* ctx, const KeyTile& tile, float* st, i64 row_stride, i64 key_stride) {
      auto& t = *static_cast<ItemTiles*>(ctx);
      const i64 rows = (t.w.q1 - t.w.q0) * (t.w.h1 - t.w.h0);
      for (int jj = 0; jj < tile.keys; ++jj)
        if ((tile.hide >> jj) & 1)
          for (i64 r = 0; r < rows; ++r) st[r * row_stride + jj * key_stride] = kNegInf;
      t.worker.hide(t.w, t.s, t.b, tile.j0, tile.keys, rows, tile.j0 + tile.keys > t.kmin, st,
                    row_stride, key_stride);
      const i64 index = (tile.j0 - t.worker.p_.segments[t.w.segment].k_begin) / kBlockKeys;
      poison_visible(t.worker.nonfinite_v(t.group, index), st, rows, row_stride, key_stride);
    }
  };

  // Merges the split items of one query block, the (O, LSE) merge of docs/semantics.md:
  // m = max m_s, l = sum l_s e^(m_s - m), O = sum O_s e^(m_s - m), written as O / l. A part
  // whose sum is NaN (it saw a NaN or +inf logit) makes the merged row NaN; parts that saw no
  // key (l = 0) are left out. `o` is scratch for dv floats.
  void merge(const MergeGroup& g, float* o) const {
    const WorkItem& w = g.rows;
    const Segment& seg = p_.segments[w.segment];
    const i64 nq = w.q1 - w.q0, rows = nq * (w.h1 - w.h0), width = p_.dv + 2;
    const auto part = [&](i64 sp, i64 r) {
      return partials_ + ((g.first_partial + sp) * plan_.partial_rows + r) * width;
    };
    for (i64 r = 0; r < rows; ++r) {
      float m = kNegInf;
      bool poisoned = false;
      for (i64 sp = 0; sp < g.splits; ++sp) {
        const float* row = part(sp, r);
        poisoned = poisoned || std::isnan(row[p_.dv + 1]);
        if (row[p_.dv + 1] > 0.0f) m = std::max(m, row[p_.dv]);
      }
      float l = poisoned ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
      std::fill(o, o + p_.dv, 0.0f);
      if (!poisoned && m != kNegInf) {
        for (i64 sp = 0; sp < g.splits; ++sp) {
          const float* row = part(sp, r);
          if (!(row[p_.dv + 1] > 0.0f)) continue;
          const float f = std::exp(row[p_.dv] - m);
          l += row[p_.dv + 1] * f;
          for (i64 e = 0; e < p_.dv; ++e) o[e] += row[e] * f;
        }
      }
      out_.finish(o, m, l, seg.batch, w.h0 + r / nq, w.q0 + r % nq);
    }
  }

  void zero_rows(const PaddingRows& pr) const {
    for (i64 i = pr.i0; i < pr.i1; ++i)
      for (i64 h = 0; h < p_.hq; ++h) write_zero(pr.batch, h, i);
  }

 private:
  // Rows [j0, j0 + n) of head hk of `t` as f32 into dst [n][ld], columns past `width` zero;
  // the first `ahead` rows of the next tile are prefetched meanwhile (rows lie H * D elements
  // apart, too far for the hardware prefetchers; one row per row converted spreads the
  // requests out: +3-4 points of peak over one burst per tile).
  void convert_rows(bool value, std::size_t segment, i64 b, i64 hk, i64 j0, i64 n, i64 width,
                    float* dst, i64 ld, i64 ahead) const {
    for (i64 jj = 0; jj < n; ++jj) {
      if (jj < ahead) {  // the same row of the next tile, into L2 while this tile computes
        const auto [t, at, unused] = kv_row(value, segment, b, j0 + n + jj, hk);
        const i64 es = i64(dtype_size(t->dtype()));
        const char* row = static_cast<const char*>(t->data()) + at * es;
        for (i64 off = 0; off < width * es; off += 64) __builtin_prefetch(row + off, 0, 2);
      }
      const auto [t, at, scale] = kv_row(value, segment, b, j0 + jj, hk);
      load_elements(*t, at, width, scale, dst + jj * ld);
      std::fill(dst + jj * ld + width, dst + (jj + 1) * ld, 0.0f);
    }
  }

  // Where key row j of head hk lives: the tensor, the element offset of its first element
  // (through the segment's block table for a paged call) and the scale of its codes (int8 and
  // fp8 pages; 1 otherwise).
  struct KvRowAt {
    const TensorView* t;
    i64 at;
    float scale;
  };
  KvRowAt kv_row(bool value, std::size_t segment, i64 b, i64 j, i64 hk) const {
    if (p_.paged) {
      const TensorView& t = value ? p_.v : p_.k;
      const i64 bs = p_.paged->block_size;
      const i64 page = (*p_.paged->tables[segment])[std::size_t(j / bs)];
      float scale = 1.0f;
      if (const auto& sc = value ? p_.paged->v_scales : p_.paged->k_scales; sc)
        scale = static_cast<const float*>(sc->data())[page * sc->stride(0) + hk * sc->stride(1)];
      return {&t, page * t.stride(0) + (j % bs) * t.stride(1) + hk * t.stride(2), scale};
    }
    const RowRef r = value ? p_.v_row(j) : p_.k_row(j);
    const TensorView& t = *r.view;
    float scale = 1.0f;
    if (quantized_) {
      const bool joint = p_.joint && (r.view == &p_.joint->k || r.view == &p_.joint->v);
      scale = (*quantized_)[std::size_t((joint ? 2 : 0) + (value ? 1 : 0))]->scale(b, r.row, hk);
    }
    return {&t, b * t.stride(0) + r.row * t.stride(1) + hk * t.stride(2), scale};
  }

  void load_elements(const TensorView& t, i64 base, i64 n, float scale, float* dst) const {
    flash::load_elements(kk_, t, base, n, scale, dst);
  }

  // Sets the logits a row may not see to -inf (keys past its position limit, masked keys) and
  // adds additive mask terms (natural units, like the logits: a finite -FLT_MAX stays finite),
  // on the engine's layout: st[r * rs + jj * ks] is row r's logit of key j0 + jj.
  void hide(const WorkItem& w, const Scratch& s, i64 b, i64 j0, i64 n, i64 rows,
            bool positions_partial, float* st, i64 rs, i64 ks) const {
    const i64 nq = w.q1 - w.q0;
    const MaskView& mask = p_.mask;
    if (mask.kind == MaskKind::keep_keys)
      for (i64 jj = 0; jj < n; ++jj)
        if (!mask.keeps_key(b, j0 + jj))
          for (i64 r = 0; r < rows; ++r) st[r * rs + jj * ks] = kNegInf;
    const bool dense = mask.kind == MaskKind::keep_dense || mask.kind == MaskKind::additive;
    if (!positions_partial && !dense) return;
    const TensorView& m = mask.view;
    for (i64 r = 0; r < rows; ++r) {
      float* row = st + r * rs;
      const i64 visible = std::clamp<i64>(s.kend[r] - j0, 0, n);
      for (i64 jj = visible; jj < n; ++jj) row[jj * ks] = kNegInf;
      if (!dense) continue;
      const i64 h = w.h0 + r / nq, i = w.q0 + r % nq;
      const i64 base = b * m.stride(0) + h * m.stride(1) + i * m.stride(2) + j0 * m.stride(3);
      if (mask.kind == MaskKind::keep_dense) {
        const auto* bytes = static_cast<const std::uint8_t*>(m.data());
        for (i64 jj = 0; jj < visible; ++jj)
          if (bytes[base + jj * m.stride(3)] == 0) row[jj * ks] = kNegInf;
      } else {
        // -inf hides the key whatever its logit holds (a NaN or inf query or key: NaN + -inf
        // would be a visible NaN); any other value is added.
        for (i64 jj = 0; jj < visible; ++jj) {
          const float add = load_as_f32(m.data(), m.dtype(), base + jj * m.stride(3));
          row[jj * ks] = add == kNegInf ? kNegInf : row[jj * ks] + add;
        }
      }
    }
  }

  // True when the mask hides every (row, key) of the tile that positions leave visible.
  bool tile_hidden_by_mask(const WorkItem& w, const Scratch& s, i64 b, i64 j0, i64 n) const {
    const MaskView& mask = p_.mask;
    if (mask.kind == MaskKind::none) return false;
    if (mask.kind == MaskKind::keep_keys) {
      for (i64 jj = 0; jj < n; ++jj)
        if (mask.keeps_key(b, j0 + jj)) return false;
      return true;
    }
    const TensorView& m = mask.view;
    const i64 nq = w.q1 - w.q0, rows = nq * (w.h1 - w.h0);
    for (i64 r = 0; r < rows; ++r) {
      const i64 visible = std::clamp<i64>(s.kend[r] - j0, 0, n);
      const i64 base = b * m.stride(0) + (w.h0 + r / nq) * m.stride(1) +
                       (w.q0 + r % nq) * m.stride(2) + j0 * m.stride(3);
      for (i64 jj = 0; jj < visible; ++jj) {
        const i64 at = base + jj * m.stride(3);
        if (mask.kind == MaskKind::keep_dense ? static_cast<const std::uint8_t*>(m.data())[at] != 0
                                              : load_as_f32(m.data(), m.dtype(), at) != kNegInf)
          return false;
      }
    }
    return true;
  }

  // Writes O / l and the LSE by the row rule of OutputRows::finish (zeros when the row saw no
  // key, NaN when its inputs carried a NaN or inf where it looked).
  void write_row(float* o_row, float m, float l, i64 b, i64 h, i64 i) const {
    out_.finish(o_row, m, l, b, h, i);
  }

  void write_zero(i64 b, i64 h, i64 i) const { out_.write_zero(b, h, i); }

  const AttentionProblem& p_;
  const FlashPlan& plan_;
  const TileKernels& kk_;
  const OutputRows out_{p_, kk_};
  const std::array<const detail::QuantizedKv*, 4>* quantized_;
  float* partials_;
  unsigned char* panel_;            // this wave's K/V panels
  std::vector<GroupStats>* stats_;  // SAGE's (prepare()), else nullptr
  float qscale_ = 1;
};

class FlashImpl final : public Impl {
 public:
  // `sage`: the SAGE backend (integer engines; options qk_dtype, pv_dtype, smooth_k, balance_qk,
  // rotate).
  FlashImpl(const Backend& backend, const ImplConfig& config, bool sage = false)
      : Impl(backend, config) {
    cap_ = options_cap(config.backend_kwargs, backend.name());
    if (sage) {
      const std::optional<ComputeDtype> qk = parse_qk_dtype(config.backend_kwargs, false);
      // qk_dtype int16, or an int16 engine named by isa / DATTN_ISA: 16-bit Q.K^T.
      const bool int16 = qk == ComputeDtype::int16 ||
                         (!qk && cap_ != nullptr && cap_->compute == ComputeDtype::int16);
      compute_ = int16 ? ComputeDtype::int16 : ComputeDtype::int8;
      pv_ = parse_pv_dtype(config.backend_kwargs);
      smooth_k_ = parse_bool_option(config.backend_kwargs, "smooth_k");
      balance_qk_ = parse_bool_option(config.backend_kwargs, "balance_qk");
      // On 16-bit lanes the channels of largest spread are exact instead: no rotation unless
      // asked for.
      rotate_ = parse_bool_option(config.backend_kwargs, "rotate", kRotateByDefault && !int16);
      if (int16) {
        if (pv_ != PvDtype::automatic && pv_ != PvDtype::int16)
          throw InvalidArgument("pv_dtype",
                                "backend option pv_dtype: with qk_dtype int16 P.V runs on 16-bit "
                                "integer codes; valid: auto, int16");
      } else {
        // Checked now, so that a pv_dtype this CPU's engine lacks is refused when the layer is
        // built.
        (void)int8_engine_kernels(select_engine(cap_, DType::F32, compute_), pv_);
      }
    } else {
      compute_ = parse_compute_dtype(config.backend_kwargs);
    }
    sage_ = sage;
  }

  std::unique_ptr<Plan> plan(const AttentionProblem& p) const override {
    const Engine& engine =
        select_engine(cap_, operand_dtype(p), compute_, half_operands(p) && keys_amortize_codes(p));
    auto plan = std::make_unique<FlashPlan>(
        p.signature, engine,
        engine.compute == ComputeDtype::int8 ? int8_engine_kernels(engine, pv_) : engine.kernels());
    plan->head_size = p.d;
    if (engine.compute == ComputeDtype::int16 && !sage_) {
      // FLASH on 16-bit lanes: K smoothed and channels balanced, the 4 channels of largest
      // spread exact, no rotation (docs/semantics.md, "16-bit integer lanes").
      plan->smooth_k = plan->balance_qk = true;
    } else if (sage_) {
      plan->smooth_k = smooth_k_;
      plan->balance_qk = plan->smooth_k && balance_qk_;
      plan->rotate = rotate_;
    }
    if (engine.compute == ComputeDtype::int16) plan->pv_int_bits = 16;
    if (engine.compute == ComputeDtype::int8) {
      const PvDtype pv = pv_ == PvDtype::automatic ? automatic_pv_dtype(engine) : pv_;
      plan->pv_int_bits = pv == PvDtype::int8 ? 8 : pv == PvDtype::int16 ? 16 : 0;
    }
    const i64 group = p.group_size();
    plan->block = row_block(group, item_rows(plan->kernels, cpu_features().l2_bytes));
    plan->dv_padded = round_up(std::max<i64>(p.dv, 1), plan->kernels.col_align);
    plan->threads = std::max(p.threads, 1);
    // Items that read the same K/V (one segment, one KV head) are consecutive, so the threads
    // working through them find that K/V in the shared cache.
    for (std::size_t si = 0; si < p.segments.size(); ++si) {
      const Segment& seg = p.segments[si];
      const i64 tiles = (seg.k_end - seg.k_begin + kBlockKeys - 1) / kBlockKeys;
      for (i64 hk = 0; hk < p.hkv; ++hk) {
        const std::size_t g = plan->groups.size();
        plan->groups.push_back({si, hk, tiles, 0});
        for (i64 q0 = seg.q_begin; q0 < seg.q_end; q0 += plan->block.rows_per_head)
          for (i64 h0 = hk * group; h0 < (hk + 1) * group; h0 += plan->block.heads)
            plan->items.push_back({si, g, q0, std::min(seg.q_end, q0 + plan->block.rows_per_head),
                                   h0, std::min((hk + 1) * group, h0 + plan->block.heads)});
      }
    }
    // Split-KV: with fewer than kSplitUnits query blocks, each block's key range is cut into
    // ranges of whole tiles, run in parallel and merged in range order.
    // The cut depends on the problem only, never on the thread count: the online softmax's
    // reference (and so, on a 16- or 8-bit P.V, the rounding of P) is the same for 1 thread as
    // for 64, and the answer bit for bit the same.
    if (const i64 blocks = static_cast<i64>(plan->items.size()); blocks < kSplitUnits) {
      std::vector<WorkItem> split;
      for (const WorkItem& w : plan->items) {
        const Segment& seg = p.segments[w.segment];
        const i64 tiles = (seg.k_end - seg.k_begin + kBlockKeys - 1) / kBlockKeys;
        const i64 splits = std::min<i64>((kSplitUnits + blocks - 1) / blocks, tiles);
        if (splits <= 1) {
          split.push_back(w);
          continue;
        }
        const i64 slot0 = plan->merges.empty()
                              ? 0
                              : plan->merges.back().first_partial + plan->merges.back().splits;
        plan->merges.push_back({w, slot0, splits});
        for (i64 sp = 0; sp < splits; ++sp) {
          WorkItem part = w;
          part.k0 = seg.k_begin + tiles * sp / splits * kBlockKeys;
          part.k1 = seg.k_begin + tiles * (sp + 1) / splits * kBlockKeys;
          part.partial = slot0 + sp;
          split.push_back(part);
        }
      }
      plan->items = std::move(split);
      if (!plan->merges.empty()) {
        plan->partial_rows = plan->block.heads * plan->block.rows_per_head;
        const i64 slots = plan->merges.back().first_partial + plan->merges.back().splits;
        plan->partial_floats = std::size_t(slots * plan->partial_rows * (p.dv + 2));
      }
    }
    // Rows outside every segment are padding.
    for (i64 b = 0; b < p.batch; ++b) {
      i64 next = 0;
      for (const Segment& seg : p.segments) {
        if (seg.batch != b) continue;
        if (seg.q_begin > next) plan->padding.push_back({b, next, seg.q_begin});
        next = std::max(next, seg.q_end);
      }
      if (next < p.sq) plan->padding.push_back({b, next, p.sq});
    }
    plan_panels(*plan, p);
    plan->shape = ItemShape::of(plan->kernels, plan->block.heads * plan->block.rows_per_head, p.d,
                                plan->dv_padded);
    plan->scratch_floats = Scratch::floats(plan->shape, plan->ld_k, plan->ld_v);
    return plan;
  }

  // Panel tile sizes, each group's place in its wave, and the waves (consecutive groups whose
  // panels fit kPanelBudget; at least one group each) with their items.
  static void plan_panels(FlashPlan& plan, const AttentionProblem& p) {
    const TileKernels& kk = plan.kernels;
    constexpr std::size_t kAlign = 64;
    const auto align = [](std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
    plan.ld_k = p.d + kStridePad;
    plan.ld_v = plan.dv_padded + kStridePad;
    if (kk.formats.k_tile_bytes != nullptr) {
      plan.k_tile_bytes = kk.formats.k_tile_bytes(int(p.d));
      plan.v_tile_bytes = kk.formats.v_tile_bytes(int(plan.dv_padded));
    } else {
      plan.k_tile_bytes = align(std::size_t(kBlockKeys * plan.ld_k) * sizeof(float));
      plan.v_tile_bytes = align(std::size_t(kBlockKeys * plan.ld_v) * sizeof(float));
    }
    std::size_t item = 0;
    for (std::size_t g = 0; g < plan.groups.size();) {
      Wave w{g, g, i64(item), i64(item), i64(plan.panel_tiles.size()), 0};
      std::size_t bytes = 0;
      while (g < plan.groups.size()) {
        PanelGroup& group = plan.groups[g];
        group.spare = plan.smooth_k ? std::min<i64>(kMaxSplitTiles, group.tiles) : 0;
        const std::size_t add = std::size_t(group.tiles + group.spare) * plan.tile_bytes();
        if (g > w.group_begin && bytes + add > kPanelBudget) break;
        group.offset = bytes;
        bytes += add;
        for (i64 t = 0; t < group.tiles; ++t) plan.panel_tiles.emplace_back(g, t);
        ++g;
      }
      w.group_end = g;
      while (item < plan.items.size() && plan.items[item].group < g) ++item;
      w.item_end = i64(item);
      w.tile_end = i64(plan.panel_tiles.size());
      plan.nonfinite_offset = std::max(plan.nonfinite_offset, bytes);
      plan.waves.push_back(w);
    }
    plan.panel_buffer_bytes =
        plan.nonfinite_offset + plan.nonfinite_offset / plan.tile_bytes() * sizeof(std::uint64_t);
  }

  // docs/semantics.md, "Paged KV": writes the rows' new K/V into their slots, then runs the same
  // work items as a dense call with one segment per row whose keys [0, seq_len) are read through
  // the row's block table (any block stride: either layout of a multi-layer cache).
  void forward_paged(const PagedAttentionCall& call) const override {
    const ImplConfig& c = config();
    validate_paged_call(call, c.num_heads, c.num_kv_heads, c.head_size);
    if (call.q.platform() != Platform::cpu) no_platform(call.q.platform());
    const TensorView& kp = call.cache.k_pages;
    const TensorView& vp = call.cache.v_pages;
    const i64 bs = kp.size(1), hkv = kp.size(2);
    write_paged_kv(call);
    i64 t0 = 0;
    for (const PagedRow& r : call.rows) t0 += r.query_len;

    AttentionProblem p;
    const auto as_batch = [](const TensorView& t) {  // [T, H, E] -> [1, T, H, E]
      return t.unsqueezed(0);
    };
    p.threads = detail::calling_threads();
    p.batch = 1;
    p.sq = t0;
    p.hq = c.num_heads;
    p.hkv = hkv;
    p.d = kp.size(3);
    p.dv = vp.size(3);
    p.q = as_batch(call.q);
    p.out = as_batch(call.out);
    p.k = kp;
    p.v = vp;
    if (call.lse) p.lse = detail::lse_as_batch(*call.lse);
    detail::apply_paged_rules(call, p);
    p.paged = PagedKeys{bs, {}, call.cache.k_scales, call.cache.v_scales};
    i64 q0 = 0;
    for (const PagedRow& r : call.rows) {
      p.skv = std::max(p.skv, r.seq_len);
      if (r.query_len > 0) {
        p.segments.push_back({0, q0, q0 + r.query_len, 0, r.seq_len, r.seq_len - r.query_len, 0});
        p.paged->tables.push_back(&r.block_table);
      }
      q0 += r.query_len;
    }
    run(*plan(p), p);
  }

 protected:
  // kv_cache_dtype fp8/int8 on a dense call (docs/semantics.md, "Paged KV"): K and V are quantized
  // per (batch, 64-token block, head) into codes (a quarter of f32's bytes), which the same kernels
  // dequantize as they load them, as they do for quantized pages.
  void run_cpu(const Plan& base, const AttentionProblem& p) const override {
    if (p.kv_cache_dtype == KvCacheDtype::unquantized) return run_with(base, p, nullptr);
    std::array<detail::QuantizedKv, 4> q;
    AttentionProblem qp = p;
    q[0] = detail::quantize_kv(p.k, p.kv_cache_dtype, "key");
    q[1] = detail::quantize_kv(p.v, p.kv_cache_dtype, "value");
    qp.k = q[0].codes.view();
    qp.v = q[1].codes.view();
    if (p.joint) {
      q[2] = detail::quantize_kv(p.joint->k, p.kv_cache_dtype, "joint_key");
      q[3] = detail::quantize_kv(p.joint->v, p.kv_cache_dtype, "joint_value");
      qp.joint->k = q[2].codes.view();
      qp.joint->v = q[3].codes.view();
    }
    const std::array<const detail::QuantizedKv*, 4> scales{&q[0], &q[1], &q[2], &q[3]};
    run_with(base, qp, &scales);
  }

 private:
  void run_with(const Plan& base, const AttentionProblem& p,
                const std::array<const detail::QuantizedKv*, 4>* quantized) const {
    const auto& plan = static_cast<const FlashPlan&>(base);
    // This call's buffers, leased from the process's (shared by every layer; in huge pages from
    // 2 MiB on): the split-KV partials, and the panels of one wave at a time.
    detail::ProcessMemory& memory = detail::ProcessMemory::instance();
    detail::ProcessMemory::Lease partials;
    if (!plan.merges.empty()) partials = memory.lease(plan.partial_floats * sizeof(float));
    const detail::ProcessMemory::Lease panel_lease = memory.lease(plan.panel_buffer_bytes);
    auto* panel = panel_lease.as<unsigned char>();
    const bool sage = plan.integer();
    std::vector<GroupStats> stats(sage ? plan.groups.size() : 0);
    const Worker worker(p, plan, quantized, plan.merges.empty() ? nullptr : partials.as<float>(),
                        panel, sage ? &stats : nullptr);
    for (const PaddingRows& pr : plan.padding) worker.zero_rows(pr);
    const auto count = static_cast<i64>(std::max(plan.items.size(), plan.panel_tiles.size()));
    const int threads = static_cast<int>(std::min<i64>(plan.threads, std::max<i64>(count, 1)));
    const auto merges = static_cast<i64>(plan.merges.size());
    // One fault-guarded region (item_driver.hpp): SAGE's statistics, then per wave its panels
    // and its items, then the merges.
    const auto rows = std::size_t(plan.block.heads * plan.block.rows_per_head);
    run_parallel(threads, plan.scratch_floats, rows, [&](DriverThread& thread) {
      if (sage)
        thread.loop(0, i64(plan.groups.size()), 1,
                    [&](i64 g) { worker.prepare(std::size_t(g), thread); });
      thread.with_engine(plan.kernels, [&] {
        for (const Wave& wave : plan.waves) {
          thread.loop(wave.tile_begin, wave.tile_end, 4, [&](i64 t) {
            const auto& [g, tile] = plan.panel_tiles[std::size_t(t)];
            worker.pack_tile(g, tile, thread);
          });
          thread.loop(wave.item_begin, wave.item_end, 1,
                      [&](i64 n) { worker.process(plan.items[std::size_t(n)], thread); });
        }
      });
      thread.loop(0, merges, 1,
                  [&](i64 g) { worker.merge(plan.merges[std::size_t(g)], thread.scratch()); });
    });
  }

  const Engine* cap_ = nullptr;  // nullptr: automatic
  ComputeDtype compute_ = ComputeDtype::f32;
  bool sage_ = false;
  PvDtype pv_ = PvDtype::automatic;  // SAGE's
  bool smooth_k_ = true;             // SAGE's
  bool balance_qk_ = true;           // SAGE's (with smooth_k)
  bool rotate_ = kRotateByDefault;   // SAGE's
};

BackendCapabilities flash_capabilities() {
  BackendCapabilities c;
  c.accept_output_buffer = true;
  c.supports_piecewise_spans = true;
  c.supports_prefix_kv_slicing = true;
  c.supports_packed_mask_free = true;
  c.supports_multi_doc_packed_varlen = true;
  c.supports_paged_kv = true;
  c.supports_attention_mask = true;
  c.indexes_kv_by_block_stride = true;
  c.supported_platforms = std::vector<Platform>{Platform::cpu};
  c.kv_cache_dtypes = {{Platform::cpu, {KvCacheDtype::fp8, KvCacheDtype::int8}}};
  return c;
}

class FlashBackend final : public Backend {
 public:
  FlashBackend() : Backend(flash_capabilities()) {}
  std::string name() const override { return "FLASH"; }
  std::string description() const override {
    return "tiled online-softmax attention with SIMD micro-kernels (" +
           std::string(select_engine(process_cap(), DType::F32, ComputeDtype::f32).name) + ")";
  }
  int priority() const override { return 100; }
  void validate_configuration() const override { (void)process_cap(); }
  void validate_available() const override { (void)process_cap(); }
  std::unique_ptr<Impl> make_impl(const ImplConfig& config) const override {
    return std::make_unique<FlashImpl>(*this, config);
  }
  std::optional<std::vector<std::string>> option_names() const override {
    return std::vector<std::string>{"isa", "compute_dtype"};
  }
};

// SAGE: FLASH's driver on the 8-bit Q.K^T engines (SageAttention's scheme on the CPU);
// approximate, so chosen only explicitly.
class SageBackend final : public Backend {
 public:
  SageBackend() : Backend(sage_capabilities()) {}
  static BackendCapabilities sage_capabilities() {
    BackendCapabilities c = flash_capabilities();
    c.exact = false;
    return c;
  }
  std::string name() const override { return "SAGE"; }
  std::string description() const override {
    const Engine& e = select_engine(process_cap(), DType::F32, ComputeDtype::int8);
    const TileKernels& kk = int8_engine_kernels(e, PvDtype::automatic);
    const PvDtype pv = automatic_pv_dtype(e);
    // automatic_pv_dtype: int16 on the vpdpwssd / vpmaddwd engines, amx_int8's own bf16 tiles, else
    // f32.
    const std::string pv_name = pv == PvDtype::int16      ? "16-bit integer codes"
                                : !kk.loop.tile_by_tile() ? "bf16 tiles"
                                                          : "f32";
    return "8-bit attention (SageAttention on the CPU): Q and K as int8 per row and key with K "
           "smoothed and rotated, P.V by pv_dtype (auto here: " +
           pv_name + "), on FLASH's driver (" + std::string(kk.engine) +
           "); approximate, chosen only explicitly";
  }
  std::optional<std::vector<std::string>> option_names() const override {
    return std::vector<std::string>{"isa",      "qk_dtype",   "pv_dtype",
                                    "smooth_k", "balance_qk", "rotate"};
  }
  int priority() const override { return 5; }
  void validate_configuration() const override { (void)process_cap(); }
  void validate_available() const override { (void)process_cap(); }
  std::unique_ptr<Impl> make_impl(const ImplConfig& config) const override {
    return std::make_unique<FlashImpl>(*this, config, true);
  }
};

static_assert(kInt8StridePad == kStridePad, "int8 V tiles keep the f32 engines' row padding");

}  // namespace
}  // namespace flash

std::shared_ptr<const Backend> make_flash_backend() {
  return std::make_shared<flash::FlashBackend>();
}

std::shared_ptr<const Backend> make_sage_backend() {
  return std::make_shared<flash::SageBackend>();
}

}  // namespace dattn
