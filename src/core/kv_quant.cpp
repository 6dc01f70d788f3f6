#include "core/kv_quant.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "dattn/errors.hpp"

namespace dattn::detail {

float kv_quant_scale(float absmax, KvCacheDtype dtype) {
  if (!(absmax > 0.0f) || !std::isfinite(absmax)) return 1.0f;
  return dtype == KvCacheDtype::int8 ? absmax / 127.0f : absmax / kFp8E4M3Max;
}

void require_finite_for_quantization(const TensorView& src, KvCacheDtype dtype,
                                     const std::string& field) {
  const std::int64_t B = src.size(0), S = src.size(1), H = src.size(2), D = src.size(3);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t e = 0; e < D; ++e) {
          const float x = load_as_f32(
              src.data(), src.dtype(),
              b * src.stride(0) + s * src.stride(1) + h * src.stride(2) + e * src.stride(3));
          if (!std::isfinite(x))
            throw InvalidArgument(
                field, field + ": element [" + std::to_string(b) + ", " + std::to_string(s) + ", " +
                           std::to_string(h) + ", " + std::to_string(e) + "] is " +
                           (std::isnan(x) ? "NaN"
                            : x > 0       ? "inf"
                                          : "-inf") +
                           "; kv_cache_dtype " + (dtype == KvCacheDtype::int8 ? "int8" : "fp8") +
                           " shares one scale per block of " + std::to_string(kKvQuantBlockTokens) +
                           " tokens, so only finite values can be quantized");
        }
}

void quantize_dequantize_kv(const TensorView& src, KvCacheDtype dtype, const TensorView& dst,
                            const std::string& field) {
  if (src.ndim() != 4 || dst.ndim() != 4 || dst.dtype() != DType::F32)
    throw InvalidArgument("kv", "quantize_dequantize_kv needs [B, S, H, D] views and f32 output");
  for (int i = 0; i < 4; ++i)
    if (src.size(i) != dst.size(i))
      throw InvalidArgument("kv", "quantize_dequantize_kv: shapes differ");
  const QuantizedKv q = quantize_kv(src, dtype, field);
  const std::int64_t B = src.size(0), S = src.size(1), H = src.size(2), D = src.size(3);
  auto* out = static_cast<float*>(dst.data());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t e = 0; e < D; ++e)
          out[b * dst.stride(0) + s * dst.stride(1) + h * dst.stride(2) + e * dst.stride(3)] =
              load_as_f32(q.codes.data(), q.codes.dtype(), ((b * S + s) * H + h) * D + e) *
              q.scale(b, s, h);
}

QuantizedKv quantize_kv(const TensorView& src, KvCacheDtype dtype, const std::string& field) {
  if (src.ndim() != 4 || dtype == KvCacheDtype::unquantized)
    throw InvalidArgument("kv", "quantize_kv needs a [B, S, H, D] view and int8 or fp8");
  require_finite_for_quantization(src, dtype, field);
  const std::int64_t B = src.size(0), S = src.size(1), H = src.size(2), D = src.size(3);
  QuantizedKv q;
  q.codes = Tensor::empty({B, S, H, D}, dtype == KvCacheDtype::int8 ? DType::I8 : DType::FP8_E4M3);
  q.blocks = (S + kKvQuantBlockTokens - 1) / kKvQuantBlockTokens;
  q.heads = H;
  q.scales.assign(std::size_t(B * q.blocks * H), 1.0f);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t blk = 0; blk < q.blocks; ++blk) {
      const std::int64_t s0 = blk * kKvQuantBlockTokens, s1 = std::min(S, s0 + kKvQuantBlockTokens);
      for (std::int64_t h = 0; h < H; ++h) {
        const auto at = [&](std::int64_t s, std::int64_t e) {
          return b * src.stride(0) + s * src.stride(1) + h * src.stride(2) + e * src.stride(3);
        };
        float absmax = 0.0f;
        for (std::int64_t s = s0; s < s1; ++s)
          for (std::int64_t e = 0; e < D; ++e)
            absmax = std::max(absmax, std::fabs(load_as_f32(src.data(), src.dtype(), at(s, e))));
        const float scale = kv_quant_scale(absmax, dtype);
        q.scales[std::size_t((b * q.blocks + blk) * H + h)] = scale;
        for (std::int64_t s = s0; s < s1; ++s)
          for (std::int64_t e = 0; e < D; ++e) {
            const float x = load_as_f32(src.data(), src.dtype(), at(s, e)) / scale;
            const std::int64_t to = ((b * S + s) * H + h) * D + e;
            if (dtype == KvCacheDtype::int8)
              q.codes.data_as<std::int8_t>()[to] =
                  static_cast<std::int8_t>(std::clamp(std::nearbyint(x), -127.0f, 127.0f));
            else
              q.codes.data_as<std::uint8_t>()[to] = f32_to_fp8e4m3(x);
          }
      }
    }
  return q;
}

}  // namespace dattn::detail
