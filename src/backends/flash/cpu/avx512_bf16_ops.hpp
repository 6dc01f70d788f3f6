// The AVX-512 BF16 vector operations of the bf16 engines (avx512_bf16 and amx): the "D" of
// bf16_pairs.hpp, bf16_dot_impl.hpp and amx_impl.hpp. Include only inside a target region that
// enables avx512f, avx512bw, avx512vl and avx512bf16, inside the engine's namespace, after
// <immintrin.h>.

struct Avx512Bf16Ops {
  using reg = __m512;
  static constexpr int W = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float f) { return _mm512_set1_ps(f); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg r) { _mm512_storeu_ps(p, r); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
  static reg not_finite_to_nan(reg a) { return _mm512_fmadd_ps(a, _mm512_setzero_ps(), a); }
  // amx_int8's logits of 16 keys of one row: out[j] = fma(float(c[j]), qs * ks[j], kb[j] + *rt)
  // (kb[j] alone with rt null), NaN where not finite (int8_impl.hpp's formula); c holds int32
  // dot products (a tile's bytes).
  static void int8_logits16(const void* c, float qs, const float* ks, const float* kb,
                            const float* rt, float* out) {
    const __m512 x = _mm512_cvtepi32_ps(_mm512_loadu_si512(c));
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(qs), _mm512_loadu_ps(ks));
    const __m512 b = rt != nullptr ? _mm512_add_ps(_mm512_loadu_ps(kb), _mm512_set1_ps(*rt))
                                   : _mm512_loadu_ps(kb);
    store(out, not_finite_to_nan(_mm512_fmadd_ps(x, t, b)));
  }
  // int8_impl.hpp's quantization in vectors, for amx_int8's packers (int8_tile_pack_k / _q):
  // the largest magnitude of x[0..n) and whether all are finite (quant_of_row's loop)...
  static void int8_amax(const float* x, int n, float* amax, bool* finite) {
    __m512 mx = _mm512_setzero_ps();
    __mmask16 bad = 0;
    const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
    for (int e = 0; e < n; e += 16) {
      const __mmask16 m = n - e >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - e)) - 1);
      const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + e));
      bad |= _mm512_mask_cmp_ps_mask(m, a, inf, _CMP_NLT_UQ);  // inf or NaN
      mx = _mm512_max_ps(mx, a);
    }
    *finite = bad == 0;
    *amax = *finite ? _mm512_reduce_max_ps(mx) : 0.0f;
  }
  // ... and the codes code_of(x[i] * inv) as 32-bit lanes: round half to even (the default
  // MXCSR mode, as std::nearbyint), clamped to [-127, 127], 0 where x * inv is NaN.
  static __m512i int8_codes16(__m512 x, __m512 inv) {
    const __m512 y = _mm512_mul_ps(x, inv);
    const __mmask16 ordered = _mm512_cmp_ps_mask(y, y, _CMP_ORD_Q);
    const __m512 c = _mm512_min_ps(
        _mm512_max_ps(_mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                      _mm512_set1_ps(-127.0f)),
        _mm512_set1_ps(127.0f));
    return _mm512_maskz_cvtps_epi32(ordered, c);
  }
  // The groups of one key row (codes of x[0..d), four to a group, zeros past d) into
  // out[g * stride] for every group g < ceil(d / 4).
  static void int8_key_groups(const float* x, int d, float inv, std::uint32_t* out,
                              std::int64_t stride) {
    const __m512 vi = _mm512_set1_ps(inv);
    for (int e = 0; e < d; e += 16) {
      const __mmask16 m = d - e >= 16 ? __mmask16(0xffff) : __mmask16((1u << (d - e)) - 1);
      const __m128i bytes = _mm512_cvtepi32_epi8(int8_codes16(_mm512_maskz_loadu_ps(m, x + e), vi));
      alignas(16) std::uint32_t g[4];
      _mm_store_si128(reinterpret_cast<__m128i*>(g), bytes);
      for (int t = 0; t < 4 && e + 4 * t < d; ++t) out[std::int64_t(e / 4 + t) * stride] = g[t];
    }
  }
  // The groups of 16 query rows: qt is [d][ldqt] (rows in columns), inv the rows' multipliers;
  // row i's group g goes to out[i * row_stride + g], for every g < ceil(d / 4).
  static void int8_query_groups16(const float* qt, std::int64_t ldqt, int d, const float* inv,
                                  std::uint32_t* out, std::int64_t row_stride) {
    const __m512 vi = _mm512_loadu_ps(inv);
    const __m512i low = _mm512_set1_epi32(0xff);
    for (int g = 0; 4 * g < d; ++g) {
      __m512i w = _mm512_setzero_si512();
      for (int t = 0; t < 4 && 4 * g + t < d; ++t) {
        const __m512i c =
            _mm512_and_si512(int8_codes16(_mm512_loadu_ps(qt + (4 * g + t) * ldqt), vi), low);
        w = _mm512_or_si512(w, _mm512_slli_epi32(c, 8 * t));
      }
      alignas(64) std::uint32_t lanes[16];
      _mm512_store_si512(lanes, w);
      for (int i = 0; i < 16; ++i) out[i * row_stride + g] = lanes[i];
    }
  }
  static reg dot(reg acc, const std::uint32_t* pairs, std::uint32_t b) {
    const __m512i a = _mm512_loadu_si512(pairs);
    const __m512i bb = _mm512_set1_epi32(static_cast<int>(b));
    // A vector cast (same 64 bytes), not std::bit_cast: a template instantiated outside this
    // target region would pass __m512 values without AVX-512 (clang refuses that).
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)bb);  // NOLINT(readability-casting)
  }
  static void pack16_consecutive(const float* src, std::uint32_t* dst) {
    // vcvtne2ps2bf16: the low 256 bits from the second operand; 32 bf16 in source order are
    // the 16 pairs.
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
    _mm512_storeu_si512(dst, (__m512i)b);  // NOLINT(readability-casting)
  }
  static void pack16_interleaved(const float* even, const float* odd, std::uint32_t* dst) {
    store_pairs16(dst, _mm512_loadu_ps(even),
                  odd != nullptr ? _mm512_loadu_ps(odd) : _mm512_setzero_ps());
  }
  // dst[i] = the pair (even[i], odd[i]) for 16 lanes (the softmax's P pairs too).
  static void store_pairs16(std::uint32_t* dst, __m512 even, __m512 odd) {
    const __m512bh b = _mm512_cvtne2ps_pbh(odd, even);  // even | odd halves
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, (__m512i)b));  // NOLINT
  }
  // dst[c][r] = src[r][c] for a 16 x 16 block of 32-bit values (strides in elements):
  // interleave 32-bit then 64-bit elements within 128-bit lanes, then gather the lanes.
  static void transpose16(const std::uint32_t* src, std::int64_t lds, std::uint32_t* dst,
                          std::int64_t ldd) {
    __m512i r[16], a[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * lds);
    for (int i = 0; i < 8; ++i) {
      a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
      a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // r[4i + e], lane L: column 4L + e of rows 4i..4i+3.
    for (int i = 0; i < 4; ++i) {
      r[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
      r[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
      r[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
      r[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int e = 0; e < 4; ++e) {
      const __m512i c0 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88);
      const __m512i c1 = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xdd);
      const __m512i d0 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88);
      const __m512i d1 = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xdd);
      _mm512_storeu_si512(dst + (0 + e) * ldd, _mm512_shuffle_i32x4(c0, d0, 0x88));
      _mm512_storeu_si512(dst + (4 + e) * ldd, _mm512_shuffle_i32x4(c1, d1, 0x88));
      _mm512_storeu_si512(dst + (8 + e) * ldd, _mm512_shuffle_i32x4(c0, d0, 0xdd));
      _mm512_storeu_si512(dst + (12 + e) * ldd, _mm512_shuffle_i32x4(c1, d1, 0xdd));
    }
  }
};
