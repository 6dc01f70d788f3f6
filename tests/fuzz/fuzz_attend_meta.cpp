// libFuzzer target: the META reader of `dattn attend` (parse_meta, apply_meta) on arbitrary text.
// Anything but a dattn::Error escaping it, or a sanitizer report, is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string_view>

#include "attend_meta.hpp"
#include "dattn/errors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const nlohmann::json meta = dattn::cli::parse_meta(text, "fuzz.meta.json");
    dattn::cli::AttendCall call;
    dattn::cli::apply_meta(meta, call);
  } catch (const dattn::Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_attend_meta: not a dattn::Error: %s\n", e.what());
    std::abort();
  }
  return 0;
}
