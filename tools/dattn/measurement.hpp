// Measuring one workload on one backend, shared by `dattn run` and `dattn bench`.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include "commands.hpp"
#include "dattn/attention.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/dtype.hpp"
#include "report.hpp"
#include "workloads.hpp"

namespace dattn::cli {

struct Measurement {
  Workload workload;
  std::string backend = "auto";
  DType dtype = DType::F32;
  int threads = 0;  // 0 = OpenMP's default
  int reps = 1;     // timed calls after one warm-up; the best counts
  std::int64_t check_rows = 32;
  std::uint64_t seed = 1;
  bool smooth_signal = false;  // Q/K/V of video rows from a smooth signal of (t, h, w)
  // The layer's backend options as given for its backend (bench/run --backend NAME:key=value):
  // checked against the backend's options, as a layer checks them.
  BackendOptions backend_options;
  // The options of the backend flags (--sparsity, --topk, --tile, --window, --pv-dtype, --isa,
  // --compute-dtype): each goes to the backends that declare it (layer_options).
  BackendOptions flag_options;
  bool allow_fallback = false;
  std::string mask_png;  // with a sparse backend: write its block map of head 0 here
  KvCacheDtype kv_dtype = KvCacheDtype::unquantized;
  std::int64_t page_block = 0;      // > 0: through forward_paged, pages of this many tokens
  std::optional<DType> page_dtype;  // default: the inputs' dtype (int8/fp8 with kv_dtype)
  bool progress = true;             // progress lines on stderr
  std::string progress_prefix = "dattn: ";
};

// Builds the inputs, runs a warm-up and `reps` timed calls, checks a sample of rows against
// REFERENCE and reports against the measured peak of the engine that computed the calls.
RunReport measure(const Measurement& m);
// The paged forms (paged_measurement.cpp): the workload's rows through forward_paged with
// shuffled block tables, and the prefix-reuse workload (cached prefix against recompute).
RunReport measure_paged(const Measurement& m);
RunReport measure_prefix_reuse(const Measurement& m);
// Sequence parallelism (parallel_measurement.cpp): this process is one rank of MPI_COMM_WORLD
// (run under mpirun) and takes its contiguous shard of the rows; rank 0's report covers the
// group, the other ranks' is empty (nullopt).
std::optional<RunReport> measure_parallel(const Measurement& m, const std::string& parallel);
// The fields every timed run reports: what ran (`ran`, chosen as `layer` says), the workload
// and options of `m`, the threads, and the best time with its GFLOP/s (`report.flops` set).
void fill_run(RunReport& report, const Measurement& m, const Backend& ran, const Attention& layer,
              int threads, double seconds);
// The peak an engine's efficiency is measured against: "f32_fma" for the f32 engines
// (portable, avx2, avx512), "bf16_dot" for avx512_bf16, "amx_bf16" for amx, "amx_int8" for
// amx_int8, "int8_dot" for SAGE's other int8 engines, "int16_dot" for the 16-bit integer-lane
// engines (avx2_int16, avx_vnni_int16, avx512_vnni_int16); empty for emulated
// engines, engines without a measured peak and "" (a backend without engines).
std::string peak_kind_of_engine(const std::string& engine);
// That peak of `peak` (f32_fma, bf16_dot, amx_bf16, int8_dot, int16_dot or amx_int8), or nullopt
// (absent or unknown kind).
std::optional<double> peak_of_kind(const PeakGflops& peak, const std::string& kind);
// The engine, peak and efficiency fields of `report` (whose backend and gflops are set): the
// engine that computed the timed calls (Attention::last_engine()) and its peak over `threads`
// threads, measured once per process and thread count, only when the engine has one.
void fill_peak(RunReport& report, const std::string& engine, int threads);
// ||a - b|| / ||b|| over all elements of two tensors of one shape.
double normwise_rel_err(const TensorView& a, const TensorView& b);

// The backend options of `m` that choose FLASH's engine: isa and compute_dtype, where given.
BackendOptions engine_options(const Measurement& m);
// The backend a layer of `config` gets for the name `backend` ("auto" or "": the automatic
// choice), as the layer will choose it.
std::shared_ptr<const Backend> resolve_backend(const std::string& backend,
                                               const AttentionConfig& config);
// The options a layer on `backend` is built with: m.backend_options, and the flag options
// `backend` declares (Backend::option_names; all of them for a backend that declares none).
BackendOptions layer_options(const Measurement& m, const Backend& backend);
// InvalidArgument naming the flag when a flag option of `m` is an option of none of `backends`
// (names as on the command line; "auto" resolved as the layer would): e.g. --sparsity with
// FLASH alone; and when a flag that shapes the measurement (--mask-png, --paged, --kv-dtype)
// names what one of them does not serve, or --page-dtype comes without --paged.
void check_flag_options(const Measurement& m, const std::vector<std::string>& backends);
// With --isa or --compute-dtype given (engine_options(m) not empty): throws InvalidArgument
// naming the option when `backend` is a backend without FLASH's engines (FLASH and VIDEO_SPARSE
// have them; "auto" or "" is checked once the layer has chosen), and NotAvailable naming --isa
// when this CPU cannot run the engine it names.
void check_engine_options(const Measurement& m, const std::string& backend);

// A --backend value: NAME, or NAME:key=value,key=value with options for that backend only
// (spaces around names, keys and values trimmed; values read as an integer, a number, true or
// false, else a string). InvalidArgument naming `backend` for an item that is not key=value.
struct BackendSpec {
  std::string name, options;  // options as given ("" when none)
  BackendOptions parsed;
};
BackendSpec parse_backend_spec(const std::string& spec);

// The workload table, one line each.
void print_workloads(std::ostream& os);

// The workload `name` with the head override of `options`, or nullopt after printing the
// error and the valid workloads on stderr.
std::optional<Workload> workload_or_report(const std::string& name, const MeasureOptions& options);
// A measurement of `workload` with the threads, rows checked and seed of `options`.
Measurement measurement_for(const Workload& workload, const MeasureOptions& options);

}  // namespace dattn::cli
