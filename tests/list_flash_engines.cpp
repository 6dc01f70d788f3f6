// Prints the FLASH engines the library lists, one name a line: CTest reads them to add one
// flash_conformance_isa_<engine> test per engine (tests/CMakeLists.txt).
#include <iostream>

#include "dattn/engines.hpp"

int main() {
  for (const dattn::EngineInfo& e : dattn::flash_engines()) std::cout << e.name << '\n';
  return 0;
}
