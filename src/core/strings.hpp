// Small string helpers shared by the library's parsers.
#pragma once

#include <string_view>

namespace dattn::detail {

// `s` without surrounding ASCII whitespace (space, \t, \n, \v, \f, \r).
constexpr std::string_view trimmed(std::string_view s) {
  constexpr auto space = [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

}  // namespace dattn::detail
