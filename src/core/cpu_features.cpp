#include <charconv>
#include <fstream>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "core/strings.hpp"
#include "dattn/cpu_info.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
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
    f.avx512_bf16 = f.avx512f && bit(l71.a, 5);
  }
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
  f.neon = true;  // Advanced SIMD is mandatory on AArch64
#endif
  f.logical_cpus = count_logical_cpus();
  f.l2_bytes = detect_l2_bytes();
  return f;
}

}  // namespace

std::vector<std::string> CpuFeatures::names() const {
  const std::pair<bool, const char*> all[] = {
      {avx2, "avx2"},
      {fma, "fma"},
      {f16c, "f16c"},
      {avx512f, "avx512f"},
      {avx512bw, "avx512bw"},
      {avx512dq, "avx512dq"},
      {avx512vl, "avx512vl"},
      {avx512_bf16, "avx512_bf16"},
      {avx512_vnni, "avx512_vnni"},
      {avx512_fp16, "avx512_fp16"},
      {amx_tile, "amx_tile"},
      {amx_bf16, "amx_bf16"},
      {neon, "neon"},
  };
  std::vector<std::string> out;
  for (const auto& [on, name] : all) {
    if (on) out.emplace_back(name);
  }
  return out;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace dattn
