// An independent oracle for the reference backend's tests: attention over an explicitly
// materialised visibility/bias function, written from the rules of docs/semantics.md rather than
// from the library's resolution code.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>

#include "test_inputs.hpp"

namespace dattn::testing {

// Bias of (b, h, i, j): nullopt = hidden, else the additive term (0 for a plain keep).
using Visibility = std::function<std::optional<double>(std::int64_t b, std::int64_t h,
                                                       std::int64_t i, std::int64_t j)>;

struct OracleResult {
  Tensor out;  // f32 [B, Sq, Hq, Dv]
  Tensor lse;  // f32 [B, Hq, Sq]
};

// q [B, Sq, Hq, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv] (BSHD views of any dtype).
inline OracleResult dense_oracle(const TensorView& q, const TensorView& k, const TensorView& v,
                                 double scale, const Visibility& visible) {
  const std::int64_t B = q.size(0), Sq = q.size(1), Hq = q.size(2), D = q.size(3);
  const std::int64_t Skv = k.size(1), Hkv = k.size(2), Dv = v.size(3);
  const auto qv = to_vector(q), kv = to_vector(k), vv = to_vector(v);
  OracleResult r{Tensor::zeros({B, Sq, Hq, Dv}, DType::F32),
                 Tensor::zeros({B, Hq, Sq}, DType::F32)};
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t hk = h * Hkv / Hq;  // consecutive query heads share a KV head
      for (std::int64_t i = 0; i < Sq; ++i) {
        std::vector<double> s(static_cast<std::size_t>(Skv),
                              -std::numeric_limits<double>::infinity());
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < Skv; ++j) {
          const auto bias = visible(b, h, i, j);
          if (!bias) continue;
          double dot = 0;
          for (std::int64_t e = 0; e < D; ++e)
            dot += qv[std::size_t(((b * Sq + i) * Hq + h) * D + e)] *
                   kv[std::size_t(((b * Skv + j) * Hkv + hk) * D + e)];
          s[std::size_t(j)] = scale * dot + *bias;
          m = std::max(m, s[std::size_t(j)]);
        }
        float* lse = r.lse.data_as<float>() + (b * Hq + h) * Sq + i;
        if (m == -std::numeric_limits<double>::infinity()) {
          *lse = -std::numeric_limits<float>::infinity();
          continue;
        }
        double sum = 0;
        std::vector<double> acc(static_cast<std::size_t>(Dv), 0.0);
        for (std::int64_t j = 0; j < Skv; ++j) {
          if (s[std::size_t(j)] == -std::numeric_limits<double>::infinity()) continue;
          const double w = std::exp(s[std::size_t(j)] - m);
          sum += w;
          for (std::int64_t e = 0; e < Dv; ++e)
            acc[std::size_t(e)] += w * vv[std::size_t(((b * Skv + j) * Hkv + hk) * Dv + e)];
        }
        *lse = static_cast<float>(m + std::log(sum));
        for (std::int64_t e = 0; e < Dv; ++e)
          r.out.data_as<float>()[((b * Sq + i) * Hq + h) * Dv + e] =
              static_cast<float>(acc[std::size_t(e)] / sum);
      }
    }
  return r;
}

}  // namespace dattn::testing
