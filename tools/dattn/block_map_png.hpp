// A picture of a sparse backend's block map: query blocks down, key blocks across.
#pragma once

#include <cstdint>
#include <string>

#include "dattn/video_sparse.hpp"

namespace dattn::cli {

// Writes the selection of (batch, head) as an RGB PNG: one square per (query block, key block),
// dark where the pair is computed (blue for dense rows: text, reference frames), white where it
// is skipped; squares are scaled up so that small maps stay readable. Throws std::runtime_error
// when the file cannot be written.
void write_block_map_png(const std::string& path, const BlockMap& map, const CallTiling& tiling,
                         std::int64_t batch, std::int64_t head);

}  // namespace dattn::cli
