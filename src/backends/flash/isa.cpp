#include "backends/flash/isa.hpp"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "dattn/cpu_info.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"

namespace dattn::flash {

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::portable:
      return "portable";
    case Isa::avx2:
      return "avx2";
    case Isa::avx512:
      return "avx512";
  }
  return "?";
}

Isa parse_isa(std::string_view name, std::string_view field) {
  for (Isa isa : {Isa::portable, Isa::avx2, Isa::avx512})
    if (names_equal(name, isa_name(isa))) return isa;
  throw InvalidArgument(std::string(field), std::string(field) + " = '" + std::string(name) +
                                                "' is not an ISA level; valid: portable, avx2, "
                                                "avx512");
}

std::vector<Isa> available_isas() {
  const CpuFeatures& f = cpu_features();
  std::vector<Isa> out{Isa::portable};
  if (f.avx2 && f.fma && f.f16c) out.push_back(Isa::avx2);
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx2 && f.fma && f.f16c)
    out.push_back(Isa::avx512);
  return out;
}

Isa process_isa() {
  static const Isa chosen = [] {
    const std::vector<Isa> have = available_isas();
    const char* env = std::getenv("DATTN_ISA");
    if (env == nullptr || *env == '\0') return have.back();
    const Isa want = parse_isa(env, "DATTN_ISA");
    if (std::find(have.begin(), have.end(), want) == have.end())
      throw NotAvailable("DATTN_ISA", "DATTN_ISA = " + std::string(env) +
                                          " is not supported by this CPU; the best it has is " +
                                          std::string(isa_name(have.back())));
    return want;
  }();
  return chosen;
}

}  // namespace dattn::flash
