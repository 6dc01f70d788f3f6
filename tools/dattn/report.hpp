// The result of one `dattn run`: what ran, how fast, and how far from REFERENCE.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

namespace dattn::cli {

struct RunShape {
  std::int64_t batch = 0, sq = 0, skv = 0, hq = 0, hkv = 0, d = 0, joint = 0;
};

// Output rows of a sample recomputed by REFERENCE, compared with the timed backend's output.
struct RowCheck {
  std::int64_t rows = 0;   // query rows sampled (every batch item and head of each)
  double max_abs_err = 0;  // max |out - reference| over the sampled rows
  double max_rel_err = 0;  // max_abs_err / max |reference| over the sampled rows
};

struct RunReport {
  std::string backend;  // the backend that ran
  // bench's backend options of this row (`--backend NAME:key=value,...`), "" when none; the
  // table and chart label the row NAME:options.
  std::string backend_options;
  std::string selection;  // how it was chosen: "explicit", "env ..." or "auto"
  std::string workload;
  std::string layout;  // "BSHD" or "THD"
  std::string dtype;
  int threads = 1;
  std::uint64_t seed = 0;
  int reps = 1;  // timed calls; `seconds` is the best
  RunShape shape;
  double flops = 0;    // attention_flops() of the workload
  double seconds = 0;  // the best timed forward call (after a warm-up call)
  double gflops = 0;
  // The engine that computed the call: Plan::engine() of the plan that ran the timed calls
  // (Attention::last_engine(): "portable", "avx2", "avx512", "avx512_bf16", "amx",
  // "avx512_bf16_emulated", ...); empty for a backend without engines (REFERENCE).
  std::string engine;
  // The measured peak that engine is held to, over `threads` threads (times `ranks`):
  // "f32_fma" for the f32 engines (portable, avx2, avx512, neon), "bf16_dot" (vdpbf16ps, BFDOT)
  // for avx512_bf16 and neon_bf16, "amx_bf16" (tdpbf16ps) for amx, "int8_dot" (GOP/s) for SAGE's
  // vector int8 engines, "int16_dot" (GOP/s) for the 16-bit integer-lane engines, "amx_int8"
  // (tdpbssd) for amx_int8. Empty, with no peak and no efficiency, for emulated engines (their
  // speed says nothing about the hardware they emulate) and without an engine; `no_peak` then says
  // why.
  std::string peak_kind;
  std::optional<double> peak_gflops;
  std::optional<double> efficiency;  // gflops / peak_gflops
  std::string no_peak;               // why there is no peak (empty when there is one)
  std::optional<RowCheck> check;     // absent with --check-rows 0
  // Sparse (approximate) backends: `check` is against REFERENCE under the backend's own block
  // mask; these say how far the result is from dense attention.
  std::string checked_against = "REFERENCE";
  std::string signal = "random";
  std::optional<double> block_sparsity;  // fraction of (query, key) pairs skipped
  std::optional<double> dense_rel_err;   // ||out - dense|| / ||dense|| over the whole output
  double dense_flops = 0;                // attention_flops() of the dense call
  // Time to tile the layout and select the blocks once, outside the timed calls (an upper
  // bound of what each call spends on it: the backend caches the tiling).
  std::optional<double> selection_seconds;
  // Quantized K/V ("fp8", "int8"; empty = none): the bytes K and V take in that form (scales
  // included) and in f32, and the normwise error against the same call with f32 K/V.
  std::string kv_dtype;
  std::optional<double> kv_cache_bytes, kv_f32_bytes, kv_rel_err;
  // Paged runs: tokens per page and the pages' dtype.
  std::int64_t page_block = 0;
  std::string page_dtype;
  // prefix-reuse: the time of recomputing every row per step (seconds is one cached step).
  std::optional<double> recompute_seconds;
  // Sequence parallelism: the strategy ("none" on one process), the ranks (processes), and the
  // most bytes one rank sends per call. With ranks > 1, `seconds` is the slowest rank's time,
  // `gflops` the whole group's, `peak_gflops` ranks x one process's peak (for rank 0's engine),
  // and `check` compares every row with one process running the same inputs.
  std::string parallel = "none";
  int ranks = 1;
  std::optional<double> bytes_sent;
};

// One flat JSON object; the error keys are null when no rows were checked.
nlohmann::json to_json(const RunReport& report);
// A few aligned human-readable lines.
void print_text(std::ostream& os, const RunReport& report);

}  // namespace dattn::cli
