#include <gtest/gtest.h>

#include <cstdlib>

#include "dattn/attention.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"

namespace dattn {
namespace {

// A backend for selection tests: configurable platforms, head sizes and availability.
class FakeBackend final : public Backend {
 public:
  FakeBackend(std::string name, int priority, std::vector<std::int64_t> heads = {},
              std::optional<std::vector<Platform>> platforms = std::nullopt, bool available = true)
      : name_(std::move(name)),
        priority_(priority),
        heads_(std::move(heads)),
        platforms_(std::move(platforms)),
        available_(available) {}
  std::string name() const override { return name_; }
  int priority() const override { return priority_; }
  std::vector<std::int64_t> supported_head_sizes() const override { return heads_; }
  std::optional<std::vector<Platform>> supported_platforms() const override { return platforms_; }
  void validate_available() const override {
    if (!available_) throw NotAvailable("backend", name_ + " needs libfake, which is missing");
  }
  std::unique_ptr<Impl> make_impl(const ImplConfig& c) const override {
    return make_reference_backend_impl(c);
  }

 private:
  std::unique_ptr<Impl> make_reference_backend_impl(const ImplConfig& c) const {
    return Registry::global().find("REFERENCE")->make_impl(c);
  }
  std::string name_;
  int priority_;
  std::vector<std::int64_t> heads_;
  std::optional<std::vector<Platform>> platforms_;
  bool available_;
};

class EnvGuard {
 public:
  explicit EnvGuard(const char* value) {
    if (const char* old = std::getenv("DIFFUSION_ATTENTION_BACKEND")) old_ = old;
    if (value)
      setenv("DIFFUSION_ATTENTION_BACKEND", value, 1);
    else
      unsetenv("DIFFUSION_ATTENTION_BACKEND");
  }
  ~EnvGuard() {
    if (old_)
      setenv("DIFFUSION_ATTENTION_BACKEND", old_->c_str(), 1);
    else
      unsetenv("DIFFUSION_ATTENTION_BACKEND");
  }

 private:
  std::optional<std::string> old_;
};

BackendRequest request(std::int64_t head = 64, Platform p = Platform::cpu) {
  BackendRequest r;
  r.head_size = head;
  r.platform = p;
  return r;
}

TEST(Registry, LookupIsCaseInsensitiveAndUnknownListsValidNames) {
  EXPECT_EQ(Registry::global().find("reference")->name(), "REFERENCE");
  EXPECT_EQ(Registry::global().find("ReFeReNcE")->name(), "REFERENCE");
  try {
    Registry::global().find("nope");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.field(), "backend");
    EXPECT_NE(std::string(e.what()).find("REFERENCE"), std::string::npos);
  }
}

TEST(Registry, DuplicateNamesAreRejected) {
  Registry r;
  r.add(std::make_shared<FakeBackend>("A", 1));
  EXPECT_THROW(r.add(std::make_shared<FakeBackend>("a", 2)), InvalidArgument);
  EXPECT_THROW(r.add(nullptr), InvalidArgument);
}

TEST(Registry, AutomaticChoiceTakesTheBestBackendThatServesTheRequest) {
  EnvGuard env(nullptr);
  Registry r;
  r.add(std::make_shared<FakeBackend>("SLOW", 1));
  r.add(std::make_shared<FakeBackend>("FAST128", 10, std::vector<std::int64_t>{128}));
  r.add(std::make_shared<FakeBackend>("GPU", 20, std::vector<std::int64_t>{},
                                      std::vector<Platform>{Platform::cuda}));
  r.add(std::make_shared<FakeBackend>("BROKEN", 30, std::vector<std::int64_t>{}, std::nullopt,
                                      false));
  EXPECT_EQ(r.select(request(128), std::nullopt).backend->name(), "FAST128");
  const Selection s = r.select(request(64), std::nullopt);
  EXPECT_EQ(s.backend->name(), "SLOW");
  EXPECT_EQ(s.source, "auto");
  EXPECT_EQ(s.skipped.size(), 3u);  // BROKEN, GPU, FAST128 with reasons
  EXPECT_EQ(r.select(request(64, Platform::cuda), std::nullopt).backend->name(), "GPU");
  EXPECT_EQ(r.select(request(64), std::string_view("auto")).backend->name(), "SLOW");
}

TEST(Registry, ExplicitChoiceThatCannotRunFailsWithTheReason) {
  EnvGuard env(nullptr);
  Registry r;
  r.add(std::make_shared<FakeBackend>("FAST128", 10, std::vector<std::int64_t>{128}));
  r.add(std::make_shared<FakeBackend>("GPU", 20, std::vector<std::int64_t>{},
                                      std::vector<Platform>{Platform::cuda}));
  r.add(std::make_shared<FakeBackend>("BROKEN", 30, std::vector<std::int64_t>{}, std::nullopt,
                                      false));
  try {
    r.select(request(64), std::string_view("fast128"));
    FAIL();
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("head size 64"), std::string::npos);
  }
  EXPECT_THROW(r.select(request(64), std::string_view("GPU")), NotAvailable);
  try {
    r.select(request(64), std::string_view("broken"));
    FAIL();
  } catch (const NotAvailable& e) {
    EXPECT_NE(std::string(e.what()).find("libfake"), std::string::npos);
  }
}

TEST(Registry, PrecedenceExplicitThenEnvThenAuto) {
  Registry r;
  r.add(std::make_shared<FakeBackend>("LOW", 1));
  r.add(std::make_shared<FakeBackend>("HIGH", 5));
  {
    EnvGuard env("low");
    EXPECT_EQ(r.select(request(), std::nullopt).backend->name(), "LOW");
    EXPECT_EQ(r.select(request(), std::nullopt).source, "env DIFFUSION_ATTENTION_BACKEND");
    EXPECT_EQ(r.select(request(), std::string_view("HIGH")).backend->name(), "HIGH");
  }
  {
    EnvGuard env("auto");
    EXPECT_EQ(r.select(request(), std::nullopt).backend->name(), "HIGH");
  }
  {
    EnvGuard env("nope");
    EXPECT_THROW(r.select(request(), std::nullopt), InvalidArgument);
  }
}

TEST(Registry, CustomBackendRegisteredAtRunTimeServesALayer) {
  EnvGuard env(nullptr);
  Registry::global().add(std::make_shared<FakeBackend>("CUSTOM_TEST", -5));
  AttentionConfig c;
  c.num_heads = 2;
  c.head_size = 8;
  c.backend = "custom_test";
  const Attention layer(c);
  EXPECT_EQ(layer.backend().name(), "CUSTOM_TEST");
  EXPECT_EQ(layer.selection().source, "explicit");
  EXPECT_TRUE(Registry::global().remove("CUSTOM_TEST"));
  EXPECT_FALSE(Registry::global().remove("CUSTOM_TEST"));
}

TEST(Layer, UnsupportedKvCacheDtypeFailsAtConstruction) {
  EnvGuard env(nullptr);
  Registry r;
  r.add(std::make_shared<FakeBackend>("FAKE", 1));
  AttentionConfig c;
  c.num_heads = 2;
  c.head_size = 8;
  c.kv_cache_dtype = KvCacheDtype::fp8;
  c.registry = &r;
  c.platform = Platform::cpu;
  // FAKE makes reference impls, which support fp8 on cpu; on cuda nothing does.
  EXPECT_NO_THROW(Attention{c});
  c.platform = Platform::cuda;
  EXPECT_THROW(Attention{c}, Unsupported);
}

TEST(Layer, ImplDispatchesOnPlatformAndRocmMusaFollowCuda) {
  EnvGuard env(nullptr);
  Registry r;
  r.add(std::make_shared<FakeBackend>("ANY", 1));
  AttentionConfig c;
  c.num_heads = 1;
  c.head_size = 4;
  c.registry = &r;
  const Attention layer(c);
  float buf[4 * 3] = {};
  for (Platform p :
       {Platform::cuda, Platform::rocm, Platform::musa, Platform::npu, Platform::xpu}) {
    const TensorView q(buf, DType::F32, {1, 1, 1, 4}, p), k(buf + 4, DType::F32, {1, 1, 1, 4}, p),
        o(buf + 8, DType::F32, {1, 1, 1, 4}, p);
    try {
      layer.forward_into(q, k, k, {}, o);
      FAIL();
    } catch (const Unsupported& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("REFERENCE"), std::string::npos) << msg;
      EXPECT_NE(msg.find("platform " + std::string(platform_name(p))), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace dattn
