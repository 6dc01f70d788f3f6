// CPU feature detection and the machine's measured peak arithmetic rate.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "dattn/threads.hpp"

namespace dattn {

// What the CPU offers and the operating system has enabled. A flag is true only when both hold
// (the AVX-512 and AMX flags also need the OS to save their registers, checked through XCR0).
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false, avx512f = false, avx512bw = false, avx512dq = false,
       avx512vl = false, avx512_bf16 = false, avx512_vnni = false, avx512_fp16 = false,
       amx_tile = false, amx_bf16 = false, neon = false;
  std::string vendor;    // cpuid vendor string ("GenuineIntel", "AuthenticAMD"); may be empty
  std::string brand;     // cpuid brand string ("AMD EPYC 7763 64-Core Processor"); may be empty
  int logical_cpus = 0;  // logical CPUs available (at least 1)
  // Bytes of the level-2 cache of one core as the OS reports it (sysfs, else sysconf); 0 when
  // unknown. FLASH sizes its work items by it (backends/flash/tile_plan.hpp).
  long long l2_bytes = 0;

  // The names of the flags that are true, lower-case, in declaration order
  // (e.g. {"avx2", "fma", "f16c"}); the x86 names match the Linux /proc/cpuinfo flags.
  std::vector<std::string> names() const;
};

// Detected once, on first use (thread-safe).
const CpuFeatures& cpu_features();

struct PeakGflops {
  double f32_fma = 0;              // f32 FMA GFLOP/s over `threads` threads (2 flops per lane)
  std::optional<double> bf16_dot;  // vdpbf16ps GFLOP/s (2 flops per bf16 pair), if avx512_bf16
  int threads = 1;                 // threads that actually ran (at most affinity_cpus())
  std::string isa;                 // ISA used for f32: "avx512f", "avx2+fma", "neon" or "scalar"
  // AMX tdpbf16ps GFLOP/s (2 flops per bf16 pair product; one 16x16x32 tile product = 16384
  // flops), measured only where this process may run AMX-BF16 tile instructions (the CPU has
  // them, the OS enables the tile state and Linux grants the process its permission); absent
  // otherwise, and then no tile instruction is ever executed.
  std::optional<double> amx_bf16;
  // Why bf16_dot / amx_bf16 are absent (empty when measured): e.g. "this CPU lacks AVX512-BF16",
  // or why this process cannot run AMX tiles (no AMX, no OS support, Linux refused the tiles).
  std::string bf16_dot_unavailable, amx_bf16_unavailable;
};

// Measures the machine's peak with a register-resident loop of independent FMA chains (and, where
// present, vdpbf16ps chains and tdpbf16ps on tiles loaded once), run on `threads` OpenMP threads
// at once and timed as one team over one interval, best of a few short trials, about `seconds`
// in total (shared by the kinds measured). At most affinity_cpus() threads run (the CPUs this
// process may run on): more would only time-share them; PeakGflops::threads says how many ran.
// threads <= 0 means every CPU the process may run on (at most kMaxThreads); threads above
// kMaxThreads raise InvalidArgument naming "threads". The result is cached per thread count for the
// life of the process: later calls with the same count return it without measuring again (and
// ignore `seconds`). Thread-safe; concurrent calls are serialised so they don't disturb each other.
PeakGflops measure_peak_gflops(int threads, double seconds = 0.2);

}  // namespace dattn
