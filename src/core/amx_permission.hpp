// AMX tile state on Linux: a process must ask the kernel for permission to use the tile data
// registers (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) before its first tile
// instruction, or that instruction faults (SIGILL). Each thread then loads its own tile
// configuration (ldtilecfg) and releases the tiles when done (tilerelease), so that the kernel
// need not save 8 KiB of tile data on every context switch.
#pragma once

#include <optional>
#include <string>

namespace dattn::detail {

// Why this process cannot execute AMX-BF16 tile instructions; nullopt when it can. The first
// call asks the kernel for permission (once per process, thread-safe); later calls return the
// same answer. Reasons: the CPU lacks AMX-TILE or AMX-BF16, the OS does not enable the tile
// state in XCR0, the kernel is not Linux or refuses the request (with its errno).
const std::optional<std::string>& amx_unavailable();

}  // namespace dattn::detail
