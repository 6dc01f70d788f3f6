#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "core/strings.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/errors.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#endif

namespace dattn {

namespace {

#if defined(__x86_64__) || defined(__i386__)

struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

// cpuid(leaf, sub); all zero when the leaf is above the maximum the CPU reports.
Regs cpuid(unsigned leaf, unsigned sub = 0) {
  Regs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) return Regs{};
  return r;
}

bool bit(unsigned v, int n) {
  return ((v >> n) & 1u) != 0;
}

// XCR0: the register state the OS saves on context switch. Only valid when CPUID.1:ECX.OSXSAVE.
unsigned long long xgetbv0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0u));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

std::string regs_string(const unsigned* words, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k < 4; ++k) {
      const char ch = static_cast<char>((words[i] >> (8 * k)) & 0xffu);
      if (ch != '\0') s.push_back(ch);
    }
  }
  return s;
}

std::string trim(const std::string& s) {
  return std::string(detail::trimmed(s));
}

void detect_x86(CpuFeatures& f) {
  const Regs l0 = cpuid(0);
  const unsigned max_leaf = l0.a;
  const unsigned vendor_words[3] = {l0.b, l0.d, l0.c};
  f.vendor = regs_string(vendor_words, 3);

  const unsigned max_ext = cpuid(0x80000000u).a;
  if (max_ext >= 0x80000004u) {
    unsigned words[12];
    for (unsigned i = 0; i < 3; ++i) {
      const Regs r = cpuid(0x80000002u + i);
      words[4 * i + 0] = r.a;
      words[4 * i + 1] = r.b;
      words[4 * i + 2] = r.c;
      words[4 * i + 3] = r.d;
    }
    f.brand = trim(regs_string(words, 12));
  }

  if (max_leaf < 1) return;
  const Regs l1 = cpuid(1);
  const bool osxsave = bit(l1.c, 27);
  const bool cpu_avx = bit(l1.c, 28);
  unsigned long long xcr0 = 0;
  if (osxsave) xcr0 = xgetbv0();
  // SSE (bit 1) and AVX (bit 2) state; AVX-512 adds opmask (5), ZMM_Hi256 (6), Hi16_ZMM (7);
  // AMX adds XTILECFG (17) and XTILEDATA (18).
  const bool os_avx = osxsave && (xcr0 & 0x6u) == 0x6u;
  const bool os_avx512 = os_avx && (xcr0 & 0xe0u) == 0xe0u;
  const bool os_amx = osxsave && (xcr0 & 0x60000u) == 0x60000u;

  const bool avx = cpu_avx && os_avx;
  f.fma = avx && bit(l1.c, 12);
  f.f16c = avx && bit(l1.c, 29);

  if (max_leaf < 7) return;
  const Regs l7 = cpuid(7, 0);
  f.avx2 = avx && bit(l7.b, 5);
  f.amx_int8 = os_amx && bit(l7.d, 25);
  f.avx512f = os_avx512 && bit(l7.b, 16);
  f.avx512dq = f.avx512f && bit(l7.b, 17);
  f.avx512bw = f.avx512f && bit(l7.b, 30);
  f.avx512vl = f.avx512f && bit(l7.b, 31);
  f.avx512_vnni = f.avx512f && bit(l7.c, 11);
  f.avx512_fp16 = f.avx512f && bit(l7.d, 23);
  f.amx_bf16 = os_amx && bit(l7.d, 22);
  f.amx_tile = os_amx && bit(l7.d, 24);
  if (l7.a >= 1) {  // leaf 7 reports its highest sub-leaf in EAX
    const Regs l71 = cpuid(7, 1);
    f.avx_vnni = f.avx2 && bit(l71.a, 4);
    f.avx512_bf16 = f.avx512f && bit(l71.a, 5);
  }
}

#endif

#if defined(__aarch64__)

// The kernel's HWCAP bits (arch/arm64/include/uapi/asm/hwcap.h), spelled out so the build needs
// no particular kernel headers.
constexpr unsigned long kHwcapAsimd = 1ul << 1, kHwcapCpuid = 1ul << 11, kHwcapAsimddp = 1ul << 20,
                        kHwcapSve = 1ul << 22;
constexpr unsigned long kHwcap2Sve2 = 1ul << 1, kHwcap2I8mm = 1ul << 13, kHwcap2Bf16 = 1ul << 14;

// "ARM Neoverse-N1" from MIDR_EL1 (which Linux lets user space read where HWCAP_CPUID says so,
// emulating the MRS), for the cores dattn is tuned for; else the implementer and part numbers.
std::string aarch64_brand(unsigned long midr) {
  const unsigned implementer = (midr >> 24) & 0xff, part = (midr >> 4) & 0xfff;
  struct Part {
    unsigned implementer, part;
    const char* name;
  };
  static constexpr Part kParts[] = {
      {0x41, 0xd08, "ARM Cortex-A72"},  {0x41, 0xd0b, "ARM Cortex-A76"},
      {0x41, 0xd0c, "ARM Neoverse-N1"}, {0x41, 0xd40, "ARM Neoverse-V1"},
      {0x41, 0xd49, "ARM Neoverse-N2"}, {0x41, 0xd4f, "ARM Neoverse-V2"},
      {0x41, 0xd8e, "ARM Neoverse-N3"}, {0x41, 0xd84, "ARM Neoverse-V3"},
      {0x46, 0x001, "Fujitsu A64FX"},   {0xc0, 0xac3, "Ampere-1"},
      {0x61, 0x000, "Apple (virtual)"},
  };
  for (const Part& p : kParts)
    if (p.implementer == implementer && p.part == part) return p.name;
  char text[64];
  std::snprintf(text, sizeof text, "AArch64 CPU (implementer 0x%02x, part 0x%03x)", implementer,
                part);
  return text;
}

void detect_aarch64(CpuFeatures& f) {
  f.neon = true;  // Advanced SIMD is mandatory on AArch64
#if defined(__linux__)
  const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
  f.neon = (hwcap & kHwcapAsimd) != 0 || hwcap == 0;
  f.asimddp = f.neon && (hwcap & kHwcapAsimddp) != 0;
  f.bf16 = f.neon && (hwcap2 & kHwcap2Bf16) != 0;
  f.i8mm = f.neon && (hwcap2 & kHwcap2I8mm) != 0;
  f.sve = (hwcap & kHwcapSve) != 0;
  f.sve2 = f.sve && (hwcap2 & kHwcap2Sve2) != 0;
  if (f.sve) {
    const int vl = prctl(PR_SVE_GET_VL);  // bytes, with flags above PR_SVE_VL_LEN_MASK
    if (vl > 0) f.sve_bits = 8 * (vl & 0xffff);
    if (f.sve_bits == 0) f.sve = f.sve2 = false;
  }
  f.vendor = "ARM";
  if ((hwcap & kHwcapCpuid) != 0) {
    unsigned long midr = 0;
    __asm__ volatile("mrs %0, MIDR_EL1" : "=r"(midr));
    f.brand = aarch64_brand(midr);
  }
#endif
}

#endif

int count_logical_cpus() {
  int n = static_cast<int>(std::thread::hardware_concurrency());
#if defined(_SC_NPROCESSORS_ONLN)
  if (n <= 0) n = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
#endif
  return n > 0 ? n : 1;
}

// The first CPU's level-2 cache from sysfs (index2 when its level says 2; sizes as "2048K"),
// else glibc's sysconf; 0 when neither knows.
long long detect_l2_bytes() {
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream level(dir + "/level"), type(dir + "/type"), size(dir + "/size");
    int l = 0;
    std::string t, text;
    if (!(level >> l)) break;
    if (l != 2 || !(type >> t) || t == "Instruction" || !(size >> text) || text.empty()) continue;
    long long bytes = 0;
    const char* end = text.data() + text.size();
    const auto [unit, err] = std::from_chars(text.data(), end, bytes);
    if (err != std::errc() || bytes <= 0) continue;
    if (unit != end && *unit == 'K') bytes <<= 10;
    if (unit != end && *unit == 'M') bytes <<= 20;
    return bytes;
  }
#if defined(_SC_LEVEL2_CACHE_SIZE)
  const long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
  if (n > 0) return n;
#endif
  return 0;
}

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  detect_x86(f);
#elif defined(__aarch64__)
  detect_aarch64(f);
#endif
  f.logical_cpus = count_logical_cpus();
  f.l2_bytes = detect_l2_bytes();
  return f;
}

}  // namespace

namespace {

struct Flag {
  bool CpuFeatures::*member;
  const char* name;
};

// Every flag, in declaration order (names() lists them so); the names are Linux's.
constexpr Flag kFlags[] = {
    {&CpuFeatures::avx2, "avx2"},
    {&CpuFeatures::fma, "fma"},
    {&CpuFeatures::f16c, "f16c"},
    {&CpuFeatures::avx_vnni, "avx_vnni"},
    {&CpuFeatures::avx512f, "avx512f"},
    {&CpuFeatures::avx512bw, "avx512bw"},
    {&CpuFeatures::avx512dq, "avx512dq"},
    {&CpuFeatures::avx512vl, "avx512vl"},
    {&CpuFeatures::avx512_bf16, "avx512_bf16"},
    {&CpuFeatures::avx512_vnni, "avx512_vnni"},
    {&CpuFeatures::avx512_fp16, "avx512_fp16"},
    {&CpuFeatures::amx_tile, "amx_tile"},
    {&CpuFeatures::amx_bf16, "amx_bf16"},
    {&CpuFeatures::amx_int8, "amx_int8"},
    {&CpuFeatures::neon, "neon"},
    {&CpuFeatures::asimddp, "asimddp"},
    {&CpuFeatures::bf16, "bf16"},
    {&CpuFeatures::i8mm, "i8mm"},
    {&CpuFeatures::sve, "sve"},
    {&CpuFeatures::sve2, "sve2"},
};

struct CpuClass {
  const char* name;
  const char* allows;  // space-separated flag names; "*" = every flag
};

// The classes of DATTN_CPU_FEATURES (cpu_info.hpp), smallest first.
constexpr CpuClass kClasses[] = {
    {"portable", ""},
    {"avx2", "avx2 fma f16c"},
    {"avx_vnni", "avx2 fma f16c avx_vnni"},
    {"avx512", "avx2 fma f16c avx512f avx512bw avx512dq avx512vl"},
    {"avx512_vnni", "avx2 fma f16c avx512f avx512bw avx512dq avx512vl avx512_vnni"},
    {"avx512_bf16",
     "avx2 fma f16c avx_vnni avx512f avx512bw avx512dq avx512vl avx512_vnni avx512_bf16 "
     "avx512_fp16"},
    {"amx", "*"},
    {"native", "*"},
    {"neon", "neon"},
    {"neon_dotprod", "neon asimddp"},
    {"neon_i8mm", "neon asimddp bf16 i8mm"},
    {"sve", "neon asimddp bf16 i8mm sve sve2"},
};

bool equal_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? char(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

bool listed(std::string_view list, std::string_view name) {
  if (list == "*") return true;
  while (!list.empty()) {
    const std::size_t space = list.find(' ');
    if (list.substr(0, space) == name) return true;
    if (space == std::string_view::npos) break;
    list.remove_prefix(space + 1);
  }
  return false;
}

std::string valid_mask_items() {
  std::string s = "the classes";
  for (const CpuClass& c : kClasses) s += std::string(" ") + c.name;
  s += ", or feature names:";
  for (const Flag& f : kFlags) s += std::string(" ") + f.name;
  return s;
}

}  // namespace

std::vector<std::string> CpuFeatures::names() const {
  std::vector<std::string> out;
  for (const Flag& f : kFlags) {
    if (this->*f.member) out.emplace_back(f.name);
  }
  return out;
}

CpuFeatures apply_cpu_feature_mask(const CpuFeatures& detected, std::string_view spec) {
  spec = detail::trimmed(spec);
  if (spec.empty()) return detected;
  bool allowed[std::size(kFlags)] = {};
  std::string_view rest = spec;
  while (true) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = detail::trimmed(rest.substr(0, comma));
    bool known = false;
    for (const CpuClass& c : kClasses) {
      if (!equal_ignoring_case(item, c.name)) continue;
      known = true;
      for (std::size_t i = 0; i < std::size(kFlags); ++i)
        allowed[i] = allowed[i] || listed(c.allows, kFlags[i].name);
    }
    for (std::size_t i = 0; i < std::size(kFlags); ++i) {
      if (!equal_ignoring_case(item, kFlags[i].name)) continue;
      known = true;
      allowed[i] = true;
    }
    if (!known)
      throw InvalidArgument("DATTN_CPU_FEATURES",
                            "DATTN_CPU_FEATURES = '" + std::string(spec.substr(0, 200)) + "': '" +
                                std::string(item.substr(0, 64)) +
                                "' is neither a CPU class nor a feature; valid: " +
                                valid_mask_items() + " (comma-separated)");
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  CpuFeatures f = detected;
  for (std::size_t i = 0; i < std::size(kFlags); ++i)
    f.*kFlags[i].member = detected.*kFlags[i].member && allowed[i];
  // What extends a feature goes with it (no AVX-512 sub-feature without avx512f, no AMX
  // instruction set without the tile state, no VNNI on 256 bits without AVX2).
  if (!f.avx512f)
    f.avx512bw = f.avx512dq = f.avx512vl = f.avx512_bf16 = f.avx512_vnni = f.avx512_fp16 = false;
  if (!f.avx2) f.avx_vnni = false;
  if (!f.amx_tile) f.amx_bf16 = f.amx_int8 = false;
  if (!f.neon) f.asimddp = f.bf16 = f.i8mm = false;
  if (!f.sve) f.sve2 = false;
  if (!f.sve) f.sve_bits = 0;
  return f;
}

const CpuFeatures& detected_cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

const CpuFeatures& cpu_features() {
  // A throwing initialiser leaves the static uninitialised: a bad mask raises on every call.
  static const CpuFeatures features = [] {
    const char* spec = std::getenv("DATTN_CPU_FEATURES");
    return apply_cpu_feature_mask(detected_cpu_features(), spec == nullptr ? "" : spec);
  }();
  return features;
}

}  // namespace dattn
