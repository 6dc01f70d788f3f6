// `dattn bench`: every combination of workloads, backends and dtypes, best of N timed calls
// after a warm-up; a table, JSON lines (the keys of `dattn run --json`) or an SVG bar chart.
#include <algorithm>
#include <cstdint>
#include <exception>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>

#include "bar_chart.hpp"
#include "commands.hpp"
#include "dattn/errors.hpp"
#include "measurement.hpp"

namespace dattn::cli {

namespace {

// Bars of GFLOP/s grouped by workload, one colour per (backend, dtype, engine), each labelled
// with its percent of the peak of the engine that computed it (drawn as a dashed tick), or
// "n/a" where that engine has no peak (emulated engines, REFERENCE).
// The row's backend as the table and chart name it: NAME, or NAME:options.
std::string backend_label(const RunReport& r) {
  return r.backend_options.empty() ? r.backend : r.backend + ":" + r.backend_options;
}

std::string svg_chart(const std::vector<RunReport>& reports) {
  std::vector<ChartBar> bars;
  int threads = 0;
  for (const RunReport& r : reports) {
    std::ostringstream pct, tip;
    if (r.efficiency)
      pct << std::fixed << std::setprecision(0) << 100 * *r.efficiency << "%";
    else
      pct << "n/a";
    tip << backend_label(r) << " " << r.dtype << " on " << r.workload << " ("
        << (r.engine.empty() ? "no engine" : "engine " + r.engine) << "): " << std::fixed
        << std::setprecision(1) << r.gflops << " GFLOP/s, ";
    if (r.peak_gflops && r.efficiency)
      tip << 100 * *r.efficiency << "% of its " << r.peak_kind << " peak " << *r.peak_gflops;
    else
      tip << "no peak (" << r.no_peak << ")";
    tip << ", " << std::setprecision(4) << r.seconds << " s";
    const std::string series =
        backend_label(r) + " " + r.dtype + (r.engine.empty() ? "" : " (" + r.engine + ")");
    bars.push_back({r.workload, series, r.gflops, r.peak_gflops.value_or(0), pct.str(), tip.str()});
    threads = std::max(threads, r.threads);
  }
  const std::string title = "dattn bench: GFLOP/s on " + std::to_string(threads) +
                            " thread(s); labels: % of the computing engine's peak";
  return bar_chart(title, "GFLOP/s", bars).svg;
}

// GFLOP/s of a sparse backend count the work it does (the selected blocks); "sparsity" is the
// fraction of (query, key) pairs it skips and "vs_dense" its normwise error against dense
// attention. "engine" is the engine that computed the row and "peak%" its percent of that
// engine's peak ("-": an emulated engine, or a backend without engines).
void print_table(std::ostream& os, const std::vector<RunReport>& reports) {
  const bool sparse = std::any_of(reports.begin(), reports.end(),
                                  [](const RunReport& r) { return r.block_sparsity.has_value(); });
  int width = 14;
  for (const RunReport& r : reports) width = std::max(width, int(backend_label(r).size()) + 2);
  os << std::left << std::setw(18) << "workload" << std::setw(width) << "backend" << std::setw(6)
     << "dtype" << std::setw(22) << "engine" << std::right << std::setw(8) << "threads"
     << std::setw(11) << "seconds" << std::setw(10) << "GFLOP/s" << std::setw(8) << "peak%"
     << std::setw(13) << "max_rel_err";
  if (sparse) os << std::setw(10) << "sparsity" << std::setw(11) << "vs_dense";
  os << '\n';
  for (const RunReport& r : reports) {
    os << std::left << std::setw(18) << r.workload << std::setw(width) << backend_label(r)
       << std::setw(6) << r.dtype << std::setw(22) << (r.engine.empty() ? "-" : r.engine)
       << std::right << std::setw(8) << r.threads << std::setw(11) << std::setprecision(4)
       << std::fixed << r.seconds << std::setw(10) << std::setprecision(1) << r.gflops;
    if (r.efficiency)
      os << std::setw(7) << 100 * *r.efficiency << '%';
    else
      os << std::setw(8) << "-";
    os << std::setw(13) << std::scientific << std::setprecision(2);
    if (r.check)
      os << r.check->max_rel_err;
    else
      os << "-";
    if (sparse) {
      os << std::setw(9) << std::fixed << std::setprecision(1)
         << (r.block_sparsity ? 100 * *r.block_sparsity : 0.0) << '%' << std::setw(11)
         << std::scientific << std::setprecision(2);
      if (r.dense_rel_err)
        os << *r.dense_rel_err;
      else
        os << "-";
    }
    os << std::defaultfloat << '\n';
  }
}

}  // namespace

void add_bench_options(CLI::App& command, BenchOptions& options) {
  command.add_option("--workload,-w", options.workloads, "Workloads (repeatable; default small)");
  command.add_option("--backend,-b", options.backends,
                     "Backends (repeatable; default auto), each NAME or NAME:key=value,... with "
                     "backend options for that row only (e.g. sage:pv_dtype=int8; an integer "
                     "value is an integer, true/false a bool, else a string)");
  command.add_option("--dtype", options.dtypes, "Dtypes (repeatable; default f32)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  add_measure_options(command, options.measure);
  command.add_option("--reps", options.reps, "Timed calls per combination; the best counts")
      ->check(count_in(1, 1000000))
      ->capture_default_str();
  command.add_flag("--json", options.json, "One JSON object per line (the keys of run --json)");
  command.add_option("--svg", options.svg, "Also write a bar chart of GFLOP/s to this file");
}

int run_bench(const BenchOptions& options) {
  const std::vector<std::string> names =
      options.workloads.empty() ? std::vector<std::string>{"small"} : options.workloads;
  const std::vector<std::string> backends =
      options.backends.empty() ? std::vector<std::string>{"auto"} : options.backends;
  const std::vector<std::string> dtypes =
      options.dtypes.empty() ? std::vector<std::string>{"f32"} : options.dtypes;
  std::vector<Workload> chosen;
  for (const std::string& name : names) {
    const std::optional<Workload> w = workload_or_report(name, options.measure);
    if (!w) return kExitUsage;
    chosen.push_back(*w);
  }
  // Before any measurement: --isa / --compute-dtype with a backend that has no engines.
  std::vector<BackendSpec> specs;
  for (const std::string& backend : backends) specs.push_back(parse_backend_spec(backend));
  std::vector<std::string> spec_names;
  for (const BackendSpec& spec : specs) {
    check_engine_options(measurement_for(chosen.front(), options.measure), spec.name);
    spec_names.push_back(spec.name);
  }
  check_flag_options(measurement_for(chosen.front(), options.measure), spec_names);
  std::vector<RunReport> reports;
  for (const Workload& w : chosen)
    for (const std::string& dtype : dtypes)
      for (const BackendSpec& spec : specs) {
        Measurement m = measurement_for(w, options.measure);
        m.backend = spec.name;
        for (const auto& [key, value] : spec.parsed) m.backend_options[key] = value;
        const std::string backend =
            spec.options.empty() ? spec.name : spec.name + ":" + spec.options;
        m.dtype = parse_dtype(dtype).value_or(DType::F32);
        m.reps = options.reps;
        m.progress_prefix = "dattn bench: " + w.name + " " + dtype + " " + backend + ": ";
        reports.push_back(measure(m));
        reports.back().backend_options = spec.options;
        if (options.json) std::cout << to_json(reports.back()).dump() << std::endl;
      }
  if (!options.json) print_table(std::cout, reports);
  if (!options.svg.empty()) {
    std::ofstream f(options.svg);
    f << svg_chart(reports);
    if (!f) {
      std::cerr << "error: cannot write " << options.svg << '\n';
      return kExitError;
    }
  }
  return kExitOk;
}

}  // namespace dattn::cli
