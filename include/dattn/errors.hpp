// Typed errors raised by dattn. Every message names the field, the value and what is valid.
#pragma once

#include <stdexcept>
#include <string>

namespace dattn {

// Base of every error dattn raises on purpose.
class Error : public std::runtime_error {
 public:
  Error(std::string field, const std::string& message)
      : std::runtime_error(message), field_(std::move(field)) {}
  // The input field (or backend feature) the error is about, e.g. "cu_seqlens_q".
  const std::string& field() const noexcept { return field_; }

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
