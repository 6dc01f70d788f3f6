// CPU feature detection and the machine's measured peak arithmetic rate.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dattn/threads.hpp"

namespace dattn {

// What the CPU offers and the operating system has enabled. A flag is true only when both hold
// (the AVX-512 and AMX flags also need the OS to save their registers, checked through XCR0).
struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false, avx_vnni = false, avx512f = false, avx512bw = false,
       avx512dq = false, avx512vl = false, avx512_bf16 = false, avx512_vnni = false,
       avx512_fp16 = false, amx_tile = false, amx_bf16 = false, amx_int8 = false, neon = false,
       // AArch64 (the kernel's HWCAPs; Linux's /proc/cpuinfo names): SDOT/UDOT (Armv8.2),
       // BFDOT/BFMMLA (Armv8.6 BF16), SMMLA/USMMLA (Armv8.6 I8MM), SVE and SVE2.
      asimddp = false, bf16 = false, i8mm = false, sve = false, sve2 = false;
  int sve_bits = 0;      // SVE's vector length in bits for this process (0 without SVE)
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

// What this process treats the CPU as having: the detected features, less those the environment
// variable DATTN_CPU_FEATURES masks out (see apply_cpu_feature_mask). Every choice of an engine,
// every peak measurement and every feature report reads this, so a masked run behaves as on a
// CPU without the masked features. Detected and masked once, on first use (thread-safe); a
// DATTN_CPU_FEATURES that names nothing known raises InvalidArgument naming it (on every call).
const CpuFeatures& cpu_features();

// What the CPU and the OS really offer, whatever DATTN_CPU_FEATURES says.
const CpuFeatures& detected_cpu_features();

// `detected` restricted to what `spec` allows: a comma-separated list of CPU classes and feature
// names (case and surrounding whitespace ignored); a feature stays only when one of the items
// allows it. Classes, each allowing what the previous one does and more:
//   portable     no SIMD feature at all (only the portable engine remains)
//   avx2         avx2, fma, f16c (an AMD Zen 3 or Intel Haswell class CPU)
//   avx_vnni     avx2 and avx_vnni (AVX-VNNI on 256-bit registers: Alder Lake, Zen 5)
//   avx512       avx2 and avx512f, avx512bw, avx512dq, avx512vl (Skylake-SP)
//   avx512_vnni  avx512 and avx512_vnni (Cascade Lake, Ice Lake)
//   avx512_bf16  avx512_vnni, avx_vnni, avx512_bf16, avx512_fp16 (Zen 4/5, no AMX)
//   amx, native  everything detected (no mask)
// and on AArch64:
//   neon          neon (Advanced SIMD: every AArch64 CPU; Cortex-A72, Graviton 1)
//   neon_dotprod  neon, asimddp (Armv8.2 dot products: Neoverse N1, Graviton 2, Ampere Altra)
//   neon_i8mm     neon_dotprod and bf16, i8mm (Armv8.6 without SVE)
//   sve           everything on AArch64 (SVE, SVE2: Graviton 3/4, Grace, Axion, Cobalt 100)
// A feature name (as CpuFeatures::names() spells it, e.g. "amx_int8" or "neon") allows that
// feature; a name that is a class too (avx2, avx_vnni, avx512_vnni, avx512_bf16) is the class.
// An empty spec means no mask. Sub-features
// never outlive what they extend: AVX-512 flags go without avx512f, AMX ones without amx_tile.
// Throws InvalidArgument naming DATTN_CPU_FEATURES for an unknown item, listing the valid ones.
CpuFeatures apply_cpu_feature_mask(const CpuFeatures& detected, std::string_view spec);

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
  // The SAGE engines' 8-bit dot rate in GOP/s (2 ops per byte product): vpdpbusd (AVX512-VNNI,
  // else AVX-VNNI) or AVX2's vpmaddwd on 16-bit lanes; int8_dot_isa names it, and
  // int8_dot_unavailable says why it is absent.
  std::optional<double> int8_dot;
  std::string int8_dot_isa, int8_dot_unavailable;
  // The 16-bit integer lanes' rate in GOP/s (2 ops per int16 product, the pairs of vpmaddwd /
  // vpdpwssd summed in int32): vpdpwssd on 512-bit registers (AVX512-VNNI), else on 256-bit
  // ones (AVX-VNNI), else AVX2's vpmaddwd + vpaddd. SAGE's P.V in 16 bits runs on it (pv_dtype
  // int16); it is the ceiling of any engine computing on int16 pairs. int16_dot_isa names it,
  // int16_dot_unavailable says why it is absent.
  std::optional<double> int16_dot;
  std::string int16_dot_isa, int16_dot_unavailable;
  // AMX tdpbssd GOP/s (2 ops per byte product; one 16x16x64 tile product = 32768 ops), the
  // amx_int8 engine's Q.K^T, measured where this process may run AMX-INT8 tile instructions;
  // amx_int8_unavailable says why not.
  std::optional<double> amx_int8;
  std::string amx_int8_unavailable;
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
