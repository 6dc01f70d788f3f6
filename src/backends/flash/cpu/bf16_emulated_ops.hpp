// The portable C++ twins of the AVX-512 BF16 vector operations (avx512_bf16_ops.hpp), lane by
// lane: VDPBF16PS in the instruction's order (Intel SDM: srcdest += src1.odd * src2.odd, then
// += src1.even * src2.even, each an f32 FMA with denormal inputs read as zero and denormal
// results flushed to zero, round to nearest even). Used by the emulated engines
// (avx512_bf16_emulated, amx_emulated), on emulated_lanes.hpp's vector. Include inside the
// engine's namespace after bf16_pairs.hpp.

#include "backends/flash/cpu/emulated_lanes.hpp"

struct EmulatedBf16Ops : EmulatedLanes<16> {
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
  static void transpose16(const std::uint32_t* src, std::int64_t lds, std::uint32_t* dst,
                          std::int64_t ldd) {
    for (int r = 0; r < W; ++r)
      for (int c = 0; c < W; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
};
