#include "attend_meta.hpp"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "dattn/errors.hpp"

namespace dattn::cli {

using i64 = std::int64_t;
using nlohmann::json;

std::string joined(std::span<const std::string_view> names) {
  std::string s;
  for (std::string_view n : names) (s += s.empty() ? "" : ", ") += n;
  return s;
}

namespace {

[[noreturn]] void invalid_meta(std::string_view key, const std::string& message) {
  throw InvalidArgument(std::string(key), "META " + std::string(key) + ": " + message);
}

// Throws naming the first key of `object` (at META `where`) that is not in `valid`.
void require_known_keys(const json& object, std::string_view where,
                        std::span<const std::string_view> valid) {
  if (!object.is_object()) invalid_meta(where, "must be a JSON object, got " + object.dump());
  for (const auto& [key, value] : object.items())
    if (std::find(valid.begin(), valid.end(), key) == valid.end())
      invalid_meta(where.empty() ? key : std::string(where) + "." + key,
                   "unknown key; valid keys: " + joined(valid));
}

i64 as_int(const json& value, std::string_view key) {
  if (!value.is_number_integer() ||
      (value.is_number_unsigned() &&
       value.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<i64>::max())))
    invalid_meta(key, "must be an integer, got " + value.dump());
  return value.get<i64>();
}

double as_number(const json& value, std::string_view key) {
  if (!value.is_number()) invalid_meta(key, "must be a number, got " + value.dump());
  return value.get<double>();
}

bool as_bool(const json& value, std::string_view key) {
  if (!value.is_boolean()) invalid_meta(key, "must be true or false, got " + value.dump());
  return value.get<bool>();
}

std::string as_string(const json& value, std::string_view key) {
  if (!value.is_string()) invalid_meta(key, "must be a string, got " + value.dump());
  return value.get<std::string>();
}

// An array of exactly `n` integers.
std::vector<i64> as_ints(const json& value, std::size_t n, std::string_view key) {
  if (!value.is_array() || value.size() != n)
    invalid_meta(key,
                 "must be an array of " + std::to_string(n) + " integers, got " + value.dump());
  std::vector<i64> ints;
  for (const json& v : value) ints.push_back(as_int(v, key));
  return ints;
}

LatentGrid as_grid(const json& value, std::string_view key) {
  const std::vector<i64> g = as_ints(value, 3, key);
  return {g[0], g[1], g[2]};
}

// [[[a, e], ...] per sample]
FullAttnSpans as_full_attn_spans(const json& value) {
  constexpr std::string_view key = "full_attn_spans";
  if (!value.is_array()) invalid_meta(key, "must be a list (per sample) of lists of [a, e] spans");
  FullAttnSpans spans;
  for (const json& sample : value) {
    if (!sample.is_array()) invalid_meta(key, "each sample must be a list of [a, e] spans");
    auto& list = spans.emplace_back();
    for (const json& span : sample) {
      const std::vector<i64> ae = as_ints(span, 2, key);
      list.emplace_back(ae[0], ae[1]);
    }
  }
  return spans;
}

// [[local_start, local_end, global_start], ...]
std::vector<QueryRange> as_query_ranges(const json& value) {
  constexpr std::string_view key = "query_ranges";
  if (!value.is_array()) invalid_meta(key, "must be a list of [local_start, local_end, global]");
  std::vector<QueryRange> ranges;
  for (const json& r : value) {
    const std::vector<i64> t = as_ints(r, 3, key);
    ranges.push_back({t[0], t[1], t[2]});
  }
  return ranges;
}

// {prefix_len, latent_grid} or {used_len, video_spans: [{start, latent_grid, role}]}
VideoTokenLayout as_video_layout(const json& value) {
  static constexpr std::array<std::string_view, 4> kKeys = {"prefix_len", "latent_grid", "used_len",
                                                            "video_spans"};
  static constexpr std::array<std::string_view, 3> kSpanKeys = {"start", "latent_grid", "role"};
  require_known_keys(value, "video_layout", kKeys);
  VideoTokenLayout layout;
  if (value.contains("prefix_len"))
    layout.prefix_len = as_int(value["prefix_len"], "video_layout.prefix_len");
  if (value.contains("latent_grid"))
    layout.latent_grid = as_grid(value["latent_grid"], "video_layout.latent_grid");
  if (value.contains("used_len"))
    layout.used_len = as_int(value["used_len"], "video_layout.used_len");
  if (value.contains("video_spans")) {
    const json& spans = value["video_spans"];
    if (!spans.is_array()) invalid_meta("video_layout.video_spans", "must be a list of spans");
    for (const json& s : spans) {
      require_known_keys(s, "video_layout.video_spans[]", kSpanKeys);
      VideoTokenSpan span;
      if (!s.contains("start") || !s.contains("latent_grid"))
        invalid_meta("video_layout.video_spans[]", "needs start and latent_grid, got " + s.dump());
      span.start = as_int(s["start"], "video_layout.video_spans[].start");
      span.latent_grid = as_grid(s["latent_grid"], "video_layout.video_spans[].latent_grid");
      if (s.contains("role"))
        span.role = parse_video_role(as_string(s["role"], "video_layout.video_spans[].role"));
      layout.video_spans.push_back(span);
    }
  }
  return layout;
}

// A scalar JSON value as a backend option.
OptionValue as_option(const json& value, std::string_view key) {
  if (value.is_boolean()) return value.get<bool>();
  if (value.is_number_integer()) return as_int(value, key);
  if (value.is_number()) return value.get<double>();
  if (value.is_string()) return value.get<std::string>();
  invalid_meta(key, "must be a boolean, number or string, got " + value.dump());
}

// An int32 [0, length] tensor: the canonical cu_seqlens of a [real, pad] packing.
Tensor single_document_cu_seqlens(i64 length, std::string_view key) {
  if (length < 0 || length > std::numeric_limits<std::int32_t>::max())
    invalid_meta(key, std::to_string(length) + " is outside [0, 2147483647]");
  Tensor t = Tensor::empty({2}, DType::I32);
  t.data_as<std::int32_t>()[0] = 0;
  t.data_as<std::int32_t>()[1] = static_cast<std::int32_t>(length);
  return t;
}

}  // namespace

json parse_meta(std::string_view text, const std::string& origin) {
  // A key given twice in one object is an error (JSON's parsers keep the last one silently).
  std::vector<std::set<std::string>> objects;  // the keys of each object open at this point
  const json::parser_callback_t unique_keys = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!objects.empty()) objects.pop_back();
    } else if (event == json::parse_event_t::key && !objects.empty()) {
      const std::string key = parsed.get<std::string>();
      if (!objects.back().insert(key).second)
        throw InvalidArgument(
            key, origin + ": key '" + key + "' is given twice in one object; give each key once");
    }
    return true;
  };
  try {
    json meta = json::parse(text.begin(), text.end(), unique_keys);
    require_known_keys(meta, "", kMetaKeys);
    return meta;
  } catch (const json::exception& e) {
    throw InvalidArgument("meta", origin + ": not valid JSON: " + e.what());
  }
}

json read_meta(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument("meta", path + ": cannot open the META file");
  const std::string text{std::istreambuf_iterator<char>(in), {}};
  return parse_meta(text, path);
}

void apply_meta(const json& meta, AttendCall& call) {
  AttentionConfig& config = call.config;
  AttentionMetadata& m = call.metadata;
  Extra& extra = m.extra;
  for (const auto& [key, value] : meta.items()) {
    if (key == "softmax_scale") {
      config.softmax_scale = as_number(value, key);
    } else if (key == "causal") {
      config.causal = as_bool(value, key);
    } else if (key == "role") {
      config.role = parse_attention_role(as_string(value, key));
    } else if (key == "qkv_layout") {
      config.qkv_layout = parse_qkv_layout(as_string(value, key));
    } else if (key == "joint_strategy") {
      m.joint_strategy = parse_joint_strategy(as_string(value, key));
    } else if (key == "max_seqlen_q") {
      extra.max_seqlen_q = as_int(value, key);
    } else if (key == "max_seqlen_k") {
      extra.max_seqlen_k = as_int(value, key);
    } else if (key == "valid_kv_length") {
      extra.valid_kv_length = as_int(value, key);
    } else if (key == "attention_mask_mode") {
      extra.attention_mask_mode = parse_attention_mask_mode(as_string(value, key));
    } else if (key == "full_attn_spans") {
      m.full_attn_spans = as_full_attn_spans(value);
    } else if (key == "query_ranges") {
      m.query_ranges = as_query_ranges(value);
    } else if (key == "q_global_start") {
      m.q_global_start = as_int(value, key);
    } else if (key == "k_global_start") {
      m.k_global_start = as_int(value, key);
    } else if (key == "packed_padding") {
      static constexpr std::array<std::string_view, 2> kKeys = {"q_length", "kv_length"};
      require_known_keys(value, key, kKeys);
      if (!value.contains("q_length") || !value.contains("kv_length"))
        invalid_meta(key, "needs q_length and kv_length, got " + value.dump());
      PackedPaddingMetadata padding;
      padding.q_length = as_int(value["q_length"], "packed_padding.q_length");
      padding.kv_length = as_int(value["kv_length"], "packed_padding.kv_length");
      const Tensor cu_q = single_document_cu_seqlens(padding.q_length, "packed_padding.q_length");
      const Tensor cu_k = single_document_cu_seqlens(padding.kv_length, "packed_padding.kv_length");
      call.owned.insert(call.owned.end(), {cu_q, cu_k});  // copies share the storage
      padding.cu_seqlens_q = cu_q.view();
      padding.cu_seqlens_k = cu_k.view();
      m.packed_padding = padding;
    } else if (key == "video_layout") {
      m.video_layout = as_video_layout(value);
    } else if (key == "kv_cache_dtype") {
      const KvCacheDtype dtype = parse_kv_cache_dtype(as_string(value, key));
      config.kv_cache_dtype = dtype;
      extra.kv_cache_dtype = dtype;
    } else if (key == "laser_input_scale") {
      extra.laser_input_scale = as_number(value, key);
    } else if (key == "backend_options") {
      if (!value.is_object()) invalid_meta(key, "must be an object of scalars");
      for (const auto& [name, option] : value.items()) {
        const OptionValue v = as_option(option, "backend_options." + name);
        extra.backend[name] = v;
        config.backend_options[name] = v;
      }
    }
  }
}

}  // namespace dattn::cli
