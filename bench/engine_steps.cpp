// One work item of an engine's inner loop, step by step: Q.K^T, the softmax and P.V (the steps of
// kernels.hpp's attend_tile_by_tile) on one thread over `tiles` K/V tiles of 64 keys that stay
// hot in L2, timed apart, for engines named on the command line and measured in interleaved
// rounds (best of each). N(0, 1) inputs, the SAGE engines' operands packed once outside the
// timing. What `dattn bench` cannot show: where the engine's time goes inside an item, against
// the FMA / integer-dot rates `dattn info` measures.
//
//   bench_engine_steps [--rows 256] [--d 128] [--tiles 16] [--rounds 5] ENGINE[:PV_DTYPE]...
//   bench_engine_steps --row-softmax [--rows 256] [--tiles 8] [--rounds 5] ENGINE...
//   bench_engine_steps --ceilings [--rounds 5]
//
// ENGINE is an engine of `dattn info` (emulated twins included); a SAGE engine takes
// :auto, :int16, :int8, :bf16 or :f32 for its P.V (default auto). GFLOP/s count 4 rows x keys x d
// per item (2 for Q.K^T, 2 for P.V); a step's figure is its half at that step's time. With an
// integer P.V (:int8, :int16, and auto where it takes one) the softmax step also makes P's codes.
//
// --row-softmax times the engine's row softmax instead (RowSoftmax: the amx engines' softmax over
// a panel of `tiles` key tiles; N(0, 1) dot products scaled in the exponent), softmax_rows_pairs
// and softmax_rows, in nanoseconds per 16 logits (best of the rounds).
//
// --ceilings times the engines' inner-loop instruction mixes alone, operands in registers and
// the broadcast groups in L1, on one thread, each in its kernel's register shape: the f32 FMA
// (avx2's and avx512's Q.K^T and P.V, ymm and zmm), avx2_int8's Q.K^T step (vpbroadcastd, vpxor,
// vpmaddubsw, vpmaddwd by ones, vpaddd: DATTN_SIGN_STEP in kernels_int8_avx2.cpp) and its P.V
// step on int16 pairs (vpbroadcastd, vpmaddwd, vpaddd: DATTN_MADD4X2), avx_vnni's (vpdpbusd,
// vpdpwssd on ymm), avx512_bf16's vdpbf16ps step, and avx512_vnni's (vpdpbusd, vpdpwssd on zmm);
// a mix this CPU (or DATTN_CPU_FEATURES) lacks prints "-". Their rates bound what an item's qk
// GF/s and pv GF/s can reach on this core, so a SAGE engine's ceiling against FLASH's reads off
// one run. Exits 77 (nothing timed) without AVX2 and FMA.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "backends/flash/engines.hpp"
#include "backends/flash/kernels.hpp"
#include "dattn/cpu_info.hpp"

namespace {
using namespace dattn::flash;

struct Item {
  std::string label;
  const TileKernels* kk;
  std::vector<unsigned char> ws;
  std::vector<std::vector<unsigned char>> k_tiles, v_tiles;
  double best[4] = {1e300, 1e300, 1e300, 1e300};  // item, qk, softmax, pv (seconds)
};

void* aligned64(std::vector<unsigned char>& b) {
  const auto p = reinterpret_cast<std::uintptr_t>(b.data());
  return reinterpret_cast<void*>((p + 63) / 64 * 64);
}

PvDtype pv_of(std::string_view s) {
  if (s == "auto") return PvDtype::automatic;
  if (s == "int16") return PvDtype::int16;
  if (s == "int8") return PvDtype::int8;
  if (s == "bf16") return PvDtype::bf16;
  if (s == "f32") return PvDtype::f32;
  throw std::invalid_argument("pv_dtype must be auto, int16, int8, bf16 or f32, not " +
                              std::string(s));
}

#if defined(__x86_64__)
// The mixes of --ceilings: `iters` times a block of the kernel's instructions (time_ceilings
// counts each block's operations, 2 a multiply-add). The accumulators are the kernels' (4 x 2 for
// the 256-bit integer steps, 8 x 2 for the 512-bit dot steps, 12 for the FMA: enough to cover its
// latency) and nothing leaves the registers; every register starts at zero (no denormals) and the
// upper halves are cleared after.
alignas(64) std::uint32_t g_groups[64];

#define DATTN_ALL_VECTORS                                                                  \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
      "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
struct ZeroedVectors {
  __attribute__((target("avx2"))) ZeroedVectors() {
    __asm__ volatile("vzeroall" ::: DATTN_ALL_VECTORS);
  }
  __attribute__((target("avx2"))) ~ZeroedVectors() {
    __asm__ volatile("vzeroupper" ::: DATTN_ALL_VECTORS);
  }
};

// The f32 FMA mix in either register width R ("ymm", "zmm"): X broadcast against B0-B2 into 12
// accumulators, twice.
// clang-format off
#define DATTN_CEIL_FMA(R, X, B, A) "vfmadd231ps %%" R X ", %%" R B ", %%" R A "\n\t"
#define DATTN_CEIL_FMA_MIX(NAME, TARGET, ZEROED, R, X, B0, B1, B2)                                 \
  __attribute__((target(TARGET))) void NAME(long iters) {                                          \
    const ZEROED zeroed;                                                                           \
    for (long i = 0; i < iters; ++i)                                                               \
      __asm__ volatile(                                                                            \
          ".rept 2\n\t"                                                                            \
          DATTN_CEIL_FMA(R, X, B0, "0") DATTN_CEIL_FMA(R, X, B1, "1")                              \
          DATTN_CEIL_FMA(R, X, B2, "2") DATTN_CEIL_FMA(R, X, B0, "3")                              \
          DATTN_CEIL_FMA(R, X, B1, "4") DATTN_CEIL_FMA(R, X, B2, "5")                              \
          DATTN_CEIL_FMA(R, X, B0, "6") DATTN_CEIL_FMA(R, X, B1, "7")                              \
          DATTN_CEIL_FMA(R, X, B2, "8") DATTN_CEIL_FMA(R, X, B0, "9")                              \
          DATTN_CEIL_FMA(R, X, B1, "10") DATTN_CEIL_FMA(R, X, B2, "11")                            \
          ".endr" ::                                                                               \
              : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",    \
                "xmm10", "xmm11");                                                                 \
  }
// clang-format on
DATTN_CEIL_FMA_MIX(mix_fma, "avx2,fma", ZeroedVectors, "ymm", "12", "13", "14", "15")

// clang-format off
#define DATTN_CEIL_SIGN(B, A0, A1)                                                                 \
  "vpbroadcastd " B "(%0), %%ymm10\n\t vpxor %%ymm8, %%ymm10, %%ymm11\n\t"                       \
  "vpxor %%ymm9, %%ymm10, %%ymm12\n\t vpmaddubsw %%ymm11, %%ymm13, %%ymm11\n\t"                   \
  "vpmaddubsw %%ymm12, %%ymm14, %%ymm12\n\t vpmaddwd %%ymm15, %%ymm11, %%ymm11\n\t"               \
  "vpmaddwd %%ymm15, %%ymm12, %%ymm12\n\t vpaddd %%ymm11, " A0 ", " A0 "\n\t"                     \
  "vpaddd %%ymm12, " A1 ", " A1 "\n\t"
#define DATTN_CEIL_MADD(B, A0, A1)                                                                 \
  "vpbroadcastd " B "(%0), %%ymm10\n\t vpmaddwd %%ymm10, %%ymm8, %%ymm11\n\t"                    \
  "vpmaddwd %%ymm10, %%ymm9, %%ymm12\n\t vpaddd %%ymm11, " A0 ", " A0 "\n\t"                      \
  "vpaddd %%ymm12, " A1 ", " A1 "\n\t"
// clang-format on

__attribute__((target("avx2,fma"))) void mix_int8_qk(long iters) {
  const ZeroedVectors zeroed;
  for (long i = 0; i < iters; ++i)
    __asm__ volatile(
        DATTN_CEIL_SIGN("0", "%%ymm0", "%%ymm1") DATTN_CEIL_SIGN("4", "%%ymm2", "%%ymm3")
            DATTN_CEIL_SIGN("8", "%%ymm4", "%%ymm5") DATTN_CEIL_SIGN("12", "%%ymm6", "%%ymm7")
        :
        : "r"(g_groups)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm10", "xmm11", "xmm12",
          "memory");
}

__attribute__((target("avx2,fma"))) void mix_int16_pv(long iters) {
  const ZeroedVectors zeroed;
  for (long i = 0; i < iters; ++i)
    __asm__ volatile(
        DATTN_CEIL_MADD("0", "%%ymm0", "%%ymm1") DATTN_CEIL_MADD("4", "%%ymm2", "%%ymm3")
            DATTN_CEIL_MADD("8", "%%ymm4", "%%ymm5") DATTN_CEIL_MADD("12", "%%ymm6", "%%ymm7")
        :
        : "r"(g_groups)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm10", "xmm11", "xmm12",
          "memory");
}

// AVX-VNNI (vpdpbusd / vpdpwssd on 256-bit registers, VEX-encoded: `{vex}`, its braces escaped
// as %{ %} in inline assembly): avx_vnni's Q.K^T and int16 P.V steps in its 4 x 2 shape
// (avx2_int8's).
// clang-format off
#define DATTN_CEIL_VNNI(INSN, B, A0, A1)                                                           \
  "vpbroadcastd " B "(%0), %%ymm10\n\t %{vex%} " INSN " %%ymm10, %%ymm8, " A0 "\n\t"              \
  "%{vex%} " INSN " %%ymm10, %%ymm9, " A1 "\n\t"
#define DATTN_CEIL_VNNI_MIX(NAME, INSN)                                                            \
  __attribute__((target("avx2,fma,avxvnni"))) void NAME(long iters) {                              \
    const ZeroedVectors zeroed;                                                                    \
    for (long i = 0; i < iters; ++i)                                                               \
      __asm__ volatile(                                                                            \
          DATTN_CEIL_VNNI(INSN, "0", "%%ymm0", "%%ymm1")                                          \
          DATTN_CEIL_VNNI(INSN, "4", "%%ymm2", "%%ymm3")                                          \
          DATTN_CEIL_VNNI(INSN, "8", "%%ymm4", "%%ymm5")                                          \
          DATTN_CEIL_VNNI(INSN, "12", "%%ymm6", "%%ymm7")                                         \
          :                                                                                        \
          : "r"(g_groups)                                                                          \
          : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm10", "memory");    \
  }
// clang-format on
DATTN_CEIL_VNNI_MIX(mix_vnni256_qk, "vpdpbusd")
DATTN_CEIL_VNNI_MIX(mix_vnni256_pv16, "vpdpwssd")

// AVX-512: zmm0-15 the accumulators, zmm16 / zmm17 the two vectors of the other operand, zmm18
// the broadcast; in the 8 x 2 shape of avx512_vnni's Q.K^T (8 keys x 32 query rows) and int16
// P.V (8 rows x 32 columns), which avx512_bf16's vdpbf16ps steps share.
// clang-format off
#define DATTN_CEIL_ZMM(INSN, B, A0, A1)                                                            \
  "vpbroadcastd " B "(%0), %%zmm18\n\t " INSN " %%zmm18, %%zmm16, %%zmm" A0 "\n\t"               \
  INSN " %%zmm18, %%zmm17, %%zmm" A1 "\n\t"
#define DATTN_CEIL_ZMM_MIX(NAME, TARGET, INSN)                                                     \
  __attribute__((target(TARGET))) void NAME(long iters) {                                          \
    const ZeroedZmm zeroed;                                                                        \
    for (long i = 0; i < iters; ++i)                                                               \
      __asm__ volatile(                                                                            \
          DATTN_CEIL_ZMM(INSN, "0", "0", "1") DATTN_CEIL_ZMM(INSN, "4", "2", "3")                  \
          DATTN_CEIL_ZMM(INSN, "8", "4", "5") DATTN_CEIL_ZMM(INSN, "12", "6", "7")                 \
          DATTN_CEIL_ZMM(INSN, "16", "8", "9") DATTN_CEIL_ZMM(INSN, "20", "10", "11")              \
          DATTN_CEIL_ZMM(INSN, "24", "12", "13") DATTN_CEIL_ZMM(INSN, "28", "14", "15")            \
          :                                                                                        \
          : "r"(g_groups)                                                                          \
          : DATTN_ZMM_ACCUMULATORS, "xmm18", "memory");                                            \
  }
// clang-format on
#define DATTN_ZMM_ACCUMULATORS                                                             \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
      "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"
struct ZeroedZmm {
  __attribute__((target("avx512f"))) ZeroedZmm() {
    __asm__ volatile(
        "vzeroall\n\t vpxord %%zmm16, %%zmm16, %%zmm16\n\t"
        "vpxord %%zmm17, %%zmm17, %%zmm17\n\t vpxord %%zmm18, %%zmm18, %%zmm18\n\t"
        "vpxord %%zmm19, %%zmm19, %%zmm19" ::
            : DATTN_ZMM_ACCUMULATORS, "xmm16", "xmm17", "xmm18", "xmm19");
  }
  __attribute__((target("avx512f"))) ~ZeroedZmm() {
    __asm__ volatile("vzeroupper" ::: DATTN_ZMM_ACCUMULATORS);
  }
};
DATTN_CEIL_ZMM_MIX(mix_zmm_vnni_qk, "avx512f,avx512vnni", "vpdpbusd")
DATTN_CEIL_ZMM_MIX(mix_zmm_pv16, "avx512f,avx512vnni", "vpdpwssd")
DATTN_CEIL_ZMM_MIX(mix_zmm_bf16, "avx512f,avx512bf16", "vdpbf16ps")

DATTN_CEIL_FMA_MIX(mix_zmm_fma, "avx512f", ZeroedZmm, "zmm", "16", "17", "18", "19")
#undef DATTN_CEIL_FMA
#undef DATTN_CEIL_FMA_MIX
#undef DATTN_CEIL_SIGN
#undef DATTN_CEIL_MADD
#undef DATTN_CEIL_VNNI
#undef DATTN_CEIL_VNNI_MIX
#undef DATTN_CEIL_ZMM
#undef DATTN_CEIL_ZMM_MIX
#undef DATTN_ZMM_ACCUMULATORS
#undef DATTN_ALL_VECTORS

int time_ceilings(int rounds) {
  const dattn::CpuFeatures& f = dattn::cpu_features();
  const bool avx2 = f.avx2 && f.fma, avx512 = f.avx512f && f.avx512bw && f.avx512vl;
  if (!avx2) {
    // Nothing to time (CTest reads 77 as skipped: tests/CMakeLists.txt).
    std::printf("--ceilings times AVX2 instructions and more; this CPU lacks AVX2 and FMA\n");
    return 77;
  }
  // ops: operations (2 a multiply-add) of one block of run's loop; base: the mix the line is
  // read against (the f32 FMA of the same register width: kYmm or kZmm).
  constexpr int kYmm = 0, kZmm = 5;
  struct Mix {
    const char* name;
    void (*run)(long);
    double ops;
    int base;
    const char* needs;  // nullptr where this CPU runs it, else the features it lacks
    double best = 1e300;
  };
  const auto lacks = [](bool has, const char* what) { return has ? nullptr : what; };
  Mix mixes[] = {
      {"f32 FMA (vfmadd231ps ymm): avx2's Q.K^T and P.V", &mix_fma, 24 * 16, kYmm, nullptr},
      {"avx2_int8 Q.K^T step (vpbroadcastd, vpxor, vpmaddubsw, vpmaddwd, vpaddd)", &mix_int8_qk,
       8 * 32 * 2, kYmm, nullptr},
      {"int16 pairs (vpbroadcastd, vpmaddwd, vpaddd): avx2_int8 P.V, avx2_int16", &mix_int16_pv,
       8 * 16 * 2, kYmm, nullptr},
      {"avx_vnni Q.K^T step (vpbroadcastd, vpdpbusd ymm)", &mix_vnni256_qk, 8 * 32 * 2, kYmm,
       lacks(f.avx_vnni, "AVX-VNNI")},
      {"int16 pairs (vpbroadcastd, vpdpwssd ymm): avx_vnni P.V, avx_vnni_int16", &mix_vnni256_pv16,
       8 * 16 * 2, kYmm, lacks(f.avx_vnni, "AVX-VNNI")},
      {"f32 FMA (vfmadd231ps zmm): avx512's Q.K^T and P.V", &mix_zmm_fma, 24 * 32, kZmm,
       lacks(avx512, "AVX-512")},
      {"avx512_bf16 step (vpbroadcastd, vdpbf16ps zmm): FLASH's Q.K^T and P.V", &mix_zmm_bf16,
       16 * 32 * 2, kZmm, lacks(avx512 && f.avx512_bf16, "AVX512-BF16")},
      {"avx512_vnni Q.K^T step (vpbroadcastd, vpdpbusd zmm)", &mix_zmm_vnni_qk, 16 * 64 * 2, kZmm,
       lacks(avx512 && f.avx512_vnni, "AVX512-VNNI")},
      {"int16 pairs (vpbroadcastd, vpdpwssd zmm): avx512_vnni P.V, avx512_vnni_int16",
       &mix_zmm_pv16, 16 * 32 * 2, kZmm, lacks(avx512 && f.avx512_vnni, "AVX512-VNNI")},
  };
  constexpr long kIters = 8'000'000;
  using clock = std::chrono::steady_clock;
  for (int round = 0; round < rounds; ++round)
    for (Mix& m : mixes) {
      if (m.needs != nullptr) continue;
      const auto t0 = clock::now();
      m.run(kIters);
      m.best = std::min(m.best, std::chrono::duration<double>(clock::now() - t0).count() /
                                    (m.ops * double(kIters)));
    }
  std::printf("instruction mixes alone, 1 thread, best of %d rounds (GOP/s: 2 a multiply-add)\n",
              rounds);
  for (const Mix& m : mixes) {
    if (m.needs != nullptr) {
      std::printf("%-76s %8s (this CPU lacks %s)\n", m.name, "-", m.needs);
      continue;
    }
    std::printf("%-76s %8.1f GOP/s %6.2fx %s\n", m.name, 1e-9 / m.best, mixes[m.base].best / m.best,
                m.base == kYmm ? "FMA ymm" : "FMA zmm");
  }
  return 0;
}
#else
int time_ceilings(int) {
  throw std::invalid_argument("--ceilings times x86-64 AVX2 instructions");
}
#endif

int usage() {
  std::fprintf(stderr,
               "usage: bench_engine_steps [--rows N] [--d N] [--tiles N] [--rounds N] "
               "ENGINE[:PV_DTYPE]...\n"
               "       bench_engine_steps --row-softmax [--rows N] [--tiles N] [--rounds N] "
               "ENGINE...\n"
               "       bench_engine_steps --ceilings [--rounds N]\n");
  return 2;
}

// --row-softmax: RowSoftmax's two functions on rows x keys logits, interleaved over the engines.
int time_row_softmax(const std::vector<std::string>& names, int rows, int keys, int rounds) {
  const int kp = (keys + 15) / 16 * 16, pairs = ((keys + 1) / 2 + 15) / 16 * 16;
  const std::int64_t lds = kp + 16, ldp = pairs + 16;
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  std::vector<float> logits(std::size_t(rows) * lds);
  for (float& x : logits) x = normal(gen) * 11.3f;  // dot products of N(0, 1) rows, d 128
  const float scale = 1.0f / std::sqrt(128.0f);
  std::vector<float> s(logits.size()), m(rows), l(rows), alpha(rows);
  std::vector<std::uint32_t> p(std::size_t(rows) * ldp);
  std::vector<std::array<double, 2>> best(names.size(), {1e300, 1e300});
  using clock = std::chrono::steady_clock;
  for (int round = 0; round < rounds; ++round)
    for (std::size_t i = 0; i < names.size(); ++i) {
      const RowSoftmax& rs = engine_named(names[i], "engine").kernels().row_softmax;
      for (int which = 0; which < 2; ++which)
        for (int rep = 0; rep < 16; ++rep) {
          std::copy(logits.begin(), logits.end(), s.begin());
          std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
          std::fill(l.begin(), l.end(), 0.0f);
          const auto t0 = clock::now();
          if (which == 0)
            rs.softmax_rows_pairs(s.data(), lds, rows, keys, scale, true, m.data(), l.data(),
                                  alpha.data(), p.data(), ldp, pairs);
          else
            rs.softmax_rows(s.data(), lds, rows, keys, scale, true, m.data(), l.data(),
                            alpha.data());
          best[i][which] =
              std::min(best[i][which], std::chrono::duration<double>(clock::now() - t0).count());
        }
    }
  std::printf(
      "row softmax: %d rows x %d keys (raw dot products), 1 thread, best of %d rounds x 16\n", rows,
      keys, rounds);
  std::printf("%-22s %22s %22s\n", "engine", "pairs ns/16 logits", "f32 ns/16 logits");
  const double groups = double(rows) * kp / 16.0;
  for (std::size_t i = 0; i < names.size(); ++i)
    std::printf("%-22s %22.2f %22.2f\n", names[i].c_str(), best[i][0] * 1e9 / groups,
                best[i][1] * 1e9 / groups);
  return 0;
}
}  // namespace

int main(int argc, char** argv) try {
  int rows = 256, d = 128, tiles = 16, rounds = 5;
  bool row_softmax = false, ceilings = false, tiles_given = false;
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--row-softmax") {
      row_softmax = true;
    } else if (a == "--ceilings") {
      ceilings = true;
    } else if ((a == "--rows" || a == "--d" || a == "--tiles" || a == "--rounds") && i + 1 < argc) {
      const int v = std::atoi(argv[++i]);
      if (v <= 0) return usage();
      (a == "--rows" ? rows : a == "--d" ? d : a == "--tiles" ? tiles : rounds) = v;
      tiles_given = tiles_given || a == "--tiles";
    } else if (!a.empty() && a[0] != '-') {
      names.push_back(a);
    } else {
      return usage();
    }
  }
  if (ceilings) return names.empty() && !row_softmax ? time_ceilings(rounds) : usage();
  if (names.empty()) return usage();
  if (row_softmax)
    return time_row_softmax(names, rows, (tiles_given ? tiles : 8) * kTileKeys, rounds);
  constexpr int keys = kTileKeys;
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  const std::int64_t ldkv = d + 16;
  std::vector<float> k(std::size_t(tiles) * keys * ldkv), v(k.size());
  for (float& x : k) x = normal(gen);
  for (float& x : v) x = normal(gen);

  std::vector<Item> items;
  for (const std::string& n : names) {
    const std::size_t colon = n.find(':');
    const Engine& e = engine_named(n.substr(0, colon), "engine");
    Item it;
    it.label = n;
    it.kk = e.compute == ComputeDtype::int8
                ? &int8_engine_kernels(e, colon == std::string::npos
                                              ? PvDtype::automatic
                                              : pv_of(std::string_view(n).substr(colon + 1)))
                : &e.kernels();
    items.push_back(std::move(it));
  }
  // Per engine: rows padded to its row alignment, Q^T, scratch, packed tiles.
  struct Buffers {
    int rows_p;
    std::int64_t ld;
    std::vector<float> qt, st, o, m, l, alpha;
  };
  std::vector<Buffers> bufs;
  for (Item& it : items) {
    const TileKernels& kk = *it.kk;
    Buffers b;
    b.rows_p = (rows + kk.row_align - 1) / kk.row_align * kk.row_align;
    b.ld = b.rows_p + 16;
    b.qt.resize(std::size_t(d) * b.ld);
    for (float& x : b.qt) x = normal(gen);
    b.st.resize(std::size_t(keys) * b.ld);
    b.o.assign(std::size_t(b.rows_p) * ldkv, 0.0f);
    b.m.resize(b.rows_p);
    b.l.resize(b.rows_p);
    b.alpha.resize(b.rows_p);
    const float scale = 1.0f / std::sqrt(float(d));
    if (kk.formats.workspace_bytes != nullptr) {
      it.ws.resize(kk.formats.workspace_bytes(b.rows_p, d, d) + 64);
      kk.formats.pack_q(b.qt.data(), b.ld, b.rows_p, d, d, scale, aligned64(it.ws));
    }
    if (kk.formats.own())
      for (int t = 0; t < tiles; ++t) {
        it.k_tiles.emplace_back(kk.formats.k_tile_bytes(d) + 64);
        it.v_tiles.emplace_back(kk.formats.v_tile_bytes(d) + 64);
        kk.formats.pack_k(k.data() + std::size_t(t) * keys * ldkv, ldkv, keys, d,
                          aligned64(it.k_tiles.back()));
        kk.formats.pack_v(v.data() + std::size_t(t) * keys * ldkv, ldkv, keys, d,
                          aligned64(it.v_tiles.back()));
      }
    if (!kk.steps.qk || !kk.steps.softmax_tile || !kk.steps.pv)
      throw std::invalid_argument(std::string(kk.engine) +
                                  " has its own inner loop (no tile-by-tile steps to time)");
    bufs.push_back(std::move(b));
  }
  using clock = std::chrono::steady_clock;
  const int reps = std::max(1, 256 / tiles);
  for (int round = 0; round < rounds; ++round)
    for (std::size_t i = 0; i < items.size(); ++i) {
      Item& it = items[i];
      Buffers& b = bufs[i];
      const TileKernels& kk = *it.kk;
      void* ws = it.ws.empty() ? nullptr : aligned64(it.ws);
      for (int rep = 0; rep < reps; ++rep) {
        std::fill(b.m.begin(), b.m.end(), -std::numeric_limits<float>::infinity());
        std::fill(b.l.begin(), b.l.end(), 0.0f);
        double t[3] = {0, 0, 0};
        const auto t0 = clock::now();
        for (int n = 0; n < tiles; ++n) {
          const void* kp = kk.formats.own()
                               ? aligned64(it.k_tiles[n])
                               : static_cast<const void*>(k.data() + std::size_t(n) * keys * ldkv);
          const void* vp = kk.formats.own()
                               ? aligned64(it.v_tiles[n])
                               : static_cast<const void*>(v.data() + std::size_t(n) * keys * ldkv);
          const auto a = clock::now();
          kk.steps.qk(kp, ldkv, b.qt.data(), b.ld, b.st.data(), b.ld, keys, b.rows_p, d, ws);
          const auto s = clock::now();
          kk.steps.softmax_tile(b.st.data(), b.ld, keys, b.rows_p, b.m.data(), b.l.data(),
                                b.alpha.data(), ws);
          const auto p = clock::now();
          kk.steps.pv(b.st.data(), b.ld, vp, ldkv, b.o.data(), ldkv, b.alpha.data(), rows, keys, d,
                      ws);
          const auto e = clock::now();
          t[0] += std::chrono::duration<double>(s - a).count();
          t[1] += std::chrono::duration<double>(p - s).count();
          t[2] += std::chrono::duration<double>(e - p).count();
        }
        const double total = std::chrono::duration<double>(clock::now() - t0).count();
        it.best[0] = std::min(it.best[0], total);
        for (int j = 0; j < 3; ++j) it.best[j + 1] = std::min(it.best[j + 1], t[j]);
      }
    }
  const double flops = 4.0 * rows * keys * double(d) * tiles;
  std::printf("one item: %d rows x %d tiles of %d keys, d %d, 1 thread, best of %d rounds x %d\n",
              rows, tiles, keys, d, rounds, reps);
  std::printf("%-22s %-14s %9s %8s %8s %8s %9s %9s\n", "engine", "kernels", "GFLOP/s", "qk%",
              "softmax%", "pv%", "qk GF/s", "pv GF/s");
  for (const Item& it : items)
    std::printf("%-22s %-14s %9.1f %8.1f %8.1f %8.1f %9.1f %9.1f\n", it.label.c_str(),
                std::string(it.kk->engine).c_str(), flops / it.best[0] / 1e9,
                100 * it.best[1] / it.best[0], 100 * it.best[2] / it.best[0],
                100 * it.best[3] / it.best[0], flops / 2 / it.best[1] / 1e9,
                flops / 2 / it.best[3] / 1e9);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_engine_steps: %s\n", e.what());
  return 1;
}
