// The bf16-dot FLASH kernels (Q.K^T and P.V on bf16 pairs, f32 accumulation) written once over
// a dot type `D`, instantiated by kernels_avx512_bf16.cpp (vdpbf16ps, inside its target region)
// and kernels_bf16_emulated.cpp (portable C++). Include only from there, after the standard
// headers and bf16_pairs.hpp, inside a per-engine namespace.
//
// D provides: reg (W f32 lanes: 16 on x86, 4 on AArch64), zero(), set1(f), load(p), store(p, r),
// mul(a, b),
// not_finite_to_nan(r) (x * 0 + x), the pair packers of bf16_pairs.hpp, and
// dot(acc, pairs, b): for every lane i, acc[i] += a_odd * b_odd, then += a_even * b_even, as
// VDPBF16PS does (each step an f32 FMA, bf16 denormal inputs read as zero, denormal results
// flushed to zero), where `pairs` points at 16 consecutive pairs and b is one pair broadcast to
// every lane.
//
// Layouts (a pair is one uint32: the even element in the low 16 bits, the odd one in the high
// 16 bits; a missing odd element is zero):
//   K tile (panel)  [kTileKeys][d2]   pairs over d of each key (d2 = ceil(d / 2))
//   V tile (panel)  [kTileKeys/2][dv] pairs of key rows 2j and 2j + 1, per column
//   workspace: q    [d2][rows_p]      pairs of QT over d, unscaled, packed once per work item
//              p    [k2][rows_p]      probabilities rounded to bf16, pairs over keys, per row
//                                     (packed from ST by pv, or made by the engine's softmax step)
// so Q.K^T broadcasts one K pair against 32 query rows, and P.V one P pair against 32 columns;
// every packing step is a vector operation on whole rows (no transposition).
//
// Optionally (D::kLanePairs, neon_bf16's BFDOT by element), D also provides preg (4 pairs in a
// vector), load_pairs(p) and dot_lane<L>(acc, pairs, b): dot(acc, pairs, pair L of b). Q.K^T
// then loads 4 consecutive pairs of each key and P.V the pairs of 4 consecutive rows as one
// vector each, instead of broadcasting every pair into a register of its own (7 DUPs beside 16
// BFDOTs on the same pipes: 66% of BFDOT's rate under llvm-mca on Neoverse V1/V2). The sums are
// the same, in the same order.
template <class D>
constexpr bool lane_pairs() {
  if constexpr (requires { D::kLanePairs; })
    return D::kLanePairs;
  else
    return false;
}

// f(std::integral_constant<int, 0>) .. f(std::integral_constant<int, N - 1>), in order.
template <int N, class F>
inline void for_lanes(F&& f) {
  [&]<int... L>(std::integer_sequence<int, L...>) {
    (f(std::integral_constant<int, L>{}), ...);
  }
  (std::make_integer_sequence<int, N>{});
}

struct Workspace {
  std::uint32_t *q, *p;
  int rows_p, d2;
  float scale;
};

struct Sizes {
  std::size_t head, a, b;
  std::size_t total() const { return head + a + b; }
};
inline Sizes sizes(int rows_p, int d) {
  const std::size_t d2 = std::size_t(d + 1) / 2, k2 = kTileKeys / 2;
  const std::size_t u = sizeof(std::uint32_t);
  return {align64(sizeof(Workspace)), align64(d2 * std::size_t(rows_p) * u),
          align64(k2 * std::size_t(rows_p) * u)};
}

inline std::size_t workspace_bytes(int rows_p, int d, int /*dv*/) {
  return sizes(rows_p, d).total();
}

inline std::size_t k_tile_bytes(int d) {
  return align64(std::size_t(kTileKeys) * std::size_t(d + 1) / 2 * sizeof(std::uint32_t));
}
inline std::size_t v_tile_bytes(int dv) {
  return align64(std::size_t(kTileKeys / 2) * std::size_t(dv) * sizeof(std::uint32_t));
}

template <class D>
void pack_k(const float* k, std::int64_t ld, int keys, int d, void* tile) {
  const int d2 = (d + 1) / 2;
  auto* dst = static_cast<std::uint32_t*>(tile);
  for (int j = 0; j < keys; ++j) pack_row_pairs<D>(k + j * ld, d, dst + std::int64_t(j) * d2);
}

template <class D>
void pack_v(const float* v, std::int64_t ld, int keys, int dv, void* tile) {
  pack_row_pairs_of_rows<D>(v, ld, keys, dv, (keys + 1) / 2, static_cast<std::uint32_t*>(tile));
}

template <class D>
void pack_q(const float* qt, std::int64_t ldqt, int rows_p, int d, int /*dv*/, float logit_scale,
            void* ws) {
  const Sizes s = sizes(rows_p, d);
  auto* base = static_cast<unsigned char*>(ws);
  auto* w = static_cast<Workspace*>(ws);
  w->q = reinterpret_cast<std::uint32_t*>(base + s.head);
  w->p = reinterpret_cast<std::uint32_t*>(base + s.head + s.a);
  w->rows_p = rows_p;
  w->d2 = (d + 1) / 2;
  w->scale = logit_scale;
  pack_row_pairs_of_rows<D>(qt, ldqt, d, rows_p, w->d2, w->q);
}

// ST[j][r0..r0+2W) for MK keys: k points at the keys' pairs, q at QT's pairs of column r0.
template <class D, int MK>
inline void qk_keys(const std::uint32_t* k, int d2, const std::uint32_t* q, int rows_p, float* st,
                    std::int64_t ldst, float scale) {
  using R = typename D::reg;
  R acc[MK][2];
#pragma GCC unroll 8
  for (int m = 0; m < MK; ++m) acc[m][0] = acc[m][1] = D::zero();
  int e2 = 0;
  if constexpr (lane_pairs<D>()) {
    for (; e2 + 4 <= d2; e2 += 4) {
      typename D::preg kv[MK];
#pragma GCC unroll 8
      for (int m = 0; m < MK; ++m) kv[m] = D::load_pairs(k + m * d2 + e2);
      for_lanes<4>([&](auto lane) {
        const std::uint32_t* qe = q + std::int64_t(e2 + lane) * rows_p;
#pragma GCC unroll 8
        for (int m = 0; m < MK; ++m) {
          acc[m][0] = D::template dot_lane<lane>(acc[m][0], qe, kv[m]);
          acc[m][1] = D::template dot_lane<lane>(acc[m][1], qe + D::W, kv[m]);
        }
      });
    }
  }
  for (; e2 < d2; ++e2) {
    const std::uint32_t* qe = q + std::int64_t(e2) * rows_p;
#pragma GCC unroll 8
    for (int m = 0; m < MK; ++m) {
      const std::uint32_t kb = k[m * d2 + e2];
      acc[m][0] = D::dot(acc[m][0], qe, kb);
      acc[m][1] = D::dot(acc[m][1], qe + D::W, kb);
    }
  }
  const R sc = D::set1(scale);
#pragma GCC unroll 8
  for (int m = 0; m < MK; ++m) {
    D::store(st + m * ldst, D::not_finite_to_nan(D::mul(acc[m][0], sc)));
    D::store(st + m * ldst + D::W, D::not_finite_to_nan(D::mul(acc[m][1], sc)));
  }
}

template <class D, int MK>
inline void qk_tail(int n, const std::uint32_t* k, int d2, const std::uint32_t* q, int rows_p,
                    float* st, std::int64_t ldst, float scale) {
  if constexpr (MK > 0) {
    if (n == MK) return qk_keys<D, MK>(k, d2, q, rows_p, st, ldst, scale);
    qk_tail<D, MK - 1>(n, k, d2, q, rows_p, st, ldst, scale);
  }
}

template <class D>
void qk(const void* k_tile, std::int64_t /*ldk*/, const float* /*qt*/, std::int64_t /*ldqt*/,
        float* st, std::int64_t ldst, int keys, int rows_p, int /*d*/, void* ws) {
  const Workspace& w = *static_cast<const Workspace*>(ws);
  const auto* k = static_cast<const std::uint32_t*>(k_tile);
  const int d2 = w.d2;
  constexpr int kKeys = 8;  // 8 keys x 32 rows: 16 accumulators
  for (int r0 = 0; r0 < rows_p; r0 += 2 * D::W) {
    const std::uint32_t* q = w.q + r0;
    int j = 0;
    for (; j + kKeys <= keys; j += kKeys)
      qk_keys<D, kKeys>(k + j * d2, d2, q, rows_p, st + j * ldst + r0, ldst, w.scale);
    qk_tail<D, kKeys - 1>(keys - j, k + j * d2, d2, q, rows_p, st + j * ldst + r0, ldst, w.scale);
  }
}

// O[r][c..c+2W) for MR rows: p points at the pairs of row r0 (stride rows_p), v at column c.
template <class D, int MR>
inline void pv_rows(const std::uint32_t* p, int rows_p, int k2, const std::uint32_t* v, int dv,
                    float* o, std::int64_t ldo, const float* alpha) {
  using R = typename D::reg;
  R acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = D::zero();
  if constexpr (lane_pairs<D>() && MR % 4 == 0) {
    // The pairs of rows r0 .. r0 + MR, 4 to a vector.
    for (int j2 = 0; j2 < k2; ++j2) {
      const std::uint32_t* vj = v + std::int64_t(j2) * dv;
      const std::uint32_t* pj = p + std::int64_t(j2) * rows_p;
#pragma GCC unroll 2
      for (int b = 0; b < MR / 4; ++b) {
        const typename D::preg pb = D::load_pairs(pj + 4 * b);
        for_lanes<4>([&](auto lane) {
          acc[4 * b + lane][0] = D::template dot_lane<lane>(acc[4 * b + lane][0], vj, pb);
          acc[4 * b + lane][1] = D::template dot_lane<lane>(acc[4 * b + lane][1], vj + D::W, pb);
        });
      }
    }
  } else {
    for (int j2 = 0; j2 < k2; ++j2) {
      const std::uint32_t* vj = v + std::int64_t(j2) * dv;
      const std::uint32_t* pj = p + std::int64_t(j2) * rows_p;
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        acc[r][0] = D::dot(acc[r][0], vj, pj[r]);
        acc[r][1] = D::dot(acc[r][1], vj + D::W, pj[r]);
      }
    }
  }
  // O * alpha joins at the end (pv_rows of tile_kernels_impl.hpp says why).
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const R a = D::set1(alpha[r]);
    D::store(o + r * ldo, D::fma(D::load(o + r * ldo), a, acc[r][0]));
    D::store(o + r * ldo + D::W, D::fma(D::load(o + r * ldo + D::W), a, acc[r][1]));
  }
}

template <class D, int MR>
inline void pv_tail(int n, const std::uint32_t* p, int rows_p, int k2, const std::uint32_t* v,
                    int dv, float* o, std::int64_t ldo, const float* alpha) {
  if constexpr (MR > 0) {
    if (n == MR) return pv_rows<D, MR>(p, rows_p, k2, v, dv, o, ldo, alpha);
    pv_tail<D, MR - 1>(n, p, rows_p, k2, v, dv, o, ldo, alpha);
  }
}

// PairsMade: the engine's softmax step wrote P's pairs into the workspace already
// (softmax_to_pairs); else P^T's f32 rows in ST are packed here.
template <class D, bool PairsMade = false>
void pv(const float* pt, std::int64_t ldpt, const void* v_tile, std::int64_t /*ldv*/, float* o,
        std::int64_t ldo, const float* alpha, int rows, int keys, int dv, void* ws) {
  const Workspace& w = *static_cast<const Workspace*>(ws);
  const auto* v = static_cast<const std::uint32_t*>(v_tile);
  const int k2 = (keys + 1) / 2, rows_p = w.rows_p;
  if constexpr (!PairsMade) pack_row_pairs_of_rows<D>(pt, ldpt, keys, rows_p, k2, w.p);
  constexpr int kRows = 8;  // 8 rows x 32 columns: 16 accumulators
  for (int c = 0; c < dv; c += 2 * D::W) {
    int r = 0;
    for (; r + kRows <= rows; r += kRows)
      pv_rows<D, kRows>(w.p + r, rows_p, k2, v + c, dv, o + r * ldo + c, ldo, alpha + r);
    pv_tail<D, kRows - 1>(rows - r, w.p + r, rows_p, k2, v + c, dv, o + r * ldo + c, ldo,
                          alpha + r);
  }
}

// The softmax step of an engine whose softmax makes P's pairs itself: Softmax (the f32 base's
// softmax_tile_pairs, tile_kernels_impl.hpp, instantiated in the engine's target region) writes
// them where pv<D, true> reads them, in one pass instead of f32 probabilities into ST and their
// packing in pv (AMD Zen 4, one core, bench_engine_steps: P.V 204-205 -> 213-214 GFLOP/s, the
// softmax 6.2% -> 7.1-7.7% of the item, the item 199.5-199.9 -> 201.9-202.8; docs/benchmarks.md).
template <auto Softmax>
void softmax_to_pairs(float* st, std::int64_t ldst, int keys, int rows_p, float* m, float* l,
                      float* alpha, void* ws) {
  const Workspace& w = *static_cast<const Workspace*>(ws);
  Softmax(st, ldst, keys, rows_p, m, l, alpha, w.p, w.rows_p);
}

// The functions an engine's TileKernels take from here (instantiated inside the including
// file's target region; bf16_tile_kernels() assembles them outside it). Softmax: nullptr for the
// base's softmax step and the packing in pv, else softmax_to_pairs's.
template <class D, auto Softmax = nullptr>
constexpr Bf16Functions bf16_dot_functions() {
  // On the type, not the address: a function's address is no constant expression under
  // GCC's sanitizers.
  constexpr bool fused = !std::is_same_v<decltype(Softmax), std::nullptr_t>;
  Bf16Functions f{
      &qk<D>,
      &pv<D, fused>,
      {&workspace_bytes, &pack_q<D>, &k_tile_bytes, &v_tile_bytes, &pack_k<D>, &pack_v<D>},
      2 * D::W};
  if constexpr (fused) f.softmax_tile = &softmax_to_pairs<Softmax>;
  return f;
}
