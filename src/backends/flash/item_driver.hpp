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
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "backends/flash/kernels.hpp"
#include "backends/flash/tile_io.hpp"
#include "backends/flash/tile_plan.hpp"
#include "core/parallel_fault.hpp"

namespace dattn::flash {

// One work item's scratch (strides padded by kStridePad): QT [d][ld_rows], S^T of one tile for
// the tile-by-tile engines (engines with their own inner loop keep their logits in their
// workspace), O [rows_p][ld_o], m, l and alpha per row, a row of max(d, dv) floats, and the
// engine's workspace (64-byte aligned; null for the f32 engines).
struct ItemScratch {
  float *qt, *st, *o, *m, *l, *alpha, *row;
  void* ws;
  std::int64_t ld_rows, ld_o;
};

// What every item scratch of a plan is carved for: up to rows_p rows (a multiple of the
// engine's row_align), head sizes d and dv_padded, the engine's workspace.
struct ItemShape {
  std::int64_t rows_p = 0, d = 0, dv_padded = 0;
  std::size_t workspace_bytes = 0;
  bool tile_by_tile = true;

  static ItemShape of(const TileKernels& kk, std::int64_t rows, std::int64_t d,
                      std::int64_t dv_padded) {
    ItemShape s;
    s.rows_p = round_up(rows, kk.row_align);
    s.d = d;
    s.dv_padded = dv_padded;
    if (kk.formats.workspace_bytes != nullptr)
      s.workspace_bytes = kk.formats.workspace_bytes(int(s.rows_p), int(d), int(dv_padded));
    s.tile_by_tile = kk.loop.tile_by_tile();
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
    return s;
  }
};

// SAGE's smoothing of one key set (FLASH: a segment's keys of one KV head; VIDEO_SPARSE: a batch
// item's visible keys of one KV head) and the queries that see it (docs/semantics.md, "SAGE"):
// d floats each of
// - the mean key mk, subtracted from every key (softmax ignores a shift shared by a row's logits;
//   the row's reference, hence its LSE, gets q . mk back: restore);
// - each channel's balance b_e = sqrt(std(q_e) / std(k_e)) with balance_qk (keys multiplied by
//   b_e, queries divided: the logits are unchanged, the two operands' channels share the int8
//   range as SmoothQuant shares them), else 1;
// - the mean query mq, subtracted from every query (SageAttention2's Q smoothing): each key's
//   exact share mq . (k - mk) is added to its logits in f32 (OperandFormats::set_key_bias).
// Computed in f64. A key that is not finite turns all three off (the mean would spread it over
// every key: the rows that see it show it, as unsmoothed), a query that is not finite the
// balance and the mean query.
struct Smoothing {
  static constexpr std::size_t kFloatsPerChannel = 3;
  const float *mean, *balance, *q_mean;
  std::int64_t d;

  // The smoothing stored at `at` (kFloatsPerChannel * d floats).
  static Smoothing at(const float* at, std::int64_t d) { return {at, at + d, at + 2 * d, d}; }

  // The f64 sums a smoothing is computed from: per channel the sum and the sum of squares of
  // the keys and of the queries, their counts, and whether every element was finite. Sums of
  // parts of the rows (Sums::add) give the same smoothing as one pass, up to f64 rounding.
  struct Sums {
    std::vector<double> k_sum, k_squares, q_sum, q_squares;
    std::int64_t keys = 0, queries = 0;
    bool k_finite = true, q_finite = true;

    void reset(std::int64_t d) {
      for (auto* v : {&k_sum, &k_squares, &q_sum, &q_squares}) v->assign(std::size_t(d), 0.0);
      keys = queries = 0;
      k_finite = q_finite = true;
    }
    // One row (d elements) into the key or the query sums.
    void row(const float* x, std::int64_t d, bool key) {
      std::vector<double>& sum = key ? k_sum : q_sum;
      std::vector<double>& squares = key ? k_squares : q_squares;
      bool finite = true;
      for (std::int64_t e = 0; e < d; ++e) {
        finite = finite && std::isfinite(x[e]);
        sum[std::size_t(e)] += x[e];
        squares[std::size_t(e)] += double(x[e]) * x[e];
      }
      (key ? k_finite : q_finite) &= finite;
      ++(key ? keys : queries);
    }
    void add(const Sums& o) {
      for (std::size_t e = 0; e < k_sum.size(); ++e) {
        k_sum[e] += o.k_sum[e];
        k_squares[e] += o.k_squares[e];
        q_sum[e] += o.q_sum[e];
        q_squares[e] += o.q_squares[e];
      }
      keys += o.keys;
      queries += o.queries;
      k_finite = k_finite && o.k_finite;
      q_finite = q_finite && o.q_finite;
    }
  };

  // The smoothing of `sums` into `out` (kFloatsPerChannel * d floats).
  static void finish(const Sums& sums, float* out, std::int64_t d, bool balance_qk) {
    float* mean = out;
    float* balance = out + d;
    float* q_mean = out + 2 * d;
    const bool finite = sums.k_finite;
    const double n = double(std::max<std::int64_t>(sums.keys, 1));
    for (std::int64_t e = 0; e < d; ++e)
      mean[e] = finite ? float(sums.k_sum[std::size_t(e)] / n) : 0.0f;
    std::fill(balance, balance + d, 1.0f);
    std::fill(q_mean, q_mean + d, 0.0f);
    if (!finite || !sums.q_finite || sums.queries == 0) return;
    for (std::int64_t e = 0; e < d; ++e) {
      const std::size_t c = std::size_t(e);
      const double m = sums.k_sum[c] / n, qm = sums.q_sum[c] / double(sums.queries);
      q_mean[e] = float(qm);
      if (!balance_qk) continue;
      const double k_var = std::max(sums.k_squares[c] / n - m * m, 0.0);
      const double q_var = std::max(sums.q_squares[c] / double(sums.queries) - qm * qm, 0.0);
      const double b = std::sqrt(std::sqrt(q_var) / std::sqrt(k_var));
      if (std::isfinite(b) && b > 0x1p-20 && b < 0x1p20) balance[e] = float(b);
    }
  }

  // Computes the smoothing into `out` in one pass from `keys` key rows (load_key(j, dst) writes
  // key j's d elements as f32) and `queries` query rows (load_query(i, dst) likewise); `row` is
  // scratch of d floats.
  template <class LoadKey, class LoadQuery>
  static void compute(float* out, std::int64_t d, bool balance_qk, std::int64_t keys,
                      LoadKey&& load_key, std::int64_t queries, LoadQuery&& load_query,
                      float* row) {
    thread_local Sums sums;
    sums.reset(d);
    for (std::int64_t j = 0; j < keys && sums.k_finite; ++j) {
      load_key(j, row);
      sums.row(row, d, true);
    }
    for (std::int64_t i = 0; i < queries && sums.k_finite && sums.q_finite; ++i) {
      load_query(i, row);
      sums.row(row, d, false);
    }
    finish(sums, out, d, balance_qk);
  }

  // n keys k [n][ld] become (k - mean) * balance; bias[j] = qscale * q_mean . (k_j - mean), each
  // key's share of the mean query in natural units.
  void keys(float* k, std::int64_t ld, std::int64_t n, float qscale, float* bias) const {
    for (std::int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (std::int64_t e = 0; e < d; ++e) {
        const float centred = k[j * ld + e] - mean[e];
        dot += double(q_mean[e]) * centred;
        k[j * ld + e] = centred * balance[e];
      }
      bias[j] = float(double(qscale) * dot);
    }
  }

  // QT [d][ld] (rows r < rows) becomes (q - q_mean) / balance.
  void queries(float* qt, std::int64_t ld, std::int64_t rows) const {
    for (std::int64_t e = 0; e < d; ++e)
      for (std::int64_t r = 0; r < rows; ++r)
        qt[e * ld + r] = (qt[e * ld + r] - q_mean[e]) / balance[e];
  }

  // Smoothed keys moved every logit of row r by -qscale q_r . mean: the output is the same, the
  // row's reference m[r] (hence its LSE) gets it back. qt holds the smoothed queries
  // ((q - q_mean) / balance), so q . mean = qt . (mean * balance) + q_mean . mean.
  void restore(const float* qt, std::int64_t ld, std::int64_t rows, float qscale, float* m) const {
    double shared = 0;
    for (std::int64_t e = 0; e < d; ++e) shared += double(q_mean[e]) * mean[e];
    for (std::int64_t r = 0; r < rows; ++r) {
      if (!std::isfinite(m[r])) continue;
      double dot = shared;
      for (std::int64_t e = 0; e < d; ++e)
        dot += double(qt[e * ld + r]) * (double(mean[e]) * balance[e]);
      m[r] = float(double(m[r]) + double(qscale) * dot);
    }
  }
};

// Begins a work item of `rows` rows on `kk`: QT [d][ld_rows] from load_query(r, dst, scale)
// (row r's d elements times `scale`: the softmax scale `qscale` for the f32 engines, 1 for
// engines with their own formats, which scale the logits after the dot products), padding rows
// zero, smoothed by `smoothing` when given, packed by the engine's pack_q; O, m and l set to
// zeros, -inf and zeros. Returns the item's state for the engine's inner loop.
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
  if (smoothing != nullptr) smoothing->queries(s.qt, s.ld_rows, rows);
  if (kk.formats.pack_q != nullptr)
    kk.formats.pack_q(s.qt, s.ld_rows, int(rows_p), int(d), int(shape.dv_padded), qscale, s.ws);
  std::fill(s.m, s.m + rows_p, -std::numeric_limits<float>::infinity());
  std::fill(s.l, s.l + rows_p, 0.0f);
  std::fill(s.o, s.o + rows_p * s.ld_o, 0.0f);
  return {s.qt, s.st,    s.ld_rows, s.o,         s.ld_o, s.m,
          s.l,  s.alpha, int(rows), int(rows_p), int(d), int(shape.dv_padded),
          ld_k, ld_v,    s.ws};
}

// Ends a work item begun with `smoothing`: the rows' references get the smoothing's shift back.
inline void end_item(const ItemScratch& s, std::int64_t rows, float qscale,
                     const Smoothing* smoothing) {
  if (smoothing != nullptr) smoothing->restore(s.qt, s.ld_rows, rows, qscale, s.m);
}

// Packs n keys staged as f32 rows (K [n][ld_k], V [n][ld_v], V's columns past dv zero) into the
// engine's tile at `at` (K, then V from k_tile_bytes on); with `smoothing` the keys are smoothed
// first and their shares of the mean query go to the engine's set_key_bias.
inline void pack_key_tile(const TileKernels& kk, float* k, std::int64_t ld_k, const float* v,
                          std::int64_t ld_v, std::int64_t n, std::int64_t d, std::int64_t dv_padded,
                          std::size_t k_tile_bytes, const Smoothing* smoothing, float qscale,
                          unsigned char* at) {
  float bias[kTileKeys];
  if (smoothing != nullptr) smoothing->keys(k, ld_k, n, qscale, bias);
  kk.formats.pack_k(k, ld_k, int(n), int(d), at);
  if (smoothing != nullptr && kk.formats.set_key_bias != nullptr)
    kk.formats.set_key_bias(at, bias, int(n));
  kk.formats.pack_v(v, ld_v, int(n), int(dv_padded), at + k_tile_bytes);
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

// Runs body(DriverThread&) on `threads` threads, each with `floats` floats of scratch and
// `row_ends` int64 of per-row key ends (grown per thread, kept between calls). A fault inside
// the region (a buffer that cannot grow, say) is kept and rethrown after it; the rows computed
// so far stay written (docs/semantics.md, "Faults").
template <class Body>
void run_parallel(int threads, std::size_t floats, std::size_t row_ends, Body&& body) {
  detail::ParallelFault fault;
#pragma omp parallel num_threads(threads)
  {
    DriverThread thread(fault);
    fault.run([&] {
      thread.scratch_ = thread_floats(floats);
      thread_local std::vector<std::int64_t> ends;
      if (ends.size() < row_ends) ends.resize(row_ends);
      thread.row_ends_ = ends.data();
    });
    body(thread);
  }
  fault.rethrow();
}

}  // namespace dattn::flash
