// The f32 vector type of the sve engine (kernels_sve_impl.hpp): SVE at one vector length,
// DATTN_SVE_BITS (128, 256 or 512: the file is compiled with -msve-vector-bits at that length, so
// that its registers have a size and the shared tile kernels' micro-tiles of W = bits / 32
// lanes are compile-time constants), the same operations in the same order as neon_vec.hpp,
// hence the same bits per lane. Include only inside the engine's namespace and SVE target
// region, after <arm_sve.h>.

struct Vec {
  using reg = svfloat32_t __attribute__((arm_sve_vector_bits(DATTN_SVE_BITS)));
  using ureg = svuint32_t __attribute__((arm_sve_vector_bits(DATTN_SVE_BITS)));
  static constexpr int W = DATTN_SVE_BITS / 32;
  static constexpr int kVectors = 3;  // 6 x 3 accumulators of the 32 registers, as neon
  static svbool_t all() { return svptrue_b32(); }
  static reg zero() { return svdup_n_f32(0.0f); }
  static reg set1(float f) { return svdup_n_f32(f); }
  static reg load(const float* p) { return svld1_f32(all(), p); }
  static void store(float* p, reg r) { svst1_f32(all(), p, r); }
  static reg fma(reg a, reg b, reg c) { return svmla_f32_x(all(), c, a, b); }
  static reg mul(reg a, reg b) { return svmul_f32_x(all(), a, b); }
  static reg add(reg a, reg b) { return svadd_f32_x(all(), a, b); }
  static reg sub(reg a, reg b) { return svsub_f32_x(all(), a, b); }
  // x86's maxps / minps rule (the second operand where either is NaN), as neon_vec.hpp.
  static reg max(reg a, reg b) { return svsel_f32(svcmpgt_f32(all(), a, b), a, b); }
  static reg min(reg a, reg b) { return svsel_f32(svcmplt_f32(all(), a, b), a, b); }
  static reg div(reg a, reg b) { return svdiv_f32_x(all(), a, b); }
  template <int G>
  static void store_codes(std::uint32_t* p, const reg (&x)[G]) {
    static_assert(G == 2 || G == 4);
    const auto bits = [&](int t) -> ureg { return svreinterpret_u32_f32(x[t]); };
    ureg codes = svand_n_u32_x(all(), bits(0), (1u << (32 / G)) - 1);
    if constexpr (G == 2) {
      codes = svorr_u32_x(all(), codes, svlsl_n_u32_x(all(), bits(1), 16));
    } else {
      codes = svorr_u32_x(all(), codes, svlsl_n_u32_x(all(), bits(1), 8));
      codes = svorr_u32_x(
          all(), codes,
          svorr_u32_x(all(), svlsl_n_u32_x(all(), bits(2), 16), svlsl_n_u32_x(all(), bits(3), 24)));
    }
    svst1_u32(all(), p, codes);
  }
  static reg select_zero_if_neg_inf(reg x) {
    return svsel_f32(svcmpeq_n_f32(all(), x, -std::numeric_limits<float>::infinity()), zero(), x);
  }
  static reg select_gt(reg a, reg b, reg x, reg y) {
    return svsel_f32(svcmpgt_f32(all(), a, b), x, y);
  }
  // neon_vec.hpp's 2^x, step for step.
  static reg exp2_nonpositive(reg x) {
    const svbool_t hidden = svcmplt_n_f32(all(), x, -126.0f);
    x = svmax_f32_x(all(), svdup_n_f32(-126.0f), x);
    const reg n = svrintn_f32_x(all(), x);
    const reg f = svsub_f32_x(all(), x, n);
    reg p = svdup_n_f32(kExp2Poly[4]);
    p = svmla_f32_x(all(), svdup_n_f32(kExp2Poly[3]), p, f);
    p = svmla_f32_x(all(), svdup_n_f32(kExp2Poly[2]), p, f);
    p = svmla_f32_x(all(), svdup_n_f32(kExp2Poly[1]), p, f);
    p = svmla_f32_x(all(), svdup_n_f32(kExp2Poly[0]), p, f);
    p = svmla_f32_x(all(), svdup_n_f32(1.0f), p, f);
    const svint32_t e =
        svlsl_n_s32_x(all(), svadd_n_s32_x(all(), svcvt_s32_f32_x(all(), n), 127), 23);
    const reg scaled = svmul_f32_x(all(), p, svreinterpret_f32_s32(e));
    return svsel_f32(hidden, zero(), scaled);
  }
  static reg load_bf16(const std::uint16_t* p) {
    return svreinterpret_f32_u32(svlsl_n_u32_x(all(), svld1uh_u32(all(), p), 16));
  }
  static reg load_f16(const std::uint16_t* p) {
    return svcvt_f32_f16_x(all(), svreinterpret_f16_u32(svld1uh_u32(all(), p)));
  }
  static void store_f16(std::uint16_t* p, reg r) {
    svst1h_u32(all(), p, svreinterpret_u32_f16(svcvt_f16_f32_x(all(), r)));
  }
  // Round to nearest even as f32_to_bf16 (NaN keeps a quiet NaN), the low half of each lane.
  static void store_bf16(std::uint16_t* p, reg r) {
    const ureg u = svreinterpret_u32_f32(r);
    const ureg high = svlsr_n_u32_x(all(), u, 16);
    const ureg lsb = svand_n_u32_x(all(), high, 1);
    const ureg rounded =
        svlsr_n_u32_x(all(), svadd_u32_x(all(), u, svadd_n_u32_x(all(), lsb, 0x7fff)), 16);
    const ureg quiet = svorr_n_u32_x(all(), high, 0x40);
    svst1h_u32(all(), p, svsel_u32(svcmpuo_f32(all(), r, r), quiet, rounded));
  }
};
