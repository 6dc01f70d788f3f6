// The check of the CLI's count options (--reps, --heads, --ranks, ...): CLI11's own numeric
// checks print their bounds as floats (a 309-digit upper bound for "positive").
#include <charconv>
#include <string>

#include "commands.hpp"

namespace dattn::cli {

CLI::Validator count_in(std::int64_t lo, std::int64_t hi) {
  const std::string range = std::to_string(lo) + " to " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, range](std::string& text) -> std::string {
        std::int64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [at, ec] = std::from_chars(text.data(), end, value);
        const std::string shown = text.size() > 40 ? text.substr(0, 40) + "..." : text;
        if (ec != std::errc() || at != end || value < lo || value > hi)
          return shown + " is not valid; want " + range;
        return {};
      },
      "INT in [" + std::to_string(lo) + " - " + std::to_string(hi) + "]");
}

}  // namespace dattn::cli
