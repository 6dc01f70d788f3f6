// Block-sparse video attention (docs/semantics.md, "Video token layout and VIDEO_SPARSE"): the
// tiling of a packed sequence described by a VideoTokenLayout, the block selection rules (sliding
// tile window, top-k, explicit maps) and the options of the VIDEO_SPARSE backend. The backend
// itself is in backends/sparse/.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dattn/attention.hpp"
#include "dattn/metadata.hpp"
#include "dattn/problem.hpp"
#include "dattn/tensor.hpp"

namespace dattn {

// Tile extents along (t, h, w), in latent tokens.
using TileShape = std::array<std::int64_t, 3>;

// One block of the tiled sequence: rows [begin, end) in tile order.
struct VideoBlock {
  std::int64_t begin = 0, end = 0;
  // Index into VideoTiling::grids() for a block of a video grid, -1 for a chunk of dense rows.
  std::int64_t grid = -1;
  // Tile coordinates inside the grid (video blocks only).
  std::array<std::int64_t, 3> tile{0, 0, 0};
  // Dense blocks (text/audio/image rows and reference grids) are attended by every query and
  // attend every key; target video blocks are the sparse ones.
  bool dense = true;
  std::int64_t size() const { return end - begin; }
};

struct VideoGrid {
  std::int64_t start = 0;  // first sequence row of the grid
  LatentGrid latent_grid{0, 0, 0};
  VideoRole role = VideoRole::target;
  std::array<std::int64_t, 3> tiles{0, 0, 0};  // tiles per axis
  std::int64_t first_block = 0;                // its first block; tiles t-major, then h, then w
};

// The permutation of a packed sequence of `seq_len` rows into tile order (docs/semantics.md, "Video
// token layout and VIDEO_SPARSE"): the used rows [0, used_len) as blocks in sequence order of their
// segments (dense runs chunked into blocks of at most `dense_block` rows that never mix segments;
// each video grid cut into 3-D tiles, t-major, edge tiles clipped, row-major inside a tile), then
// the padding rows [used_len, seq_len) in their order, in no block. Built once per layout and
// reused.
class VideoTiling {
 public:
  // Throws InvalidArgument naming the video_layout field (or "tile"/"dense_block") that is
  // invalid: both or neither form, negative or zero sizes, spans unsorted, overlapping or past
  // used_len, used length past `seq_len`.
  static VideoTiling build(const VideoTokenLayout& layout, std::int64_t seq_len, TileShape tile,
                           std::int64_t dense_block = 64);
  // No layout: `seq_len` dense rows in sequence order.
  static VideoTiling dense(std::int64_t seq_len, std::int64_t dense_block = 64);

  std::int64_t seq_len() const { return static_cast<std::int64_t>(order_.size()); }
  std::int64_t used_len() const { return used_len_; }
  const std::vector<VideoBlock>& blocks() const { return blocks_; }
  const std::vector<VideoGrid>& grids() const { return grids_; }
  // order()[p] = the sequence row at tile-order position p; position() is its inverse.
  const std::vector<std::int64_t>& order() const { return order_; }
  const std::vector<std::int64_t>& position() const { return position_; }
  std::int64_t video_blocks() const;  // blocks with dense == false

  // Rows of `x` along dimension `dim` (of size seq_len) reordered into tile order, and back.
  Tensor tile(const TensorView& x, int dim) const;
  Tensor untile(const TensorView& x, int dim) const;

 private:
  std::int64_t used_len_ = 0;
  std::vector<VideoBlock> blocks_;
  std::vector<VideoGrid> grids_;
  std::vector<std::int64_t> order_, position_;
};

enum class BlockSelection : std::uint8_t { sliding_tile, topk, explicit_map };
BlockSelection parse_block_selection(std::string_view s);  // throws InvalidArgument
std::string_view block_selection_name(BlockSelection s);

// Options of VIDEO_SPARSE, from its construction kwargs, overridden per call by the opaque
// `extra` slot. Keys (all optional):
//   "selection"     "topk" (default) | "sliding_tile" | "explicit"
//   "tile"          "t,h,w" tile extents (default "4,4,4" = 64 tokens)
//   "dense_block"   rows per block of dense rows (default 64)
//   "window"        "wt,wh,ww" sliding window in tiles (default "3,3,3")
//   "topk"          video key blocks kept per query block
//   "sparsity"      fraction of video key blocks skipped when topk is not given (default
//                   0.875): topk = max(1, round((1 - sparsity) x video blocks))
//   "gate"          tensor [B, Sq, Hq] or [B, Sq, Hq, Dv]: adds gate x the coarse branch
//   "block_map"     bool [B|1, Hq|1, query blocks, key blocks] (selection "explicit")
//   "block_indices" int32 [B|1, Hq|1, query blocks, K] with "block_counts" int32
//                   [B|1, Hq|1, query blocks]: the first counts entries of each row
struct VideoSparseOptions {
  BlockSelection selection = BlockSelection::topk;
  TileShape tile{4, 4, 4};
  std::int64_t dense_block = 64;
  std::array<std::int64_t, 3> window{3, 3, 3};
  std::optional<std::int64_t> topk;
  double sparsity = 0.875;
  std::optional<TensorView> gate;
  std::optional<TensorView> block_map;
  std::optional<TensorView> block_indices, block_counts;

  // Reads `construction`, then `call` (may be null) over it. Unknown keys are ignored; a known
  // key with a bad value throws InvalidArgument naming it.
  static VideoSparseOptions from(const BackendOptions& construction, const BackendOptions* call);
  // The top-k a call over `video_blocks` key blocks uses.
  std::int64_t topk_for(std::int64_t video_blocks) const;
};

// The key blocks each (batch, query head, query block) attends, ascending, in CSR form.
// Broadcast maps (the same selection for every batch item or head) have stride 0 there.
struct BlockMap {
  std::int64_t batch = 1, heads = 1, query_blocks = 0, key_blocks = 0;
  std::int64_t batch_stride = 0, head_stride = 0;  // in rows of the CSR
  std::vector<std::int64_t> offsets{0};
  std::vector<std::int32_t> indices;

  std::span<const std::int32_t> selected(std::int64_t b, std::int64_t h, std::int64_t qb) const {
    const std::int64_t row = b * batch_stride + h * head_stride + qb;
    return {indices.data() + offsets[std::size_t(row)],
            static_cast<std::size_t>(offsets[std::size_t(row) + 1] - offsets[std::size_t(row)])};
  }
  // Fraction of the (query row, key row) pairs of the used rows that are not computed, over
  // every (batch, head).
  double sparsity(const VideoTiling& queries, const VideoTiling& keys) const;
};

// The sliding tile window: a target video query block sees, per axis, the min(window, tiles)
// consecutive tiles of its own grid whose centre is nearest its own tile (the earlier one on a
// tie; at the grid's edges the window moves inside), plus every dense key block; dense query
// blocks see every block.
// `queries` and `keys` are the same tiling for self-attention; with keys of another sequence
// (no video blocks) every query sees every key block.
BlockMap sliding_tile_map(const VideoTiling& queries, const VideoTiling& keys,
                          const std::array<std::int64_t, 3>& window);

// The tilings of one call: queries by the layout; keys by the same layout for
// self-attention (Skv == Sq), all dense otherwise.
struct CallTiling {
  VideoTiling queries, keys;
};
CallTiling tile_call(const AttentionProblem& p, const VideoSparseOptions& o);

// Mean-pooled rows per block over valid rows (rows inside a segment of the batch item, keys kept
// by the key-padding mask): q [B, Hq, query blocks, D], k [B, Hkv, key blocks, D] and, when
// `with_values`, v [B, Hkv, key blocks, Dv]; counts of valid rows per block.
struct PooledBlocks {
  std::int64_t qblocks = 0, kblocks = 0;
  std::vector<float> q, k, v;
  std::vector<std::int64_t> q_rows, k_rows;  // [B, query blocks], [B, key blocks]
};
PooledBlocks pool_blocks(const AttentionProblem& p, const CallTiling& t, bool with_values);

// The selection a VIDEO_SPARSE call makes (docs/semantics.md, "Video token layout and
// VIDEO_SPARSE"): sliding window, top-k by pooled scores (video key blocks scored pooled q . pooled
// k x scale, ties to the lower block; every video query block keeps exactly min(topk, video blocks)
// of them plus every dense block; dense query blocks see everything), or the caller's explicit map
// (validated: shape, and every query block selects at least one key block). `pooled` is needed for
// top-k only.
BlockMap select_blocks(const AttentionProblem& p, const CallTiling& t, const VideoSparseOptions& o,
                       const PooledBlocks* pooled);

// What VIDEO_SPARSE selects for the call `in` of a layer configured as `config` (its
// backend_options are the construction options; the call's extra.backend overrides them):
// validates the call like the layer does and returns the tilings, options and block map. For
// tools and tests: reports of sparsity, pictures of the map, masked-reference checks.
struct VideoSparseSelection {
  CallTiling tiling;
  VideoSparseOptions options;
  BlockMap map;
};
VideoSparseSelection video_sparse_selection(const AttentionConfig& config,
                                            const AttentionInputs& in);

}  // namespace dattn
