// Per-call attention metadata (the seed's AttentionMetadata and its companions), typed.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "dattn/tensor.hpp"

namespace dattn {

// Every position of a call stays below 2^62: query and key positions (q_global_start + Sq,
// k_global_start + Skv, query_ranges' global_start + rows), full_attn_spans' ends, video layout
// rows and paged sequence lengths are at most kMaxPosition, so no sum of positions and lengths
// can overflow. A larger one raises InvalidArgument naming the field.
inline constexpr std::int64_t kMaxPosition = std::int64_t(1) << 62;

// Maps local query rows [local_start, local_end) to global positions starting at global_start.
struct QueryRange {
  std::int64_t local_start = 0;
  std::int64_t local_end = 0;
  std::int64_t global_start = 0;
  bool operator==(const QueryRange&) const = default;
};

enum class VideoRole : std::uint8_t { reference, target };
std::string_view video_role_name(VideoRole r);
VideoRole parse_video_role(std::string_view name);  // throws InvalidArgument

// (t, h, w) latent grid.
using LatentGrid = std::array<std::int64_t, 3>;

// One physical video-grid slice of packed document 0.
struct VideoTokenSpan {
  std::int64_t start = 0;
  LatentGrid latent_grid{0, 0, 0};
  VideoRole role = VideoRole::target;
  std::int64_t length() const { return latent_grid[0] * latent_grid[1] * latent_grid[2]; }
  bool operator==(const VideoTokenSpan&) const = default;
};

// Where video grids sit in a packed sequence (docs/semantics.md, "Video token layout and
// VIDEO_SPARSE"). Either the one-tail form (prefix_len + latent_grid) or the span form (used_len +
// video_spans). Plain integers.
struct VideoTokenLayout {
  std::optional<std::int64_t> prefix_len;
  std::optional<LatentGrid> latent_grid;
  std::optional<std::int64_t> used_len;
  std::vector<VideoTokenSpan> video_spans;

  // prefix_len + t*h*w (one-tail form) or used_len (span form).
  std::int64_t used_length() const;
  bool operator==(const VideoTokenLayout&) const = default;
};

// Mask-free view of structural suffix padding in a [real, pad] packing (docs/semantics.md, "Packed
// padding and prefix slicing"). cu_seqlens_q/k are the canonical [0, length] int32 views.
struct PackedPaddingMetadata {
  std::int64_t q_length = 0;
  std::int64_t kv_length = 0;
  TensorView cu_seqlens_q;
  TensorView cu_seqlens_k;
};

// What a mask producer promises about attn_mask (docs/semantics.md, "Masks").
enum class AttentionMaskMode : std::uint8_t { none, padding, arbitrary };
AttentionMaskMode parse_attention_mask_mode(std::string_view s);  // throws InvalidArgument
std::string_view attention_mask_mode_name(AttentionMaskMode m);

// Quantized KV storage policy (docs/semantics.md, "Paged KV"). None/"auto"/"float" are all
// `unquantized`.
enum class KvCacheDtype : std::uint8_t { unquantized, fp8, int8 };
KvCacheDtype parse_kv_cache_dtype(std::string_view s);  // throws InvalidArgument
std::string_view kv_cache_dtype_name(KvCacheDtype d);

enum class JointStrategy : std::uint8_t { front, rear };
JointStrategy parse_joint_strategy(std::string_view s);  // throws InvalidArgument
std::string_view joint_strategy_name(JointStrategy s);

// A value in the opaque per-backend slot.
using OptionValue = std::variant<bool, std::int64_t, double, std::string, TensorView>;
// Per-backend options. As a layer's construction options (AttentionConfig::backend_options)
// they are strict: a key the chosen backend does not declare (Backend::option_names) is
// InvalidArgument. In a call's extra.backend slot every backend ignores keys it does not know.
using BackendOptions = std::map<std::string, OptionValue, std::less<>>;

// A backend option's value written as text (the CLI's NAME:key=value, the C ABI's "key=value"
// strings): an integer, else a finite number, else true / false, else the string itself
// (surrounding whitespace trimmed).
OptionValue parse_option_value(std::string_view text);

// The seed's well-known `extra` keys as typed fields, plus the opaque slot.
struct Extra {
  std::optional<KvCacheDtype> kv_cache_dtype;
  std::optional<TensorView> cu_seqlens_q;  // int32 [docs + 1]
  std::optional<TensorView> cu_seqlens_k;  // int32 [docs + 1]
  std::optional<std::int64_t> max_seqlen_q;
  std::optional<std::int64_t> max_seqlen_k;
  std::optional<std::int64_t> valid_kv_length;
  std::optional<AttentionMaskMode> attention_mask_mode;
  std::optional<double> laser_input_scale;
  BackendOptions backend;  // opaque per-backend slot
};

using FullAttnSpans = std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>>;

struct AttentionMetadata {
  std::optional<TensorView> attn_mask;        // [B, Skv] bool, [B, Sq, Skv] or [B|1, H|1, Sq, Skv]
  std::optional<TensorView> joint_attn_mask;  // [B, J] bool
  std::optional<TensorView> joint_query;      // [B, J, Hq, D]
  std::optional<TensorView> joint_key;        // [B, J, Hkv, D]
  std::optional<TensorView> joint_value;      // [B, J, Hkv, Dv]
  JointStrategy joint_strategy = JointStrategy::front;
  Extra extra;
  // Piecewise mixed causal/full attention (docs/semantics.md, "Piecewise spans and query ranges").
  std::optional<FullAttnSpans> full_attn_spans;
  std::optional<std::vector<QueryRange>> query_ranges;
  // Global position of query row 0 / key row 0 (docs/semantics.md, "Positions and causality").
  // Defaults: Skv - Sq and 0.
  std::optional<std::int64_t> q_global_start;
  std::optional<std::int64_t> k_global_start;
  std::optional<VideoTokenLayout> video_layout;
  std::optional<PackedPaddingMetadata> packed_padding;
};

}  // namespace dattn
