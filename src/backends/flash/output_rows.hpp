// Writing finished output rows (and their LSE) of a problem, for FLASH and the backends built on
// its kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>

#include "backends/flash/kernels.hpp"
#include "dattn/problem.hpp"

namespace dattn::flash {

class OutputRows {
 public:
  OutputRows(const AttentionProblem& p, const TileKernels& kk) : p_(p), kk_(kk) {}

  // out[b, i, h, :] = o_row * inv (rounded to out's dtype); LSE = m ln 2 + ln l, where m is the
  // row's running max in log2 units and l its sum.
  void write(const float* o_row, float inv, float m, float l, std::int64_t b, std::int64_t h,
             std::int64_t i) const {
    const TensorView& o = p_.out;
    const std::int64_t base = b * o.stride(0) + i * o.stride(1) + h * o.stride(2);
    if (o.stride(3) == 1) {
      kk_.store_row(o_row, inv, p_.dv, o.dtype(),
                    static_cast<std::byte*>(o.data()) + base * std::int64_t(dtype_size(o.dtype())));
    } else {
      for (std::int64_t e = 0; e < p_.dv; ++e)
        store_from_f32(o.data(), o.dtype(), base + e * o.stride(3), o_row[e] * inv);
    }
    if (p_.lse)
      lse_at(b, h, i) = static_cast<float>((double(m) + std::log2(double(l))) * std::numbers::ln2);
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
