// The f32 vector type of the AArch64 engines (NEON, 4 f32 lanes), as tile_kernels_impl.hpp
// wants it: used by the neon engine (kernels_neon.cpp) and by neon_bf16's softmax step
// (kernels_neon_bf16.cpp). Include only from an AArch64 engine's source, inside its namespace,
// after <arm_neon.h>, the standard headers and kernels.hpp.

struct Vec {
  using reg = float32x4_t;
  static constexpr int W = 4;
  static constexpr int kVectors = 3;  // 6 x 3 accumulators of the 32 registers (see above)
  static reg zero() { return vdupq_n_f32(0.0f); }
  static reg set1(float f) { return vdupq_n_f32(f); }
  static reg load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, reg r) { vst1q_f32(p, r); }
  static reg fma(reg a, reg b, reg c) { return vfmaq_f32(c, a, b); }
  // tile_kernels_impl.hpp's scalar_lane: LDR into lane 0 (in assembly, which GCC cannot turn into
  // a broadcasting LD1R) and FMLA by element.
  static reg load_lane0(const float* p) {
    reg r;
    __asm__("ldr %s0, %1" : "=w"(r) : "m"(*p));
    return r;
  }
  static reg fma_lane0(reg s, reg b, reg c) { return vfmaq_laneq_f32(c, b, s, 0); }
  static reg mul(reg a, reg b) { return vmulq_f32(a, b); }
  static reg add(reg a, reg b) { return vaddq_f32(a, b); }
  static reg sub(reg a, reg b) { return vsubq_f32(a, b); }
  // x86's maxps / minps rule, which the shared kernels are written for: the second operand
  // where either is NaN (NEON's FMAX / FMIN would return the NaN).
  static reg max(reg a, reg b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
  static reg min(reg a, reg b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
  static reg div(reg a, reg b) { return vdivq_f32(a, b); }
  // x[t]: 2^23 + key t's code, as in avx512_vec.hpp.
  template <int G>
  static void store_codes(std::uint32_t* p, const reg (&x)[G]) {
    static_assert(G == 2 || G == 4);
    const auto bits = [&](int t) { return vreinterpretq_u32_f32(x[t]); };
    uint32x4_t codes = vandq_u32(bits(0), vdupq_n_u32((1u << (32 / G)) - 1));
    if constexpr (G == 2) {
      codes = vorrq_u32(codes, vshlq_n_u32(bits(1), 16));
    } else {
      codes = vorrq_u32(codes, vshlq_n_u32(bits(1), 8));
      codes = vorrq_u32(codes, vorrq_u32(vshlq_n_u32(bits(2), 16), vshlq_n_u32(bits(3), 24)));
    }
    vst1q_u32(p, codes);
  }
  static reg select_zero_if_neg_inf(reg x) {
    const uint32x4_t is_neg_inf =
        vceqq_f32(x, vdupq_n_f32(-std::numeric_limits<float>::infinity()));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(x), is_neg_inf));
  }
  // a > b ? x : y per lane (false for NaN).
  static reg select_gt(reg a, reg b, reg x, reg y) { return vbslq_f32(vcgtq_f32(a, b), x, y); }
  // 2^x for x <= 0: 2^n * p(f), n = round(x), f in [-1/2, 1/2], p = kExp2Poly (relative error
  // < 2e-7); x < -126 (and -inf) gives 0, NaN stays NaN (FMAX propagates it).
  static reg exp2_nonpositive(reg x) {
    const reg lowest = vdupq_n_f32(-126.0f);
    const uint32x4_t hidden = vcltq_f32(x, lowest);
    x = vmaxq_f32(lowest, x);
    const reg n = vrndnq_f32(x);
    const reg f = vsubq_f32(x, n);
    reg p = vdupq_n_f32(kExp2Poly[4]);
    p = vfmaq_f32(vdupq_n_f32(kExp2Poly[3]), p, f);
    p = vfmaq_f32(vdupq_n_f32(kExp2Poly[2]), p, f);
    p = vfmaq_f32(vdupq_n_f32(kExp2Poly[1]), p, f);
    p = vfmaq_f32(vdupq_n_f32(kExp2Poly[0]), p, f);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, f);
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const reg scaled = vmulq_f32(p, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(scaled), hidden));
  }
  static reg load_bf16(const std::uint16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
  }
  static reg load_f16(const std::uint16_t* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  // FCVTN rounds to nearest even under the default FPCR (as vcvtps2ph's mode here).
  static void store_f16(std::uint16_t* p, reg r) {
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(r)));
  }
  // The bf16 bits of each lane in its low 16 bits, rounded to nearest even as f32_to_bf16 does
  // (add 0x7fff + the lowest kept bit, keep the high half); NaN keeps a quiet NaN.
  static uint32x4_t bf16_bits(reg r) {
    const uint32x4_t u = vreinterpretq_u32_f32(r);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7fff))), 16);
    const uint32x4_t is_nan = vmvnq_u32(vceqq_f32(r, r));
    const uint32x4_t quiet = vorrq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(0x40));
    return vbslq_u32(is_nan, quiet, rounded);
  }
  static void store_bf16(std::uint16_t* p, reg r) { vst1_u16(p, vmovn_u32(bf16_bits(r))); }
  // p[i] = the pair (even[i], odd[i]) of bf16 bits (bf16_pairs.hpp's layout: even in the low half).
  static void store_bf16_pairs(std::uint32_t* p, reg even, reg odd) {
    vst1q_u32(p, vorrq_u32(bf16_bits(even), vshlq_n_u32(bf16_bits(odd), 16)));
  }
};
