#include "dattn/safetensors.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "dattn/errors.hpp"

namespace {

using namespace std::literals;
using dattn::DType;
using dattn::Tensor;
using dattn::TensorView;

constexpr std::array<DType, 7> kAllDTypes = {DType::F32,      DType::BF16, DType::F16, DType::I32,
                                             DType::FP8_E4M3, DType::I8,   DType::Bool};

// A file path unique to the running test, removed again at scope exit.
class TempFile {
 public:
  explicit TempFile(std::string_view tag = "") {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = (std::filesystem::temp_directory_path() /
             ("dattn_" + std::string(info->name()) + "_" + std::string(tag) +
              std::to_string(::getpid()) + ".safetensors"))
                .string();
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::vector<std::byte> file_contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> chars{std::istreambuf_iterator<char>(in), {}};
  std::vector<std::byte> bytes(chars.size());
  if (!chars.empty()) std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

// An 8-byte little-endian length, `header`, then `data_bytes` zero bytes.
std::vector<std::byte> with_header(std::string_view header, std::size_t data_bytes = 0) {
  std::vector<std::byte> bytes(8 + header.size() + data_bytes);
  for (std::size_t i = 0; i < 8; ++i)
    bytes[i] = static_cast<std::byte>(std::uint64_t{header.size()} >> (8 * i));
  std::memcpy(bytes.data() + 8, header.data(), header.size());
  return bytes;
}

std::vector<std::byte> length_prefix_only(std::uint64_t claimed_length, std::size_t extra = 0) {
  std::vector<std::byte> bytes(8 + extra);
  for (std::size_t i = 0; i < 8; ++i) bytes[i] = static_cast<std::byte>(claimed_length >> (8 * i));
  return bytes;
}

// Parsing `bytes` throws InvalidArgument whose message contains every one of `needles`.
::testing::AssertionResult rejects(std::span<const std::byte> bytes,
                                   std::initializer_list<std::string_view> needles) {
  try {
    dattn::parse_safetensors(bytes, "test.safetensors");
  } catch (const dattn::InvalidArgument& e) {
    const std::string_view message = e.what();
    if (message.find("test.safetensors: ") != 0)
      return ::testing::AssertionFailure() << "message does not name the origin: " << message;
    for (std::string_view needle : needles)
      if (message.find(needle) == std::string_view::npos)
        return ::testing::AssertionFailure() << "message lacks \"" << needle << "\": " << message;
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw something else: " << e.what();
  }
  return ::testing::AssertionFailure() << "parsed without error";
}

::testing::AssertionResult rejects(std::string_view header,
                                   std::initializer_list<std::string_view> needles,
                                   std::size_t data_bytes = 0) {
  return rejects(with_header(header, data_bytes), needles);
}

Tensor random_tensor(std::initializer_list<std::int64_t> shape, DType dtype, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  std::uniform_int_distribution<int> byte(0, 255);
  auto* p = static_cast<unsigned char*>(t.data());
  for (std::size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(byte(rng));
  return t;
}

// `actual` is a contiguous tensor holding exactly the bytes of `expected`'s elements.
void expect_same_elements(const TensorView& expected, const Tensor& actual) {
  ASSERT_EQ(actual.dtype(), expected.dtype());
  ASSERT_TRUE(std::ranges::equal(actual.shape(), expected.shape())) << expected.describe();
  ASSERT_TRUE(actual.view().is_contiguous());
  const std::size_t es = dattn::dtype_size(expected.dtype());
  std::array<std::int64_t, TensorView::kMaxDims> index{};
  const auto* got = static_cast<const std::byte*>(actual.data());
  for (std::int64_t e = 0; e < expected.numel(); ++e) {
    ASSERT_EQ(std::memcmp(
                  got + std::size_t(e) * es,
                  expected.element_ptr(std::span(index.data(), std::size_t(expected.ndim()))), es),
              0)
        << "element " << e << " of " << expected.describe();
    for (int i = expected.ndim() - 1; i >= 0; --i) {
      if (++index[std::size_t(i)] < expected.size(i)) break;
      index[std::size_t(i)] = 0;
    }
  }
}

TEST(Safetensors, RoundTripsEveryDtypeFromStridedViewsWithMetadata) {
  std::mt19937 rng(1234);
  std::vector<Tensor> storage;
  std::vector<std::pair<std::string, TensorView>> views;
  for (DType dtype : kAllDTypes) {
    // Random bytes, so NaN payloads and non-0/1 bools must survive bit exact.
    const Tensor& base = storage.emplace_back(random_tensor({5, 7, 3}, dtype, rng));
    const std::string prefix(dattn::dtype_name(dtype));
    const std::array<int, 3> perm{2, 0, 1};
    views.emplace_back(prefix + "/permuted", base.view().permuted(perm));
    views.emplace_back(prefix + "/sliced", base.view().sliced(1, 2, 4));
    const std::array<std::int64_t, 2> shape{5, 7};
    const std::array<std::int64_t, 2> reversed{-21, -3};
    const std::array<std::int64_t, 3> last{4, 6, 0};
    views.emplace_back(prefix + "/reversed",
                       TensorView(base.view().element_ptr(last), dtype, shape, reversed));
    const std::array<std::int64_t, 2> broadcast{0, 1};
    const std::array<std::int64_t, 2> bshape{4, 3};
    views.emplace_back(prefix + "/broadcast", TensorView(base.data(), dtype, bshape, broadcast));
    views.emplace_back(prefix + "/contiguous", base.view());
  }
  const std::map<std::string, std::string, std::less<>> metadata{
      {"format", "pt"}, {"note", "ünïcödé ✓"}, {"", "empty key"}};
  TempFile file;
  dattn::write_safetensors(file.path(), views, metadata);

  for (const dattn::SafetensorsFile& loaded :
       {dattn::read_safetensors(file.path()),
        dattn::parse_safetensors(file_contents(file.path()), file.path())}) {
    EXPECT_EQ(loaded.metadata, metadata);
    ASSERT_EQ(loaded.tensors.size(), views.size());
    for (const auto& [name, view] : views) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(loaded.contains(name));
      expect_same_elements(view, loaded.at(name));
    }
  }
}

TEST(Safetensors, WritesTensorsBackToBackInNameOrderAfterSpacePaddedHeader) {
  std::mt19937 rng(7);
  const Tensor b = random_tensor({3}, DType::F32, rng);
  const Tensor a = random_tensor({2, 2}, DType::BF16, rng);
  const Tensor c = random_tensor({5}, DType::I8, rng);
  TempFile file;
  dattn::write_safetensors(file.path(), {{"b", b}, {"c", c}, {"a", a}}, {{"k", "v"}});
  const std::vector<std::byte> bytes = file_contents(file.path());

  ASSERT_GE(bytes.size(), 8u);
  std::uint64_t header_len = 0;
  for (std::size_t i = 0; i < 8; ++i)
    header_len |= std::uint64_t{std::to_integer<std::uint8_t>(bytes[i])} << (8 * i);
  EXPECT_EQ(header_len % 8, 0u);
  const std::string header(reinterpret_cast<const char*>(bytes.data()) + 8, header_len);
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
  for (std::string_view key :
       {"\"BF16\"", "\"F32\"", "\"I8\"", "\"__metadata__\"", "\"data_offsets\":[0,8]",
        "\"data_offsets\":[8,20]", "\"data_offsets\":[20,25]"})
    EXPECT_NE(header.find(key), std::string::npos) << key << " not in " << header;

  const std::size_t data_start = 8 + header_len;
  ASSERT_EQ(bytes.size(), data_start + a.nbytes() + b.nbytes() + c.nbytes());
  std::size_t at = data_start;
  for (const Tensor* t : {&a, &b, &c}) {
    EXPECT_EQ(std::memcmp(bytes.data() + at, t->data(), t->nbytes()), 0);
    at += t->nbytes();
  }
}

TEST(Safetensors, RoundTripsZeroElementAndScalarTensors) {
  const Tensor empty_rows = Tensor::empty({0, 3}, DType::F32);
  const Tensor empty_cols = Tensor::empty({2, 0}, DType::I32);
  Tensor scalar = Tensor::empty(std::span<const std::int64_t>{}, DType::F16);
  *scalar.data_as<std::uint16_t>() = 0x3c00;  // 1.0
  const TensorView no_data(nullptr, DType::BF16, {4, 0});
  TempFile file;
  dattn::write_safetensors(
      file.path(),
      {{"rows", empty_rows}, {"cols", empty_cols}, {"scalar", scalar}, {"no_data", no_data}});
  const dattn::SafetensorsFile loaded = dattn::read_safetensors(file.path());
  ASSERT_EQ(loaded.tensors.size(), 4u);
  EXPECT_EQ(loaded.at("rows").numel(), 0);
  EXPECT_TRUE(std::ranges::equal(loaded.at("rows").shape(), std::vector<std::int64_t>{0, 3}));
  EXPECT_TRUE(std::ranges::equal(loaded.at("cols").shape(), std::vector<std::int64_t>{2, 0}));
  EXPECT_TRUE(std::ranges::equal(loaded.at("no_data").shape(), std::vector<std::int64_t>{4, 0}));
  EXPECT_EQ(loaded.at("no_data").dtype(), DType::BF16);
  EXPECT_EQ(loaded.at("scalar").view().ndim(), 0);
  EXPECT_EQ(*loaded.at("scalar").data_as<std::uint16_t>(), 0x3c00);
  EXPECT_TRUE(loaded.metadata.empty());
}

TEST(Safetensors, RoundTripsAFileWithoutTensors) {
  TempFile file;
  dattn::write_safetensors(file.path(), {}, {{"only", "metadata"}});
  const dattn::SafetensorsFile loaded = dattn::read_safetensors(file.path());
  EXPECT_TRUE(loaded.tensors.empty());
  EXPECT_EQ(loaded.metadata.at("only"), "metadata");
}

TEST(Safetensors, AtNamesTheMissingTensorAndListsThePresentOnes) {
  dattn::SafetensorsFile file;
  file.tensors.emplace("alpha", Tensor::empty({1}, DType::F32));
  file.tensors.emplace("beta", Tensor::empty({1}, DType::F32));
  EXPECT_FALSE(file.contains("gamma"));
  try {
    (void)file.at("gamma");
    FAIL() << "at() did not throw";
  } catch (const dattn::InvalidArgument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("'gamma'"), std::string::npos) << message;
    EXPECT_NE(message.find("'alpha', 'beta'"), std::string::npos) << message;
  }
}

TEST(Safetensors, ReadingAMissingFileNamesThePath) {
  const std::string path = "/nonexistent/dir/model.safetensors";
  try {
    dattn::read_safetensors(path);
    FAIL() << "no error";
  } catch (const dattn::InvalidArgument& e) {
    EXPECT_EQ(e.field(), "path");
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(Safetensors, ReadingADirectoryFails) {
  EXPECT_THROW(dattn::read_safetensors(std::filesystem::temp_directory_path().string()),
               dattn::InvalidArgument);
}

TEST(Safetensors, ReadErrorsUseFieldPathAndNameTheFile) {
  TempFile file;
  {
    std::ofstream out(file.path(), std::ios::binary);
    out << "abc";
  }
  try {
    dattn::read_safetensors(file.path());
    FAIL() << "no error";
  } catch (const dattn::InvalidArgument& e) {
    EXPECT_EQ(e.field(), "path");
    EXPECT_EQ(std::string(e.what()).find(file.path() + ": "), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("too short"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, WritingToAnUnwritablePathFails) {
  const Tensor t = Tensor::zeros({2}, DType::F32);
  try {
    dattn::write_safetensors("/nonexistent/dir/out.safetensors", {{"t", t}});
    FAIL() << "no error";
  } catch (const dattn::InvalidArgument& e) {
    EXPECT_EQ(e.field(), "path");
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/out.safetensors"), std::string::npos);
  }
}

TEST(Safetensors, WriteRejectsDuplicateAndReservedNames) {
  const Tensor t = Tensor::zeros({2}, DType::F32);
  TempFile file;
  EXPECT_THROW(dattn::write_safetensors(file.path(), {{"x", t}, {"y", t}, {"x", t}}),
               dattn::InvalidArgument);
  EXPECT_THROW(dattn::write_safetensors(file.path(), {{"__metadata__", t}}),
               dattn::InvalidArgument);
}

TEST(Safetensors, WriteRejectsInvalidUtf8NamesAndMetadata) {
  const Tensor t = Tensor::zeros({2}, DType::F32);
  TempFile file;
  EXPECT_THROW(dattn::write_safetensors(file.path(), {{"bad\xff", t}}), dattn::InvalidArgument);
  EXPECT_THROW(dattn::write_safetensors(file.path(), {{"t", t}}, {{"k", "bad\xc3"}}),
               dattn::InvalidArgument);
}

TEST(Safetensors, WriteRejectsNonCpuAndDatalessViews) {
  float fake = 0.0f;
  TempFile file;
  EXPECT_THROW(dattn::write_safetensors(
                   file.path(), {{"t", TensorView(&fake, DType::F32, {1}, dattn::Platform::cuda)}}),
               dattn::Unsupported);
  EXPECT_THROW(dattn::write_safetensors(file.path(), {{"t", TensorView(nullptr, DType::F32, {2})}}),
               dattn::InvalidArgument);
}

// ---- writes replace the file atomically ----

// Entries of `path`'s directory named like a temporary of `path` ("<name>.tmp...").
std::vector<std::string> leftover_temporaries(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string prefix = p.filename().string() + ".tmp";
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator(p.parent_path()))
    if (entry.path().filename().string().starts_with(prefix)) found.push_back(entry.path());
  return found;
}

mode_t permission_bits(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

void write_text(const std::string& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

TEST(Safetensors, WriteReplacesAnExistingFileKeepingItsMode) {
  TempFile file;
  write_text(file.path(), "previous contents");
  ASSERT_EQ(::chmod(file.path().c_str(), 0640), 0);
  const Tensor t = Tensor::zeros({3}, DType::F32);
  dattn::write_safetensors(file.path(), {{"t", t}});
  EXPECT_EQ(dattn::read_safetensors(file.path()).at("t").numel(), 3);
  EXPECT_EQ(permission_bits(file.path()), 0640u);
  EXPECT_TRUE(leftover_temporaries(file.path()).empty());
}

TEST(Safetensors, WriteCreatesANewFileWithTheUmaskedDefaultMode) {
  TempFile file;
  const mode_t previous = ::umask(027);
  dattn::write_safetensors(file.path(), {{"t", Tensor::zeros({1}, DType::F32)}});
  ::umask(previous);
  EXPECT_EQ(permission_bits(file.path()), 0640u);  // 0666 & ~027
}

TEST(Safetensors, WriteThroughASymlinkReplacesItsTarget) {
  TempFile file, link("link");
  write_text(file.path(), "previous contents");
  std::filesystem::create_symlink(file.path(), link.path());
  dattn::write_safetensors(link.path(), {{"t", Tensor::zeros({2}, DType::F32)}});
  EXPECT_TRUE(std::filesystem::is_symlink(link.path()));
  EXPECT_EQ(dattn::read_safetensors(file.path()).at("t").numel(), 2);
  EXPECT_TRUE(leftover_temporaries(file.path()).empty());
  EXPECT_TRUE(leftover_temporaries(link.path()).empty());
}

// A target that is not a regular file (here a pipe, through /proc/self/fd) is written in place.
TEST(Safetensors, WriteToAPipeWritesInPlace) {
  std::array<int, 2> fds{};
  ASSERT_EQ(::pipe(fds.data()), 0);
  const std::string pipe_path = "/proc/self/fd/" + std::to_string(fds[1]);
  const Tensor t = Tensor::zeros({4}, DType::F32);
  TempFile file;
  dattn::write_safetensors(file.path(), {{"t", t}});
  const std::vector<std::byte> expected = file_contents(file.path());
  ASSERT_LT(expected.size(), 4096u);  // fits in the pipe's buffer
  dattn::write_safetensors(pipe_path, {{"t", t}});
  ::close(fds[1]);
  std::vector<std::byte> got(expected.size() + 1);
  const ::ssize_t n = ::read(fds[0], got.data(), got.size());
  ::close(fds[0]);
  ASSERT_EQ(n, static_cast<::ssize_t>(expected.size()));
  got.resize(expected.size());
  EXPECT_EQ(got, expected);
}

// A file with no path of its own (deleted, reached through /proc/self/fd) is written in place
// too, rather than through a temporary next to its former name.
TEST(Safetensors, WriteToADeletedFileThroughProcWritesInPlace) {
  TempFile file;
  write_text(file.path(), "previous contents");
  const int fd = ::open(file.path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::unlink(file.path().c_str()), 0);
  const std::string proc_path = "/proc/self/fd/" + std::to_string(fd);
  dattn::write_safetensors(proc_path, {{"t", Tensor::zeros({5}, DType::F32)}});
  EXPECT_EQ(dattn::read_safetensors(proc_path).at("t").numel(), 5);
  ::close(fd);
  EXPECT_FALSE(std::filesystem::exists(file.path() + " (deleted)"));
  EXPECT_TRUE(leftover_temporaries(file.path()).empty());
  EXPECT_TRUE(leftover_temporaries(file.path() + " (deleted)").empty());
}

TEST(Safetensors, WritingOntoADirectoryFailsAndLeavesNoTemporary) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("dattn_dir_" + std::to_string(::getpid()));
  std::filesystem::create_directory(dir);
  try {
    dattn::write_safetensors(dir.string(), {{"t", Tensor::zeros({1}, DType::F32)}});
    ADD_FAILURE() << "no error";
  } catch (const dattn::InvalidArgument& e) {
    EXPECT_EQ(e.field(), "path");
    EXPECT_NE(std::string(e.what()).find(dir.string()), std::string::npos) << e.what();
  }
  EXPECT_TRUE(std::filesystem::is_directory(dir));
  EXPECT_TRUE(leftover_temporaries(dir.string()).empty());
  std::filesystem::remove_all(dir);
}

// Exit codes of the writing child below.
enum ChildExit : int {
  kThrewTheTypedError = 0,
  kWroteWithoutError = 10,
  kThrewSomethingElse = 11,
  kMessageLacksReason = 12,
  kSignalNotRestored = 13,
};

// A write that runs past RLIMIT_FSIZE (the file system's "disk full" as a process limit, which
// works as root too) throws InvalidArgument naming the path and EFBIG instead of dying of
// SIGXFSZ, and the file written before stays byte for byte, with no temporary left.
TEST(Safetensors, AFailedWriteLeavesThePreviousFileAsItWas) {
  TempFile file;
  std::mt19937 rng(7);
  dattn::write_safetensors(file.path(), {{"small", random_tensor({16}, DType::F32, rng)}});
  const std::vector<std::byte> before = file_contents(file.path());
  const Tensor big = random_tensor({64, 1024}, DType::F32, rng);  // 256 KiB

  const ::pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const ::rlimit limit{64 * 1024, 64 * 1024};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(20);
    int code = kWroteWithoutError;
    try {
      dattn::write_safetensors(file.path(), {{"big", big}});
    } catch (const dattn::InvalidArgument& e) {
      const std::string message = e.what();
      code = message.find(file.path()) != std::string::npos &&
                     message.find(std::strerror(EFBIG)) != std::string::npos
                 ? kThrewTheTypedError
                 : kMessageLacksReason;
    } catch (...) {
      code = kThrewSomethingElse;
    }
    struct sigaction now {};
    if (::sigaction(SIGXFSZ, nullptr, &now) != 0 || now.sa_handler != SIG_DFL)
      code = kSignalNotRestored;
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_FALSE(WIFSIGNALED(status)) << "the child died of signal " << WTERMSIG(status);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), kThrewTheTypedError);
  EXPECT_EQ(file_contents(file.path()), before);
  EXPECT_TRUE(leftover_temporaries(file.path()).empty());
}

// ---- malformed input ----

TEST(Safetensors, RejectsFilesShorterThanTheLengthPrefix) {
  const std::vector<std::byte> bytes(7);
  for (std::size_t n = 0; n < 8; ++n)
    EXPECT_TRUE(rejects(std::span(bytes.data(), n), {"too short"})) << n << " bytes";
}

TEST(Safetensors, RejectsHeaderLengthPastTheEndOfTheFile) {
  EXPECT_TRUE(rejects(length_prefix_only(1000, 12), {"header length 1000", "past the end"}));
  EXPECT_TRUE(rejects(length_prefix_only(1), {"past the end"}));
}

TEST(Safetensors, RejectsHeaderLengthAboveTheLimit) {
  EXPECT_TRUE(
      rejects(length_prefix_only(dattn::kSafetensorsMaxHeaderBytes + 1, 4), {"exceeds the limit"}));
  EXPECT_TRUE(rejects(length_prefix_only(~std::uint64_t{0}), {"exceeds the limit"}));
}

TEST(Safetensors, RejectsHeaderThatIsNotJson) {
  EXPECT_TRUE(rejects("", {"not valid JSON"}));
  EXPECT_TRUE(rejects("{\"a\": ", {"not valid JSON"}));
  EXPECT_TRUE(rejects("{} trailing", {"not valid JSON"}));
  EXPECT_TRUE(rejects("{\"a\": {}}\0\0"sv, {"not valid JSON"}));
  EXPECT_TRUE(rejects("{}\0 garbage"sv, {"not valid JSON", "NUL byte at offset 2"}));
  EXPECT_TRUE(rejects("{\"bad\xff\": {}}", {"not valid JSON"}));  // not UTF-8
}

// Found by tests/fuzz (corpus/fuzz_safetensors/crash-number-overflow): numbers beyond double's
// range made nlohmann throw out_of_range, which escaped as a non-dattn exception.
TEST(Safetensors, RejectsHeaderNumbersBeyondDoubleRange) {
  EXPECT_TRUE(rejects("1e999", {"not valid JSON", "number overflow", "1e999"}));
  EXPECT_TRUE(rejects(R"({"t": {"dtype": "F32", "shape": [-1e999], "data_offsets": [0, 4]}})",
                      {"not valid JSON", "number overflow"}, 4));
  TempFile file;
  {
    const std::vector<std::byte> bytes = with_header(R"({"__metadata__": {"k": 1E+400}})");
    std::ofstream out(file.path(), std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
  try {
    dattn::read_safetensors(file.path());
    ADD_FAILURE() << "no error";
  } catch (const dattn::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("number overflow"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, RejectsHeaderThatIsNotAnObject) {
  EXPECT_TRUE(rejects("[]", {"must be a JSON object", "array"}));
  EXPECT_TRUE(rejects("42", {"must be a JSON object", "number"}));
  EXPECT_TRUE(rejects("\"text\"", {"must be a JSON object", "string"}));
}

TEST(Safetensors, RejectsDeeplyNestedHeader) {
  const std::string deep =
      "{\"a\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [0, 4], "
      "\"extra\": " +
      std::string(100, '[') + std::string(100, ']') + "}}";
  EXPECT_TRUE(rejects(deep, {"nested deeper"}, 4));
}

TEST(Safetensors, RejectsEntryThatIsNotAnObject) {
  EXPECT_TRUE(rejects(R"({"w": [1, 2]})", {"tensor 'w'", "must be an object", "array"}));
  EXPECT_TRUE(rejects(R"({"w": "F32"})", {"tensor 'w'", "must be an object", "string"}));
}

TEST(Safetensors, RejectsEntryWithMissingKeys) {
  EXPECT_TRUE(
      rejects(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", {"tensor 'w'", "'dtype'"}, 4));
  EXPECT_TRUE(
      rejects(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", {"missing key 'shape'"}, 4));
  EXPECT_TRUE(
      rejects(R"({"w": {"dtype": "F32", "shape": [1]}})", {"missing key 'data_offsets'"}, 4));
}

TEST(Safetensors, RejectsEntryWithWrongKeyTypes) {
  EXPECT_TRUE(rejects(R"({"w": {"dtype": 1, "shape": [1], "data_offsets": [0, 4]}})",
                      {"'dtype' must be a string"}, 4));
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}})",
                      {"'shape' must be an array"}, 4));
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})",
                      {"dimension 0 of 'shape' must be an integer"}, 4));
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "F32", "shape": [1, null], "data_offsets": [0, 4]}})",
                      {"dimension 1 of 'shape' must be an integer", "null"}, 4));
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": "0-4"}})",
                      {"'data_offsets' must be two non-negative integers"}, 4));
}

TEST(Safetensors, RejectsUnknownDtypeListingTheValidOnes) {
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})",
                      {"'F64'", "F32, BF16, F16, F8_E4M3, I8, I32, BOOL"}, 8));
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}})",
                      {"'f32' is not supported"}, 4));
}

TEST(Safetensors, RejectsNegativeShapeDimensions) {
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 0]}})",
                      {"dimension 1 of 'shape' is negative (-1)"}));
}

TEST(Safetensors, RejectsShapeWhoseSizeOverflows) {
  EXPECT_TRUE(rejects(
      R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})",
      {"overflow"}));
  EXPECT_TRUE(
      rejects(R"({"w": {"dtype": "I8", "shape": [18446744073709551615], "data_offsets": [0, 0]}})",
              {"overflow"}));
  // Zero elements, but the strides of the other dims would still overflow.
  EXPECT_TRUE(rejects(
      R"({"w": {"dtype": "I8", "shape": [0, 4294967296, 4294967296], "data_offsets": [0, 0]}})",
      {"overflow"}));
}

TEST(Safetensors, RejectsShapeOfTooManyDimensions) {
  EXPECT_TRUE(
      rejects(R"({"w": {"dtype": "I8", "shape": [1, 1, 1, 1, 1, 1, 1], "data_offsets": [0, 1]}})",
              {"7 dimensions", "at most 6"}, 1));
}

TEST(Safetensors, RejectsDataOffsetsThatAreNotTwoIntegers) {
  for (std::string_view offsets : {"[]", "[0]", "[0, 4, 8]", "[-4, 0]", "[0, 4.0]", "[0, \"4\"]",
                                   "{\"begin\": 0, \"end\": 4}"}) {
    const std::string header =
        R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": )" + std::string(offsets) + "}}";
    EXPECT_TRUE(rejects(header, {"'data_offsets' must be two non-negative integers"}, 8))
        << offsets;
  }
}

TEST(Safetensors, RejectsDecreasingDataOffsets) {
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})",
                      {"[8, 4] decrease"}, 8));
}

TEST(Safetensors, RejectsDataOffsetsOutsideTheDataBuffer) {
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
                      {"past the end of the 12-byte data buffer"}, 12));
  EXPECT_TRUE(rejects(
      R"({"w": {"dtype": "I8", "shape": [0], "data_offsets": [18446744073709551615, 18446744073709551615]}})",
      {"past the end"}));
}

TEST(Safetensors, RejectsDataOffsetsDisagreeingWithDtypeAndShape) {
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}})",
                      {"hold 8 bytes", "F32 shape [4] needs 16"}, 16));
  EXPECT_TRUE(rejects(R"({"w": {"dtype": "BF16", "shape": [2, 0], "data_offsets": [0, 2]}})",
                      {"needs 0"}, 2));
}

TEST(Safetensors, RejectsOverlappingTensors) {
  EXPECT_TRUE(rejects(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                      {"'a' [0, 8]", "'b' [4, 12]", "overlap"}, 12));
  EXPECT_TRUE(rejects(R"({"a": {"dtype": "I8", "shape": [8], "data_offsets": [0, 8]},
                          "b": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}})",
                      {"overlap"}, 8));
}

TEST(Safetensors, AcceptsEmptyRangesInsideOthersAndUnusedBytes) {
  const std::vector<std::byte> bytes =
      with_header(R"({"a": {"dtype": "I8", "shape": [8], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
                      "c": {"dtype": "I8", "shape": [2], "data_offsets": [10, 12], "x": 1}})",
                  16);
  const dattn::SafetensorsFile file = dattn::parse_safetensors(bytes);
  EXPECT_EQ(file.tensors.size(), 3u);
  EXPECT_EQ(file.at("b").numel(), 0);
}

TEST(Safetensors, RejectsMetadataThatIsNotAnObjectOfStrings) {
  EXPECT_TRUE(rejects(R"({"__metadata__": ["a"]})", {"'__metadata__' must be an object", "array"}));
  EXPECT_TRUE(rejects(R"({"__metadata__": {"a": "x", "b": 3}})",
                      {"'__metadata__' value for key 'b' must be a string", "number"}));
  EXPECT_TRUE(rejects(R"({"__metadata__": {"a": null}})", {"'__metadata__'", "null"}));
}

TEST(Safetensors, ReadsMetadataAndToleratesHeaderPadding) {
  const std::vector<std::byte> bytes = with_header(
      R"({"__metadata__": {"format": "pt"}, "w": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}}   )",
      4);
  const dattn::SafetensorsFile file = dattn::parse_safetensors(bytes);
  EXPECT_EQ(file.metadata.at("format"), "pt");
  EXPECT_EQ(*file.at("w").data_as<std::int32_t>(), 0);
}

// Truncations and random header mutations of a valid file either parse or throw dattn errors;
// the sanitizer builds check that nothing reads out of bounds or allocates absurd sizes.
TEST(Safetensors, FuzzedInputOnlyEverThrowsDattnErrors) {
  std::mt19937 rng(42);
  const Tensor a = random_tensor({3, 4}, DType::F32, rng);
  const Tensor b = random_tensor({2, 2, 2}, DType::BF16, rng);
  const Tensor c = random_tensor({5}, DType::Bool, rng);
  const Tensor d = Tensor::empty({0, 7}, DType::I32);
  TempFile file;
  dattn::write_safetensors(file.path(), {{"a", a}, {"b", b}, {"c", c}, {"d", d}},
                           {{"format", "pt"}, {"k", "v"}});
  const std::vector<std::byte> valid = file_contents(file.path());
  ASSERT_NO_THROW(dattn::parse_safetensors(valid));
  std::uint64_t header_len = 0;
  for (std::size_t i = 0; i < 8; ++i)
    header_len |= std::uint64_t{std::to_integer<std::uint8_t>(valid[i])} << (8 * i);

  int accepted = 0, rejected = 0;
  const auto attempt = [&](std::span<const std::byte> bytes, const std::string& what) {
    try {
      const dattn::SafetensorsFile loaded = dattn::parse_safetensors(bytes);
      for (const auto& [name, t] : loaded.tensors) EXPECT_LE(t.nbytes(), bytes.size()) << what;
      ++accepted;
    } catch (const dattn::Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": non-dattn exception " << e.what();
    }
  };

  for (std::size_t n = 0; n <= valid.size(); ++n)
    attempt(std::span(valid.data(), n), "truncated to " + std::to_string(n));
  EXPECT_EQ(accepted, 1);  // only the whole file

  constexpr std::string_view kJsonChars = "0123456789-+.eE[]{},:\" \\ntfu";
  std::uniform_int_distribution<std::size_t> position(0, 8 + header_len - 1);
  std::uniform_int_distribution<std::size_t> flips(1, 4);
  std::uniform_int_distribution<std::size_t> json_char(0, kJsonChars.size() - 1);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int iteration = 0; iteration < 5000; ++iteration) {
    std::vector<std::byte> mutated = valid;
    for (std::size_t f = flips(rng); f > 0; --f) {
      const std::size_t at = position(rng);
      mutated[at] = rng() % 2 ? static_cast<std::byte>(byte(rng))
                              : static_cast<std::byte>(kJsonChars[json_char(rng)]);
    }
    attempt(mutated, "mutation " + std::to_string(iteration));
  }
  EXPECT_GT(rejected, 0);
}

}  // namespace
