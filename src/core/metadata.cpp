#include "dattn/metadata.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <exception>
#include <string>

#include "core/strings.hpp"
#include "dattn/errors.hpp"

namespace dattn {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

[[noreturn]] void bad_choice(std::string_view field, std::string_view value,
                             std::string_view valid) {
  throw InvalidArgument(std::string(field), std::string(field) + " = '" + std::string(value) +
                                                "' is not valid; valid: " + std::string(valid));
}

}  // namespace

OptionValue parse_option_value(std::string_view text) {
  const std::string value(detail::trimmed(text));
  std::size_t used = 0;
  try {
    const long long integer = std::stoll(value, &used);
    if (!value.empty() && used == value.size()) return std::int64_t(integer);
  } catch (const std::exception&) {
  }
  try {
    const double number = std::stod(value, &used);
    if (!value.empty() && used == value.size() && std::isfinite(number)) return number;
  } catch (const std::exception&) {
  }
  if (value == "true" || value == "false") return value == "true";
  return value;
}

std::string_view video_role_name(VideoRole r) {
  return r == VideoRole::reference ? "reference" : "target";
}

VideoRole parse_video_role(std::string_view name) {
  const std::string s = lower(name);
  if (s == "reference") return VideoRole::reference;
  if (s == "target") return VideoRole::target;
  bad_choice("video_spans.role", name, "reference, target");
}

std::int64_t VideoTokenLayout::used_length() const {
  if (used_len) return *used_len;
  if (prefix_len && latent_grid)
    return *prefix_len + (*latent_grid)[0] * (*latent_grid)[1] * (*latent_grid)[2];
  return 0;
}

AttentionMaskMode parse_attention_mask_mode(std::string_view s) {
  const std::string v = lower(s);
  if (v == "none") return AttentionMaskMode::none;
  if (v == "padding") return AttentionMaskMode::padding;
  if (v == "arbitrary") return AttentionMaskMode::arbitrary;
  bad_choice("attention_mask_mode", s, "none, padding, arbitrary");
}

std::string_view attention_mask_mode_name(AttentionMaskMode m) {
  switch (m) {
    case AttentionMaskMode::none:
      return "none";
    case AttentionMaskMode::padding:
      return "padding";
    case AttentionMaskMode::arbitrary:
      return "arbitrary";
  }
  return "?";
}

KvCacheDtype parse_kv_cache_dtype(std::string_view s) {
  const std::string v = lower(s);
  if (v.empty() || v == "none" || v == "auto" || v == "float") return KvCacheDtype::unquantized;
  if (v == "fp8" || v == "fp8_e4m3") return KvCacheDtype::fp8;
  if (v == "int8") return KvCacheDtype::int8;
  bad_choice("kv_cache_dtype", s, "none, auto, float, fp8, int8");
}

std::string_view kv_cache_dtype_name(KvCacheDtype d) {
  switch (d) {
    case KvCacheDtype::unquantized:
      return "auto";
    case KvCacheDtype::fp8:
      return "fp8";
    case KvCacheDtype::int8:
      return "int8";
  }
  return "?";
}

JointStrategy parse_joint_strategy(std::string_view s) {
  const std::string v = lower(s);
  if (v == "front") return JointStrategy::front;
  if (v == "rear") return JointStrategy::rear;
  bad_choice("joint_strategy", s, "front, rear");
}

std::string_view joint_strategy_name(JointStrategy s) {
  return s == JointStrategy::front ? "front" : "rear";
}

}  // namespace dattn
