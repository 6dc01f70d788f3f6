// The trusted parameter struct: one attention call after validation, with every metadata form
// (global starts, query ranges, cu_seqlens, [real, pad] packing, packed padding,
// valid_kv_length, joint tokens) resolved into row segments. Backends and kernels trust it.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dattn/metadata.hpp"
#include "dattn/tensor.hpp"

namespace dattn {

// Features a call uses that a backend must claim (docs/semantics.md, "Capabilities and selection":
// flags must be true).
enum class Feature : std::uint32_t {
  attention_mask = 1u << 0,           // any attn_mask that is read
  multi_doc_packed_varlen = 1u << 1,  // more than one real packed document
  packed_mask_free = 1u << 2,         // packed_padding used without a mask
  prefix_kv_slicing = 1u << 3,        // extra.valid_kv_length
  piecewise_spans = 1u << 4,          // full_attn_spans
  paged_kv = 1u << 5,                 // forward_paged
  lse_output = 1u << 6,               // always supported; recorded for reports
  causal = 1u << 7,                   // causal (or bottom-right causal) positions
  dense_attention_mask = 1u << 8,     // a 3-D/4-D bool or additive mask (not key padding)
};
inline constexpr Feature kLastFeature = Feature::dense_attention_mask;
// The name of the capability that guards `f` (include/dattn/capabilities.hpp), the seed's flag
// name, e.g. "supports_paged_kv"; "lse_output" for the feature nothing guards.
std::string_view feature_name(Feature f);

class FeatureSet {
 public:
  void add(Feature f) { bits_ |= static_cast<std::uint32_t>(f); }
  bool has(Feature f) const { return (bits_ & static_cast<std::uint32_t>(f)) != 0; }
  std::vector<Feature> list() const;
  std::string to_string() const;

 private:
  std::uint32_t bits_ = 0;
};

// How keys are restricted by position.
enum class PositionRule : std::uint8_t {
  full,       // no positional restriction
  causal,     // key visible iff pos(key) <= pos(query)
  piecewise,  // causal, and rows inside a full span [a, e) see every key < e (docs/semantics.md,
              // "Piecewise spans and query ranges")
};

// The kind of dense mask a call carries. Layout contract of MaskView::view:
//  keep_keys:  bool [B, Skv]                      (key padding)
//  keep_dense: bool [B, Hq, Sq, Skv]              (size-1 dims broadcast with stride 0)
//  additive:   f32/bf16/f16 [B, Hq, Sq, Skv]      (added to the scaled logits; -inf hides)
enum class MaskKind : std::uint8_t { none, keep_keys, keep_dense, additive };
struct MaskView {
  MaskKind kind = MaskKind::none;
  TensorView view;
  // Whether key j of batch item b survives a key-padding mask (always true for other kinds).
  bool keeps_key(std::int64_t b, std::int64_t j) const {
    return kind != MaskKind::keep_keys ||
           static_cast<const std::uint8_t*>(view.data())[b * view.stride(0) + j * view.stride(1)] !=
               0;
  }
};

// A run of query rows [q_begin, q_end) of one batch item that see keys [k_begin, k_end).
// Positions are linear: row i is at q_pos0 + (i - q_begin), key j at k_pos0 + (j - k_begin).
// Query rows that belong to no segment are padding: output 0, LSE -inf.
struct Segment {
  std::int64_t batch = 0;
  std::int64_t q_begin = 0, q_end = 0;
  std::int64_t k_begin = 0, k_end = 0;
  std::int64_t q_pos0 = 0, k_pos0 = 0;
  bool operator==(const Segment&) const = default;
};

// Joint (text) rows attached to Q, K and V without a copy (docs/semantics.md, "Joint tokens"): row
// i of the concatenation is joint row i (front) or local row i (rear) for i below the first part's
// length, and a row of the other part after it.
struct JointRows {
  TensorView q, k, v;  // [B, J, Hq, D], [B, J, Hkv, D], [B, J, Hkv, Dv]
  bool front = true;
  std::int64_t rows() const { return q.size(1); }
};

// Row `row` of tensor `view`: where one row of the concatenation lives.
struct RowRef {
  const TensorView* view;
  std::int64_t row;
};

// Keys read through block tables (a paged call, docs/semantics.md, "Paged KV"): k and v of the
// problem are the page pools [num_blocks, block_size, Hkv, D]; key j of segment s lives in page
// tables[s][j / block_size], slot j % block_size.
struct PagedKeys {
  std::int64_t block_size = 0;
  std::vector<const std::vector<std::int32_t>*> tables;  // one per segment
  // int8 / fp8 pages: f32 scales [num_blocks, Hkv] (value = code x scale).
  std::optional<TensorView> k_scales, v_scales;
};

struct AttentionProblem {
  // Shapes, joint rows included: Q [B, Sq, Hq, D], K [B, Skv, Hkv, D], V [B, Skv, Hkv, Dv],
  // out [B, Sq, Hq, Dv], lse f32 [B, Hq, Sq]. q, k and v hold the caller's own rows
  // (Sq - J and Skv - J of them); read rows through q_row/k_row/v_row, which also find the
  // joint ones. All strided views, whatever layout the caller used.
  std::int64_t batch = 0, sq = 0, skv = 0, hq = 0, hkv = 0, d = 0, dv = 0;
  TensorView q, k, v, out;
  std::optional<JointRows> joint;
  std::optional<TensorView> lse;
  std::optional<PagedKeys> paged;  // set by a backend's forward_paged, never by the layer

  RowRef q_row(std::int64_t i) const { return locate(q, joint ? &joint->q : nullptr, i); }
  RowRef k_row(std::int64_t j) const { return locate(k, joint ? &joint->k : nullptr, j); }
  RowRef v_row(std::int64_t j) const { return locate(v, joint ? &joint->v : nullptr, j); }

  double softmax_scale = 1.0;
  PositionRule position_rule = PositionRule::full;
  std::vector<std::pair<std::int64_t, std::int64_t>> full_spans;  // sorted, for piecewise
  MaskView mask;
  // Self-attention with a key-padding mask: a query row whose own key position is masked out
  // outputs zero (docs/semantics.md, "Masks").
  bool zero_masked_query_rows = false;
  std::vector<Segment> segments;   // sorted by (batch, q_begin), disjoint in query rows
  double laser_input_scale = 1.0;  // 1 = off
  KvCacheDtype kv_cache_dtype = KvCacheDtype::unquantized;
  const BackendOptions* backend_options = nullptr;  // opaque per-backend slot; may be null
  // Where video grids sit in the sequence (docs/semantics.md, "Video token layout and
  // VIDEO_SPARSE"), joint rows included; null = none. Dense backends ignore it. Not part of the
  // signature: a sparse backend keys its own caches by it.
  const VideoTokenLayout* video_layout = nullptr;
  FeatureSet features;
  // OpenMP threads the call may use: the calling context's omp_get_max_threads(), clamped to
  // [1, kMaxThreads] (set by the layer and by forward_paged). Part of the signature, so a plan
  // made on one thread count never runs a call from another.
  int threads = 1;
  // Identifies shapes and metadata structure; a plan runs only on problems with its signature.
  std::uint64_t signature = 0;

  std::int64_t group_size() const { return hkv > 0 ? hq / hkv : 1; }
  // One past the largest key position a query at `pos_q` may see (numeric_limits max = all).
  std::int64_t key_position_limit(std::int64_t pos_q) const {
    switch (position_rule) {
      case PositionRule::full:
        return std::numeric_limits<std::int64_t>::max();
      case PositionRule::causal:
        return pos_q + 1;
      case PositionRule::piecewise:
        for (const auto& [a, e] : full_spans)
          if (pos_q >= a && pos_q < e) return e;
        return pos_q + 1;
    }
    return pos_q + 1;
  }
  std::string describe() const;

 private:
  RowRef locate(const TensorView& local, const TensorView* joint_part, std::int64_t i) const {
    if (joint_part == nullptr) return {&local, i};
    const std::int64_t first = joint->front ? joint_part->size(1) : local.size(1);
    const TensorView* head = joint->front ? joint_part : &local;
    const TensorView* tail = joint->front ? &local : joint_part;
    return i < first ? RowRef{head, i} : RowRef{tail, i - first};
  }
};

}  // namespace dattn
