#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(__unix__)
#include <unistd.h>
#endif

#include "core/amx_permission.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/engines.hpp"
#include "dattn/errors.hpp"

namespace dattn {
namespace {

// The flags line of the first processor in /proc/cpuinfo ("flags" on x86, "Features" on
// AArch64), or nullopt where there is none (qemu-user shows the host's file).
std::optional<std::set<std::string>> proc_cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  if (!in) return std::nullopt;
#if defined(__aarch64__)
  const char* const key = "Features";
#else
  const char* const key = "flags";
#endif
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::istringstream words(line.substr(colon + 1));
    std::set<std::string> flags;
    std::string w;
    while (words >> w) flags.insert(w);
    return flags;
  }
  return std::nullopt;
}

TEST(CpuInfo, DetectedOnceAndStable) {
  const CpuFeatures& a = cpu_features();
  const CpuFeatures& b = cpu_features();
  EXPECT_EQ(&a, &b);
  EXPECT_GE(a.logical_cpus, 1);
  const unsigned hc = std::thread::hardware_concurrency();
  if (hc > 0) {
    EXPECT_EQ(a.logical_cpus, static_cast<int>(hc));
  }
}

// The L2 size FLASH sizes its work items by: what sysfs says of cpu0's level-2 data or unified
// cache, and glibc's sysconf (its own reading, from cpuid) agrees where it knows.
TEST(CpuInfo, L2BytesMatchTheOperatingSystem) {
  const long long l2 = cpu_features().l2_bytes;
  EXPECT_GE(l2, 0);
  std::ifstream size("/sys/devices/system/cpu/cpu0/cache/index2/size");
  std::ifstream level("/sys/devices/system/cpu/cpu0/cache/index2/level");
  int lv = 0;
  std::string text;
  if (level >> lv && lv == 2 && size >> text) {
    EXPECT_GT(l2, 0) << text;
    EXPECT_EQ(l2 % 1024, 0) << text;
  }
#if defined(_SC_LEVEL2_CACHE_SIZE)
  const long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (n > 0) {
    EXPECT_EQ(l2, n);
  }
#endif
}

TEST(CpuInfo, FlagImplications) {
  const CpuFeatures& f = cpu_features();
  if (f.avx512bw || f.avx512dq || f.avx512vl || f.avx512_bf16 || f.avx512_vnni || f.avx512_fp16) {
    EXPECT_TRUE(f.avx512f);
  }
#if defined(__x86_64__)
  EXPECT_FALSE(f.neon);
  EXPECT_FALSE(f.vendor.empty());
#elif defined(__aarch64__)
  EXPECT_TRUE(detected_cpu_features().neon);  // mandatory (DATTN_CPU_FEATURES may hide it)
  EXPECT_FALSE(f.avx2 || f.fma || f.avx512f || f.amx_tile);
  if (f.sve2) {
    EXPECT_TRUE(f.sve);
  }
  // SVE's vector length: a multiple of 128 bits up to 2048 where SVE is, 0 where it is not.
  if (f.sve) {
    EXPECT_TRUE(f.sve_bits >= 128 && f.sve_bits <= 2048 && f.sve_bits % 128 == 0) << f.sve_bits;
  } else {
    EXPECT_EQ(f.sve_bits, 0);
  }
#endif
  if (!f.neon) {
    EXPECT_FALSE(f.asimddp || f.bf16 || f.i8mm);
  }
}

TEST(CpuInfo, NamesListExactlyTheTrueFlags) {
  const CpuFeatures& f = cpu_features();
  const std::vector<std::pair<bool, std::string>> all = {
      {f.avx2, "avx2"},
      {f.fma, "fma"},
      {f.f16c, "f16c"},
      {f.avx_vnni, "avx_vnni"},
      {f.avx512f, "avx512f"},
      {f.avx512bw, "avx512bw"},
      {f.avx512dq, "avx512dq"},
      {f.avx512vl, "avx512vl"},
      {f.avx512_bf16, "avx512_bf16"},
      {f.avx512_vnni, "avx512_vnni"},
      {f.avx512_fp16, "avx512_fp16"},
      {f.amx_tile, "amx_tile"},
      {f.amx_bf16, "amx_bf16"},
      {f.amx_int8, "amx_int8"},
      {f.neon, "neon"},
      {f.asimddp, "asimddp"},
      {f.bf16, "bf16"},
      {f.i8mm, "i8mm"},
      {f.sve, "sve"},
      {f.sve2, "sve2"},
  };
  std::vector<std::string> expected;
  for (const auto& [on, name] : all) {
    if (on) expected.push_back(name);
  }
  EXPECT_EQ(f.names(), expected);

  // Every false flag yields a name list without it.
  CpuFeatures none;
  EXPECT_TRUE(none.names().empty());
  CpuFeatures some;
  some.fma = true;
  some.amx_bf16 = true;
  EXPECT_EQ(some.names(), (std::vector<std::string>{"fma", "amx_bf16"}));
}

TEST(CpuInfo, MatchesProcCpuinfo) {
#if defined(__aarch64__)
  const auto flags = proc_cpuinfo_flags();
  if (!flags) GTEST_SKIP() << "no /proc/cpuinfo Features line (under qemu-user: the host's file)";
  const CpuFeatures& f = detected_cpu_features();
  auto has = [&](const char* name) { return flags->count(name) != 0; };
  EXPECT_EQ(f.neon, has("asimd"));
  EXPECT_EQ(f.asimddp, has("asimddp"));
  EXPECT_EQ(f.bf16, has("bf16"));
  EXPECT_EQ(f.i8mm, has("i8mm"));
  EXPECT_EQ(f.sve, has("sve"));
  EXPECT_EQ(f.sve2, has("sve2"));
#elif !defined(__x86_64__)
  GTEST_SKIP() << "flag names compared are x86 and AArch64 ones";
#else
  const auto flags = proc_cpuinfo_flags();
  if (!flags) GTEST_SKIP() << "no /proc/cpuinfo flags line";
  const CpuFeatures& f = detected_cpu_features();  // whatever DATTN_CPU_FEATURES masks
  auto has = [&](const char* name) { return flags->count(name) != 0; };
  // The kernel lists a flag only when the CPU has it and the kernel enabled its state, which is
  // what detection reports.
  EXPECT_EQ(f.avx2, has("avx2"));
  EXPECT_EQ(f.fma, has("fma"));
  EXPECT_EQ(f.f16c, has("f16c"));
  EXPECT_EQ(f.avx512f, has("avx512f"));
  EXPECT_EQ(f.avx512bw, has("avx512bw"));
  EXPECT_EQ(f.avx512dq, has("avx512dq"));
  EXPECT_EQ(f.avx512vl, has("avx512vl"));
  EXPECT_EQ(f.avx512_bf16, has("avx512_bf16"));
  EXPECT_EQ(f.avx512_vnni, has("avx512_vnni"));
  EXPECT_EQ(f.amx_tile, has("amx_tile"));
  EXPECT_EQ(f.amx_bf16, has("amx_bf16"));
  EXPECT_EQ(f.amx_int8, has("amx_int8"));
  // Kernels older than 5.13 don't know avx_vnni: only check that a listed flag is detected.
  if (has("avx_vnni")) {
    EXPECT_TRUE(f.avx_vnni);
  }
  // Kernels older than 5.11 don't know avx512_fp16: only check that a listed flag is detected.
  if (has("avx512_fp16")) {
    EXPECT_TRUE(f.avx512_fp16);
  }
#endif
}

// DATTN_CPU_FEATURES: what each class keeps of a CPU with every feature, feature names,
// lists, the implications, and the typed error.
TEST(CpuFeatureMask, ClassesKeepWhatTheyName) {
  CpuFeatures all;
  all.avx2 = all.fma = all.f16c = all.avx_vnni = all.avx512f = all.avx512bw = all.avx512dq =
      all.avx512vl = all.avx512_bf16 = all.avx512_vnni = all.avx512_fp16 = all.amx_tile =
          all.amx_bf16 = all.amx_int8 = true;
  all.vendor = "GenuineIntel";
  all.logical_cpus = 7;
  all.l2_bytes = 2 << 20;
  using Names = std::vector<std::string>;
  const auto kept = [&](const char* spec) { return apply_cpu_feature_mask(all, spec).names(); };
  EXPECT_EQ(kept(""), all.names());
  EXPECT_EQ(kept("  "), all.names());
  EXPECT_EQ(kept("native"), all.names());
  EXPECT_EQ(kept("AMX"), all.names());
  EXPECT_EQ(kept("portable"), Names{});
  EXPECT_EQ(kept("avx2"), (Names{"avx2", "fma", "f16c"}));
  EXPECT_EQ(kept(" Avx2 \n"), (Names{"avx2", "fma", "f16c"}));
  EXPECT_EQ(kept("avx_vnni"), (Names{"avx2", "fma", "f16c", "avx_vnni"}));
  EXPECT_EQ(kept("avx512"),
            (Names{"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"}));
  EXPECT_EQ(kept("avx512_vnni"), (Names{"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq",
                                        "avx512vl", "avx512_vnni"}));
  EXPECT_EQ(kept("avx512_bf16"),
            (Names{"avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                   "avx512_bf16", "avx512_vnni", "avx512_fp16"}));
  // A list is the union of its items; a sub-feature never outlives what it extends.
  EXPECT_EQ(kept("avx2, amx_int8"), (Names{"avx2", "fma", "f16c"}));
  EXPECT_EQ(kept("avx2,avx512_fp16"), (Names{"avx2", "fma", "f16c"}));
  EXPECT_EQ(kept("avx512,amx_tile,amx_int8"),
            (Names{"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "amx_tile",
                   "amx_int8"}));
  EXPECT_EQ(kept("fma"), (Names{"fma"}));
  // Nothing is added that the CPU lacks, and what is not a flag stays as detected.
  CpuFeatures zen3;
  zen3.avx2 = zen3.fma = zen3.f16c = true;
  EXPECT_EQ(apply_cpu_feature_mask(zen3, "native").names(), zen3.names());
  EXPECT_EQ(apply_cpu_feature_mask(zen3, "avx512_bf16").names(), zen3.names());
  // The AArch64 classes, on an Armv9 CPU with 256-bit SVE (Graviton 4 / Grace class).
  CpuFeatures arm;
  arm.neon = arm.asimddp = arm.bf16 = arm.i8mm = arm.sve = arm.sve2 = true;
  arm.sve_bits = 256;
  const auto arm_kept = [&](const char* spec) { return apply_cpu_feature_mask(arm, spec).names(); };
  EXPECT_EQ(arm_kept("portable"), Names{});
  EXPECT_EQ(arm_kept("neon"), Names{"neon"});
  EXPECT_EQ(arm_kept("neon_dotprod"), (Names{"neon", "asimddp"}));
  EXPECT_EQ(arm_kept("neon_i8mm"), (Names{"neon", "asimddp", "bf16", "i8mm"}));
  EXPECT_EQ(arm_kept("sve"), arm.names());
  EXPECT_EQ(arm_kept("native"), arm.names());
  EXPECT_EQ(arm_kept("avx2"), Names{});
  EXPECT_EQ(apply_cpu_feature_mask(arm, "neon_i8mm").sve_bits, 0);  // no SVE, no length
  EXPECT_EQ(apply_cpu_feature_mask(arm, "sve").sve_bits, 256);
  EXPECT_EQ(arm_kept("bf16,sve2"), Names{});  // nothing outlives NEON / SVE
  const CpuFeatures masked = apply_cpu_feature_mask(all, "portable");
  EXPECT_EQ(masked.vendor, all.vendor);
  EXPECT_EQ(masked.logical_cpus, 7);
  EXPECT_EQ(masked.l2_bytes, 2 << 20);
  for (const char* bad : {"avx3", "avx2,,", "avx2;avx512", "sse4"}) {
    try {
      apply_cpu_feature_mask(all, bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.field(), "DATTN_CPU_FEATURES");
      EXPECT_NE(std::string(e.what()).find("valid: the classes portable avx2"), std::string::npos)
          << e.what();
    }
  }
}

// The process's features are the detected ones under this process's DATTN_CPU_FEATURES.
TEST(CpuFeatureMask, TheProcessSeesTheMaskedCpu) {
  const char* spec = std::getenv("DATTN_CPU_FEATURES");
  EXPECT_EQ(cpu_features().names(),
            apply_cpu_feature_mask(detected_cpu_features(), spec ? spec : "").names());
  if (spec == nullptr) {
    EXPECT_EQ(cpu_features().names(), detected_cpu_features().names());
  }
}

// Never silently slow: the rule fires exactly where the automatic engine is a portable one on a
// CPU that has SIMD (masked or not served), e.g. under DATTN_CPU_FEATURES=portable on x86 (the
// masked CTest run) and on AArch64 without an engine for NEON; it names the CPU, the engine and
// what is unused. Unmasked on an x86 CPU with AVX2 it is silent.
TEST(SimdShortfall, FiresExactlyWhereAPortableEngineServesASimdCpu) {
  std::string automatic;
  int automatic_rank = -1;
  for (const EngineInfo& e : flash_engines()) {
    if (e.compute_dtype == "f32" && !e.emulated && !e.unavailable_reason &&
        e.rank > automatic_rank) {
      automatic = e.name;
      automatic_rank = e.rank;
    }
  }
  ASSERT_FALSE(automatic.empty());
  bool simd = !detected_cpu_features().names().empty();
#if defined(__x86_64__)
  simd = true;  // SSE2 on every x86-64 CPU
#endif
  const std::optional<SimdShortfall> s = simd_shortfall();
  EXPECT_EQ(s.has_value(), automatic_rank == 0 && simd) << automatic;
  if (s) {
    EXPECT_EQ(s->engine, automatic);
    EXPECT_NE(s->message.find(s->cpu), std::string::npos) << s->message;
    EXPECT_NE(s->message.find(automatic + " engine"), std::string::npos) << s->message;
    EXPECT_FALSE(s->unused.empty());
    EXPECT_NE(s->message.find(s->unused), std::string::npos) << s->message;
    const char* spec = std::getenv("DATTN_CPU_FEATURES");
    if (cpu_features().names().empty() && !detected_cpu_features().names().empty()) {
      ASSERT_NE(spec, nullptr);
      EXPECT_NE(s->message.find("DATTN_CPU_FEATURES"), std::string::npos) << s->message;
    }
  }
#if defined(__x86_64__)
  if (std::getenv("DATTN_CPU_FEATURES") == nullptr && detected_cpu_features().avx2 &&
      detected_cpu_features().fma && detected_cpu_features().f16c) {
    EXPECT_FALSE(s.has_value()) << s->message;
  }
#endif
}

TEST(CpuInfo, BrandIsTrimmed) {
  const std::string& b = cpu_features().brand;
  if (b.empty()) GTEST_SKIP() << "no brand string";
  EXPECT_NE(b.front(), ' ');
  EXPECT_NE(b.back(), ' ');
  EXPECT_EQ(b.find('\0'), std::string::npos);
}

void expect_sane(const PeakGflops& p, int threads) {
  EXPECT_TRUE(std::isfinite(p.f32_fma));
  EXPECT_GT(p.f32_fma, 0.0);
  EXPECT_GE(p.threads, 1);
  EXPECT_LE(p.threads, threads);
  const std::vector<std::string> isas = {"avx512f", "avx2+fma", "neon", "scalar"};
  EXPECT_NE(std::find(isas.begin(), isas.end(), p.isa), isas.end()) << p.isa;
  const CpuFeatures& f = cpu_features();
  if (f.avx512f) {
    EXPECT_EQ(p.isa, "avx512f");
  } else if (f.avx2 && f.fma) {
    EXPECT_EQ(p.isa, "avx2+fma");
  }
  EXPECT_EQ(p.bf16_dot.has_value(), f.avx512_bf16);
  if (p.bf16_dot) {
    EXPECT_TRUE(std::isfinite(*p.bf16_dot));
    EXPECT_GT(*p.bf16_dot, 0.0);
  }
  // Measured exactly where this process may run AMX tiles (never attempted elsewhere).
  EXPECT_EQ(p.amx_bf16.has_value(), !detail::amx_unavailable().has_value());
  EXPECT_EQ(p.amx_bf16_unavailable, detail::amx_unavailable().value_or(""));
  EXPECT_EQ(p.bf16_dot_unavailable.empty(), p.bf16_dot.has_value());
  if (p.amx_bf16) {
    EXPECT_TRUE(std::isfinite(*p.amx_bf16));
    EXPECT_GT(*p.amx_bf16, 0.0);
  }
  // amx_int8's tdpbssd: where AMX runs and the CPU has AMX-INT8; else the reason.
  EXPECT_EQ(p.amx_int8.has_value(),
            !detail::amx_unavailable().has_value() && cpu_features().amx_int8);
  EXPECT_EQ(p.amx_int8_unavailable.empty(), p.amx_int8.has_value());
  if (p.amx_int8) {
    EXPECT_TRUE(std::isfinite(*p.amx_int8));
    EXPECT_GT(*p.amx_int8, 0.0);
  }
  // The 16-bit integer lanes: wherever AVX2 is, on the widest of vpdpwssd zmm, vpdpwssd ymm and
  // vpmaddwd + vpaddd the CPU has (the mask counts: DATTN_CPU_FEATURES=avx2,fma,f16c measures the
  // last); else the reason.
  EXPECT_EQ(p.int16_dot.has_value(), f.avx2);
  EXPECT_EQ(p.int16_dot_unavailable.empty(), p.int16_dot.has_value());
  if (p.int16_dot) {
    EXPECT_TRUE(std::isfinite(*p.int16_dot));
    EXPECT_GT(*p.int16_dot, 0.0);
    EXPECT_EQ(p.int16_dot_isa, f.avx512f && f.avx512_vnni ? "avx512_vnni (vpdpwssd)"
                               : f.avx_vnni               ? "avx_vnni (vpdpwssd)"
                                                          : "avx2 (vpmaddwd + vpaddd)");
  }
}

TEST(CpuPeak, OneThread) {
  const PeakGflops p = measure_peak_gflops(1, 0.05);
  expect_sane(p, 1);
  EXPECT_EQ(p.threads, 1);
  std::printf("peak 1 thread: %.1f GFLOP/s f32 (%s)", p.f32_fma, p.isa.c_str());
  if (p.bf16_dot) std::printf(", %.1f GFLOP/s bf16 dot", *p.bf16_dot);
  if (p.amx_bf16) std::printf(", %.1f GFLOP/s AMX bf16", *p.amx_bf16);
  if (p.int16_dot)
    std::printf(", %.1f GOP/s int16 dot (%s)", *p.int16_dot, p.int16_dot_isa.c_str());
  std::printf("\n");
}

TEST(CpuPeak, CachedPerThreadCount) {
  const PeakGflops a = measure_peak_gflops(1, 0.05);
  const PeakGflops b = measure_peak_gflops(1, 0.05);
  EXPECT_EQ(a.f32_fma, b.f32_fma);  // the cached value, bit for bit
  EXPECT_EQ(a.bf16_dot, b.bf16_dot);
  EXPECT_EQ(a.amx_bf16, b.amx_bf16);
  EXPECT_EQ(a.threads, b.threads);
  EXPECT_EQ(a.isa, b.isa);

  const PeakGflops c = measure_peak_gflops(2, 0.05);
  expect_sane(c, 2);
  const PeakGflops d = measure_peak_gflops(2, 0.05);
  EXPECT_EQ(c.f32_fma, d.f32_fma);
  EXPECT_EQ(c.bf16_dot, d.bf16_dot);
  EXPECT_EQ(c.threads, d.threads);
}

// More threads than the process may run on would only time-share its CPUs (and, timed one by
// one, add up to a rate above the machine's): the measurement runs on the CPUs it has.
TEST(CpuPeak, AtMostTheCpusTheProcessMayRunOn) {
  const int cpus = affinity_cpus();
  EXPECT_GE(cpus, 1);
  EXPECT_LE(cpus, cpu_features().logical_cpus);
  const PeakGflops p = measure_peak_gflops(cpus + 2, 0.05);
  EXPECT_EQ(p.threads, cpus);
  const PeakGflops q = measure_peak_gflops(cpus, 0.05);
  EXPECT_EQ(p.f32_fma, q.f32_fma);  // the same measurement
}

TEST(CpuPeak, NonPositiveThreadsMeansAllCpus) {
  const int n = affinity_cpus();
  const PeakGflops a = measure_peak_gflops(0, 0.05);
  expect_sane(a, n);
  const PeakGflops b = measure_peak_gflops(n, 0.05);
  EXPECT_EQ(a.f32_fma, b.f32_fma);  // same cache entry
}

}  // namespace
}  // namespace dattn
