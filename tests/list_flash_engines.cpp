// Prints the FLASH engines the library lists, one "<name> <compute dtype>" a line: CTest reads
// them to add one flash_conformance_isa_<engine> test per engine, running the cases that fit
// the engine's compute kind (tests/CMakeLists.txt).
#include <iostream>

#include "dattn/engines.hpp"

int main() {
  for (const dattn::EngineInfo& e : dattn::flash_engines())
    std::cout << e.name << ' ' << e.compute_dtype << '\n';
  return 0;
}
