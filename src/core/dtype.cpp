#include "dattn/dtype.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <string>

namespace dattn {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::FP8_E4M3:
      return "fp8_e4m3";
    case DType::I8:
      return "i8";
    case DType::I32:
      return "i32";
    case DType::Bool:
      return "bool";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view name) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  struct Alias {
    std::string_view name;
    DType type;
  };
  static constexpr std::array<Alias, 14> kAliases{{
      {"f32", DType::F32},
      {"float32", DType::F32},
      {"bf16", DType::BF16},
      {"bfloat16", DType::BF16},
      {"f16", DType::F16},
      {"float16", DType::F16},
      {"fp8_e4m3", DType::FP8_E4M3},
      {"fp8", DType::FP8_E4M3},
      {"i8", DType::I8},
      {"int8", DType::I8},
      {"i32", DType::I32},
      {"int32", DType::I32},
      {"bool", DType::Bool},
      {"b8", DType::Bool},
  }};
  for (const Alias& a : kAliases)
    if (a.name == s) return a.type;
  return std::nullopt;
}

float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | (static_cast<std::uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {                        // below the smallest normal half
    // Subnormal half: value = mant * 2^-24. Round to nearest even by integer arithmetic.
    const int exp = static_cast<int>(abs >> 23);
    if (exp < 102) return sign;  // < 2^-25: rounds to zero
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - exp;  // bring to units of 2^-24
    std::uint32_t q = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<std::uint16_t>(q);
  }
  std::uint32_t v = abs - 0x38000000u;  // rebias 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return sign | static_cast<std::uint16_t>(v >> 13);
}

float fp8e4m3_to_f32(std::uint8_t v) {
  const float sign = (v & 0x80u) ? -1.0f : 1.0f;
  const int exp = (v >> 3) & 0xf;
  const int mant = v & 0x7;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);  // subnormal: m * 2^-9
  return sign * std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, exp - 7);
}

std::uint8_t f32_to_fp8e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const std::uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  float a = std::fabs(f);
  if (a >= kFp8E4M3Max) return sign | 0x7e;  // saturate to 448
  // Find the exponent; values below 2^-6 are subnormal with quantum 2^-9.
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exp = e - 1;    // a = 1.x * 2^exp
  if (exp < -6) exp = -6;
  const float quantum = std::ldexp(1.0f, exp - 3);
  float q = std::nearbyint(a / quantum);  // round to nearest even (default rounding mode)
  float r = q * quantum;
  if (r >= kFp8E4M3Max) return sign | 0x7e;
  if (r == 0.0f) return sign;
  // Re-encode r exactly.
  int re;
  std::frexp(r, &re);
  int rexp = re - 1;
  if (rexp < -6) {  // subnormal
    return sign | static_cast<std::uint8_t>(std::lround(std::ldexp(r, 9)));
  }
  const int mant = static_cast<int>(std::lround((std::ldexp(r, -rexp) - 1.0f) * 8.0f));
  return sign | static_cast<std::uint8_t>(((rexp + 7) << 3) | mant);
}

}  // namespace dattn
