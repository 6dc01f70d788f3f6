#include "backends/flash/engines.hpp"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <utility>
#include <variant>

#include "core/amx_permission.hpp"
#include "core/cpu_peak.hpp"
#include "core/strings.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/engines.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"

namespace dattn::flash {
namespace {

std::optional<std::string> always() {
  return std::nullopt;
}

std::optional<std::string> needs_avx2() {
  const CpuFeatures& f = cpu_features();
  if (f.avx2 && f.fma && f.f16c) return std::nullopt;
  return std::string("this CPU lacks AVX2, FMA or F16C");
}

std::optional<std::string> needs_avx512() {
  const CpuFeatures& f = cpu_features();
  if (needs_avx2()) return needs_avx2();
  if (f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl) return std::nullopt;
  return std::string("this CPU lacks AVX-512 (F, BW, DQ and VL)");
}

std::optional<std::string> needs_avx512_bf16() {
  if (needs_avx512()) return needs_avx512();
  if (cpu_features().avx512_bf16) return std::nullopt;
  return std::string("this CPU lacks AVX512-BF16 (vdpbf16ps)");
}

std::optional<std::string> needs_amx() {
  if (needs_avx512_bf16()) return needs_avx512_bf16();
  return detail::amx_unavailable();
}

std::optional<std::string> needs_amx_int8() {
  if (needs_amx()) return needs_amx();
  if (cpu_features().amx_int8) return std::nullopt;
  return std::string("this CPU lacks AMX-INT8 (tdpbssd)");
}

std::optional<std::string> needs_avx_vnni() {
  if (needs_avx2()) return needs_avx2();
  if (cpu_features().avx_vnni) return std::nullopt;
  return std::string("this CPU lacks AVX-VNNI (vpdpbusd on 256-bit registers)");
}

std::optional<std::string> needs_avx512_vnni() {
  if (needs_avx512()) return needs_avx512();
  if (cpu_features().avx512_vnni) return std::nullopt;
  return std::string("this CPU lacks AVX512-VNNI (vpdpbusd)");
}

std::optional<std::string> needs_neon() {
  if (cpu_features().neon) return std::nullopt;
  return std::string("this CPU lacks NEON (AArch64's Advanced SIMD)");
}

// The sve engine is built for the vector lengths of the cores that exist: 128 bits (Neoverse
// V2, N2: Graviton 4, Grace, Axion), 256 (Neoverse V1: Graviton 3) and 512 (A64FX)
// (kernels_sve_impl.hpp). The architecture allows up to 2048, which the row kernels' padding
// of keys to 16 (AVX-512's and SVE-512's lanes) does not cover: there neon serves.
bool sve_length_built(int bits) {
  return bits == 128 || bits == 256 || bits == 512;
}

std::optional<std::string> needs_sve() {
  if (needs_neon()) return needs_neon();
  const CpuFeatures& f = cpu_features();
  if (!f.sve) return std::string("this CPU lacks SVE");
  if (sve_length_built(f.sve_bits)) return std::nullopt;
  return "SVE's vector length here is " + std::to_string(f.sve_bits) +
         " bits; the sve engine is built for 128, 256 and 512 (the neon engine serves)";
}

std::optional<std::string> needs_neon_dotprod() {
  if (needs_neon()) return needs_neon();
  if (cpu_features().asimddp) return std::nullopt;
  return std::string("this CPU lacks the dot product instructions (SDOT, Armv8.2's asimddp)");
}

std::optional<std::string> needs_neon_i8mm() {
  if (needs_neon()) return needs_neon();
  if (cpu_features().i8mm) return std::nullopt;
  return std::string("this CPU lacks I8MM (USDOT, Armv8.6's int8 matrix multiply)");
}

std::optional<std::string> needs_neon_bf16() {
  if (needs_neon()) return needs_neon();
  if (cpu_features().bf16) return std::nullopt;
  return std::string("this CPU lacks BF16 (BFDOT, Armv8.6's bf16 instructions)");
}

// Ladder order (ranks ascending; within a rank, the preferred engine last, emulated twins
// right after their real ones). FLASH runs the f32 and bf16 engines, SAGE the int8 ones.
constexpr std::array<Engine, 30> kEngines{{
    {"portable", 0, ComputeDtype::f32, false, &always, &portable_kernels},
    {"portable_int8", 0, ComputeDtype::int8, false, &always, &portable_int8_kernels},
    {"neon", 1, ComputeDtype::f32, false, &needs_neon, &neon_kernels},
    {"neon_dotprod", 1, ComputeDtype::int8, false, &needs_neon_dotprod, &neon_dotprod_kernels},
    {"neon_dotprod_emulated", 1, ComputeDtype::int8, true, &always, &neon_dotprod_emulated_kernels},
    {"avx2", 1, ComputeDtype::f32, false, &needs_avx2, &avx2_kernels},
    {"avx2_int8", 1, ComputeDtype::int8, false, &needs_avx2, &avx2_int8_kernels},
    {"avx2_int8_emulated", 1, ComputeDtype::int8, true, &always, &avx2_int8_emulated_kernels},
    {"avx2_int16", 1, ComputeDtype::int16, false, &needs_avx2, &avx2_int16_kernels},
    {"avx2_int16_emulated", 1, ComputeDtype::int16, true, &always, &avx2_int16_emulated_kernels},
    {"sve", 2, ComputeDtype::f32, false, &needs_sve, &sve_kernels},
    {"neon_i8mm", 2, ComputeDtype::int8, false, &needs_neon_i8mm, &neon_i8mm_kernels},
    {"neon_i8mm_emulated", 2, ComputeDtype::int8, true, &always, &neon_i8mm_emulated_kernels},
    {"avx512", 2, ComputeDtype::f32, false, &needs_avx512, &avx512_kernels},
    {"avx_vnni", 2, ComputeDtype::int8, false, &needs_avx_vnni, &avx_vnni_kernels},
    {"avx_vnni_emulated", 2, ComputeDtype::int8, true, &always, &avx_vnni_emulated_kernels},
    {"avx512_vnni", 2, ComputeDtype::int8, false, &needs_avx512_vnni, &avx512_vnni_kernels},
    {"avx512_vnni_emulated", 2, ComputeDtype::int8, true, &always, &avx512_vnni_emulated_kernels},
    {"avx_vnni_int16", 2, ComputeDtype::int16, false, &needs_avx_vnni, &avx_vnni_int16_kernels},
    {"avx_vnni_int16_emulated", 2, ComputeDtype::int16, true, &always,
     &avx_vnni_int16_emulated_kernels},
    {"avx512_vnni_int16", 2, ComputeDtype::int16, false, &needs_avx512_vnni,
     &avx512_vnni_int16_kernels},
    {"avx512_vnni_int16_emulated", 2, ComputeDtype::int16, true, &always,
     &avx512_vnni_int16_emulated_kernels},
    {"neon_bf16", 3, ComputeDtype::bf16, false, &needs_neon_bf16, &neon_bf16_kernels},
    {"neon_bf16_emulated", 3, ComputeDtype::bf16, true, &always, &neon_bf16_emulated_kernels},
    {"avx512_bf16", 3, ComputeDtype::bf16, false, &needs_avx512_bf16, &avx512_bf16_kernels},
    {"avx512_bf16_emulated", 3, ComputeDtype::bf16, true, &always, &avx512_bf16_emulated_kernels},
    {"amx", 4, ComputeDtype::bf16, false, &needs_amx, &amx_kernels},
    {"amx_emulated", 4, ComputeDtype::bf16, true, &always, &amx_emulated_kernels},
    {"amx_int8", 4, ComputeDtype::int8, false, &needs_amx_int8, &amx_int8_kernels},
    {"amx_int8_emulated", 4, ComputeDtype::int8, true, &always, &amx_int8_emulated_kernels},
}};

}  // namespace

const TileKernels& sve_kernels() {
  switch (cpu_features().sve_bits) {
    case 128:
      return sve128_kernels();
    case 256:
      return sve256_kernels();
    case 512:
      return sve512_kernels();
    default:
      return portable_kernels();  // unavailable (needs_sve): never run
  }
}

namespace {

std::string valid_names() {
  std::string s;
  for (const Engine& e : kEngines) s += (s.empty() ? "" : ", ") + std::string(e.name);
  return s;
}

}  // namespace

std::string_view compute_dtype_name(ComputeDtype c) {
  switch (c) {
    case ComputeDtype::bf16:
      return "bf16";
    case ComputeDtype::int8:
      return "int8";
    case ComputeDtype::int16:
      return "int16";
    case ComputeDtype::f32:
      break;
  }
  return "f32";
}

std::span<const Engine> engines() {
  return kEngines;
}

namespace {

using detail::trimmed;  // DATTN_ISA='amx\n' names amx

// `name` as an error message quotes it: at most 64 characters, control characters escaped.
std::string quoted(std::string_view name) {
  std::string s = "'";
  for (std::size_t i = 0; i < name.size() && i < 64; ++i) {
    const auto c = static_cast<unsigned char>(name[i]);
    if (c >= 0x20 && c < 0x7f) {
      s += char(c);
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      s += "\\x";
      s += kHex[c >> 4];
      s += kHex[c & 15];
    }
  }
  s += "'";
  if (name.size() > 64) s += " (" + std::to_string(name.size()) + " characters, cut)";
  return s;
}

}  // namespace

const Engine& engine_named(std::string_view given, std::string_view field,
                           std::string_view backend) {
  const std::string_view name = trimmed(given);
  const std::string who = std::string(backend);
  for (const Engine& e : kEngines) {
    if (!names_equal(name, e.name)) continue;
    if (const auto why = e.unavailable())
      throw NotAvailable(std::string(field), std::string(field) + " = " + std::string(e.name) +
                                                 ": " + who + "'s engine " + std::string(e.name) +
                                                 " is not available: " + *why);
    return e;
  }
  throw InvalidArgument(std::string(field), std::string(field) + " = " + quoted(given) +
                                                " is not an engine of " + who +
                                                "; valid: " + valid_names() +
                                                " (case and surrounding whitespace ignored)");
}

const Engine* process_cap() {
  static const Engine* const cap = []() -> const Engine* {
    const char* env = std::getenv("DATTN_ISA");
    if (env == nullptr || trimmed(env).empty()) return nullptr;
    return &engine_named(env, "DATTN_ISA");
  }();
  return cap;
}

const Engine* options_cap(const BackendOptions& options, std::string_view backend) {
  const auto it = options.find("isa");
  if (it == options.end()) return process_cap();
  const auto* name = std::get_if<std::string>(&it->second);
  if (name == nullptr) throw InvalidArgument("isa", "backend option isa must be a string");
  return &engine_named(*name, "isa", backend);
}

DType operand_dtype(const AttentionProblem& p) {
  bool bf16 = p.q.dtype() == DType::BF16 && p.k.dtype() == DType::BF16 &&
              p.v.dtype() == DType::BF16 && p.kv_cache_dtype == KvCacheDtype::unquantized;
  if (p.joint)
    bf16 = bf16 && p.joint->q.dtype() == DType::BF16 && p.joint->k.dtype() == DType::BF16 &&
           p.joint->v.dtype() == DType::BF16;
  return bf16 ? DType::BF16 : DType::F32;
}

ComputeDtype parse_compute_dtype(const BackendOptions& options) {
  const auto it = options.find("compute_dtype");
  if (it == options.end()) return ComputeDtype::f32;
  const auto* name = std::get_if<std::string>(&it->second);
  if (name != nullptr && (names_equal(*name, "f32") || names_equal(*name, "float32")))
    return ComputeDtype::f32;
  if (name != nullptr && (names_equal(*name, "bf16") || names_equal(*name, "bfloat16")))
    return ComputeDtype::bf16;
  if (name != nullptr && names_equal(*name, "int16")) return ComputeDtype::int16;
  throw InvalidArgument("compute_dtype",
                        "backend option compute_dtype = " +
                            (name != nullptr ? "'" + *name + "'" : std::string("a non-string")) +
                            " is not valid; valid: f32 (the default: exact to the inputs' "
                            "precision), bf16, int16 (16-bit integer lanes)");
}

std::optional<ComputeDtype> parse_qk_dtype(const BackendOptions& options, bool f32_valid) {
  const auto it = options.find("qk_dtype");
  if (it == options.end()) return std::nullopt;
  const auto* name = std::get_if<std::string>(&it->second);
  if (name != nullptr && names_equal(*name, "auto")) return std::nullopt;
  if (name != nullptr && names_equal(*name, "int8")) return ComputeDtype::int8;
  if (name != nullptr && names_equal(*name, "int16")) return ComputeDtype::int16;
  if (f32_valid && name != nullptr && (names_equal(*name, "f32") || names_equal(*name, "float32")))
    return ComputeDtype::f32;
  throw InvalidArgument("qk_dtype",
                        "backend option qk_dtype = " +
                            (name != nullptr ? "'" + *name + "'" : std::string("a non-string")) +
                            " is not valid; valid: auto, " + (f32_valid ? "f32, " : "") +
                            "int8 (8-bit codes), int16 (13-bit codes on 16-bit integer lanes: "
                            "more accurate)");
}

bool keys_amortize_codes(const AttentionProblem& p) {
  double rows = 0, products = 0;
  for (const Segment& s : p.segments) {
    rows += double(s.q_end - s.q_begin);
    products += double(s.q_end - s.q_begin) * double(s.k_end - s.k_begin);
  }
  return rows > 0 && products >= double(kInt16MinKeys) * rows;
}

bool half_operands(const AttentionProblem& p) {
  for (const DType want : {DType::BF16, DType::F16}) {
    bool all = p.q.dtype() == want && p.k.dtype() == want && p.v.dtype() == want &&
               p.kv_cache_dtype == KvCacheDtype::unquantized;
    if (p.joint)
      all = all && p.joint->q.dtype() == want && p.joint->k.dtype() == want &&
            p.joint->v.dtype() == want;
    if (all) return true;
  }
  return false;
}

namespace {

// The highest-ranked available engine of compute kind `kind` (int8 or int16) at or below the
// cap, or nullptr.
const Engine* integer_engine(const Engine* cap, ComputeDtype kind) {
  for (auto it = kEngines.rbegin(); it != kEngines.rend(); ++it) {
    const Engine& e = *it;
    if (e.compute != kind) continue;
    if (cap != nullptr && e.rank > cap->rank) continue;
    if (e.emulated && &e != cap) continue;
    if (cap != nullptr && cap->emulated && &e != cap && e.rank == cap->rank) continue;
    // A real engine named as the cap is the one of its rank (avx_vnni beside avx512_vnni).
    if (cap != nullptr && !cap->emulated && &e != cap && e.rank == cap->rank && cap->available() &&
        cap->compute == kind)
      continue;
    if (!e.available()) continue;
    return &e;
  }
  return nullptr;
}

}  // namespace

const Engine& select_engine(const Engine* cap, DType input, ComputeDtype compute, bool half) {
  if (cap != nullptr && cap->compute == ComputeDtype::int16 && compute != ComputeDtype::int8)
    return *cap;  // by its exact name
  if (compute == ComputeDtype::int16) {
    if (const Engine* e = integer_engine(cap, ComputeDtype::int16)) return *e;
    return select_engine(cap, input, ComputeDtype::f32);  // no integer lanes: f32
  }
  // The automatic rule (docs/semantics.md, "16-bit integer lanes").
  if (compute == ComputeDtype::f32 && cap == nullptr && half && int16_lanes_outrun())
    if (const Engine* e = integer_engine(nullptr, ComputeDtype::int16)) return *e;
  if (compute == ComputeDtype::int8) {
    for (auto it = kEngines.rbegin(); it != kEngines.rend(); ++it) {
      const Engine& e = *it;
      if (e.compute != ComputeDtype::int8) continue;
      if (cap != nullptr && e.rank > cap->rank) continue;
      if (e.emulated && &e != cap) continue;
      if (cap != nullptr && cap->emulated && &e != cap && e.rank == cap->rank) continue;
      // A real engine named as the cap is the one of its rank (avx_vnni beside avx512_vnni).
      if (cap != nullptr && !cap->emulated && &e != cap && e.rank == cap->rank && cap->available())
        continue;
      if (!e.available()) continue;
      return e;
    }
    return *std::find_if(kEngines.begin(), kEngines.end(),
                         [](const Engine& e) { return e.name == "portable_int8"; });
  }
  const bool bf16_ok = input == DType::BF16 || compute == ComputeDtype::bf16;
  // Highest rank first; an emulated cap stands in for the real engines of its rank.
  for (auto it = kEngines.rbegin(); it != kEngines.rend(); ++it) {
    const Engine& e = *it;
    if (cap != nullptr && e.rank > cap->rank) continue;
    if (e.emulated && &e != cap) continue;
    if (cap != nullptr && cap->emulated && &e != cap && e.rank == cap->rank) continue;
    if (e.compute == ComputeDtype::int8 || e.compute == ComputeDtype::int16) continue;
    if (e.compute == ComputeDtype::bf16 && !bf16_ok) continue;
    if (!e.available()) continue;
    // vdpbf16ps is chosen by itself only where it measurably outruns f32 FMAs (on Intel's AMX
    // machines it runs at about half their rate); AMX always does.
    if ((e.kernels == &avx512_bf16_kernels || e.kernels == &neon_bf16_kernels) && cap == nullptr &&
        !bf16_dot_outruns_fma())
      continue;
    // At 128 bits SVE has NEON's four lanes and nothing to add for FMLA: neon serves unless sve
    // is named.
    if (e.kernels == &sve_kernels && &e != cap && cpu_features().sve_bits <= 128) continue;
    return e;
  }
  return kEngines[0];
}

PvDtype parse_pv_dtype(const BackendOptions& options) {
  const auto it = options.find("pv_dtype");
  if (it == options.end()) return PvDtype::automatic;
  const auto* name = std::get_if<std::string>(&it->second);
  if (name != nullptr && names_equal(*name, "auto")) return PvDtype::automatic;
  if (name != nullptr && (names_equal(*name, "f32") || names_equal(*name, "float32")))
    return PvDtype::f32;
  if (name != nullptr && (names_equal(*name, "bf16") || names_equal(*name, "bfloat16")))
    return PvDtype::bf16;
  if (name != nullptr && names_equal(*name, "int8")) return PvDtype::int8;
  if (name != nullptr && names_equal(*name, "int16")) return PvDtype::int16;
  throw InvalidArgument("pv_dtype",
                        "backend option pv_dtype = " +
                            (name != nullptr ? "'" + *name + "'" : std::string("a non-string")) +
                            " is not valid; valid: auto (the default: int16 on avx512_vnni, "
                            "avx_vnni and avx2_int8, bf16 tiles on amx_int8, f32 on the AArch64 "
                            "and portable engines), bf16, "
                            "f32, int16 (P and V as 12- and 13-bit codes in 16-bit integer lanes: "
                            "more accurate than bf16), int8 (P and V as 8-bit codes: fastest, "
                            "least accurate)");
}

bool parse_bool_option(const BackendOptions& options, const std::string& name, bool default_value) {
  const auto it = options.find(name);
  if (it == options.end()) return default_value;
  if (const auto* b = std::get_if<bool>(&it->second)) return *b;
  throw InvalidArgument(name, "backend option " + name + " must be a bool (default " +
                                  (default_value ? "true" : "false") + ")");
}

PvDtype automatic_pv_dtype(const Engine& e) {
  for (const auto kernels :
       {&avx512_vnni_kernels, &avx512_vnni_emulated_kernels, &avx2_int8_kernels,
        &avx2_int8_emulated_kernels, &avx_vnni_kernels, &avx_vnni_emulated_kernels})
    if (e.kernels == kernels) return PvDtype::int16;
  return PvDtype::automatic;
}

const TileKernels& int8_engine_kernels(const Engine& e, PvDtype pv) {
  const bool vnni512 = e.kernels == &avx512_vnni_kernels;
  const bool vnni512_twin = e.kernels == &avx512_vnni_emulated_kernels;
  const bool amx = e.kernels == &amx_int8_kernels;
  const bool amx_twin = e.kernels == &amx_int8_emulated_kernels;
  if (pv == PvDtype::automatic) pv = automatic_pv_dtype(e);
  if (pv == PvDtype::int16 || pv == PvDtype::int8) {
    // amx_int8's P.V is on bf16 tiles: an integer P.V is avx512_vnni's (the engine then reported).
    using Kernels = const TileKernels& (*)();
    struct IntegerPv {
      Kernels engine, pv8, pv16;
    };
    const IntegerPv table[] = {
        {&portable_int8_kernels, &portable_int8_pv8_kernels, &portable_int8_pv16_kernels},
        {&avx2_int8_kernels, &avx2_int8_pv8_kernels, &avx2_int8_pv16_kernels},
        {&avx2_int8_emulated_kernels, &avx2_int8_emulated_pv8_kernels,
         &avx2_int8_emulated_pv16_kernels},
        {&avx_vnni_kernels, &avx_vnni_pv8_kernels, &avx_vnni_pv16_kernels},
        {&avx_vnni_emulated_kernels, &avx_vnni_emulated_pv8_kernels,
         &avx_vnni_emulated_pv16_kernels},
        {&avx512_vnni_kernels, &avx512_vnni_pv8_kernels, &avx512_vnni_pv16_kernels},
        {&avx512_vnni_emulated_kernels, &avx512_vnni_emulated_pv8_kernels,
         &avx512_vnni_emulated_pv16_kernels},
        {&neon_dotprod_kernels, &neon_dotprod_pv8_kernels, &neon_dotprod_pv16_kernels},
        {&neon_dotprod_emulated_kernels, &neon_dotprod_emulated_pv8_kernels,
         &neon_dotprod_emulated_pv16_kernels},
        {&neon_i8mm_kernels, &neon_i8mm_pv8_kernels, &neon_i8mm_pv16_kernels},
        {&neon_i8mm_emulated_kernels, &neon_i8mm_emulated_pv8_kernels,
         &neon_i8mm_emulated_pv16_kernels},
        {&amx_int8_kernels, &avx512_vnni_pv8_kernels, &avx512_vnni_pv16_kernels},
        {&amx_int8_emulated_kernels, &avx512_vnni_emulated_pv8_kernels,
         &avx512_vnni_emulated_pv16_kernels}};
    for (const IntegerPv& row : table)
      if (e.kernels == row.engine) return pv == PvDtype::int8 ? row.pv8() : row.pv16();
    return e.kernels();
  }
  if (pv == PvDtype::f32) {
    // amx_int8's P.V is on bf16 tiles: an f32 P.V is avx512_vnni's (the engine then reported).
    if (vnni512 || amx) return avx512_vnni_f32_pv_kernels();
    if (vnni512_twin || amx_twin) return avx512_vnni_emulated_f32_pv_kernels();
    return e.kernels();
  }
  if (pv == PvDtype::bf16) {
    const bool has_bf16 =
        vnni512_twin || amx || amx_twin || (vnni512 && cpu_features().avx512_bf16);
    if (!has_bf16)
      throw NotAvailable(
          "pv_dtype",
          "pv_dtype = bf16: the SAGE engine " + std::string(e.name) +
              " has no bf16 P.V on this CPU (avx512_vnni with AVX512-BF16, amx_int8 and "
              "the emulated twins have one); use pv_dtype auto or f32");
  }
  return e.kernels();
}

bool int16_lanes_outrun() {
  static const bool faster = [] {
    if (!needs_amx().has_value()) return false;  // AMX's bf16 tiles run far ahead
    const bool any = std::any_of(kEngines.begin(), kEngines.end(), [](const Engine& e) {
      return e.compute == ComputeDtype::int16 && !e.emulated && e.available();
    });
    if (!any) return false;
    const double int16 = detail::int16_dot_to_fma_ratio();
    if (int16 < kInt16Margin) return false;
    if (bf16_dot_outruns_fma() && int16 < kInt16Margin * detail::bf16_dot_to_fma_ratio())
      return false;
    return true;
  }();
  return faster;
}

bool bf16_dot_outruns_fma() {
  static const bool faster = [] {
    if (!cpu_features().avx512_bf16 && !cpu_features().bf16) return false;
    return detail::bf16_dot_to_fma_ratio() >= 1.5;
  }();
  return faster;
}

}  // namespace dattn::flash

namespace dattn {

std::optional<SimdShortfall> simd_shortfall() {
  static const std::optional<SimdShortfall> shortfall = []() -> std::optional<SimdShortfall> {
    const flash::Engine& automatic =
        flash::select_engine(nullptr, DType::F32, flash::ComputeDtype::f32);
    if (automatic.rank > 0) return std::nullopt;
    const CpuFeatures& detected = detected_cpu_features();
    const CpuFeatures& used = cpu_features();
    const auto list = [](const std::vector<std::string>& names) {
      std::string s;
      for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
      return s;
    };
    SimdShortfall out;
    out.engine = std::string(automatic.name);
    out.cpu = detected.brand.empty() ? "this CPU" : detected.brand;
    std::string why;
    if (!used.names().empty()) {
      // Features no engine of this build can use (e.g. AVX2 without FMA and F16C, or a mask
      // keeping only fma).
      out.unused = list(used.names());
      why = "it has " + out.unused + ", for which this build of dattn has no engine";
    } else if (!detected.names().empty()) {
      const char* mask = std::getenv("DATTN_CPU_FEATURES");
      out.unused = list(detected.names());
      why = "DATTN_CPU_FEATURES=" + std::string(mask == nullptr ? "" : mask) + " hides its " +
            out.unused + " (a testing tool; unset it to use them)";
    } else {
#if defined(__x86_64__) || defined(__i386__)
      out.unused = "sse2";  // every x86-64 CPU; dattn's x86 engines start at AVX2
      why = "it has SSE2 but not AVX2, FMA and F16C, which dattn's x86 engines start at";
#else
      return std::nullopt;  // no SIMD known to the build: nothing is left unused
#endif
    }
    out.message = "dattn runs far below " + out.cpu + ": its attention runs on the " + out.engine +
                  " engine (one lane, no SIMD) because " + why;
    return out;
  }();
  return shortfall;
}

std::vector<EngineInfo> flash_engines() {
  std::vector<EngineInfo> out;
  for (const flash::Engine& e : flash::engines())
    out.push_back({std::string(e.name), e.rank, std::string(flash::compute_dtype_name(e.compute)),
                   e.emulated, e.unavailable()});
  return out;
}

}  // namespace dattn
