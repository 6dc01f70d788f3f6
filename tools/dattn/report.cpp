#include "report.hpp"

#include <cmath>
#include <iomanip>

namespace dattn::cli {

namespace {

// JSON has no NaN or infinity; nlohmann would write null anyway, say so explicitly.
nlohmann::json finite_or_null(double x) {
  return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr);
}

}  // namespace

nlohmann::json to_json(const RunReport& r) {
  nlohmann::json j;
  j["backend"] = r.backend;
  if (!r.backend_options.empty()) j["backend_options"] = r.backend_options;
  j["selection"] = r.selection;
  j["workload"] = r.workload;
  j["layout"] = r.layout;
  j["dtype"] = r.dtype;
  j["threads"] = r.threads;
  j["seed"] = r.seed;
  j["reps"] = r.reps;
  j["shape"] = {{"B", r.shape.batch}, {"Sq", r.shape.sq}, {"Skv", r.shape.skv}, {"Hq", r.shape.hq},
                {"Hkv", r.shape.hkv}, {"D", r.shape.d},   {"J", r.shape.joint}};
  j["flops"] = r.flops;
  j["seconds"] = r.seconds;
  j["gflops"] = finite_or_null(r.gflops);
  const auto opt = [](const std::optional<double>& x) {
    return x ? finite_or_null(*x) : nlohmann::json(nullptr);
  };
  const auto name = [](const std::string& s) {
    return s.empty() ? nlohmann::json(nullptr) : nlohmann::json(s);
  };
  j["engine"] = name(r.engine);
  j["peak_kind"] = name(r.peak_kind);
  j["peak_gflops"] = opt(r.peak_gflops);
  j["efficiency"] = opt(r.efficiency);
  j["checked_rows"] = r.check ? r.check->rows : 0;
  j["max_abs_err"] = r.check ? finite_or_null(r.check->max_abs_err) : nlohmann::json(nullptr);
  j["max_rel_err"] = r.check ? finite_or_null(r.check->max_rel_err) : nlohmann::json(nullptr);
  j["checked_against"] = r.checked_against;
  j["signal"] = r.signal;
  j["block_sparsity"] =
      r.block_sparsity ? nlohmann::json(*r.block_sparsity) : nlohmann::json(nullptr);
  j["dense_rel_err"] = r.dense_rel_err ? finite_or_null(*r.dense_rel_err) : nlohmann::json(nullptr);
  j["dense_flops"] = r.dense_flops;
  j["kv_dtype"] = r.kv_dtype.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.kv_dtype);
  j["kv_cache_bytes"] = opt(r.kv_cache_bytes);
  j["kv_f32_bytes"] = opt(r.kv_f32_bytes);
  j["kv_rel_err"] = opt(r.kv_rel_err);
  j["page_block"] = r.page_block;
  j["page_dtype"] = r.page_dtype.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.page_dtype);
  j["recompute_seconds"] = opt(r.recompute_seconds);
  j["parallel"] = r.parallel;
  j["ranks"] = r.ranks;
  j["bytes_sent"] = opt(r.bytes_sent);
  j["selection_seconds"] =
      r.selection_seconds ? nlohmann::json(*r.selection_seconds) : nlohmann::json(nullptr);
  return j;
}

void print_text(std::ostream& os, const RunReport& r) {
  const auto label = [&os](const char* name) -> std::ostream& {
    return os << "  " << std::left << std::setw(12) << name << std::right;
  };
  os << "workload " << r.workload << " on " << r.backend << " (" << r.selection << ")\n";
  label("shape") << "B " << r.shape.batch << ", Sq " << r.shape.sq << ", Skv " << r.shape.skv
                 << ", Hq " << r.shape.hq << ", Hkv " << r.shape.hkv << ", D " << r.shape.d
                 << ", J " << r.shape.joint << " (" << r.layout << ")\n";
  label("dtype") << r.dtype << ", " << r.threads << " thread(s), seed " << r.seed << '\n';
  if (r.ranks > 1 || r.parallel != "none") {
    label("parallel") << r.parallel << " over " << r.ranks << " processes of " << r.threads
                      << " thread(s)";
    if (r.bytes_sent)
      os << ", " << std::fixed << std::setprecision(2) << *r.bytes_sent / 1048576.0
         << " MiB sent per rank per call" << std::defaultfloat;
    os << '\n';
  }
  label("time") << std::fixed << std::setprecision(4) << r.seconds << " s for "
                << std::setprecision(3) << r.flops * 1e-9 << " GFLOP\n";
  label("rate") << std::setprecision(2) << r.gflops << " GFLOP/s";
  if (r.peak_gflops && r.efficiency)
    os << " of " << *r.peak_gflops << " peak (" << r.peak_kind << "): " << std::setprecision(2)
       << 100.0 * *r.efficiency << "% efficiency\n";
  else
    os << ", no peak to compare with (" << r.no_peak << ")\n";
  label("engine") << (r.engine.empty() ? "none" : r.engine) << '\n';
  if (r.check) {
    label("accuracy") << std::scientific << std::setprecision(3) << "max abs err "
                      << r.check->max_abs_err << ", max rel err " << r.check->max_rel_err
                      << " over " << r.check->rows << " rows checked against " << r.checked_against
                      << '\n';
  } else {
    label("accuracy") << "not checked (--check-rows 0)\n";
  }
  if (r.page_block > 0)
    label("paged") << "pages of " << r.page_block << " tokens, " << r.page_dtype
                   << ", shuffled block tables\n";
  if (!r.kv_dtype.empty()) {
    label("kv cache") << r.kv_dtype;
    if (r.kv_cache_bytes)
      os << ": " << std::fixed << std::setprecision(1) << *r.kv_cache_bytes / 1048576.0
         << " MiB (f32: " << *r.kv_f32_bytes / 1048576.0 << " MiB)";
    if (r.kv_rel_err)
      os << ", " << std::scientific << std::setprecision(3) << *r.kv_rel_err
         << " normwise relative error against f32 K/V";
    os << '\n' << std::defaultfloat;
  }
  if (r.recompute_seconds)
    label("reuse") << std::fixed << std::setprecision(4) << r.seconds
                   << " s per step with the cached prefix, " << *r.recompute_seconds
                   << " s recomputing every row (" << std::setprecision(3)
                   << r.seconds / *r.recompute_seconds << "x)\n"
                   << std::defaultfloat;
  if (r.block_sparsity) {
    label("sparsity") << std::fixed << std::setprecision(2) << 100.0 * *r.block_sparsity
                      << "% of the (query, key) pairs skipped; " << std::setprecision(3)
                      << r.dense_flops * 1e-9 << " GFLOP dense";
    if (r.selection_seconds)
      os << "; tiling + selection " << std::setprecision(4) << *r.selection_seconds << " s ("
         << std::setprecision(1) << 100.0 * *r.selection_seconds / r.seconds << "% of the call)";
    os << '\n';
    label("vs dense");
    if (r.dense_rel_err)
      os << std::scientific << std::setprecision(3) << *r.dense_rel_err
         << " normwise relative error against dense attention (" << r.signal << " inputs)\n";
    else
      os << "not measured\n";
  }
  os << std::defaultfloat;
}

}  // namespace dattn::cli
