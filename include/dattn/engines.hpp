// The FLASH backend's engines: the kernel sets it can run on this machine, for `dattn info`, the
// tests and callers that want to know what DATTN_ISA and the `isa` backend option accept.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace dattn {

struct EngineInfo {
  std::string name;           // what DATTN_ISA and the isa option accept, e.g. "avx512_bf16"
  int rank = 0;               // place on the ladder (portable 0); an emulated twin has its twin's
  std::string compute_dtype;  // "f32" (exact for f32/bf16/f16 inputs) or "bf16" (bf16 products)
  bool emulated = false;      // never chosen automatically, only by its exact name
  std::optional<std::string> unavailable_reason;  // why this CPU cannot run it; none if it can
};

// Every engine of the table, in ladder order (emulated twins after their real ones).
std::vector<EngineInfo> flash_engines();

// "Far below the CPU" (docs/architecture.md, "Never silently slow"): the engine FLASH chooses
// automatically (no DATTN_ISA cap, f32 inputs) has no SIMD (the portable ones, rank 0) while the
// CPU as detected, before DATTN_CPU_FEATURES masks it, has SIMD: a feature some engine uses
// (hidden by the mask) or one this build has no engine for (e.g. AVX2 without FMA and F16C, or
// SSE2 alone on an x86-64 CPU; NEON before the neon engine existed). The mask is a testing tool,
// not an opt-in: DATTN_CPU_FEATURES=portable on an AVX2 machine is far below it.
struct SimdShortfall {
  std::string engine;   // the engine automatic calls run on, e.g. "portable"
  std::string cpu;      // the CPU as named (its brand string; "this CPU" when it has none)
  std::string unused;   // the SIMD left unused, e.g. "avx2, fma, f16c" or "neon"
  std::string message;  // one sentence naming the CPU, the engine and what is missing
};
// nullopt where an engine with SIMD serves automatic calls (or the CPU has no SIMD at all).
// Computed once per process (the features are); the rule `dattn info` reports, under which the
// hosts' automatic choices keep their own attention and explicit ones warn once (Python).
std::optional<SimdShortfall> simd_shortfall();

}  // namespace dattn
