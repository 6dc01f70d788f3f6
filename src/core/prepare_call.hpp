// Validation of one call and its resolution into an AttentionProblem (the trusted struct).
#pragma once

#include <string>
#include <vector>

#include "dattn/attention.hpp"
#include "dattn/parallel.hpp"
#include "dattn/problem.hpp"

namespace dattn::detail {

struct PrepareOptions {
  // Backends without supports_packed_mask_free ignore packed_padding (docs/semantics.md, "Packed
  // padding and prefix slicing").
  bool honour_packed_padding = true;
  // false: validate only; merged masks are not built (used to validate before any parallel
  // exchange).
  bool materialize = true;
};

struct PreparedCall {
  AttentionProblem problem;
  std::vector<Tensor> owned;  // merged key masks, when needed
};

// The entries of a 1-D int32 host tensor (cu_seqlens) as i64. Throws InvalidArgument naming
// `field` for another dtype or rank, Unsupported for a tensor not on the host.
std::vector<std::int64_t> read_int32_vector(const TensorView& t, const std::string& field);
// Q/K/V/out (or joint tensors) in `layout` as a [B, S, H, D] view (BHSD permuted, THD with a
// batch dim of 1 in front). Throws InvalidArgument naming `field` for a wrong rank.
TensorView to_bshd(const TensorView& t, QkvLayout layout, const std::string& field);

// Validates `in` against `config` (docs/semantics.md) and resolves it. Throws InvalidArgument or
// Unsupported naming the field; never writes to the output buffers.
PreparedCall prepare_call(const AttentionConfig& config, double softmax_scale,
                          std::int64_t num_kv_heads, const AttentionInputs& in,
                          const PrepareOptions& options);

}  // namespace dattn::detail
