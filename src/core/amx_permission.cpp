#include "core/amx_permission.hpp"

#include <cerrno>
#include <cstring>

#include "dattn/cpu_info.hpp"

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace dattn::detail {
namespace {

std::optional<std::string> request() {
  const CpuFeatures& f = cpu_features();
  if (!f.amx_tile || !f.amx_bf16)
    return std::string("this CPU (or its OS, through XCR0) lacks AMX-TILE and AMX-BF16");
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
  constexpr unsigned long kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
    return std::string("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
           std::strerror(errno) + ")";
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 ||
      ((granted >> kXfeatureXtiledata) & 1ul) == 0)
    return std::string("Linux did not grant the AMX tile state (ARCH_GET_XCOMP_PERM)");
  return std::nullopt;
#else
  return std::string("AMX needs Linux on x86-64 (arch_prctl ARCH_REQ_XCOMP_PERM)");
#endif
}

}  // namespace

const std::optional<std::string>& amx_unavailable() {
  static const std::optional<std::string> why = request();
  return why;
}

}  // namespace dattn::detail
