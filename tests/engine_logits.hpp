// The logits S^T an engine with its own operand formats computes for one K tile and one item of
// query rows, through its formats and qk step alone (tests/test_sage.cpp, test_int16.cpp: every
// engine of a kind computes the same bits). Include after the engine table's header.
#pragma once

#include <cstdint>
#include <vector>

#include "backends/flash/engines.hpp"

namespace dattn::testing {

// Q^T as qt[e * 128 + r] for rows r < rows (<= 128 after padding to the engine's row_align), the
// keys as k[j * (d + 16) + e] for j < keys; the softmax scale 0.125. Returns the logits of key j,
// row r at [j * rows + r]; ok false when the rows do not fit.
struct EngineLogits {
  std::vector<float> logits;
  bool ok = false;
};
inline EngineLogits engine_logits(const flash::Engine& e, const std::vector<float>& qt,
                                  const std::vector<float>& k, int d, int keys, int rows) {
  const flash::TileKernels& kk = e.kernels();
  const int rows_p = (rows + kk.row_align - 1) / kk.row_align * kk.row_align;
  if (rows_p > 128) return {};
  std::vector<unsigned char> ws(kk.formats.workspace_bytes(rows_p, d, 64) + 64),
      tile(kk.formats.k_tile_bytes(d) + 64);
  const auto align = [](unsigned char* p) {
    return reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(p) + 63) / 64 * 64);
  };
  void* w = align(ws.data());
  void* t = align(tile.data());
  kk.formats.pack_q(qt.data(), 128, rows_p, d, 64, 0.125f, w);
  kk.formats.pack_k(k.data(), d + 16, keys, d, t);
  std::vector<float> st(std::size_t(keys) * 144, -1.0f);
  kk.steps.qk(t, 0, qt.data(), 128, st.data(), 144, keys, rows_p, d, w);
  EngineLogits out;
  out.ok = true;
  for (int j = 0; j < keys; ++j)
    for (int r = 0; r < rows; ++r) out.logits.push_back(st[std::size_t(j) * 144 + r]);
  return out;
}

}  // namespace dattn::testing
