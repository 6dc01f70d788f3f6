// `dattn bench`: every combination of workloads, backends and dtypes, best of N timed calls
// after a warm-up; a table, JSON lines (the keys of `dattn run --json`) or an SVG bar chart.
#include <algorithm>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "commands.hpp"
#include "measurement.hpp"

namespace dattn::cli {

namespace {

std::string escape_xml(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// Bars of GFLOP/s, one group per (workload, dtype), one bar per backend, each labelled with its
// percent of the machine's peak; the peak is drawn as a dashed line per group.
std::string svg_chart(const std::vector<RunReport>& reports) {
  struct Group {
    std::string label;
    double peak = 0;
    std::vector<const RunReport*> bars;
  };
  std::vector<Group> groups;
  std::vector<std::string> backends;
  double top = 1;
  for (const RunReport& r : reports) {
    const std::string label = r.workload + " " + r.dtype;
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const Group& g) { return g.label == label; });
    if (it == groups.end()) it = groups.insert(groups.end(), Group{label, r.peak_gflops, {}});
    it->bars.push_back(&r);
    it->peak = std::max(it->peak, r.peak_gflops);
    if (std::find(backends.begin(), backends.end(), r.backend) == backends.end())
      backends.push_back(r.backend);
    top = std::max({top, r.gflops, r.peak_gflops});
  }
  const char* colours[] = {"#3465a4", "#f57900", "#4e9a06", "#75507b", "#c4a000", "#cc0000"};
  const int bar = 36, gap = 30, left = 70, chart_h = 300, top_margin = 40;
  std::size_t most = 1;
  for (const Group& g : groups) most = std::max(most, g.bars.size());
  const int group_w = int(most) * bar + gap;
  const int width = left + int(groups.size()) * group_w + 160;
  const int height = top_margin + chart_h + 80;
  const auto y_of = [&](double v) { return top_margin + chart_h - int(v / top * chart_h); };
  std::ostringstream os;
  os << std::fixed << std::setprecision(1);
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
     << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
     << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
     << "<text x=\"" << left
     << "\" y=\"20\" font-size=\"15\">dattn bench: GFLOP/s (label: % of "
        "measured peak; dashed: peak)</text>\n";
  for (int t = 0; t <= 4; ++t) {
    const double v = top * t / 4;
    os << "<line x1=\"" << left << "\" x2=\"" << width - 150 << "\" y1=\"" << y_of(v) << "\" y2=\""
       << y_of(v) << "\" stroke=\"#ddd\"/>\n<text x=\"" << left - 8 << "\" y=\"" << y_of(v) + 4
       << "\" text-anchor=\"end\">" << v << "</text>\n";
  }
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const Group& g = groups[gi];
    const int x0 = left + int(gi) * group_w + gap / 2;
    for (std::size_t bi = 0; bi < g.bars.size(); ++bi) {
      const RunReport& r = *g.bars[bi];
      const auto colour = std::find(backends.begin(), backends.end(), r.backend) - backends.begin();
      const int x = x0 + int(bi) * bar;
      os << "<rect x=\"" << x << "\" y=\"" << y_of(r.gflops) << "\" width=\"" << bar - 4
         << "\" height=\"" << top_margin + chart_h - y_of(r.gflops) << "\" fill=\""
         << colours[colour % 6] << "\"><title>" << escape_xml(r.backend + " " + g.label)
         << "</title></rect>\n<text x=\"" << x + (bar - 4) / 2 << "\" y=\"" << y_of(r.gflops) - 4
         << "\" text-anchor=\"middle\" font-size=\"10\">" << 100 * r.efficiency << "%</text>\n";
    }
    os << "<line x1=\"" << x0 - 4 << "\" x2=\"" << x0 + int(g.bars.size()) * bar << "\" y1=\""
       << y_of(g.peak) << "\" y2=\"" << y_of(g.peak)
       << "\" stroke=\"#555\" stroke-dasharray=\"4 3\"/>\n<text x=\"" << x0 << "\" y=\""
       << top_margin + chart_h + 16 << "\">" << escape_xml(g.label) << "</text>\n";
  }
  for (std::size_t bi = 0; bi < backends.size(); ++bi)
    os << "<rect x=\"" << width - 140 << "\" y=\"" << top_margin + 20 * int(bi)
       << "\" width=\"12\" height=\"12\" fill=\"" << colours[bi % 6] << "\"/>\n<text x=\""
       << width - 122 << "\" y=\"" << top_margin + 20 * int(bi) + 11 << "\">"
       << escape_xml(backends[bi]) << "</text>\n";
  os << "</svg>\n";
  return os.str();
}

// GFLOP/s of a sparse backend count the work it does (the selected blocks); "sparsity" is the
// fraction of (query, key) pairs it skips and "vs_dense" its normwise error against dense
// attention.
void print_table(std::ostream& os, const std::vector<RunReport>& reports) {
  const bool sparse = std::any_of(reports.begin(), reports.end(),
                                  [](const RunReport& r) { return r.block_sparsity.has_value(); });
  os << std::left << std::setw(18) << "workload" << std::setw(14) << "backend" << std::setw(6)
     << "dtype" << std::right << std::setw(8) << "threads" << std::setw(11) << "seconds"
     << std::setw(10) << "GFLOP/s" << std::setw(8) << "peak%" << std::setw(13) << "max_rel_err";
  if (sparse) os << std::setw(10) << "sparsity" << std::setw(11) << "vs_dense";
  os << '\n';
  for (const RunReport& r : reports) {
    os << std::left << std::setw(18) << r.workload << std::setw(14) << r.backend << std::setw(6)
       << r.dtype << std::right << std::setw(8) << r.threads << std::setw(11)
       << std::setprecision(4) << std::fixed << r.seconds << std::setw(10) << std::setprecision(1)
       << r.gflops << std::setw(7) << 100 * r.efficiency << '%' << std::setw(13) << std::scientific
       << std::setprecision(2);
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
  command.add_option("--backend,-b", options.backends, "Backends (repeatable; default auto)");
  command.add_option("--dtype", options.dtypes, "Dtypes (repeatable; default f32)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  add_measure_options(command, options.measure);
  command.add_option("--reps", options.reps, "Timed calls per combination; the best counts")
      ->check(CLI::PositiveNumber)
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
  std::vector<RunReport> reports;
  for (const Workload& w : chosen)
    for (const std::string& dtype : dtypes)
      for (const std::string& backend : backends) {
        Measurement m = measurement_for(w, options.measure);
        m.backend = backend;
        m.dtype = parse_dtype(dtype).value_or(DType::F32);
        m.reps = options.reps;
        m.progress_prefix = "dattn bench: " + w.name + " " + dtype + " " + backend + ": ";
        reports.push_back(measure(m));
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
