// The FLASH backend's engines: the kernel sets it can run on this machine, for `dattn info`, the
// tests and callers that want to know what DATTN_ISA and the `isa` backend option accept.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace dattn {

struct EngineInfo {
  std::string name;           // what DATTN_ISA and the isa option accept, e.g. "avx512_bf16"
  int rank = 0;               // place on the ladder (portable 0); an emulated twin has its twin's
  std::string compute_dtype;  // "f32" (exact for f32/bf16/f16 inputs) or "bf16" (bf16 products)
  bool emulated = false;      // never chosen automatically, only by its exact name
  std::optional<std::string> unavailable_reason;  // why this CPU cannot run it; none if it can
};

// Every engine of the table, in ladder order (emulated twins after their real ones).
std::vector<EngineInfo> flash_engines();

}  // namespace dattn
