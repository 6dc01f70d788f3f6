// The driver half of every backend built on FLASH's engines, written once: FLASH (flash.cpp) and
// VIDEO_SPARSE (sparse/video_sparse.cpp) add only what is their own (which rows and keys a work
// item has, which key tiles it visits, what the logits hook hides) and run the rest from here:
// - a work item's scratch (ItemShape, ItemScratch) and the engine's workspace in it;
// - its queries packed (Q^T, scaled or not as the engine's format wants, smoothed for SAGE,
//   handed to the engine's pack_q) and its running (O, m, l) set up (begin_item);
// - key tiles packed from staged f32 rows into the engine's format (pack_key_tile);
// - SAGE's smoothing of one key set and the queries that see it (Smoothing);
// - the fault-guarded OpenMP region, its work-sharing loops and the engine's per-thread set-up
//   around the loops that run it (run_parallel, DriverThread).
// The engines see none of it: their contract is kernels.hpp's.
#pragma once

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "backends/flash/kernels.hpp"
#include "backends/flash/tile_io.hpp"
#include "backends/flash/tile_plan.hpp"
#include "core/parallel_fault.hpp"
#include "core/process_memory.hpp"

namespace dattn::flash {

// The most runs of key tiles SAGE's smoothing of one key set has, and the most tiles it splits
// between two runs (Smoothing).
inline constexpr int kMaxSmoothingRuns = 32;
inline constexpr int kMaxSplitTiles = 2;

// One work item's scratch (strides padded by kStridePad): QT [d][ld_rows], S^T of one tile for
// the tile-by-tile engines (engines with their own inner loop keep their logits in their
// workspace), O [rows_p][ld_o], m, l and alpha per row, a row of max(d, dv) floats, and the
// engine's workspace (64-byte aligned; null for the f32 engines), and for the engines that take
// row terms (OperandFormats::set_row_terms) kMaxSmoothingRuns x rows_p of them.
struct ItemScratch {
  float *qt, *st, *o, *m, *l, *alpha, *row, *terms;
  void* ws;
  std::int64_t ld_rows, ld_o;
};

// What every item scratch of a plan is carved for: up to rows_p rows (a multiple of the
// engine's row_align), head sizes d and dv_padded, the engine's workspace.
struct ItemShape {
  std::int64_t rows_p = 0, d = 0, dv_padded = 0;
  std::size_t workspace_bytes = 0;
  bool tile_by_tile = true;
  bool row_terms = false;

  static ItemShape of(const TileKernels& kk, std::int64_t rows, std::int64_t d,
                      std::int64_t dv_padded) {
    ItemShape s;
    s.rows_p = round_up(rows, kk.row_align);
    s.d = d;
    s.dv_padded = dv_padded;
    if (kk.formats.workspace_bytes != nullptr)
      s.workspace_bytes = kk.formats.workspace_bytes(int(s.rows_p), int(d), int(dv_padded));
    s.tile_by_tile = kk.loop.tile_by_tile();
    s.row_terms = kk.formats.set_row_terms != nullptr;
    return s;
  }

  // The item scratch, first in `at` (a driver takes its own arrays after it).
  ItemScratch carve(ScratchLayout& at) const {
    ItemScratch s{};
    if (workspace_bytes > 0) {  // with 64 bytes of slack to align it
      constexpr std::int64_t kAlignFloats = 64 / sizeof(float);
      float* raw = at.take(std::int64_t(workspace_bytes / sizeof(float)) + kAlignFloats);
      const auto addr = reinterpret_cast<std::uintptr_t>(raw);
      s.ws = raw == nullptr ? nullptr : reinterpret_cast<void*>((addr + 63) / 64 * 64);
    }
    s.ld_rows = rows_p + kStridePad;
    s.ld_o = dv_padded + kStridePad;
    s.qt = at.take(d * s.ld_rows);
    s.st = tile_by_tile ? at.take(kTileKeys * s.ld_rows) : nullptr;
    s.o = at.take(rows_p * s.ld_o);
    s.m = at.take(rows_p);
    s.l = at.take(rows_p);
    s.alpha = at.take(rows_p);
    s.row = at.take(std::max(d, dv_padded));
    s.terms = row_terms ? at.take(std::int64_t(kMaxSmoothingRuns) * rows_p) : nullptr;
    return s;
  }
};

// The orthogonal map SAGE may turn smoothed queries and keys by (Smoothing's `rotate`): each
// element times a fixed random sign (a hash of its channel), then a Walsh-Hadamard transform
// scaled by 1/sqrt(n) on each block of d: d split into powers of two, largest first (72 = 64 +
// 8, 80 = 64 + 16, 96 = 64 + 32, 40 = 32 + 8; never a padded d). Orthogonal, so q . k is kept
// up to f32 rounding; d log d additions a row. The block is divided by n first (exactly) and
// scaled by sqrt(n) with the last butterfly: no partial sum outgrows the row's largest element,
// so a row near FLT_MAX whose rotation is finite stays finite.
// In smoothing.cpp (in the widest vectors the CPU has).
namespace rotation {
// Rows r < rows of QT [d][ld] (each row's elements a column) in place.
void columns(float* qt, std::int64_t ld, std::int64_t rows, std::int64_t d);
// n rows k [n][ld] (n <= kTileKeys) in place, element for element as columns().
void rows(float* k, std::int64_t ld, std::int64_t n, std::int64_t d);
}  // namespace rotation

// SAGE's smoothing of one key set (FLASH: a segment's keys of one KV head; VIDEO_SPARSE: a batch
// item's visible keys of one KV head) and the queries that see it (docs/semantics.md, "SAGE"),
// computed in f64 only from the rows that count: keys some query of the set can see and query
// rows that are computed (no padding, no key hidden from every query), and of those only the
// finite ones (a NaN or inf row stays where PyTorch shows it, in the rows that see it):
// - the mean key of each run of key tiles (tiles whose means lie close together share one: a
//   run per population, text and image tokens from different projections), subtracted from the
//   run's keys; every logit of a tile of run n >= 1 gets its row's exact term qscale * q .
//   (mean_n - mean_0) added in f32 by the engine (OperandFormats::set_row_terms; row_terms
//   below), and the row's reference (hence its LSE) gets qscale * q . mean_0 back at the end of
//   the item (end_item): one run, the common case, costs the engines nothing;
// - each channel's balance b_e = sqrt(std(q_e) / std(k_e)) with balance_qk, the keys' spread
//   taken within their runs (keys multiplied by b_e, queries divided: the logits are unchanged,
//   the two operands' channels share the int8 range as SmoothQuant shares them), else 1;
// - the mean query mq, subtracted from every query (SageAttention2's Q smoothing): each key's
//   exact share qscale * mq . (k - mean_run) is added to its logits in f32
//   (OperandFormats::set_key_bias).
// So logit = codes' dot + row term + key term, each part exact but the first. With `rotate`
// the smoothed keys and queries are then turned by one orthogonal map (rotation::, smoothing.cpp:
// random signs, then a Walsh-Hadamard transform per power-of-two block of d), which leaves their
// dots as they are and spreads an outlier channel over its block, so that it no longer sets the
// row's scale alone (FlashAttention-3's incoherent processing, QuaRot).
//
// A tile where one population ends and the next begins (77 text tokens, then image tokens) is a
// run of its own whose mean lies between the two; split_tiles() splits its keys in two (2-means)
// where they are far apart, each part a run of its own: the driver packs the tile twice, once
// per part, each copy hiding the other part's keys (KeyTile::hide), so every key is centred on
// its own population's mean at the cost of one more tile per split.
struct Smoothing {
  const float* balance;          // [d]
  const float* q_mean;           // [d]
  const float* means;            // [runs][d]
  const std::int32_t* tile_run;  // per tile of the key set (nullptr: every tile is run 0)
  int runs;
  std::int64_t d;
  bool rotate = false;
  // The 16-bit integer-lane engines' exact channels (kernels.hpp, int16_exact_channels): after
  // the smoothing, channels swaps[2i] and swaps[2i + 1] trade places, in order, in every query
  // and key alike (their dots unchanged), which moves the channels of largest spread to the last
  // places, where those engines keep them exact. None for the others.
  const std::int32_t* swaps = nullptr;
  int swap_count = 0;

  int run_of(std::int64_t tile) const { return tile_run != nullptr ? tile_run[tile] : 0; }

  // The f64 sums a smoothing is computed from: per key tile the sum of its keys, their count
  // and the sum of their squared norms; per channel the sum of squares of all keys, the sum and
  // the sum of squares of the queries, and their count. Rows that are not finite are left out.
  // Sums of parts of the rows (add) give the same smoothing as one pass, up to f64 rounding.
  struct Sums {
    std::vector<double> tile_sum, tile_norms, k_squares, q_sum, q_squares;
    std::vector<std::int64_t> tile_keys;
    std::int64_t queries = 0;

    void reset(std::int64_t d, std::int64_t tiles) {
      tile_sum.assign(std::size_t(d * tiles), 0.0);
      tile_norms.assign(std::size_t(tiles), 0.0);
      tile_keys.assign(std::size_t(tiles), 0);
      for (auto* v : {&k_squares, &q_sum, &q_squares}) v->assign(std::size_t(d), 0.0);
      queries = 0;
    }
    // Whether all d elements are finite (smoothing.cpp, as the three below).
    static bool finite(const float* x, std::int64_t d);
    // Key x (d elements) of tile `tile`, if finite.
    void key(const float* x, std::int64_t d, std::int64_t tile);
    // Query row x (d elements), if finite.
    void query(const float* x, std::int64_t d);
    void add(const Sums& o) {
      for (std::size_t n = 0; n < tile_sum.size(); ++n) tile_sum[n] += o.tile_sum[n];
      for (std::size_t n = 0; n < tile_norms.size(); ++n) {
        tile_norms[n] += o.tile_norms[n];
        tile_keys[n] += o.tile_keys[n];
      }
      for (std::size_t e = 0; e < k_squares.size(); ++e) {
        k_squares[e] += o.k_squares[e];
        q_sum[e] += o.q_sum[e];
        q_squares[e] += o.q_squares[e];
      }
      queries += o.queries;
    }
  };

  // A tile packed twice: its keys whose bit is set in `second` (bit j: key j of the tile) as run
  // `second_run`, the others as the tile's run.
  struct Split {
    std::int64_t tile;
    std::uint64_t second;
    int second_run;
  };

  // A smoothing's storage: balance and mean query, the runs' means, each tile's run, the split
  // tiles, and the keys' mean within-tile variance (over all channels).
  struct Data {
    std::vector<float> floats;  // [d] balance | [d] mean query | [runs][d] means
    std::vector<std::int32_t> tile_run;
    std::vector<Split> splits;
    std::vector<std::int32_t> swaps;  // pairs (Smoothing::swaps)
    double within = 0;
    int runs = 1;
    bool rotate = false;
    Smoothing view(std::int64_t d) const {
      return {floats.data(),
              floats.data() + d,
              floats.data() + 2 * d,
              tile_run.empty() ? nullptr : tile_run.data(),
              runs,
              d,
              rotate,
              swaps.empty() ? nullptr : swaps.data(),
              int(swaps.size() / 2)};
    }
    // No smoothing (means 0, balance 1) over `tiles` tiles: only the rotation, if any.
    void identity(std::int64_t d, std::int64_t tiles) {
      floats.assign(std::size_t(3 * d), 0.0f);
      std::fill(floats.begin(), floats.begin() + d, 1.0f);
      tile_run.assign(std::size_t(tiles), 0);
      splits.clear();
      swaps.clear();
      runs = 1;
    }
  };

  // The smoothing of `sums` into `out`. Runs: consecutive tiles join the current run while
  // their mean lies within a sixteenth of the keys' mean within-tile variance (squared
  // distance, over all channels) of the run's mean: tiles of one population differ only by
  // sampling noise (d / 64 for unit keys, against d), populations by their offsets; at most
  // kMaxSmoothingRuns, the bound relaxed fourfold until they fit (else equal runs of tiles).
  // With `exact` > 0 (the 16-bit integer-lane engines), the `exact` channels of largest spread
  // (the product of the queries' and the keys' standard deviations about their means, which
  // balancing leaves as it is) are moved to the last places (swaps).
  static void finish(const Sums& sums, Data& out, std::int64_t d, bool balance_qk, int exact = 0) {
    out.swaps.clear();
    const std::int64_t tiles = std::int64_t(sums.tile_keys.size());
    std::int64_t keys = 0;
    double within = 0;
    for (std::int64_t t = 0; t < tiles; ++t) {
      const std::int64_t n = sums.tile_keys[std::size_t(t)];
      if (n == 0) continue;
      keys += n;
      double mean_norm = 0;
      for (std::int64_t e = 0; e < d; ++e) {
        const double m = sums.tile_sum[std::size_t(t * d + e)] / double(n);
        mean_norm += m * m;
      }
      within += std::max(sums.tile_norms[std::size_t(t)] - double(n) * mean_norm, 0.0);
    }
    within = keys > 0 ? within / double(keys) : 0.0;
    out.within = within;
    out.splits.clear();
    out.tile_run.assign(std::size_t(tiles), 0);
    thread_local std::vector<double> run_sum;
    int runs = 0;
    const auto form_runs = [&](double bound) {
      runs = 0;
      run_sum.assign(std::size_t(d), 0.0);
      std::int64_t run_keys = 0;
      for (std::int64_t t = 0; t < tiles; ++t) {
        const std::int64_t n = sums.tile_keys[std::size_t(t)];
        const double* ts = sums.tile_sum.data() + t * d;
        if (n > 0 && run_keys > 0) {
          double dist = 0;
          for (std::int64_t e = 0; e < d; ++e) {
            const double diff = ts[e] / double(n) - run_sum[std::size_t(e)] / double(run_keys);
            dist += diff * diff;
          }
          if (!(dist <= bound)) {
            ++runs;
            run_keys = 0;
            std::fill(run_sum.begin(), run_sum.end(), 0.0);
          }
        }
        for (std::int64_t e = 0; e < d; ++e) run_sum[std::size_t(e)] += ts[e];
        run_keys += n;
        out.tile_run[std::size_t(t)] = runs;
      }
      ++runs;
    };
    double bound = within / 16.0;
    form_runs(bound);
    for (int attempt = 0; attempt < 8 && runs > kMaxSmoothingRuns; ++attempt)
      form_runs(bound *= 4.0);
    if (runs > kMaxSmoothingRuns) {  // equal runs of tiles
      for (std::int64_t t = 0; t < tiles; ++t)
        out.tile_run[std::size_t(t)] = std::int32_t(t * kMaxSmoothingRuns / tiles);
      runs = int(std::min<std::int64_t>(tiles, kMaxSmoothingRuns));
    }
    out.runs = runs;
    out.floats.assign(std::size_t((2 + runs) * d), 0.0f);
    float* balance = out.floats.data();
    float* q_mean = balance + d;
    float* means = q_mean + d;
    // The runs' means, and the keys' squares about them per channel (within-run spread).
    std::vector<double> run_squares(std::size_t(d), 0.0);
    {
      std::vector<double> sum(std::size_t(runs) * std::size_t(d), 0.0);
      std::vector<std::int64_t> count(std::size_t(runs), 0);
      for (std::int64_t t = 0; t < tiles; ++t) {
        const std::size_t r = std::size_t(out.tile_run[std::size_t(t)]);
        count[r] += sums.tile_keys[std::size_t(t)];
        for (std::int64_t e = 0; e < d; ++e)
          sum[r * std::size_t(d) + std::size_t(e)] += sums.tile_sum[std::size_t(t * d + e)];
      }
      for (std::size_t r = 0; r < std::size_t(runs); ++r) {
        if (count[r] == 0) continue;
        for (std::int64_t e = 0; e < d; ++e) {
          const double m = sum[r * std::size_t(d) + std::size_t(e)] / double(count[r]);
          means[r * std::size_t(d) + std::size_t(e)] = float(m);
          run_squares[std::size_t(e)] += double(count[r]) * m * m;
        }
      }
    }
    std::fill(balance, balance + d, 1.0f);
    if (sums.queries == 0) return;
    for (std::int64_t e = 0; e < d; ++e) {
      const std::size_t c = std::size_t(e);
      const double qm = sums.q_sum[c] / double(sums.queries);
      q_mean[e] = float(qm);
      if (!balance_qk || keys == 0) continue;
      const double k_var = std::max(sums.k_squares[c] - run_squares[c], 0.0) / double(keys);
      const double q_var = std::max(sums.q_squares[c] / double(sums.queries) - qm * qm, 0.0);
      const double b = std::sqrt(std::sqrt(q_var) / std::sqrt(k_var));
      if (std::isfinite(b) && b > 0x1p-20 && b < 0x1p20) balance[e] = float(b);
    }
    if (exact > 0 && exact < d && keys > 0) choose_exact(sums, run_squares, keys, d, exact, out);
  }

  // finish()'s exact channels: the `exact` largest spreads (ties: the lower channel), moved to
  // places d - exact, ..., d - 1 in that order by swaps.
  static void choose_exact(const Sums& sums, const std::vector<double>& run_squares,
                           std::int64_t keys, std::int64_t d, int exact, Data& out) {
    std::vector<double> spread(std::size_t(d), 0.0);
    for (std::int64_t e = 0; e < d; ++e) {
      const std::size_t c = std::size_t(e);
      const double qm = sums.q_sum[c] / double(sums.queries);
      const double k_var = std::max(sums.k_squares[c] - run_squares[c], 0.0) / double(keys);
      const double q_var = std::max(sums.q_squares[c] / double(sums.queries) - qm * qm, 0.0);
      spread[c] = std::sqrt(q_var * k_var);
      if (!std::isfinite(spread[c])) spread[c] = 0.0;
    }
    std::vector<std::int32_t> order(static_cast<std::size_t>(d));
    for (std::int64_t e = 0; e < d; ++e) order[std::size_t(e)] = std::int32_t(e);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      return spread[std::size_t(a)] > spread[std::size_t(b)];
    });
    // where[c]: the place channel c is at; at[p]: the channel at place p.
    std::vector<std::int32_t> where(order.size()), at(order.size());
    for (std::int64_t e = 0; e < d; ++e)
      where[std::size_t(e)] = at[std::size_t(e)] = std::int32_t(e);
    for (int t = 0; t < exact; ++t) {
      const std::int32_t c = order[std::size_t(t)];
      const std::int32_t from = where[std::size_t(c)], to = std::int32_t(d - exact + t);
      if (from == to) continue;
      const std::int32_t other = at[std::size_t(to)];
      std::swap(at[std::size_t(from)], at[std::size_t(to)]);
      where[std::size_t(c)] = to;
      where[std::size_t(other)] = from;
      out.swaps.push_back(from);
      out.swaps.push_back(to);
    }
  }

  // Splits the tiles that are runs of their own between two runs (at most kMaxSplitTiles, while
  // runs are left): load(tile, rows, counts) writes the tile's keys as f32 rows [kTileKeys][d]
  // and whether each counts (seen and finite), and returns how many keys the tile has. The
  // parts are 2-means clusters of the keys that count (seeded with the key farthest from the
  // tile's mean and the key farthest from that one), kept where their means lie further apart
  // than half the keys' within-tile spread (a quarter of the variance): noise is split at a
  // fraction of that (2.5 sigma^2 against d sigma^2). Keys that do not count stay in the first
  // part.
  template <class Load>
  static void split_tiles(Data& out, std::int64_t d, Load&& load, float* rows) {
    const std::int64_t tiles = std::int64_t(out.tile_run.size());
    if (out.runs < 2) return;
    const auto run = [&](std::int64_t t) { return out.tile_run[std::size_t(t)]; };
    for (std::int64_t t = 0; t < tiles && int(out.splits.size()) < kMaxSplitTiles; ++t) {
      if (out.runs >= kMaxSmoothingRuns) return;
      if ((t > 0 && run(t - 1) == run(t)) || (t + 1 < tiles && run(t + 1) == run(t))) continue;
      bool counts[kTileKeys];
      const int n = load(t, rows, counts);
      std::vector<double> c[2] = {std::vector<double>(std::size_t(d), 0.0),
                                  std::vector<double>(std::size_t(d), 0.0)};
      const auto dist = [&](const float* x, const std::vector<double>& y) {
        double s = 0;
        for (std::int64_t e = 0; e < d; ++e)
          s += (x[e] - y[std::size_t(e)]) * (x[e] - y[std::size_t(e)]);
        return s;
      };
      int live = 0;
      for (int j = 0; j < n; ++j) {
        if (!counts[j]) continue;
        ++live;
        for (std::int64_t e = 0; e < d; ++e) c[0][std::size_t(e)] += rows[j * d + e];
      }
      if (live < 2) continue;
      for (double& x : c[0]) x /= live;
      const auto farthest = [&](const std::vector<double>& from) {
        int best = -1;
        double far = -1;
        for (int j = 0; j < n; ++j)
          if (counts[j] && dist(rows + j * d, from) > far) far = dist(rows + j * d, from), best = j;
        return best;
      };
      const int a = farthest(c[0]);
      for (std::int64_t e = 0; e < d; ++e) c[0][std::size_t(e)] = rows[a * d + e];
      const int b = farthest(c[0]);
      for (std::int64_t e = 0; e < d; ++e) c[1][std::size_t(e)] = rows[b * d + e];
      std::uint64_t second = 0;
      for (int iteration = 0; iteration < 8; ++iteration) {
        std::uint64_t next = 0;
        for (int j = 0; j < n; ++j)
          if (counts[j] && dist(rows + j * d, c[1]) < dist(rows + j * d, c[0]))
            next |= std::uint64_t(1) << j;
        if (iteration > 0 && next == second) break;
        second = next;
        int count[2] = {0, 0};
        for (auto& x : c) std::fill(x.begin(), x.end(), 0.0);
        for (int j = 0; j < n; ++j) {
          if (!counts[j]) continue;
          const int part = (second >> j) & 1;
          ++count[part];
          for (std::int64_t e = 0; e < d; ++e) c[part][std::size_t(e)] += rows[j * d + e];
        }
        if (count[0] == 0 || count[1] == 0) {
          second = 0;
          break;
        }
        for (int p = 0; p < 2; ++p)
          for (double& x : c[p]) x /= count[p];
      }
      if (second == 0) continue;
      double apart = 0;
      for (std::int64_t e = 0; e < d; ++e)
        apart += (c[0][std::size_t(e)] - c[1][std::size_t(e)]) *
                 (c[0][std::size_t(e)] - c[1][std::size_t(e)]);
      if (!(apart > out.within / 4.0)) continue;
      const int first = run(t), extra = out.runs++;
      out.floats.resize(std::size_t((2 + out.runs) * d));
      float* means = out.floats.data() + 2 * d;
      for (std::int64_t e = 0; e < d; ++e) {
        means[first * d + e] = float(c[0][std::size_t(e)]);
        means[extra * d + e] = float(c[1][std::size_t(e)]);
      }
      out.splits.push_back({t, second, extra});
    }
  }

  // n keys k [n][ld] of run `run` become (k - mean_run) * balance, rotated with `rotate`;
  // bias[j] = qscale * q_mean . (k_j - mean_run), each key's share of the mean query in natural
  // units (smoothing.cpp).
  void keys(float* k, std::int64_t ld, std::int64_t n, float qscale, float* bias, int run) const;

  // The row terms of QT [d][ld] (the queries as they are, before queries()), in f32, for rows
  // r < rows_p: terms[r] = qscale * q_r . mean_0 (what end_item restores) and terms[n * rows_p
  // + r] = qscale * q_r . (mean_n - mean_0) for every run n >= 1 (smoothing.cpp).
  void row_terms(const float* qt, std::int64_t ld, std::int64_t rows_p, float qscale,
                 float* terms) const;

  // QT [d][ld] (rows r < rows) becomes (q - q_mean) * (1 / balance), rotated with `rotate`
  // (smoothing.cpp).
  void queries(float* qt, std::int64_t ld, std::int64_t rows) const;
};

// Begins a work item of `rows` rows on `kk`: QT [d][ld_rows] from load_query(r, dst, scale)
// (row r's d elements times `scale`: the softmax scale `qscale` for the f32 engines, 1 for
// engines with their own formats, which scale the logits after the dot products), padding rows
// zero, smoothed by `smoothing` when given (its row terms to the engine's set_row_terms),
// packed by the engine's pack_q; O, m and l set to zeros, -inf and zeros. Returns the item's
// state for the engine's inner loop.
template <class LoadQuery>
ItemState begin_item(const TileKernels& kk, const ItemShape& shape, const ItemScratch& s,
                     std::int64_t rows, std::int64_t ld_k, std::int64_t ld_v, float qscale,
                     const Smoothing* smoothing, LoadQuery&& load_query) {
  const std::int64_t d = shape.d, rows_p = round_up(rows, kk.row_align);
  const float scale = kk.formats.pack_q != nullptr ? 1.0f : qscale;
  for (std::int64_t r = 0; r < rows; ++r) {
    load_query(r, s.row, scale);
    for (std::int64_t e = 0; e < d; ++e) s.qt[e * s.ld_rows + r] = s.row[e];
  }
  for (std::int64_t e = 0; e < d; ++e)
    std::fill(s.qt + e * s.ld_rows + rows, s.qt + (e + 1) * s.ld_rows, 0.0f);
  const bool terms = smoothing != nullptr && s.terms != nullptr;
  if (terms) smoothing->row_terms(s.qt, s.ld_rows, rows_p, qscale, s.terms);
  if (smoothing != nullptr) smoothing->queries(s.qt, s.ld_rows, rows);
  if (kk.formats.pack_q != nullptr)
    kk.formats.pack_q(s.qt, s.ld_rows, int(rows_p), int(d), int(shape.dv_padded), qscale, s.ws);
  if (kk.formats.set_row_terms != nullptr)
    kk.formats.set_row_terms(s.ws, terms ? s.terms : nullptr);
  std::fill(s.m, s.m + rows_p, -std::numeric_limits<float>::infinity());
  std::fill(s.l, s.l + rows_p, 0.0f);
  std::fill(s.o, s.o + rows_p * s.ld_o, 0.0f);
  return {s.qt, s.st,    s.ld_rows, s.o,         s.ld_o, s.m,
          s.l,  s.alpha, int(rows), int(rows_p), int(d), int(shape.dv_padded),
          ld_k, ld_v,    s.ws};
}

// Ends a work item begun with `smoothing`: the rows' references get run 0's terms back (the
// shift the smoothed keys took from every logit of the row).
inline void end_item(const ItemScratch& s, std::int64_t rows, const Smoothing* smoothing) {
  if (smoothing == nullptr || s.terms == nullptr) return;
  for (std::int64_t r = 0; r < rows; ++r)
    if (std::isfinite(s.m[r])) s.m[r] += s.terms[r];
}

// Packs n keys staged as f32 rows (K [n][ld_k], V [n][ld_v], V's columns past dv zero) into the
// engine's tile at `at` (K, then V from k_tile_bytes on); with `smoothing` the keys are smoothed
// by the mean of run `run` first, and their shares of the mean query and the run go to the
// engine's set_key_bias.
inline void pack_key_tile(const TileKernels& kk, float* k, std::int64_t ld_k, const float* v,
                          std::int64_t ld_v, std::int64_t n, std::int64_t d, std::int64_t dv_padded,
                          std::size_t k_tile_bytes, const Smoothing* smoothing, int run,
                          float qscale, unsigned char* at) {
  float bias[kTileKeys];
  if (smoothing != nullptr) smoothing->keys(k, ld_k, n, qscale, bias, run);
  kk.formats.pack_k(k, ld_k, int(n), int(d), at);
  if (smoothing != nullptr && kk.formats.set_key_bias != nullptr)
    kk.formats.set_key_bias(at, bias, int(n), run);
  kk.formats.pack_v(v, ld_v, int(n), int(dv_padded), at + k_tile_bytes);
}

// Non-finite V rows (docs/semantics.md, "Finite masks and non-finite inputs"): a key whose V row
// holds a NaN or an inf is packed with that row as zeros, and the logits hook makes every logit
// of it that a row can see NaN. The rows that attend it come out NaN (the row rule: NaN with LSE
// NaN), as they would with the value packed; the rows it is hidden from, whose probability for
// it is 0, stay exact, where 0 x NaN would have made them NaN too. Finding the rows costs a scan
// of the staged rows, which packing has just written (in cache); only tiles that hold one take
// the hook.

// The rows among n staged f32 rows v [n][ld] (`width` elements each) that hold a NaN or an inf,
// as bits (bit jj: row jj), each of them set to zeros.
inline std::uint64_t zero_nonfinite_rows(float* v, std::int64_t ld, std::int64_t n,
                                         std::int64_t width) {
  std::uint64_t rows = 0;
  for (std::int64_t jj = 0; jj < n; ++jj) {
    float* row = v + jj * ld;
    // A float is NaN or inf when its exponent bits are all ones: |bits| > the largest finite.
    std::int32_t worst = 0;
    for (std::int64_t e = 0; e < width; ++e) {
      std::int32_t bits;
      std::memcpy(&bits, row + e, sizeof bits);
      worst = std::max(worst, bits & 0x7fffffff);
    }
    if (worst <= 0x7f7fffff) continue;
    rows |= std::uint64_t(1) << jj;
    std::fill(row, row + width, 0.0f);
  }
  return rows;
}

// The hook's part for such keys: every logit of a key in `keys` (bit jj) that a row can see (not
// -inf: call it after the hook has hidden what it hides) becomes NaN, on the engine's layout
// st[r * rs + jj * ks].
inline void poison_visible(std::uint64_t keys, float* st, std::int64_t rows, std::int64_t rs,
                           std::int64_t ks) {
  for (; keys != 0; keys &= keys - 1) {
    const int jj = std::countr_zero(keys);
    for (std::int64_t r = 0; r < rows; ++r) {
      float& x = st[r * rs + jj * ks];
      if (x != -std::numeric_limits<float>::infinity()) x = std::numeric_limits<float>::quiet_NaN();
    }
  }
}

// One thread of a driver's parallel region: its scratch and its view of the region's fault.
class DriverThread {
 public:
  explicit DriverThread(detail::ParallelFault& fault) : fault_(fault) {}

  float* scratch() const { return scratch_; }
  std::int64_t* row_ends() const { return row_ends_; }

  // A work-sharing loop over [begin, end) (dynamic schedule, `chunk` iterations at a time):
  // every thread of the region must reach it; past a fault the work is skipped, never the loop.
  template <class Work>
  void loop(std::int64_t begin, std::int64_t end, int chunk, Work&& work) {
#pragma omp for schedule(dynamic, chunk)
    for (std::int64_t n = begin; n < end; ++n) fault_.run([&] { work(n); });
  }

  // `body` (which runs the engine's inner loop) between the engine's per-thread set-up and
  // tear-down (AMX: the tile configuration); the set-up is skipped once the region has failed.
  template <class Body>
  void with_engine(const TileKernels& kk, Body&& body) {
    const bool set_up = kk.loop.thread_begin != nullptr && !fault_.failed();
    if (set_up) kk.loop.thread_begin();
    body();
    if (set_up && kk.loop.thread_end != nullptr) kk.loop.thread_end();
  }

 private:
  template <class Body>
  friend void run_parallel(int threads, std::size_t floats, std::size_t row_ends, Body&& body);

  detail::ParallelFault& fault_;
  float* scratch_ = nullptr;
  std::int64_t* row_ends_ = nullptr;
};

// Runs body(DriverThread&) on `threads` threads, each with `floats` floats of scratch (leased
// for the region from the process's buffers, core/process_memory.hpp: no thread keeps one
// between calls) and `row_ends` int64 of per-row key ends (grown per thread, kept between calls:
// a few KiB). A fault inside the region (a buffer that cannot be had, say) is kept and rethrown
// after it; the rows computed so far stay written (docs/semantics.md, "Faults").
template <class Body>
void run_parallel(int threads, std::size_t floats, std::size_t row_ends, Body&& body) {
  detail::ParallelFault fault;
#pragma omp parallel num_threads(threads)
  {
    DriverThread thread(fault);
    detail::ProcessMemory::Lease scratch;
    fault.run([&] {
      scratch = detail::ProcessMemory::instance().lease(floats * sizeof(float));
      thread.scratch_ = scratch.as<float>();
      thread_local std::vector<std::int64_t> ends;
      if (ends.size() < row_ends) ends.resize(row_ends);
      thread.row_ends_ = ends.data();
    });
    body(thread);
  }
  fault.rethrow();
}

}  // namespace dattn::flash
