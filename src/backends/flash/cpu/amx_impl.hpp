// The AMX FLASH kernels (Q.K^T and P.V with tdpbf16ps: bf16 pair products accumulated in f32
// tiles) written once over a tile type `T` and the vector operations `D` (avx512_bf16_ops.hpp
// or bf16_emulated_ops.hpp), instantiated by kernels_amx.cpp (the real tiles, inside its target
// region) and kernels_amx_emulated.cpp (tile registers and instructions in portable C++).
// Include only from there, after bf16_pairs.hpp, inside the engine's namespace.
//
// T provides, for tile numbers 0-7 (compile-time constants): zero<t>(), load<t>(p, stride),
// store<t>(p, stride) (strides in bytes) and dp<c, a, b>() (C += A.B, TDPBF16PS), plus
// begin() / end() (a thread loads its tile configuration: eight tiles of 16 rows x 64 bytes /
// releases them) and ensure() (begin() unless this thread already did).
//
// Tiles 0-3 accumulate a 32 x 32 block of f32 (2 x 2 tiles of 16 x 16), 4-5 hold A, 6-7 hold B:
// one tile load per multiply. Layouts (a pair: the even element in the low 16 bits):
//   K tile (panel)  [kTileKeys][d2p]     pairs over d of each key, d2p = round_up(d / 2, 16);
//                                        zeros past d and past the tile's keys (A of S^T)
//   V tile (panel)  [kTileKeys/2][dv]    pairs of key rows 2j, 2j + 1 per column; zeros past
//                                        the tile's keys (B of P.V)
//   workspace: q    [d2p][rows_p]        pairs of QT over d, unscaled (B of S^T = K.Q^T)
//              pt   [kTileKeys/2][rows_p] probabilities as pairs over keys, per row
//              p    [rows_p][kTileKeys/2] the same transposed: rows of P (A of P.V)
// S^T = K.Q^T lands in ST as 16 x 16 f32 tiles; the logits are then scaled and checked in
// vectors; the softmax is the AVX-512 one; P.V rescales O by alpha in vectors and accumulates
// into O's 32 x 32 blocks loaded into the tiles.

constexpr int kPairsPerTile = 16;  // a tile row: 64 bytes = 16 pairs = 32 bf16
constexpr int kKeyPairs = kTileKeys / 2;

struct Workspace {
  std::uint32_t *q, *pt, *p;
  int rows_p, d2p;
  float scale;
};

inline int d2_padded(int d) {
  return ((d + 1) / 2 + kPairsPerTile - 1) / kPairsPerTile * kPairsPerTile;
}

struct Sizes {
  std::size_t head, q, pt, p;
  std::size_t total() const { return head + q + pt + p; }
};
inline Sizes sizes(int rows_p, int d) {
  const std::size_t u = sizeof(std::uint32_t), rp = std::size_t(rows_p);
  return {align64(sizeof(Workspace)), align64(std::size_t(d2_padded(d)) * rp * u),
          align64(std::size_t(kKeyPairs) * rp * u), align64(rp * kKeyPairs * u)};
}
inline std::size_t workspace_bytes(int rows_p, int d, int /*dv*/) {
  return sizes(rows_p, d).total();
}
inline std::size_t k_tile_bytes(int d) {
  return align64(std::size_t(kTileKeys) * std::size_t(d2_padded(d)) * sizeof(std::uint32_t));
}
inline std::size_t v_tile_bytes(int dv) {
  return align64(std::size_t(kKeyPairs) * std::size_t(dv) * sizeof(std::uint32_t));
}

template <class D>
void pack_k(const float* k, std::int64_t ld, int keys, int d, void* tile) {
  const int d2 = (d + 1) / 2, d2p = d2_padded(d);
  auto* dst = static_cast<std::uint32_t*>(tile);
  for (int j = 0; j < keys; ++j) {
    std::uint32_t* row = dst + std::int64_t(j) * d2p;
    pack_row_pairs<D>(k + j * ld, d, row);
    std::fill(row + d2, row + d2p, 0u);
  }
  std::fill(dst + std::int64_t(keys) * d2p, dst + std::int64_t(kTileKeys) * d2p, 0u);
}

template <class D>
void pack_v(const float* v, std::int64_t ld, int keys, int dv, void* tile) {
  pack_row_pairs_of_rows<D>(v, ld, keys, dv, kKeyPairs, static_cast<std::uint32_t*>(tile));
}

template <class D>
void pack_q(const float* qt, std::int64_t ldqt, int rows_p, int d, int /*dv*/, float logit_scale,
            void* ws) {
  const Sizes s = sizes(rows_p, d);
  auto* base = static_cast<unsigned char*>(ws);
  auto* w = static_cast<Workspace*>(ws);
  w->q = reinterpret_cast<std::uint32_t*>(base + s.head);
  w->pt = reinterpret_cast<std::uint32_t*>(base + s.head + s.q);
  w->p = reinterpret_cast<std::uint32_t*>(base + s.head + s.q + s.pt);
  w->rows_p = rows_p;
  w->d2p = d2_padded(d);
  w->scale = logit_scale;
  pack_row_pairs_of_rows<D>(qt, ldqt, d, rows_p, w->d2p, w->q);
}

// The 32 x 32 f32 block at c (row stride ldc floats) as accumulator tiles 0-3 (0: rows 0-15,
// columns 0-15; 1: columns 16-31; 2 and 3: rows 16-31), and back.
template <class T>
inline void load_block(const float* c, std::int64_t ldc) {
  const long stride = long(ldc) * 4;
  T::template load<0>(c, stride);
  T::template load<1>(c + 16, stride);
  T::template load<2>(c + 16 * ldc, stride);
  T::template load<3>(c + 16 * ldc + 16, stride);
}
template <class T>
inline void store_block(float* c, std::int64_t ldc) {
  const long stride = long(ldc) * 4;
  T::template store<0>(c, stride);
  T::template store<1>(c + 16, stride);
  T::template store<2>(c + 16 * ldc, stride);
  T::template store<3>(c + 16 * ldc + 16, stride);
}

// One step over 16 pairs of the block's products: A's rows 0-15 at a and 16-31 at a + 16 rows
// (stride lda pairs), B's columns 0-15 at b and 16-31 at b + 16 (stride ldb pairs).
template <class T>
inline void multiply_block(const std::uint32_t* a, std::int64_t lda, const std::uint32_t* b,
                           std::int64_t ldb) {
  T::template load<4>(a, long(lda) * 4);
  T::template load<5>(a + 16 * lda, long(lda) * 4);
  T::template load<6>(b, long(ldb) * 4);
  T::template load<7>(b + 16, long(ldb) * 4);
  T::template dp<0, 4, 6>();
  T::template dp<1, 4, 7>();
  T::template dp<2, 5, 6>();
  T::template dp<3, 5, 7>();
}

template <class T, class D>
void qk(const void* k_tile, std::int64_t /*ldk*/, const float* /*qt*/, std::int64_t /*ldqt*/,
        float* st, std::int64_t ldst, int keys, int rows_p, int /*d*/, void* ws) {
  T::ensure();
  const Workspace& w = *static_cast<const Workspace*>(ws);
  const auto* k = static_cast<const std::uint32_t*>(k_tile);
  const int d2p = w.d2p;
  for (int kb = 0; kb < keys; kb += 32)  // the K tile holds zeros up to kTileKeys keys
    for (int r0 = 0; r0 < rows_p; r0 += 32) {
      T::template zero<0>();
      T::template zero<1>();
      T::template zero<2>();
      T::template zero<3>();
      for (int e = 0; e < d2p; e += kPairsPerTile)
        multiply_block<T>(k + std::int64_t(kb) * d2p + e, d2p, w.q + std::int64_t(e) * rows_p + r0,
                          rows_p);
      store_block<T>(st + std::int64_t(kb) * ldst + r0, ldst);
    }
  // Scale in f32 (the bf16 operands are the unscaled inputs); a logit that is not finite
  // becomes NaN (kernels.hpp).
  const auto sc = D::set1(w.scale);
  for (int j = 0; j < keys; ++j)
    for (int r = 0; r < rows_p; r += D::W)
      D::store(st + j * ldst + r, D::not_finite_to_nan(D::mul(D::load(st + j * ldst + r), sc)));
}

template <class T, class D>
void pv(const float* pt, std::int64_t ldpt, const void* v_tile, std::int64_t /*ldv*/, float* o,
        std::int64_t ldo, const float* alpha, int /*rows*/, int keys, int dv, void* ws) {
  T::ensure();
  const Workspace& w = *static_cast<const Workspace*>(ws);
  const auto* v = static_cast<const std::uint32_t*>(v_tile);
  const int rows_p = w.rows_p, k2 = (keys + 1) / 2;
  const int k2p = (k2 + kPairsPerTile - 1) / kPairsPerTile * kPairsPerTile;
  // Probabilities as pairs over keys (zeros past the tile's keys), then transposed into rows.
  pack_row_pairs_of_rows<D>(pt, ldpt, keys, rows_p, k2p, w.pt);
  for (int r0 = 0; r0 < rows_p; r0 += 16)
    for (int c0 = 0; c0 < k2p; c0 += 16)
      D::transpose16(w.pt + std::int64_t(c0) * rows_p + r0, rows_p, w.p + r0 * kKeyPairs + c0,
                     kKeyPairs);
  // O *= alpha row by row (every row of the padded block: the tiles read 32 rows at a time),
  // unless no row's reference moved (the lazy max of softmax_tile: most tiles).
  bool moved = false;
  for (int r = 0; r < rows_p; ++r) moved = moved || alpha[r] != 1.0f;
  for (int r = 0; moved && r < rows_p; ++r) {
    const auto a = D::set1(alpha[r]);
    for (int c = 0; c < dv; c += D::W)
      D::store(o + r * ldo + c, D::mul(D::load(o + r * ldo + c), a));
  }
  for (int r0 = 0; r0 < rows_p; r0 += 32)
    for (int c0 = 0; c0 < dv; c0 += 32) {
      float* ob = o + std::int64_t(r0) * ldo + c0;
      load_block<T>(ob, ldo);
      for (int e = 0; e < k2p; e += kPairsPerTile)
        multiply_block<T>(w.p + std::int64_t(r0) * kKeyPairs + e, kKeyPairs,
                          v + std::int64_t(e) * dv + c0, dv);
      store_block<T>(ob, ldo);
    }
}

template <class T, class D>
constexpr Bf16Functions amx_functions() {
  return {&qk<T, D>,     &pv<T, D>,  &workspace_bytes, &pack_q<D>, &k_tile_bytes,
          &v_tile_bytes, &pack_k<D>, &pack_v<D>,       32,         &T::begin,
          &T::end};
}
