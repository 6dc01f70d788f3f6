// The 256-bit SAGE engines: avx2_int8 (Q.K^T on vpmaddubsw with the sign trick: |q| as unsigned
// bytes against k complemented where q < 0 (vpxor with q's sign masks, made once per item like
// the magnitudes and each row's sum of its negative magnitudes, which the complement takes off
// the dot and int8_qk_keys adds back), one vpmaddubsw's pair sums widened by vpmaddwd
// with ones and added in 32 bits, exact, never two vpmaddubsw results summed in 16 bits; P.V
// codes as int16 pairs on vpmaddwd) and avx_vnni (vpdpbusd on 256-bit registers: four
// unsigned-by-signed byte products per lane, queries offset by 128); micro-tiles of 4 keys x 16
// query rows (8 accumulators). Layouts: int8_impl.hpp, shared with the emulated twins
// (kernels_int8_emulated.cpp). P.V (f32 unless pv_dtype says otherwise), the softmax and the row
// conversions are the avx2 engine's. Q's, K's and V's codes are made in vectors here
// (pack_query_split, pack_key_row, pack_v_pairs): the portable loops' scales and codes, which
// the twins keep (tests/test_sage.cpp, SageEngines).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/flash/kernels.hpp"

#if defined(__x86_64__)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif

namespace dattn::flash {
namespace int8_avx2_impl {

#include "backends/flash/cpu/int8_impl.hpp"

struct Avx2Lanes {
  static constexpr int W = 8, kKeys = 4;
  using ireg = __m256i;
  static ireg zero() { return _mm256_setzero_si256(); }
  static ireg add(ireg a, ireg b) { return _mm256_add_epi32(a, b); }
  static ireg load(const std::uint32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static void accumulate(float* o, ireg acc, float alpha, float ps, const float* vs) {
    const __m256 t = _mm256_mul_ps(_mm256_set1_ps(ps), _mm256_loadu_ps(vs));
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), t,
                                        _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(alpha))));
  }
  // One step of a largest-magnitude scan: mx takes |x| lane by lane, bad turns all-ones in a lane
  // where x is inf or NaN (quant_of's `finite`).
  static void take_magnitude(__m256& mx, __m256& bad, __m256 x) {
    const __m256 a = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    bad = _mm256_or_ps(
        bad, _mm256_cmp_ps(a, _mm256_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ));
    mx = _mm256_max_ps(mx, a);
  }
  // int8_impl.hpp's code_of(x * inv) in vectors: round half to even (the default MXCSR mode, as
  // std::nearbyint), clamped to [-top, top] (127 unless given), 0 where x * inv is NaN.
  static ireg codes8(__m256 x, __m256 inv, float top = 127.0f) {
    const __m256 y = _mm256_mul_ps(x, inv);
    const __m256 ordered = _mm256_cmp_ps(y, y, _CMP_ORD_Q);
    const __m256 c = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 cl = _mm256_min_ps(_mm256_max_ps(c, _mm256_set1_ps(-top)), _mm256_set1_ps(top));
    return _mm256_and_si256(_mm256_cvttps_epi32(cl), _mm256_castps_si256(ordered));
  }
  // int8pv_pack_v's work for whole vectors of 8 columns of a V tile whose codes go in int16 pairs
  // (groups of 2 keys): each column's scale (max |v| / top; NaN where the column holds a value
  // that is not finite, 0 where it is all zeros) into vs[c], its codes (0 past `keys`) as
  // groups[g * dv + c] = code(2g) | code(2g + 1) << 16; returns the first column not done.
  static int pack_v_pairs(const float* v, std::int64_t ld, int keys, int dv, float top, float* vs,
                          std::uint32_t* groups) {
    const ireg low = _mm256_set1_epi32(0xffff);
    int c = 0;
    for (; c + W <= dv; c += W) {
      __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      for (int j = 0; j < keys; ++j) {
        take_magnitude(mx, bad, _mm256_loadu_ps(v + j * ld + c));
      }
      alignas(32) float amax[W], mul[W];
      _mm256_store_ps(amax, mx);
      const int not_finite = _mm256_movemask_ps(bad);
      for (int i = 0; i < W; ++i) {  // int8pv_pack_v's scale and multiplier
        const Quant qn = quant_of(amax[i], (not_finite >> i & 1) == 0, top);
        vs[c + i] = qn.scale;
        mul[i] = qn.inv;
      }
      const __m256 vi = _mm256_load_ps(mul);
      for (int g = 0; g < kTileKeys / 2; ++g) {
        const int j = 2 * g;
        const ireg c0 = j < keys ? codes8(_mm256_loadu_ps(v + j * ld + c), vi, top) : zero();
        const ireg c1 =
            j + 1 < keys ? codes8(_mm256_loadu_ps(v + (j + 1) * ld + c), vi, top) : zero();
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(groups + std::int64_t(g) * dv + c),
                            _mm256_or_si256(_mm256_and_si256(c0, low), _mm256_slli_epi32(c1, 16)));
      }
    }
    return c;
  }
  // int8_pack_k's work for one key (avx2_int8's and avx_vnni's hook, as avx512_vnni's): its scale
  // (quant_of over its largest magnitude, NaN where an element is not finite) into *ks, its d codes
  // as bytes into groups (zeros past d up to the last group); returns the codes' sum.
  static std::int32_t pack_key_row(const float* x, int d, std::uint32_t* groups, float* ks) {
    __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    int e = 0;
    for (; e + W <= d; e += W) {
      take_magnitude(mx, bad, _mm256_loadu_ps(x + e));
    }
    alignas(32) float lanes[W];
    _mm256_store_ps(lanes, mx);
    float amax = 0.0f;
    for (const float a : lanes) amax = std::max(amax, a);
    bool finite = _mm256_movemask_ps(bad) == 0;
    for (int t = e; t < d; ++t) {
      finite = finite && std::isfinite(x[t]);
      amax = std::max(amax, std::fabs(x[t]));
    }
    const Quant qn = quant_of(amax, finite);
    *ks = qn.scale;
    const __m256 vi = _mm256_set1_ps(qn.inv);
    auto* bytes = reinterpret_cast<std::uint8_t*>(groups);
    ireg sum = zero();
    for (e = 0; e + W <= d; e += W) {
      const ireg c = codes8(_mm256_loadu_ps(x + e), vi);
      sum = _mm256_add_epi32(sum, c);
      const __m128i words =
          _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(bytes + e), _mm_packs_epi16(words, words));
    }
    alignas(32) std::int32_t partial[W];
    _mm256_store_si256(reinterpret_cast<__m256i*>(partial), sum);
    std::int32_t total = 0;
    for (const std::int32_t p : partial) total += p;
    for (; e < (d + 3) / 4 * 4; ++e) {  // whole groups of 4 bytes
      const int c = e < d ? code_of(x[e], qn.inv) : 0;
      bytes[e] = std::uint8_t(std::int8_t(c));
      total += c;
    }
    return total;
  }
  static void logits(float* st, ireg acc, std::int32_t corr, const float* qs, float ks, float kb,
                     const float* rt) {
    __m256 x = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, _mm256_set1_epi32(corr)));
    const __m256 b =
        rt != nullptr ? _mm256_add_ps(_mm256_set1_ps(kb), _mm256_loadu_ps(rt)) : _mm256_set1_ps(kb);
    x = _mm256_fmadd_ps(x, _mm256_mul_ps(_mm256_loadu_ps(qs), _mm256_set1_ps(ks)), b);
    _mm256_storeu_ps(st, _mm256_add_ps(_mm256_mul_ps(x, _mm256_setzero_ps()), x));
  }
};

// One group of the 4 x 2 P.V micro-tile on vpmaddwd + vpaddd, written as one block of assembly:
// a[n][0] += a0 x b[n], a[n][1] += a1 x b[n] for the 4 broadcast groups b[n] at b0, b0 + s,
// b1, b1 + s (byte strides). GCC 12 compiled the intrinsics' loop with a vmovdqa per vpaddd
// (the accumulators rotated through other registers, 57 in the Q.K^T loop of the time), none here.
#define DATTN_MADD4X2(A0, A1)                                                               \
  __asm__(                                                                                  \
      "vpbroadcastd (%[b0]), %[t2]\n\t"                                                     \
      "vpmaddwd %[t2], %[x0], %[t0]\n\t"                                                    \
      "vpmaddwd %[t2], %[x1], %[t1]\n\t"                                                    \
      "vpaddd %[t0], %[a00], %[a00]\n\t"                                                    \
      "vpaddd %[t1], %[a01], %[a01]\n\t"                                                    \
      "vpbroadcastd (%[b0],%[s]), %[t2]\n\t"                                                \
      "vpmaddwd %[t2], %[x0], %[t0]\n\t"                                                    \
      "vpmaddwd %[t2], %[x1], %[t1]\n\t"                                                    \
      "vpaddd %[t0], %[a10], %[a10]\n\t"                                                    \
      "vpaddd %[t1], %[a11], %[a11]\n\t"                                                    \
      "vpbroadcastd (%[b1]), %[t2]\n\t"                                                     \
      "vpmaddwd %[t2], %[x0], %[t0]\n\t"                                                    \
      "vpmaddwd %[t2], %[x1], %[t1]\n\t"                                                    \
      "vpaddd %[t0], %[a20], %[a20]\n\t"                                                    \
      "vpaddd %[t1], %[a21], %[a21]\n\t"                                                    \
      "vpbroadcastd (%[b1],%[s]), %[t2]\n\t"                                                \
      "vpmaddwd %[t2], %[x0], %[t0]\n\t"                                                    \
      "vpmaddwd %[t2], %[x1], %[t1]\n\t"                                                    \
      "vpaddd %[t0], %[a30], %[a30]\n\t"                                                    \
      "vpaddd %[t1], %[a31], %[a31]"                                                        \
      : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]), \
        [a20] "+x"(a[2][0]), [a21] "+x"(a[2][1]), [a30] "+x"(a[3][0]), [a31] "+x"(a[3][1]), \
        [t0] "=&x"(t0), [t1] "=&x"(t1), [t2] "=&x"(t2)                                      \
      : [x0] "x"(A0), [x1] "x"(A1), [b0] "r"(b0), [b1] "r"(b1), [s] "r"(s)                  \
      : "memory")

// One group of the 4 x 2 Q.K^T micro-tile on the sign trick, as one block of assembly:
// a[n][i] += |q_i| x (k_n ^ m_i) for the query registers' magnitudes u0, u1 and sign masks x0, x1
// (m = 0xff bytes where q < 0) and the 4 broadcast key groups k_n at b0, b0 + s, b1, b1 + s.
// k ^ 0xff is -k - 1, so |q| x (k ^ m) is q x k, less |q| where q < 0: int8_qk_keys adds each
// row's sum of those magnitudes back after the last group (int8_impl.hpp, split_sign()), and the
// step is one vpxor, which any vector pipe runs, where negating exactly ((k ^ m) - m) took a
// vpsubb more and vpsignb shares the two multiply pipes with vpmaddubsw and vpmaddwd on AMD Zen 4
// (a step of vpsignb, vpmaddubsw, vpmaddwd and vpaddd: 0.63 a cycle; with vpxor and vpsubb: 0.79;
// Q.K^T of one 256-row item with vpxor alone 1.19x that with vpxor and vpsubb). vpmaddubsw
// multiplies u's unsigned bytes by the signed ones and adds each pair in 16 bits: |q| <= 127 and
// -128 <= k ^ m <= 127, so a pair sums to at most 2 x 127 x 128 = 32512 in magnitude and never
// saturates; vpmaddwd by ones adds the two pairs of each 32-bit lane exactly.
// clang-format off
#define DATTN_SIGN_STEP(B, A0, A1)              \
  "vpbroadcastd " B ", %[t2]\n\t"               \
  "vpxor %[x0], %[t2], %[t0]\n\t"               \
  "vpxor %[x1], %[t2], %[t1]\n\t"               \
  "vpmaddubsw %[t0], %[u0], %[t0]\n\t"          \
  "vpmaddubsw %[t1], %[u1], %[t1]\n\t"          \
  "vpmaddwd %[ones], %[t0], %[t0]\n\t"          \
  "vpmaddwd %[ones], %[t1], %[t1]\n\t"          \
  "vpaddd %[t0], %[" A0 "], %[" A0 "]\n\t"      \
  "vpaddd %[t1], %[" A1 "], %[" A1 "]\n\t"
// clang-format on

struct Avx2Int8 : Avx2Lanes {
  static constexpr int G = 4;
  static constexpr bool kOffsetQ = false;
  // Q's codes as magnitudes and sign masks, made once per item (int8_impl.hpp).
  static constexpr bool kSplitSign = true;
  // P.V's 8-bit codes go in int16 pairs (vpmaddwd): P's codes reach 255, which vpmaddubsw's
  // 16-bit pair sums would saturate against V's.
  static constexpr int kPvGroup = 2;
  // int8_qk_keys' loop body for 4 keys: the query groups' magnitudes at q and sign masks at qm
  // (2 registers each), the keys' groups at k, k + dg, k + 2 dg, k + 3 dg.
  static void qk_group4(ireg (&a)[4][2], const std::uint32_t* q, const std::uint32_t* qm,
                        const std::uint32_t* k, int dg) {
    const ireg u0 = load(q), u1 = load(q + W), s0 = load(qm), s1 = load(qm + W);
    const ireg ones = _mm256_set1_epi16(1);
    const std::uint32_t* b0 = k;
    const std::uint32_t* b1 = k + 2 * std::int64_t(dg);
    const std::int64_t s = std::int64_t(dg) * 4;
    ireg t0, t1, t2;
    __asm__(DATTN_SIGN_STEP("(%[b0])", "a00", "a01")       //
            DATTN_SIGN_STEP("(%[b0],%[s])", "a10", "a11")  //
            DATTN_SIGN_STEP("(%[b1])", "a20", "a21")       //
            DATTN_SIGN_STEP("(%[b1],%[s])", "a30", "a31")  //
            : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]),
              [a20] "+x"(a[2][0]), [a21] "+x"(a[2][1]), [a30] "+x"(a[3][0]), [a31] "+x"(a[3][1]),
              [t0] "=&x"(t0), [t1] "=&x"(t1), [t2] "=&x"(t2)
            : [x0] "x"(s0), [x1] "x"(s1), [u0] "x"(u0), [u1] "x"(u1), [ones] "x"(ones),
              [b0] "r"(b0), [b1] "r"(b1), [s] "r"(s)
            : "memory");
  }
  // int8pv_rows' loop body for 4 rows (int16 pairs either way): V's groups at v (2 registers),
  // the rows' P groups at p[0..4).
  static void pv16_group4(ireg (&a)[4][2], const std::uint32_t* v, const std::uint32_t* p) {
    const ireg x0 = load(v), x1 = load(v + W);
    const std::uint32_t* b0 = p;
    const std::uint32_t* b1 = p + 2;
    const std::int64_t s = 4;
    ireg t0, t1, t2;
    DATTN_MADD4X2(x0, x1);
  }
  static void pv8_group4(ireg (&a)[4][2], const std::uint32_t* v, const std::uint32_t* p) {
    pv16_group4(a, v, p);
  }
  // int8_pack_q's work for whole vectors of 8 rows of Q^T (qt[e * ldqt + r]): each row's scale
  // times logit_scale into qs and code multiplier into inv (quant_of over its largest magnitude,
  // NaN / 0 where an element is not finite), its codes' magnitudes and sign masks (0xff where the
  // code is negative) as groups of 4 bytes at q[g * ldg + r] and q[(dg + g) * ldg + r] (zeros past
  // d), the sum of its negative codes' magnitudes into negative[r]; returns the first row not done.
  static int pack_query_split(const float* qt, std::int64_t ldqt, int rows_p, int d,
                              float logit_scale, float* qs, float* inv, std::uint32_t* q, int ldg,
                              std::int32_t* negative) {
    const int dg = (d + G - 1) / G;
    const ireg low = _mm256_set1_epi32(0xff);
    int r = 0;
    for (; r + W <= rows_p; r += W) {
      __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      for (int e = 0; e < d; ++e) {
        take_magnitude(mx, bad, _mm256_loadu_ps(qt + e * ldqt + r));
      }
      alignas(32) float amax[W];
      _mm256_store_ps(amax, mx);
      const int not_finite = _mm256_movemask_ps(bad);
      for (int i = 0; i < W; ++i) {
        const bool finite = (not_finite >> i & 1) == 0;
        const Quant qn = quant_of(finite ? amax[i] : 0.0f, finite);
        qs[r + i] = qn.scale * logit_scale;
        inv[r + i] = qn.inv;
      }
      const __m256 vi = _mm256_loadu_ps(inv + r);
      ireg neg = zero();
      for (int g = 0; g < dg; ++g) {
        ireg mags = zero(), signs = zero();
        for (int t = 0; t < G; ++t) {
          const int e = G * g + t;
          if (e >= d) break;
          const ireg c = codes8(_mm256_loadu_ps(qt + e * ldqt + r), vi);
          const ireg m = _mm256_abs_epi32(c), s = _mm256_srai_epi32(c, 31);
          neg = _mm256_add_epi32(neg, _mm256_and_si256(m, s));
          mags = _mm256_or_si256(mags, _mm256_slli_epi32(m, 8 * t));
          signs = _mm256_or_si256(signs, _mm256_slli_epi32(_mm256_and_si256(s, low), 8 * t));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + std::int64_t(g) * ldg + r), mags);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + std::int64_t(dg + g) * ldg + r), signs);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(negative + r), neg);
    }
    return r;
  }
  // The signed codes of magnitudes u and sign masks m.
  static ireg signed_codes(ireg u, ireg m) { return _mm256_sub_epi8(_mm256_xor_si256(u, m), m); }
  // acc += q . k over each lane's 4 signed bytes (the sign trick, as qk_group4).
  static ireg dot(ireg acc, ireg q, std::uint32_t k) {
    const ireg t = _mm256_sign_epi8(_mm256_set1_epi32(std::int32_t(k)), q);
    return _mm256_add_epi32(
        acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), t), _mm256_set1_epi16(1)));
  }
  // P.V: P codes (0..255, or 0..4095 for pv_dtype int16) and V codes as int16 pairs;
  // vpmaddwd is symmetric.
  static ireg dot_pairs(ireg acc, ireg v, std::uint32_t p) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(v, _mm256_set1_epi32(std::int32_t(p))));
  }
  static ireg dot_pv(ireg acc, ireg v, std::uint32_t p) { return dot_pairs(acc, v, p); }
  static ireg dot_pv16(ireg acc, ireg v, std::uint32_t p) { return dot_pairs(acc, v, p); }
};

struct AvxVnni : Avx2Lanes {
  static constexpr int G = 4;
  static constexpr bool kOffsetQ = true;
  static ireg dot(ireg acc, ireg q, std::uint32_t k) {
    return _mm256_dpbusd_avx_epi32(acc, q, _mm256_set1_epi32(std::int32_t(k)));
  }
  // P.V: unsigned P codes broadcast against signed V codes; int16: P and V as int16 pairs
  // (vpdpwssd, no saturation).
  static ireg dot_pv(ireg acc, ireg v, std::uint32_t p) {
    return _mm256_dpbusd_avx_epi32(acc, _mm256_set1_epi32(std::int32_t(p)), v);
  }
  static ireg dot_pv16(ireg acc, ireg v, std::uint32_t p) {
    return _mm256_dpwssd_avx_epi32(acc, _mm256_set1_epi32(std::int32_t(p)), v);
  }
};

// The 16-bit integer-lane engines (compute int16, int8_impl.hpp's "16-bit integer lanes"): Q and
// K codes as int16 pairs, one vpmaddwd + vpaddd per pair of channels (avx2_int16) or one
// vpdpwssd on 256-bit registers (avx_vnni_int16), P.V on the same pairs (Pv16).
struct Avx2Int16 : Avx2Lanes {
  static constexpr int G = 2;
  static constexpr bool kOffsetQ = false, kExact = true;
  static ireg dot(ireg acc, ireg q, std::uint32_t k) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(q, _mm256_set1_epi32(std::int32_t(k))));
  }
  static ireg dot_pv16(ireg acc, ireg v, std::uint32_t p) { return dot(acc, v, p); }
  // int8_qk_keys' loop body for 4 keys: the query groups at q (2 registers), the keys' groups at
  // k, k + dg, k + 2 dg, k + 3 dg.
  static void qk_group4(ireg (&a)[4][2], const std::uint32_t* q, const std::uint32_t* k, int dg) {
    const ireg x0 = load(q), x1 = load(q + W);
    const std::uint32_t* b0 = k;
    const std::uint32_t* b1 = k + 2 * std::int64_t(dg);
    const std::int64_t s = std::int64_t(dg) * 4;
    ireg t0, t1, t2;
    DATTN_MADD4X2(x0, x1);
  }
  static void pv16_group4(ireg (&a)[4][2], const std::uint32_t* v, const std::uint32_t* p) {
    Avx2Int8::pv16_group4(a, v, p);
  }
};

struct AvxVnniInt16 : Avx2Lanes {
  static constexpr int G = 2;
  static constexpr bool kOffsetQ = false, kExact = true;
  // vpdpwssd in inline assembly ({vex}: AVX-VNNI's encoding), as avx512_vnni's: GCC 12 copied
  // the intrinsic's accumulators between registers (flux-1024 on one AMD Zen 5 core: 0.78x
  // avx2_int16's vpmaddwd + vpaddd with the intrinsic).
  static ireg dot(ireg acc, ireg q, std::uint32_t k) {
    const ireg kk = _mm256_set1_epi32(std::int32_t(k));
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(q), "x"(kk));
    return acc;
  }
  static ireg dot_pv16(ireg acc, ireg v, std::uint32_t p) { return dot(acc, v, p); }
  // The 4 x 2 micro-tile's group as one block of assembly (a[n][i] += x_i . b_n for the 4
  // broadcast groups b_n at b0, b0 + s, b1, b1 + s), for Q.K^T (x: query groups, b: keys) and
  // P.V (x: V groups, b: P codes of 4 rows).
  static void dp4x2(ireg (&a)[4][2], ireg x0, ireg x1, const std::uint32_t* b0,
                    const std::uint32_t* b1, std::int64_t s) {
    ireg t;
    __asm__(
        "vpbroadcastd (%[b0]), %[t]\n\t"
        "%{vex%} vpdpwssd %[t], %[x0], %[a00]\n\t"
        "%{vex%} vpdpwssd %[t], %[x1], %[a01]\n\t"
        "vpbroadcastd (%[b0],%[s]), %[t]\n\t"
        "%{vex%} vpdpwssd %[t], %[x0], %[a10]\n\t"
        "%{vex%} vpdpwssd %[t], %[x1], %[a11]\n\t"
        "vpbroadcastd (%[b1]), %[t]\n\t"
        "%{vex%} vpdpwssd %[t], %[x0], %[a20]\n\t"
        "%{vex%} vpdpwssd %[t], %[x1], %[a21]\n\t"
        "vpbroadcastd (%[b1],%[s]), %[t]\n\t"
        "%{vex%} vpdpwssd %[t], %[x0], %[a30]\n\t"
        "%{vex%} vpdpwssd %[t], %[x1], %[a31]"
        : [a00] "+x"(a[0][0]), [a01] "+x"(a[0][1]), [a10] "+x"(a[1][0]), [a11] "+x"(a[1][1]),
          [a20] "+x"(a[2][0]), [a21] "+x"(a[2][1]), [a30] "+x"(a[3][0]), [a31] "+x"(a[3][1]),
          [t] "=&x"(t)
        : [x0] "x"(x0), [x1] "x"(x1), [b0] "r"(b0), [b1] "r"(b1), [s] "r"(s)
        : "memory");
  }
  static void qk_group4(ireg (&a)[4][2], const std::uint32_t* q, const std::uint32_t* k, int dg) {
    dp4x2(a, load(q), load(q + W), k, k + 2 * std::int64_t(dg), std::int64_t(dg) * 4);
  }
  static void pv16_group4(ireg (&a)[4][2], const std::uint32_t* v, const std::uint32_t* p) {
    dp4x2(a, load(v), load(v + W), p, p + 2, 4);
  }
};

#undef DATTN_MADD4X2
#undef DATTN_SIGN_STEP

constexpr Int8Functions kAvx2Int8 = int8_functions<Avx2Int8, &avx2_kernels>();
constexpr Int8Functions kAvxVnni = int8_functions<AvxVnni, &avx2_kernels>();
constexpr Int8Functions kAvx2Int8Pv8 = int8pv_functions<Avx2Int8, &avx2_kernels>();
constexpr Int8Functions kAvxVnniPv8 = int8pv_functions<AvxVnni, &avx2_kernels>();
constexpr Int8Functions kAvx2Int8Pv16 = int8pv_functions<Avx2Int8, &avx2_kernels, Pv16<Avx2Int8>>();
constexpr Int8Functions kAvxVnniPv16 = int8pv_functions<AvxVnni, &avx2_kernels, Pv16<AvxVnni>>();
constexpr Int8Functions kAvx2Int16 = int8pv_functions<Avx2Int16, &avx2_kernels, Pv16<Avx2Int16>>();
constexpr Int8Functions kAvxVnniInt16 =
    int8pv_functions<AvxVnniInt16, &avx2_kernels, Pv16<AvxVnniInt16>>();

}  // namespace int8_avx2_impl
}  // namespace dattn::flash

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace dattn::flash {
// Outside the target region: the engine table may build these on any CPU.
const TileKernels& avx2_int8_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx2_int8", avx2_kernels(), int8_avx2_impl::kAvx2Int8);
  return k;
}
const TileKernels& avx_vnni_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx_vnni", avx2_kernels(), int8_avx2_impl::kAvxVnni);
  return k;
}
const TileKernels& avx2_int8_pv8_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx2_int8", avx2_kernels(), int8_avx2_impl::kAvx2Int8Pv8);
  return k;
}
const TileKernels& avx_vnni_pv8_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx_vnni", avx2_kernels(), int8_avx2_impl::kAvxVnniPv8);
  return k;
}
const TileKernels& avx2_int8_pv16_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx2_int8", avx2_kernels(), int8_avx2_impl::kAvx2Int8Pv16);
  return k;
}
const TileKernels& avx_vnni_pv16_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx_vnni", avx2_kernels(), int8_avx2_impl::kAvxVnniPv16);
  return k;
}
const TileKernels& avx2_int16_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx2_int16", avx2_kernels(), int8_avx2_impl::kAvx2Int16);
  return k;
}
const TileKernels& avx_vnni_int16_kernels() {
  static const TileKernels k =
      int8_tile_kernels("avx_vnni_int16", avx2_kernels(), int8_avx2_impl::kAvxVnniInt16);
  return k;
}
}  // namespace dattn::flash
#else
namespace dattn::flash {
const TileKernels& avx2_int16_kernels() {
  return avx2_int16_emulated_kernels();
}
const TileKernels& avx_vnni_int16_kernels() {
  return avx_vnni_int16_emulated_kernels();
}
const TileKernels& avx2_int8_kernels() {
  return avx2_int8_emulated_kernels();
}
const TileKernels& avx_vnni_kernels() {
  return avx_vnni_emulated_kernels();
}
const TileKernels& avx2_int8_pv8_kernels() {
  return avx2_int8_emulated_pv8_kernels();
}
const TileKernels& avx_vnni_pv8_kernels() {
  return avx_vnni_emulated_pv8_kernels();
}
const TileKernels& avx2_int8_pv16_kernels() {
  return avx2_int8_emulated_pv16_kernels();
}
const TileKernels& avx_vnni_pv16_kernels() {
  return avx_vnni_emulated_pv16_kernels();
}
}  // namespace dattn::flash
#endif
