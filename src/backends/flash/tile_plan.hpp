// Tile-size and work-split heuristics of the FLASH backend: small pure functions.
#pragma once

#include <algorithm>
#include <cstdint>

#include "backends/flash/kernels.hpp"

namespace dattn::flash {

// Keys per tile. 128 rows x 64 keys keep the tile scratch (Q^T, S^T, O and, for inputs that
// need converting, K and V) at 224 KiB for D = Dv = 128, inside a 512 KiB L2.
inline constexpr std::int64_t kBlockKeys = kTileKeys;

// Split-KV: a call with fewer query blocks than this has its key ranges cut until it has about
// this many work items (flash.cpp's plan). A constant, not the thread count, so that the answer
// does not depend on how many threads computed it; 16 keeps 16 threads busy on one query block.
inline constexpr std::int64_t kSplitUnits = 16;

struct RowBlock {
  std::int64_t heads;  // query heads of the group per work item
  std::int64_t rows_per_head;
};

// Query rows of one work item: a block of query rows times the heads of one GQA group that
// share its K/V tiles, about `target` rows in all (item_rows below). Examples for 128: GQA 4:1
// gives 32 rows per head x 4 heads = 128; MHA gives 128 rows of one head; MQA with 24 query heads
// gives 5 rows x 24 heads = 120; 200 heads give {128, 1} (groups of more than `target` heads are
// split into chunks). Target 256: group 1 -> {1, 256}, group 4 -> {4, 64}.
constexpr RowBlock row_block(std::int64_t group, std::int64_t target) {
  const std::int64_t heads = std::clamp<std::int64_t>(group, 1, target);
  return {heads, std::max<std::int64_t>(1, target / heads)};
}

// The rows per work item of an engine on a CPU whose cores have `l2_bytes` of L2 (0:
// unknown): InnerLoop::item_rows, or item_rows_large_l2 from 1 MiB on. The tile-by-tile
// engines take 256 rows there (f32 scratch about 430 KiB at D 128): each K/V tile then serves
// twice the rows while in L2, which pays where K/V is long (wan-480p f32, 2 threads, an Intel
// Xeon with 2 MiB L2, interleaved in one process: 194 -> 205 GFLOP/s median; sd35-1024 191 ->
// 196; flux-1024 even), while a 512 KiB L2 (AMD Zen 3) keeps 128.
constexpr std::int64_t item_rows(const TileKernels& kk, long long l2_bytes) {
  return l2_bytes >= (1ll << 20) ? kk.loop.item_rows_large_l2 : kk.loop.item_rows;
}

constexpr std::int64_t round_up(std::int64_t x, std::int64_t to) {
  return (x + to - 1) / to * to;
}

}  // namespace dattn::flash
