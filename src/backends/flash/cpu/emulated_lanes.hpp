// The f32 vector of the emulated bf16-dot twins, lane by lane in portable C++: W floats and the
// operations bf16_dot_impl.hpp takes besides the dot product (each an f32 operation per lane),
// with the bf16 pairs' packing and the flushing of denormals both twins share. The twins add
// their instruction's dot product: bf16_emulated_ops.hpp (vdpbf16ps, 16 lanes) and
// neon_bf16_emulated_ops.hpp (BFDOT, 4 lanes). Include inside the engine's namespace after
// bf16_pairs.hpp.

template <int Lanes>
struct EmulatedLanes {
  static constexpr int W = Lanes;
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
  // A bf16 input with a zero exponent (zero or denormal) reads as a signed zero.
  static float daz(std::uint32_t bits16) {
    if ((bits16 & 0x7f80u) == 0) bits16 &= 0x8000u;
    return bf16_to_f32(static_cast<std::uint16_t>(bits16));
  }
  // A denormal result flushed to the zero of its sign.
  static float ftz(float x) {
    return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
  }
  // 16 pairs (the driver's panel rows), whatever W is.
  static void pack16_consecutive(const float* src, std::uint32_t* dst) {
    for (int i = 0; i < 16; ++i) dst[i] = pair(src[2 * i], src[2 * i + 1]);
  }
  static void pack16_interleaved(const float* even, const float* odd, std::uint32_t* dst) {
    for (int i = 0; i < 16; ++i) dst[i] = pair(even[i], odd != nullptr ? odd[i] : 0.0f);
  }
};
