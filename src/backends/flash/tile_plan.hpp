// Tile-size and work-split heuristics of the FLASH backend: small pure functions.
#pragma once

#include <algorithm>
#include <cstdint>

#include "backends/flash/kernels.hpp"

namespace dattn::flash {

// Query rows of one work item: a block of query rows times the heads of one GQA group that
// share its K/V tiles, about kTargetRows in all. Example: GQA 4:1 gives 32 rows per head x 4
// heads = 128; MHA gives 128 rows of one head; MQA with 24 query heads gives 5 rows x 24
// heads = 120 (groups of more than kTargetRows heads are split into chunks).
inline constexpr std::int64_t kTargetRows = 128;
// Keys per tile. 128 rows x 64 keys keep the tile scratch (Q^T, S^T, O and, for inputs that
// need converting, K and V) at 224 KiB for D = Dv = 128, inside a 512 KiB L2.
inline constexpr std::int64_t kBlockKeys = kTileKeys;

struct RowBlock {
  std::int64_t heads;  // query heads of the group per work item
  std::int64_t rows_per_head;
};

// Example: group 4 -> {4, 32}; group 1 -> {1, 128}; group 24 -> {24, 5}; 200 -> {128, 1}.
constexpr RowBlock row_block(std::int64_t group) {
  const std::int64_t heads = std::clamp<std::int64_t>(group, 1, kTargetRows);
  return {heads, std::max<std::int64_t>(1, kTargetRows / heads)};
}

constexpr std::int64_t round_up(std::int64_t x, std::int64_t to) {
  return (x + to - 1) / to * to;
}

}  // namespace dattn::flash
