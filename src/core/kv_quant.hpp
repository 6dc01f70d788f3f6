// Quantized KV storage (docs/semantics.md, "Paged KV"): symmetric int8 and fp8 e4m3 with one f32
// scale per (batch, block of kKvQuantBlockTokens tokens, head) on the dense path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dattn/metadata.hpp"
#include "dattn/tensor.hpp"

namespace dattn::detail {

inline constexpr std::int64_t kKvQuantBlockTokens = 64;

// The scale that maps a block whose largest magnitude is `absmax` onto the format's range
// (127 for int8, 448 for fp8 e4m3). A zero block gets scale 1.
float kv_quant_scale(float absmax, KvCacheDtype dtype);

// Quantizes `src` [B, S, H, D] (float dtype, any strides) per (batch, 64-token block, head) and
// writes the dequantized values into `dst` (f32, same shape). This is what a kernel reading a
// quantized cache sees. Throws InvalidArgument naming `field` when `src` holds an inf or NaN.
void quantize_dequantize_kv(const TensorView& src, KvCacheDtype dtype, const TensorView& dst,
                            const std::string& field);

// Throws InvalidArgument naming `field` (and the element) when `src` [B, S, H, D] holds an
// inf or NaN: one scale per block would turn its finite neighbours into NaN or zero.
void require_finite_for_quantization(const TensorView& src, KvCacheDtype dtype,
                                     const std::string& field);

// K or V held as codes: `codes` [B, S, H, D] int8 or fp8 e4m3 (contiguous) and one scale per
// (batch, block of kKvQuantBlockTokens tokens, head), scales[(b * blocks + s / 64) * H + h].
// The value of a code is code x scale, the same numbers quantize_dequantize_kv writes.
struct QuantizedKv {
  Tensor codes;
  std::vector<float> scales;
  std::int64_t blocks = 0, heads = 0;
  float scale(std::int64_t b, std::int64_t row, std::int64_t h) const {
    return scales[std::size_t((b * blocks + row / kKvQuantBlockTokens) * heads + h)];
  }
};
// Throws InvalidArgument naming `field` when `src` holds an inf or NaN.
QuantizedKv quantize_kv(const TensorView& src, KvCacheDtype dtype, const std::string& field);

}  // namespace dattn::detail
