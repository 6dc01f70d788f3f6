// Measured peak arithmetic rate: independent FMA chains that live in registers, run on every
// requested thread at once. Each ISA's loop is compiled with a function target attribute so the
// file needs no -march flags, and is only called when cpu_features() reports the ISA (the AMX
// loop only where detail::amx_unavailable() is nullopt: Linux has granted the tile state).
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/amx_permission.hpp"
#include "core/cpu_peak.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/errors.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace dattn {

namespace {

// Each loop runs `iters` iterations of kChains independent FMA chains and returns a checksum of
// the accumulators, which the caller stores to a volatile: the work can't be optimised away.
// acc = acc * m + c with m just below 1 converges to c / (1 - m), so values stay normal (no
// overflow, no denormal slow paths) however long it runs.
#if defined(__aarch64__)
// FMLA, BFDOT and SDOT: latency 4 (3 for SDOT) on 4 128-bit pipes on Neoverse V1 and V2; the
// 32 NEON registers hold the 16 accumulators and the operands.
constexpr int kChains = 16;
#else
constexpr int kChains = 12;  // covers latency 4-6 x 2 pipes on current x86 cores
#endif
constexpr float kMul = 0.99999f;
constexpr float kAdd = 1e-3f;

using Kernel = float (*)(long long iters, float seed);

// Repeats a statement for chains 0..kChains - 1 (explicit, so the accumulators stay in
// registers).
#if defined(__aarch64__)
#define DATTN_CHAINS(X) \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#else
#define DATTN_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#endif

#if defined(__x86_64__)

__attribute__((target("avx2,fma"))) float fma_avx2(long long iters, float seed) {
  const __m256 m = _mm256_set1_ps(kMul);
  const __m256 c = _mm256_set1_ps(kAdd);
#define DATTN_INIT(k) __m256 a##k = _mm256_set1_ps(seed + static_cast<float>(k));
#define DATTN_STEP(k) a##k = _mm256_fmadd_ps(a##k, m, c);
#define DATTN_SUM(k) s = _mm256_add_ps(s, a##k);
  DATTN_CHAINS(DATTN_INIT)
  for (long long i = 0; i < iters; ++i) {
    DATTN_CHAINS(DATTN_STEP)
  }
  __m256 s = _mm256_setzero_ps();
  DATTN_CHAINS(DATTN_SUM)
#undef DATTN_INIT
#undef DATTN_STEP
#undef DATTN_SUM
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  float total = 0;
  for (float v : lanes) total += v;
  return total;
}

// Horizontal sum through memory (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized).
__attribute__((target("avx512f"))) float sum_lanes(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float total = 0;
  for (float x : lanes) total += x;
  return total;
}

__attribute__((target("avx512f"))) float fma_avx512(long long iters, float seed) {
  const __m512 m = _mm512_set1_ps(kMul);
  const __m512 c = _mm512_set1_ps(kAdd);
#define DATTN_INIT(k) __m512 a##k = _mm512_set1_ps(seed + static_cast<float>(k));
#define DATTN_STEP(k) a##k = _mm512_fmadd_ps(a##k, m, c);
#define DATTN_SUM(k) s = _mm512_add_ps(s, a##k);
  DATTN_CHAINS(DATTN_INIT)
  for (long long i = 0; i < iters; ++i) {
    DATTN_CHAINS(DATTN_STEP)
  }
  __m512 s = _mm512_setzero_ps();
  DATTN_CHAINS(DATTN_SUM)
#undef DATTN_INIT
#undef DATTN_STEP
#undef DATTN_SUM
  return sum_lanes(s);
}

// vdpbf16ps: acc += a[2i] * b[2i] + a[2i+1] * b[2i+1] per f32 lane. The pairs are (x, -x) x (y, y),
// which cancel exactly, so the accumulators stay at their start values.
__attribute__((target("avx512bf16,avx512f"))) float dot_avx512bf16(long long iters, float seed) {
  const __m512 alt = _mm512_setr_ps(0.5f, -0.5f, 0.5f, -0.5f, 0.5f, -0.5f, 0.5f, -0.5f, 0.5f, -0.5f,
                                    0.5f, -0.5f, 0.5f, -0.5f, 0.5f, -0.5f);
  const __m512bh x = _mm512_cvtne2ps_pbh(alt, alt);
  const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.25f), _mm512_set1_ps(0.25f));
#define DATTN_INIT(k) __m512 a##k = _mm512_set1_ps(seed + static_cast<float>(k));
#define DATTN_STEP(k) a##k = _mm512_dpbf16_ps(a##k, x, y);
#define DATTN_SUM(k) s = _mm512_add_ps(s, a##k);
  DATTN_CHAINS(DATTN_INIT)
  for (long long i = 0; i < iters; ++i) {
    DATTN_CHAINS(DATTN_STEP)
  }
  __m512 s = _mm512_setzero_ps();
  DATTN_CHAINS(DATTN_SUM)
#undef DATTN_INIT
#undef DATTN_STEP
#undef DATTN_SUM
  return sum_lanes(s);
}

// The integer dot products, 12 independent int32 chains of one instruction each (the integers
// wrap harmlessly; the lanes' sum is returned so that nothing is optimised away), one function
// per instruction and register width:
// - the SAGE engines' 8-bit dot: vpdpbusd on 512-bit (64 byte products per instruction) or
//   256-bit registers (32), and AVX2's sign trick (dot_avx2_sign below);
// - the 16-bit integer lanes: vpdpwssd (int16 pairs multiplied, both products added to the
//   int32 lane) on 512-bit (32 products) or 256-bit registers (16), and AVX2's vpmaddwd +
//   vpaddd (dot16_avx2 below).
// NAME, its TARGET, the register type REG with its SET1, ADD, ZERO and STORE, the step
// DOT(acc, x, y) on the constant operands X and Y (32-bit patterns).
#define DATTN_CHAINS_ARG(X, A) \
  X(0, A) X(1, A) X(2, A) X(3, A) X(4, A) X(5, A) X(6, A) X(7, A) X(8, A) X(9, A) X(10, A) X(11, A)
#define DATTN_INT_INIT(k, SET1) auto a##k = SET1(static_cast<int>(seed) + k);
#define DATTN_INT_STEP(k, DOT) a##k = DOT(a##k, x, y);
#define DATTN_INT_SUM(k, ADD) s = ADD(s, a##k);
#define DATTN_INT_DOT_PEAK(NAME, TARGET, REG, SET1, ADD, ZERO, STORE, DOT, X, Y) \
  __attribute__((target(TARGET))) float NAME(long long iters, float seed) {      \
    const REG x = SET1(static_cast<int>(X)), y = SET1(static_cast<int>(Y));      \
    DATTN_CHAINS_ARG(DATTN_INT_INIT, SET1)                                       \
    for (long long i = 0; i < iters; ++i) {                                      \
      DATTN_CHAINS_ARG(DATTN_INT_STEP, DOT)                                      \
    }                                                                            \
    REG s = ZERO();                                                              \
    DATTN_CHAINS_ARG(DATTN_INT_SUM, ADD)                                         \
    alignas(64) std::int32_t lanes[sizeof(REG) / 4];                             \
    STORE(reinterpret_cast<REG*>(lanes), s);                                     \
    std::int64_t total = 0;                                                      \
    for (std::int32_t v : lanes) total += v;                                     \
    return static_cast<float>(total);                                            \
  }

DATTN_INT_DOT_PEAK(dot_avx512vnni, "avx512f,avx512vnni", __m512i, _mm512_set1_epi32,
                   _mm512_add_epi32, _mm512_setzero_si512, _mm512_store_si512, _mm512_dpbusd_epi32,
                   0x01020304, 0x01ff01ff)
DATTN_INT_DOT_PEAK(dot16_avx512vnni, "avx512f,avx512vnni", __m512i, _mm512_set1_epi32,
                   _mm512_add_epi32, _mm512_setzero_si512, _mm512_store_si512, _mm512_dpwssd_epi32,
                   0x00030002, 0xfffe0001)
DATTN_INT_DOT_PEAK(dot_avxvnni, "avx2,avxvnni", __m256i, _mm256_set1_epi32, _mm256_add_epi32,
                   _mm256_setzero_si256, _mm256_store_si256, _mm256_dpbusd_avx_epi32, 0x01020304,
                   0x01ff01ff)
DATTN_INT_DOT_PEAK(dot16_avxvnni, "avx2,avxvnni", __m256i, _mm256_set1_epi32, _mm256_add_epi32,
                   _mm256_setzero_si256, _mm256_store_si256, _mm256_dpwssd_avx_epi32, 0x00030002,
                   0xfffe0001)
#undef DATTN_INT_DOT_PEAK
#undef DATTN_INT_SUM
#undef DATTN_INT_STEP
#undef DATTN_INT_INIT
#undef DATTN_CHAINS_ARG

// The chains of the AVX2 integer loops in assembly (vpmaddwd + vpaddd, and the sign trick below).
constexpr int kSignChains = 8;

// AVX2's vpmaddwd + vpaddd, 8 accumulators: one block of assembly per iteration (as the sign
// trick's below), so that the compiler can neither compute the chains' identical products once
// nor hoist them out of the loop. 12 registers: 8 accumulators, 4 products.
// clang-format off
#define DATTN_MADD_PEAK_STEP(A, T)             \
  "vpmaddwd %[y], %[x], %[" T "]\n\t"           \
  "vpaddd %[" T "], %[" A "], %[" A "]\n\t"
// clang-format on
__attribute__((target("avx2"))) float dot16_avx2(long long iters, float seed) {
  const __m256i x = _mm256_set1_epi32(0x00030002), y = _mm256_set1_epi32(0xfffe0001);
  __m256i a[kSignChains];
  for (int k = 0; k < kSignChains; ++k) a[k] = _mm256_set1_epi32(static_cast<int>(seed) + k);
  __m256i t0, t1, t2, t3;
  for (long long i = 0; i < iters; ++i) {
    __asm__(DATTN_MADD_PEAK_STEP("a0", "t0") DATTN_MADD_PEAK_STEP("a1", "t1")
                DATTN_MADD_PEAK_STEP("a2", "t2") DATTN_MADD_PEAK_STEP("a3", "t3")
                    DATTN_MADD_PEAK_STEP("a4", "t0") DATTN_MADD_PEAK_STEP("a5", "t1")
                        DATTN_MADD_PEAK_STEP("a6", "t2") DATTN_MADD_PEAK_STEP("a7", "t3")
            : [a0] "+x"(a[0]), [a1] "+x"(a[1]), [a2] "+x"(a[2]), [a3] "+x"(a[3]), [a4] "+x"(a[4]),
              [a5] "+x"(a[5]), [a6] "+x"(a[6]), [a7] "+x"(a[7]), [t0] "=&x"(t0), [t1] "=&x"(t1),
              [t2] "=&x"(t2), [t3] "=&x"(t3)
            : [x] "x"(x), [y] "x"(y));
  }
#undef DATTN_MADD_PEAK_STEP
  __m256i s = _mm256_setzero_si256();
  for (int k = 0; k < kSignChains; ++k) s = _mm256_add_epi32(s, a[k]);
  alignas(32) std::int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  std::int64_t total = 0;
  for (std::int32_t v : lanes) total += v;
  return static_cast<float>(total);
}

// avx2_int8's Q.K^T step (the sign trick): vpxor with x's sign masks complements y where x < 0,
// vpmaddubsw multiplies |x| by it (pairs summed in 16 bits), vpmaddwd by ones widens to 32 bits,
// vpaddd accumulates: 32 byte products per four instructions, 8 independent chains (the kernel
// adds back, once per dot, what the complement takes off: kernels_int8_avx2.cpp). One block of
// assembly per iteration, as the kernel's loop body is: the compiler neither shares the steps'
// common vpxor between chains nor spills the accumulators (16 registers: 8 accumulators, 4
// temporaries, |x|, its masks, y and the ones), which its intrinsics loop did (on AMD Zen 4 that
// loop measured 0.78 of the kernel's own Q.K^T rate, this block 1.09x it).
// clang-format off
#define DATTN_SIGN_PEAK_STEP(A, T)               \
  "vpxor %[mx], %[y], %[" T "]\n\t"              \
  "vpmaddubsw %[" T "], %[ux], %[" T "]\n\t"     \
  "vpmaddwd %[ones], %[" T "], %[" T "]\n\t"     \
  "vpaddd %[" T "], %[" A "], %[" A "]\n\t"
// clang-format on
__attribute__((target("avx2"))) float dot_avx2_sign(long long iters, float seed) {
  const __m256i x = _mm256_set1_epi32(0x01fd02fe), y = _mm256_set1_epi32(0x017f0102);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i ux = _mm256_abs_epi8(x);
  const __m256i mx = _mm256_cmpgt_epi8(_mm256_setzero_si256(), x);
  __m256i a[kSignChains];
  for (int k = 0; k < kSignChains; ++k) a[k] = _mm256_set1_epi32(static_cast<int>(seed) + k);
  __m256i t0, t1, t2, t3;
  for (long long i = 0; i < iters; ++i) {
    __asm__(DATTN_SIGN_PEAK_STEP("a0", "t0") DATTN_SIGN_PEAK_STEP("a1", "t1")
                DATTN_SIGN_PEAK_STEP("a2", "t2") DATTN_SIGN_PEAK_STEP("a3", "t3")
                    DATTN_SIGN_PEAK_STEP("a4", "t0") DATTN_SIGN_PEAK_STEP("a5", "t1")
                        DATTN_SIGN_PEAK_STEP("a6", "t2") DATTN_SIGN_PEAK_STEP("a7", "t3")
            : [a0] "+x"(a[0]), [a1] "+x"(a[1]), [a2] "+x"(a[2]), [a3] "+x"(a[3]), [a4] "+x"(a[4]),
              [a5] "+x"(a[5]), [a6] "+x"(a[6]), [a7] "+x"(a[7]), [t0] "=&x"(t0), [t1] "=&x"(t1),
              [t2] "=&x"(t2), [t3] "=&x"(t3)
            : [ux] "x"(ux), [mx] "x"(mx), [y] "x"(y), [ones] "x"(ones));
  }
#undef DATTN_SIGN_PEAK_STEP
  __m256i s = _mm256_setzero_si256();
  for (int k = 0; k < kSignChains; ++k) s = _mm256_add_epi32(s, a[k]);
  alignas(32) std::int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), s);
  std::int64_t total = 0;
  for (std::int32_t v : lanes) total += v;
  return static_cast<float>(total);
}

// AMX-BF16 (palette 1, every tile 16 rows of 64 bytes): tmm0-3 accumulate 16 x 16 f32, tmm4-5
// hold A (16 rows of 32 bf16 = 16 pairs), tmm6-7 hold B (16 rows of 16 bf16 pairs, the pair
// layout tdpbf16ps reads). Each iteration runs the 2 x 2 products C[2i + j] += A[i] . B[j]: four
// independent tdpbf16ps of 16 x 16 x 32 pair products, 16 * 16 * 32 * 2 = 16384 flops each.
// A's pairs are (0.5, -0.5) and B's (0.25, 0.25): each pair's products cancel exactly, so the
// accumulators keep their start values however long it runs. The operands are constants in
// memory, loaded into the tiles once per call: the loop itself touches no memory.
constexpr int kTileRows = 16;   // rows of every tile
constexpr int kTileColsb = 64;  // bytes per row of every tile (16 f32, or 16 bf16 pairs)
constexpr int kAmxAccumulators = 4;
constexpr double kAmxFlopsPerIter = kAmxAccumulators * 16.0 * 16 * 32 * 2;

// Tiles are configured by detail::kAmxTileConfig (core/amx_permission.hpp): 16 x 64 bytes each.
// One operand tile: every bf16 pair is (even, odd), given as bf16 bit patterns.
constexpr std::array<std::uint16_t, kTileRows * kTileColsb / 2> amx_operand(std::uint16_t even,
                                                                            std::uint16_t odd) {
  std::array<std::uint16_t, kTileRows * kTileColsb / 2> a{};
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = i % 2 == 0 ? even : odd;
  return a;
}

alignas(64) constexpr auto kAmxA = amx_operand(0x3f00, 0xbf00);  // (0.5, -0.5)
alignas(64) constexpr auto kAmxB = amx_operand(0x3e80, 0x3e80);  // (0.25, 0.25)

// TDPBSSD (amx_int8) on the same tiles: A's bytes are (1, -1, 1, -1) and B's all 1, so each
// group's four products cancel and the int32 accumulators keep their start values.
alignas(64) constexpr auto kAmxA8 = amx_operand(0xff01, 0xff01);  // bytes 1, -1, 1, -1
alignas(64) constexpr auto kAmxB8 = amx_operand(0x0101, 0x0101);  // bytes 1, 1, 1, 1
constexpr double kAmxInt8OpsPerIter = kAmxAccumulators * 16.0 * 16 * 64 * 2;

// Run on each thread: ldtilecfg is per thread, and tilerelease hands the tile state back so
// that the kernel need not save it on every context switch. Tile numbers are immediates.
// kInt8: tdpbssd on int32 accumulators (executed only where the CPU has AMX-INT8), else
// tdpbf16ps on f32 ones.
template <bool kInt8>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) float dot_amx(long long iters, float seed) {
  using Acc = std::conditional_t<kInt8, std::int32_t, float>;
  alignas(64) Acc c[kAmxAccumulators][kTileRows * kTileColsb / 4];
  for (int t = 0; t < kAmxAccumulators; ++t)
    for (Acc& x : c[t]) x = static_cast<Acc>(seed) + static_cast<Acc>(t);
  const void* a = kInt8 ? kAmxA8.data() : kAmxA.data();
  const void* b = kInt8 ? kAmxB8.data() : kAmxB.data();
  // GCC's tile intrinsics are asm statements that read memory through pointers they do not
  // declare as memory inputs: make the stores above happen before the tile loads.
  __asm__ __volatile__("" : : "r"(&c[0][0]) : "memory");
  _tile_loadconfig(detail::kAmxTileConfig.data());
  _tile_loadd(0, c[0], kTileColsb);
  _tile_loadd(1, c[1], kTileColsb);
  _tile_loadd(2, c[2], kTileColsb);
  _tile_loadd(3, c[3], kTileColsb);
  _tile_loadd(4, a, kTileColsb);
  _tile_loadd(5, a, kTileColsb);
  _tile_loadd(6, b, kTileColsb);
  _tile_loadd(7, b, kTileColsb);
  for (long long i = 0; i < iters; ++i) {
    if constexpr (kInt8) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0], kTileColsb);
  _tile_stored(1, c[1], kTileColsb);
  _tile_stored(2, c[2], kTileColsb);
  _tile_stored(3, c[3], kTileColsb);
  _tile_release();
  __asm__ __volatile__("" : : "r"(&c[0][0]) : "memory");
  float total = 0;
  for (const auto& tile : c)
    for (Acc x : tile) total += static_cast<float>(x);
  return total;
}
float dot_amx_bf16(long long iters, float seed) {
  return dot_amx<false>(iters, seed);
}
float dot_amx_int8(long long iters, float seed) {
  return dot_amx<true>(iters, seed);
}

#endif  // __x86_64__

#if defined(__aarch64__)

float fma_neon(long long iters, float seed) {
  const float32x4_t m = vdupq_n_f32(kMul);
  const float32x4_t c = vdupq_n_f32(kAdd);
#define DATTN_INIT(k) float32x4_t a##k = vdupq_n_f32(seed + static_cast<float>(k));
#define DATTN_STEP(k) a##k = vfmaq_f32(c, a##k, m);
#define DATTN_SUM(k) s = vaddq_f32(s, a##k);
  DATTN_CHAINS(DATTN_INIT)
  for (long long i = 0; i < iters; ++i) {
    DATTN_CHAINS(DATTN_STEP)
  }
  float32x4_t s = vdupq_n_f32(0.0f);
  DATTN_CHAINS(DATTN_SUM)
#undef DATTN_INIT
#undef DATTN_STEP
#undef DATTN_SUM
  return vaddvq_f32(s);
}

// BFDOT (BF16): 4 f32 lanes, each 2 bf16 products per step.
__attribute__((target("arch=armv8.2-a+bf16"))) float dot_neon_bfdot(long long iters, float seed) {
  // The operands from memory: as constants GCC 12 makes them with FMOV's f16 form, which needs
  // FEAT_FP16 besides BF16.
  static volatile std::uint32_t operands[2] = {0xbf003f00u, 0x3e803e80u};  // (0.5, -0.5), 0.25
  const bfloat16x8_t x = vreinterpretq_bf16_u32(vdupq_n_u32(operands[0]));
  const bfloat16x8_t y = vreinterpretq_bf16_u32(vdupq_n_u32(operands[1]));
#define DATTN_INIT(k) float32x4_t a##k = vdupq_n_f32(seed + static_cast<float>(k));
#define DATTN_STEP(k) a##k = vbfdotq_f32(a##k, x, y);
#define DATTN_SUM(k) s = vaddq_f32(s, a##k);
  DATTN_CHAINS(DATTN_INIT)
  for (long long i = 0; i < iters; ++i) {
    DATTN_CHAINS(DATTN_STEP)
  }
  float32x4_t s = vdupq_n_f32(0.0f);
  DATTN_CHAINS(DATTN_SUM)
#undef DATTN_INIT
#undef DATTN_STEP
#undef DATTN_SUM
  return vaddvq_f32(s);
}

// The SAGE engines' 8-bit dots: SDOT (neon_dotprod) and USDOT (neon_i8mm), 16 byte products
// per instruction; the int32 chains wrap harmlessly.
#define DATTN_NEON_INT8_DOT(NAME, TARGET, STEP)                             \
  __attribute__((target(TARGET))) float NAME(long long iters, float seed) { \
    const int8x16_t x = vdupq_n_s8(3);                                      \
    const uint8x16_t ux = vdupq_n_u8(3);                                    \
    const int8x16_t y = vdupq_n_s8(-5);                                     \
    (void)x;                                                                \
    (void)ux;                                                               \
    DATTN_CHAINS(DATTN_INIT)                                                \
    for (long long i = 0; i < iters; ++i) {                                 \
      DATTN_CHAINS(STEP)                                                    \
    }                                                                       \
    int32x4_t s = vdupq_n_s32(0);                                           \
    DATTN_CHAINS(DATTN_SUM)                                                 \
    return static_cast<float>(vaddvq_s32(s));                               \
  }
#define DATTN_INIT(k) int32x4_t a##k = vdupq_n_s32(static_cast<int>(seed) + k);
#define DATTN_SUM(k) s = vaddq_s32(s, a##k);
#define DATTN_SDOT(k) a##k = vdotq_s32(a##k, x, y);
#define DATTN_USDOT(k) a##k = vusdotq_s32(a##k, ux, y);
DATTN_NEON_INT8_DOT(dot_neon_sdot, "arch=armv8.2-a+dotprod", DATTN_SDOT)
DATTN_NEON_INT8_DOT(dot_neon_usdot, "arch=armv8.2-a+i8mm", DATTN_USDOT)
#undef DATTN_INIT
#undef DATTN_SUM
#undef DATTN_SDOT
#undef DATTN_USDOT
#undef DATTN_NEON_INT8_DOT

#endif  // __aarch64__

// Portable fallback: a multiply and an add per chain step (2 flops, fused or not).
float fma_scalar(long long iters, float seed) {
#define DATTN_INIT(k) float a##k = seed + static_cast<float>(k);
#define DATTN_STEP(k) a##k = a##k * kMul + kAdd;
#define DATTN_SUM(k) s += a##k;
  DATTN_CHAINS(DATTN_INIT)
  for (long long i = 0; i < iters; ++i) {
    DATTN_CHAINS(DATTN_STEP)
  }
  float s = 0;
  DATTN_CHAINS(DATTN_SUM)
#undef DATTN_INIT
#undef DATTN_STEP
#undef DATTN_SUM
  return s;
}

#undef DATTN_CHAINS

volatile float g_sink = 0;  // checksums land here so the loops can't be removed
volatile float g_seed = 1.0f;

using Clock = std::chrono::steady_clock;

struct Run {
  double gflops = 0;   // the team's flops over the team's interval
  double seconds = 0;  // the interval: from the barrier all threads start at to the last one done
  int threads = 1;     // threads that actually ran
};

// Runs `fn` on `threads` threads at once, timed as a team on one clock: the interval opens when
// every thread has passed a barrier and closes when the last has finished, so a thread that
// runs late (descheduled, or sharing a CPU with another) makes the interval longer instead of
// adding a rate of its own.
Run run_parallel(Kernel fn, long long iters, int threads, double flops_per_iter) {
  const float seed = g_seed;
  int team = 1;
  float sum = 0;
  Clock::time_point t0, t1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : sum)
  {
#pragma omp barrier
#pragma omp master
    {
      t0 = Clock::now();
      team = omp_get_num_threads();
    }
    sum += fn(iters, seed);
#pragma omp barrier
#pragma omp master
    t1 = Clock::now();
  }
#else
  (void)threads;
  t0 = Clock::now();
  sum = fn(iters, seed);
  t1 = Clock::now();
#endif
  g_sink = sum;
  Run run;
  run.threads = team;
  run.seconds = std::chrono::duration<double>(t1 - t0).count();
  if (run.seconds > 0)
    run.gflops = flops_per_iter * static_cast<double>(iters) * team / run.seconds * 1e-9;
  return run;
}

struct Rate {
  double gflops = 0;
  int threads = 1;
};

// Best rate of a few trials lasting about `seconds` in all. `flops_per_iter` is per thread.
Rate measure(Kernel fn, double flops_per_iter, int threads, double seconds) {
  constexpr int kTrials = 5;
  // Calibrate on one thread: grow the count until a run is long enough to time (this also
  // warms the core up).
  long long iters = 1024;
  Run run = run_parallel(fn, iters, 1, flops_per_iter);
  const double min_calibration = std::min(2e-3, seconds / (4 * kTrials));
  while (run.seconds < min_calibration && iters < (1LL << 40)) {
    iters *= 4;
    run = run_parallel(fn, iters, 1, flops_per_iter);
  }
  // Size the trials from the calibration run.
  const double per_iter = run.seconds > 0 ? run.seconds / static_cast<double>(iters) : 1e-9;
  const double trial_seconds = seconds / kTrials;
  const long long trial_iters = std::clamp(static_cast<long long>(trial_seconds / per_iter), 1024LL,
                                           static_cast<long long>(1LL << 40));
  Rate best;
  for (int t = 0; t < kTrials; ++t) {
    run = run_parallel(fn, trial_iters, threads, flops_per_iter);
    if (run.gflops > best.gflops) {
      best.gflops = run.gflops;
      best.threads = run.threads;
    }
  }
  return best;
}

#if defined(__x86_64__) || defined(__aarch64__)
// One thread's rate of `other` over that of `base` (both in ops): short trials of the two loops
// alternate, so a neighbour taking the core for a while slows both alike, and the best trial of
// each counts; calibrated (and the core warmed up) on `base`.
double interleaved_ratio(Kernel base, double base_ops, Kernel other, double other_ops) {
  long long iters = 1024;
  Run run = run_parallel(base, iters, 1, base_ops);
  while (run.seconds < 5e-4 && iters < (1LL << 40)) {
    iters *= 2;
    run = run_parallel(base, iters, 1, base_ops);
  }
  double b = 0, o = 0;
  for (int t = 0; t < 16; ++t) {  // short trials: some of each run between preemptions
    b = std::max(b, run_parallel(base, iters, 1, base_ops).gflops);
    o = std::max(o, run_parallel(other, iters, 1, other_ops).gflops);
  }
  return b > 0 ? o / b : 0;
}
#endif

#if defined(__x86_64__)
// The 16-bit integer lanes' loop on this CPU (vpdpwssd zmm, vpdpwssd ymm, or AVX2's vpmaddwd +
// vpaddd), its ops per call (2 per int16 product) and its name; fn nullptr without AVX2.
struct Int16Dot {
  Kernel fn = nullptr;
  double ops = 0;
  const char* isa = "";
};
Int16Dot int16_dot_of(const CpuFeatures& f) {
  if (f.avx512f && f.avx512_vnni)
    return {dot16_avx512vnni, 32.0 * 2 * kChains, "avx512_vnni (vpdpwssd)"};
  if (f.avx2 && f.avx_vnni) return {dot16_avxvnni, 16.0 * 2 * kChains, "avx_vnni (vpdpwssd)"};
  if (f.avx2) return {dot16_avx2, 16.0 * 2 * kSignChains, "avx2 (vpmaddwd + vpaddd)"};
  return {};
}
#endif

// One thread's bf16 dot rate (vdpbf16ps, BFDOT) over its f32 FMA rate (both in flops: a bf16 pair
// product and an f32 FMA are 2 flops each), interleaved.
double bf16_dot_ratio_uncached() {
#if defined(__x86_64__)
  const CpuFeatures& f = cpu_features();
  if (!f.avx512f || !f.avx512_bf16) return 0;
  return interleaved_ratio(fma_avx512, 2.0 * 16 * kChains, dot_avx512bf16, 16.0 * 2 * 2 * kChains);
#elif defined(__aarch64__)
  const CpuFeatures& f = cpu_features();
  if (!f.neon || !f.bf16) return 0;
  return interleaved_ratio(fma_neon, 2.0 * 4 * kChains, dot_neon_bfdot, 4.0 * 2 * 2 * kChains);
#else
  return 0;
#endif
}

// One thread's rate on the 16-bit integer lanes the int16 engines use over its f32 FMA rate on
// the f32 engine's registers (AVX-512 or AVX2), both in ops, interleaved; 0 without AVX2.
double int16_dot_ratio_uncached() {
#if defined(__x86_64__)
  const CpuFeatures& f = cpu_features();
  if (!(f.avx2 && f.fma)) return 0;
  const bool wide = f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl;
  const Int16Dot dot = int16_dot_of(f);
  return interleaved_ratio(wide ? fma_avx512 : fma_avx2, 2.0 * (wide ? 16 : 8) * kChains, dot.fn,
                           dot.ops);
#else
  return 0;
#endif
}

PeakGflops measure_uncached(int threads, double seconds) {
  const CpuFeatures& f = cpu_features();
  PeakGflops out;
  Kernel f32 = fma_scalar;
  int lanes = 1;
  out.isa = "scalar";
  bool bf16 = false, amx = false, amx_int8 = false;
#if defined(__x86_64__)
  if (f.avx512f) {
    f32 = fma_avx512;
    lanes = 16;
    out.isa = "avx512f";
  } else if (f.avx2 && f.fma) {
    f32 = fma_avx2;
    lanes = 8;
    out.isa = "avx2+fma";
  }
  bf16 = f.avx512_bf16;
  if (!bf16) out.bf16_dot_unavailable = "this CPU lacks AVX512-BF16 (vdpbf16ps)";
  // Asks Linux for the tile state (once per process) where the CPU has AMX: nothing below runs a
  // tile instruction unless that succeeded.
  const std::optional<std::string>& no_amx = detail::amx_unavailable();
  amx = !no_amx.has_value();
  if (no_amx) out.amx_bf16_unavailable = *no_amx;
  amx_int8 = amx && f.amx_int8;
  if (no_amx)
    out.amx_int8_unavailable = *no_amx;
  else if (!f.amx_int8)
    out.amx_int8_unavailable = "this CPU lacks AMX-INT8 (tdpbssd)";
#elif defined(__aarch64__)
  if (f.neon) {
    f32 = fma_neon;
    lanes = 4;
    out.isa = "neon";
  }
  bf16 = f.neon && f.bf16;
  if (!bf16) out.bf16_dot_unavailable = "this CPU lacks BF16 (BFDOT, Armv8.6)";
#endif
#if !defined(__x86_64__) && !defined(__aarch64__)
  out.bf16_dot_unavailable = "this build has no bf16 dot engine for this CPU";
#endif
#if !defined(__x86_64__)
  out.amx_bf16_unavailable = "AMX is an x86-64 extension";
  out.amx_int8_unavailable = "AMX is an x86-64 extension";
#endif
  // The time is shared by the kinds measured.
  const double share = seconds / (3 + int(bf16) + int(amx) + int(amx_int8));
  // 2 flops (multiply + add) per lane per chain step.
  const Rate r = measure(f32, 2.0 * lanes * kChains, threads, share);
  out.f32_fma = r.gflops;
  out.threads = r.threads;
#if defined(__x86_64__)
  if (bf16) {
    // 16 f32 lanes, each 2 bf16 pairs, 2 flops per pair.
    out.bf16_dot = measure(dot_avx512bf16, 16.0 * 2 * 2 * kChains, threads, share).gflops;
  }
  if (amx) out.amx_bf16 = measure(dot_amx_bf16, kAmxFlopsPerIter, threads, share).gflops;
  if (amx_int8) out.amx_int8 = measure(dot_amx_int8, kAmxInt8OpsPerIter, threads, share).gflops;
  // The SAGE engines' int8 dot: 2 ops per byte product.
  if (f.avx512f && f.avx512_vnni) {
    out.int8_dot = measure(dot_avx512vnni, 64.0 * 2 * kChains, threads, share).gflops;
    out.int8_dot_isa = "avx512_vnni (vpdpbusd)";
  } else if (f.avx2 && f.avx_vnni) {
    out.int8_dot = measure(dot_avxvnni, 32.0 * 2 * kChains, threads, share).gflops;
    out.int8_dot_isa = "avx_vnni (vpdpbusd)";
  } else if (f.avx2) {
    out.int8_dot = measure(dot_avx2_sign, 32.0 * 2 * kSignChains, threads, share).gflops;
    out.int8_dot_isa = "avx2 (vpxor + vpmaddubsw + vpmaddwd)";
  } else {
    out.int8_dot_unavailable = "this CPU lacks AVX2 (the SAGE engines run portable C++)";
  }
  // The 16-bit integer lanes: 2 ops per int16 product.
  if (const Int16Dot dot = int16_dot_of(f); dot.fn != nullptr) {
    out.int16_dot = measure(dot.fn, dot.ops, threads, share).gflops;
    out.int16_dot_isa = dot.isa;
  } else {
    out.int16_dot_unavailable = "this CPU lacks AVX2 (vpmaddwd)";
  }
#elif defined(__aarch64__)
  if (bf16) out.bf16_dot = measure(dot_neon_bfdot, 4.0 * 2 * 2 * kChains, threads, share).gflops;
  if (f.neon && f.i8mm) {
    out.int8_dot = measure(dot_neon_usdot, 16.0 * 2 * kChains, threads, share).gflops;
    out.int8_dot_isa = "neon_i8mm (usdot)";
  } else if (f.neon && f.asimddp) {
    out.int8_dot = measure(dot_neon_sdot, 16.0 * 2 * kChains, threads, share).gflops;
    out.int8_dot_isa = "neon_dotprod (sdot)";
  } else {
    out.int8_dot_unavailable =
        "this CPU lacks the dot product instructions (SDOT, Armv8.2; the SAGE engines run portable "
        "C++)";
  }
  out.int16_dot_unavailable =
      "dattn has no 16-bit integer-lane engine on AArch64 (SMLAL makes four products per "
      "instruction, as FMLA does)";
#else
  out.int8_dot_unavailable = "the SAGE engines' int8 dot instructions are x86-64's";
  out.int16_dot_unavailable =
      "the 16-bit integer dot instructions (vpmaddwd, vpdpwssd) are x86-64's";
#endif
  return out;
}

}  // namespace

namespace detail {
double bf16_dot_to_fma_ratio() {
  static std::mutex mu;  // not at the same time as measure_peak_gflops's own runs
  const std::lock_guard<std::mutex> lock(mu);
  static const double ratio = bf16_dot_ratio_uncached();
  return ratio;
}
double int16_dot_to_fma_ratio() {
  static std::mutex mu;
  const std::lock_guard<std::mutex> lock(mu);
  static const double ratio = int16_dot_ratio_uncached();
  return ratio;
}
}  // namespace detail

PeakGflops measure_peak_gflops(int threads, double seconds) {
  if (threads > kMaxThreads)
    throw InvalidArgument("threads", "threads: " + std::to_string(threads) +
                                         " is above the limit of " + std::to_string(kMaxThreads) +
                                         " (kMaxThreads); valid: 1 to " +
                                         std::to_string(kMaxThreads) + ", or <= 0 for every CPU");
  // At most as many threads as the process may run on: more would time-share CPUs, which says
  // nothing more about the machine's rate.
  if (threads <= 0) threads = kMaxThreads;
  threads = std::min(threads, affinity_cpus());
  if (!(seconds > 0) || !std::isfinite(seconds)) seconds = 0.2;
  seconds = std::min(seconds, 60.0);

  static std::mutex mu;
  static std::map<int, PeakGflops> cache;
  // Held while measuring too: two measurements at once would compete for the cores.
  const std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(threads); it != cache.end()) return it->second;
  PeakGflops p = measure_uncached(threads, seconds);
  cache.emplace(threads, p);
  return p;
}

}  // namespace dattn
