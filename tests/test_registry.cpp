#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <string_view>

#include "dattn/attention.hpp"
#include "dattn/capabilities.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"

namespace dattn {
namespace {

// A backend for selection tests: configurable platforms, head sizes, availability and flags.
// It makes reference impls, so it declares the reference's kv cache dtypes.
BackendCapabilities fake_capabilities(std::vector<std::int64_t> heads,
                                      std::optional<std::vector<Platform>> platforms) {
  BackendCapabilities c;
  c.supported_head_sizes = std::move(heads);
  c.supported_platforms = std::move(platforms);
  c.kv_cache_dtypes = {{Platform::cpu, {KvCacheDtype::fp8, KvCacheDtype::int8}}};
  return c;
}

class FakeBackend final : public Backend {
 public:
  FakeBackend(std::string name, int priority, std::vector<std::int64_t> heads = {},
              std::optional<std::vector<Platform>> platforms = std::nullopt, bool available = true)
      : FakeBackend(std::move(name), priority,
                    fake_capabilities(std::move(heads), std::move(platforms)), available) {}
  FakeBackend(std::string name, int priority, BackendCapabilities capabilities,
              bool available = true)
      : Backend(std::move(capabilities)),
        name_(std::move(name)),
        priority_(priority),
        available_(available) {}
  std::string name() const override { return name_; }
  int priority() const override { return priority_; }
  void validate_available() const override {
    if (!available_) throw NotAvailable("backend", name_ + " needs libfake, which is missing");
  }
  std::unique_ptr<Impl> make_impl(const ImplConfig& c) const override {
    return Registry::global().find("REFERENCE")->make_impl(c);
  }

 private:
  std::string name_;
  int priority_;
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

// ---- capabilities as data (include/dattn/capabilities.hpp) ----

TEST(Capabilities, TableNamesAreUniqueAndEveryGuardedFeatureHasOneEntry) {
  std::set<std::string_view> names;
  for (const Capability& c : capability_table()) {
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate capability " << c.name;
    EXPECT_EQ(find_capability(c.name), &c);
    ASSERT_NE(c.read, nullptr) << c.name;
    EXPECT_EQ(c.kind == CapabilityKind::flag, c.flag != nullptr) << c.name;
    if (c.feature) {
      EXPECT_EQ(capability_for(*c.feature), &c) << c.name;
      EXPECT_EQ(feature_name(*c.feature), c.name);
    }
  }
  EXPECT_EQ(find_capability("nope"), nullptr);
  // Every feature but lse_output (always supported) is guarded by exactly one capability.
  for (std::uint32_t bit = 1; bit <= static_cast<std::uint32_t>(kLastFeature); bit <<= 1) {
    const auto f = static_cast<Feature>(bit);
    int guards = 0;
    for (const Capability& c : capability_table()) guards += c.feature == f ? 1 : 0;
    EXPECT_EQ(guards, f == Feature::lse_output ? 0 : 1) << feature_name(f);
  }
  EXPECT_EQ(feature_name(Feature::lse_output), "lse_output");
}

TEST(Capabilities, EveryRegisteredBackendAgreesWithItsReaders) {
  for (const auto& backend : Registry::global().all()) {
    const Backend& b = *backend;
    const BackendCapabilities& caps = b.capabilities();
    SCOPED_TRACE(b.name());
    // The readers under the seed's names, written out by hand as an independent check.
    const std::map<std::string_view, CapabilityValue> readers{
        {"accept_output_buffer", b.accept_output_buffer()},
        {"supports_piecewise_spans", b.supports_piecewise_spans()},
        {"supports_paged_kv", b.supports_paged_kv()},
        {"supports_prefix_kv_slicing", b.supports_prefix_kv_slicing()},
        {"supports_packed_mask_free", b.supports_packed_mask_free()},
        {"supports_multi_doc_packed_varlen", b.supports_multi_doc_packed_varlen()},
        {"supports_attention_mask", b.supports_attention_mask()},
        {"indexes_kv_by_block_stride", b.indexes_kv_by_block_stride()},
        {"supports_causal", b.supports_causal()},
        {"supports_dense_attention_mask", b.supports_dense_attention_mask()},
        {"exact", b.exact()},
        {"supported_platforms", b.supported_platforms()},
        {"supported_head_sizes", b.supported_head_sizes()},
        {"supported_dtypes", caps.supported_dtypes},
        {"kv_cache_dtypes", caps.kv_cache_dtypes},
    };
    EXPECT_EQ(readers.size(), capability_table().size());
    for (const Capability& c : capability_table()) {
      const auto it = readers.find(c.name);
      ASSERT_NE(it, readers.end()) << "no reader for " << c.name;
      EXPECT_TRUE(c.read(b, nullptr) == it->second) << c.name;
      if (c.flag) {
        EXPECT_EQ(caps.*(c.flag), std::get<bool>(it->second)) << c.name;
      }
      if (c.feature) {
        EXPECT_EQ(b.claims(*c.feature),
                  std::get<bool>(it->second) && (!c.implies || b.claims(*c.implies)))
            << c.name;
      }
    }
    for (DType t : {DType::F32, DType::BF16, DType::F16, DType::I8})
      EXPECT_EQ(b.supports_dtype(t),
                std::find(caps.supported_dtypes.begin(), caps.supported_dtypes.end(), t) !=
                    caps.supported_dtypes.end());
    // An impl's kv cache dtypes are the backend's declaration.
    ImplConfig ic;
    ic.num_heads = 1;
    ic.num_kv_heads = 1;
    ic.head_size = 64;
    if (b.supports_head_size(64)) {
      const auto impl = b.make_impl(ic);
      for (Platform p : {Platform::cpu, Platform::cuda})
        for (KvCacheDtype k : {KvCacheDtype::unquantized, KvCacheDtype::fp8, KvCacheDtype::int8})
          EXPECT_EQ(impl->supports_kv_cache_dtype(k, p), b.supports_kv_cache_dtype(k, p));
    }
  }
  EXPECT_TRUE(
      Registry::global().find("FLASH")->supports_kv_cache_dtype(KvCacheDtype::fp8, Platform::cpu));
  EXPECT_FALSE(
      Registry::global().find("FLASH")->supports_kv_cache_dtype(KvCacheDtype::fp8, Platform::cuda));
}

TEST(Capabilities, DenseMaskIsClaimedOnlyWithAttentionMask) {
  BackendCapabilities caps;  // supports_dense_attention_mask defaults to true
  const FakeBackend no_mask("NO_MASK", 1, caps);
  EXPECT_FALSE(no_mask.claims(Feature::dense_attention_mask));
  EXPECT_TRUE(no_mask.claims(Feature::lse_output));
  caps.supports_attention_mask = true;
  EXPECT_TRUE(FakeBackend("MASK", 1, caps).claims(Feature::dense_attention_mask));
  caps.supports_dense_attention_mask = false;
  const FakeBackend keys_only("KEYS_ONLY", 1, caps);
  EXPECT_TRUE(keys_only.claims(Feature::attention_mask));
  EXPECT_FALSE(keys_only.claims(Feature::dense_attention_mask));
}

TEST(Registry, RefusalListsEveryReason) {
  EnvGuard env(nullptr);
  BackendCapabilities caps = fake_capabilities({128}, std::nullopt);
  caps.supports_paged_kv = false;
  caps.supports_piecewise_spans = false;
  Registry r;
  r.add(std::make_shared<FakeBackend>("PLAIN", 1, caps));
  BackendRequest req = request(64);
  req.features.add(Feature::paged_kv);
  req.features.add(Feature::piecewise_spans);
  req.features.add(Feature::lse_output);
  const Refusal why = r.find("PLAIN")->refusal(req);
  ASSERT_TRUE(why.refused());
  ASSERT_EQ(why.reasons.size(), 3u) << why.to_string();
  EXPECT_EQ(why.reasons[0], "head size 64 is not supported");
  EXPECT_EQ(why.reasons[1], "does not support supports_piecewise_spans");
  EXPECT_EQ(why.reasons[2], "does not support supports_paged_kv");
  // A dense mask on a backend without masks: the mask flag once, not once per feature.
  BackendRequest masked = request(128);
  masked.features.add(Feature::attention_mask);
  masked.features.add(Feature::dense_attention_mask);
  EXPECT_EQ(r.find("PLAIN")->refusal(masked).reasons,
            std::vector<std::string>{"does not support supports_attention_mask"});
  EXPECT_FALSE(r.find("PLAIN")->refusal(request(128)));
  // The registry's errors name every reason, automatic and explicit alike.
  for (std::optional<std::string_view> name :
       {std::optional<std::string_view>(), std::optional<std::string_view>("plain")}) {
    try {
      r.select(req, name);
      FAIL();
    } catch (const Unsupported& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("head size 64"), std::string::npos) << msg;
      EXPECT_NE(msg.find("supports_piecewise_spans"), std::string::npos) << msg;
      EXPECT_NE(msg.find("supports_paged_kv"), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace dattn
