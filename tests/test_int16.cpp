// The 16-bit integer-lane engines (compute int16: avx2_int16, avx_vnni_int16, avx512_vnni_int16
// and their twins; cpu/int8_impl.hpp, "16-bit integer lanes"): their accuracy on the hostile bf16
// input classes against the bf16 engine semantics (the automatic rule's condition, engines.hpp:
// within 1.5x in mean relative L1 on every class), the twins' bits against their real engines',
// what masks hide and padding holds changing no other row, heads wide enough that the codes'
// bound matters, the selection rules (compute_dtype int16, exact names, caps that never select
// them), and SAGE's and VIDEO_SPARSE's qk_dtype int16. The conformance suite runs every feature
// on each of them (flash_conformance_isa_<engine>).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backends/flash/engines.hpp"
#include "backends/flash/kernels.hpp"
#include "dattn/attention.hpp"
#include "dattn/errors.hpp"
#include "engine_logits.hpp"
#include "test_inputs.hpp"

namespace dattn {
namespace {

using i64 = std::int64_t;

std::vector<const flash::Engine*> int16_engines(bool emulated_too = true) {
  std::vector<const flash::Engine*> out;
  for (const flash::Engine& e : flash::engines())
    if (e.compute == flash::ComputeDtype::int16 && e.available() && (emulated_too || !e.emulated))
      out.push_back(&e);
  return out;
}

// Inputs of one hostile class (as bench/int16_accuracy.py's): Q [1, S, H, D], K and V [1, Skv, H,
// D] in `dtype`, and the key mask (all kept unless the class pads keys).
struct Case {
  Tensor q, k, v;
  std::optional<Tensor> mask;
  i64 valid_rows;
};

Case hostile(const std::string& cls, i64 h, i64 sq, i64 skv, i64 d, DType dtype,
             std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> q(std::size_t(sq * h * d)), k(std::size_t(skv * h * d)),
      v(std::size_t(skv * h * d));
  for (auto* x : {&q, &k, &v})
    for (float& e : *x) e = n(rng);
  std::vector<i64> outliers;
  for (i64 c = 3; c < d && outliers.size() < 4; c += d / 4) outliers.push_back(c);
  const auto each = [&](std::vector<float>& x, i64 s, auto&& f) {
    for (i64 i = 0; i < s; ++i)
      for (i64 hh = 0; hh < h; ++hh)
        for (i64 e = 0; e < d; ++e) f(x[std::size_t((i * h + hh) * d + e)], i, e);
  };
  Case out;
  out.valid_rows = sq;
  if (cls == "offset") {
    for (auto* x : {&q, &k, &v})
      for (float& e : *x) e = 3.0f + 4.0f * e;
  } else if (cls == "outliers") {
    for (auto* x : {&q, &k})
      each(*x, x == &q ? sq : skv, [&](float& e, i64, i64 c) {
        if (std::find(outliers.begin(), outliers.end(), c) != outliers.end()) e *= 20.0f;
      });
  } else if (cls == "two_pops") {  // the first 77 tokens text, from another projection
    each(q, sq, [](float& e, i64 i, i64) { e = i < 77 ? 3.0f * e - 2.0f : e; });
    each(k, skv, [](float& e, i64 i, i64) { e = i < 77 ? 3.0f * e - 2.0f : e; });
    each(v, skv, [](float& e, i64 i, i64) { e = i < 77 ? 3.0f * e - 2.0f : e; });
  } else if (cls == "garbage") {  // the last 40 keys padding holding huge values and NaN
    each(k, skv, [&](float& e, i64 i, i64 c) {
      if (i >= skv - 40) e = c % 7 == 0 ? std::numeric_limits<float>::quiet_NaN() : 1e4f;
    });
    each(v, skv, [&](float& e, i64 i, i64) {
      if (i >= skv - 40) e = std::numeric_limits<float>::quiet_NaN();
    });
    Tensor m = Tensor::empty({1, skv}, DType::Bool);
    for (i64 j = 0; j < skv; ++j) m.data_as<std::uint8_t>()[j] = j < skv - 40 ? 1 : 0;
    out.mask = std::move(m);
  }
  const auto make = [&](const std::vector<float>& x, i64 s) {
    Tensor t = Tensor::empty({1, s, h, d}, dtype);
    for (i64 i = 0; i < t.numel(); ++i) store_from_f32(t.data(), dtype, i, x[std::size_t(i)]);
    return t;
  };
  out.q = make(q, sq);
  out.k = make(k, skv);
  out.v = make(v, skv);
  return out;
}

ForwardResult run(const Case& c, const std::string& backend, BackendOptions options, i64 h, i64 d) {
  AttentionConfig cfg = testing::layer_config(backend, h, h, d);
  cfg.backend_options = std::move(options);
  AttentionMetadata m;
  if (c.mask) m.attn_mask = c.mask->view();
  return Attention(cfg).forward(c.q.view(), c.k.view(), c.v.view(), m, true);
}

// Mean relative L1 of `got` against `want` over every row.
double rel_l1(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = testing::to_vector(got.view()), w = testing::to_vector(want.view());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i) num += std::fabs(g[i] - w[i]), den += std::fabs(w[i]);
  return num / den;
}

// The automatic rule's condition: on every hostile bf16 class the integer lanes' error (the
// output rounded to bf16, as the bf16 engine's) is within 1.5x the bf16 engine semantics'
// (avx512_bf16's emulated twin: bf16 operands, P rounded to bf16, the same on every CPU).
TEST(Int16Lanes, WithinTheBf16EngineErrorOnHostileInputs) {
  const std::vector<const flash::Engine*> engines = int16_engines();
  ASSERT_FALSE(engines.empty()) << "the emulated twins run everywhere";
  const i64 h = 2, sq = testing::kSanitized ? 96 : 256, skv = testing::kSanitized ? 192 : 640;
  for (const i64 d : {64, 128})
    for (const char* cls : {"normal", "offset", "outliers", "two_pops", "garbage"}) {
      const Case c = hostile(cls, h, sq, skv, d, DType::BF16, 7);
      const ForwardResult want = run(c, "REFERENCE", {}, h, d);
      const ForwardResult bf16 = run(c, "FLASH", {{"isa", "avx512_bf16_emulated"}}, h, d);
      const double base = rel_l1(bf16.out, want.out);
      for (const flash::Engine* e : engines) {
        const ForwardResult got = run(c, "FLASH", {{"isa", std::string(e->name)}}, h, d);
        const double err = rel_l1(got.out, want.out);
        EXPECT_LE(err, 1.5 * base) << e->name << " " << cls << " D " << d << ": " << err
                                   << " against the bf16 engine's " << base;
        const auto lse = testing::compare(got.lse->view(), want.lse->view());
        EXPECT_FALSE(lse.nan) << e->name << " " << cls;
        EXPECT_LE(lse.max_abs, 2e-2) << e->name << " " << cls;
      }
    }
}

// Every int16 engine (the real ones this CPU runs, every twin) computes the same logits bit for
// bit (exact integer dots, the same f32 steps for the scales and the exact channels: the twins
// emulate the instructions; a twin's softmax is the portable one, so its outputs may differ from
// its real engine's in the last bits), with a key and a query row that are not finite, head sizes
// with partial groups, no exact channels (24) and codes of the wide heads' bound (256), and
// `extreme` inputs whose every code is the top one (the largest dots an int32 lane holds).
TEST(Int16Lanes, EveryEngineComputesTheSameLogitsBitForBit) {
  const std::vector<const flash::Engine*> engines = int16_engines();
  ASSERT_GE(engines.size(), 3u);  // the three twins run everywhere
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 2.0f);
  std::bernoulli_distribution coin(0.5);
  for (const bool extreme : {false, true})
    for (const int d : {24, 59, 128, 256})
      for (const int keys : {64, 37, 1}) {
        const int rows = 61;
        const auto draw = [&] { return extreme ? (coin(rng) ? 2.0f : -2.0f) : n(rng); };
        std::vector<std::vector<float>> results;
        std::vector<float> k(std::size_t(keys) * (d + 16));
        for (float& x : k) x = draw();
        std::vector<float> qt(std::size_t(d) * 128, 0.0f);
        for (int e = 0; e < d; ++e)
          for (int r = 0; r < rows; ++r) qt[std::size_t(e) * 128 + r] = draw();
        k[3] = INFINITY;                         // key 0's logits are NaN in every row
        qt[std::size_t(d - 1) * 128 + 7] = NAN;  // row 7's (in an exact channel from 32 on)
        for (const flash::Engine* e : engines) {
          SCOPED_TRACE(std::string(e->name) + " d " + std::to_string(d) + " keys " +
                       std::to_string(keys) + (extreme ? " extreme" : ""));
          const testing::EngineLogits got = testing::engine_logits(*e, qt, k, d, keys, rows);
          ASSERT_TRUE(got.ok);
          const std::vector<float>& mine = got.logits;
          for (int r = 0; r < rows; ++r) EXPECT_TRUE(std::isnan(mine[std::size_t(r)])) << r;
          for (int j = 0; j < keys; ++j)
            EXPECT_TRUE(std::isnan(mine[std::size_t(j) * rows + 7])) << j;
          if (extreme)  // every code at the top: the logits are 0.125 q . k up to f32 rounding
            for (int j = 1; j < keys; ++j)
              for (int r = 0; r < rows; ++r) {
                if (r == 7) continue;
                double dot = 0.0;
                for (int ch = 0; ch < d; ++ch)
                  dot += double(qt[std::size_t(ch) * 128 + r]) * k[std::size_t(j) * (d + 16) + ch];
                ASSERT_NEAR(mine[std::size_t(j) * rows + r], 0.125 * dot, 1e-5 * 0.5 * d)
                    << "key " << j << " row " << r;
              }
          results.push_back(mine);
        }
        for (std::size_t n2 = 1; n2 < results.size(); ++n2)
          EXPECT_EQ(
              std::memcmp(results[n2].data(), results[0].data(), results[0].size() * sizeof(float)),
              0)
              << engines[n2]->name << " vs " << engines[0]->name;
      }
}

// What a mask hides and padding holds changes no row's answer, bit for bit: the keys' statistics
// (the smoothing, the exact channels' choice) and every code come only from what rows see.
TEST(Int16Lanes, HiddenKeysChangeNoAnswer) {
  const i64 h = 2, d = 64, sq = 70, skv = 150;
  for (const flash::Engine* e : int16_engines()) {
    Case a = hostile("normal", h, sq, skv, d, DType::BF16, 11);
    Tensor m = Tensor::empty({1, skv}, DType::Bool);
    for (i64 j = 0; j < skv; ++j) m.data_as<std::uint8_t>()[j] = (j % 5 == 3 || j > 120) ? 0 : 1;
    a.mask = std::move(m);
    Case b = hostile("normal", h, sq, skv, d, DType::BF16, 11);
    b.mask = Tensor::copy_of(a.mask->view());
    for (i64 j = 0; j < skv; ++j) {
      if (a.mask->data_as<std::uint8_t>()[j] != 0) continue;
      for (i64 x = 0; x < h * d; ++x) {
        const float garbage = x % 3 == 0   ? std::numeric_limits<float>::quiet_NaN()
                              : x % 3 == 1 ? 3e38f
                                           : -1e4f;
        store_from_f32(b.k.data(), DType::BF16, j * h * d + x, garbage);
        store_from_f32(b.v.data(), DType::BF16, j * h * d + x, -garbage);
      }
    }
    const BackendOptions o{{"isa", std::string(e->name)}};
    const ForwardResult ra = run(a, "FLASH", o, h, d), rb = run(b, "FLASH", o, h, d);
    EXPECT_TRUE(testing::bitwise_equal(ra.out, rb.out)) << e->name;
    EXPECT_TRUE(testing::bitwise_equal(*ra.lse, *rb.lse)) << e->name;
  }
}

// VIDEO_SPARSE with qk_dtype int16 (every block selected, and a sparse selection): GQA, two
// token populations, a key-padding mask whose keys (and the query rows it hides) hold garbage;
// the other rows are the same bits whatever the garbage, within the engines' accuracy of
// REFERENCE (or of VIDEO_SPARSE's f32 answer on the same blocks).
TEST(Int16Lanes, VideoSparseOnTheIntegerLanes) {
  const i64 s = 160, hq = 4, hkv = 2, d = 64, used = 131;
  Case x = hostile("two_pops", hkv, s, s, d, DType::F32, 21);
  const Case xq = hostile("two_pops", hq, s, s, d, DType::F32, 22);
  Tensor q = Tensor::copy_of(xq.q.view());
  Tensor mask = Tensor::zeros({1, s}, DType::Bool);
  for (i64 j = 0; j < s; ++j) mask.data_as<std::uint8_t>()[j] = j < used ? 1 : 0;
  AttentionMetadata m;
  m.attn_mask = mask.view();
  for (const flash::Engine* e : int16_engines()) {
    SCOPED_TRACE(e->name);
    for (const i64 topk : {i64(1000), i64(2)}) {
      AttentionConfig c = testing::layer_config("VIDEO_SPARSE", hq, hkv, d);
      c.backend_options["topk"] = topk;
      if (topk == 2) c.backend_options["tile"] = std::string("1,1,32");
      AttentionConfig f = c;  // the same blocks in f32
      c.backend_options["qk_dtype"] = std::string("int16");
      c.backend_options["isa"] = std::string(e->name);
      const ForwardResult want =
          topk == 1000 ? [&] {
            AttentionConfig r = testing::layer_config("REFERENCE", hq, hkv, d);
            return Attention(r).forward(q.view(), x.k.view(), x.v.view(), m, true);
          }()
                       : Attention(f).forward(q.view(), x.k.view(), x.v.view(), m, true);
      Tensor first;
      bool have = false;
      for (const float g : {1e4f, std::numeric_limits<float>::quiet_NaN(), -3e38f}) {
        for (i64 j = used; j < s; ++j)
          for (i64 n = 0; n < hkv * d; ++n) {
            x.k.data_as<float>()[j * hkv * d + n] = g;
            x.v.data_as<float>()[j * hkv * d + n] = -g;
          }
        for (i64 i = used; i < s; ++i)
          for (i64 n = 0; n < hq * d; ++n) q.data_as<float>()[i * hq * d + n] = 3 * g;
        Attention layer(c);
        const ForwardResult got = layer.forward(q.view(), x.k.view(), x.v.view(), m, true);
        EXPECT_EQ(layer.last_engine(), e->name);
        if (!have) {
          have = true;
          first = Tensor::copy_of(got.out.view());
          const auto diff = testing::compare(got.out.view(), want.out.view());
          EXPECT_FALSE(diff.nan);
          EXPECT_LE(diff.normwise_rel, 5e-3) << "topk " << topk;
        } else {
          EXPECT_TRUE(testing::bitwise_equal(got.out, first)) << g << " topk " << topk;
        }
      }
    }
  }
}

// Heads wider than 128 coded channels take smaller codes (kernels.hpp, int16_code_top): inputs
// whose every element reaches the top code sum to the largest dot, which must not wrap.
TEST(Int16Lanes, WideHeadsDoNotWrap) {
  EXPECT_EQ(flash::int16_code_top(124), 4095.0f);
  EXPECT_EQ(flash::int16_code_top(128), 4095.0f);
  for (const int coded : {129, 252, 508, 1020}) {
    const double top = flash::int16_code_top(coded);
    EXPECT_LE(2.0 * ((coded + 1) / 2) * top * top, 2147483647.0) << coded;
    EXPECT_GT(2.0 * ((coded + 1) / 2) * (top + 1) * (top + 1), 2147483647.0) << coded;
  }
  for (const flash::Engine* e : int16_engines()) {
    for (const i64 d : {256, 512}) {
      // Q and K all ones but for one smaller channel per row; V random.
      Tensor q = Tensor::empty({1, 33, 1, d}, DType::F32);
      Tensor k = Tensor::empty({1, 70, 1, d}, DType::F32);
      for (i64 i = 0; i < q.numel(); ++i) q.data_as<float>()[i] = i % d == 5 ? 0.5f : 1.0f;
      for (i64 i = 0; i < k.numel(); ++i) k.data_as<float>()[i] = (i / d) % 3 == 0 ? -1.0f : 1.0f;
      const Tensor v = testing::random_tensor({1, 70, 1, d}, DType::F32, 5);
      AttentionConfig c = testing::layer_config("FLASH", 1, 1, d);
      c.softmax_scale = 0.001;
      c.backend_options["isa"] = std::string(e->name);
      const ForwardResult got = Attention(c).forward(q.view(), k.view(), v.view(), {}, true);
      c.backend = "REFERENCE";
      c.backend_options.clear();
      const ForwardResult want = Attention(c).forward(q.view(), k.view(), v.view(), {}, true);
      const auto diff = testing::compare(got.out.view(), want.out.view());
      EXPECT_FALSE(diff.nan) << e->name << " D " << d;
      EXPECT_LE(diff.normwise_rel, 2e-3) << e->name << " D " << d;
      EXPECT_LE(testing::compare(got.lse->view(), want.lse->view()).max_abs, 1e-3) << e->name;
    }
  }
}

const flash::Engine& named(const std::string& name) {
  return flash::engine_named(name, "isa");
}

TEST(Int16Lanes, SelectionRules) {
  using flash::ComputeDtype;
  // compute_dtype int16: the highest-ranked int16 engine the CPU runs, else f32 (as bf16 does
  // where no bf16 engine exists).
  const flash::Engine& chosen = flash::select_engine(nullptr, DType::BF16, ComputeDtype::int16);
  if (int16_engines(false).empty())
    EXPECT_EQ(chosen.compute, ComputeDtype::f32) << chosen.name;
  else
    EXPECT_EQ(chosen.name, int16_engines(false).back()->name);
  // A cap that names another engine never selects the integer lanes, whatever the operands.
  for (const flash::Engine& e : flash::engines()) {
    if (e.compute == ComputeDtype::int16 || !e.available()) continue;
    const std::string_view cap = e.name;
    for (const bool half : {false, true})
      EXPECT_NE(flash::select_engine(&e, DType::BF16, ComputeDtype::f32, half).compute,
                ComputeDtype::int16)
          << cap;
  }
  // An int16 engine by its exact name is taken, for f32 and bf16 compute alike; SAGE's int8
  // selection stays on the int8 engines.
  const flash::Engine& twin = named("avx2_int16_emulated");
  EXPECT_EQ(&flash::select_engine(&twin, DType::F32, ComputeDtype::f32), &twin);
  EXPECT_EQ(&flash::select_engine(&twin, DType::BF16, ComputeDtype::bf16), &twin);
  EXPECT_EQ(flash::select_engine(&twin, DType::F32, ComputeDtype::int8).compute,
            ComputeDtype::int8);
  // f32 inputs never take the integer lanes by themselves.
  EXPECT_NE(flash::select_engine(nullptr, DType::F32, ComputeDtype::f32, false).compute,
            ComputeDtype::int16);
  // The automatic rule: all-16-bit operands, and only where the lanes outrun what bf16 calls
  // run on (measured), never an emulated engine.
  const flash::Engine& automatic =
      flash::select_engine(nullptr, DType::BF16, ComputeDtype::f32, true);
  EXPECT_FALSE(automatic.emulated);
  EXPECT_EQ(automatic.compute == ComputeDtype::int16, flash::int16_lanes_outrun())
      << automatic.name;
  // Only calls whose rows see kInt16MinKeys keys on average, so that quantizing Q pays off.
  AttentionProblem p;
  p.segments = {{0, 0, 4096, 0, 512}};  // cross-attention on 512 text keys
  EXPECT_FALSE(flash::keys_amortize_codes(p));
  p.segments = {{0, 0, 4096, 0, 4096}, {1, 0, 10, 0, 10}};
  EXPECT_TRUE(flash::keys_amortize_codes(p));
  p.segments.clear();
  EXPECT_FALSE(flash::keys_amortize_codes(p));
  // Mixed or f32 operands never take them by themselves.
  EXPECT_NE(flash::select_engine(nullptr, DType::BF16, ComputeDtype::f32, false).compute,
            ComputeDtype::int16);
}

TEST(Int16Lanes, OptionsAndTheirErrors) {
  AttentionConfig c = testing::layer_config("FLASH", 2, 2, 64);
  c.backend_options["compute_dtype"] = std::string("int16");
  const Tensor q = testing::random_tensor({1, 40, 2, 64}, DType::BF16, 1);
  const Tensor k = testing::random_tensor({1, 90, 2, 64}, DType::BF16, 2);
  const Tensor v = testing::random_tensor({1, 90, 2, 64}, DType::BF16, 3);
  Attention flash(c);
  const ForwardResult got = flash.forward(q.view(), k.view(), v.view(), {}, true);
  const std::string ran = flash.last_engine();
  EXPECT_EQ(named(ran).compute,
            int16_engines(false).empty() ? flash::ComputeDtype::f32 : flash::ComputeDtype::int16)
      << ran;
  c.backend_options["compute_dtype"] = std::string("int17");
  try {
    Attention bad(c);
    ADD_FAILURE() << "compute_dtype int17 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.field(), "compute_dtype");
    EXPECT_NE(std::string(e.what()).find("int16"), std::string::npos) << e.what();
  }
  // SAGE and VIDEO_SPARSE: qk_dtype int16 runs on the integer lanes (an emulated one by name
  // here, on every CPU), a pv_dtype other than auto / int16 is refused with it.
  for (const char* backend : {"SAGE", "VIDEO_SPARSE"}) {
    AttentionConfig s = testing::layer_config(backend, 2, 2, 64);
    s.backend_options["qk_dtype"] = std::string("int16");
    s.backend_options["isa"] = std::string("avx512_vnni_int16_emulated");
    Attention layer(s);
    const ForwardResult out = layer.forward(q.view(), k.view(), v.view(), {}, true);
    EXPECT_EQ(layer.last_engine(), "avx512_vnni_int16_emulated") << backend;
    AttentionConfig r = testing::layer_config("REFERENCE", 2, 2, 64);
    const ForwardResult want = Attention(r).forward(q.view(), k.view(), v.view(), {}, true);
    if (std::string(backend) == "SAGE") {  // VIDEO_SPARSE's default selects some blocks
      EXPECT_LE(testing::compare(out.out.view(), want.out.view()).normwise_rel, 1.6e-2);
    }
    s.backend_options["pv_dtype"] = std::string("int8");
    EXPECT_THROW(Attention{s}, InvalidArgument) << backend;
    s.backend_options.erase("pv_dtype");
    s.backend_options["qk_dtype"] = std::string("int4");
    try {
      Attention bad(s);
      ADD_FAILURE() << backend << " qk_dtype int4 accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.field(), "qk_dtype") << backend;
    }
  }
}

}  // namespace
}  // namespace dattn
