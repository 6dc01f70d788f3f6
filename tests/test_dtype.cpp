#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "dattn/dtype.hpp"

namespace dattn {
namespace {

TEST(DType, NamesRoundTrip) {
  for (DType t :
       {DType::F32, DType::BF16, DType::F16, DType::FP8_E4M3, DType::I8, DType::I32, DType::Bool})
    EXPECT_EQ(parse_dtype(dtype_name(t)), t);
  EXPECT_EQ(parse_dtype("BFloat16"), DType::BF16);
  EXPECT_FALSE(parse_dtype("f64").has_value());
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(-2.5f)), -2.5f);
}

TEST(DType, F16ExhaustiveRoundTrip) {
  // Every finite half converts to f32 and back to itself.
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float f = f16_to_f32(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), bits) << std::hex << h;
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);               // rounds to infinity
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: zero
  EXPECT_EQ(f32_to_f16(std::ldexp(1.5f, -25)), 0x0001);
}

TEST(DType, Fp8E4M3ExhaustiveRoundTripAndSaturation) {
  for (std::uint32_t v = 0; v < 0x100; ++v) {
    const auto bits = static_cast<std::uint8_t>(v);
    const float f = fp8e4m3_to_f32(bits);
    if (std::isnan(f)) continue;
    if (bits == 0x80) continue;  // -0 encodes as -0
    ASSERT_EQ(f32_to_fp8e4m3(f), bits) << v;
  }
  EXPECT_EQ(fp8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(f32_to_fp8e4m3(1e6f), 0x7e);
  EXPECT_EQ(f32_to_fp8e4m3(-1e6f), 0xfe);
  EXPECT_TRUE(std::isnan(fp8e4m3_to_f32(f32_to_fp8e4m3(std::nanf("")))));
  // Relative rounding error of normal values is at most 2^-4.
  for (float x = 0.02f; x < 400.0f; x *= 1.013f)
    EXPECT_LE(std::fabs(fp8e4m3_to_f32(f32_to_fp8e4m3(x)) - x), x / 16.0f) << x;
}

}  // namespace
}  // namespace dattn
