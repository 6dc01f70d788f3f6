// libFuzzer target: the safetensors reader on arbitrary bytes, from memory (parse_safetensors)
// and from a file (read_safetensors, through a memfd), which must agree. Anything but a
// dattn::Error escaping either, a disagreement, or a sanitizer report is a finding.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>

#include "dattn/errors.hpp"
#include "dattn/safetensors.hpp"

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "fuzz_safetensors: %s\n", what);
  std::abort();
}

// The file read_safetensors reads: a memfd rewritten for every input.
const std::string& as_file(std::span<const std::byte> bytes) {
  static const int fd = ::memfd_create("fuzz_safetensors", 0);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (fd < 0 || ::ftruncate(fd, 0) != 0) finding("cannot reset the memfd");
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ::ssize_t n = ::pwrite(fd, bytes.data() + done, bytes.size() - done, ::off_t(done));
    if (n <= 0) finding("cannot write the memfd");
    done += std::size_t(n);
  }
  return path;
}

// The file, or nothing if it is rejected with a dattn::Error.
template <class Read>
std::optional<dattn::SafetensorsFile> attempt(Read read) {
  try {
    return read();
  } catch (const dattn::Error&) {
    return std::nullopt;
  }
}

bool same(const dattn::SafetensorsFile& a, const dattn::SafetensorsFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (const auto& [name, t] : a.tensors) {
    if (!b.contains(name)) return false;
    const dattn::Tensor& u = b.at(name);
    if (t.dtype() != u.dtype() || !std::ranges::equal(t.shape(), u.shape()) ||
        t.nbytes() != u.nbytes() ||
        (t.nbytes() > 0 && std::memcmp(t.data(), u.data(), t.nbytes()) != 0))
      return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span bytes(reinterpret_cast<const std::byte*>(data), size);
  const auto from_memory = attempt([&] { return dattn::parse_safetensors(bytes, "fuzz"); });
  if (from_memory)
    for (const auto& [name, t] : from_memory->tensors)
      if (t.nbytes() > size) finding("a tensor larger than the input");
  const std::string& path = as_file(bytes);
  const auto from_file = attempt([&] { return dattn::read_safetensors(path); });
  if (from_memory.has_value() != from_file.has_value())
    finding(from_memory ? "read_safetensors rejects what parse_safetensors accepts"
                        : "parse_safetensors rejects what read_safetensors accepts");
  if (from_memory && !same(*from_memory, *from_file))
    finding("read_safetensors and parse_safetensors load different files");
  return 0;
}
