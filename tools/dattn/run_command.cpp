// `dattn run`: times one workload on one backend and checks a sample of rows against
// REFERENCE.
#include <iostream>

#include "commands.hpp"
#include "measurement.hpp"

namespace dattn::cli {

void add_run_options(CLI::App& command, RunOptions& options) {
  command.add_option("--workload,-w", options.workload, "Workload to run (see --list-workloads)")
      ->capture_default_str();
  command
      .add_option("--backend,-b", options.backend,
                  "Backend name, or auto (DIFFUSION_ATTENTION_BACKEND, then the best that fits); "
                  "NAME:key=value,... gives it options, as bench's --backend")
      ->capture_default_str();
  command.add_option("--dtype", options.dtype, "Element type of Q, K and V")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  add_measure_options(command, options.measure);
  command.add_flag("--json", options.json, "Print one JSON object per line");
  command.add_flag("--list-workloads", options.list_workloads, "List the workloads and exit");
  command.add_option("--reps", options.reps, "Timed calls after one warm-up; the best counts")
      ->check(count_in(1, 1000000))
      ->capture_default_str();
  command
      .add_option("--parallel", options.parallel,
                  "Sequence parallelism over MPI: none, ulysses, ulysses-strict, ring, allgather "
                  "or hybrid:UxR; run as `mpirun -np P dattn run ...`, each process takes its "
                  "shard of the rows and rank 0 reports for the group")
      ->capture_default_str();
  command.add_option("--mask-png", options.mask_png,
                     "With a sparse backend: write its block map of head 0 as a PNG "
                     "(query blocks down, key blocks across)");
}

int run_run(const RunOptions& options) {
  if (options.list_workloads) {
    print_workloads(std::cout);
    return kExitOk;
  }
  const std::optional<Workload> workload = workload_or_report(options.workload, options.measure);
  if (!workload) return kExitUsage;
  Measurement m = measurement_for(*workload, options.measure);
  const BackendSpec spec = parse_backend_spec(options.backend);
  m.backend = spec.name;
  m.backend_options = spec.parsed;
  m.dtype = parse_dtype(options.dtype).value_or(DType::F32);
  m.progress_prefix = "dattn run: ";
  m.mask_png = options.mask_png;
  m.reps = options.reps;
  check_engine_options(m, m.backend);
  check_flag_options(m, {m.backend});
  if (options.parallel != "none") {
    const std::optional<RunReport> group = measure_parallel(m, options.parallel);
    if (!group) return kExitOk;  // not rank 0
    if (options.json)
      std::cout << to_json(*group).dump() << '\n';
    else
      print_text(std::cout, *group);
    return kExitOk;
  }
  RunReport report = measure(m);
  report.backend_options = spec.options;
  if (options.json)
    std::cout << to_json(report).dump() << '\n';
  else
    print_text(std::cout, report);
  return kExitOk;
}

}  // namespace dattn::cli
