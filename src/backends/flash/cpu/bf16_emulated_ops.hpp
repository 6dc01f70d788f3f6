// The portable C++ twins of the AVX-512 BF16 vector operations (avx512_bf16_ops.hpp), lane by
// lane: VDPBF16PS in the instruction's order (Intel SDM: srcdest += src1.odd * src2.odd, then
// += src1.even * src2.even, each an f32 FMA with denormal inputs read as zero and denormal
// results flushed to zero, round to nearest even). Used by the emulated engines
// (avx512_bf16_emulated, amx_emulated). Include inside the engine's namespace after
// bf16_pairs.hpp.

struct EmulatedBf16Ops {
  static constexpr int W = 16;
  struct reg {
    float v[W];
  };
  static reg zero() { return set1(0.0f); }
  static reg set1(float f) {
    reg r;
    for (float& x : r.v) x = f;
    return r;
  }
  static reg load(const float* p) {
    reg r;
    for (int i = 0; i < W; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, const reg& r) {
    for (int i = 0; i < W; ++i) p[i] = r.v[i];
  }
  static reg mul(const reg& a, const reg& b) {
    reg r;
    for (int i = 0; i < W; ++i) r.v[i] = a.v[i] * b.v[i];
    return r;
  }
  static reg fma(const reg& a, const reg& b, const reg& c) {
    reg r;
    for (int i = 0; i < W; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return r;
  }
  static reg not_finite_to_nan(const reg& a) {
    reg r;
    for (int i = 0; i < W; ++i) r.v[i] = std::fma(a.v[i], 0.0f, a.v[i]);
    return r;
  }
  // amx_int8's logits of 16 keys of one row (avx512_bf16_ops.hpp's int8_logits16).
  static void int8_logits16(const void* c, float qs, const float* ks, const float* kb,
                            const float* rt, float* out) {
    std::int32_t v[W];
    std::memcpy(v, c, sizeof(v));
    for (int i = 0; i < W; ++i) {
      const float x =
          std::fma(static_cast<float>(v[i]), qs * ks[i], rt != nullptr ? kb[i] + *rt : kb[i]);
      out[i] = std::fma(x, 0.0f, x);
    }
  }
  // A bf16 input with a zero exponent (zero or denormal) reads as a signed zero.
  static float daz(std::uint32_t bits16) {
    if ((bits16 & 0x7f80u) == 0) bits16 &= 0x8000u;
    return bf16_to_f32(static_cast<std::uint16_t>(bits16));
  }
  static float ftz(float x) {
    return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
  }
  static reg dot(reg acc, const std::uint32_t* pairs, std::uint32_t b) {
    const float b_even = daz(b & 0xffffu), b_odd = daz(b >> 16);
    for (int i = 0; i < W; ++i) {
      const float a_even = daz(pairs[i] & 0xffffu), a_odd = daz(pairs[i] >> 16);
      float x = ftz(acc.v[i]);
      x = ftz(std::fma(a_odd, b_odd, x));
      x = ftz(std::fma(a_even, b_even, x));
      acc.v[i] = x;
    }
    return acc;
  }
  static void pack16_consecutive(const float* src, std::uint32_t* dst);
  static void pack16_interleaved(const float* even, const float* odd, std::uint32_t* dst);
  static void transpose16(const std::uint32_t* src, std::int64_t lds, std::uint32_t* dst,
                          std::int64_t ldd) {
    for (int r = 0; r < W; ++r)
      for (int c = 0; c < W; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
};

inline void EmulatedBf16Ops::pack16_consecutive(const float* src, std::uint32_t* dst) {
  for (int i = 0; i < W; ++i) dst[i] = pair(src[2 * i], src[2 * i + 1]);
}
inline void EmulatedBf16Ops::pack16_interleaved(const float* even, const float* odd,
                                                std::uint32_t* dst) {
  for (int i = 0; i < W; ++i) dst[i] = pair(even[i], odd != nullptr ? odd[i] : 0.0f);
}
