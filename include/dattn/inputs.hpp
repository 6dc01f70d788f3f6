// The inputs of one attention call as the caller passes them, and how to read their views.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "dattn/metadata.hpp"
#include "dattn/tensor.hpp"

namespace dattn {

// How Q, K, V, out and the joint tensors are laid out: BSHD [B, S, H, D], BHSD [B, H, S, D] or
// THD [T, H, D] (one packed sequence, batch 1).
enum class QkvLayout : std::uint8_t { BSHD, BHSD, THD };
QkvLayout parse_qkv_layout(std::string_view s);  // throws InvalidArgument
std::string_view qkv_layout_name(QkvLayout l);

// The inputs of one call as the caller passed them (layout of the layer's qkv_layout).
struct AttentionInputs {
  TensorView q, k, v;
  const AttentionMetadata* metadata = nullptr;
  TensorView out;
  std::optional<TensorView> lse;
};

}  // namespace dattn
