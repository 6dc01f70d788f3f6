// What every backend's forward_paged sets alike on the problems it builds from a paged call.
#pragma once

#include <cstdint>

#include "dattn/paged.hpp"
#include "dattn/problem.hpp"

namespace dattn::detail {

// Scale and position rule of `call` (full, bottom-right causal, or piecewise with its spans).
inline void apply_paged_rules(const PagedAttentionCall& call, AttentionProblem& p) {
  p.softmax_scale = call.softmax_scale;
  p.position_rule = call.causal ? PositionRule::causal : PositionRule::full;
  if (!call.full_attn_spans.empty()) {
    p.position_rule = PositionRule::piecewise;
    p.full_spans = call.full_attn_spans;
  }
}

// An LSE view [H, T] as the problem's [1, H, T].
inline TensorView lse_as_batch(const TensorView& l) {
  return l.unsqueezed(0);
}

}  // namespace dattn::detail
