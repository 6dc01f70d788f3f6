// What FLASH and the backends built on its kernels share around them: per-thread scratch laid
// out in one buffer, rows read into f32 tiles (any float dtype, int8/fp8 codes with a scale),
// and finished output rows (with their LSE) written back.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <optional>
#include <vector>

#include "backends/flash/kernels.hpp"
#include "dattn/problem.hpp"

namespace dattn::flash {

// Row strides in scratch are padded by kStridePad floats so that walking a column of a tile does
// not land every row in the same few L1 sets (strides of 512 B or 1 KiB cost the P.V and Q.K^T
// kernels 10-20% here).
inline constexpr std::int64_t kStridePad = 16;

// Lays float arrays out one after another in a scratch buffer; without a buffer it only
// counts, so that one carve function gives both the layout and the size.
class ScratchLayout {
 public:
  explicit ScratchLayout(float* base = nullptr) : base_(base) {}
  float* take(std::int64_t n) {
    float* at = base_ != nullptr ? base_ + used_ : nullptr;
    used_ += n;
    return at;
  }
  std::size_t floats() const { return static_cast<std::size_t>(used_); }

 private:
  float* base_;
  std::int64_t used_ = 0;
};

// The 256 values of fp8 e4m3 codes.
inline const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[std::size_t(c)] = fp8e4m3_to_f32(static_cast<std::uint8_t>(c));
    return t;
  }();
  return table;
}

// dst[0..n) = the `n` elements along t's last dim from element offset `base`, times `scale`:
// f32/bf16/f16 through the ISA's load_row, int8 and fp8 e4m3 codes dequantized.
inline void load_elements(const TileKernels& kk, const TensorView& t, std::int64_t base,
                          std::int64_t n, float scale, float* dst) {
  if (t.stride(3) == 1) {
    if (t.dtype() == DType::I8) {
      const auto* codes = static_cast<const std::int8_t*>(t.data()) + base;
      for (std::int64_t e = 0; e < n; ++e) dst[e] = float(codes[e]) * scale;
      return;
    }
    if (t.dtype() == DType::FP8_E4M3) {
      const auto* codes = static_cast<const std::uint8_t*>(t.data()) + base;
      const std::array<float, 256>& table = fp8_values();
      for (std::int64_t e = 0; e < n; ++e) dst[e] = table[codes[e]] * scale;
      return;
    }
    kk.rows_io.load_row(static_cast<const std::byte*>(t.data()) +
                            base * static_cast<std::int64_t>(dtype_size(t.dtype())),
                        t.dtype(), n, scale, dst);
    return;
  }
  for (std::int64_t e = 0; e < n; ++e)
    dst[e] = load_as_f32(t.data(), t.dtype(), base + e * t.stride(3)) * scale;
}

class OutputRows {
 public:
  OutputRows(const AttentionProblem& p, const TileKernels& kk) : p_(p), kk_(kk) {}

  // The end of a row's online softmax: m is its running max (natural units), l its sum and
  // o_row its un-normalised output. l NaN (a NaN or +inf logit it saw) or an output that is
  // not finite (NaN or inf in a V row it attended) gives a NaN row with LSE NaN; l == 0 (it saw
  // no key) gives zeros with LSE -inf; otherwise o_row / l. `inv` overrides 1 / l when the
  // caller has already normalised o_row (pass 1).
  void finish(float* o_row, float m, float l, std::int64_t b, std::int64_t h, std::int64_t i,
              std::optional<float> inv = std::nullopt) const {
    if (std::isnan(l)) return write_nan(b, h, i);
    if (!(l > 0.0f)) return write_zero(b, h, i);
    const float factor = inv.value_or(1.0f / l);
    bool finite = std::isfinite(m) && std::isfinite(l);
    for (std::int64_t e = 0; e < p_.dv; ++e) finite = finite && std::isfinite(o_row[e] * factor);
    if (!finite) return write_nan(b, h, i);
    write(o_row, factor, m, l, b, h, i);
  }

  // out[b, i, h, :] = o_row * inv (rounded to out's dtype); LSE = m + ln l, where m is the
  // row's running max and l its sum.
  void write(const float* o_row, float inv, float m, float l, std::int64_t b, std::int64_t h,
             std::int64_t i) const {
    const TensorView& o = p_.out;
    const std::int64_t base = b * o.stride(0) + i * o.stride(1) + h * o.stride(2);
    if (o.stride(3) == 1) {
      kk_.rows_io.store_row(
          o_row, inv, p_.dv, o.dtype(),
          static_cast<std::byte*>(o.data()) + base * std::int64_t(dtype_size(o.dtype())));
    } else {
      for (std::int64_t e = 0; e < p_.dv; ++e)
        store_from_f32(o.data(), o.dtype(), base + e * o.stride(3), o_row[e] * inv);
    }
    if (p_.lse) lse_at(b, h, i) = static_cast<float>(double(m) + std::log(double(l)));
  }

  // A row whose inputs carried a NaN or inf where it looked: NaN everywhere, LSE NaN.
  void write_nan(std::int64_t b, std::int64_t h, std::int64_t i) const {
    const TensorView& o = p_.out;
    const std::int64_t base = b * o.stride(0) + i * o.stride(1) + h * o.stride(2);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (std::int64_t e = 0; e < p_.dv; ++e)
      store_from_f32(o.data(), o.dtype(), base + e * o.stride(3), nan);
    if (p_.lse) lse_at(b, h, i) = nan;
  }

  // A row that saw no key: zeros, LSE -inf.
  void write_zero(std::int64_t b, std::int64_t h, std::int64_t i) const {
    const TensorView& o = p_.out;
    const std::int64_t base = b * o.stride(0) + i * o.stride(1) + h * o.stride(2);
    for (std::int64_t e = 0; e < p_.dv; ++e)
      store_from_f32(o.data(), o.dtype(), base + e * o.stride(3), 0.0f);
    if (p_.lse) lse_at(b, h, i) = -std::numeric_limits<float>::infinity();
  }

 private:
  float& lse_at(std::int64_t b, std::int64_t h, std::int64_t i) const {
    const TensorView& l = *p_.lse;
    return static_cast<float*>(l.data())[b * l.stride(0) + h * l.stride(1) + i * l.stride(2)];
  }

  const AttentionProblem& p_;
  const TileKernels& kk_;
};

}  // namespace dattn::flash
