// `dattn attend`: attention on real tensors. Reads Q, K, V (and optional masks, joint tokens,
// cu_seqlens, gate) from a safetensors file and the call's metadata from a JSON file, runs the
// Attention layer and writes `out` and `lse` to a safetensors file.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dattn/attention.hpp"
#include "dattn/errors.hpp"
#include "dattn/safetensors.hpp"
#include "workloads.hpp"

namespace dattn::cli {

namespace {

using i64 = std::int64_t;
using nlohmann::json;

// Tensors an input file must hold, and those it may hold besides.
constexpr std::array<std::string_view, 3> kRequiredTensors = {"q", "k", "v"};
constexpr std::array<std::string_view, 8> kOptionalTensors = {
    "attn_mask",       "joint_query",  "joint_key",    "joint_value",
    "joint_attn_mask", "cu_seqlens_q", "cu_seqlens_k", "gate"};

// Keys of the META JSON object.
constexpr std::array<std::string_view, 18> kMetaKeys = {
    "softmax_scale",       "causal",          "role",         "qkv_layout",
    "joint_strategy",      "max_seqlen_q",    "max_seqlen_k", "valid_kv_length",
    "attention_mask_mode", "full_attn_spans", "query_ranges", "q_global_start",
    "k_global_start",      "packed_padding",  "video_layout", "kv_cache_dtype",
    "laser_input_scale",   "backend_options"};

std::string joined(std::span<const std::string_view> names) {
  std::string s;
  for (std::string_view n : names) (s += s.empty() ? "" : ", ") += n;
  return s;
}

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

// The longest document of an int32 cu_seqlens tensor (0 when it is malformed: the layer then
// reports what is wrong with it).
i64 longest_document(const TensorView& cu) {
  if (cu.dtype() != DType::I32 || cu.ndim() != 1) return 0;
  i64 longest = 0;
  for (i64 d = 0; d + 1 < cu.size(0); ++d) {
    const auto* base = static_cast<const std::int32_t*>(cu.data());
    longest = std::max<i64>(longest, i64(base[(d + 1) * cu.stride(0)]) - base[d * cu.stride(0)]);
  }
  return longest;
}

json read_meta(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InvalidArgument("meta", path + ": cannot open the META file");
  try {
    json meta = json::parse(in);
    require_known_keys(meta, "", kMetaKeys);
    return meta;
  } catch (const json::exception& e) {
    throw InvalidArgument("meta", path + ": not valid JSON: " + e.what());
  }
}

// One `attend` call assembled from the input file and META.
struct AttendCall {
  AttentionConfig config;
  AttentionMetadata metadata;
  std::vector<Tensor> owned;  // tensors made here that the metadata points into
};

// Fills config.num_heads / num_kv_heads / head_size / dtype from Q and K.
void infer_shapes(const TensorView& q, const TensorView& k, AttentionConfig& config) {
  const int rank = config.qkv_layout == QkvLayout::THD ? 3 : 4;
  if (q.ndim() != rank || k.ndim() != rank)
    throw InvalidArgument("q", "layout " + std::string(qkv_layout_name(config.qkv_layout)) +
                                   " needs q and k of rank " + std::to_string(rank) + "; got q " +
                                   q.describe() + ", k " + k.describe());
  const int head_dim = config.qkv_layout == QkvLayout::BSHD ? 2 : 1;
  config.num_heads = q.size(head_dim);
  config.num_kv_heads = k.size(head_dim);
  config.head_size = q.size(rank - 1);
  config.dtype = q.dtype();
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

// Attaches the optional tensors of the input file to the metadata.
void attach_tensors(const SafetensorsFile& file, AttentionMetadata& m) {
  const auto optional_view = [&file](std::string_view name) -> std::optional<TensorView> {
    if (!file.contains(name)) return std::nullopt;
    return file.at(name).view();
  };
  m.attn_mask = optional_view("attn_mask");
  m.joint_query = optional_view("joint_query");
  m.joint_key = optional_view("joint_key");
  m.joint_value = optional_view("joint_value");
  m.joint_attn_mask = optional_view("joint_attn_mask");
  m.extra.cu_seqlens_q = optional_view("cu_seqlens_q");
  m.extra.cu_seqlens_k = optional_view("cu_seqlens_k");
  if (auto gate = optional_view("gate")) m.extra.backend["gate"] = *gate;
}

AttendCall assemble_call(const SafetensorsFile& file, const json& meta) {
  AttendCall call;
  attach_tensors(file, call.metadata);
  apply_meta(meta, call);
  // Without a qkv_layout key the rank decides: 4 = BSHD, 3 = THD.
  if (!meta.contains("qkv_layout") && file.at("q").view().ndim() == 3)
    call.config.qkv_layout = QkvLayout::THD;
  infer_shapes(file.at("q"), file.at("k"), call.config);
  Extra& extra = call.metadata.extra;
  // max_seqlen_* default to the longest document of the given cu_seqlens_*.
  if (extra.cu_seqlens_q && !extra.max_seqlen_q)
    extra.max_seqlen_q = longest_document(*extra.cu_seqlens_q);
  if (extra.cu_seqlens_k && !extra.max_seqlen_k)
    extra.max_seqlen_k = longest_document(*extra.cu_seqlens_k);
  return call;
}

void check_tensor_names(const SafetensorsFile& file, const std::string& path) {
  const auto known = [](std::string_view name) {
    return std::find(kRequiredTensors.begin(), kRequiredTensors.end(), name) !=
               kRequiredTensors.end() ||
           std::find(kOptionalTensors.begin(), kOptionalTensors.end(), name) !=
               kOptionalTensors.end();
  };
  for (const auto& [name, tensor] : file.tensors)
    if (!known(name))
      throw InvalidArgument("inputs", path + ": unknown tensor '" + name +
                                          "'; valid tensors: " + joined(kRequiredTensors) + ", " +
                                          joined(kOptionalTensors));
  for (std::string_view required : kRequiredTensors)
    if (!file.contains(required))
      throw InvalidArgument("inputs", path + ": tensor '" + std::string(required) +
                                          "' is missing; q, k and v are required");
}

// Writes a small random example: IN (q, k, v, attn_mask) at `path` and its META JSON next to
// it (`path` with extension .meta.json).
int write_example_inputs(const std::string& path) {
  Workload example;
  example.name = "example";
  example.batch = 2;
  example.query_rows = example.key_rows = 48;
  example.heads = 4;
  example.kv_heads = 2;
  example.head_size = 32;
  example.mask = WorkloadMask::key_padding;
  example.kept_rows = 40;
  const WorkloadInputs in = build_workload_inputs(example, DType::F32, 1);
  write_safetensors(path, {{"q", in.q.view()},
                           {"k", in.k.view()},
                           {"v", in.v.view()},
                           {"attn_mask", in.attn_mask.view()}});
  const std::string meta_path =
      std::filesystem::path(path).replace_extension(".meta.json").string();
  const json meta = {{"softmax_scale", 1.0 / std::sqrt(double(example.head_size))},
                     {"causal", false},
                     {"role", "self"},
                     {"attention_mask_mode", "padding"}};
  std::ofstream out(meta_path);
  out << meta.dump(2) << '\n';
  if (!out) throw InvalidArgument("example_inputs", meta_path + ": cannot write the META file");
  std::cout << "wrote " << path << " (q, k, v, attn_mask) and " << meta_path << "\n"
            << "try: dattn attend --inputs " << path << " --meta " << meta_path
            << " --out out.safetensors\n";
  return kExitOk;
}

}  // namespace

void add_attend_options(CLI::App& command, AttendOptions& options) {
  CLI::Option* inputs =
      command.add_option("--inputs,-i", options.inputs,
                         "safetensors file with " + joined(kRequiredTensors) +
                             " (BSHD, or THD when rank 3) and optionally " +
                             joined(kOptionalTensors) + " (gate goes to the backend options)");
  CLI::Option* meta =
      command.add_option("--meta,-m", options.meta,
                         "JSON object of call metadata: " + joined(kMetaKeys) +
                             " (max_seqlen_* default to the longest document of cu_seqlens_*)");
  CLI::Option* out = command.add_option("--out,-o", options.out,
                                        "safetensors file to write: out and lse (f32 [B, H, S])");
  CLI::Option* backend =
      command.add_option("--backend,-b", options.backend, "Backend name, or auto")
          ->capture_default_str();
  command
      .add_option("--example-inputs", options.example_inputs,
                  "Write a small random input file (q, k, v, attn_mask) and its META "
                  "(FILE with extension .meta.json), then exit")
      ->excludes(inputs)
      ->excludes(meta)
      ->excludes(out)
      ->excludes(backend);
}

int run_attend(const AttendOptions& options) {
  if (!options.example_inputs.empty()) return write_example_inputs(options.example_inputs);
  if (options.inputs.empty() || options.out.empty()) {
    std::cerr << "error: dattn attend needs --inputs FILE and --out FILE "
                 "(or --example-inputs FILE); see dattn attend --help\n";
    return kExitUsage;
  }
  const SafetensorsFile file = read_safetensors(options.inputs);
  check_tensor_names(file, options.inputs);
  const json meta = options.meta.empty() ? json::object() : read_meta(options.meta);
  AttendCall call = assemble_call(file, meta);
  call.config.backend = options.backend;
  call.config.prefix = "attend";
  const Attention layer(call.config);

  const auto start = std::chrono::steady_clock::now();
  const ForwardResult result =
      layer.forward(file.at("q"), file.at("k"), file.at("v"), call.metadata, /*want_lse=*/true);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  write_safetensors(options.out, {{"out", result.out.view()}, {"lse", result.lse->view()}},
                    {{"backend", layer.backend().name()}});
  std::cout << "wrote " << options.out << ": out " << result.out.view().describe() << ", lse "
            << result.lse->view().describe() << " (backend " << layer.backend().name() << ", "
            << seconds << " s)\n";
  return kExitOk;
}

}  // namespace dattn::cli
