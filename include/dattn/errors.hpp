// Typed errors raised by dattn. Every message names the field, the value and what is valid.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

namespace dattn {

// Base of every error dattn raises on purpose.
class Error : public std::runtime_error {
 public:
  Error(std::string field, const std::string& message)
      : std::runtime_error(bounded(message, kMaxMessage)),
        field_(bounded(std::move(field), kMaxField)) {}
  // The input field (or backend feature) the error is about, e.g. "cu_seqlens_q".
  const std::string& field() const noexcept { return field_; }

  // Messages and fields quote what the caller passed; a value of 200 kB (a misspelled option
  // key, a name) is quoted by its start and end, so that no message outgrows these.
  static constexpr std::size_t kMaxMessage = 2048, kMaxField = 256;
  // `s`, or its start and end around a note of how much was left out where it is longer than
  // `limit` bytes (cut between UTF-8 characters).
  static std::string bounded(std::string s, std::size_t limit) {
    if (s.size() <= limit) return s;
    const auto boundary = [&](std::size_t at) {  // back to the start of a UTF-8 character
      while (at > 0 && at < s.size() && (static_cast<unsigned char>(s[at]) & 0xC0) == 0x80) --at;
      return at;
    };
    const std::size_t head = boundary(limit * 5 / 8), tail = boundary(s.size() - limit / 4);
    return s.substr(0, head) + " ... [" + std::to_string(tail - head) + " bytes left out] ... " +
           s.substr(tail);
  }

 private:
  std::string field_;
};

// The input is malformed: wrong shape, dtype, range, inconsistent metadata.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The input is well formed but the chosen backend (or platform) does not support it.
class Unsupported : public Error {
 public:
  using Error::Error;
};

// The backend cannot run on this machine at all (missing dependency or hardware).
class NotAvailable : public Error {
 public:
  using Error::Error;
};

}  // namespace dattn
