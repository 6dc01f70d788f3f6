#include "dattn/safetensors.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <optional>
#include <system_error>

#include <nlohmann/json.hpp>

#include "dattn/errors.hpp"

namespace dattn {

// Tensor bytes are copied between files and memory as they are.
static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; big-endian hosts would need byte swapping");

namespace {

using nlohmann::json;

constexpr std::size_t kPrefixBytes = 8;  // the u64 header length
constexpr std::string_view kMetadataKey = "__metadata__";
// A valid header nests 3 levels (root, entry, shape); deeper JSON is rejected before it is built.
constexpr int kMaxHeaderDepth = 16;

struct DTypeName {
  DType type;
  std::string_view name;
};
constexpr std::array<DTypeName, 7> kDTypeNames{{
    {DType::F32, "F32"},
    {DType::BF16, "BF16"},
    {DType::F16, "F16"},
    {DType::FP8_E4M3, "F8_E4M3"},
    {DType::I8, "I8"},
    {DType::I32, "I32"},
    {DType::Bool, "BOOL"},
}};
constexpr std::string_view kValidDTypes = "F32, BF16, F16, F8_E4M3, I8, I32, BOOL";

std::string_view safetensors_dtype_name(DType t) {
  for (const DTypeName& d : kDTypeNames)
    if (d.type == t) return d.name;
  return "?";
}

std::optional<DType> parse_safetensors_dtype(std::string_view name) {
  for (const DTypeName& d : kDTypeNames)
    if (d.name == name) return d.type;
  return std::nullopt;
}

// 'text' for messages, cut (on a UTF-8 boundary) so that hostile headers keep messages short.
std::string in_quotes(std::string_view text) {
  constexpr std::size_t kMaxChars = 64;
  if (text.size() <= kMaxChars) return "'" + std::string(text) + "'";
  std::size_t n = kMaxChars;
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xc0u) == 0x80u) --n;
  return "'" + std::string(text.substr(0, n)) + "...'";
}

std::string join(std::span<const std::int64_t> xs) {
  std::string s = "[";
  for (std::size_t i = 0; i < xs.size(); ++i) s += (i ? ", " : "") + std::to_string(xs[i]);
  return s + "]";
}

std::string range(std::uint64_t begin, std::uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// The source being read; every error names it.
struct Origin {
  std::string_view field;  // "path" or "bytes"
  std::string_view name;   // the path, or what the caller called the bytes

  [[noreturn]] void fail(const std::string& message) const {
    throw InvalidArgument(std::string(field), std::string(name) + ": " + message);
  }
  [[noreturn]] void fail(std::string_view tensor, const std::string& message) const {
    fail("tensor " + in_quotes(tensor) + ": " + message);
  }
};

// One validated header entry.
struct Entry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // byte range in the data buffer
  std::uint64_t end = 0;
};

struct Header {
  std::vector<Entry> entries;  // ordered by data offset
  std::map<std::string, std::string, std::less<>> metadata;
};

void check_file_size(std::uint64_t size, const Origin& origin) {
  if (size < kPrefixBytes)
    origin.fail("the file is " + std::to_string(size) +
                " bytes long, too short for the 8-byte header length");
}

// Decodes the header length and checks it against the limit and the `file_size`.
std::uint64_t header_length(std::span<const std::byte, kPrefixBytes> prefix,
                            std::uint64_t file_size, const Origin& origin) {
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < kPrefixBytes; ++i)
    n |= std::uint64_t{std::to_integer<std::uint8_t>(prefix[i])} << (8 * i);
  if (n > kSafetensorsMaxHeaderBytes)
    origin.fail("header length " + std::to_string(n) + " exceeds the limit of " +
                std::to_string(kSafetensorsMaxHeaderBytes) + " bytes");
  if (n > file_size - kPrefixBytes)
    origin.fail("header length " + std::to_string(n) + " runs past the end of the file (" +
                std::to_string(file_size - kPrefixBytes) + " bytes follow the length)");
  return n;
}

std::array<std::byte, kPrefixBytes> encode_header_length(std::uint64_t n) {
  std::array<std::byte, kPrefixBytes> out{};
  for (std::size_t i = 0; i < kPrefixBytes; ++i) out[i] = static_cast<std::byte>(n >> (8 * i));
  return out;
}

// A JSON integer >= 0 ("-0" included); nullopt for negatives, fractions and non-numbers.
std::optional<std::uint64_t> non_negative_integer(const json& j) {
  if (j.is_number_unsigned()) return j.get<std::uint64_t>();
  if (j.is_number_integer() && j.get<std::int64_t>() >= 0)
    return static_cast<std::uint64_t>(j.get<std::int64_t>());
  return std::nullopt;
}

const json& require_key(const json& entry, const char* key, const std::string& name,
                        const Origin& origin) {
  const auto it = entry.find(key);
  if (it == entry.end()) origin.fail(name, std::string("missing key '") + key + "'");
  return *it;
}

DType parse_entry_dtype(const json& j, const std::string& name, const Origin& origin) {
  if (!j.is_string())
    origin.fail(name, std::string("'dtype' must be a string, got ") + j.type_name());
  const auto& text = j.get_ref<const std::string&>();
  const std::optional<DType> dtype = parse_safetensors_dtype(text);
  if (!dtype)
    origin.fail(name, "dtype " + in_quotes(text) +
                          " is not supported; valid: " + std::string(kValidDTypes));
  return *dtype;
}

// The shape, checked so that every element count, stride and byte size derived from it (with
// empty dims counted as 1) fits in int64. Sets `nbytes` to the tensor's size in bytes.
std::vector<std::int64_t> parse_entry_shape(const json& j, DType dtype, std::uint64_t& nbytes,
                                            const std::string& name, const Origin& origin) {
  if (!j.is_array())
    origin.fail(name, std::string("'shape' must be an array of integers, got ") + j.type_name());
  if (j.size() > TensorView::kMaxDims)
    origin.fail(name, "'shape' has " + std::to_string(j.size()) + " dimensions; at most " +
                          std::to_string(TensorView::kMaxDims) + " are supported");
  constexpr auto kLimit = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t extent = dtype_size(dtype);
  nbytes = dtype_size(dtype);
  std::vector<std::int64_t> shape;
  for (const json& d : j) {
    const std::string which = "dimension " + std::to_string(shape.size()) + " of 'shape'";
    if (!d.is_number_integer())
      origin.fail(name, which + " must be an integer, got " +
                            (d.is_number_float() ? "a fraction or out-of-range number"
                                                 : std::string(d.type_name())));
    const std::optional<std::uint64_t> dim = non_negative_integer(d);
    if (!dim) origin.fail(name, which + " is negative (" + d.dump() + ")");
    if (*dim > kLimit || (*dim > 1 && extent > kLimit / *dim))
      origin.fail(name, which + " (" + std::to_string(*dim) +
                            ") makes the tensor's byte size overflow 64 bits");
    extent *= std::max<std::uint64_t>(*dim, 1);
    nbytes *= *dim;
    shape.push_back(static_cast<std::int64_t>(*dim));
  }
  return shape;
}

Entry parse_entry(const std::string& name, const json& j, std::uint64_t data_size,
                  const Origin& origin) {
  if (!j.is_object())
    origin.fail(name,
                std::string("entry must be an object with 'dtype', 'shape' and 'data_offsets', "
                            "got ") +
                    j.type_name());
  Entry e;
  e.name = name;
  e.dtype = parse_entry_dtype(require_key(j, "dtype", name, origin), name, origin);
  std::uint64_t nbytes = 0;
  e.shape = parse_entry_shape(require_key(j, "shape", name, origin), e.dtype, nbytes, name, origin);

  const json& offsets = require_key(j, "data_offsets", name, origin);
  std::optional<std::uint64_t> begin, end;
  if (offsets.is_array() && offsets.size() == 2) {
    begin = non_negative_integer(offsets[0]);
    end = non_negative_integer(offsets[1]);
  }
  if (!begin || !end)
    origin.fail(name, "'data_offsets' must be two non-negative integers [begin, end]");
  e.begin = *begin;
  e.end = *end;
  if (e.end < e.begin) origin.fail(name, "data_offsets " + range(e.begin, e.end) + " decrease");
  if (e.end > data_size)
    origin.fail(name, "data_offsets " + range(e.begin, e.end) + " run past the end of the " +
                          std::to_string(data_size) + "-byte data buffer");
  if (e.end - e.begin != nbytes)
    origin.fail(name, "data_offsets " + range(e.begin, e.end) + " hold " +
                          std::to_string(e.end - e.begin) + " bytes but " +
                          std::string(safetensors_dtype_name(e.dtype)) + " shape " + join(e.shape) +
                          " needs " + std::to_string(nbytes));
  return e;
}

std::map<std::string, std::string, std::less<>> parse_metadata(const json& j,
                                                               const Origin& origin) {
  if (!j.is_object())
    origin.fail(std::string("'__metadata__' must be an object of strings, got ") + j.type_name());
  std::map<std::string, std::string, std::less<>> out;
  for (const auto& [key, value] : j.items()) {
    if (!value.is_string())
      origin.fail("'__metadata__' value for key " + in_quotes(key) + " must be a string, got " +
                  value.type_name());
    out.emplace(key, value.get<std::string>());
  }
  return out;
}

// Sorts `entries` by offset and rejects overlapping (non-empty) byte ranges.
void check_disjoint(std::vector<Entry>& entries, const Origin& origin) {
  std::ranges::sort(entries, {}, [](const Entry& e) { return std::pair(e.begin, e.end); });
  const Entry* previous = nullptr;  // the last non-empty range; it reaches furthest
  for (const Entry& e : entries) {
    if (e.begin == e.end) continue;
    if (previous != nullptr && e.begin < previous->end)
      origin.fail("tensors " + in_quotes(previous->name) + " " +
                  range(previous->begin, previous->end) + " and " + in_quotes(e.name) + " " +
                  range(e.begin, e.end) + " overlap in the data buffer");
    previous = &e;
  }
}

Header parse_header(std::string_view text, std::uint64_t data_size, const Origin& origin) {
  const json::parser_callback_t limit_depth = [&origin](int depth, json::parse_event_t, json&) {
    if (depth > kMaxHeaderDepth)
      origin.fail("header JSON is nested deeper than " + std::to_string(kMaxHeaderDepth) +
                  " levels");
    return true;
  };
  // nlohmann's lexer takes a NUL byte for the end of input and would ignore what follows.
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)
    origin.fail("header is not valid JSON: NUL byte at offset " + std::to_string(nul));
  json root;
  try {
    root = json::parse(text.begin(), text.end(), limit_depth);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for numbers like 1e999
    std::string_view what = e.what();   // "[json.exception.parse_error.101] parse error at ..."
    if (const auto pos = what.find("] "); pos != std::string_view::npos)
      what.remove_prefix(pos + 2);
    origin.fail("header is not valid JSON: " + std::string(what));
  }
  if (!root.is_object())
    origin.fail(std::string("header must be a JSON object, got ") + root.type_name());

  Header header;
  for (const auto& [name, value] : root.items()) {
    if (name == kMetadataKey)
      header.metadata = parse_metadata(value, origin);
    else
      header.entries.push_back(parse_entry(name, value, data_size, origin));
  }
  check_disjoint(header.entries, origin);
  return header;
}

void read_exact(std::istream& in, void* dst, std::uint64_t n, const Origin& origin) {
  in.read(static_cast<char*>(dst), static_cast<std::streamsize>(n));
  if (!in || static_cast<std::uint64_t>(in.gcount()) != n)
    origin.fail("read error or unexpected end of file");
}

// Copies `view` (any strides) to `out` in row-major order, bit exact.
void gather_contiguous(const TensorView& view, std::byte* out) {
  const std::int64_t n = view.numel();
  const std::size_t es = dtype_size(view.dtype());
  const int nd = view.ndim();
  std::array<std::int64_t, TensorView::kMaxDims> index{};
  for (std::int64_t e = 0; e < n; ++e, out += es) {
    std::memcpy(out, view.element_ptr(std::span(index.data(), std::size_t(nd))), es);
    for (int i = nd - 1; i >= 0; --i) {
      if (++index[std::size_t(i)] < view.size(i)) break;
      index[std::size_t(i)] = 0;
    }
  }
}

// Throws InvalidArgument(field) if `text` is not valid UTF-8 (which JSON requires).
void require_utf8(const std::string& text, const char* field, const std::string& what) {
  try {
    static_cast<void>(json(text).dump());
  } catch (const json::type_error&) {
    throw InvalidArgument(field, what + " " + in_quotes(text) + " is not valid UTF-8");
  }
}

std::string error_text(int error) {
  return std::error_code(error, std::generic_category()).message();
}

// Ignores SIGXFSZ while any instance is alive, so that a write past RLIMIT_FSIZE fails with
// EFBIG instead of killing the process; the last one restores the previous disposition.
class IgnoreFileSizeSignal {
 public:
  IgnoreFileSizeSignal() {
    const std::lock_guard lock(mutex_);
    if (users_++ > 0) return;
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    saved_ = ::sigaction(SIGXFSZ, &ignore, &previous_) == 0;
  }
  IgnoreFileSizeSignal(const IgnoreFileSizeSignal&) = delete;
  IgnoreFileSizeSignal& operator=(const IgnoreFileSizeSignal&) = delete;
  ~IgnoreFileSizeSignal() {
    const std::lock_guard lock(mutex_);
    if (--users_ == 0 && saved_) ::sigaction(SIGXFSZ, &previous_, nullptr);
  }

 private:
  static inline std::mutex mutex_;
  static inline int users_ = 0;
  static inline bool saved_ = false;
  static inline struct sigaction previous_ {};
};

// A file written through a temporary in the target's directory that commit() renames over the
// target once it is complete and on disk: until then, and after any failure, the target keeps
// its previous contents, and the temporary is removed. An existing target's permission bits are
// kept; a new one gets 0666 less the umask, as a plain create would. A target that exists but is
// not a regular file (a device, a FIFO), or has no path to put a temporary next to (a deleted
// file or memfd reached through /proc/self/fd), is written in place. Errors throw InvalidArgument
// (field "path") naming the path and the system's reason.
class AtomicOutput {
 public:
  explicit AtomicOutput(const std::string& path) : path_(path), target_(path) {
    std::optional<mode_t> keep_mode;
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) fail("", EISDIR);
      if (!S_ISREG(st.st_mode)) {
        open_in_place();
        return;
      }
      keep_mode = st.st_mode & 07777;
      // A symlink: replace the file it leads to, as writing through the link would.
      if (is_symlink(path)) {
        const std::optional<std::string> real = path_of_file(path, st);
        if (!real) {
          open_in_place();
          return;
        }
        target_ = *real;
      }
    }
    create_temporary();
    if (keep_mode && ::fchmod(fd_, *keep_mode) != 0) {
      const int error = errno;
      fail("cannot set the mode of '" + temp_ + "'", error);
    }
  }
  AtomicOutput(const AtomicOutput&) = delete;
  AtomicOutput& operator=(const AtomicOutput&) = delete;
  ~AtomicOutput() { discard(); }

  void write(const void* src, std::uint64_t n) {
    constexpr std::uint64_t kMaxChunk = std::uint64_t{1} << 30;
    const auto* p = static_cast<const char*>(src);
    while (n > 0) {
      const ::ssize_t written = ::write(fd_, p, std::min(n, kMaxChunk));
      if (written < 0) {
        const int error = errno;
        if (error == EINTR) continue;
        fail("write error", error);
      }
      if (written == 0) fail("write error", EIO);
      p += written;
      n -= static_cast<std::uint64_t>(written);
    }
  }

  void commit() {
    if (!direct_ && ::fsync(fd_) != 0) {
      const int error = errno;
      fail("cannot flush '" + temp_ + "' to disk", error);
    }
    if (::close(std::exchange(fd_, -1)) != 0) {
      const int error = errno;
      fail("cannot close '" + (direct_ ? path_ : temp_) + "'", error);
    }
    if (direct_) return;
    if (::rename(temp_.c_str(), target_.c_str()) != 0) {
      const int error = errno;
      fail("cannot rename '" + temp_ + "' over it", error);
    }
    temp_.clear();
    sync_directory();
  }

 private:
  static bool is_symlink(const std::string& path) {
    struct stat link {};
    return ::lstat(path.c_str(), &link) == 0 && S_ISLNK(link.st_mode);
  }

  // The link-free path of `link`, whose target is `st`; nothing when the target has no path of
  // its own (a deleted file, a memfd under /proc/self/fd).
  static std::optional<std::string> path_of_file(const std::string& link, const struct stat& st) {
    std::error_code ec;
    const std::filesystem::path real = std::filesystem::canonical(link, ec);
    struct stat found {};
    if (ec || ::stat(real.c_str(), &found) != 0 || found.st_dev != st.st_dev ||
        found.st_ino != st.st_ino)
      return std::nullopt;
    return real.string();
  }

  // Opens path_ to be written in place, truncated.
  void open_in_place() {
    direct_ = true;
    fd_ = ::open(path_.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
    if (fd_ < 0) {
      const int error = errno;
      fail("cannot open it", error);
    }
  }

  // Creates temp_ = target_ + ".tmp" + a unique suffix, exclusively, mode 0666 less the umask.
  void create_temporary() {
    static std::atomic<std::uint64_t> counter{0};
    constexpr std::string_view kDigits = "0123456789abcdefghijklmnopqrstuvwxyz";
    for (int attempt = 0; attempt < 100; ++attempt) {
      // splitmix64 of the pid, a counter and the clock: distinct across threads and processes.
      std::uint64_t x = (std::uint64_t(::getpid()) << 40) ^ counter.fetch_add(1) ^
                        std::uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
      x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
      x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
      x ^= x >> 31;
      std::string suffix;
      for (int i = 0; i < 8; ++i, x /= kDigits.size()) suffix += kDigits[x % kDigits.size()];
      const std::string name = target_ + ".tmp" + suffix;
      fd_ = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd_ >= 0) {
        temp_ = name;
        return;
      }
      if (const int error = errno; error != EEXIST)
        fail("cannot create a temporary file next to it", error);
    }
    fail("cannot create a temporary file next to it", EEXIST);
  }

  // Makes the rename durable; best effort, since the new file is already in place.
  void sync_directory() const {
    std::filesystem::path dir = std::filesystem::path(target_).parent_path();
    if (dir.empty()) dir = ".";
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;
    static_cast<void>(::fsync(fd));
    ::close(fd);
  }

  void discard() noexcept {
    if (fd_ >= 0) ::close(std::exchange(fd_, -1));
    if (!temp_.empty()) ::unlink(temp_.c_str());
    temp_.clear();
  }

  [[noreturn]] void fail(const std::string& what, int error) {
    discard();
    throw InvalidArgument("path", "cannot write '" + path_ + "': " +
                                      (what.empty() ? "" : what + ": ") + error_text(error) +
                                      (direct_ ? "" : "; the previous file, if any, is unchanged"));
  }

  std::string path_;    // as given, for messages
  std::string target_;  // the file replaced: path_ with a symlink resolved
  std::string temp_;    // the temporary file while it exists
  int fd_ = -1;
  bool direct_ = false;  // written in place (not a regular file)
};

}  // namespace

bool SafetensorsFile::contains(std::string_view name) const {
  return tensors.contains(name);
}

const Tensor& SafetensorsFile::at(std::string_view name) const {
  if (const auto it = tensors.find(name); it != tensors.end()) return it->second;
  constexpr std::size_t kMaxListed = 32;
  std::string present;
  std::size_t listed = 0;
  for (const auto& [key, tensor] : tensors) {
    if (listed == kMaxListed) {
      present += " and " + std::to_string(tensors.size() - listed) + " more";
      break;
    }
    present += (listed++ ? ", " : "") + in_quotes(key);
  }
  throw InvalidArgument("name", "no tensor named " + in_quotes(name) + "; present: " +
                                    (tensors.empty() ? std::string("(none)") : present));
}

SafetensorsFile parse_safetensors(std::span<const std::byte> bytes, std::string_view origin_name) {
  const Origin origin{"bytes", origin_name};
  check_file_size(bytes.size(), origin);
  const std::uint64_t header_len = header_length(bytes.first<kPrefixBytes>(), bytes.size(), origin);
  const std::span<const std::byte> header_bytes = bytes.subspan(kPrefixBytes, header_len);
  const std::span<const std::byte> data = bytes.subspan(kPrefixBytes + header_len);
  Header header =
      parse_header({reinterpret_cast<const char*>(header_bytes.data()), header_bytes.size()},
                   data.size(), origin);

  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  for (Entry& e : header.entries) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    if (t.nbytes() > 0) std::memcpy(t.data(), data.data() + e.begin, t.nbytes());
    file.tensors.emplace(std::move(e.name), std::move(t));
  }
  return file;
}

SafetensorsFile read_safetensors(const std::string& path) {
  const Origin origin{"path", path};
  std::error_code ec;
  const std::uintmax_t file_size = std::filesystem::file_size(path, ec);
  if (ec) origin.fail("cannot read the file: " + ec.message());
  std::ifstream in(path, std::ios::binary);
  if (!in)
    origin.fail("cannot open the file: " +
                std::error_code(errno, std::generic_category()).message());
  check_file_size(file_size, origin);
  std::array<std::byte, kPrefixBytes> prefix{};
  read_exact(in, prefix.data(), prefix.size(), origin);
  const std::uint64_t header_len = header_length(prefix, file_size, origin);
  std::string text(header_len, '\0');
  read_exact(in, text.data(), header_len, origin);
  const std::uint64_t data_start = kPrefixBytes + header_len;
  Header header = parse_header(text, file_size - data_start, origin);

  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  for (Entry& e : header.entries) {  // in offset order, so the file is read front to back
    Tensor t = Tensor::empty(e.shape, e.dtype);
    in.seekg(static_cast<std::streamoff>(data_start + e.begin));
    read_exact(in, t.data(), t.nbytes(), origin);
    file.tensors.emplace(std::move(e.name), std::move(t));
  }
  return file;
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, TensorView>>& tensors,
                       const std::map<std::string, std::string, std::less<>>& metadata) {
  std::vector<const std::pair<std::string, TensorView>*> order;
  order.reserve(tensors.size());
  for (const auto& t : tensors) order.push_back(&t);
  std::ranges::sort(order, {}, [](const auto* t) -> const std::string& { return t->first; });

  json header = json::object();
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const auto& [name, view] = *order[i];
    if (i > 0 && order[i - 1]->first == name)
      throw InvalidArgument("tensors", "duplicate tensor name " + in_quotes(name));
    if (name == kMetadataKey)
      throw InvalidArgument("tensors", "the tensor name '__metadata__' is reserved");
    require_utf8(name, "tensors", "tensor name");
    if (view.platform() != Platform::cpu)
      throw Unsupported("tensors", "tensor " + in_quotes(name) + " is " + view.describe() +
                                       "; only CPU tensors can be written");
    if (view.data() == nullptr && view.numel() > 0)
      throw InvalidArgument("tensors",
                            "tensor " + in_quotes(name) + " (" + view.describe() + ") has no data");
    const std::uint64_t nbytes =
        static_cast<std::uint64_t>(view.numel()) * dtype_size(view.dtype());
    header[name] = {
        {"dtype", std::string(safetensors_dtype_name(view.dtype()))},
        {"shape", std::vector<std::int64_t>(view.shape().begin(), view.shape().end())},
        {"data_offsets", {offset, offset + nbytes}},
    };
    offset += nbytes;
  }
  if (!metadata.empty()) {
    for (const auto& [key, value] : metadata) {
      require_utf8(key, "metadata", "metadata key");
      require_utf8(value, "metadata", "value of metadata key " + in_quotes(key));
    }
    header[std::string(kMetadataKey)] = metadata;
  }
  std::string text = header.dump();
  text.append((kPrefixBytes - text.size() % kPrefixBytes) % kPrefixBytes, ' ');

  const IgnoreFileSizeSignal ignore_file_size_signal;
  AtomicOutput out(path);
  out.write(encode_header_length(text.size()).data(), kPrefixBytes);
  out.write(text.data(), text.size());
  std::vector<std::byte> scratch;
  for (const auto* entry : order) {
    const TensorView& view = entry->second;
    const std::uint64_t nbytes =
        static_cast<std::uint64_t>(view.numel()) * dtype_size(view.dtype());
    if (nbytes == 0) continue;
    if (view.is_contiguous()) {
      out.write(view.data(), nbytes);
    } else {
      scratch.resize(nbytes);
      gather_contiguous(view, scratch.data());
      out.write(scratch.data(), nbytes);
    }
  }
  out.commit();
}

}  // namespace dattn
