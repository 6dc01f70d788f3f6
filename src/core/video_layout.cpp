#include "core/video_layout.hpp"

#include <string>

#include "dattn/errors.hpp"

namespace dattn::detail {

namespace {

using i64 = std::int64_t;

[[noreturn]] void invalid(const std::string& field, const std::string& what) {
  throw InvalidArgument(field, field + ": " + what);
}

std::string grid_text(const LatentGrid& g) {
  return "(" + std::to_string(g[0]) + ", " + std::to_string(g[1]) + ", " + std::to_string(g[2]) +
         ")";
}

const std::string kBound = "2^62 (kMaxPosition)";

// t*h*w of `g`, which must not overflow nor pass kMaxPosition.
i64 grid_rows(const LatentGrid& g, const std::string& field) {
  i64 rows = 1;
  for (i64 n : g)
    if (__builtin_mul_overflow(rows, n, &rows) || rows > kMaxPosition || rows < -kMaxPosition)
      invalid(field, "latent_grid " + grid_text(g) + " has t*h*w past " + kBound);
  return rows;
}

// start + rows, which must not overflow and must stay at most kMaxPosition.
i64 end_of(i64 start, i64 rows, const std::string& field, const std::string& what) {
  i64 end = 0;
  if (start >= kMaxPosition || __builtin_add_overflow(start, rows, &end) || end > kMaxPosition)
    invalid(field, what + " = " + std::to_string(start) + " with " + std::to_string(rows) +
                       " video rows ends past " + kBound);
  return end;
}

}  // namespace

CheckedVideoLayout validate_video_layout(const VideoTokenLayout& layout, i64 seq_len,
                                         VideoLayoutRules rules) {
  const bool full = rules == VideoLayoutRules::full;
  const bool tail = layout.prefix_len.has_value() || layout.latent_grid.has_value();
  // A one-tail layout may also state its used_len (vllm-omni's video models do), which must
  // then be prefix_len + t*h*w: without spans, used_len is the span form's only if no tail.
  const bool spans = !layout.video_spans.empty() || (layout.used_len.has_value() && !tail);

  // ---- arithmetic, whatever the form ----
  if (layout.prefix_len && *layout.prefix_len >= kMaxPosition)
    invalid("video_layout.prefix_len",
            "prefix_len = " + std::to_string(*layout.prefix_len) + " is past " + kBound);
  if (layout.latent_grid) {
    const i64 rows = grid_rows(*layout.latent_grid, "video_layout.latent_grid");
    if (layout.prefix_len)
      end_of(*layout.prefix_len, rows, "video_layout.prefix_len", "prefix_len");
  }
  if (layout.used_len && *layout.used_len > kMaxPosition)
    invalid("video_layout.used_len",
            "used_len = " + std::to_string(*layout.used_len) + " is past " + kBound);
  for (std::size_t i = 0; i < layout.video_spans.size(); ++i) {
    const VideoTokenSpan& s = layout.video_spans[i];
    const std::string field = "video_layout.video_spans[" + std::to_string(i) + "]";
    end_of(s.start, grid_rows(s.latent_grid, field + ".latent_grid"), field + ".start", "start");
  }
  CheckedVideoLayout out;
  if (!full) return out;

  // ---- the form, sizes, order and length ----
  if (tail == spans)
    invalid("video_layout",
            "give either prefix_len + latent_grid (one-tail form) or used_len + "
            "video_spans (span form), not " +
                std::string(tail ? "both" : "neither"));
  std::vector<VideoTokenSpan> grids;
  if (tail) {
    if (!layout.prefix_len || !layout.latent_grid)
      invalid(layout.prefix_len ? "video_layout.latent_grid" : "video_layout.prefix_len",
              "the one-tail form needs both prefix_len and latent_grid");
    if (*layout.prefix_len < 0)
      invalid("video_layout.prefix_len",
              "prefix_len = " + std::to_string(*layout.prefix_len) + " must be >= 0");
    grids.push_back({*layout.prefix_len, *layout.latent_grid, VideoRole::target});
  } else {
    if (!layout.used_len) invalid("video_layout.used_len", "the span form needs used_len");
    grids = layout.video_spans;
  }
  i64 end = 0;
  for (std::size_t i = 0; i < grids.size(); ++i) {
    const VideoTokenSpan& s = grids[i];
    const std::string field =
        tail ? "video_layout.latent_grid" : "video_layout.video_spans[" + std::to_string(i) + "]";
    for (i64 n : s.latent_grid)
      if (n <= 0 || n > (i64(1) << 20))
        invalid(field, "latent_grid " + grid_text(s.latent_grid) +
                           " is not valid; valid: three sizes in [1, 2^20]");
    if (s.start < end)
      invalid(field, "start " + std::to_string(s.start) +
                         (i == 0 ? " is negative" : " overlaps or precedes the previous span") +
                         "; spans must be sorted and disjoint");
    if (s.start > end) out.stretches.push_back({end, s.start - end, std::nullopt});
    out.stretches.push_back({s.start, s.length(), s});
    end = s.start + s.length();  // checked above: at most kMaxPosition
  }
  if (tail && layout.used_len && *layout.used_len != end)
    invalid("video_layout.used_len",
            "used_len = " + std::to_string(*layout.used_len) +
                " with the one-tail form's prefix_len = " + std::to_string(*layout.prefix_len) +
                " and latent_grid " + grid_text(*layout.latent_grid) + ", which end at " +
                std::to_string(end) + "; give used_len = prefix_len + t*h*w or leave it out");
  out.used_len = tail ? end : *layout.used_len;
  if (!tail && out.used_len < end)
    invalid("video_layout.used_len", "used_len = " + std::to_string(out.used_len) +
                                         " ends before the last span (ends at " +
                                         std::to_string(end) + ")");
  if (out.used_len > seq_len)
    invalid(tail ? "video_layout" : "video_layout.used_len",
            "used length " + std::to_string(out.used_len) + " is past the sequence's " +
                std::to_string(seq_len) + " rows");
  if (out.used_len > end) out.stretches.push_back({end, out.used_len - end, std::nullopt});
  return out;
}

}  // namespace dattn::detail
