// The one validator of a VideoTokenLayout (docs/semantics.md, "Video token layout and
// VIDEO_SPARSE"), used by the layer for every backend and by every reader of a layout
// (VIDEO_SPARSE's tiling).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "dattn/metadata.hpp"

namespace dattn::detail {

// What a check of a layout covers.
enum class VideoLayoutRules : std::uint8_t {
  // Every sum and product (t*h*w, prefix_len + t*h*w, start + t*h*w) computed without overflow
  // and every row below kMaxPosition: what a backend that ignores the layout still needs.
  arithmetic,
  // The arithmetic, and the form (one-tail or span form, not both), sizes in [1, 2^20], spans
  // sorted and disjoint, the used length within the sequence: what a reader of the layout needs.
  full,
};

// A stretch of the used rows: dense rows, or one video grid.
struct VideoStretch {
  std::int64_t start = 0, length = 0;
  std::optional<VideoTokenSpan> video;
};

struct CheckedVideoLayout {
  std::int64_t used_len = 0;            // full rules only
  std::vector<VideoStretch> stretches;  // full rules only: the used rows in sequence order
};

// Checks `layout` for a sequence of `seq_len` rows (joint rows included). Throws InvalidArgument
// naming the field: "video_layout.prefix_len", "video_layout.latent_grid",
// "video_layout.used_len", "video_layout.video_spans[i]" (with ".start" or ".latent_grid" for
// an overflow), or "video_layout" for the form or a layout longer than the sequence.
CheckedVideoLayout validate_video_layout(const VideoTokenLayout& layout, std::int64_t seq_len,
                                         VideoLayoutRules rules);

}  // namespace dattn::detail
