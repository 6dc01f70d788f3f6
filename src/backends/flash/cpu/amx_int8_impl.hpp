// The amx_int8 SAGE engine (Q.K^T with TDPBSSD: four signed-byte products per 32-bit group,
// accumulated in int32 tiles; P.V on bf16 tiles as the amx engine) written over the tile type
// `T` and the vector operations `D`, instantiated by kernels_amx.cpp (the real tiles) and
// kernels_amx_emulated.cpp (the emulated ones). Include only from there, after int8_impl.hpp
// and amx_impl.hpp, inside the engine's namespace.
//
// Codes and scales are int8_impl.hpp's (quant_of / code_of: per query row and per key,
// symmetric, the softmax scale folded into the query scales), so the logits equal the other
// SAGE engines' bit for bit: each 32 x 32 block of int32 dots becomes natural-unit logits
// fma(float(dot), qs[row] * ks[key], kb[key] + rt[row]), NaN where not finite (D::int8_logits16; rt
// the row's term of the tile's run, int8_impl.hpp's "Row terms"), before
// the hook and the softmax (attend with Int8Operands, amx_impl.hpp). Layouts (a group: four
// consecutive codes over d, the lowest first; zeros past d; dgp = ceil(d / 4) rounded up to
// 16, a tile row):
//   K tile (panel)  int8_impl.hpp's header ([kTileKeys] f32 scales | [kTileKeys] int32 code
//                   sums | [kTileKeys] f32 key terms, set_key_bias | the tile's run) |
//                   [dgp][kTileKeys] groups,
//                   one column per key (B of S = Q.K^T); codes and scales 0 past the keys
//   V tile (panel)  the amx engine's bf16 key pairs
//   workspace: q [rows_p][dgp] groups (A of S), qs [rows_p] query scales, rows_p zeros (the row
//              terms until set_row_terms), then amx's s and p

inline int int8_groups_padded(int d) {
  return ((d + 3) / 4 + kPairsPerTile - 1) / kPairsPerTile * kPairsPerTile;
}

struct Int8Workspace {
  std::uint32_t *q, *p;
  float *s, *qs;
  const float* rt;     // the row terms, [runs][rows_p] (set_row_terms), or `zeros`
  const float* zeros;  // rows_p zeros
  int rows_p, d2p;     // d2p: the groups per row (dgp), the operands' inner dimension
  float scale = 1.0f;  // folded into qs
};

struct Int8TileSizes {
  std::size_t head, q, qs, s, p;
  std::size_t total() const { return head + q + 2 * qs + s + p; }
};
inline Int8TileSizes int8_tile_sizes(int rows_p, int d) {
  const std::size_t rp = std::size_t(rows_p);
  return {align64(sizeof(Int8Workspace)),
          align64(std::size_t(int8_groups_padded(d)) * rp * sizeof(std::uint32_t)),
          align64(rp * sizeof(float)), align64(rp * kLdS * sizeof(float)),
          align64(rp * kLdP * sizeof(std::uint32_t))};
}
inline std::size_t int8_tile_workspace_bytes(int rows_p, int d, int /*dv*/) {
  return int8_tile_sizes(rows_p, d).total();
}
inline std::size_t int8_tile_k_bytes(int d) {
  return align64(int8_k_header_bytes() +
                 std::size_t(kTileKeys) * std::size_t(int8_groups_padded(d)) * 4);
}

inline const std::uint32_t* int8_tile_groups(const void* tile) {
  return reinterpret_cast<const std::uint32_t*>(static_cast<const unsigned char*>(tile) +
                                                int8_k_header_bytes());
}

// The codes of `n` values as groups of four signed bytes (zeros past n).
inline std::uint32_t int8_group(const float* x, std::int64_t stride, int n, float inv) {
  std::uint32_t g = 0;
  for (int t = 0; t < 4 && t < n; ++t)
    g |= std::uint32_t(std::uint8_t(std::int8_t(code_of(x[t * stride], inv)))) << (8 * t);
  return g;
}

template <class D>
void int8_tile_pack_k(const float* k, std::int64_t ld, int keys, int d, void* tile) {
  auto* ks = static_cast<float*>(tile);
  auto* groups =
      reinterpret_cast<std::uint32_t*>(static_cast<unsigned char*>(tile) + int8_k_header_bytes());
  const int dgp = int8_groups_padded(d);
  // Scales, code sums and key terms: tdpbssd multiplies signed by signed bytes, so the sums
  // (the unsigned-by-signed engines' correction) stay 0.
  std::fill(ks, ks + 3 * kTileKeys, 0.0f);
  *int8_tile_run(tile) = 0;
  std::fill(groups, groups + std::int64_t(dgp) * kTileKeys, 0u);
  for (int j = 0; j < keys; ++j) {
    const float* row = k + j * ld;
    if constexpr (requires { D::int8_key_groups(row, d, 1.0f, groups, kTileKeys); }) {
      float amax = 0.0f;
      bool finite = true;
      D::int8_amax(row, d, &amax, &finite);
      const Quant qn = quant_of(amax, finite);
      ks[j] = qn.scale;
      D::int8_key_groups(row, d, qn.inv, groups + j, kTileKeys);
    } else {
      const Quant qn = quant_of_row(row, d);
      ks[j] = qn.scale;
      for (int g = 0; g * 4 < d; ++g)
        groups[std::int64_t(g) * kTileKeys + j] = int8_group(row + 4 * g, 1, d - 4 * g, qn.inv);
    }
  }
}

template <class D>
void int8_tile_pack_q(const float* qt, std::int64_t ldqt, int rows_p, int d, int /*dv*/,
                      float logit_scale, void* ws) {
  const Int8TileSizes sz = int8_tile_sizes(rows_p, d);
  auto* base = static_cast<unsigned char*>(ws);
  auto* w = static_cast<Int8Workspace*>(ws);
  std::size_t at = sz.head;
  w->q = reinterpret_cast<std::uint32_t*>(base + at);
  w->qs = reinterpret_cast<float*>(base + (at += sz.q));
  float* zeros = reinterpret_cast<float*>(base + (at += sz.qs));
  std::fill(zeros, zeros + rows_p, 0.0f);
  w->rt = w->zeros = zeros;
  w->s = reinterpret_cast<float*>(base + (at += sz.qs));
  w->p = reinterpret_cast<std::uint32_t*>(base + at + sz.s);
  w->rows_p = rows_p;
  w->d2p = int8_groups_padded(d);
  w->scale = 1.0f;
  // Per row: the largest magnitude and whether every element is finite (in s's bytes).
  float* amax = w->s;
  float* inv = w->s + rows_p;
  for (int r = 0; r < rows_p; ++r) amax[r] = 0.0f, inv[r] = 1.0f;
  for (int e = 0; e < d; ++e) {
    const float* col = qt + e * ldqt;
    for (int r = 0; r < rows_p; ++r) {
      if (!std::isfinite(col[r])) inv[r] = 0.0f;
      amax[r] = std::max(amax[r], std::fabs(col[r]));
    }
  }
  for (int r = 0; r < rows_p; ++r) {
    const Quant qn = quant_of(amax[r], inv[r] != 0.0f);
    w->qs[r] = qn.scale * logit_scale;
    inv[r] = qn.inv;
  }
  int r0 = 0;
  if constexpr (requires { D::int8_query_groups16(qt, ldqt, d, inv, w->q, w->d2p); }) {
    for (; r0 + 16 <= rows_p; r0 += 16)
      D::int8_query_groups16(qt + r0, ldqt, d, inv + r0, w->q + std::int64_t(r0) * w->d2p, w->d2p);
  }
  for (int r = r0; r < rows_p; ++r) {
    std::uint32_t* row = w->q + std::int64_t(r) * w->d2p;
    for (int g = 0; g * 4 < d; ++g)
      row[g] = int8_group(qt + std::int64_t(4 * g) * ldqt + r, ldqt, d - 4 * g, inv[r]);
  }
  for (int r = 0; r < rows_p; ++r)
    std::fill(w->q + std::int64_t(r) * w->d2p + (d + 3) / 4, w->q + std::int64_t(r + 1) * w->d2p,
              0u);
}

inline void int8_tile_set_row_terms(void* ws, const float* terms) {
  auto* w = static_cast<Int8Workspace*>(ws);
  w->rt = terms != nullptr ? terms : w->zeros;
}

// The int8 operands of attend (amx_impl.hpp).
struct Int8Operands {
  using Ws = Int8Workspace;
  static constexpr bool kInt8 = true;
  static const std::uint32_t* k_operand(const KeyTile& t) { return int8_tile_groups(t.k); }
  // The 32 x 32 int32 block at `block` (rows r0.., keys kb.. of tile t) as logits, in place.
  template <class D>
  static void to_logits(const Ws& w, float* block, int r0, const KeyTile& t, int kb) {
    const auto* ks = static_cast<const float*>(t.k) + kb;
    const float* bias = static_cast<const float*>(t.k) + 2 * kTileKeys + kb;
    const int run = int8_tile_run(t.k);
    if (w.rt == w.zeros || run == 0) {  // no row terms (int8_impl.hpp, "Row terms")
      for (int r = 0; r < 32; ++r) {
        float* row = block + std::int64_t(r) * kLdS;
        D::int8_logits16(row, w.qs[r0 + r], ks, bias, nullptr, row);
        D::int8_logits16(row + 16, w.qs[r0 + r], ks + 16, bias + 16, nullptr, row + 16);
      }
      return;
    }
    const float* rt = w.rt + std::int64_t(run) * w.rows_p + r0;
    for (int r = 0; r < 32; ++r) {
      float* row = block + std::int64_t(r) * kLdS;
      D::int8_logits16(row, w.qs[r0 + r], ks, bias, rt + r, row);
      D::int8_logits16(row + 16, w.qs[r0 + r], ks + 16, bias + 16, rt + r, row + 16);
    }
  }
};

// TileSteps::qk for amx_int8 (the logits as S^T, qk's contract; attend does not use it): the
// tile's S = Q.K^T through the same tiles and conversion in the workspace's s, then transposed.
template <class T, class D>
void int8_tile_qk(const void* k_tile, std::int64_t /*ldk*/, const float* /*qt*/,
                  std::int64_t /*ldqt*/, float* st, std::int64_t ldst, int keys, int rows_p,
                  int /*d*/, void* ws) {
  T::ensure();
  const Int8Workspace& w = *static_cast<const Int8Workspace*>(ws);
  const KeyTile t{k_tile, nullptr, keys, false, 0};
  const std::uint32_t* kt = Int8Operands::k_operand(t);
  for (int r0 = 0; r0 < rows_p; r0 += 32)
    for (int kb = 0; kb < keys; kb += 32) {
      zero_block<T>();
      for (int e = 0; e < w.d2p; e += kPairsPerTile)
        multiply_block<T, true>(w.q + std::int64_t(r0) * w.d2p + e, w.d2p,
                                kt + std::int64_t(e) * kTileKeys + kb, kTileKeys);
      float* block = w.s + std::int64_t(r0) * kLdS + kb;
      store_block<T>(block, kLdS);
      Int8Operands::to_logits<D>(w, block, r0, t, kb);
      for (int j = kb; j < std::min(keys, kb + 32); ++j)
        for (int r = r0; r < r0 + 32; ++r) st[j * ldst + r] = w.s[std::int64_t(r) * kLdS + j];
    }
}

template <class T, class D>
constexpr Bf16Functions amx_int8_functions(
    decltype(RowSoftmax::softmax_rows_pairs) softmax = nullptr) {
  return {&int8_tile_qk<T, D>,
          nullptr,
          {&int8_tile_workspace_bytes, &int8_tile_pack_q<D>, &int8_tile_k_bytes, &v_tile_bytes,
           &int8_tile_pack_k<D>, &pack_v<D>, &int8_set_key_bias, &int8_tile_set_row_terms},
          32,
          &T::begin,
          &T::end,
          &attend<T, D, Int8Operands>,
          kPanelTiles,
          kItemRows,
          softmax};
}
