// dattn: command-line front end of the library (info, run, bench, attend).
#include <exception>
#include <iostream>
#include <new>

#include <omp.h>
#include <CLI/CLI.hpp>

#include "dattn/cpu_info.hpp"
#include "dattn/errors.hpp"
#include "dattn/threads.hpp"

#include "commands.hpp"

int main(int argc, char** argv) {
  using namespace dattn::cli;
  // A DATTN_CPU_FEATURES that names nothing known is the process's configuration error: said
  // before anything (the options' help already lists the engines this CPU can run).
  try {
    dattn::cpu_features();
  } catch (const dattn::Error& e) {
    std::cerr << "error: " << e.what() << '\n';
    return kExitUsage;
  }

  CLI::App app{"dattn: attention backends for diffusion transformers"};
  app.require_subcommand(1);
  // CLI11's messages quote the argument in full: bounded as the library's are.
  app.failure_message([](const CLI::App* a, const CLI::Error& e) {
    return dattn::Error::bounded(CLI::FailureMessage::simple(a, e), dattn::Error::kMaxMessage);
  });

  InfoOptions info;
  CLI::App* info_command = app.add_subcommand(
      "info", "Show the platform, CPU features, measured peak and every registered backend");
  add_info_options(*info_command, info);

  RunOptions run;
  CLI::App* run_command = app.add_subcommand(
      "run", "Time a workload on a backend and check a sample of rows against REFERENCE");
  add_run_options(*run_command, run);

  BenchOptions bench;
  CLI::App* bench_command = app.add_subcommand(
      "bench", "Time workloads x backends x dtypes (best of --reps) as a table, JSON or SVG");
  add_bench_options(*bench_command, bench);

  TrafficOptions traffic;
  CLI::App* traffic_command = app.add_subcommand(
      "traffic", "Bytes each sequence-parallel strategy sends per call for workload shapes");
  add_traffic_options(*traffic_command, traffic);

  AttendOptions attend;
  CLI::App* attend_command = app.add_subcommand(
      "attend", "Run attention on tensors from a safetensors file and write the result");
  add_attend_options(*attend_command, attend);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitUsage;
  }

  // OpenMP's default (OMP_NUM_THREADS) counts only up to the library's limit, and a value that
  // OpenMP's int wrapped counts as that limit (dattn::default_threads()): every region of the
  // CLI, those without a num_threads clause included, then runs within the one bound.
  if (const int bound = dattn::default_threads(); bound != omp_get_max_threads())
    omp_set_num_threads(bound);

  try {
    if (*info_command) return run_info(info);
    if (*run_command) return run_run(run);
    if (*bench_command) return run_bench(bench);
    if (*attend_command) return run_attend(attend);
    if (*traffic_command) return run_traffic(traffic);
  } catch (const std::bad_alloc&) {
    std::cerr << "error: out of memory (for a large workload, try fewer heads: --heads N)\n";
    return kExitError;
  } catch (const std::exception& e) {  // dattn::Error and anything else
    std::cerr << "error: " << e.what() << '\n';
    return kExitError;
  }
  return kExitUsage;
}
