// The FLASH engines as one table: name, place on the ladder, what they compute in, whether they
// are an emulated twin, their availability check and their kernels. DATTN_ISA, the `isa`
// backend option, `dattn info` (through dattn/engines.hpp) and the tests all read it; a new
// engine is one row here plus its kernel source file (named once in CMakeLists.txt).
//
// The ladder: amx > avx512_bf16 > avx512 > avx2 > portable. The SAGE engines (compute int8) sit
// on the same ladder: avx512_vnni and avx_vnni at avx512's rank, avx2_int8 at avx2's,
// portable_int8 at portable's; FLASH never picks them, SAGE picks only them. The 16-bit
// integer-lane engines (compute int16) too: avx512_vnni_int16 and avx_vnni_int16 at avx512's
// rank, avx2_int16 at avx2's; FLASH takes them with compute_dtype int16, by exact name (isa /
// DATTN_ISA) or by the automatic rule (select_engine), SAGE and VIDEO_SPARSE with qk_dtype
// int16; a cap that names another engine never selects them. DATTN_ISA or the isa
// option name a cap on it (or an emulated twin, by exact name, which then stands in for its real
// twin); each call runs on the fastest engine at or below the cap that serves its input dtype and
// compute_dtype (select_engine).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "backends/flash/kernels.hpp"
#include "dattn/dtype.hpp"
#include "dattn/metadata.hpp"
#include "dattn/problem.hpp"

namespace dattn::flash {

// What the dot products of Q.K^T and P.V are computed in. f32 is exact to the inputs' precision
// (f32, bf16 and f16 inputs); bf16 rounds the operands to bf16 and accumulates in f32; int8 (the
// SAGE engines, never FLASH's) quantizes Q and K to int8 codes with f32 scales (integer dot
// products) and computes P.V on the engine's base (bf16 or f32); int16 computes Q.K^T and P.V
// on int16 pairs (13-bit codes with exact f32 terms for a head's 4 channels of largest spread:
// cpu/int8_impl.hpp, "16-bit integer lanes").
enum class ComputeDtype { f32, bf16, int8, int16 };

std::string_view compute_dtype_name(ComputeDtype c);

struct Engine {
  std::string_view name;
  int rank;  // place on the ladder; an emulated twin shares its real twin's rank
  ComputeDtype compute;
  bool emulated;  // always available, never chosen automatically
  // Why this CPU cannot run the engine; nullopt when it can.
  std::optional<std::string> (*unavailable)();
  const TileKernels& (*kernels)();

  bool available() const { return !unavailable().has_value(); }
};

// The table, in ladder order (emulated twins right after their real ones).
std::span<const Engine> engines();

// The engine called `name` (case-insensitive). Throws InvalidArgument naming `field`, the
// backend the user chose and the valid names when there is none, NotAvailable naming `field`
// when this CPU cannot run it.
const Engine& engine_named(std::string_view name, std::string_view field,
                           std::string_view backend = "FLASH");

// The cap DATTN_ISA sets for the process (checked once): nullptr when unset (automatic choice).
const Engine* process_cap();

// The cap backend `backend`'s `isa` option names (InvalidArgument naming isa if not a string or
// not an engine, NotAvailable when this CPU cannot run it), else process_cap().
const Engine* options_cap(const BackendOptions& options, std::string_view backend = "FLASH");

// The dtype a bf16 engine would round a call's operands from: BF16 only when every Q, K and V
// the call reads (joint ones and pages included, unquantized) is bf16, so that the automatic
// choice takes a bf16 engine only where its operands are the inputs themselves; F32 otherwise.
DType operand_dtype(const AttentionProblem& p);

// The backend option compute_dtype ("f32", the default, "bf16" or "int16"); InvalidArgument
// naming compute_dtype otherwise.
ComputeDtype parse_compute_dtype(const BackendOptions& options);

// SAGE's and VIDEO_SPARSE's backend option qk_dtype: what Q.K^T is computed in (auto, int8,
// int16; VIDEO_SPARSE also takes f32); nullopt when absent or auto. InvalidArgument naming
// qk_dtype otherwise.
std::optional<ComputeDtype> parse_qk_dtype(const BackendOptions& options, bool f32_valid);

// Whether every Q, K and V a call reads (joint ones included, KV unquantized) is bf16, or every
// one is f16: the calls the automatic rule may run on 16-bit integer lanes.
bool half_operands(const AttentionProblem& p);

// Whether a call's query rows see kInt16MinKeys keys or more on average (over its segments):
// where they see fewer, quantizing each query row and the statistics over Q cost more than the
// faster dots win back (an AVX2 proxy, bf16: wan-480p-cross's 512 text keys 0.95x and `small`
// 0.87x avx2 f32; wan-480p, flux-1024 and packed-docs 1.3-1.5x), so the automatic rule leaves
// such calls on the float engines.
inline constexpr int kInt16MinKeys = 1024;
bool keys_amortize_codes(const AttentionProblem& p);

// The engine for a call with inputs of `input` dtype: the highest-ranked available engine at or
// below `cap` (nullptr: no cap) that serves it. f32 engines serve every call; bf16 engines serve
// bf16 inputs and calls with compute_dtype bf16. An emulated engine serves only when it is the
// cap itself. With no cap, bf16 engines serve only calls whose operands are all bf16 (or
// compute_dtype bf16): amx wherever it is available, avx512_bf16 and neon_bf16 only where
// bf16_dot_outruns_fma().
// compute int8 (SAGE): the highest-ranked available int8 engine at or below the cap.
// compute int16: the highest-ranked available int16 engine at or below the cap (an int16 cap:
// itself), else the f32 engine as for compute f32. A cap that is an int16 engine is taken for
// any compute but int8. Automatic (no cap, compute f32): an int16 engine where `half` (the
// call's operands are all bf16 or all f16, half_operands, and its rows see enough keys,
// keys_amortize_codes) and int16_lanes_outrun() say so.
const Engine& select_engine(const Engine* cap, DType input, ComputeDtype compute,
                            bool half = false);

// True when this CPU's 16-bit integer lanes measurably outrun what a bf16 call would otherwise
// run on (the measured
// int16 rate over the f32 FMA rate, detail::int16_dot_to_fma_ratio, at least kInt16Margin, and
// above the bf16 dot's ratio where avx512_bf16 is chosen; never where AMX is available). Measured
// once per process, on first use. The int16 engines' errors on the hostile bf16 input classes are
// within 1.5x the bf16 engine semantics' (tests/test_int16.cpp), the other condition of the
// automatic rule.
inline constexpr double kInt16Margin = 1.3;

// How many exact channels the smoothing moves to the end of a head of d for engine `e`
// (item_driver.hpp, Smoothing::finish): the int16 engines' (kernels.hpp,
// int16_exact_channels) unless the keys are rotated (which spreads what the channels would
// single out); none for the others.
inline int smoothing_exact_channels(const Engine& e, bool rotate, std::int64_t d) {
  return e.compute == ComputeDtype::int16 && !rotate ? int16_exact_channels(int(d)) : 0;
}
bool int16_lanes_outrun();

// What a SAGE engine computes P.V in (backend option pv_dtype): auto (automatic_pv_dtype), bf16,
// f32, int16 (P codes 0..4095 and V codes -4095..4095 as int16 pairs on the engine's 16-bit
// integer dot: more accurate than bf16), int8 (P and V as 8-bit codes on the engine's integer
// dot: faster, less accurate); amx_int8 runs avx512_vnni's for f32, int16 and int8.
// InvalidArgument naming pv_dtype otherwise.
enum class PvDtype { automatic, bf16, f32, int8, int16 };
PvDtype parse_pv_dtype(const BackendOptions& options);
// A bool backend option (SAGE's smooth_k, balance_qk): true when absent; InvalidArgument naming
// it when not a bool.
bool parse_bool_option(const BackendOptions& options, const std::string& name,
                       bool default_value = true);
// SAGE's option `rotate` when it is not given (docs/semantics.md, "SAGE": chosen by
// measurement).
inline constexpr bool kRotateByDefault = true;
// What pv_dtype auto is on engine e, chosen by measurement (docs/semantics.md, "SAGE"): int16
// on avx512_vnni, avx2_int8, avx_vnni and their twins (vpdpwssd / vpmaddwd: on an Intel Xeon
// with AVX512-BF16, flux-1024 f32 on avx512_vnni 419 GFLOP/s against 367 with f32 P.V and 251
// with bf16; on avx2_int8 1.04-1.12x f32 P.V on an AMD Zen 4, 1.03-1.06x on the Xeon; avx_vnni
// 1.05x there); otherwise `automatic` itself, the engine's own kernels: bf16 tiles on amx_int8,
// f32 on portable_int8.
PvDtype automatic_pv_dtype(const Engine& e);
// The kernels of int8 engine `e` with P.V in `pv`; NotAvailable naming pv_dtype where the engine
// has no bf16 P.V on this CPU.
const TileKernels& int8_engine_kernels(const Engine& e, PvDtype pv);

// True when this CPU's measured bf16 dot rate (vdpbf16ps on x86-64, BFDOT on AArch64) is at least
// 1.5x its f32 FMA rate (both in flops; detail::bf16_dot_to_fma_ratio, interleaved trials on one
// thread). Measured once per process, on first use, only when a choice depends on it; false
// without AVX512-BF16 or AArch64's BF16.
bool bf16_dot_outruns_fma();

}  // namespace dattn::flash
