// `dattn traffic`: the bytes each sequence-parallel strategy sends per attention call (one layer)
// for the workloads' shapes at several rank counts, from parallel_bytes_sent (which the tests
// check against the bytes the strategies really move).
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "dattn/errors.hpp"
#include "dattn/parallel.hpp"
#include "measurement.hpp"

namespace dattn::cli {

void add_traffic_options(CLI::App& command, TrafficOptions& options) {
  command.add_option("--workload,-w", options.workloads,
                     "Workloads (default: flux-1024, wan-480p, hunyuan-720p)");
  command.add_option("--ranks", options.ranks, "Rank counts")
      ->delimiter(',')
      ->check(count_in(1, 65536))
      ->capture_default_str();
  command.add_option("--dtype", options.dtype, "Element type of Q, K, V and the output")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  command.add_flag("--json", options.json, "Print one JSON object per line");
}

int run_traffic(const TrafficOptions& options) {
  std::vector<std::string> names = options.workloads;
  if (names.empty()) names = {"flux-1024", "wan-480p", "hunyuan-720p"};
  const DType dtype = parse_dtype(options.dtype).value_or(DType::BF16);
  std::vector<const Workload*> chosen;  // every name checked before anything is printed
  for (const std::string& name : names) {
    const Workload* w = find_workload(name);
    if (w == nullptr) {
      std::cerr << "error: unknown workload '" << Error::bounded(name, 80)
                << "'; valid workloads:\n";
      print_workloads(std::cerr);
      return kExitUsage;
    }
    chosen.push_back(w);
  }
  if (!options.json)
    std::cout << "bytes sent per rank per attention call (one layer), " << options.dtype
              << ", no mask; MiB = 2^20 bytes\n"
              << std::left << std::setw(14) << "workload" << std::setw(15) << "strategy"
              << std::right << std::setw(4) << "P" << std::setw(14) << "MiB/rank" << std::setw(14)
              << "MiB total" << std::setw(14) << "GFLOP/rank" << std::setw(12) << "FLOP/byte"
              << '\n';
  for (const Workload* w : chosen) {
    const std::string& name = w->name;
    ParallelTraffic t;
    t.batch = w->packed() ? 1 : w->batch;
    t.rows = w->query_rows;
    t.joint = w->joint_rows;
    t.heads = w->heads, t.kv_heads = w->kv_heads, t.head_size = t.value_head_size = w->head_size;
    t.q_bytes = t.kv_bytes = t.out_bytes = dtype_size(dtype);
    for (int P : options.ranks) {
      std::vector<std::string> specs{"ulysses", "ring", "allgather"};
      for (int u = 2; u < P; u *= 2)
        if (P % u == 0)
          specs.push_back("hybrid:" + std::to_string(u) + "x" + std::to_string(P / u));
      for (const std::string& spec : specs) {
        double most = 0, total = 0;
        for (int r = 0; r < P; ++r) {
          const double b = double(parallel_bytes_sent(spec, t, P, r));
          most = std::max(most, b);
          total += b;
        }
        const double flops = attention_flops(*w) / P;
        if (options.json) {
          nlohmann::json j{
              {"workload", name},       {"strategy", spec},       {"ranks", P},
              {"dtype", options.dtype}, {"bytes_per_rank", most}, {"bytes_total", total},
              {"flops_per_rank", flops}};
          std::cout << j.dump() << '\n';
        } else {
          std::cout << std::left << std::setw(14) << name << std::setw(15) << spec << std::right
                    << std::setw(4) << P << std::fixed << std::setprecision(1) << std::setw(14)
                    << most / 1048576.0 << std::setw(14) << total / 1048576.0 << std::setw(14)
                    << flops * 1e-9 << std::setw(12) << std::setprecision(0)
                    << (most > 0 ? flops / most : 0.0) << '\n'
                    << std::defaultfloat;
        }
      }
    }
  }
  return kExitOk;
}

}  // namespace dattn::cli
