// META of `dattn attend`: a JSON object of call metadata, read into the AttentionConfig and
// AttentionMetadata of one call; a library of its own so that tests/fuzz can drive the reader.
#pragma once

#include <array>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "dattn/attention.hpp"
#include "dattn/metadata.hpp"
#include "dattn/tensor.hpp"

namespace dattn::cli {

// Keys of the META JSON object.
inline constexpr std::array<std::string_view, 18> kMetaKeys = {
    "softmax_scale",       "causal",          "role",         "qkv_layout",
    "joint_strategy",      "max_seqlen_q",    "max_seqlen_k", "valid_kv_length",
    "attention_mask_mode", "full_attn_spans", "query_ranges", "q_global_start",
    "k_global_start",      "packed_padding",  "video_layout", "kv_cache_dtype",
    "laser_input_scale",   "backend_options"};

// One `attend` call assembled from the input file and META.
struct AttendCall {
  AttentionConfig config;
  AttentionMetadata metadata;
  std::vector<Tensor> owned;  // tensors made here that the metadata points into
};

// "a, b, c"
std::string joined(std::span<const std::string_view> names);

// Parses META text read from `origin` (named in errors): a JSON object whose keys are all in
// kMetaKeys. Throws InvalidArgument: field "meta" for text that is not JSON, or the first unknown
// key.
nlohmann::json parse_meta(std::string_view text, const std::string& origin);

// Reads and parses the META file at `path`, as parse_meta.
nlohmann::json read_meta(const std::string& path);

// Sets the fields of `call` that the keys of `meta` (as parse_meta returns it) name. Throws
// InvalidArgument naming the key for a value of the wrong type, range or name.
void apply_meta(const nlohmann::json& meta, AttendCall& call);

}  // namespace dattn::cli
