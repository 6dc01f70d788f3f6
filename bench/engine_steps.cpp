// One work item of an engine's inner loop, step by step: Q.K^T, the softmax and P.V (the steps of
// kernels.hpp's attend_tile_by_tile) on one thread over `tiles` K/V tiles of 64 keys that stay
// hot in L2, timed apart, for engines named on the command line and measured in interleaved
// rounds (best of each). N(0, 1) inputs, the SAGE engines' operands packed once outside the
// timing. What `dattn bench` cannot show: where the engine's time goes inside an item, against
// the FMA / integer-dot rates `dattn info` measures.
//
//   bench_engine_steps [--rows 256] [--d 128] [--tiles 16] [--rounds 5] ENGINE[:PV_DTYPE]...
//   bench_engine_steps --row-softmax [--rows 256] [--tiles 8] [--rounds 5] ENGINE...
//
// ENGINE is an engine of `dattn info` (emulated twins included); a SAGE engine takes
// :auto, :int16, :int8, :bf16 or :f32 for its P.V (default auto). GFLOP/s count 4 rows x keys x d
// per item (2 for Q.K^T, 2 for P.V); a step's figure is its half at that step's time. With an
// integer P.V (:int8, :int16, and auto where it takes one) the softmax step also makes P's codes.
//
// --row-softmax times the engine's row softmax instead (RowSoftmax: the amx engines' softmax over
// a panel of `tiles` key tiles; N(0, 1) dot products scaled in the exponent), softmax_rows_pairs
// and softmax_rows, in nanoseconds per 16 logits (best of the rounds).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "backends/flash/engines.hpp"
#include "backends/flash/kernels.hpp"

namespace {
using namespace dattn::flash;

struct Item {
  std::string label;
  const TileKernels* kk;
  std::vector<unsigned char> ws;
  std::vector<std::vector<unsigned char>> k_tiles, v_tiles;
  double best[4] = {1e300, 1e300, 1e300, 1e300};  // item, qk, softmax, pv (seconds)
};

void* aligned64(std::vector<unsigned char>& b) {
  const auto p = reinterpret_cast<std::uintptr_t>(b.data());
  return reinterpret_cast<void*>((p + 63) / 64 * 64);
}

PvDtype pv_of(std::string_view s) {
  if (s == "auto") return PvDtype::automatic;
  if (s == "int16") return PvDtype::int16;
  if (s == "int8") return PvDtype::int8;
  if (s == "bf16") return PvDtype::bf16;
  if (s == "f32") return PvDtype::f32;
  throw std::invalid_argument("pv_dtype must be auto, int16, int8, bf16 or f32, not " +
                              std::string(s));
}

int usage() {
  std::fprintf(stderr,
               "usage: bench_engine_steps [--rows N] [--d N] [--tiles N] [--rounds N] "
               "ENGINE[:PV_DTYPE]...\n"
               "       bench_engine_steps --row-softmax [--rows N] [--tiles N] [--rounds N] "
               "ENGINE...\n");
  return 2;
}

// --row-softmax: RowSoftmax's two functions on rows x keys logits, interleaved over the engines.
int time_row_softmax(const std::vector<std::string>& names, int rows, int keys, int rounds) {
  const int kp = (keys + 15) / 16 * 16, pairs = ((keys + 1) / 2 + 15) / 16 * 16;
  const std::int64_t lds = kp + 16, ldp = pairs + 16;
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::vector<float> logits(std::size_t(rows) * lds);
  for (float& x : logits) x = normal(gen) * 11.3f;  // dot products of N(0, 1) rows, d 128
  const float scale = 1.0f / std::sqrt(128.0f);
  std::vector<float> s(logits.size()), m(rows), l(rows), alpha(rows);
  std::vector<std::uint32_t> p(std::size_t(rows) * ldp);
  std::vector<std::array<double, 2>> best(names.size(), {1e300, 1e300});
  using clock = std::chrono::steady_clock;
  for (int round = 0; round < rounds; ++round)
    for (std::size_t i = 0; i < names.size(); ++i) {
      const RowSoftmax& rs = engine_named(names[i], "engine").kernels().row_softmax;
      for (int which = 0; which < 2; ++which)
        for (int rep = 0; rep < 16; ++rep) {
          std::copy(logits.begin(), logits.end(), s.begin());
          std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
          std::fill(l.begin(), l.end(), 0.0f);
          const auto t0 = clock::now();
          if (which == 0)
            rs.softmax_rows_pairs(s.data(), lds, rows, keys, scale, true, m.data(), l.data(),
                                  alpha.data(), p.data(), ldp, pairs);
          else
            rs.softmax_rows(s.data(), lds, rows, keys, scale, true, m.data(), l.data(),
                            alpha.data());
          best[i][which] =
              std::min(best[i][which], std::chrono::duration<double>(clock::now() - t0).count());
        }
    }
  std::printf(
      "row softmax: %d rows x %d keys (raw dot products), 1 thread, best of %d rounds x 16\n", rows,
      keys, rounds);
  std::printf("%-22s %22s %22s\n", "engine", "pairs ns/16 logits", "f32 ns/16 logits");
  const double groups = double(rows) * kp / 16.0;
  for (std::size_t i = 0; i < names.size(); ++i)
    std::printf("%-22s %22.2f %22.2f\n", names[i].c_str(), best[i][0] * 1e9 / groups,
                best[i][1] * 1e9 / groups);
  return 0;
}
}  // namespace

int main(int argc, char** argv) try {
  int rows = 256, d = 128, tiles = 16, rounds = 5;
  bool row_softmax = false, tiles_given = false;
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--row-softmax") {
      row_softmax = true;
    } else if ((a == "--rows" || a == "--d" || a == "--tiles" || a == "--rounds") && i + 1 < argc) {
      const int v = std::atoi(argv[++i]);
      if (v <= 0) return usage();
      (a == "--rows" ? rows : a == "--d" ? d : a == "--tiles" ? tiles : rounds) = v;
      tiles_given = tiles_given || a == "--tiles";
    } else if (!a.empty() && a[0] != '-') {
      names.push_back(a);
    } else {
      return usage();
    }
  }
  if (names.empty()) return usage();
  if (row_softmax)
    return time_row_softmax(names, rows, (tiles_given ? tiles : 8) * kTileKeys, rounds);
  constexpr int keys = kTileKeys;
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  const std::int64_t ldkv = d + 16;
  std::vector<float> k(std::size_t(tiles) * keys * ldkv), v(k.size());
  for (float& x : k) x = normal(gen);
  for (float& x : v) x = normal(gen);

  std::vector<Item> items;
  for (const std::string& n : names) {
    const std::size_t colon = n.find(':');
    const Engine& e = engine_named(n.substr(0, colon), "engine");
    Item it;
    it.label = n;
    it.kk = e.compute == ComputeDtype::int8
                ? &int8_engine_kernels(e, colon == std::string::npos
                                              ? PvDtype::automatic
                                              : pv_of(std::string_view(n).substr(colon + 1)))
                : &e.kernels();
    items.push_back(std::move(it));
  }
  // Per engine: rows padded to its row alignment, Q^T, scratch, packed tiles.
  struct Buffers {
    int rows_p;
    std::int64_t ld;
    std::vector<float> qt, st, o, m, l, alpha;
  };
  std::vector<Buffers> bufs;
  for (Item& it : items) {
    const TileKernels& kk = *it.kk;
    Buffers b;
    b.rows_p = (rows + kk.row_align - 1) / kk.row_align * kk.row_align;
    b.ld = b.rows_p + 16;
    b.qt.resize(std::size_t(d) * b.ld);
    for (float& x : b.qt) x = normal(gen);
    b.st.resize(std::size_t(keys) * b.ld);
    b.o.assign(std::size_t(b.rows_p) * ldkv, 0.0f);
    b.m.resize(b.rows_p);
    b.l.resize(b.rows_p);
    b.alpha.resize(b.rows_p);
    const float scale = 1.0f / std::sqrt(float(d));
    if (kk.formats.workspace_bytes != nullptr) {
      it.ws.resize(kk.formats.workspace_bytes(b.rows_p, d, d) + 64);
      kk.formats.pack_q(b.qt.data(), b.ld, b.rows_p, d, d, scale, aligned64(it.ws));
    }
    if (kk.formats.own())
      for (int t = 0; t < tiles; ++t) {
        it.k_tiles.emplace_back(kk.formats.k_tile_bytes(d) + 64);
        it.v_tiles.emplace_back(kk.formats.v_tile_bytes(d) + 64);
        kk.formats.pack_k(k.data() + std::size_t(t) * keys * ldkv, ldkv, keys, d,
                          aligned64(it.k_tiles.back()));
        kk.formats.pack_v(v.data() + std::size_t(t) * keys * ldkv, ldkv, keys, d,
                          aligned64(it.v_tiles.back()));
      }
    if (!kk.steps.qk || !kk.steps.softmax_tile || !kk.steps.pv)
      throw std::invalid_argument(std::string(kk.engine) +
                                  " has its own inner loop (no tile-by-tile steps to time)");
    bufs.push_back(std::move(b));
  }
  using clock = std::chrono::steady_clock;
  const int reps = std::max(1, 256 / tiles);
  for (int round = 0; round < rounds; ++round)
    for (std::size_t i = 0; i < items.size(); ++i) {
      Item& it = items[i];
      Buffers& b = bufs[i];
      const TileKernels& kk = *it.kk;
      void* ws = it.ws.empty() ? nullptr : aligned64(it.ws);
      for (int rep = 0; rep < reps; ++rep) {
        std::fill(b.m.begin(), b.m.end(), -std::numeric_limits<float>::infinity());
        std::fill(b.l.begin(), b.l.end(), 0.0f);
        double t[3] = {0, 0, 0};
        const auto t0 = clock::now();
        for (int n = 0; n < tiles; ++n) {
          const void* kp = kk.formats.own()
                               ? aligned64(it.k_tiles[n])
                               : static_cast<const void*>(k.data() + std::size_t(n) * keys * ldkv);
          const void* vp = kk.formats.own()
                               ? aligned64(it.v_tiles[n])
                               : static_cast<const void*>(v.data() + std::size_t(n) * keys * ldkv);
          const auto a = clock::now();
          kk.steps.qk(kp, ldkv, b.qt.data(), b.ld, b.st.data(), b.ld, keys, b.rows_p, d, ws);
          const auto s = clock::now();
          kk.steps.softmax_tile(b.st.data(), b.ld, keys, b.rows_p, b.m.data(), b.l.data(),
                                b.alpha.data(), ws);
          const auto p = clock::now();
          kk.steps.pv(b.st.data(), b.ld, vp, ldkv, b.o.data(), ldkv, b.alpha.data(), rows, keys, d,
                      ws);
          const auto e = clock::now();
          t[0] += std::chrono::duration<double>(s - a).count();
          t[1] += std::chrono::duration<double>(p - s).count();
          t[2] += std::chrono::duration<double>(e - p).count();
        }
        const double total = std::chrono::duration<double>(clock::now() - t0).count();
        it.best[0] = std::min(it.best[0], total);
        for (int j = 0; j < 3; ++j) it.best[j + 1] = std::min(it.best[j + 1], t[j]);
      }
    }
  const double flops = 4.0 * rows * keys * double(d) * tiles;
  std::printf("one item: %d rows x %d tiles of %d keys, d %d, 1 thread, best of %d rounds x %d\n",
              rows, tiles, keys, d, rounds, reps);
  std::printf("%-22s %-14s %9s %8s %8s %8s %9s %9s\n", "engine", "kernels", "GFLOP/s", "qk%",
              "softmax%", "pv%", "qk GF/s", "pv GF/s");
  for (const Item& it : items)
    std::printf("%-22s %-14s %9.1f %8.1f %8.1f %8.1f %9.1f %9.1f\n", it.label.c_str(),
                std::string(it.kk->engine).c_str(), flops / it.best[0] / 1e9,
                100 * it.best[1] / it.best[0], 100 * it.best[2] / it.best[0],
                100 * it.best[3] / it.best[0], flops / 2 / it.best[1] / 1e9,
                flops / 2 / it.best[3] / 1e9);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_engine_steps: %s\n", e.what());
  return 1;
}
