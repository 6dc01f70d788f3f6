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
#include <span>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "attend_meta.hpp"
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
