// The 8-bit Q.K^T kernels of the SAGE engines (SageAttention's scheme on the CPU: Q and K as
// int8 codes with f32 scales, integer dot products, P.V on the engine's 16-bit or f32 base),
// written once over an integer-dot type `I`, instantiated by kernels_int8_avx2.cpp (avx2_int8,
// avx_vnni), kernels_int8_avx512.cpp (avx512_vnni) and kernels_int8_emulated.cpp (portable
// C++: portable_int8 and the emulated twins). Include only from there, after the standard
// headers, inside a per-engine namespace and the file's target region.
//
// Codes and scales. Each query row and each key is quantized symmetrically on its own (finer
// than SageAttention's per-block scales, at no cost here: every logit is multiplied by its two
// scales anyway): scale = max|x| / 127, code = round(x / scale) in [-127, 127]. A row or key
// with an element that is not finite gets scale NaN (its logits are NaN, as qk's contract
// asks); an all-zero one (or one so small that 127 / max|x| overflows) gets scale 0 and codes
// 0. The softmax scale is folded into the query scales.
//
// I provides: W (int32 lanes per register), G (codes per 32-bit group: 2 = two int16, 4 = four
// bytes for vpdpbusd or avx2_int8's vpmaddubsw sign trick), kOffsetQ (query codes stored as
// q + 128 in unsigned bytes, as vpdpbusd multiplies unsigned by signed bytes; the dot then carries
// 128 * sum(k), which the key's code sum removes; without it both are signed bytes), ireg, zero(),
// load(p) (W groups), dot(acc, q, k) (for every lane: acc += the G products of the lane's group of
// q and the group k broadcast), logits(st, acc, corr, qs, ks, kb, rt) (st[i] = fma(float(acc[i] -
// corr), qs[i] * ks, kb + rt[i]), or with rt null fma(float(acc[i] - corr), qs[i] * ks, kb), then
// NaN where not finite; the same f32 steps on every engine, so that all round alike. The scales are
// multiplied together before the dot: a logit that is finite in f32 never overflows on the way,
// however large the query's scale).
//
// Layouts (a group is one uint32 of G codes over consecutive elements of d, the lowest first;
// missing elements are code 0, stored 128 for offset queries):
//   K tile (panel)  [kTileKeys] f32 scales | [kTileKeys] int32 code sums | [kTileKeys] f32
//                   logit terms (set_key_bias; 0 from pack_k) | 64 bytes: the tile's run
//                   (int32, set_key_bias; 0 from pack_k) | [kTileKeys][dg] groups
//                   (dg = ceil(d / G))
//   V tile (panel)  the base engine's (f32 rows of stride dv + kStridePad where it has none)
//   workspace: header | q [dg][ldg] groups of QT per row (ldg = int8_group_stride(rows_p)), for
//              engines with I::kSplitSign the codes' magnitudes there, their signs after
//              them ([dg][ldg] groups of bytes 0xff where the code is negative, else 0) and
//              then each row's sum of its negative codes' magnitudes ([ldg] int32) |
//              qs [rows_p] | inverse scales [rows_p] | zeros [rows_p] | the base engine's
//              workspace
// so Q.K^T broadcasts one key group against 2W query rows, like the bf16 engines' pairs.
//
// 16-bit integer lanes (the int16 engines: I::G == 2 with I::kExact). Q and K codes are int16
// pairs of at most int16_code_top(coded) (kernels.hpp: 4095 up to 128 coded channels, so that no
// int32 lane wraps) over the first coded = d - E channels, E = int16_exact_channels(d); the last
// E channels are exact f32 terms (the driver moves the channels of largest spread there): each
// logit gets sum_t qe[t][r] * ke[j][t] added in f32 after the codes' part (fma in channel order,
// then NaN where not finite), where qe holds the query's channels times the logit scale (an
// area of [E][rows_p] f32 after the zeros in the workspace) and ke the key's (an area of
// [kTileKeys][E] f32 after the K tile's groups). The byte engines' vector packing hooks
// (pack_key_row, pack_query_rows, pack_query_split) write bytes and are not used for them.
//
// Row terms. Every logit of a tile of run n >= 1 gets its row's term of that run added in f32
// (OperandFormats::set_row_terms: SAGE's exact q . (mean_n - mean_0), the driver having
// subtracted each run's mean from its keys and restoring run 0's q . mean_0 in the row's
// reference); tiles of run 0 (every tile of a one-run key set) add none. No terms until the
// driver sets them, and a tile's run is 0 until set_key_bias sets it.

struct Int8Header {
  std::uint32_t* q;
  float *qs, *inv;
  float* qe;  // the exact channels' terms, [exact][rows_p] (16-bit lanes), else unused
  int exact;
  const float* rt;     // the row terms, [runs][rows_p] (set_row_terms), or `zeros`
  const float* zeros;  // rows_p zeros
  void* base_ws;
  int rows_p, dg;
  int ldg;  // the stride of q's groups (int8_group_stride)
};

constexpr std::size_t int8_align64(std::size_t n) {
  return (n + 63) / 64 * 64;
}

// The stride (in groups) of the per-row group arrays (Q's codes, P.V's P codes): rows_p plus a
// cache line, so that one row block's successive groups do not all fall in the same few L1
// sets (rows_p = 256 puts them 1 KiB apart, 4 sets of a 32 KiB 8-way L1: avx2_int8 lost 10% to
// it on AMD Zen 4, 120 -> 134 GFLOP/s on one 256-row item of flux-1024's head size).
constexpr int int8_group_stride(int rows_p) {
  return rows_p + 16;
}

template <class I>
constexpr bool byte_codes() {
  return I::G == 4;
}

template <class I>
constexpr bool exact_terms() {
  if constexpr (requires { I::kExact; })
    return I::kExact;
  else
    return false;
}

// How many of d channels are exact f32 terms, and the codes' largest magnitude.
template <class I>
constexpr int exact_of(int d) {
  if constexpr (exact_terms<I>())
    return int16_exact_channels(d);
  else
    return 0;
}
template <class I>
float code_top_of(int d) {
  if constexpr (byte_codes<I>())
    return 127.0f;
  else
    return int16_code_top(d - exact_of<I>(d));
}

// Groups of the coded channels of a head of d.
template <class I>
constexpr int groups_of(int d) {
  const int coded = d - exact_of<I>(d);
  return (coded + I::G - 1) / I::G;
}

// Whether the engine keeps Q's codes as magnitudes and sign masks (avx2_int8's sign trick reads
// both in every step; kept once per item, its loop makes neither). Such an engine's own loop body
// (I::qk_group4 with the masks) adds |q| x (k ^ m) per element, which is q x k where q >= 0 and
// q x k - |q| where q < 0 (k ^ 0xff = -k - 1): the dot falls short by the row's sum of its
// negative codes' magnitudes, kept per row after the masks and added back after the last group.
template <class I>
constexpr bool split_sign() {
  if constexpr (requires { I::kSplitSign; })
    return I::kSplitSign;
  else
    return false;
}

struct Int8Sizes {
  std::size_t head, q, qs, exact, base;
  std::size_t total() const { return head + q + 3 * qs + exact + base; }
};

template <class I, const TileKernels& (*Base)()>
Int8Sizes int8_sizes(int rows_p, int d, int dv) {
  const TileKernels& b = Base();
  return {int8_align64(sizeof(Int8Header)),
          int8_align64((split_sign<I>() ? 2 * std::size_t(groups_of<I>(d)) + 1
                                        : std::size_t(groups_of<I>(d))) *
                       std::size_t(int8_group_stride(rows_p)) * 4),
          int8_align64(std::size_t(rows_p) * sizeof(float)),
          int8_align64(std::size_t(exact_of<I>(d)) * std::size_t(rows_p) * sizeof(float)),
          b.formats.workspace_bytes != nullptr ? b.formats.workspace_bytes(rows_p, d, dv) : 0};
}

template <class I, const TileKernels& (*Base)()>
std::size_t int8_workspace_bytes(int rows_p, int d, int dv) {
  return int8_sizes<I, Base>(rows_p, d, dv).total();
}

// The scale of values whose largest magnitude is `amax` (NaN: one is not finite), and the
// multiplier that turns a value into its code (0 where the scale is 0), codes up to `top`.
struct Quant {
  float scale, inv;
};
inline Quant quant_of(float amax, bool finite, float top = 127.0f) {
  if (!finite) return {std::numeric_limits<float>::quiet_NaN(), 0.0f};
  if (!(amax > 0.0f)) return {0.0f, 0.0f};
  const float inv = top / amax;
  if (!std::isfinite(inv)) return {0.0f, 0.0f};
  return {amax / top, inv};
}

// The quantization of the n values of one row or key (its largest magnitude, its finiteness).
inline Quant quant_of_row(const float* x, int n, float top = 127.0f) {
  float amax = 0.0f;
  bool finite = true;
  for (int e = 0; e < n; ++e) {
    finite = finite && std::isfinite(x[e]);
    amax = std::max(amax, std::fabs(x[e]));
  }
  return quant_of(amax, finite, top);
}

inline int code_of(float x, float inv, float top = 127.0f) {
  const float c = std::nearbyint(x * inv);  // round half to even
  if (std::isnan(c)) return 0;              // a value that is not finite (its scale is NaN)
  return static_cast<int>(std::clamp(c, -top, top));
}

// G signed codes as one 32-bit group (int16 pairs for G = 2, bytes for G = 4).
template <int G>
std::uint32_t group_bits_of(const int* codes) {
  std::uint32_t g = 0;
  for (int t = 0; t < G; ++t) {
    const int c = codes[t];
    const std::uint32_t bits = G == 2 ? std::uint32_t(std::uint16_t(std::int16_t(c)))
                                      : std::uint32_t(std::uint8_t(std::int8_t(c)));
    g |= bits << (t * (32 / G));
  }
  return g;
}
template <class I>
std::uint32_t group_bits(const int* codes) {
  return group_bits_of<I::G>(codes);
}

template <class I>
std::uint32_t query_group_bits(const int* codes) {
  if constexpr (I::kOffsetQ) {
    std::uint32_t g = 0;
    for (int t = 0; t < I::G; ++t) g |= std::uint32_t(codes[t] + 128) << (8 * t);
    return g;
  } else {
    return group_bits<I>(codes);
  }
}

inline std::size_t int8_k_header_bytes() {
  return std::size_t(kTileKeys) * (2 * sizeof(float) + sizeof(std::int32_t)) + 64;
}

// Where a K tile keeps its run (the int32 after the key terms).
inline std::int32_t* int8_tile_run(void* tile) {
  return reinterpret_cast<std::int32_t*>(static_cast<float*>(tile) + 3 * kTileKeys);
}
inline std::int32_t int8_tile_run(const void* tile) {
  return *reinterpret_cast<const std::int32_t*>(static_cast<const float*>(tile) + 3 * kTileKeys);
}

inline void int8_set_key_bias(void* tile, const float* bias, int keys, int run) {
  float* kb = static_cast<float*>(tile) + 2 * kTileKeys;
  std::copy(bias, bias + keys, kb);
  *int8_tile_run(tile) = run;
}

inline void int8_set_row_terms(void* ws, const float* terms) {
  auto* h = static_cast<Int8Header*>(ws);
  h->rt = terms != nullptr ? terms : h->zeros;
}

template <class I>
std::size_t int8_k_tile_bytes(int d) {
  return int8_align64(int8_k_header_bytes() +
                      std::size_t(kTileKeys) * std::size_t(groups_of<I>(d)) * 4) +
         std::size_t(kTileKeys) * std::size_t(exact_of<I>(d)) * sizeof(float);
}

// A K tile's exact channels' values, [kTileKeys][exact_of(d)] (16-bit lanes).
template <class I>
float* int8_k_exact(void* tile, int d) {
  return reinterpret_cast<float*>(
      static_cast<unsigned char*>(tile) +
      int8_align64(int8_k_header_bytes() +
                   std::size_t(kTileKeys) * std::size_t(groups_of<I>(d)) * 4));
}

template <class I>
void int8_pack_k(const float* k, std::int64_t ld, int keys, int d, void* tile) {
  auto* ks = static_cast<float*>(tile);
  auto* sums = reinterpret_cast<std::int32_t*>(ks + kTileKeys);
  float* kb = ks + 2 * kTileKeys;
  auto* groups =
      reinterpret_cast<std::uint32_t*>(static_cast<unsigned char*>(tile) + int8_k_header_bytes());
  const int dg = groups_of<I>(d);
  const int exact = exact_of<I>(d), coded = d - exact;
  const float top = code_top_of<I>(d);
  std::fill(kb, kb + kTileKeys, 0.0f);
  *int8_tile_run(tile) = 0;
  if (exact > 0) {
    float* ke = int8_k_exact<I>(tile, d);
    std::fill(ke, ke + kTileKeys * exact, 0.0f);
    for (int j = 0; j < keys; ++j)
      for (int t = 0; t < exact; ++t) ke[j * exact + t] = k[j * ld + coded + t];
  }
  for (int j = 0; j < keys; ++j) {
    const float* row = k + j * ld;
    if constexpr (byte_codes<I>() && requires { I::pack_key_row(row, d, groups, ks); }) {
      // The same codes and sums in vectors (the engine's I::pack_key_row).
      sums[j] = I::pack_key_row(row, d, groups + std::int64_t(j) * dg, ks + j);
      continue;
    }
    const Quant qn = quant_of_row(row, coded, top);
    ks[j] = qn.scale;
    std::int32_t sum = 0;
    for (int g = 0; g < dg; ++g) {
      int codes[4] = {0, 0, 0, 0};
      for (int t = 0; t < I::G; ++t) {
        const int e = g * I::G + t;
        codes[t] = e < coded ? code_of(row[e], qn.inv, top) : 0;
        sum += codes[t];
      }
      groups[std::int64_t(j) * dg + g] = group_bits<I>(codes);
    }
    sums[j] = sum;
  }
}

template <class I, const TileKernels& (*Base)()>
void int8_pack_q(const float* qt, std::int64_t ldqt, int rows_p, int d, int dv, float logit_scale,
                 void* ws) {
  const Int8Sizes s = int8_sizes<I, Base>(rows_p, d, dv);
  auto* base = static_cast<unsigned char*>(ws);
  auto* h = static_cast<Int8Header*>(ws);
  h->q = reinterpret_cast<std::uint32_t*>(base + s.head);
  h->qs = reinterpret_cast<float*>(base + s.head + s.q);
  h->inv = reinterpret_cast<float*>(base + s.head + s.q + s.qs);
  h->base_ws = s.base > 0 ? base + s.head + s.q + 3 * s.qs + s.exact : nullptr;
  float* zeros = h->inv + s.qs / sizeof(float);
  std::fill(zeros, zeros + rows_p, 0.0f);
  const int exact = exact_of<I>(d), coded = d - exact;
  const float top = code_top_of<I>(d);
  h->qe = reinterpret_cast<float*>(base + s.head + s.q + 3 * s.qs);
  h->exact = exact;
  for (int t = 0; t < exact; ++t)
    for (int r = 0; r < rows_p; ++r)
      h->qe[t * rows_p + r] = qt[(coded + t) * ldqt + r] * logit_scale;
  h->rt = h->zeros = zeros;
  h->rows_p = rows_p;
  h->dg = groups_of<I>(d);
  h->ldg = int8_group_stride(rows_p);
  const TileKernels& b = Base();
  if (b.formats.pack_q != nullptr)
    b.formats.pack_q(qt, ldqt, rows_p, d, dv, logit_scale, h->base_ws);
  // Split signs: each row's sum of its negative codes' magnitudes (split_sign()).
  std::int32_t* negative = nullptr;
  int r0 = 0;  // rows from r0 on are left to the portable loops below
  if constexpr (split_sign<I>()) {
    negative = reinterpret_cast<std::int32_t*>(h->q + 2 * std::int64_t(h->dg) * h->ldg);
    if constexpr (byte_codes<I>() && requires {
                    I::pack_query_split(qt, ldqt, rows_p, d, logit_scale, h->qs, h->inv, h->q,
                                        h->ldg, negative);
                  }) {
      // Whole vectors of rows in the engine's code: the same scales, magnitudes, sign masks
      // and sums as the loops below.
      r0 = I::pack_query_split(qt, ldqt, rows_p, d, logit_scale, h->qs, h->inv, h->q, h->ldg,
                               negative);
    }
    std::fill(negative + r0, negative + rows_p, 0);
  }
  // Per row: the largest magnitude (in qs) and whether every element is finite (inv = 0/1), in
  // loops over contiguous rows without branches or aliasing that the compiler vectorizes (a
  // branch and possibly aliased stores kept them scalar: 58 instructions an element on NEON).
  float* __restrict amax = h->qs;
  float* __restrict finite = h->inv;
  for (int r = r0; r < rows_p; ++r) amax[r] = 0.0f, finite[r] = 1.0f;
  for (int e = 0; e < coded; ++e) {
    const float* __restrict col = qt + e * ldqt;
    for (int r = r0; r < rows_p; ++r) {
      const float a = std::fabs(col[r]);
      finite[r] = a <= std::numeric_limits<float>::max() ? finite[r] : 0.0f;  // inf, NaN: 0
      amax[r] = std::max(amax[r], a);
    }
  }
  for (int r = r0; r < rows_p; ++r) {
    const Quant qn = quant_of(h->qs[r], h->inv[r] != 0.0f, top);
    h->qs[r] = qn.scale * logit_scale;
    h->inv[r] = qn.inv;
  }
  if constexpr (byte_codes<I>() && !split_sign<I>() &&
                requires { I::pack_query_rows(qt, ldqt, rows_p, d, h->inv, h->q, h->ldg); }) {
    // Whole vectors of rows in the engine's code (the same codes), the rest below.
    r0 = I::pack_query_rows(qt, ldqt, rows_p, d, h->inv, h->q, h->ldg);
  }
  for (int g = 0; g < h->dg; ++g) {
    std::uint32_t* dst = h->q + std::int64_t(g) * h->ldg;
    for (int r = r0; r < rows_p; ++r) {
      int codes[4] = {0, 0, 0, 0};
      for (int t = 0; t < I::G; ++t) {
        const int e = g * I::G + t;
        codes[t] = e < coded ? code_of(qt[e * ldqt + r], h->inv[r], top) : 0;
      }
      if constexpr (split_sign<I>()) {
        int mags[4] = {0, 0, 0, 0}, signs[4] = {0, 0, 0, 0};
        for (int t = 0; t < I::G; ++t) {
          mags[t] = std::abs(codes[t]), signs[t] = codes[t] < 0 ? -1 : 0;
          if (codes[t] < 0) negative[r] += mags[t];
        }
        dst[r] = group_bits<I>(mags);
        dst[std::int64_t(h->dg) * h->ldg + r] = group_bits<I>(signs);
      } else {
        dst[r] = query_group_bits<I>(codes);
      }
    }
  }
}

// The exact channels' terms of a micro-tile (16-bit lanes): qe [exact][ldqe] from the item's row
// r0, ke [keys][exact] from the micro-tile's first key.
struct ExactTerms {
  const float* qe;
  int ldqe;
  const float* ke;
  int exact;
};

// Adds the exact channels' terms to ST[j][0..2W) for MK keys: fma in channel order, then NaN
// where not finite (qk's contract), the same f32 steps on every engine.
static_assert(int16_exact_channels(31) == 0 && int16_exact_channels(32) == 4 &&
                  int16_exact_channels(1 << 20) == 4,
              "int8_add_exact adds 4 exact channels (or none)");
template <class I, int MK>
inline void int8_add_exact(const ExactTerms& x, float* st, std::int64_t ldst) {
  const float* q0 = x.qe;
  const float* q1 = q0 + x.ldqe;
  const float* q2 = q1 + x.ldqe;
  const float* q3 = q2 + x.ldqe;
#pragma GCC unroll 8
  for (int m = 0; m < MK; ++m) {
    float* row = st + m * ldst;
    const float* km = x.ke + m * 4;
    const float k0 = km[0], k1 = km[1], k2 = km[2], k3 = km[3];
    // One vector of rows at a time (no loop inside: the compiler keeps it in registers).
#pragma GCC ivdep
    for (int i = 0; i < 2 * I::W; ++i) {
      float v = row[i];
      v = std::fma(q0[i], k0, v);
      v = std::fma(q1[i], k1, v);
      v = std::fma(q2[i], k2, v);
      v = std::fma(q3[i], k3, v);
      row[i] = v * 0.0f + v;
    }
  }
}

// Optionally (I::kLaneGroups: the AArch64 engines' SDOT / USDOT by element), I also provides
// greg (4 groups in a vector), load_groups(p) and dot_lane<L>(acc, q, kv): dot(acc, q, group L
// of kv). Q.K^T then loads 4 consecutive groups of each key as one vector instead of
// broadcasting every group into a register of its own (7 DUPs beside 16 SDOTs on the same
// pipes: 66% of SDOT's rate under llvm-mca on Neoverse N1/V1/V2). The same integers.
template <class I>
constexpr bool lane_groups() {
  if constexpr (requires { I::kLaneGroups; })
    return I::kLaneGroups;
  else
    return false;
}

// f(std::integral_constant<int, 0>) .. f(std::integral_constant<int, N - 1>), in order.
template <int N, class F>
inline void int8_for_lanes(F&& f) {
  [&]<int... L>(std::integer_sequence<int, L...>) {
    (f(std::integral_constant<int, L>{}), ...);
  }
  (std::make_integer_sequence<int, N>{});
}

// ST[j][r0..r0+2W) for MK keys.
template <class I, int MK>
inline void int8_qk_keys(const std::uint32_t* k, const float* ks, const std::int32_t* sums,
                         const float* kb, int dg, const std::uint32_t* q, int ldg, const float* qs,
                         const float* rt, float* st, std::int64_t ldst,
                         const ExactTerms* exact = nullptr) {
  using R = typename I::ireg;
  R acc[MK][2];
#pragma GCC unroll 8
  for (int m = 0; m < MK; ++m) acc[m][0] = acc[m][1] = I::zero();
  // Split signs (I::kSplitSign): q holds the magnitudes, qm the sign masks.
  const std::uint32_t* qm = q + std::int64_t(dg) * ldg;
  if constexpr (MK == 4 && split_sign<I>() && requires { I::qk_group4(acc, q, qm, k, dg); }) {
    // The engine's own loop body for its full micro-tile, then each row's negative magnitudes
    // back (split_sign()).
    for (int g = 0; g < dg; ++g)
      I::qk_group4(acc, q + std::int64_t(g) * ldg, qm + std::int64_t(g) * ldg, k + g, dg);
    const std::uint32_t* neg = qm + std::int64_t(dg) * ldg;
    const R n0 = I::load(neg), n1 = I::load(neg + I::W);
#pragma GCC unroll 4
    for (int m = 0; m < MK; ++m)
      acc[m][0] = I::add(acc[m][0], n0), acc[m][1] = I::add(acc[m][1], n1);
  } else if constexpr (MK == 4 && requires { I::qk_group4(acc, q, k, dg); }) {
    for (int g = 0; g < dg; ++g) I::qk_group4(acc, q + std::int64_t(g) * ldg, k + g, dg);
  } else {
    int g = 0;
    if constexpr (lane_groups<I>()) {
      for (; g + 4 <= dg; g += 4) {
        typename I::greg kv[MK];
#pragma GCC unroll 8
        for (int m = 0; m < MK; ++m) kv[m] = I::load_groups(k + m * dg + g);
        int8_for_lanes<4>([&](auto lane) {
          const R q0 = I::load(q + std::int64_t(g + lane) * ldg);
          const R q1 = I::load(q + std::int64_t(g + lane) * ldg + I::W);
#pragma GCC unroll 8
          for (int m = 0; m < MK; ++m) {
            acc[m][0] = I::template dot_lane<lane>(acc[m][0], q0, kv[m]);
            acc[m][1] = I::template dot_lane<lane>(acc[m][1], q1, kv[m]);
          }
        });
      }
    }
    for (; g < dg; ++g) {
      R q0 = I::load(q + std::int64_t(g) * ldg);
      R q1 = I::load(q + std::int64_t(g) * ldg + I::W);
      if constexpr (split_sign<I>()) {  // the signed codes again
        q0 = I::signed_codes(q0, I::load(qm + std::int64_t(g) * ldg));
        q1 = I::signed_codes(q1, I::load(qm + std::int64_t(g) * ldg + I::W));
      }
#pragma GCC unroll 8
      for (int m = 0; m < MK; ++m) {
        const std::uint32_t kg = k[m * dg + g];
        acc[m][0] = I::dot(acc[m][0], q0, kg);
        acc[m][1] = I::dot(acc[m][1], q1, kg);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MK; ++m) {
    const std::int32_t corr = I::kOffsetQ ? 128 * sums[m] : 0;
    I::logits(st + m * ldst, acc[m][0], corr, qs, ks[m], kb[m], rt);
    I::logits(st + m * ldst + I::W, acc[m][1], corr, qs + I::W, ks[m], kb[m],
              rt != nullptr ? rt + I::W : nullptr);
  }
  if constexpr (exact_terms<I>())
    if (exact != nullptr) int8_add_exact<I, MK>(*exact, st, ldst);
}

template <class I, int MK>
inline void int8_qk_tail(int n, const std::uint32_t* k, const float* ks, const std::int32_t* sums,
                         const float* kb, int dg, const std::uint32_t* q, int ldg, const float* qs,
                         const float* rt, float* st, std::int64_t ldst, const ExactTerms* exact) {
  if constexpr (MK > 0) {
    if (n == MK) return int8_qk_keys<I, MK>(k, ks, sums, kb, dg, q, ldg, qs, rt, st, ldst, exact);
    int8_qk_tail<I, MK - 1>(n, k, ks, sums, kb, dg, q, ldg, qs, rt, st, ldst, exact);
  }
}

template <class I>
void int8_qk(const void* k_tile, std::int64_t /*ldk*/, const float* /*qt*/, std::int64_t /*ldqt*/,
             float* st, std::int64_t ldst, int keys, int rows_p, [[maybe_unused]] int d, void* ws) {
  const Int8Header& h = *static_cast<const Int8Header*>(ws);
  const auto* ks = static_cast<const float*>(k_tile);
  const auto* sums = reinterpret_cast<const std::int32_t*>(ks + kTileKeys);
  const float* kb = ks + 2 * kTileKeys;
  const auto* k = reinterpret_cast<const std::uint32_t*>(static_cast<const unsigned char*>(k_tile) +
                                                         int8_k_header_bytes());
  const int run = int8_tile_run(k_tile);
  const float* rt_run = h.rt == h.zeros || run == 0 ? nullptr : h.rt + std::int64_t(run) * h.rows_p;
  const int dg = h.dg;
  constexpr int kKeys = I::kKeys;
  const float* ke = nullptr;
  if constexpr (exact_terms<I>())
    if (h.exact > 0) ke = int8_k_exact<I>(const_cast<void*>(k_tile), d);
  for (int r0 = 0; r0 < rows_p; r0 += 2 * I::W) {
    const std::uint32_t* q = h.q + r0;
    const float* qs = h.qs + r0;
    const float* rt = rt_run != nullptr ? rt_run + r0 : nullptr;
    ExactTerms x{h.qe + r0, h.rows_p, ke, h.exact};
    int j = 0;
    for (; j + kKeys <= keys; j += kKeys, x.ke = ke != nullptr ? x.ke + kKeys * h.exact : nullptr)
      int8_qk_keys<I, kKeys>(k + j * dg, ks + j, sums + j, kb + j, dg, q, h.ldg, qs, rt,
                             st + j * ldst + r0, ldst, ke != nullptr ? &x : nullptr);
    int8_qk_tail<I, kKeys - 1>(keys - j, k + j * dg, ks + j, sums + j, kb + j, dg, q, h.ldg, qs, rt,
                               st + j * ldst + r0, ldst, ke != nullptr ? &x : nullptr);
  }
}

// P.V on the base engine, in its own workspace.
template <const TileKernels& (*Base)()>
void int8_pv(const float* pt, std::int64_t ldpt, const void* v, std::int64_t ldv, float* o,
             std::int64_t ldo, const float* alpha, int rows, int keys, int dv, void* ws) {
  Base().steps.pv(pt, ldpt, v, ldv, o, ldo, alpha, rows, keys, dv,
                  static_cast<const Int8Header*>(ws)->base_ws);
}

// The base's softmax step, in the base's own workspace too (where a bf16 base's softmax writes
// P's pairs for its P.V: bf16_dot_impl.hpp's softmax_to_pairs).
template <const TileKernels& (*Base)()>
void int8_softmax(float* st, std::int64_t ldst, int keys, int rows_p, float* m, float* l,
                  float* alpha, void* ws) {
  Base().steps.softmax_tile(st, ldst, keys, rows_p, m, l, alpha,
                            static_cast<const Int8Header*>(ws)->base_ws);
}

template <const TileKernels& (*Base)()>
std::size_t int8_v_tile_bytes(int dv) {
  const TileKernels& b = Base();
  if (b.formats.v_tile_bytes != nullptr) return b.formats.v_tile_bytes(dv);
  return int8_align64(std::size_t(kTileKeys) * std::size_t(dv + kInt8StridePad) * sizeof(float));
}

template <const TileKernels& (*Base)()>
void int8_pack_v(const float* v, std::int64_t ld, int keys, int dv, void* tile) {
  const TileKernels& b = Base();
  if (b.formats.pack_v != nullptr) return b.formats.pack_v(v, ld, keys, dv, tile);
  std::copy(v, v + std::int64_t(keys) * ld, static_cast<float*>(tile));
}

// P.V in integers (pv_dtype int8 or int16): P as unsigned codes per (row, tile), V as signed
// codes per (tile, column), an integer dot (F::dot), f32 accumulation across tiles. F is the
// format: Pv8<I> (8-bit codes, P 0..255 and V -127..127, in groups of pv8_group<I>(): 4 bytes
// for vpdpbusd, or vpmaddwd's int16 pairs) or Pv16<I> (P 0..4095 and V -4095..4095 as int16 pairs:
// vpmaddwd, vpdpwssd; 64 keys sum to at most 64 * 4095 * 4095 < 2^31, so the int32 lanes never
// wrap).
//   V tile   [dv] f32 column scales (max over the tile's keys of |v| / F::kVTop; NaN where one is
//            not finite, 0 for an all-zero column) | [kTileKeys / F::G][dv] groups of F::G keys'
//            codes per column (missing keys code 0)
//   workspace: the f32 base's (none) replaced by [kTileKeys / F::G][ldg] groups of P codes
//            per row (ldg = int8_group_stride(rows_p)) | [rows_p] P scales
// The softmax step writes the codes (int8pv_softmax: the base's softmax_tile_codes): row r's
// codes are p * top / pmax_r rounded to the nearest integer (ties to even) in [0, top], scale
// pmax_r / top (top = F::kPTop, pmax_r the probability of the tile's largest logit; a row whose
// tile is all hidden, or whose pmax is NaN, gets scale 0: a row that saw a NaN or +inf logit is NaN
// already through its sum). Each tile adds float(dot) * (ps_r * vs_c) to O[r][c] * alpha_r in one
// fused multiply-add (I::accumulate), so every engine rounds alike. The groups of P.V's 8-bit
// codes: I::kPvGroup where the engine sets one (avx2_int8: int16 pairs, as vpmaddubsw would
// saturate on P codes up to 255), else the Q.K^T dot's I::G.
template <class I>
constexpr int pv8_group() {
  if constexpr (requires { I::kPvGroup; })
    return I::kPvGroup;
  else
    return I::G;
}

template <class I>
struct Pv8 {
  using Engine = I;
  static constexpr int G = pv8_group<I>();
  static constexpr float kPTop = 255.0f, kVTop = 127.0f;
  static typename I::ireg dot(typename I::ireg acc, const typename I::ireg& v, std::uint32_t p) {
    return I::dot_pv(acc, v, p);
  }
  template <class A>
  static void group4(A& acc, const std::uint32_t* v, const std::uint32_t* p) requires requires {
    I::pv8_group4(acc, v, p);
  }
  { I::pv8_group4(acc, v, p); }
};
template <class I>
struct Pv16 {
  using Engine = I;
  static constexpr int G = 2;
  static constexpr float kPTop = 4095.0f, kVTop = 4095.0f;
  static typename I::ireg dot(typename I::ireg acc, const typename I::ireg& v, std::uint32_t p) {
    return I::dot_pv16(acc, v, p);
  }
  template <class A>
  static void group4(A& acc, const std::uint32_t* v, const std::uint32_t* p) requires requires {
    I::pv16_group4(acc, v, p);
  }
  { I::pv16_group4(acc, v, p); }
};

template <class F>
constexpr int pv_groups() {
  return kTileKeys / F::G;
}

template <class F>
std::size_t int8pv_v_tile_bytes(int dv) {
  return int8_align64(std::size_t(dv) * sizeof(float)) +
         int8_align64(std::size_t(pv_groups<F>()) * std::size_t(dv) * 4);
}

template <class F>
void int8pv_pack_v(const float* v, std::int64_t ld, int keys, int dv, void* tile) {
  auto* vs = static_cast<float*>(tile);
  auto* groups = reinterpret_cast<std::uint32_t*>(static_cast<unsigned char*>(tile) +
                                                  int8_align64(std::size_t(dv) * sizeof(float)));
  constexpr float top = F::kVTop;
  int c0 = 0;  // columns from c0 on are left to the portable loops below
  if constexpr (requires { F::Engine::pack_v_pairs(v, ld, keys, dv, top, vs, groups); }) {
    // Whole vectors of columns in the engine's code (the same scales and codes).
    if constexpr (F::G == 2) c0 = F::Engine::pack_v_pairs(v, ld, keys, dv, top, vs, groups);
  }
  if (c0 == dv) return;
  thread_local std::vector<float> inv;
  inv.resize(std::size_t(dv));
  for (int c = c0; c < dv; ++c) {
    float amax = 0.0f;
    bool finite = true;
    for (int j = 0; j < keys; ++j) {
      const float x = v[j * ld + c];
      finite = finite && std::isfinite(x);
      amax = std::max(amax, std::fabs(x));
    }
    const Quant qn = quant_of(amax, finite, top);
    vs[c] = qn.scale;
    inv[std::size_t(c)] = qn.inv;
  }
  for (int g = 0; g < pv_groups<F>(); ++g)
    for (int c = c0; c < dv; ++c) {
      int codes[4] = {0, 0, 0, 0};
      for (int t = 0; t < F::G; ++t) {
        const int j = g * F::G + t;
        if (j >= keys) continue;
        const float x = std::nearbyint(v[j * ld + c] * inv[std::size_t(c)]);
        codes[t] = std::isnan(x) ? 0 : static_cast<int>(std::clamp(x, -top, top));
      }
      groups[std::int64_t(g) * dv + c] = group_bits_of<F::G>(codes);
    }
}

inline std::size_t int8pv_p_bytes(int rows_p, int groups) {
  return int8_align64(std::size_t(groups) * std::size_t(int8_group_stride(rows_p)) * 4) +
         int8_align64(std::size_t(rows_p) * sizeof(float));
}

template <class I, class F, const TileKernels& (*Base)()>
std::size_t int8pv_workspace_bytes(int rows_p, int d, int dv) {
  return int8_sizes<I, Base>(rows_p, d, dv).total() + int8pv_p_bytes(rows_p, pv_groups<F>());
}

// int8_pack_q, then the P area after it (in the header's base_ws: the f32 base has none).
template <class I, const TileKernels& (*Base)()>
void int8pv_pack_q(const float* qt, std::int64_t ldqt, int rows_p, int d, int dv, float logit_scale,
                   void* ws) {
  int8_pack_q<I, Base>(qt, ldqt, rows_p, d, dv, logit_scale, ws);
  static_cast<Int8Header*>(ws)->base_ws =
      static_cast<unsigned char*>(ws) + int8_sizes<I, Base>(rows_p, d, dv).total();
}

// O[r][c..c+2W) for MR rows: p points at the P groups of row r0 (stride ldg), v at column c.
template <class I, class F, int MR>
inline void int8pv_rows(const std::uint32_t* p, int ldg, const float* ps, const std::uint32_t* v,
                        const float* vs, int dv, float* o, std::int64_t ldo, const float* alpha) {
  using R = typename I::ireg;
  R acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = I::zero();
  if constexpr (MR == 4 && requires { F::group4(acc, v, p); }) {
    // The engine's own loop body for its full micro-tile.
    for (int g = 0; g < pv_groups<F>(); ++g)
      F::group4(acc, v + std::int64_t(g) * dv, p + std::int64_t(g) * ldg);
  } else {
    for (int g = 0; g < pv_groups<F>(); ++g) {
      const R v0 = I::load(v + std::int64_t(g) * dv);
      const R v1 = I::load(v + std::int64_t(g) * dv + I::W);
      const std::uint32_t* pg = p + std::int64_t(g) * ldg;
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        acc[r][0] = F::dot(acc[r][0], v0, pg[r]);
        acc[r][1] = F::dot(acc[r][1], v1, pg[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    I::accumulate(o + r * ldo, acc[r][0], alpha[r], ps[r], vs);
    I::accumulate(o + r * ldo + I::W, acc[r][1], alpha[r], ps[r], vs + I::W);
  }
}

template <class I, class F, int MR>
inline void int8pv_tail(int n, const std::uint32_t* p, int ldg, const float* ps,
                        const std::uint32_t* v, const float* vs, int dv, float* o, std::int64_t ldo,
                        const float* alpha) {
  if constexpr (MR > 0) {
    if (n == MR) return int8pv_rows<I, F, MR>(p, ldg, ps, v, vs, dv, o, ldo, alpha);
    int8pv_tail<I, F, MR - 1>(n, p, ldg, ps, v, vs, dv, o, ldo, alpha);
  }
}

// The P codes of one tile and their scales in the workspace, after the Q and K parts.
struct Int8PvCodes {
  std::uint32_t* p;  // [pv_groups][ldg]
  float* ps;         // [rows_p]
  int ldg;
};
template <class F>
Int8PvCodes int8pv_codes(void* ws) {
  const Int8Header& h = *static_cast<const Int8Header*>(ws);
  auto* p = static_cast<std::uint32_t*>(h.base_ws);
  const int ldg = int8_group_stride(h.rows_p);
  auto* ps =
      reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(p) +
                               int8_align64(std::size_t(pv_groups<F>()) * std::size_t(ldg) * 4));
  return {p, ps, ldg};
}

// The softmax step: the base engine's, writing P's codes (kernels.hpp, softmax_tile_codes) where
// int8pv_pv reads them.
template <class F, const TileKernels& (*Base)()>
void int8pv_softmax(float* st, std::int64_t ldst, int keys, int rows_p, float* m, float* l,
                    float* alpha, void* ws) {
  static_assert(F::G == 2 || F::G == 4, "softmax_tile_codes packs 2 or 4 codes to a group");
  const Int8PvCodes c = int8pv_codes<F>(ws);
  Base().steps.softmax_tile_codes(st, ldst, keys, rows_p, m, l, alpha, c.p, c.ldg, c.ps, F::G,
                                  F::kPTop);
}

template <class I, class F>
void int8pv_pv(const float* /*pt*/, std::int64_t /*ldpt*/, const void* v_tile, std::int64_t /*ldv*/,
               float* o, std::int64_t ldo, const float* alpha, int rows, int /*keys*/, int dv,
               void* ws) {
  const auto [p, ps, ldg] = int8pv_codes<F>(ws);  // written by int8pv_softmax
  const auto* vs = static_cast<const float*>(v_tile);
  const auto* v = reinterpret_cast<const std::uint32_t*>(
      static_cast<const unsigned char*>(v_tile) + int8_align64(std::size_t(dv) * sizeof(float)));
  // Rows x 2W columns of accumulators: 8 x 2 of the 32 AVX-512 registers; 4 x 2 of AVX2's 16
  // (8 x 2 spilled accumulators to the stack every group; flux-1024 f32 on avx2_int8, pv_dtype
  // int16, on an Intel Xeon: 150 GFLOP/s with 8 rows, 185 with 6 (still spilling), 187-202 with
  // 5 or 4).
  constexpr int kRows = I::W >= 16 ? 8 : 4;
  for (int c = 0; c < dv; c += 2 * I::W) {
    int r = 0;
    for (; r + kRows <= rows; r += kRows)
      int8pv_rows<I, F, kRows>(p + r, ldg, ps + r, v + c, vs + c, dv, o + r * ldo + c, ldo,
                               alpha + r);
    int8pv_tail<I, F, kRows - 1>(rows - r, p + r, ldg, ps + r, v + c, vs + c, dv, o + r * ldo + c,
                                 ldo, alpha + r);
  }
}

// The functions an engine's TileKernels take from here (instantiated inside the including
// file's target region; int8_tile_kernels() assembles them outside it).
template <class I, const TileKernels& (*Base)()>
constexpr Int8Functions int8_functions() {
  return {&int8_qk<I>,
          &int8_pv<Base>,
          {&int8_workspace_bytes<I, Base>, &int8_pack_q<I, Base>, &int8_k_tile_bytes<I>,
           &int8_v_tile_bytes<Base>, &int8_pack_k<I>, &int8_pack_v<Base>, &int8_set_key_bias,
           &int8_set_row_terms},
          2 * I::W,
          0,
          &int8_softmax<Base>};
}

// The same engine with P.V in integers (pv_dtype int8: F = Pv8<I>; int16: F = Pv16<I>) on the f32
// base `Base` (its softmax and row conversions; its V format and P.V replaced).
template <class I, const TileKernels& (*Base)(), class F = Pv8<I>>
constexpr Int8Functions int8pv_functions() {
  return {&int8_qk<I>,
          &int8pv_pv<I, F>,
          {&int8pv_workspace_bytes<I, F, Base>, &int8pv_pack_q<I, Base>, &int8_k_tile_bytes<I>,
           &int8pv_v_tile_bytes<F>, &int8_pack_k<I>, &int8pv_pack_v<F>, &int8_set_key_bias,
           &int8_set_row_terms},
          2 * I::W,
          2 * I::W,
          &int8pv_softmax<F, Base>};
}
