// `dattn info`: what this machine offers and what every registered backend claims.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dattn/backend.hpp"
#include "dattn/capabilities.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/engines.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"
#include "dattn/threads.hpp"
#include "measurement.hpp"
#include "workloads.hpp"

namespace dattn::cli {

namespace {

using nlohmann::json;

// The reason validate_available() gives, or nullopt when the backend can run here.
std::optional<std::string> unavailable_reason(const Backend& backend) {
  try {
    backend.validate_available();
    return std::nullopt;
  } catch (const Error& e) {
    return std::string(e.what());
  }
}

// One capability's value: a bool, a list of names or numbers (null = any platform), or an
// object from platform to kv cache dtype names.
json capability_json(const CapabilityValue& value) {
  struct ToJson {
    json operator()(bool b) const { return b; }
    json operator()(const std::optional<std::vector<Platform>>& platforms) const {
      if (!platforms) return nullptr;
      json a = json::array();
      for (Platform p : *platforms) a.push_back(platform_name(p));
      return a;
    }
    json operator()(const std::vector<std::int64_t>& sizes) const { return sizes; }
    json operator()(const std::vector<DType>& dtypes) const {
      json a = json::array();
      for (DType t : dtypes) a.push_back(dtype_name(t));
      return a;
    }
    json operator()(const std::map<Platform, std::vector<KvCacheDtype>>& table) const {
      json o = json::object();
      for (const auto& [platform, dtypes] : table) {
        json a = json::array();
        for (KvCacheDtype k : dtypes) a.push_back(kv_cache_dtype_name(k));
        o[std::string(platform_name(platform))] = a;
      }
      return o;
    }
  };
  return std::visit(ToJson{}, value);
}

// Identity, availability and every capability of capability_table() under its name.
json backend_json(const Backend& b) {
  json j;
  j["name"] = b.name();
  j["description"] = b.description();
  j["priority"] = b.priority();
  const std::optional<std::string> reason = unavailable_reason(b);
  j["available"] = !reason.has_value();
  j["unavailable_reason"] = reason ? json(*reason) : json(nullptr);
  const std::optional<std::vector<std::string>> options = b.option_names();
  j["options"] = options ? json(*options) : json(nullptr);  // its backend options (strict)
  for (const Capability& c : capability_table())
    j[std::string(c.name)] = capability_json(c.read(b, nullptr));
  return j;
}

// DATTN_CPU_FEATURES as set (null when unset or blank): the mask the features are reported under.
json feature_mask_env() {
  const char* spec = std::getenv("DATTN_CPU_FEATURES");
  if (spec == nullptr ||
      std::string_view(spec).find_first_not_of(" \t\n\v\f\r") == std::string_view::npos)
    return nullptr;
  return std::string(spec);
}

json info_json(int threads, const PeakGflops& peak) {
  const CpuFeatures& cpu = cpu_features();
  json j;
  j["platform"] = platform_name(Platform::cpu);
  j["cpu"] = {{"brand", cpu.brand},
              {"vendor", cpu.vendor},
              {"logical_cpus", cpu.logical_cpus},
              {"l2_bytes", cpu.l2_bytes},
              {"features", cpu.names()},
              {"sve_bits", cpu.sve_bits},
              {"detected_features", detected_cpu_features().names()},
              {"feature_mask", feature_mask_env()}};
  // The never-silently-slow rule (dattn/engines.hpp): why automatic calls run far below this
  // CPU, or null.
  const std::optional<SimdShortfall> shortfall = simd_shortfall();
  j["far_below_cpu"] = shortfall ? json(shortfall->message) : json(nullptr);
  j["threads"] = threads;
  // Every kind of peak an engine is held to; null where not measured, with the reason.
  const auto rate = [](const std::optional<double>& x) { return x ? json(*x) : json(nullptr); };
  const auto why = [](const std::optional<double>& x, const std::string& reason) {
    return x ? json(nullptr) : json(reason);
  };
  j["peak_gflops"] = {{"f32_fma", peak.f32_fma},
                      {"bf16_dot", rate(peak.bf16_dot)},
                      {"bf16_dot_unavailable", why(peak.bf16_dot, peak.bf16_dot_unavailable)},
                      {"amx_bf16", rate(peak.amx_bf16)},
                      {"amx_bf16_unavailable", why(peak.amx_bf16, peak.amx_bf16_unavailable)},
                      {"int8_dot", rate(peak.int8_dot)},
                      {"int8_dot_isa", peak.int8_dot_isa},
                      {"int8_dot_unavailable", why(peak.int8_dot, peak.int8_dot_unavailable)},
                      {"int16_dot", rate(peak.int16_dot)},
                      {"int16_dot_isa", peak.int16_dot_isa},
                      {"int16_dot_unavailable", why(peak.int16_dot, peak.int16_dot_unavailable)},
                      {"amx_int8", rate(peak.amx_int8)},
                      {"amx_int8_unavailable", why(peak.amx_int8, peak.amx_int8_unavailable)},
                      {"isa", peak.isa},
                      {"threads", peak.threads},
                      {"affinity_cpus", affinity_cpus()}};
  // FLASH's engines (what DATTN_ISA and its isa option accept), in ladder order, each with the
  // kind of peak `run` and `bench` measure its efficiency against (null: none, e.g. emulated).
  j["engines"] = json::array();
  for (const EngineInfo& e : flash_engines()) {
    const std::string kind = peak_kind_of_engine(e.name);
    j["engines"].push_back({{"name", e.name},
                            {"rank", e.rank},
                            {"compute_dtype", e.compute_dtype},
                            {"emulated", e.emulated},
                            {"peak_kind", kind.empty() ? json(nullptr) : json(kind)},
                            {"available", !e.unavailable_reason.has_value()},
                            {"unavailable_reason",
                             e.unavailable_reason ? json(*e.unavailable_reason) : json(nullptr)}});
  }
  j["backends"] = json::array();
  for (const auto& backend : Registry::global().all())
    j["backends"].push_back(backend_json(*backend));
  j["workloads"] = workload_names();
  return j;
}

// A JSON value as a table cell: yes/no, "any", comma-separated lists, "key:list" entries
// separated by spaces ("none" when empty), numbers as printed.
std::string cell(const json& value) {
  if (value.is_boolean()) return value.get<bool>() ? "yes" : "no";
  if (value.is_null()) return "any";
  if (value.is_string()) return value.get<std::string>();
  if (value.is_array()) {
    if (value.empty()) return "any";
    std::string s;
    for (const json& item : value) s += (s.empty() ? "" : ",") + cell(item);
    return s;
  }
  if (value.is_object()) {
    if (value.empty()) return "none";
    std::string s;
    for (const auto& [key, item] : value.items())
      s += (s.empty() ? "" : " ") + key + ":" + cell(item);
    return s;
  }
  return value.dump();
}

void print_text(std::ostream& os, const json& info) {
  const auto label = [&os](const char* name) -> std::ostream& {
    return os << std::left << std::setw(14) << name << std::right;
  };
  label("platform") << info["platform"].get<std::string>() << '\n';
  label("cpu") << info["cpu"]["brand"].get<std::string>() << " ("
               << info["cpu"]["logical_cpus"].get<int>() << " logical CPUs)\n";
  label("features") << (info["cpu"]["features"].empty() ? "none" : cell(info["cpu"]["features"]));
  if (info["cpu"]["sve_bits"].get<int>() > 0)
    os << " (SVE at " << info["cpu"]["sve_bits"].get<int>() << " bits)";
  if (!info["cpu"]["feature_mask"].is_null())
    os << " (DATTN_CPU_FEATURES=" << info["cpu"]["feature_mask"].get<std::string>() << "; detected "
       << cell(info["cpu"]["detected_features"]) << ")";
  os << '\n';
  if (!info["far_below_cpu"].is_null())
    label("WARNING") << info["far_below_cpu"].get<std::string>() << '\n';
  label("threads") << info["threads"].get<int>() << '\n';
  label("peak timing") << info["peak_gflops"]["threads"].get<int>()
                       << " thread(s) timed together over one interval, at most the "
                       << info["peak_gflops"]["affinity_cpus"].get<int>()
                       << " CPU(s) this process may run on\n";
  // One line per kind of peak: the rate (or "none" and why) and the engines this CPU runs that
  // are held to it, e.g.
  //   peak GFLOP/s  204.1 f32 FMA (avx2+fma): engines portable, avx2
  //                 none bf16 dot (vdpbf16ps): this CPU lacks AVX512-BF16 (vdpbf16ps)
  const json& peak = info["peak_gflops"];
  const auto engines_of = [&info](const std::string& kind) {
    std::string names;
    for (const json& e : info["engines"])  // the ones this CPU runs
      if (e["peak_kind"] == kind && e["available"].get<bool>())
        names += (names.empty() ? "" : ", ") + e["name"].get<std::string>();
    return names;
  };
  const std::array<std::array<const char*, 2>, 6> kinds{
      {{"f32_fma", "f32 FMA"},
#if defined(__aarch64__)
       {"bf16_dot", "bf16 dot (BFDOT)"},
#else
       {"bf16_dot", "bf16 dot (vdpbf16ps)"},
#endif
       {"amx_bf16", "AMX tiles (tdpbf16ps)"},
       {"int8_dot", "int8 dot (GOP/s)"},
       {"int16_dot", "int16 dot (GOP/s)"},
       {"amx_int8", "AMX int8 tiles (tdpbssd, GOP/s)"}}};
  for (std::size_t n = 0; n < kinds.size(); ++n) {
    const std::string kind = kinds[n][0];
    label(n == 0 ? "peak GFLOP/s" : "");
    if (peak[kind].is_null()) {
      os << "none " << kinds[n][1] << ": " << peak[kind + "_unavailable"].get<std::string>();
    } else {
      os << std::fixed << std::setprecision(1) << peak[kind].get<double>() << std::defaultfloat
         << ' ' << kinds[n][1];
      if (kind == "f32_fma") os << " (" << peak["isa"].get<std::string>() << ")";
      if (kind == "int8_dot" || kind == "int16_dot")
        os << " (" << peak[kind + "_isa"].get<std::string>() << ")";
      const std::string names = engines_of(kind);
      os << ": "
         << (names.empty()                          ? "no engine uses it yet"
             : names.find(',') == std::string::npos ? "engine " + names
                                                    : "engines " + names);
    }
    os << '\n';
  }
  // e.g. "portable, avx2, avx512 (unavailable), avx512_bf16 (bf16, unavailable), ..."
  std::string engines;
  for (const json& e : info["engines"]) {
    std::string notes;
    if (e["compute_dtype"].get<std::string>() != "f32")
      notes += e["compute_dtype"].get<std::string>();
    if (e["emulated"].get<bool>()) notes += std::string(notes.empty() ? "" : ", ") + "emulated";
    if (!e["available"].get<bool>())
      notes += std::string(notes.empty() ? "" : ", ") + "unavailable";
    engines += (engines.empty() ? "" : ", ") + e["name"].get<std::string>() +
               (notes.empty() ? "" : " (" + notes + ")");
  }
  label("engines") << engines << '\n';
  label("workloads") << cell(info["workloads"]) << "\n\n";

  // One row per capability (capability_table()), one column per backend.
  std::vector<std::string> rows{"priority", "available"};
  for (const Capability& c : capability_table()) rows.emplace_back(c.name);
  const json& backends = info["backends"];
  std::size_t label_width = std::string_view("backend").size();
  for (const std::string& row : rows) label_width = std::max(label_width, row.size());
  std::vector<std::size_t> widths;
  for (const json& b : backends) {
    std::size_t w = b["name"].get<std::string>().size();
    for (const std::string& row : rows) w = std::max(w, cell(b[row]).size());
    widths.push_back(w);
  }
  const auto print_row = [&](std::string_view name, auto&& value_of) {
    os << std::left << std::setw(int(label_width)) << name;
    for (std::size_t i = 0; i < backends.size(); ++i) {
      const bool last = i + 1 == backends.size();  // no trailing spaces
      os << "  " << std::setw(last ? 0 : int(widths[i])) << value_of(backends[i]);
    }
    os << std::right << '\n';
  };
  print_row("backend", [](const json& b) { return b["name"].get<std::string>(); });
  for (const std::string& row : rows)
    print_row(row, [&row](const json& b) { return cell(b[row]); });
  os << '\n';
  for (const json& b : backends) {
    os << b["name"].get<std::string>() << ": " << b["description"].get<std::string>() << '\n';
    if (!b["unavailable_reason"].is_null())
      os << "  unavailable: " << b["unavailable_reason"].get<std::string>() << '\n';
    if (b["options"].is_array()) {
      std::string names;
      for (const json& n : b["options"])
        names += (names.empty() ? "" : ", ") + n.get<std::string>();
      os << "  options: " << (names.empty() ? std::string("none") : names) << '\n';
    }
  }
}

}  // namespace

void add_info_options(CLI::App& command, InfoOptions& options) {
  command.add_flag("--json", options.json, "Print one JSON object");
  command
      .add_option("--threads,-t", options.threads,
                  "Threads for the peak measurement, 1 to " + std::to_string(kMaxThreads))
      ->check(count_in(1, kMaxThreads));
}

int run_info(const InfoOptions& options) {
  if (options.threads > 0) omp_set_num_threads(options.threads);
  const int threads = default_threads();
  const json info = info_json(threads, measure_peak_gflops(threads));
  if (options.json)
    std::cout << info.dump() << '\n';
  else
    print_text(std::cout, info);
  return kExitOk;
}

}  // namespace dattn::cli
