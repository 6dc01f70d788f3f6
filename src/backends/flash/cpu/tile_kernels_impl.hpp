// The FLASH tile kernels written once over a SIMD vector type `V`, instantiated per ISA by
// kernels_avx2.cpp, kernels_avx512.cpp (inside their target regions) and kernels_portable.cpp.
// Include only from there, after the standard headers and inside a per-ISA namespace.
//
// V provides: reg, W (lanes), zero(), set1(f), load(p), store(p, r), fma(a, b, c) = a*b + c,
// mul, add, sub, max, select_zero_if_neg_inf(x) (0 where x == -inf, else x), select_gt(a, b,
// x, y) (a > b ? x : y, false for NaN), min(a, b) (a < b ? a : b: b where either is NaN), div,
// store_codes<G>(p, x) (the G vectors x truncated to int32 lanes, lane i's G values packed into
// p[i] at 32 / G bits each, x[t] at bit 32 / G x t; every x is in [0, 2^(32 / G))),
// exp2_nonpositive(r) (2^x for x <= 0; x < -126 and -inf give 0, NaN stays NaN), load_bf16(p) /
// load_f16(p) converting W 16-bit values, and store_bf16(p, r) / store_f16(p, r) rounding to
// nearest even (NaN stays NaN).

// Vectors per micro-tile row: V::kVectors where V has it (AVX-512's 32 registers hold 6 x 4
// accumulators), else 2.
template <class V>
constexpr int vectors_per_tile() {
  if constexpr (requires { V::kVectors; }) {
    return V::kVectors;
  } else {
    return 2;
  }
}

// f.template operator()<n>() for a count n known only at run time, 1 <= n <= N (nothing
// otherwise): the remainder micro-tiles, whose sizes must be compile-time constants.
template <int N, class F>
inline void for_count(int n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N)
      f.template operator()<N>();
    else
      for_count<N - 1>(n, f);
  }
}

// Whether V multiplies by one scalar operand without broadcasting it (neon_vec.hpp): load_lane0(p)
// puts *p in lane 0 (the other lanes unspecified) and fma_lane0(s, b, c) = c + b * s[0] (FMLA by
// element), the same fused operation as fma(set1(*p), b, c). Without it GCC broadcast one key of
// the six with LD1R, which also takes a vector-pipe uop on Neoverse V1/V2 beside the 18 FMLAs
// (93% of FMLA's rate under llvm-mca, against 99% for SVE's LD1RW, a load alone).
template <class V>
constexpr bool scalar_lane() {
  return requires(const float* p, typename V::reg r) {
    V::load_lane0(p);
    V::fma_lane0(r, r, r);
  };
}

// ST[j][r0..r0+NV W) for MK keys starting at `k`.
template <class V, int MK, int NV>
inline void qk_keys(const float* k, std::int64_t ldk, const float* qt, std::int64_t ldqt, float* st,
                    std::int64_t ldst, int d) {
  using R = typename V::reg;
  R acc[MK][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MK; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[m][v] = V::zero();
  // While a micro-tile runs, the next one's K rows come in a cache line (16 floats) at a time:
  // they stream from L3 in the item's first row block, which the hardware prefetchers leave
  // Q.K^T waiting on (AMD Zen 4, bench_engine_steps --tiles 72, K and V beyond L2: Q.K^T 105 ->
  // 114 GFLOP/s a core, the f32 engine 103 -> 107; no change on hot tiles). Past the tile's last
  // key the addresses may lie beyond the buffer: they are made as integers, never dereferenced,
  // and a prefetch never faults.
  const std::uintptr_t next_keys = reinterpret_cast<std::uintptr_t>(k) +
                                   std::uintptr_t(MK) * std::uintptr_t(ldk) * sizeof(float);
  for (int e0 = 0; e0 < d; e0 += 16) {
#pragma GCC unroll 8
    for (int m = 0; m < MK; ++m)
      __builtin_prefetch(
          reinterpret_cast<const void*>(
              next_keys +
              (std::uintptr_t(m) * std::uintptr_t(ldk) + std::uintptr_t(e0)) * sizeof(float)),
          0, 3);
    const int e1 = e0 + 16 < d ? e0 + 16 : d;
    for (int e = e0; e < e1; ++e) {
      R q[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) q[v] = V::load(qt + e * ldqt + v * V::W);
#pragma GCC unroll 8
      for (int m = 0; m < MK; ++m) {
        if constexpr (scalar_lane<V>()) {
          const R kb = V::load_lane0(k + m * ldk + e);
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) acc[m][v] = V::fma_lane0(kb, q[v], acc[m][v]);
        } else {
          const R kb = V::set1(k[m * ldk + e]);
#pragma GCC unroll 4
          for (int v = 0; v < NV; ++v) acc[m][v] = V::fma(kb, q[v], acc[m][v]);
        }
      }
    }
  }
  // A logit that is not finite (the dot product overflowed f32, or Q or K held an inf or NaN)
  // becomes NaN: x * 0 + x is x for every finite x and NaN for +-inf, so an overflow can never
  // pass for a hidden key (-inf) and poisons its row instead (docs/semantics.md).
  const R zero = V::zero();
#pragma GCC unroll 8
  for (int m = 0; m < MK; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      V::store(st + m * ldst + v * V::W, V::fma(acc[m][v], zero, acc[m][v]));
}

// The keys of one block of NV W rows: micro-tiles of 6 keys, the remainder in one smaller one.
template <class V, int NV>
inline void qk_rows(const float* k, std::int64_t ldk, const float* qt, std::int64_t ldqt, float* st,
                    std::int64_t ldst, int keys, int d) {
  int j = 0;
  for (; j + 6 <= keys; j += 6)
    qk_keys<V, 6, NV>(k + j * ldk, ldk, qt, ldqt, st + j * ldst, ldst, d);
  for_count<5>(keys - j, [&]<int MK>() {
    qk_keys<V, MK, NV>(k + j * ldk, ldk, qt, ldqt, st + j * ldst, ldst, d);
  });
}

// Row blocks of NV W rows (the last ones, if shorter, of 2 W, and where NV is odd one of W:
// rows_p is a multiple of 2 W), each against the whole tile: a block's Q^T slice stays in L1
// while the tile's keys stream by.
template <class V>
void qk(const void* k_tile, std::int64_t ldk, const float* qt, std::int64_t ldqt, float* st,
        std::int64_t ldst, int keys, int rows_p, int d, void* /*ws*/) {
  const auto* k = static_cast<const float*>(k_tile);
  constexpr int NV = vectors_per_tile<V>();
  int r0 = 0;
  for (; r0 + NV * V::W <= rows_p; r0 += NV * V::W)
    qk_rows<V, NV>(k, ldk, qt + r0, ldqt, st + r0, ldst, keys, d);
  for (; r0 + 2 * V::W <= rows_p; r0 += 2 * V::W)
    qk_rows<V, 2>(k, ldk, qt + r0, ldqt, st + r0, ldst, keys, d);
  if constexpr (NV % 2 == 1) {
    if (r0 < rows_p) qk_rows<V, 1>(k, ldk, qt + r0, ldqt, st + r0, ldst, keys, d);
  }
}

// e^(x - m_use) for x <= m_use: 2^(x log2 e) with the difference taken first, so that finite
// logits as large as a mask's -3.4e38 never overflow on the way.
template <class V>
inline typename V::reg softmax_exp(typename V::reg x, typename V::reg m_use) {
  return V::exp2_nonpositive(V::mul(V::sub(x, m_use), V::set1(std::numbers::log2e_v<float>)));
}

// The largest logit of W rows (a column block of ST) over a tile's keys, taken one key at a time
// in key order: even keys in one chain, odd keys in the other, so that the result (NaN included:
// vmaxps returns its second operand when one is NaN) is the same bits however the keys are
// visited in that order.
template <class V>
struct ColumnMax {
  using R = typename V::reg;
  // A constructor of its own, not member initialisers: the engine's target region (clang's
  // attribute pragma) applies to declared functions only, not to an implicit constructor.
  ColumnMax() : even(V::set1(-std::numeric_limits<float>::infinity())), odd(even) {}
  R even, odd;
  void take(int j, const float* s) {
    if ((j & 1) == 0)
      even = V::max(even, V::load(s));
    else
      odd = V::max(odd, V::load(s));
  }
  R get() const { return V::max(even, odd); }
};

template <class V>
inline typename V::reg column_max(const float* st, std::int64_t ldst, int keys, int r) {
  ColumnMax<V> mx;
  for (int j = 0; j < keys; ++j) mx.take(j, st + j * ldst + r);
  return mx.get();
}

// softmax_tile's reference for the W rows at r whose tile's largest logit is tile_max: sets
// m[r..] and alpha[r..], returns the reference the probabilities use.
template <class V>
inline typename V::reg softmax_reference(typename V::reg tile_max, int r, float* m, float* alpha) {
  using R = typename V::reg;
  const R m_old = V::load(m + r);
  // A lazy running max: m rises only when a logit passes it, and then kMaxHeadroom above the
  // tile's max, so that later tiles seldom raise it again and alpha is exactly 1 for most
  // tiles (the AMX engine then skips rescaling O). Every probability stays <= 1 (>= e^-8 for
  // the row's largest logit); LSE = m + log(l) whatever m is. A NaN max leaves m alone (its
  // NaN probability poisons l anyway); +inf raises m to +inf, and inf - inf poisons l.
  const R m_new = V::select_gt(tile_max, m_old, V::add(tile_max, V::set1(kMaxHeadroom)), m_old);
  // A row that has seen nothing keeps m = -inf; subtracting 0 instead keeps its
  // probabilities at e^-inf = 0 rather than NaN. A NaN logit gives a NaN probability
  // (exp2_nonpositive keeps NaN), and a +inf one gives inf - inf = NaN: either way the row's
  // sum l turns NaN and stays NaN, which the row writer reports as a NaN row.
  const R m_use = V::select_zero_if_neg_inf(m_new);
  V::store(alpha + r, softmax_exp<V>(m_old, m_use));
  V::store(m + r, m_new);
  return m_use;
}

// e^(s - m_use) for the logits at s (natural units).
template <class V>
inline typename V::reg softmax_probability(const float* s, typename V::reg m_use) {
  return softmax_exp<V>(V::load(s), m_use);
}

// The column blocks of softmax_tile and softmax_tile_codes, W rows at a time: block(r, tile_max,
// m_use, next) makes block r's probabilities against m_use (softmax_reference's, from the block's
// largest logit tile_max), takes each key j's logit at next + j * ldst into a ColumnMax in key
// order and returns its maximum: the next block's (for the last block, its own again, unused;
// the ColumnMax is the block's own so that it stays in registers). A block's reference waits on its
// maximum and its probabilities on the reference; with the next block's maximum taken among this
// block's probabilities, that wait overlaps work instead of stalling every block (AMD Zen 4, the
// f32 softmax of a 256-row tile: 11.3 -> 9.3 cycles per 16 logits).
template <class V, class Block>
inline void softmax_blocks(const float* st, std::int64_t ldst, int keys, int rows_p, float* m,
                           float* alpha, Block&& block) {
  typename V::reg tile_max = column_max<V>(st, ldst, keys, 0);
  for (int r = 0; r < rows_p; r += V::W) {
    const typename V::reg m_use = softmax_reference<V>(tile_max, r, m, alpha);
    const float* next = st + (r + V::W < rows_p ? r + V::W : r);
    tile_max = block(r, tile_max, m_use, next);
  }
}

// The softmax step over a tile with each key pair's probabilities handed to put(j, r, p_j,
// p_j+1, odd) for the block of rows from r (odd false: key j is the tile's last, p_j+1 zero);
// l sums them in the order softmax_tile's bits depend on.
template <class V, class Put>
inline void softmax_tile_to(const float* st, std::int64_t ldst, int keys, int rows_p, float* m,
                            float* l, float* alpha, Put&& put) {
  using R = typename V::reg;
  softmax_blocks<V>(st, ldst, keys, rows_p, m, alpha, [&](int r, R, R m_use, const float* next) {
    ColumnMax<V> next_max;
    R sum0 = V::zero(), sum1 = V::zero();
    int j = 0;
    // Two independent evaluations per step hide part of the polynomial's latency.
    for (; j + 2 <= keys; j += 2) {
      const float* s0 = st + j * ldst + r;
      next_max.take(j, next + j * ldst);
      next_max.take(j + 1, next + (j + 1) * ldst);
      const R p0 = softmax_probability<V>(s0, m_use);
      const R p1 = softmax_probability<V>(s0 + ldst, m_use);
      put(j, r, p0, p1, true);
      sum0 = V::add(sum0, p0);
      sum1 = V::add(sum1, p1);
    }
    if (j < keys) {
      next_max.take(j, next + j * ldst);
      const R p0 = softmax_probability<V>(st + j * ldst + r, m_use);
      put(j, r, p0, V::zero(), false);
      sum0 = V::add(sum0, p0);
    }
    V::store(l + r, V::fma(V::load(l + r), V::load(alpha + r), V::add(sum0, sum1)));
    return next_max.get();
  });
}

template <class V>
void softmax_tile(float* st, std::int64_t ldst, int keys, int rows_p, float* m, float* l,
                  float* alpha, void* /*ws*/) {
  using R = typename V::reg;
  softmax_tile_to<V>(st, ldst, keys, rows_p, m, l, alpha, [&](int j, int r, R p0, R p1, bool odd) {
    V::store(st + j * ldst + r, p0);
    if (odd) V::store(st + (j + 1) * ldst + r, p1);
  });
}

// softmax_tile for the bf16 engines' P.V (bf16_dot_impl.hpp): the probabilities go straight to
// bf16 pairs over keys instead of back into ST, which keeps the logits: pair row i holds keys 2i
// (low half) and 2i + 1 (high half) of every row, row r's at pairs[i * ldp + r], each rounded to
// nearest even (NaN stays NaN), a missing last odd key 0: the bits softmax_tile and then
// bf16_pairs.hpp's pack_row_pairs_of_rows give, in one pass. m, l and alpha are softmax_tile's.
// V also provides store_bf16_pairs(p, even, odd).
template <class V>
void softmax_tile_pairs(const float* st, std::int64_t ldst, int keys, int rows_p, float* m,
                        float* l, float* alpha, std::uint32_t* pairs, std::int64_t ldp) {
  using R = typename V::reg;
  softmax_tile_to<V>(st, ldst, keys, rows_p, m, l, alpha, [&](int j, int r, R p0, R p1, bool) {
    V::store_bf16_pairs(pairs + (j / 2) * ldp + r, p0, p1);
  });
}

// softmax_tile for the integer P.V (int8_impl.hpp): the probabilities go straight to codes instead
// of back into ST. Row r's codes are p * top / pmax_r rounded to the nearest integer (ties to
// even; one rounding of the exact product, in the FMA that adds 2^23 to it), at most top, its
// scale ps[r] = pmax_r / top, where pmax_r = e^(tile max - m_use) is the probability of the
// tile's largest logit (computed as every p: no pass over the probabilities for their max); a row
// whose tile is all hidden (pmax 0) or holds a +inf logit (pmax NaN) gets scale 0 and codes 0
// (a NaN probability's code is top: its row's sum l is NaN already). G keys' codes to a 32-bit
// group (32 / G bits each, key t of a group at bit 32 / G x t), group g of row r at codes[g * ldg +
// r]; every group of the 64-key tile is written, keys past `keys` as code 0. l sums the f32
// probabilities as softmax_tile does (the same order, so the same bits).
template <class V, int G>
void softmax_tile_codes(float* st, std::int64_t ldst, int keys, int rows_p, float* m, float* l,
                        float* alpha, std::uint32_t* codes, int ldg, float* ps, float top_code) {
  using R = typename V::reg;
  // 2^23 + a code (V::store_codes keeps its low bits): 2^23 + p * inv rounds to an integer.
  const R zero = V::zero(), top = V::set1(top_code), round = V::set1(0x1p23f),
          round_top = V::set1(0x1p23f + top_code);
  softmax_blocks<V>(
      st, ldst, keys, rows_p, m, alpha, [&](int r, R tile_max, R m_use, const float* next) {
        ColumnMax<V> next_max;
        const R pmax = softmax_exp<V>(tile_max, m_use);
        // pmax / top and top / pmax where pmax > 0, else 0 (pmax 0 or NaN: select_gt is false).
        const R inv = V::select_gt(pmax, zero, V::div(top, pmax), zero);
        V::store(ps + r, V::select_gt(pmax, zero, V::div(pmax, top), zero));
        R sum0 = V::zero(), sum1 = V::zero();
        // 2^23 + key j's code; its probability joins the sum of its parity.
        const auto code_of = [&](int j) {
          next_max.take(j, next + j * ldst);
          const R p = softmax_probability<V>(st + j * ldst + r, m_use);
          if ((j & 1) == 0)
            sum0 = V::add(sum0, p);
          else
            sum1 = V::add(sum1, p);
          return V::min(V::fma(p, inv, round), round_top);  // NaN p: top
        };
        for (int g = 0; g < kTileKeys / G; ++g) {
          R x[G];
          const int n = keys - g * G;  // keys of this group (>= G: all of them)
          if (n >= G) {
#pragma GCC unroll 4
            for (int t = 0; t < G; ++t) x[t] = code_of(g * G + t);
          } else {
            for (int t = 0; t < G; ++t) x[t] = t < n ? code_of(g * G + t) : round;
          }
          V::template store_codes<G>(codes + std::int64_t(g) * ldg + r, x);
        }
        V::store(l + r, V::fma(V::load(l + r), V::load(alpha + r), V::add(sum0, sum1)));
        return next_max.get();
      });
}

// softmax_tile_codes for G given at run time (TileSteps::softmax_tile_codes).
template <class V>
void softmax_tile_codes_any(float* st, std::int64_t ldst, int keys, int rows_p, float* m, float* l,
                            float* alpha, std::uint32_t* codes, int ldg, float* ps, int group,
                            float top) {
  if (group == 4)
    softmax_tile_codes<V, 4>(st, ldst, keys, rows_p, m, l, alpha, codes, ldg, ps, top);
  else
    softmax_tile_codes<V, 2>(st, ldst, keys, rows_p, m, l, alpha, codes, ldg, ps, top);
}

// O[r][c..c+NV W) for MR rows: one column chunk of P.V. The accumulators start at zero and O *
// alpha joins them at the end: started from O * alpha, every FMA chain waited on O's loads
// (from L2: O is 128 KiB at 256 rows x 128 columns), about 5% of the kernel (hot tile, one
// core, AMD Zen 4: 105-108 -> 112.5 GFLOP/s of a 117 peak at 256 rows x 64 keys x 128).
template <class V, int MR, int NV>
inline void pv_rows(const float* pt, std::int64_t ldpt, const float* v, std::int64_t ldv, float* o,
                    std::int64_t ldo, const float* alpha, int keys) {
  using R = typename V::reg;
  R acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = V::zero();
  const float* vj = v;
  const float* pj = pt;
  for (int j = 0; j < keys; ++j, vj += ldv, pj += ldpt) {
    R vv[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) vv[c] = V::load(vj + c * V::W);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      if constexpr (scalar_lane<V>()) {
        const R w = V::load_lane0(pj + r);
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) acc[r][c] = V::fma_lane0(w, vv[c], acc[r][c]);
      } else {
        const R w = V::set1(pj[r]);
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) acc[r][c] = V::fma(w, vv[c], acc[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const R a = V::set1(alpha[r]);
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c)
      V::store(o + r * ldo + c * V::W, V::fma(V::load(o + r * ldo + c * V::W), a, acc[r][c]));
  }
}

// One column chunk of NV W columns for every row. Rows come in blocks of 6, the remainder in
// blocks of 4 and fewer so that no block is left with too few accumulators to hide the FMA
// latency.
template <class V, int NV>
inline void pv_chunk(const float* pt, std::int64_t ldpt, const float* v, std::int64_t ldv, float* o,
                     std::int64_t ldo, const float* alpha, int rows, int keys) {
  int sixes = rows / 6;
  if (rows % 6 == 2 && sixes > 0) --sixes;  // 6k + 2 = 6(k - 1) + 4 + 4
  int r = 0;
  for (int n = 0; n < sixes; ++n, r += 6)
    pv_rows<V, 6, NV>(pt + r, ldpt, v, ldv, o + r * ldo, ldo, alpha + r, keys);
  while (r < rows) {
    const int n = rows - r == 8 ? 4 : rows - r;  // what is left: 1-5, or 8 = 4 + 4
    for_count<5>(n, [&]<int MR>() {
      pv_rows<V, MR, NV>(pt + r, ldpt, v, ldv, o + r * ldo, ldo, alpha + r, keys);
    });
    r += n;
  }
}

// Column chunks outer (NV W columns; the last ones, if shorter, of 2 W, and where NV is odd one
// of W: dv is padded to a multiple of 2 W), row blocks inner: the chunk's slice of V stays in
// L1 while every row block uses it.
template <class V>
void pv(const float* pt, std::int64_t ldpt, const void* v_tile, std::int64_t ldv, float* o,
        std::int64_t ldo, const float* alpha, int rows, int keys, int dv, void* /*ws*/) {
  const auto* v = static_cast<const float*>(v_tile);
  constexpr int NV = vectors_per_tile<V>();
  int c = 0;
  for (; c + NV * V::W <= dv; c += NV * V::W)
    pv_chunk<V, NV>(pt, ldpt, v + c, ldv, o + c, ldo, alpha, rows, keys);
  for (; c + 2 * V::W <= dv; c += 2 * V::W)
    pv_chunk<V, 2>(pt, ldpt, v + c, ldv, o + c, ldo, alpha, rows, keys);
  if constexpr (NV % 2 == 1) {
    if (c < dv) pv_chunk<V, 1>(pt, ldpt, v + c, ldv, o + c, ldo, alpha, rows, keys);
  }
}

template <class V>
void load_row(const void* src, DType dtype, std::int64_t n, float scale, float* dst) {
  using R = typename V::reg;
  const R vs = V::set1(scale);
  std::int64_t i = 0;
  switch (dtype) {
    case DType::F32: {
      const auto* s = static_cast<const float*>(src);
      for (; i + V::W <= n; i += V::W) V::store(dst + i, V::mul(V::load(s + i), vs));
      break;
    }
    case DType::BF16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      for (; i + V::W <= n; i += V::W) V::store(dst + i, V::mul(V::load_bf16(s + i), vs));
      break;
    }
    case DType::F16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      for (; i + V::W <= n; i += V::W) V::store(dst + i, V::mul(V::load_f16(s + i), vs));
      break;
    }
    default:
      break;
  }
  for (; i < n; ++i) dst[i] = load_as_f32(src, dtype, i) * scale;
}

template <class V>
void store_row(const float* src, float scale, std::int64_t n, DType dtype, void* dst) {
  using R = typename V::reg;
  const R vs = V::set1(scale);
  std::int64_t i = 0;
  switch (dtype) {
    case DType::F32: {
      auto* d = static_cast<float*>(dst);
      for (; i + V::W <= n; i += V::W) V::store(d + i, V::mul(V::load(src + i), vs));
      break;
    }
    case DType::BF16: {
      auto* d = static_cast<std::uint16_t*>(dst);
      for (; i + V::W <= n; i += V::W) V::store_bf16(d + i, V::mul(V::load(src + i), vs));
      break;
    }
    case DType::F16: {
      auto* d = static_cast<std::uint16_t*>(dst);
      for (; i + V::W <= n; i += V::W) V::store_f16(d + i, V::mul(V::load(src + i), vs));
      break;
    }
    default:
      break;
  }
  for (; i < n; ++i) store_from_f32(dst, dtype, i, src[i] * scale);
}

// Horizontal max and sum of a vector: V's own where it has them (hmax / hsum), else lane by
// lane.
template <class V>
inline float reduce_max(typename V::reg r) {
  if constexpr (requires { V::hmax(r); }) {
    return V::hmax(r);
  } else {
    float lanes[V::W];
    V::store(lanes, r);
    float m = lanes[0];
    for (int i = 1; i < V::W; ++i) m = lanes[i] > m ? lanes[i] : m;
    return m;
  }
}
template <class V>
inline float reduce_sum(typename V::reg r) {
  if constexpr (requires { V::hsum(r); }) {
    return V::hsum(r);
  } else {
    float lanes[V::W];
    V::store(lanes, r);
    float t = 0.0f;
    for (int i = 0; i < V::W; ++i) t += lanes[i];
    return t;
  }
}

// A row's running reference after a panel whose largest scaled logit is tile_max (the lazy max
// of softmax_tile: it moves only when a logit passes it, then with kMaxHeadroom), the reference
// its probabilities use (0 while nothing is visible) and the factor alpha for what the row holds.
struct RowReference {
  float m_new, m_use, alpha;
};
inline RowReference row_reference(float tile_max, float m_old) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float m_new = tile_max > m_old ? tile_max + kMaxHeadroom : m_old;
  const float m_use = m_new == -kInf ? 0.0f : m_new;
  // exp(0) = 1 where the reference stayed (most rows after the first panels).
  return {m_new, m_use, m_new == m_old && m_old > -kInf ? 1.0f : std::exp(m_old - m_use)};
}

// The probabilities of one row of kp logits (a multiple of 16) against a reference, in place or
// as bf16 to out16 (consecutive bf16 are the pairs over keys); returns their sum in lanes.
// p = 2^(x * scale log2 e - m log2 e): with Fold one FMA x c + b (c = scale log2 e, b = -m
// log2 e), else the difference first (x scale - m) log2 e; Raw: a dot product that is not
// finite becomes NaN. Meanwhile the largest entry of the row at `next` (kp entries, padding
// filled) goes to next_max, taken as softmax_rows_to's row_max takes it (the same bits): the next
// row group's maxima come in while this group works instead of in a pass its references wait on.
// Everything the loop reads is a parameter: the bf16 stores may alias anything, so captured
// variables would be reloaded each step.
template <class V, bool Pairs, bool Raw, bool Fold>
typename V::reg row_probabilities(float* row, std::uint16_t* out16, int kp, typename V::reg vc,
                                  typename V::reg vb, typename V::reg vs, typename V::reg vm,
                                  const float* next, typename V::reg& next_max) {
  using R = typename V::reg;
  R mx0 = V::set1(-std::numeric_limits<float>::infinity()), mx1 = mx0;
  const R zero = V::zero(), vl = V::set1(std::numbers::log2e_v<float>);
  const auto prob = [&](R x) {
    if constexpr (Raw) x = V::fma(x, zero, x);
    const R e = Fold ? V::fma(x, vc, vb) : V::mul(V::sub(V::mul(x, vs), vm), vl);
    // Probabilities bound for bf16 may take V's coarser exponential (an error far below
    // bf16's rounding).
    if constexpr (Pairs && requires { V::exp2_nonpositive_bf16(e); })
      return V::exp2_nonpositive_bf16(e);
    else
      return V::exp2_nonpositive(e);
  };
  const auto put = [&](int j, R x) {
    if constexpr (Pairs)
      V::store_bf16(out16 + j, x);
    else
      V::store(row + j, x);
  };
  // Two vectors at once where V converts them to bf16 in one instruction (store_bf16_pair).
  const auto put_pair = [&](int j, R x0, R x1) {
    if constexpr (Pairs && requires { V::store_bf16_pair(out16, x0, x1); }) {
      V::store_bf16_pair(out16 + j, x0, x1);
    } else {
      put(j, x0);
      put(j + V::W, x1);
    }
  };
  R sum0 = zero, sum1 = zero;
  int j = 0;
  for (; j + 2 * V::W <= kp; j += 2 * V::W) {
    mx0 = V::max(mx0, V::load(next + j));
    mx1 = V::max(mx1, V::load(next + j + V::W));
    const R p0 = prob(V::load(row + j)), p1 = prob(V::load(row + j + V::W));
    put_pair(j, p0, p1);
    sum0 = V::add(sum0, p0);
    sum1 = V::add(sum1, p1);
  }
  for (; j < kp; j += V::W) {
    mx0 = V::max(mx0, V::load(next + j));
    const R p0 = prob(V::load(row + j));
    put(j, p0);
    sum0 = V::add(sum0, p0);
  }
  next_max = V::max(mx0, mx1);
  return V::add(sum0, sum1);
}

// RowSoftmax::softmax_rows (Pairs false) and softmax_rows_pairs (true): the rule of
// softmax_tile along rows instead of columns. Where V reduces W vectors at once (hmax_rows,
// hsum_rows), rows go in groups of W: their maxima, references and sums in vectors, one lane per
// row, instead of two horizontal reductions and a scalar exp per row.
template <class V, bool Pairs>
void softmax_rows_to(float* s, std::int64_t lds, int rows, int keys, float scale, bool raw,
                     float* m, float* l, float* alpha, std::uint32_t* p, std::int64_t ldp,
                     int pairs) {
  using R = typename V::reg;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr float kLog2e = std::numbers::log2e_v<float>;
  const int kp = (keys + 15) / 16 * 16;
  // A negative or zero scale turns the order of the logits around: scale them first.
  if (raw && !(scale > 0.0f)) {
    const R sc = V::set1(scale), zero = V::zero();
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j + V::W <= kp; j += V::W) {
        float* at = s + r * lds + j;
        const R x = V::mul(V::load(at), sc);
        V::store(at, V::fma(x, zero, x));  // not finite -> NaN
      }
    raw = false;
  }
  if (!raw) scale = 1.0f;
  // Padding keys: hidden in natural units; in raw ones a finite value that no dot product
  // passes (raw entries that are not finite poison the row).
  const float pad = raw ? -std::numeric_limits<float>::max() : -kInf;
  const float c = scale * kLog2e;
  const R vc = V::set1(c), vs = V::set1(scale), vl = V::set1(kLog2e);

  const auto fill_padding = [&](int r) {
    float* row = s + r * lds;
    for (int j = keys; j < kp; ++j) row[j] = pad;
  };
  // The largest logit of row r (unscaled), its padding filled first.
  const auto row_max = [&](int r) {
    fill_padding(r);
    float* row = s + r * lds;
    R mx0 = V::set1(-kInf), mx1 = mx0;
    int j = 0;
    for (; j + 2 * V::W <= kp; j += 2 * V::W) {
      mx0 = V::max(mx0, V::load(row + j));
      mx1 = V::max(mx1, V::load(row + j + V::W));
    }
    for (; j < kp; j += V::W) mx0 = V::max(mx0, V::load(row + j));
    return V::max(mx0, mx1);
  };
  // Row r's probabilities against the reference m_use; returns their sum in lanes, and row
  // r_next's largest logit (padding filled before) in next_max.
  const auto row_probs = [&](int r, float m_use, int r_next, R& next_max) {
    const float* next = s + r_next * lds;
    float* row = s + r * lds;
    auto* out16 = reinterpret_cast<std::uint16_t*>(Pairs ? p + r * ldp : nullptr);
    // One FMA where |m log2 e| <= 1024, whose rounding then moves the exponent by at most
    // 6e-5; else the difference first (a row whose logits all lie far down the range, as
    // under a large finite mask such as finfo.min or -1e38, where that rounding alone would
    // be astronomically large).
    const float b = -m_use * kLog2e;
    const bool fold = std::abs(b) <= 1024.0f && std::isfinite(c);
    const R vb = V::set1(b), vm = V::set1(m_use);
    R sum;
    if (raw)
      sum = fold ? row_probabilities<V, Pairs, true, true>(row, out16, kp, vc, vb, vs, vm, next,
                                                           next_max)
                 : row_probabilities<V, Pairs, true, false>(row, out16, kp, vc, vb, vs, vm, next,
                                                            next_max);
    else
      sum = fold ? row_probabilities<V, Pairs, false, true>(row, out16, kp, vc, vb, vs, vm, next,
                                                            next_max)
                 : row_probabilities<V, Pairs, false, false>(row, out16, kp, vc, vb, vs, vm, next,
                                                             next_max);
    // The padding keys' probabilities: exactly zero (2^-inf; in raw units 2^(-FLT_MAX c)).
    if constexpr (Pairs) {
      for (int j = keys; j < kp; ++j) out16[j] = 0;
      std::fill(p + r * ldp + kp / 2, p + r * ldp + pairs, 0u);
    } else {
      for (int j = keys; j < kp; ++j) row[j] = 0.0f;
    }
    return sum;
  };

  int r = 0;
  if constexpr (requires(const R(&x)[V::W]) {
                  V::hmax_rows(x);
                  V::hsum_rows(x);
                }) {
    // row_reference in lanes; exp2_nonpositive(0) is exactly 1 where the reference stayed.
    const R headroom = V::set1(kMaxHeadroom);
    R part[V::W];  // the group's row maxima (the first group's from row_max, then row_probs')
    if (rows >= V::W)
      for (int i = 0; i < V::W; ++i) part[i] = row_max(i);
    for (; r + V::W <= rows; r += V::W) {
      const R m_old = V::load(m + r), tile_max = V::mul(V::hmax_rows(part), vs);
      const R m_new = V::select_gt(tile_max, m_old, V::add(tile_max, headroom), m_old);
      const R m_use = V::select_zero_if_neg_inf(m_new);
      const R a = V::exp2_nonpositive(V::mul(V::sub(m_old, m_use), vl));
      V::store(m + r, m_new);
      V::store(alpha + r, a);
      float use[V::W];
      V::store(use, m_use);
      // The next group's maxima come with this group's probabilities (the last group reads its
      // own rows again, for nothing).
      const bool more = r + 2 * V::W <= rows;
      R sums[V::W];
      for (int i = 0; i < V::W; ++i) {
        const int next = more ? r + V::W + i : r + i;
        if (more) fill_padding(next);
        sums[i] = row_probs(r + i, use[i], next, part[i]);
      }
      V::store(l + r, V::add(V::mul(V::load(l + r), a), V::hsum_rows(sums)));
    }
  }
  // One row at a time (the rows past the last group of W, or every row where V has no hmax_rows),
  // the next row's maximum again taken with this row's probabilities.
  R row_mx = r < rows ? row_max(r) : V::zero();
  for (; r < rows; ++r) {
    const RowReference ref = row_reference(reduce_max<V>(row_mx) * scale, m[r]);
    m[r] = ref.m_new;
    alpha[r] = ref.alpha;
    const int next = r + 1 < rows ? r + 1 : r;
    if (next != r) fill_padding(next);
    l[r] = l[r] * ref.alpha + reduce_sum<V>(row_probs(r, ref.m_use, next, row_mx));
  }
}

template <class V>
void softmax_rows(float* s, std::int64_t lds, int rows, int keys, float scale, bool raw, float* m,
                  float* l, float* alpha) {
  softmax_rows_to<V, false>(s, lds, rows, keys, scale, raw, m, l, alpha, nullptr, 0, 0);
}
template <class V>
void softmax_rows_pairs(float* s, std::int64_t lds, int rows, int keys, float scale, bool raw,
                        float* m, float* l, float* alpha, std::uint32_t* p, std::int64_t ldp,
                        int pairs) {
  softmax_rows_to<V, true>(s, lds, rows, keys, scale, raw, m, l, alpha, p, ldp, pairs);
}

template <class V>
constexpr TileKernels make_tile_kernels(std::string_view engine) {
  TileKernels k{engine, 2 * V::W, 2 * V::W, {&load_row<V>, &store_row<V>}};
  k.steps = {&qk<V>, &softmax_tile<V>, &pv<V>, &softmax_tile_codes_any<V>};
  k.row_softmax = {&softmax_rows<V>, &softmax_rows_pairs<V>};
  return k;
}
