// The AVX-512 f32 vector type `V` of tile_kernels_impl.hpp (16 lanes). Include only inside a
// target region that enables avx512f, avx512bw, avx512dq, avx512vl, avx2, fma and f16c, inside the
// engine's namespace, after <immintrin.h> and kernels.hpp: kernels_avx512.cpp, and
// kernels_amx.cpp for the amx engine's softmax (with its bf16 conversion in AVX512-BF16).

struct Vec {
  using reg = __m512;
  static constexpr int W = 16;
  // Micro-tiles of 6 x 64 (K.Q^T: keys x rows; P.V: rows x columns).
  static constexpr int kVectors = 4;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float f) { return _mm512_set1_ps(f); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg r) { _mm512_storeu_ps(p, r); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg min(reg a, reg b) { return _mm512_min_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  // x[t]: 2^23 + key t's code, an integer below 2^(32 / G) (softmax_tile_codes rounds to it in
  // the FMA that adds 2^23), so the code is x[t]'s low mantissa bits; shifted left by 8 or more,
  // the bits of 2^23 (0x4b000000) leave the word.
  template <int G>
  static void store_codes(std::uint32_t* p, const reg (&x)[G]) {
    static_assert(G == 2 || G == 4);
    const auto bits = [&](int t) { return _mm512_castps_si512(x[t]); };
    __m512i codes = _mm512_and_si512(bits(0), _mm512_set1_epi32((1 << (32 / G)) - 1));
    if constexpr (G == 2) {
      codes = _mm512_or_si512(codes, _mm512_slli_epi32(bits(1), 16));
    } else {
      codes = _mm512_ternarylogic_epi32(codes, _mm512_slli_epi32(bits(1), 8),
                                        _mm512_slli_epi32(bits(2), 16), 0xfe);  // a | b | c
      codes = _mm512_or_si512(codes, _mm512_slli_epi32(bits(3), 24));
    }
    _mm512_storeu_si512(p, codes);
  }
  static float hmax(reg a) { return _mm512_reduce_max_ps(a); }
  static float hsum(reg a) { return _mm512_reduce_add_ps(a); }
  // Lane i: the largest lane (hmax_rows) or the sum of the lanes (hsum_rows) of x[i], sixteen
  // horizontal reductions in one tree of 45 shuffles and operations (softmax_rows_to's groups
  // of rows) instead of 16 x 8.
  static reg hmax_rows(const reg (&x)[W]) { return reduce_rows<true>(x); }
  static reg hsum_rows(const reg (&x)[W]) { return reduce_rows<false>(x); }
  template <bool Max>
  static reg combine(reg a, reg b) {
    return Max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b);
  }
  template <bool Max>
  static reg reduce_rows(const reg (&x)[W]) {
    constexpr auto op = &combine<Max>;
    // Each 128-bit lane of t[i]: two partial results of x[2i] (elements 0, 2) and of x[2i + 1]
    // (1, 3); of u[i]: one of each of x[4i .. 4i + 3]; w[i]: rows 8i .. 8i + 7, two 128-bit lanes
    // per group of four rows still to combine.
    reg t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i)
      t[i] = op(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
      u[i] = op(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; ++i)
      w[i] = op(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return op(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  static reg select_zero_if_neg_inf(reg x) {
    const __mmask16 is_neg_inf =
        _mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(is_neg_inf, x, _mm512_setzero_ps());
  }
  // a > b ? x : y per lane (false for NaN).
  static reg select_gt(reg a, reg b, reg x, reg y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), y, x);
  }
  // 2^x = 2^f 2^n with n = round(x), f = x - n in [-1/2, 1/2] (kExp2Poly), vscalefps applying
  // 2^n. Lanes below -126 (-inf included) are zeroed by the mask, so no clamp is needed; NaN
  // stays NaN (not-less-than is true for NaN, and every step keeps it).
  static reg exp2_nonpositive(reg x) { return exp2_poly(x, kExp2Poly); }
  // The same with 2^f = 1 + f (c[0] + f (c[1] + ...)) for any coefficients c fitted on
  // [-1/2, 1/2]; with Floor, for coefficients fitted on [0, 1): f = x - floor(x) from one
  // vreduceps (AVX512-DQ; rounding and a subtraction take three micro-ops) and vscalefps
  // applying 2^floor(x) from x itself.
  template <bool Floor = false, std::size_t N>
  static reg exp2_poly(reg x, const float (&c)[N]) {
    const __mmask16 visible = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    reg n = x, f;
    if constexpr (Floor) {
      f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    } else {
      n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      f = _mm512_sub_ps(x, n);
    }
    reg p = _mm512_set1_ps(c[N - 1]);
#pragma GCC unroll 8
    for (int i = int(N) - 2; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(visible, p, n);
  }
  static reg load_bf16(const std::uint16_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static reg load_f16(const std::uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(std::uint16_t* p, reg r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // As in the AVX2 kernels.
  static void store_bf16(std::uint16_t* p, reg r) {
    const __m512i u = _mm512_castps_si512(r);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
};
