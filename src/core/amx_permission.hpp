// AMX tile state on Linux: a process must ask the kernel for permission to use the tile data
// registers (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) before its first tile
// instruction, or that instruction faults (SIGILL). Each thread then loads its own tile
// configuration (ldtilecfg) and releases the tiles when done (tilerelease), so that the kernel
// need not save 8 KiB of tile data on every context switch.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace dattn::detail {

// The tile configuration dattn loads (ldtilecfg): palette 1, tiles 0-7 of 16 rows x 64 bytes
// (bytes 16-47: bytes per row of each tile, uint16 little-endian; bytes 48-63: rows). Kept in
// memory: GCC 12's _tile_loadconfig tells the compiler it reads only 8 bytes of it.
alignas(64) inline constexpr std::array<std::uint8_t, 64> kAmxTileConfig = [] {
  std::array<std::uint8_t, 64> c{};
  c[0] = 1;
  for (std::size_t t = 0; t < 8; ++t) {
    c[16 + 2 * t] = 64;
    c[48 + t] = 16;
  }
  return c;
}();

// Why this process cannot execute AMX-BF16 tile instructions; nullopt when it can. The first
// call asks the kernel for permission (once per process, thread-safe); later calls return the
// same answer. Reasons: the CPU lacks AMX-TILE or AMX-BF16, the OS does not enable the tile
// state in XCR0, the kernel is not Linux or refuses the request (with its errno).
const std::optional<std::string>& amx_unavailable();

}  // namespace dattn::detail
