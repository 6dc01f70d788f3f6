// Element types and their scalar conversions.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace dattn {

enum class DType : std::uint8_t {
  F32,
  BF16,
  F16,
  FP8_E4M3,  // e4m3 "fn": bias 7, max 448, no infinity, NaN = S.1111.111
  I8,
  I32,
  Bool,  // one byte, 0 = false, anything else = true
};

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::BF16:
    case DType::F16:
      return 2;
    case DType::FP8_E4M3:
    case DType::I8:
    case DType::Bool:
      return 1;
  }
  return 0;
}

// "f32", "bf16", "f16", "fp8_e4m3", "i8", "i32", "bool".
std::string_view dtype_name(DType t);
// Inverse of dtype_name; also accepts "float32", "bfloat16", "float16", "fp8", "int8", "int32".
std::optional<DType> parse_dtype(std::string_view name);

constexpr bool is_float_input_dtype(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

// ---- scalar conversions (bit exact, round to nearest even) ----

inline float bf16_to_f32(std::uint16_t b) {
  return std::bit_cast<float>(std::uint32_t{b} << 16);
}

inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

float f16_to_f32(std::uint16_t h);
std::uint16_t f32_to_f16(float f);
float fp8e4m3_to_f32(std::uint8_t v);
// Saturates to +-448 (the format has no infinity); NaN stays NaN.
std::uint8_t f32_to_fp8e4m3(float f);
inline constexpr float kFp8E4M3Max = 448.0f;

// Reads element `index` (in elements from `base`) of a float-like dtype as f32.
inline float load_as_f32(const void* base, DType t, std::int64_t index) {
  switch (t) {
    case DType::F32:
      return static_cast<const float*>(base)[index];
    case DType::BF16:
      return bf16_to_f32(static_cast<const std::uint16_t*>(base)[index]);
    case DType::F16:
      return f16_to_f32(static_cast<const std::uint16_t*>(base)[index]);
    case DType::FP8_E4M3:
      return fp8e4m3_to_f32(static_cast<const std::uint8_t*>(base)[index]);
    case DType::I8:
      return static_cast<float>(static_cast<const std::int8_t*>(base)[index]);
    case DType::I32:
      return static_cast<float>(static_cast<const std::int32_t*>(base)[index]);
    case DType::Bool:
      return static_cast<const std::uint8_t*>(base)[index] != 0 ? 1.0f : 0.0f;
  }
  return 0.0f;
}

// Writes `value` rounded to dtype `t` (f32, bf16, f16 or fp8) at element `index`.
inline void store_from_f32(void* base, DType t, std::int64_t index, float value) {
  switch (t) {
    case DType::F32:
      static_cast<float*>(base)[index] = value;
      break;
    case DType::BF16:
      static_cast<std::uint16_t*>(base)[index] = f32_to_bf16(value);
      break;
    case DType::F16:
      static_cast<std::uint16_t*>(base)[index] = f32_to_f16(value);
      break;
    case DType::FP8_E4M3:
      static_cast<std::uint8_t*>(base)[index] = f32_to_fp8e4m3(value);
      break;
    case DType::I8:
      static_cast<std::int8_t*>(base)[index] =
          static_cast<std::int8_t>(std::fmax(-128.0f, std::fmin(127.0f, std::nearbyint(value))));
      break;
    case DType::I32:
      static_cast<std::int32_t*>(base)[index] = static_cast<std::int32_t>(value);
      break;
    case DType::Bool:
      static_cast<std::uint8_t*>(base)[index] = value != 0.0f ? 1 : 0;
      break;
  }
}

}  // namespace dattn
