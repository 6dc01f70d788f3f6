// VideoTiling: the permutation of a packed sequence into tile order (docs/semantics.md, "Video
// token layout and VIDEO_SPARSE").
#include <algorithm>
#include <string>

#include "core/video_layout.hpp"
#include "dattn/errors.hpp"
#include "dattn/video_sparse.hpp"

namespace dattn {

namespace {

using i64 = std::int64_t;

[[noreturn]] void invalid(const std::string& field, const std::string& what) {
  throw InvalidArgument(field, field + ": " + what);
}

void check_sizes(const TileShape& tile, i64 dense_block) {
  for (i64 n : tile)
    if (n <= 0 || n > 4096)
      invalid("tile", "tile (" + std::to_string(tile[0]) + ", " + std::to_string(tile[1]) + ", " +
                          std::to_string(tile[2]) + ") is not valid; valid: sizes in [1, 4096]");
  if (dense_block <= 0 || dense_block > (i64(1) << 20))
    invalid("dense_block", "dense_block = " + std::to_string(dense_block) +
                               " is not valid; valid: 1 to 2^20 rows");
}

Tensor reorder(const TensorView& x, int dim, const std::vector<i64>& from) {
  if (dim < 0 || dim >= x.ndim() || x.size(dim) != static_cast<i64>(from.size()))
    invalid("x", "dimension " + std::to_string(dim) + " of " + x.describe() + " must have " +
                     std::to_string(from.size()) + " rows");
  Tensor out = Tensor::empty(x.shape(), x.dtype());
  for (std::size_t p = 0; p < from.size(); ++p)
    copy_into(x.sliced(dim, from[p], 1), out.view().sliced(dim, static_cast<i64>(p), 1));
  return out;
}

}  // namespace

VideoTiling VideoTiling::dense(i64 seq_len, i64 dense_block) {
  check_sizes({1, 1, 1}, dense_block);
  if (seq_len < 0) invalid("seq_len", "seq_len must be >= 0");
  VideoTiling t;
  t.used_len_ = seq_len;
  for (i64 b = 0; b < seq_len; b += dense_block)
    t.blocks_.push_back({b, std::min(seq_len, b + dense_block)});
  t.order_.resize(std::size_t(seq_len));
  for (i64 i = 0; i < seq_len; ++i) t.order_[std::size_t(i)] = i;
  t.position_ = t.order_;
  return t;
}

VideoTiling VideoTiling::build(const VideoTokenLayout& layout, i64 seq_len, TileShape tile,
                               i64 dense_block) {
  check_sizes(tile, dense_block);
  VideoTiling t;
  const detail::CheckedVideoLayout checked =
      detail::validate_video_layout(layout, seq_len, detail::VideoLayoutRules::full);
  t.used_len_ = checked.used_len;
  t.order_.reserve(std::size_t(seq_len));
  for (const detail::VideoStretch& s : checked.stretches) {
    if (!s.video) {
      for (i64 b = 0; b < s.length; b += dense_block) {
        const i64 begin = static_cast<i64>(t.order_.size());
        const i64 n = std::min(dense_block, s.length - b);
        for (i64 r = 0; r < n; ++r) t.order_.push_back(s.start + b + r);
        t.blocks_.push_back({begin, begin + n});
      }
      continue;
    }
    const LatentGrid& g = s.video->latent_grid;
    VideoGrid vg;
    vg.start = s.start;
    vg.latent_grid = g;
    vg.role = s.video->role;
    for (int a = 0; a < 3; ++a) vg.tiles[std::size_t(a)] = (g[a] + tile[a] - 1) / tile[a];
    vg.first_block = static_cast<i64>(t.blocks_.size());
    const i64 grid_index = static_cast<i64>(t.grids_.size());
    t.grids_.push_back(vg);
    for (i64 ct = 0; ct < vg.tiles[0]; ++ct)
      for (i64 ch = 0; ch < vg.tiles[1]; ++ch)
        for (i64 cw = 0; cw < vg.tiles[2]; ++cw) {
          const i64 begin = static_cast<i64>(t.order_.size());
          for (i64 z = ct * tile[0]; z < std::min(g[0], (ct + 1) * tile[0]); ++z)
            for (i64 y = ch * tile[1]; y < std::min(g[1], (ch + 1) * tile[1]); ++y)
              for (i64 x = cw * tile[2]; x < std::min(g[2], (cw + 1) * tile[2]); ++x)
                t.order_.push_back(s.start + (z * g[1] + y) * g[2] + x);
          VideoBlock block{begin, static_cast<i64>(t.order_.size()), grid_index, {ct, ch, cw}};
          block.dense = vg.role != VideoRole::target;
          t.blocks_.push_back(block);
        }
  }
  for (i64 r = t.used_len_; r < seq_len; ++r) t.order_.push_back(r);
  t.position_.assign(std::size_t(seq_len), 0);
  for (std::size_t p = 0; p < t.order_.size(); ++p)
    t.position_[std::size_t(t.order_[p])] = static_cast<i64>(p);
  return t;
}

i64 VideoTiling::video_blocks() const {
  return std::count_if(blocks_.begin(), blocks_.end(),
                       [](const VideoBlock& b) { return !b.dense; });
}

Tensor VideoTiling::tile(const TensorView& x, int dim) const {
  return reorder(x, dim, order_);
}

Tensor VideoTiling::untile(const TensorView& x, int dim) const {
  return reorder(x, dim, position_);
}

}  // namespace dattn
