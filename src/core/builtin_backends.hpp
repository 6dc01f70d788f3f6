// The hook through which the registry gets the backends dattn ships. Declared here so that
// core includes no backend; defined by src/backends/builtin.cpp.
#pragma once

namespace dattn {

class Registry;

// Adds FLASH, REFERENCE and VIDEO_SPARSE to `registry`.
void register_builtin_backends(Registry& registry);

}  // namespace dattn
