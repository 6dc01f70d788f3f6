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
// one tile load per multiply. The engine owns its inner loop (kernels.hpp, InnerLoop::attend):
// it computes S = Q.K^T with query rows as rows, so that the probabilities come out as rows
// that are directly the A operand of P.V (no transposition), over key panels of up to
// kPanelTiles tiles, and O goes through the tiles once per panel. Layouts (a pair: the even
// element in the low 16 bits):
//   K tile (panel)  [d2p][kTileKeys]     pairs over d, one column per key, d2p =
//                                        round_up(d / 2, 16); zeros past d and past the tile's
//                                        keys (B of S = Q.K^T)
//   V tile (panel)  [kTileKeys/2][dv]    pairs of key rows 2j, 2j + 1 per column; zeros past
//                                        the tile's keys (B of P.V)
//   workspace: q    [rows_p][d2p]        query rows as pairs over d, unscaled (A of S)
//              s    [rows_p][kLdS]       a panel's logits (f32), then its probabilities
//              p    [rows_p][kLdP]       the probabilities as pairs over keys (A of P.V)
//              qt   [d2p][rows_p]        pairs of QT over d (pack_q's step to q, in s's bytes)
// A panel's logits are scaled in the softmax's exponent (natural units where the driver's hook
// must see them: scaled in vectors first, with qk's NaN rule); P.V rescales O by alpha in vectors
// (when a row's reference moved) and accumulates into O's 32 x 32 blocks loaded into the tiles.

constexpr int kPairsPerTile = 16;  // a tile row: 64 bytes = 16 pairs = 32 bf16
constexpr int kKeyPairs = kTileKeys / 2;
// Key tiles per panel, and query rows per work item. O goes through the tiles once per panel and
// 32 x 32 block, and each round trip (four tile loads, four stores that the next block's loads
// must wait for) costs about what 8 steps of its multiplies do: a harness of P.V alone ran at
// 1232 GFLOP/s with 8 steps (4 tiles), 1510 with 16, 1674 with 32. Panels of 8 tiles (16 steps)
// and items of 256 rows (each panel serves twice the rows while it is in L2), on a Xeon,
// interleaved in one process, flux-1024: 1 thread 570 GFLOP/s (4 tiles, 128 rows) -> 602 (4,
// 256) -> 654 (8, 256); 2 threads, 4 heads, 1120 -> 1185 -> 1271; sd35-1024 (D 64) 445 -> 462
// from the panels. The logits of a panel for 256 rows take 528 KiB, their pairs 272 KiB: with
// Q and the driver's O, about 1.2 MiB per thread at D 128, beside the 256 KiB panel in the 2
// MiB L2 of every CPU with AMX (512 rows measured slower).
constexpr int kPanelTiles = 8;
constexpr int kItemRows = 256;
constexpr int kLdS = kPanelTiles * kTileKeys + 16;  // floats
constexpr int kLdP = kPanelTiles * kKeyPairs + 16;  // pairs
static_assert(kPanelTiles <= kMaxPanelTiles);

struct Workspace {
  std::uint32_t *q, *p, *qt;
  float* s;
  int rows_p, d2p;
  float scale;
};

inline int d2_padded(int d) {
  return ((d + 1) / 2 + kPairsPerTile - 1) / kPairsPerTile * kPairsPerTile;
}

// qt is only pack_q's step: it shares s's bytes.
struct Sizes {
  std::size_t head, q, s, p;
  std::size_t total() const { return head + q + s + p; }
};
inline Sizes sizes(int rows_p, int d) {
  const std::size_t u = sizeof(std::uint32_t), rp = std::size_t(rows_p);
  const std::size_t q = align64(std::size_t(d2_padded(d)) * rp * u);
  return {align64(sizeof(Workspace)), q, std::max(align64(rp * kLdS * sizeof(float)), q),
          align64(rp * kLdP * u)};
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

// Pairs over d of each key row (a [kTileKeys][d2p] block in this thread's scratch), then
// transposed in 16 x 16 blocks into the tile's columns.
template <class D>
void pack_k(const float* k, std::int64_t ld, int keys, int d, void* tile) {
  const int d2 = (d + 1) / 2, d2p = d2_padded(d);
  thread_local std::vector<std::uint32_t> rows;
  rows.resize(std::size_t(kTileKeys) * std::size_t(d2p));
  std::uint32_t* by_key = rows.data();
  for (int j = 0; j < keys; ++j) {
    std::uint32_t* row = by_key + std::int64_t(j) * d2p;
    pack_row_pairs<D>(k + j * ld, d, row);
    std::fill(row + d2, row + d2p, 0u);
  }
  std::fill(by_key + std::int64_t(keys) * d2p, by_key + std::int64_t(kTileKeys) * d2p, 0u);
  auto* dst = static_cast<std::uint32_t*>(tile);
  for (int j0 = 0; j0 < kTileKeys; j0 += 16)
    for (int e0 = 0; e0 < d2p; e0 += 16)
      D::transpose16(by_key + std::int64_t(j0) * d2p + e0, d2p,
                     dst + std::int64_t(e0) * kTileKeys + j0, kTileKeys);
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
  std::size_t at = s.head;
  w->q = reinterpret_cast<std::uint32_t*>(base + at);
  w->s = reinterpret_cast<float*>(base + (at += s.q));
  w->p = reinterpret_cast<std::uint32_t*>(base + at + s.s);
  w->qt = reinterpret_cast<std::uint32_t*>(w->s);
  w->rows_p = rows_p;
  w->d2p = d2_padded(d);
  w->scale = logit_scale;
  pack_row_pairs_of_rows<D>(qt, ldqt, d, rows_p, w->d2p, w->qt);
  for (int e0 = 0; e0 < w->d2p; e0 += 16)
    for (int r0 = 0; r0 < rows_p; r0 += 16)
      D::transpose16(w->qt + std::int64_t(e0) * rows_p + r0, rows_p,
                     w->q + std::int64_t(r0) * w->d2p + e0, w->d2p);
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
template <class T>
inline void zero_block() {
  T::template zero<0>();
  T::template zero<1>();
  T::template zero<2>();
  T::template zero<3>();
}

// One step over 16 pairs of the block's products: A's rows 0-15 at a and 16-31 at a + 16 rows
// (stride lda pairs), B's columns 0-15 at b and 16-31 at b + 16 (stride ldb pairs).
// kInt8: TDPBSSD on groups of four signed bytes (amx_int8), else TDPBF16PS on bf16 pairs.
template <class T, bool kInt8 = false>
inline void multiply_block(const std::uint32_t* a, std::int64_t lda, const std::uint32_t* b,
                           std::int64_t ldb) {
  T::template load<4>(a, long(lda) * 4);
  T::template load<5>(a + 16 * lda, long(lda) * 4);
  T::template load<6>(b, long(ldb) * 4);
  T::template load<7>(b + 16, long(ldb) * 4);
  if constexpr (kInt8) {
    T::template dp_int8<0, 4, 6>();
    T::template dp_int8<1, 4, 7>();
    T::template dp_int8<2, 5, 6>();
    T::template dp_int8<3, 5, 7>();
  } else {
    T::template dp<0, 4, 6>();
    T::template dp<1, 4, 7>();
    T::template dp<2, 5, 6>();
    T::template dp<3, 5, 7>();
  }
}

// The operands of S = Q.K^T for attend: bf16 pairs (amx), dot products scaled in the softmax's
// exponent. amx_int8_impl.hpp has the other (int8 groups, natural-unit logits per block).
struct Bf16Operands {
  using Ws = Workspace;
  static constexpr bool kInt8 = false;
  static const std::uint32_t* k_operand(const KeyTile& t) {
    return static_cast<const std::uint32_t*>(t.k);
  }
  template <class D>
  static void to_logits(const Ws&, float*, int, const KeyTile&, int) {}
};

// InnerLoop::attend: a work item panel by panel.
template <class T, class D, class P = Bf16Operands>
void attend(const TileKernels& kk, const ItemKeys& keys, const ItemState& st) {
  T::ensure();
  const typename P::Ws& w = *static_cast<const typename P::Ws*>(st.ws);
  const int rows_p = st.rows_p, dv = st.dv, d2p = w.d2p;
  const KeyTile* panel[kPanelTiles];
  bool first = true, done = false;
  int next = 0;
  while (!done) {
    // Up to kPanelTiles tiles, all full but the last, so that the panel's keys are contiguous.
    int count = 0, total = 0;
    bool hook = false;
    while (count < kPanelTiles) {
      const KeyTile* t = keys.tile(keys.ctx, next++);
      if (t == nullptr) {
        done = true;
        break;
      }
      panel[count++] = t;
      total += t->keys;
      hook = hook || t->hook;
      if (t->keys < kTileKeys) break;
    }
    if (count == 0) break;

    // S = Q.K^T, 32 x 32 blocks: rows [r0, r0 + 32) x keys [kb, kb + 32) of each tile. The
    // K block after this one comes into L1 meanwhile, 16 of its pair rows (two lines each) per
    // step: the panel's K (64 KiB at D 128) streams from L2 once per row block, and tile loads
    // that miss L1 stall the multiplies (on a Xeon, this loop alone in a harness: 1240 -> 1390
    // GFLOP/s; the engine, one thread, interleaved: +1.5-2.7%). The A operand, a row block's
    // 8 KiB of Q, stays in L1 by itself.
    for (int r0 = 0; r0 < rows_p; r0 += 32)
      for (int c = 0; c < count; ++c) {
        const std::uint32_t* kt = P::k_operand(*panel[c]);
        for (int kb = 0; kb < panel[c]->keys; kb += 32) {
          const std::uint32_t* after = nullptr;
          if (kb + 32 < panel[c]->keys)
            after = kt + kb + 32;
          else if (c + 1 < count)
            after = P::k_operand(*panel[c + 1]);
          else if (r0 + 32 < rows_p)
            after = P::k_operand(*panel[0]);
          zero_block<T>();
          for (int e = 0; e < d2p; e += kPairsPerTile) {
            multiply_block<T, P::kInt8>(w.q + std::int64_t(r0) * d2p + e, d2p,
                                        kt + std::int64_t(e) * kTileKeys + kb, kTileKeys);
            if (after != nullptr)
              for (int i = e; i < e + kPairsPerTile; ++i) {
                __builtin_prefetch(after + std::int64_t(i) * kTileKeys, 0, 3);
                __builtin_prefetch(after + std::int64_t(i) * kTileKeys + 16, 0, 3);
              }
          }
          float* block = w.s + std::int64_t(r0) * kLdS + c * kTileKeys + kb;
          store_block<T>(block, kLdS);
          P::template to_logits<D>(w, block, r0, *panel[c], kb);
        }
      }

    if constexpr (P::kInt8) {
      // Natural-unit logits already (the scales folded in per block): the hook, then the
      // softmax of logits.
      for (int c = 0; c < count; ++c)
        if (panel[c]->hook) keys.logits(keys.ctx, *panel[c], w.s + c * kTileKeys, kLdS, 1);
    } else if (hook) {
      // The softmax: the scale folded into the exponent, unless the driver must see the logits.
      const auto sc = D::set1(w.scale);
      const int width = (total + 15) / 16 * 16;
      for (int r = 0; r < rows_p; ++r)
        for (int j = 0; j < width; j += D::W) {
          float* at = w.s + std::int64_t(r) * kLdS + j;
          D::store(at, D::not_finite_to_nan(D::mul(D::load(at), sc)));
        }
      for (int c = 0; c < count; ++c)
        if (panel[c]->hook) keys.logits(keys.ctx, *panel[c], w.s + c * kTileKeys, kLdS, 1);
    }
    // P as pairs over keys straight from the softmax, zeros up to whole 16-pair steps.
    const int k2 = (total + 1) / 2, k2p = (k2 + kPairsPerTile - 1) / kPairsPerTile * kPairsPerTile;
    kk.row_softmax.softmax_rows_pairs(w.s, kLdS, rows_p, total, P::kInt8 ? 1.0f : w.scale,
                                      !P::kInt8 && !hook, st.m, st.l, st.alpha, w.p, kLdP, k2p);

    // O *= alpha for the rows whose reference moved (the lazy max: seldom after the first
    // panels), then O += P.V through the tiles.
    if (!first)
      for (int r = 0; r < rows_p; ++r) {
        if (st.alpha[r] == 1.0f) continue;
        const auto a = D::set1(st.alpha[r]);
        float* orow = st.o + std::int64_t(r) * st.ld_o;
        for (int c = 0; c < dv; c += D::W) D::store(orow + c, D::mul(D::load(orow + c), a));
      }
    for (int r0 = 0; r0 < rows_p; r0 += 32)
      for (int c0 = 0; c0 < dv; c0 += 32) {
        float* ob = st.o + std::int64_t(r0) * st.ld_o + c0;
        if (first)
          zero_block<T>();
        else
          load_block<T>(ob, st.ld_o);
        for (int e = 0; e < k2p; e += kPairsPerTile) {
          const auto* v = static_cast<const std::uint32_t*>(panel[e / kKeyPairs]->v);
          multiply_block<T>(w.p + std::int64_t(r0) * kLdP + e, kLdP,
                            v + std::int64_t(e % kKeyPairs) * dv + c0, dv);
        }
        store_block<T>(ob, st.ld_o);
      }
    first = false;
  }
}

// `softmax`: the engine's own softmax_rows_pairs (nullptr: the base kernels').
template <class T, class D>
constexpr Bf16Functions amx_functions(decltype(RowSoftmax::softmax_rows_pairs) softmax = nullptr) {
  // No qk / pv: the engine has its own inner loop (attend).
  return {nullptr,
          nullptr,
          {&workspace_bytes, &pack_q<D>, &k_tile_bytes, &v_tile_bytes, &pack_k<D>, &pack_v<D>},
          32,
          &T::begin,
          &T::end,
          &attend<T, D>,
          kPanelTiles,
          kItemRows,
          softmax};
}
