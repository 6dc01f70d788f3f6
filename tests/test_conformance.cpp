// The capability conformance suite (docs/semantics.md, "Capabilities and selection": flags must be
// true). Every registered backend runs every case: where it claims the features a case needs, its
// output and LSE must match REFERENCE; where it does not, the layer must raise Unsupported naming
// the feature and write nothing. New backends join by registering; no test code changes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>

#include "dattn/attention.hpp"
#include "dattn/capabilities.hpp"
#include "dattn/engines.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"
#include "test_inputs.hpp"

namespace dattn {
namespace {

using i64 = std::int64_t;

// A backend that claims no optional capability and writes only into a buffer of its own
// (accept_output_buffer false), computing with the reference impl. It proves that the layer
// raises for every unclaimed feature and copies results for such backends.
class MinimalBackend final : public Backend {
 public:
  std::string name() const override { return "MINIMAL_TEST"; }
  int priority() const override { return -100; }
  std::unique_ptr<Impl> make_impl(const ImplConfig& config) const override {
    return std::make_unique<MinimalImpl>(*this, config);
  }

 private:
  class MinimalImpl final : public Impl {
   public:
    MinimalImpl(const Backend& b, const ImplConfig& c)
        : Impl(b, c), inner_(Registry::global().find("REFERENCE")->make_impl(c)) {}
    std::unique_ptr<Plan> plan(const AttentionProblem& p) const override { return inner_->plan(p); }

   protected:
    void run_cpu(const Plan& plan, const AttentionProblem& p) const override {
      EXPECT_TRUE(p.out.is_contiguous())
          << "layer must hand a non-accepting backend its own buffer";
      inner_->run(plan, p);
    }

   private:
    std::unique_ptr<Impl> inner_;
  };
};

const bool kMinimalRegistered = [] {
  Registry::global().add(std::make_shared<MinimalBackend>());
  return true;
}();

struct Shape {
  i64 d, hq, hkv, sq, skv;
};

// The inputs of one case; tensors are views into NaN-padded buffers to catch stray reads.
struct Inputs {
  std::vector<Tensor> owned;
  TensorView q, k, v;
  AttentionMetadata meta;
  AttentionConfig config;
  std::optional<KvCacheDtype> per_call_kv;

  TensorView hold(Tensor t) {
    owned.push_back(t);
    return t.view();
  }
  // [B, S, H, E] random values inside a [B, S, H + 1, E + 3] NaN buffer.
  TensorView padded(std::initializer_list<i64> shape, DType dtype, std::uint32_t seed) {
    const auto s = std::vector<i64>(shape);
    Tensor buf = testing::nan_tensor({s[0], s[1], s[2] + 1, s[3] + 3}, dtype);
    Tensor vals = testing::random_tensor(shape, dtype, seed);
    const std::array<i64, 4> view_shape{s[0], s[1], s[2], s[3]};
    const TensorView view(buf.data(), dtype, view_shape, buf.view().strides());
    copy_into(vals.view(), view);
    owned.push_back(buf);
    return view;
  }
};

struct Case {
  std::string name;
  std::function<void(Inputs&, const Shape&, DType, std::uint32_t)> build;
  // Features a backend must claim to serve the case; the layer raises when one is unclaimed.
  std::vector<Feature> needs = {};
};

// Default inputs: BSHD, batch 2.
void dense(Inputs& in, const Shape& s, DType dt, std::uint32_t seed, i64 batch = 2) {
  in.q = in.padded({batch, s.sq, s.hq, s.d}, dt, seed);
  in.k = in.padded({batch, s.skv, s.hkv, s.d}, dt, seed + 1);
  in.v = in.padded({batch, s.skv, s.hkv, s.d}, dt, seed + 2);
}

std::vector<Case> scenarios() {
  std::vector<Case> c;
  c.push_back({"Dense", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed);
               }});
  c.push_back({"Causal", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed);
                 in.config.causal = true;
               }});
  c.push_back({"CausalGlobalStarts", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed);
                 in.config.causal = true;
                 in.meta.q_global_start = s.skv / 3;
                 in.meta.k_global_start = 5;
               }});
  c.push_back({"KeyPaddingMaskSelf", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 Shape sq = s;
                 sq.skv = s.sq;
                 dense(in, sq, dt, seed);
                 in.meta.attn_mask = in.hold(testing::bool_tensor({2, sq.skv}, seed, 0.7));
               }});
  c.push_back({"KeyPaddingMaskCross", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed);
                 in.config.role = AttentionRole::cross;
                 in.meta.attn_mask = in.hold(testing::bool_tensor({2, s.skv}, seed, 0.7));
               }});
  c.push_back({"BoolMask4DBroadcastWithFullyMaskedRows",
               [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed);
                 Tensor m = testing::bool_tensor({1, s.hq, s.sq, s.skv}, seed, 0.5);
                 for (i64 j = 0; j < s.skv; ++j) m.data_as<std::uint8_t>()[3 * s.skv + j] = 0;
                 in.meta.attn_mask = in.hold(m);
               }});
  c.push_back(
      {"AdditiveMaskWithInfinities", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
         dense(in, s, dt, seed);
         Tensor m = testing::random_tensor({2, 1, s.sq, s.skv}, DType::F32, seed);
         for (i64 n = 0; n < m.numel(); n += 4) m.data_as<float>()[n] = -INFINITY;
         for (i64 j = 0; j < s.skv; ++j) m.data_as<float>()[j] = -INFINITY;  // row 0 hidden
         in.meta.attn_mask = in.hold(m);
       }});
  c.push_back({"Mask3D", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed);
                 in.meta.attn_mask = in.hold(testing::bool_tensor({2, s.sq, s.skv}, seed, 0.6));
               }});
  c.push_back({"VarlenMultiDoc", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed, 1);
                 const auto cut = [](i64 n) {
                   return std::vector<std::int32_t>{0, std::int32_t(n / 3), std::int32_t(n / 3),
                                                    std::int32_t(n / 2), std::int32_t(n)};
                 };
                 in.meta.extra.cu_seqlens_q = in.hold(testing::int32_tensor(cut(s.sq)));
                 in.meta.extra.cu_seqlens_k = in.hold(testing::int32_tensor(cut(s.skv)));
                 in.meta.extra.max_seqlen_q = s.sq;
                 in.meta.extra.max_seqlen_k = s.skv;
                 in.config.causal = true;
               }});
  c.push_back(
      {"VarlenSingleDoc", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
         dense(in, s, dt, seed, 1);
         in.meta.extra.cu_seqlens_q = in.hold(testing::int32_tensor({0, std::int32_t(s.sq)}));
         in.meta.extra.cu_seqlens_k = in.hold(testing::int32_tensor({0, std::int32_t(s.skv)}));
         in.meta.extra.max_seqlen_q = s.sq;
         in.meta.extra.max_seqlen_k = s.skv;
       }});
  c.push_back(
      {"RealPadPackedPadding", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
         Shape sq = s;
         sq.skv = s.sq;
         dense(in, sq, dt, seed, 1);
         const auto used = std::int32_t(s.sq * 2 / 3), total = std::int32_t(s.sq);
         in.meta.extra.cu_seqlens_q = in.hold(testing::int32_tensor({0, used, total}));
         in.meta.extra.cu_seqlens_k = in.hold(testing::int32_tensor({0, used, total}));
         in.meta.extra.max_seqlen_q = total;
         in.meta.extra.max_seqlen_k = total;
         const TensorView cu = in.hold(testing::int32_tensor({0, used}));
         in.meta.packed_padding = PackedPaddingMetadata{used, used, cu, cu};
       }});
  c.push_back({"PackedPaddingWithoutCuSeqlens",
               [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed);
                 const auto ql = std::int32_t(s.sq - 5), kl = std::int32_t(s.skv - 7);
                 in.meta.packed_padding =
                     PackedPaddingMetadata{ql, kl, in.hold(testing::int32_tensor({0, ql})),
                                           in.hold(testing::int32_tensor({0, kl}))};
               }});
  c.push_back({"ValidKvLength", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed);
                 in.meta.extra.valid_kv_length = s.skv - 11;
                 in.config.causal = true;
               }});
  c.push_back(
      {"PiecewiseSpansQueryRanges", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
         dense(in, s, dt, seed);
         const i64 half = s.sq / 2;
         in.meta.query_ranges =
             std::vector<QueryRange>{{0, half, 0}, {half, s.sq, s.skv - (s.sq - half)}};
         const std::vector<std::pair<i64, i64>> spans{{2, 9}, {s.skv / 2, s.skv / 2 + 13}};
         in.meta.full_attn_spans = FullAttnSpans{spans, spans};
       }});
  for (JointStrategy js : {JointStrategy::front, JointStrategy::rear}) {
    c.push_back({std::string("Joint") + (js == JointStrategy::front ? "Front" : "Rear"),
                 [js](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                   dense(in, s, dt, seed);
                   in.meta.joint_query = in.padded({2, 7, s.hq, s.d}, dt, seed + 10);
                   in.meta.joint_key = in.padded({2, 7, s.hkv, s.d}, dt, seed + 11);
                   in.meta.joint_value = in.padded({2, 7, s.hkv, s.d}, dt, seed + 12);
                   in.meta.joint_strategy = js;
                   in.config.role = AttentionRole::cross;
                 }});
  }
  c.push_back(
      {"JointWithMergedMasks", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
         Shape sq = s;
         sq.skv = s.sq;
         dense(in, sq, dt, seed);
         in.meta.joint_query = in.padded({2, 5, s.hq, s.d}, dt, seed + 10);
         in.meta.joint_key = in.padded({2, 5, s.hkv, s.d}, dt, seed + 11);
         in.meta.joint_value = in.padded({2, 5, s.hkv, s.d}, dt, seed + 12);
         in.meta.attn_mask = in.hold(testing::bool_tensor({2, sq.skv}, seed, 0.8));
         in.meta.joint_attn_mask = in.hold(testing::bool_tensor({2, 5}, seed + 1, 0.6));
       }});
  c.push_back(
      {"ValueHeadSizeDiffers", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
         dense(in, s, dt, seed);
         in.v = in.padded({2, s.skv, s.hkv, s.d / 2 + 3}, dt, seed + 2);
         in.config.causal = true;
       }});
  c.push_back({"LaserScale", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed);
                 in.meta.extra.laser_input_scale = 8.0;
                 in.config.causal = true;
               }});
  c.push_back({"EmptyKeys", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 Shape z = s;
                 z.skv = 0;
                 dense(in, z, dt, seed);
               }});
  c.push_back({"LayoutBHSD", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed);
                 const std::array<int, 4> perm{0, 2, 1, 3};
                 in.q = in.q.permuted(perm);
                 in.k = in.k.permuted(perm);
                 in.v = in.v.permuted(perm);
                 in.config.qkv_layout = QkvLayout::BHSD;
                 in.config.causal = true;
               }});
  c.push_back({"LayoutTHD", [](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                 dense(in, s, dt, seed, 1);
                 in.q = testing::without_batch_dim(in.q);
                 in.k = testing::without_batch_dim(in.k);
                 in.v = testing::without_batch_dim(in.v);
                 in.config.qkv_layout = QkvLayout::THD;
               }});
  for (KvCacheDtype kv : {KvCacheDtype::fp8, KvCacheDtype::int8}) {
    c.push_back({std::string("KvCache") + (kv == KvCacheDtype::fp8 ? "Fp8" : "Int8"),
                 [kv](Inputs& in, const Shape& s, DType dt, std::uint32_t seed) {
                   dense(in, s, dt, seed);
                   in.per_call_kv = kv;
                   in.meta.extra.kv_cache_dtype = kv;
                 }});
  }
  const auto need = [&](const std::string& name, std::vector<Feature> f) {
    for (Case& k : c)
      if (k.name == name) k.needs = f;
  };
  for (const char* masked :
       {"KeyPaddingMaskSelf", "KeyPaddingMaskCross", "BoolMask4DBroadcastWithFullyMaskedRows",
        "AdditiveMaskWithInfinities", "Mask3D", "JointWithMergedMasks"})
    need(masked, {Feature::attention_mask});
  need("VarlenMultiDoc", {Feature::multi_doc_packed_varlen});
  need("ValidKvLength", {Feature::prefix_kv_slicing});
  need("PiecewiseSpansQueryRanges", {Feature::piecewise_spans});
  return c;
}

// What a backend must claim to serve `c` built as `in`. A [real, pad] packing is one document
// for a backend that honours packed_padding, and two real ones for a backend that ignores it
// (docs/semantics.md, "Packed variable-length batches" and "Packed padding and prefix slicing").
// Causal cases need supports_causal; 3-D/4-D masks supports_dense_attention_mask.
std::vector<Feature> needs_of(const Case& c, const Backend& b, const Inputs& in) {
  std::vector<Feature> needs = c.needs;
  if (c.name == "RealPadPackedPadding" && !b.supports_packed_mask_free())
    needs = {Feature::multi_doc_packed_varlen};
  if (in.config.causal || in.meta.full_attn_spans) needs.push_back(Feature::causal);
  if (in.meta.attn_mask && in.meta.attn_mask->ndim() >= 3)
    needs.push_back(Feature::dense_attention_mask);
  return needs;
}

struct Param {
  std::string backend;
  Case scenario;
  Shape shape;
  DType dtype;
  std::string name;
};

std::vector<Param> params() {
  // Every dtype at the common head sizes; an odd head size (no multiple of any SIMD width)
  // with GQA 3:1 in f32. Under the sanitizers each shape runs one dtype and each dtype one
  // shape: every head-size path and every dtype path, not every pair (CI time).
  struct ShapeDtypes {
    Shape shape;
    std::vector<DType> dtypes;
  };
  const std::vector<ShapeDtypes> shapes =
      testing::kSanitized
          ? std::vector<ShapeDtypes>{{{64, 4, 1, 59, 97}, {DType::F16}},
                                     {{80, 2, 2, 113, 113}, {DType::F32}},
                                     {{128, 4, 1, 61, 61}, {DType::BF16}},
                                     {{59, 3, 1, 37, 71}, {DType::F32}}}
          : std::vector<ShapeDtypes>{{{64, 4, 1, 59, 97}, {DType::F32, DType::BF16, DType::F16}},
                                     {{80, 2, 2, 113, 113}, {DType::F32, DType::BF16, DType::F16}},
                                     {{128, 4, 1, 61, 61}, {DType::F32, DType::BF16, DType::F16}},
                                     {{59, 3, 1, 37, 71}, {DType::F32}}};
  std::vector<Param> out;
  for (const auto& b : Registry::global().all())
    for (const Case& sc : scenarios())
      for (const ShapeDtypes& sd : shapes)
        for (DType dt : sd.dtypes) {
          const Shape& s = sd.shape;
          const std::string name = b->name() + "_" + sc.name + "_D" + std::to_string(s.d) + "_H" +
                                   std::to_string(s.hq) + "x" + std::to_string(s.hkv) + "_" +
                                   std::string(dtype_name(dt));
          out.push_back({b->name(), sc, s, dt, name});
        }
  return out;
}

void PrintTo(const Param& p, std::ostream* os) {
  *os << p.name;
}

// Whether DATTN_ISA names a 16-bit integer-lane engine (compute int16): FLASH and the backends
// on its engines then compute every call on it, at its accuracy.
bool integer_lanes_forced() {
  const char* isa = std::getenv("DATTN_ISA");
  if (isa == nullptr) return false;
  for (const EngineInfo& e : flash_engines())
    if (e.name == isa) return e.compute_dtype == "int16";
  return false;
}

class Conformance : public ::testing::TestWithParam<Param> {};

ForwardResult run(const Inputs& in, const std::string& backend,
                  const AttentionMetadata* meta = nullptr) {
  AttentionConfig c = in.config;
  c.backend = backend;
  return Attention(c).forward(in.q, in.k, in.v, meta ? *meta : in.meta, true);
}

TEST_P(Conformance, MatchesReferenceOrRaisesForUnclaimedFeatures) {
  (void)kMinimalRegistered;
  const Param& p = GetParam();
  Inputs in;
  in.config.num_heads = p.shape.hq;
  in.config.num_kv_heads = p.shape.hkv;
  in.config.head_size = p.shape.d;
  p.scenario.build(in, p.shape, p.dtype, 1234);

  AttentionConfig c = in.config;
  c.backend = p.backend;
  std::optional<Attention> made;
  try {
    made.emplace(c);
  } catch (const NotAvailable& e) {
    GTEST_SKIP() << e.what();  // e.g. DATTN_ISA asks for an instruction set this CPU lacks
  }
  const Attention& layer = *made;
  // What the layer would need from the backend for this call.
  const bool kv_ok =
      !in.per_call_kv || layer.impl().supports_kv_cache_dtype(*in.per_call_kv, Platform::cpu);
  try {
    const ForwardResult got = layer.forward(in.q, in.k, in.v, in.meta, true);
    ASSERT_TRUE(kv_ok) << "a kv_cache_dtype the impl does not declare was accepted";
    for (Feature f : needs_of(p.scenario, layer.backend(), in))
      ASSERT_TRUE(layer.backend().claims(f))
          << "served a call needing unclaimed " << feature_name(f);
    // Backends without supports_packed_mask_free ignore packed_padding (docs/semantics.md, "Packed
    // padding and prefix slicing").
    AttentionMetadata want_meta = in.meta;
    if (!layer.backend().supports_packed_mask_free()) want_meta.packed_padding.reset();
    const ForwardResult want = run(in, "REFERENCE", &want_meta);
    const auto d = testing::compare(got.out.view(), want.out.view());
    EXPECT_FALSE(d.nan) << "NaN where the reference has none (or the reverse)";
    // SAGE (8-bit Q.K^T) at its accuracy (test_sage.cpp measures it closely), the 16-bit
    // integer-lane engines at theirs (test_int16.cpp), the others exact.
    const bool int16 = integer_lanes_forced() && p.backend != "REFERENCE";
    const bool int8 = p.backend == "SAGE";
    EXPECT_LE(d.normwise_rel, int8    ? 2e-2
                              : int16 ? std::max(5e-3, testing::tolerance_for(p.dtype))
                                      : testing::tolerance_for(p.dtype))
        << "max abs " << d.max_abs;
    const auto l = testing::compare(got.lse->view(), want.lse->view());
    EXPECT_FALSE(l.nan);
    EXPECT_LE(l.max_abs, int8 ? 5e-2 : int16 ? 2e-2 : p.dtype == DType::F32 ? 1e-4 : 1e-2);
    for (i64 n = 0; n < got.out.numel(); ++n)
      ASSERT_FALSE(std::isnan(load_as_f32(got.out.data(), got.out.dtype(), n))) << "NaN in output";
    // Every run of the same inputs is bitwise equal.
    const ForwardResult again = layer.forward(in.q, in.k, in.v, in.meta, true);
    EXPECT_TRUE(testing::bitwise_equal(got.out, again.out));
    EXPECT_TRUE(testing::bitwise_equal(*got.lse, *again.lse));
  } catch (const Unsupported& e) {
    // Allowed only when the backend does not claim a feature the call needs; the message names
    // the backend.
    const Backend& b = layer.backend();
    bool unclaimed = !kv_ok && e.field() == "kv_cache_dtype";
    for (Feature f : needs_of(p.scenario, b, in))
      if (e.field() == feature_name(f)) unclaimed = !b.claims(f);
    EXPECT_TRUE(unclaimed) << "raised for a claimed feature: " << e.what();
    EXPECT_NE(std::string(e.what()).find(b.name()), std::string::npos) << e.what();
    // Nothing written: forward_into on a sentinel buffer stays untouched.
    const ForwardResult shape = run(in, "REFERENCE");
    Tensor sentinel = Tensor::empty(shape.out.shape(), shape.out.dtype());
    for (i64 n = 0; n < sentinel.numel(); ++n)
      store_from_f32(sentinel.data(), sentinel.dtype(), n, 3.0f);
    const Tensor before = Tensor::copy_of(sentinel.view());
    EXPECT_THROW(layer.forward_into(in.q, in.k, in.v, in.meta, sentinel.view()), Unsupported);
    EXPECT_TRUE(testing::bitwise_equal(sentinel, before));
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Conformance, ::testing::ValuesIn(params()),
                         [](const auto& tp) { return tp.param.name; });

// supports_paged_kv (and indexes_kv_by_block_stride: the pool is a block-outermost layer view
// with a runtime block stride): a paged call equals dense attention on the logical sequence.
class PagedConformance : public ::testing::TestWithParam<std::string> {};

TEST_P(PagedConformance, PagedEqualsDenseOrIsRefused) {
  const i64 hq = 4, hkv = 2, d = 64, bs = 16, layers = 3, seq = 45, fresh = 13;
  const i64 blocks = 5;
  // Block-outermost multi-layer cache [blocks, layers, bs, hkv, d]; this layer is layer 1.
  Tensor pool_k = testing::nan_tensor({blocks, layers, bs, hkv, d}, DType::F32);
  Tensor pool_v = testing::nan_tensor({blocks, layers, bs, hkv, d}, DType::F32);
  const std::array<i64, 4> shape{blocks, bs, hkv, d};
  const std::array<i64, 4> strides{layers * bs * hkv * d, hkv * d, d, 1};
  const i64 layer_off = bs * hkv * d;
  PagedAttentionCall call;
  call.cache = {TensorView(pool_k.data_as<float>() + layer_off, DType::F32, shape, strides),
                TensorView(pool_v.data_as<float>() + layer_off, DType::F32, shape, strides)};
  call.rows = {{fresh, seq, seq - fresh, {4, 0, 2}}};
  call.softmax_scale = 0.125;
  const Tensor full_k = testing::random_tensor({seq, hkv, d}, DType::F32, 1);
  const Tensor full_v = testing::random_tensor({seq, hkv, d}, DType::F32, 2);
  // Cached prefix written by hand through the table.
  for (i64 pos = 0; pos < seq - fresh; ++pos) {
    const i64 slot = paged_slot(call.rows[0].block_table, bs, pos);
    for (i64 h = 0; h < hkv; ++h)
      for (i64 e = 0; e < d; ++e) {
        const std::array<i64, 4> idx{slot / bs, slot % bs, h, e};
        *static_cast<float*>(call.cache.k_pages.element_ptr(idx)) =
            full_k.data_as<float>()[(pos * hkv + h) * d + e];
        *static_cast<float*>(call.cache.v_pages.element_ptr(idx)) =
            full_v.data_as<float>()[(pos * hkv + h) * d + e];
      }
  }
  const Tensor q = testing::random_tensor({fresh, hq, d}, DType::F32, 3);
  call.q = q.view();
  call.k_new = full_k.view().sliced(0, seq - fresh, fresh);
  call.v_new = full_v.view().sliced(0, seq - fresh, fresh);
  Tensor out = Tensor::zeros({fresh, hq, d}, DType::F32);
  call.out = out.view();
  AttentionConfig c;
  c.num_heads = hq;
  c.num_kv_heads = hkv;
  c.head_size = d;
  c.softmax_scale = 0.125;
  c.backend = GetParam();
  std::optional<Attention> made;
  try {
    made.emplace(c);
  } catch (const NotAvailable& e) {
    GTEST_SKIP() << e.what();
  }
  const Attention& layer = *made;
  if (!layer.backend().supports_paged_kv()) {
    EXPECT_THROW(layer.forward_paged(call), Unsupported);
    return;
  }
  layer.forward_paged(call);
  c.qkv_layout = QkvLayout::THD;
  c.backend = "REFERENCE";
  const auto dense = Attention(c).forward(q, full_k, full_v);
  const auto diff = testing::compare(out.view(), dense.out.view());
  EXPECT_FALSE(diff.nan);
  // SAGE: 8-bit Q.K^T; the 16-bit integer-lane engines forced through DATTN_ISA: 13-bit codes.
  EXPECT_LE(diff.normwise_rel, GetParam() == "SAGE"                                  ? 2e-2
                               : integer_lanes_forced() && GetParam() != "REFERENCE" ? 5e-3
                                                                                     : 1e-5);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, PagedConformance, ::testing::ValuesIn([] {
                           (void)kMinimalRegistered;
                           return Registry::global().names();
                         }()));

// Every capability that guards a feature (capability_table()) is proven here: some scenario
// needs it (so a backend that claims it must match REFERENCE, one that does not must raise), or
// a named test covers it. A capability added to the table fails this until a scenario joins.
TEST(ConformanceCoverage, EveryCapabilityThatGuardsAFeatureHasAScenario) {
  (void)kMinimalRegistered;
  // Features not raised on when unclaimed, proven by the test named.
  const std::map<Feature, std::string> elsewhere{
      {Feature::paged_kv, "PagedConformance"},
      // Unclaimed, packed_padding is ignored (compared against REFERENCE without it).
      {Feature::packed_mask_free, "PackedPaddingWithoutCuSeqlens"},
  };
  const std::vector<Case> cases = scenarios();
  const Shape shape{64, 4, 1, 59, 97};
  for (const Capability& cap : capability_table()) {
    if (!cap.feature) continue;
    bool covered = false;
    if (const auto it = elsewhere.find(*cap.feature); it != elsewhere.end())
      covered = it->second == "PagedConformance" ||
                std::any_of(cases.begin(), cases.end(),
                            [&](const Case& c) { return c.name == it->second; });
    for (const Case& c : cases) {
      Inputs in;
      c.build(in, shape, DType::F32, 1);
      for (const auto& b : Registry::global().all()) {
        const std::vector<Feature> needs = needs_of(c, *b, in);
        covered = covered || std::find(needs.begin(), needs.end(), *cap.feature) != needs.end();
      }
    }
    EXPECT_TRUE(covered) << "no conformance scenario needs " << cap.name;
  }
}

}  // namespace
}  // namespace dattn
