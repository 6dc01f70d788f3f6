// The subcommands of the `dattn` tool. Each registers its options on a CLI11 subcommand and
// runs from the parsed options, returning the process exit code. Library errors
// (dattn::Error) propagate to main(), which prints "error: <message>" and exits 1.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace dattn::cli {

// A count option's check: an integer in [lo, hi], else "V is not valid; want lo to hi" (CLI11
// prefixes the option's name).
CLI::Validator count_in(std::int64_t lo, std::int64_t hi);

// Exit codes.
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;  // the library or the inputs refused the request
inline constexpr int kExitUsage = 2;  // the command line itself is wrong

// `dattn info`: the platform, the CPU, its measured peak and every registered backend.
struct InfoOptions {
  bool json = false;
  int threads = 0;  // 0 = OpenMP's default
};
void add_info_options(CLI::App& command, InfoOptions& options);
int run_info(const InfoOptions& options);

// How `run` and `bench` measure: threads, head count override, rows checked, input seed, the
// input signal, and the options only some backends take (an error with the others:
// check_flag_options).
struct MeasureOptions {
  int threads = 0;         // 0 = OpenMP's default
  std::int64_t heads = 0;  // 0 = the workload's own head count
  std::int64_t check_rows = 32;
  std::uint64_t seed = 1;
  std::string signal = "random";  // "random" or "smooth" (a smooth video signal)
  std::optional<double> sparsity;
  std::optional<std::int64_t> topk;
  std::string window;  // "wt,wh,ww": sliding tile selection
  std::string tile;    // "t,h,w"
  bool fallback = false;
  std::string kv_dtype;    // "", "fp8" or "int8": quantized K/V (dense calls, or the pages)
  std::int64_t paged = 0;  // > 0: run through forward_paged with pages of this many tokens
  std::string page_dtype;  // dtype of the pages (default: the inputs' dtype)
  // FLASH's engine options (VIDEO_SPARSE takes them too): the backend options compute_dtype
  // ("f32" or "bf16") and isa (an engine of flash_engines(), the cap); empty = not given.
  std::string compute_dtype;
  std::string isa;
  // SAGE's backend option pv_dtype ("auto", "bf16", "f32", "int16" or "int8").
  std::string pv_dtype;
};
void add_measure_options(CLI::App& command, MeasureOptions& options);

// `dattn run`: times one workload of the table and checks a sample of rows against REFERENCE.
struct RunOptions {
  std::string workload = "small";
  std::string backend = "auto";
  std::string dtype = "f32";
  MeasureOptions measure;
  bool json = false;
  bool list_workloads = false;
  std::string mask_png;  // a sparse backend's block map of head 0 as a PNG
  int reps = 1;
  std::string parallel = "none";  // sequence parallelism over MPI (run under mpirun)
};
void add_run_options(CLI::App& command, RunOptions& options);
int run_run(const RunOptions& options);

// `dattn bench`: every combination of workloads, backends and dtypes, best of `reps`.
struct BenchOptions {
  std::vector<std::string> workloads;  // default {"small"}
  std::vector<std::string> backends;   // default {"auto"}
  std::vector<std::string> dtypes;     // default {"f32"}
  MeasureOptions measure = [] {
    MeasureOptions m;
    m.check_rows = 8;
    return m;
  }();
  int reps = 3;
  bool json = false;
  std::string svg;
};
void add_bench_options(CLI::App& command, BenchOptions& options);
int run_bench(const BenchOptions& options);

// `dattn traffic`: the bytes each sequence-parallel strategy sends per call, from the shapes.
struct TrafficOptions {
  std::vector<std::string> workloads;  // default: flux-1024, wan-480p, hunyuan-720p
  std::vector<int> ranks{2, 4, 8};
  std::string dtype = "bf16";
  bool json = false;
};
void add_traffic_options(CLI::App& command, TrafficOptions& options);
int run_traffic(const TrafficOptions& options);

// `dattn attend`: attention on tensors read from a safetensors file.
struct AttendOptions {
  std::string inputs;
  std::string meta;
  std::string out;
  std::string backend = "auto";
  std::string example_inputs;  // write an example input file (+ META json) instead
};
void add_attend_options(CLI::App& command, AttendOptions& options);
int run_attend(const AttendOptions& options);

}  // namespace dattn::cli
