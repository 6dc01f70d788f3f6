// Reading and writing the safetensors format (https://github.com/huggingface/safetensors).
//
// A file is an 8-byte little-endian header length N, N bytes of JSON, then the data buffer.
// The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// into the data buffer), plus an optional "__metadata__" object of strings. Supported dtypes:
// F32, BF16, F16, F8_E4M3, I8, I32 and BOOL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dattn/tensor.hpp"

namespace dattn {

// Longer headers are rejected as malformed (the reference implementation's limit).
inline constexpr std::uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// A safetensors file loaded into memory.
struct SafetensorsFile {
  std::map<std::string, Tensor, std::less<>> tensors;        // owning, contiguous
  std::map<std::string, std::string, std::less<>> metadata;  // the "__metadata__" object

  bool contains(std::string_view name) const;
  // Throws InvalidArgument (field "name") naming `name` and listing the tensors present.
  const Tensor& at(std::string_view name) const;
};

// Loads every tensor of the file at `path`. Throws InvalidArgument (field "path", the message
// starting with the path) if the file cannot be read or is malformed in any way: truncated,
// header too long or not a JSON object, entries with missing or mistyped keys, unsupported
// dtypes, negative or overflowing shapes, data_offsets outside the data buffer, disagreeing
// with dtype and shape, or overlapping another tensor's. Bytes of the data buffer that no
// tensor covers are ignored.
SafetensorsFile read_safetensors(const std::string& path);

// As read_safetensors, for a file already in memory; errors use field "bytes" and start with
// `origin`.
SafetensorsFile parse_safetensors(std::span<const std::byte> bytes,
                                  std::string_view origin = "<memory>");

// Writes `tensors` (CPU views of any strides, stored contiguous and bit exact) and `metadata` to
// `path`, replacing it. Tensors are laid out back to back in name order; the header is padded
// with spaces to a multiple of 8 bytes. Throws InvalidArgument for duplicate names, the reserved
// name "__metadata__", names or metadata that are not valid UTF-8, views without data, or I/O
// failures (field "path", naming the path and the system's reason); Unsupported for views that
// are not on the CPU.
//
// The replacement is atomic: the file is written to a temporary next to `path`
// ("<path>.tmpXXXXXXXX"), flushed to disk and renamed over `path`, so that a failed write (a
// full disk, RLIMIT_FSIZE: SIGXFSZ is ignored during the call, so it fails with EFBIG) leaves
// the previous file as it was and no temporary behind. An existing file keeps its permission
// bits, a new one gets 0666 less the umask; a symlink is followed and its target replaced. A
// `path` that exists but is not a regular file (a pipe, a device) is written in place.
void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string, std::less<>>& metadata = {});

}  // namespace dattn
