// The portable C++ twin of AArch64's BFDOT (Armv8.6 BF16, FPCR.EBF = 0: the standard BFloat16
// behaviours of the Arm ARM's BFDotAdd), lane by lane, for the neon_bf16 engine's emulated twin
// (kernels_bf16_emulated.cpp): for each lane, the two products of bf16 pairs (exact in f32 where
// they stay in its normal range), their sum, then that sum added to the accumulator, each
// addition rounded to odd (a result between two floats takes the one whose last bit is 1; beyond
// the largest float, infinity), bf16 and f32 denormal inputs read as zero, denormal results
// flushed to zero, a NaN result the default NaN. This is not vdpbf16ps's arithmetic
// (bf16_emulated_ops.hpp: two fused multiply-adds rounded to nearest even), hence a twin of its
// own, on emulated_lanes.hpp's vector. Include inside the engine's namespace after bf16_pairs.hpp.

#include "backends/flash/cpu/emulated_lanes.hpp"

struct EmulatedNeonBf16Ops : EmulatedLanes<4> {
  // The float that x + err rounds to under round-to-odd with overflow to infinity and denormal
  // results flushed to zero, where x is a finite double and err the exact remainder of a sum
  // (0 for an exact x; |err| at most half x's last place).
  static float round_to_odd(double x, double err) {
    const double ax = std::fabs(x);
    const bool below = err != 0.0 && std::signbit(err) != std::signbit(x);  // |exact| < |x|
    if (ax < double(std::numeric_limits<float>::min()) ||
        (ax == double(std::numeric_limits<float>::min()) && below))
      return std::copysign(0.0f, float(x));  // tiny: flushed
    if (ax >= 0x1p128) return std::copysign(std::numeric_limits<float>::infinity(), float(x));
    float f = float(x);  // to nearest: f is x's float below or above (in magnitude)
    const double af = std::fabs(double(f));
    if (af > ax || (af == ax && below)) f = std::nextafter(f, 0.0f);  // truncated
    if (double(f) != x || err != 0.0) {
      std::uint32_t bits;
      std::memcpy(&bits, &f, sizeof(bits));
      bits |= 1u;  // inexact: odd
      std::memcpy(&f, &bits, sizeof(bits));
    }
    return f;
  }
  static float default_nan() { return std::numeric_limits<float>::quiet_NaN(); }
  // a + b (inputs flushed), rounded to odd.
  static float add(float a, float b) {
    a = ftz(a);
    b = ftz(b);
    if (std::isnan(a) || std::isnan(b)) return default_nan();
    if (std::isinf(a) || std::isinf(b)) {
      const float s = a + b;  // inf - inf: NaN
      return std::isnan(s) ? default_nan() : s;
    }
    const double da = a, db = b, s = da + db;
    const double bb = s - da, err = (da - (s - bb)) + (db - bb);  // TwoSum: s + err = a + b
    if (s == 0.0 && err == 0.0) return float(s);                  // the signed zero of a + b
    return round_to_odd(s, err);
  }
  // A product of two bf16 values (inputs flushed already), rounded to odd: exact in double.
  static float mul1(float a, float b) {
    const double p = double(a) * double(b);
    if (std::isnan(p)) return default_nan();
    if (std::isinf(p) || p == 0.0) return float(p);
    return round_to_odd(p, 0.0);
  }
  static reg dot(reg acc, const std::uint32_t* pairs, std::uint32_t b) {
    const float b_even = daz(b & 0xffffu), b_odd = daz(b >> 16);
    for (int i = 0; i < W; ++i) {
      const float a_even = daz(pairs[i] & 0xffffu), a_odd = daz(pairs[i] >> 16);
      const float sum = add(mul1(a_even, b_even), mul1(a_odd, b_odd));
      acc.v[i] = add(acc.v[i], sum);
    }
    return acc;
  }
};
