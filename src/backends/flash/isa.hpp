// Instruction-set levels of the FLASH CPU kernels, chosen once per process from the CPU's
// features; DATTN_ISA=portable|avx2|avx512 forces a level the machine has.
#pragma once

#include <string_view>
#include <vector>

namespace dattn::flash {

enum class Isa { portable, avx2, avx512 };

std::string_view isa_name(Isa isa);
// Throws InvalidArgument naming `field` and the valid names.
Isa parse_isa(std::string_view name, std::string_view field);
// The levels this machine runs, lowest first (portable is always there).
std::vector<Isa> available_isas();
// The best available level, or DATTN_ISA when set (NotAvailable if the machine lacks it).
Isa process_isa();

}  // namespace dattn::flash
