// FLASH-specific properties beyond the conformance suite: thread splits, plan reuse, scratch
// size, engines agreeing (the engine table, the ladder, compute_dtype, every engine the library
// lists against REFERENCE), the laser scale.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backends/flash/engines.hpp"
#include "backends/flash/kernels.hpp"
#include "backends/flash/tile_plan.hpp"
#include "core/prepare_call.hpp"
#include "dattn/attention.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/engines.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"
#include "test_inputs.hpp"

namespace dattn {
namespace {

using i64 = std::int64_t;
using testing::random_tensor;

AttentionConfig flash_config(i64 hq, i64 hkv, i64 d, bool causal) {
  return testing::layer_config("FLASH", hq, hkv, d, causal);
}

// FLASH's plan for a call of layer config `c` (head size and KV heads from it) with these
// backend options, as its impl makes it.
std::unique_ptr<Plan> flash_plan_for(const AttentionConfig& c, const AttentionInputs& in,
                                     double scale, const BackendOptions& options = {}) {
  const i64 hkv = c.num_kv_heads.value_or(c.num_heads);
  const auto call = detail::prepare_call(c, scale, hkv, in, {});
  ImplConfig ic;
  ic.num_heads = c.num_heads;
  ic.num_kv_heads = hkv;
  ic.head_size = c.head_size;
  ic.backend_kwargs = options;
  return Registry::global().find("FLASH")->make_impl(ic)->plan(call.problem);
}

TEST(Flash, IsThePlatformDefaultOnCpu) {
  AttentionConfig c = flash_config(2, 2, 64, false);
  c.backend = "";
  if (const char* env = std::getenv("DIFFUSION_ATTENTION_BACKEND"); env && *env)
    GTEST_SKIP() << "DIFFUSION_ATTENTION_BACKEND is set";
  EXPECT_EQ(Attention(c).backend().name(), "FLASH");
}

TEST(Flash, OneAndTwoThreadsAreBitwiseEqual) {
  auto q = random_tensor({2, 300, 4, 64}, DType::F32, 1),
       k = random_tensor({2, 300, 1, 64}, DType::F32, 2),
       v = random_tensor({2, 300, 1, 64}, DType::F32, 3);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = Attention(flash_config(4, 1, 64, true)).forward(q, k, v, {}, true);
  omp_set_num_threads(2);
  const auto two = Attention(flash_config(4, 1, 64, true)).forward(q, k, v, {}, true);
  omp_set_num_threads(saved);
  EXPECT_TRUE(testing::bitwise_equal(one.out, two.out));
  EXPECT_TRUE(testing::bitwise_equal(*one.lse, *two.lse));
}

TEST(Flash, APlanRunsAgainOnNewDataOfTheSameShapes) {
  const Attention layer(flash_config(2, 2, 80, true));
  for (std::uint32_t seed : {10u, 20u, 30u}) {
    auto q = random_tensor({1, 77, 2, 80}, DType::BF16, seed),
         k = random_tensor({1, 77, 2, 80}, DType::BF16, seed + 1),
         v = random_tensor({1, 77, 2, 80}, DType::BF16, seed + 2);
    const auto reused = layer.forward(q, k, v, {}, true);
    const auto fresh = Attention(flash_config(2, 2, 80, true)).forward(q, k, v, {}, true);
    EXPECT_TRUE(testing::bitwise_equal(reused.out, fresh.out)) << seed;
  }
}

// Every engine this CPU runs (bf16 inputs, so the bf16 engines plan their pair workspaces too):
// with items of 128 rows (a core's L2 under 1 MiB) the f32 engines stay within 256 KiB per
// thread (half of a 512 KiB L2) and avx512_bf16 within 256 KiB plus its workspace (Q and P as
// bf16 pairs: up to 64 KiB at D = 128; K and V live in the per-call panels); with 256 rows (1
// MiB of L2 or more) within twice that (512 KiB for the f32 engines: half of a 1 MiB L2); amx,
// whose work items have 256 rows and which keeps a key panel's logits and probabilities of 8
// tiles for them (800 KiB), within 1.25 MiB: the rest of the 2 MiB L2 of every CPU with AMX
// holds the 256 KiB panel it streams.
TEST(Flash, ScratchPerThreadStaysWithinTheEnginesL2BudgetUpToHeadSize128) {
  const std::size_t rows_factor = cpu_features().l2_bytes >= (1ll << 20) ? 2 : 1;
  for (const EngineInfo& engine : flash_engines()) {
    if (engine.unavailable_reason) continue;
    SCOPED_TRACE(engine.name);
    const bool amx = engine.name.starts_with("amx");
    // The 16-bit integer-lane engines keep Q's and P's codes as int16 pairs per item, as
    // avx512_bf16 keeps them as bf16 pairs (and 4 exact channels of Q in f32): its budget.
    const bool pairs = engine.compute_dtype == "bf16" || engine.compute_dtype == "int16";
    const std::size_t budget = amx     ? 1280u * 1024u
                               : pairs ? rows_factor * 352u * 1024u
                                       : rows_factor * 256u * 1024u;
    for (const auto& [hq, hkv] : {std::pair<i64, i64>{24, 24}, {28, 7}, {24, 1}})
      for (i64 d : {32, 64, 80, 96, 128}) {
        AttentionConfig c = flash_config(hq, hkv, d, false);
        auto q = Tensor::empty({1, 1000, hq, d}, DType::BF16),
             k = Tensor::empty({1, 1000, hkv, d}, DType::BF16);
        Tensor out = Tensor::empty({1, 1000, hq, d}, DType::BF16);
        const AttentionInputs in{q, k, k, nullptr, out, std::nullopt};
        const auto plan = flash_plan_for(c, in, 0.1, {{"isa", engine.name}});
        EXPECT_LE(plan->scratch_bytes_per_thread(), budget)
            << "H " << hq << ":" << hkv << " D " << d << ": " << plan->to_string();
      }
  }
}

// Rows per work item by engine and L2 (tile_plan.hpp): the tile-by-tile engines 128 under 1 MiB
// of L2 or when it is unknown, 256 from 1 MiB on; amx 256 whatever the L2. A plan on this CPU
// follows the CPU's own L2.
TEST(Flash, WorkItemRowsFollowTheEngineAndTheL2) {
  const flash::TileKernels& f32 = flash::avx512_kernels();
  EXPECT_EQ(flash::item_rows(f32, 0), 128);
  EXPECT_EQ(flash::item_rows(f32, 512 << 10), 128);
  EXPECT_EQ(flash::item_rows(f32, (1 << 20) - 1), 128);
  EXPECT_EQ(flash::item_rows(f32, 1 << 20), 256);
  EXPECT_EQ(flash::item_rows(f32, 2 << 20), 256);
  for (const flash::TileKernels* amx : {&flash::amx_kernels(), &flash::amx_emulated_kernels()}) {
    EXPECT_EQ(flash::item_rows(*amx, 512 << 10), 256);
    EXPECT_EQ(flash::item_rows(*amx, 2 << 20), 256);
  }
  EXPECT_EQ(flash::row_block(1, 256).rows_per_head, 256);
  EXPECT_EQ(flash::row_block(4, 256).rows_per_head, 64);
  EXPECT_EQ(flash::row_block(4, 256).heads, 4);

  AttentionConfig c = flash_config(2, 2, 64, false);
  auto q = Tensor::empty({1, 600, 2, 64}, DType::F32);
  Tensor out = Tensor::empty({1, 600, 2, 64}, DType::F32);
  const AttentionInputs in{q, q, q, nullptr, out, std::nullopt};
  const auto plan = flash_plan_for(c, in, 0.1, {{"isa", std::string("portable")}});
  const std::string want =
      cpu_features().l2_bytes >= (1ll << 20) ? "up to 256 rows" : "up to 128 rows";
  EXPECT_NE(plan->to_string().find(want), std::string::npos) << plan->to_string();
}

TEST(Flash, EveryF32EngineAgreesWithThePortableOne) {
  auto q = random_tensor({1, 131, 4, 96}, DType::F16, 4),
       k = random_tensor({1, 150, 2, 96}, DType::F16, 5),
       v = random_tensor({1, 150, 2, 96}, DType::F16, 6);
  AttentionConfig c = flash_config(4, 2, 96, true);
  c.backend_options["isa"] = std::string("portable");
  const auto base = Attention(c).forward(q, k, v, {}, true);
  for (const EngineInfo& e : flash_engines()) {
    if (e.compute_dtype != "f32" || e.name == "portable") continue;
    c.backend_options["isa"] = e.name;
    if (e.unavailable_reason) {
      EXPECT_THROW(Attention{c}, NotAvailable) << e.name;
      continue;
    }
    const auto got = Attention(c).forward(q, k, v, {}, true);
    EXPECT_LE(testing::compare(got.out.view(), base.out.view()).max_abs, 2e-3) << e.name;
    EXPECT_LE(testing::compare(got.lse->view(), base.lse->view()).max_abs, 1e-4) << e.name;
  }
  c.backend_options["isa"] = std::string("sse9");
  EXPECT_THROW(Attention{c}, InvalidArgument);
}

TEST(Flash, LaserScaleOfAPowerOfTwoIsBitExact) {
  auto q = random_tensor({1, 65, 2, 64}, DType::F32, 7, 30.0f),
       k = random_tensor({1, 65, 2, 64}, DType::F32, 8, 30.0f),
       v = random_tensor({1, 65, 2, 64}, DType::F32, 9);
  const Attention layer(flash_config(2, 2, 64, true));
  const auto plain = layer.forward(q, k, v, {}, true);
  AttentionMetadata m;
  m.extra.laser_input_scale = 16.0;
  const auto scaled = layer.forward(q, k, v, m, true);
  EXPECT_TRUE(testing::bitwise_equal(plain.out, scaled.out));
  EXPECT_TRUE(testing::bitwise_equal(*plain.lse, *scaled.lse));
}

TEST(Flash, LargeLogitsAndFullyMaskedRowsNeverGiveNaN) {
  // Logits of several thousand: the running max must keep exp2 in range.
  auto q = random_tensor({1, 40, 1, 32}, DType::F32, 10, 40.0f),
       k = random_tensor({1, 70, 1, 32}, DType::F32, 11, 40.0f),
       v = random_tensor({1, 70, 1, 32}, DType::F32, 12);
  Tensor mask = Tensor::empty({1, 1, 40, 70}, DType::F32);
  for (i64 n = 0; n < mask.numel(); ++n)
    mask.data_as<float>()[n] = (n / 70) % 3 == 0 ? -INFINITY : 0.0f;  // every third row hidden
  AttentionMetadata m;
  m.attn_mask = mask.view();
  const auto got = Attention(flash_config(1, 1, 32, false)).forward(q, k, v, m, true);
  AttentionConfig rc = flash_config(1, 1, 32, false);
  rc.backend = "REFERENCE";
  const auto want = Attention(rc).forward(q, k, v, m, true);
  const auto d = testing::compare(got.out.view(), want.out.view());
  EXPECT_FALSE(d.nan);
  EXPECT_LE(d.normwise_rel, 1e-5);
  EXPECT_EQ(got.lse->data_as<float>()[0], -INFINITY);
}

TEST(Flash, AKeyMaskBroadcastOverHeadsAndRowsIsReadPerKey) {
  // diffusers' [B, 1, 1, Skv] bool key masks arrive broadcast to [B, H, Sq, Skv] (strides 0):
  // read once per key, with the answer of the mask written out per (head, row) and of
  // REFERENCE; unlike SPEC's 2-D key padding no query row is padding (a row whose own key is
  // hidden is computed).
  const i64 B = 2, S = 150, H = 3, D = 40;
  auto q = random_tensor({B, S, H, D}, DType::F32, 21),
       k = random_tensor({B, S, H, D}, DType::F32, 22),
       v = random_tensor({B, S, H, D}, DType::F32, 23);
  Tensor keys = Tensor::empty({B, 1, 1, S}, DType::Bool);
  Tensor dense = Tensor::empty({B, H, S, S}, DType::Bool);
  auto* kb = keys.data_as<std::uint8_t>();
  for (i64 b = 0; b < B; ++b)
    for (i64 j = 0; j < S; ++j) kb[b * S + j] = b == 0 ? (j % 5 != 0) : (j < 70 && j % 3 != 1);
  auto* db = dense.data_as<std::uint8_t>();
  for (i64 n = 0; n < dense.numel(); ++n) db[n] = kb[(n / (H * S * S)) * S + n % S];
  const std::array<i64, 4> shape{B, H, S, S}, strides{S, 0, 0, 1};
  AttentionMetadata broadcast, written;
  broadcast.attn_mask = TensorView(keys.data(), DType::Bool, shape, strides);
  written.attn_mask = dense.view();
  AttentionConfig c = flash_config(H, H, D, false);
  const auto got = Attention(c).forward(q, k, v, broadcast, true);
  const auto per_row = Attention(c).forward(q, k, v, written, true);
  c.backend = "REFERENCE";
  const auto want = Attention(c).forward(q, k, v, written, true);
  EXPECT_LE(testing::compare(got.out.view(), want.out.view()).normwise_rel, 1e-5);
  EXPECT_LE(testing::compare(got.out.view(), per_row.out.view()).normwise_rel, 1e-6);
  // Row 0 of batch 0 hides its own key: it is computed, not zeroed.
  float norm = 0;
  for (i64 d = 0; d < D; ++d) norm += std::fabs(got.out.data_as<float>()[d]);
  EXPECT_GT(norm, 0.0f);
  // Garbage in the hidden keys (huge, NaN, inf) moves no row: they are packed as zeros.
  for (const float garbage : {1e4f, NAN, INFINITY, -INFINITY}) {
    Tensor k2 = Tensor::empty({B, S, H, D}, DType::F32),
           v2 = Tensor::empty({B, S, H, D}, DType::F32);
    std::copy_n(k.data_as<float>(), k.numel(), k2.data_as<float>());
    std::copy_n(v.data_as<float>(), v.numel(), v2.data_as<float>());
    for (i64 b = 0; b < B; ++b)
      for (i64 j = 0; j < S; ++j)
        if (!kb[b * S + j])
          for (i64 e = 0; e < H * D; ++e) {
            k2.data_as<float>()[(b * S + j) * H * D + e] = garbage;
            v2.data_as<float>()[(b * S + j) * H * D + e] = garbage;
          }
    c.backend = "FLASH";
    const auto poisoned = Attention(c).forward(q, k2, v2, broadcast, true);
    EXPECT_EQ(std::memcmp(poisoned.out.data(), got.out.data(), got.out.numel() * sizeof(float)), 0)
        << garbage;
  }
}

TEST(Flash, AnAdditiveMinusInfHidesWhateverTheLogitHolds) {
  // -inf in an additive mask hides the key even where the logit is NaN or inf (a NaN query):
  // a row whose keys are all hidden is zeros with LSE -inf (docs/semantics.md, "Finite masks
  // and non-finite inputs"), and the other rows do not move.
  const i64 S = 75, H = 2, D = 40;
  auto q = random_tensor({1, S, H, D}, DType::F32, 41),
       k = random_tensor({1, S, H, D}, DType::F32, 42),
       v = random_tensor({1, S, H, D}, DType::F32, 43);
  const auto padded = [](i64 i) { return i >= 60; };  // rows (and keys) 60.. are padding
  for (const DType mask_dtype : {DType::F32, DType::F16}) {
    Tensor mask = Tensor::empty({1, H, S, S}, mask_dtype);
    for (i64 h = 0; h < H; ++h)
      for (i64 i = 0; i < S; ++i)
        for (i64 j = 0; j < S; ++j) {
          const float x = padded(i) || padded(j) ? -INFINITY : 0.25f * float((i + j) % 3);
          const i64 at = (h * S + i) * S + j;
          if (mask_dtype == DType::F32)
            mask.data_as<float>()[at] = x;
          else
            mask.data_as<std::uint16_t>()[at] = f32_to_f16(x);
        }
    AttentionMetadata meta;
    meta.attn_mask = mask.view();
    AttentionConfig c = flash_config(H, H, D, false);
    const auto clean = Attention(c).forward(q, k, v, meta, true);
    Tensor q2 = Tensor::empty({1, S, H, D}, DType::F32);
    std::copy_n(q.data_as<float>(), q.numel(), q2.data_as<float>());
    for (i64 i = 60; i < S; ++i)
      for (i64 e = 0; e < H * D; ++e) q2.data_as<float>()[i * H * D + e] = e % 2 ? NAN : INFINITY;
    const auto poisoned = Attention(c).forward(q2, k, v, meta, true);
    c.backend = "REFERENCE";
    const auto want = Attention(c).forward(q2, k, v, meta, true);
    EXPECT_EQ(std::memcmp(poisoned.out.data(), clean.out.data(), clean.out.numel() * sizeof(float)),
              0)
        << dtype_name(mask_dtype);
    EXPECT_LE(testing::compare(poisoned.out.view(), want.out.view()).normwise_rel, 1e-5);
    for (i64 h = 0; h < H; ++h)
      for (i64 i = 60; i < S; ++i) {
        EXPECT_EQ(poisoned.lse->data_as<float>()[h * S + i], -INFINITY) << h << " " << i;
        for (i64 e = 0; e < D; ++e)
          EXPECT_EQ(poisoned.out.data_as<float>()[(i * H + h) * D + e], 0.0f);
      }
  }
}

TEST(Flash, KeysADenseMaskHidesFromEveryRowAreHarmless) {
  // An additive (-inf) or bool 4-D mask that hides some keys from every row of every query head
  // of their KV head (ggml's key padding, a padded text tail): NaN or inf in their K or V moves
  // no row (docs/semantics.md, "Finite masks and non-finite inputs"; keys hidden from some rows
  // only: FlashEngine.NonFiniteValuesReachOnlyTheRowsThatSeeThem).
  const i64 B = 2, S = 131, Hq = 4, Hkv = 2, D = 48;
  auto q = random_tensor({B, S, Hq, D}, DType::F32, 31),
       k = random_tensor({B, S, Hkv, D}, DType::F32, 32),
       v = random_tensor({B, S, Hkv, D}, DType::F32, 33);
  // Key j of batch b, KV head g is hidden from all rows when hidden_all(b, g, j).
  auto hidden_all = [](i64 b, i64 g, i64 j) { return j >= S - 9 - 4 * b || (j + g) % 7 == 3; };
  for (const DType mask_dtype : {DType::F16, DType::F32, DType::Bool}) {
    Tensor mask = Tensor::empty({B, Hq, S, S}, mask_dtype);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> bias(-1.0f, 0.5f);
    for (i64 b = 0; b < B; ++b)
      for (i64 h = 0; h < Hq; ++h)
        for (i64 i = 0; i < S; ++i)
          for (i64 j = 0; j < S; ++j) {
            const i64 at = ((b * Hq + h) * S + i) * S + j;
            const bool hide = hidden_all(b, h / (Hq / Hkv), j) || (i * 3 + j) % 13 == 0;
            if (mask_dtype == DType::Bool)
              mask.data_as<std::uint8_t>()[at] = hide ? 0 : 1;
            else if (mask_dtype == DType::F32)
              mask.data_as<float>()[at] = hide ? -INFINITY : bias(rng);
            else
              mask.data_as<std::uint16_t>()[at] = f32_to_f16(hide ? -INFINITY : bias(rng));
          }
    AttentionMetadata meta;
    meta.attn_mask = mask.view();
    AttentionConfig c = flash_config(Hq, Hkv, D, false);
    const auto clean = Attention(c).forward(q, k, v, meta, true);
    c.backend = "REFERENCE";
    const auto want = Attention(c).forward(q, k, v, meta, true);
    EXPECT_LE(testing::compare(clean.out.view(), want.out.view()).normwise_rel, 1e-5);
    c.backend = "FLASH";
    for (const float garbage : {6e4f, NAN, INFINITY}) {
      Tensor k2 = Tensor::empty({B, S, Hkv, D}, DType::F32),
             v2 = Tensor::empty({B, S, Hkv, D}, DType::F32);
      std::copy_n(k.data_as<float>(), k.numel(), k2.data_as<float>());
      std::copy_n(v.data_as<float>(), v.numel(), v2.data_as<float>());
      for (i64 b = 0; b < B; ++b)
        for (i64 j = 0; j < S; ++j)
          for (i64 g = 0; g < Hkv; ++g)
            if (hidden_all(b, g, j))
              for (i64 e = 0; e < D; ++e) {
                k2.data_as<float>()[((b * S + j) * Hkv + g) * D + e] = garbage;
                v2.data_as<float>()[((b * S + j) * Hkv + g) * D + e] = garbage;
              }
      const auto poisoned = Attention(c).forward(q, k2, v2, meta, true);
      EXPECT_EQ(
          std::memcmp(poisoned.out.data(), clean.out.data(), clean.out.numel() * sizeof(float)), 0)
          << dtype_name(mask_dtype) << " " << garbage;
    }
  }
}

}  // namespace
}  // namespace dattn

namespace dattn {
namespace {

TEST(FlashKernels, StoreRowRoundsLikeTheScalarConversions) {
  std::vector<float> src;
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 100.0f);
  for (int n = 0; n < 4000; ++n) src.push_back(dist(rng));
  // Ties, infinities, NaN, subnormals, the edges of f16.
  for (float x : {1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8), INFINITY, -INFINITY,
                  NAN, 1e-40f, 65504.0f, 65520.0f, -0.0f, 3.0e-8f})
    src.push_back(x);
  for (const flash::Engine& engine : flash::engines()) {
    if (!engine.available()) continue;
    const flash::TileKernels& k = engine.kernels();
    for (DType dt : {DType::BF16, DType::F16}) {
      std::vector<std::uint16_t> got(src.size()), want(src.size());
      k.rows_io.store_row(src.data(), 1.0f, std::int64_t(src.size()), dt, got.data());
      for (std::size_t n = 0; n < src.size(); ++n)
        want[n] = dt == DType::BF16 ? f32_to_bf16(src[n]) : f32_to_f16(src[n]);
      for (std::size_t n = 0; n < src.size(); ++n) {
        if (std::isnan(src[n])) {
          EXPECT_TRUE(std::isnan(load_as_f32(got.data(), dt, std::int64_t(n))));
          continue;
        }
        ASSERT_EQ(got[n], want[n]) << engine.name << " " << dtype_name(dt) << " " << src[n];
      }
    }
  }
}

}  // namespace
}  // namespace dattn

namespace dattn {
namespace {

// Fewer query blocks than threads: the key range is split across threads and the partial
// results merged by LSE.
TEST(Flash, SplitKvMatchesReference) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  struct Case {
    i64 sq, skv, hq, hkv;
    bool causal;
    bool mask;
  };
  for (const Case& c : {Case{5, 1000, 1, 1, false, false}, Case{7, 777, 4, 1, true, false},
                        Case{3, 1200, 2, 1, false, true}, Case{1, 65, 1, 1, true, true}}) {
    SCOPED_TRACE("Sq " + std::to_string(c.sq) + " Skv " + std::to_string(c.skv));
    auto q = testing::random_tensor({1, c.sq, c.hq, 64}, DType::F32, 1),
         k = testing::random_tensor({1, c.skv, c.hkv, 64}, DType::F32, 2),
         v = testing::random_tensor({1, c.skv, c.hkv, 64}, DType::F32, 3);
    AttentionMetadata m;
    Tensor mask;
    if (c.mask) {
      mask = testing::bool_tensor({1, c.skv}, 4, 0.5);
      m.attn_mask = mask.view();
    }
    AttentionConfig fc = flash_config(c.hq, c.hkv, 64, c.causal);
    fc.role = AttentionRole::cross;
    // The plan really splits.
    {
      Tensor out = Tensor::empty({1, c.sq, c.hq, 64}, DType::F32);
      const AttentionInputs in{q, k, v, &m, out, std::nullopt};
      const auto plan = flash_plan_for(fc, in, 0.125);
      EXPECT_NE(plan->to_string().find("split-KV"), std::string::npos) << plan->to_string();
    }
    const auto got = Attention(fc).forward(q, k, v, m, true);
    AttentionConfig rc = fc;
    rc.backend = "REFERENCE";
    const auto want = Attention(rc).forward(q, k, v, m, true);
    const auto d = testing::compare(got.out.view(), want.out.view());
    EXPECT_FALSE(d.nan);
    EXPECT_LE(d.normwise_rel, 1e-5);
    EXPECT_LE(testing::compare(got.lse->view(), want.lse->view()).max_abs, 1e-4);
  }
  omp_set_num_threads(saved);
}

// An answer does not depend on the thread count: the split-KV cut (and every other choice of the
// plan) is the problem's, so 1, 2 and 3 threads give the same bits on FLASH and on SAGE with
// each P.V (whose 8- and 16-bit P are rounded against the online softmax's reference, which a
// cut moves), for short queries against long keys (split) and a long self-attention (not).
TEST(Flash, AnswersDoNotDependOnTheThreadCount) {
  const int saved = omp_get_max_threads();
  struct Case {
    i64 sq, skv, hq, hkv;
  };
  for (const Case& c : {Case{5, 2000, 1, 1}, Case{16, 4096, 2, 1}, Case{300, 300, 2, 2}}) {
    SCOPED_TRACE("Sq " + std::to_string(c.sq) + " Skv " + std::to_string(c.skv));
    const auto q = testing::random_tensor({1, c.sq, c.hq, 64}, DType::F32, 11),
               k = testing::random_tensor({1, c.skv, c.hkv, 64}, DType::F32, 12),
               v = testing::random_tensor({1, c.skv, c.hkv, 64}, DType::F32, 13);
    std::vector<std::pair<std::string, AttentionConfig>> configs{
        {"FLASH", flash_config(c.hq, c.hkv, 64, false)}};
    for (const char* pv : {"auto", "bf16", "f32", "int8"}) {
      AttentionConfig sc = testing::layer_config("SAGE", c.hq, c.hkv, 64, false);
      sc.backend_options["pv_dtype"] = std::string(pv);
      configs.emplace_back(std::string("SAGE pv_dtype=") + pv, sc);
    }
    for (const auto& [name, config] : configs) {
      SCOPED_TRACE(name);
      std::optional<Attention> layer;
      try {
        layer.emplace(config);
      } catch (const NotAvailable&) {
        continue;  // a pv_dtype this CPU's engine lacks
      }
      std::vector<std::vector<double>> outs;
      for (const int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        const auto r = layer->forward(q.view(), k.view(), v.view(), {}, true);
        std::vector<double> o = testing::to_vector(r.out.view());
        const std::vector<double> lse = testing::to_vector(r.lse->view());
        o.insert(o.end(), lse.begin(), lse.end());
        outs.push_back(std::move(o));
      }
      omp_set_num_threads(saved);
      for (std::size_t t = 1; t < outs.size(); ++t)
        for (std::size_t n = 0; n < outs[0].size(); ++n)
          ASSERT_EQ(outs[t][n], outs[0][n]) << "threads " << t + 1 << " element " << n;
    }
  }
  omp_set_num_threads(saved);
}

}  // namespace
}  // namespace dattn

namespace dattn {
namespace {

// Joint rows are read where they live, so they may have their own dtype and strides.
TEST(Flash, JointRowsOfAnotherDtypeMatchReference) {
  auto q = testing::random_tensor({2, 41, 4, 64}, DType::BF16, 1),
       k = testing::random_tensor({2, 41, 2, 64}, DType::BF16, 2),
       v = testing::random_tensor({2, 41, 2, 64}, DType::BF16, 3);
  auto jq = testing::random_tensor({2, 9, 4, 64}, DType::F32, 4),
       jk = testing::random_tensor({2, 9, 2, 64}, DType::F32, 5),
       jv = testing::random_tensor({2, 9, 2, 64}, DType::F32, 6);
  for (JointStrategy js : {JointStrategy::front, JointStrategy::rear}) {
    AttentionMetadata m;
    m.joint_query = jq.view();
    m.joint_key = jk.view();
    m.joint_value = jv.view();
    m.joint_strategy = js;
    AttentionConfig c = flash_config(4, 2, 64, true);
    const auto got = Attention(c).forward(q, k, v, m, true);
    // REFERENCE on one f32 concatenation built by hand.
    const bool front = js == JointStrategy::front;
    const auto cat = [&](const Tensor& local, const Tensor& joint) {
      Tensor t = Tensor::empty({2, 50, local.shape()[2], 64}, DType::F32);
      copy_into(joint.view(), t.view().sliced(1, front ? 0 : 41, 9));
      copy_into(local.view(), t.view().sliced(1, front ? 9 : 0, 41));
      return t;
    };
    c.backend = "REFERENCE";
    const auto want = Attention(c).forward(cat(q, jq), cat(k, jk), cat(v, jv), {}, true);
    EXPECT_LE(testing::compare(got.out.view(), want.out.view()).normwise_rel, 1.6e-2);
    EXPECT_LE(testing::compare(got.lse->view(), want.lse->view()).max_abs, 1e-4);
  }
}

}  // namespace
}  // namespace dattn

namespace dattn {
namespace {

TEST(EmptyShapes, ZeroBatchAndZeroQueryRowsRunOnEveryBackend) {
  for (const auto& backend : Registry::global().names()) {
    SCOPED_TRACE(backend);
    AttentionConfig c = flash_config(2, 1, 16, true);
    c.causal = Registry::global().find(backend)->supports_causal();
    c.backend = backend;
    const Attention layer(c);
    for (const auto& [b, sq, skv] : {std::tuple<i64, i64, i64>{0, 5, 5}, {2, 0, 7}, {1, 0, 0}}) {
      auto q = testing::random_tensor({b, sq, 2, 16}, DType::F32, 1),
           k = testing::random_tensor({b, skv, 1, 16}, DType::F32, 2),
           v = testing::random_tensor({b, skv, 1, 16}, DType::F32, 3);
      const auto r = layer.forward(q, k, v, {}, true);
      EXPECT_EQ(r.out.numel(), b * sq * 2 * 16);
    }
  }
}

}  // namespace
}  // namespace dattn

namespace dattn {
namespace {

// K/V panels larger than one wave's budget (64 MiB): the groups are packed and run in several
// waves, each reusing the panel buffer; every group still reads its own keys. 4 KV heads x 65536
// keys of D 24 are 80-92 MiB of f32 panels on every f32 engine (padded strides); a key-padding
// mask hides a tenth of the keys.
TEST(Flash, PanelsInSeveralWavesMatchReference) {
  const i64 sq = 3, skv = 65536, hq = 8, hkv = 4, d = 24;
  auto q = testing::random_tensor({1, sq, hq, d}, DType::F32, 1),
       k = testing::random_tensor({1, skv, hkv, d}, DType::F32, 2),
       v = testing::random_tensor({1, skv, hkv, d}, DType::F32, 3);
  Tensor keep = testing::bool_tensor({1, skv}, 4, 0.9);
  AttentionMetadata m;
  m.attn_mask = keep.view();
  AttentionConfig fc = flash_config(hq, hkv, d, false);
  fc.role = AttentionRole::cross;
  {
    Tensor out = Tensor::empty({1, sq, hq, d}, DType::F32);
    const AttentionInputs in{q, k, v, &m, out, std::nullopt};
    const std::string plan = flash_plan_for(fc, in, 0.2)->to_string();
    EXPECT_EQ(plan.find(" in 1 wave(s)"), std::string::npos) << plan;
    EXPECT_NE(plan.find(" wave(s)"), std::string::npos) << plan;
  }
  const auto got = Attention(fc).forward(q, k, v, m, true);
  AttentionConfig rc = fc;
  rc.backend = "REFERENCE";
  const auto want = Attention(rc).forward(q, k, v, m, true);
  const auto diff = testing::compare(got.out.view(), want.out.view());
  EXPECT_FALSE(diff.nan);
  EXPECT_LE(diff.normwise_rel, 1e-5);
  EXPECT_LE(testing::compare(got.lse->view(), want.lse->view()).max_abs, 1e-4);
}

// The plan description of a FLASH call with these options, which names the engine that runs it.
std::string flash_plan(const BackendOptions& options, DType dtype, i64 hq = 2, i64 hkv = 1,
                       i64 d = 64) {
  AttentionConfig c = flash_config(hq, hkv, d, false);
  auto q = Tensor::empty({1, 40, hq, d}, dtype), k = Tensor::empty({1, 40, hkv, d}, dtype);
  Tensor out = Tensor::empty({1, 40, hq, d}, dtype);
  const AttentionInputs in{q, k, k, nullptr, out, std::nullopt};
  return flash_plan_for(c, in, 0.125, options)->to_string();
}

// The engine row called `name`, whether or not this CPU can run it (engine_named refuses those).
const flash::Engine& engine(std::string_view name) {
  for (const flash::Engine& e : flash::engines())
    if (e.name == name) return e;
  throw std::out_of_range("no FLASH engine " + std::string(name));
}

bool engine_available(std::string_view name) {
  for (const flash::Engine& e : flash::engines())
    if (e.name == name) return e.available();
  return false;
}

bool runs_on(const std::string& plan, std::string_view engine) {
  return plan.find("engine " + std::string(engine) + " ") != std::string::npos;
}

TEST(FlashEngines, TheTableListsTheLadderAndTheEmulatedTwins) {
  const std::vector<EngineInfo> engines = flash_engines();
  std::vector<std::string> names;
  for (const EngineInfo& e : engines) names.push_back(e.name);
  for (const char* want : {"portable",
                           "avx2",
                           "avx512",
                           "avx512_bf16",
                           "avx512_bf16_emulated",
                           "amx",
                           "amx_emulated",
                           "portable_int8",
                           "avx2_int8",
                           "avx2_int8_emulated",
                           "avx_vnni",
                           "avx_vnni_emulated",
                           "avx512_vnni",
                           "avx512_vnni_emulated",
                           "avx2_int16",
                           "avx2_int16_emulated",
                           "avx_vnni_int16",
                           "avx_vnni_int16_emulated",
                           "avx512_vnni_int16",
                           "avx512_vnni_int16_emulated",
                           "neon",
                           "sve",
                           "neon_bf16",
                           "neon_bf16_emulated",
                           "neon_dotprod",
                           "neon_dotprod_emulated",
                           "neon_i8mm",
                           "neon_i8mm_emulated"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
  for (std::size_t i = 1; i < engines.size(); ++i)
    EXPECT_LE(engines[i - 1].rank, engines[i].rank) << engines[i].name;
  for (const EngineInfo& e : engines) {
    EXPECT_TRUE(e.compute_dtype == "f32" || e.compute_dtype == "bf16" ||
                e.compute_dtype == "int8" || e.compute_dtype == "int16")
        << e.name;
    if (e.emulated || e.name == "portable" || e.name == "portable_int8") {
      EXPECT_FALSE(e.unavailable_reason.has_value()) << e.name << " must run everywhere";
    }
    if (e.unavailable_reason) {
      EXPECT_FALSE(e.unavailable_reason->empty()) << e.name;
    }
  }
}

// The ladder: a cap, the input dtype and compute_dtype pick the engine; an emulated engine only
// by its name; a cap the CPU lacks is NotAvailable.
TEST(FlashEngines, TheCapDtypeAndComputeDtypePickTheEngine) {
  using flash::ComputeDtype;
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (ComputeDtype c : {ComputeDtype::f32, ComputeDtype::bf16}) {
      const flash::Engine& e = flash::select_engine(nullptr, dt, c);
      EXPECT_FALSE(e.emulated) << "an emulated engine was chosen automatically";
      EXPECT_TRUE(e.available());
      if (dt != DType::BF16 && c == ComputeDtype::f32) {
        EXPECT_EQ(e.compute, ComputeDtype::f32);
      }
    }
  const flash::Engine& emulated = flash::engine_named("avx512_bf16_emulated", "isa");
  EXPECT_EQ(&flash::select_engine(&emulated, DType::BF16, ComputeDtype::f32), &emulated);
  EXPECT_EQ(&flash::select_engine(&emulated, DType::F32, ComputeDtype::bf16), &emulated);
  EXPECT_EQ(&flash::select_engine(&emulated, DType::F16, ComputeDtype::bf16), &emulated);
  // Exact calls under the emulated cap run the best f32 engine this CPU has.
  const flash::Engine& best_f32 = flash::select_engine(nullptr, DType::F32, ComputeDtype::f32);
  EXPECT_EQ(&flash::select_engine(&emulated, DType::F32, ComputeDtype::f32), &best_f32);
  EXPECT_EQ(&flash::select_engine(&emulated, DType::F16, ComputeDtype::f32), &best_f32);

  // Through the backend options: isa avx2 with bf16 inputs and the exact default runs avx2.
  if (engine_available("avx2")) {
    EXPECT_TRUE(runs_on(flash_plan({{"isa", std::string("avx2")}}, DType::BF16), "avx2"));
    EXPECT_TRUE(
        runs_on(flash_plan({{"isa", std::string("avx2")}, {"compute_dtype", std::string("bf16")}},
                           DType::F32),
                "avx2"));
  }
  EXPECT_TRUE(runs_on(flash_plan({{"isa", std::string("avx512_bf16_emulated")}}, DType::BF16),
                      "avx512_bf16_emulated"));
  EXPECT_TRUE(runs_on(flash_plan({{"isa", std::string("avx512_bf16_emulated")},
                                  {"compute_dtype", std::string("bf16")}},
                                 DType::F32),
                      "avx512_bf16_emulated"));
  EXPECT_TRUE(runs_on(flash_plan({{"isa", std::string("avx512_bf16_emulated")}}, DType::F32),
                      best_f32.name));
  EXPECT_FALSE(flash_plan({}, DType::BF16).find("emulated") != std::string::npos);

  // Naming an engine this CPU lacks is NotAvailable, with the reason.
  for (const flash::Engine& e : flash::engines()) {
    if (e.available()) continue;
    AttentionConfig c = flash_config(2, 1, 64, false);
    c.backend_options["isa"] = std::string(e.name);
    try {
      Attention layer(c);
      ADD_FAILURE() << e.name << " accepted on a CPU that lacks it";
    } catch (const NotAvailable& err) {
      EXPECT_EQ(err.field(), "isa");
      EXPECT_NE(std::string(err.what()).find(*e.unavailable()), std::string::npos) << err.what();
    }
  }
}

// Without compute_dtype bf16, a bf16 engine serves only calls whose every operand is bf16: bf16
// Q, K and V with f32 joint rows (or quantized K/V) run on an f32 engine, exactly.
// The sve engine runs wherever this build has its vector length (128, 256 and 512 bits); it
// serves automatic f32 calls where its vectors are longer than NEON's, and at 128 bits (the
// same four lanes) only by name, neon serving the rest. Runs under qemu at each length.
TEST(FlashEngines, SveServesAutomaticCallsWhereItsVectorsOutgrowNeons) {
  using flash::ComputeDtype;
  const flash::Engine& sve = engine("sve");
  const int bits = cpu_features().sve_bits;
  if (!cpu_features().sve) {
    EXPECT_TRUE(sve.unavailable().has_value());
    GTEST_SKIP() << "this CPU lacks SVE";
  }
  EXPECT_EQ(sve.available(), bits == 128 || bits == 256 || bits == 512) << bits;
  if (!sve.available()) {
    EXPECT_NE(sve.unavailable()->find(std::to_string(bits) + " bits"), std::string::npos)
        << *sve.unavailable();
    GTEST_SKIP() << *sve.unavailable();
  }
  EXPECT_EQ(&flash::select_engine(&sve, DType::F32, ComputeDtype::f32), &sve);
  EXPECT_EQ(&flash::select_engine(&sve, DType::BF16, ComputeDtype::f32), &sve);
  for (const DType dt : {DType::F32, DType::F16}) {
    const flash::Engine& chosen = flash::select_engine(nullptr, dt, ComputeDtype::f32);
    EXPECT_EQ(chosen.name, bits > 128 ? "sve" : "neon") << bits << " bits, " << dtype_name(dt);
  }
  // A cap above sve (neon_bf16, rank 3) on f32 inputs at 128 bits still comes down to neon.
  const flash::Engine& above = flash::engine_named("neon_bf16_emulated", "isa");
  EXPECT_EQ(flash::select_engine(&above, DType::F32, ComputeDtype::f32).name,
            bits > 128 ? "sve" : "neon");
}

TEST(FlashEngines, Bf16EnginesServeAllBf16OperandsOnly) {
  const auto q = testing::random_tensor({1, 30, 2, 32}, DType::BF16, 1),
             k = testing::random_tensor({1, 30, 2, 32}, DType::BF16, 2),
             v = testing::random_tensor({1, 30, 2, 32}, DType::BF16, 3),
             jk = testing::random_tensor({1, 5, 2, 32}, DType::F32, 4);
  const auto problem = [&](bool joint_f32, KvCacheDtype kv) {
    AttentionMetadata m;
    if (joint_f32) {
      m.joint_query = jk.view();
      m.joint_key = jk.view();
      m.joint_value = jk.view();
    }
    AttentionConfig c = flash_config(2, 2, 32, false);
    c.kv_cache_dtype = kv;
    Tensor out = Tensor::empty({1, joint_f32 ? 35 : 30, 2, 32}, DType::BF16);
    const AttentionInputs in{q, k, v, &m, out, std::nullopt};
    return detail::prepare_call(c, 0.125, 2, in, {}).problem;
  };
  EXPECT_EQ(flash::operand_dtype(problem(false, KvCacheDtype::unquantized)), DType::BF16);
  EXPECT_EQ(flash::operand_dtype(problem(true, KvCacheDtype::unquantized)), DType::F32);
  EXPECT_EQ(flash::operand_dtype(problem(false, KvCacheDtype::int8)), DType::F32);
  const flash::Engine& cap = flash::engine_named("amx_emulated", "isa");
  EXPECT_EQ(
      flash::select_engine(&cap, flash::operand_dtype(problem(true, KvCacheDtype::unquantized)),
                           flash::ComputeDtype::f32)
          .compute,
      flash::ComputeDtype::f32);
}

TEST(FlashEngines, ComputeDtypeIsValidated) {
  AttentionConfig c = flash_config(2, 1, 64, false);
  for (const char* ok : {"f32", "bf16", "BF16"}) {
    c.backend_options["compute_dtype"] = std::string(ok);
    EXPECT_NO_THROW(Attention{c}) << ok;
  }
  for (const OptionValue& bad : {OptionValue(std::string("fp8")), OptionValue(std::int64_t{16})}) {
    c.backend_options["compute_dtype"] = bad;
    try {
      Attention layer(c);
      ADD_FAILURE() << "a bad compute_dtype was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.field(), "compute_dtype");
      EXPECT_NE(std::string(e.what()).find("f32"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
    }
  }
}

// Every engine the library lists, forced by name, against REFERENCE: GQA, causal, additive
// masks hiding keys, odd head sizes, lengths that are no multiple of any tile, several work
// items per head. Engines the CPU lacks skip with the reason.
class FlashEngine : public ::testing::TestWithParam<std::string> {};

// The engine the library lists under `name` (an empty EngineInfo if none).
EngineInfo engine_info(const std::string& name) {
  for (const EngineInfo& e : flash_engines())
    if (e.name == name) return e;
  return EngineInfo{};
}

struct EngineCase {
  i64 hq, hkv, d, sq, skv;
  bool causal, mask;
  std::optional<double> scale = std::nullopt;  // default head_size^-0.5
};

TEST_P(FlashEngine, MatchesReference) {
  const EngineInfo info = engine_info(GetParam());
  ASSERT_EQ(info.name, GetParam());
  if (info.unavailable_reason) GTEST_SKIP() << info.name << ": " << *info.unavailable_reason;
  const bool bf16_engine = info.compute_dtype == "bf16";
  // SAGE's engines (8-bit Q.K^T) run under the SAGE backend, at its accuracy (test_sage.cpp).
  const bool int8_engine = info.compute_dtype == "int8";
  // The 16-bit integer-lane engines, named as the cap, compute every call (13-bit codes).
  const bool int16_engine = info.compute_dtype == "int16";
  const std::vector<EngineCase> cases{{4, 2, 59, 77, 131, false, false},
                                      {3, 1, 64, 100, 100, true, false},
                                      {2, 2, 80, 45, 97, false, true},
                                      {2, 1, 59, 130, 67, true, true},
                                      {1, 1, 128, 33, 200, false, false},
                                      // Key panels of several tiles with a short one inside
                                      // and at the end; a negative and a zero scale (the
                                      // order of the logits turned round; all equal).
                                      {2, 1, 48, 70, 300, true, true, -0.2},
                                      {1, 1, 32, 40, 260, false, false, 0.0},
                                      {3, 3, 64, 65, 577, false, false}};
  // (inputs, compute_dtype) pairs this engine serves when forced by name.
  std::vector<std::pair<DType, std::string>> runs;
  if (bf16_engine)
    runs = {{DType::BF16, "f32"}, {DType::F32, "bf16"}, {DType::F16, "bf16"}};
  else
    runs = {{DType::F32, "f32"}, {DType::BF16, "f32"}, {DType::F16, "f32"}};
  std::uint32_t seed = 100;
  for (const EngineCase& ec : cases)
    for (const auto& [dt, compute] : runs) {
      const std::string what =
          info.name + " " + std::string(dtype_name(dt)) + " compute " + compute + " H" +
          std::to_string(ec.hq) + "x" + std::to_string(ec.hkv) + " D" + std::to_string(ec.d) + " " +
          std::to_string(ec.sq) + "x" + std::to_string(ec.skv) + (ec.causal ? " causal" : "") +
          (ec.mask ? " mask" : "") + (ec.scale ? " scale " + std::to_string(*ec.scale) : "");
      auto q = random_tensor({1, ec.sq, ec.hq, ec.d}, dt, seed++),
           k = random_tensor({1, ec.skv, ec.hkv, ec.d}, dt, seed++),
           v = random_tensor({1, ec.skv, ec.hkv, ec.d}, dt, seed++);
      Tensor mask = Tensor::empty({1, ec.hq, ec.sq, ec.skv}, DType::F32);
      AttentionMetadata m;
      if (ec.mask) {
        std::mt19937 rng(seed++);
        std::uniform_real_distribution<float> u(-2.0f, 2.0f);
        for (i64 n = 0; n < mask.numel(); ++n)  // every fifth key hidden, the rest biased
          mask.data_as<float>()[n] = (n % ec.skv) % 5 == 3 ? -INFINITY : u(rng);
        m.attn_mask = mask.view();
      }
      AttentionConfig c = flash_config(ec.hq, ec.hkv, ec.d, ec.causal);
      c.softmax_scale = ec.scale;
      c.backend_options["isa"] = info.name;
      if (int8_engine)
        c.backend = "SAGE";
      else
        c.backend_options["compute_dtype"] = compute;
      const auto got = Attention(c).forward(q, k, v, m, true);
      c.backend = "REFERENCE";
      c.backend_options.clear();
      const auto want = Attention(c).forward(q, k, v, m, true);
      const auto d = testing::compare(got.out.view(), want.out.view());
      const double tol = int8_engine         ? 2e-2
                         : int16_engine      ? std::max(5e-3, testing::tolerance_for(dt))
                         : !bf16_engine      ? testing::tolerance_for(dt)
                         : dt == DType::BF16 ? testing::tolerance_for(DType::BF16)
                                             : 1e-2;
      EXPECT_FALSE(d.nan) << what;
      EXPECT_LE(d.normwise_rel, tol) << what;
      // f32 inputs on a bf16 engine: the operands were rounded, so the error cannot be f32's.
      if (bf16_engine && dt == DType::F32) {
        EXPECT_GT(d.normwise_rel, 1e-5) << what;
      }
      const auto l = testing::compare(got.lse->view(), want.lse->view());
      EXPECT_FALSE(l.nan) << what;
      EXPECT_LE(l.max_abs, int8_engine                       ? 5e-2
                           : int16_engine                    ? 2e-2
                           : bf16_engine || dt != DType::F32 ? 1e-2
                                                             : 1e-4)
          << what;
      for (i64 n = 0; n < got.out.numel(); ++n)
        ASSERT_FALSE(std::isnan(load_as_f32(got.out.data(), got.out.dtype(), n))) << what;
    }
}

// A NaN or inf in the V row of a key reaches only the rows that see that key (docs/semantics.md,
// "Finite masks and non-finite inputs"): those rows are NaN with LSE NaN, as REFERENCE gives,
// and every row the key is hidden from (causal, a 4-D mask hiding it from some rows only, keys
// past valid_kv_length) keeps the bits it has with clean values, on every engine (SAGE's under
// SAGE), over several tiles, a short last tile and split-KV. 0 x NaN would have made them NaN.
TEST_P(FlashEngine, NonFiniteValuesReachOnlyTheRowsThatSeeThem) {
  const EngineInfo info = engine_info(GetParam());
  ASSERT_EQ(info.name, GetParam());
  if (info.unavailable_reason) GTEST_SKIP() << info.name << ": " << *info.unavailable_reason;
  const bool bf16_engine = info.compute_dtype == "bf16";
  const bool int8_engine = info.compute_dtype == "int8";
  // The 16-bit integer-lane engines, named as the cap, compute every call (13-bit codes).
  const bool int16_engine = info.compute_dtype == "int16";
  const DType dt = bf16_engine ? DType::BF16 : DType::F32;
  struct Case {
    i64 sq, skv;
    bool causal;
    std::vector<i64> bad;  // keys whose V row (of KV head 0) gets garbage
  };
  // 150 x 150 causal: key 40 is seen by rows 40.., 70 by rows 70.. that the mask lets see it,
  // 149 by the last row only; 5 x 700 (split-KV): key 300 is hidden from rows 0-2 by the mask.
  for (const Case& cs : {Case{150, 150, true, {40, 70, 149}}, Case{5, 700, false, {300, 699}}}) {
    const i64 H = 2, Hkv = 1, D = 40;
    auto q = random_tensor({1, cs.sq, H, D}, dt, 901),
         k = random_tensor({1, cs.skv, Hkv, D}, dt, 902),
         v = random_tensor({1, cs.skv, Hkv, D}, dt, 903);
    // Additive: -inf hides key 70 from rows 100-119 of head 1, key 300 from rows 0-2 of both
    // heads, every 7th key from rows i % 3 == 0; the rest a bias.
    Tensor mask = Tensor::empty({1, H, cs.sq, cs.skv}, DType::F32);
    const auto hidden = [&](i64 h, i64 i, i64 j) {
      return (j == 70 && h == 1 && i >= 100 && i < 120) || (j == 300 && i < 3) ||
             (j % 7 == 0 && i % 3 == 0);
    };
    for (i64 h = 0; h < H; ++h)
      for (i64 i = 0; i < cs.sq; ++i)
        for (i64 j = 0; j < cs.skv; ++j)
          mask.data_as<float>()[(h * cs.sq + i) * cs.skv + j] =
              hidden(h, i, j) ? -INFINITY : 0.1f * float((i + 2 * j) % 5);
    const i64 valid = cs.causal ? cs.skv : cs.skv - 1;  // without causal the last key is cut
    const auto sees = [&](i64 h, i64 i, i64 j) {
      const i64 pos = cs.skv - cs.sq + i;
      return !(cs.causal && j > pos) && !hidden(h, i, j) && j < valid;
    };
    AttentionMetadata m;
    m.attn_mask = mask.view();
    if (!cs.causal) m.extra.valid_kv_length = valid;
    AttentionConfig c = flash_config(H, Hkv, D, cs.causal);
    c.backend_options["isa"] = info.name;
    if (int8_engine) c.backend = "SAGE";
    // SAGE's V codes share scales per tile, so its rows keep the bits they have with zeros in
    // the poisoned V rows (whatever those held, no other key's code moves); FLASH's keep those
    // of the clean values too (a probability of 0 adds nothing).
    Tensor zeroed = Tensor::copy_of(v.view(), dt);
    for (const i64 j : cs.bad)
      for (i64 e = 0; e < D; ++e) store_from_f32(zeroed.data(), dt, j * D + e, 0.0f);
    // The 16-bit integer-lane engines' V codes share scales per tile too.
    const auto clean =
        Attention(c).forward(q, k, int8_engine || int16_engine ? zeroed : v, m, true);
    for (const float garbage : {NAN, INFINITY, -INFINITY}) {
      const std::string what = info.name + " " + std::to_string(cs.sq) + "x" +
                               std::to_string(cs.skv) + " " + std::to_string(garbage);
      Tensor v2 = Tensor::copy_of(v.view(), dt);
      for (const i64 j : cs.bad)
        for (i64 e = 0; e < D; e += 3) store_from_f32(v2.data(), dt, j * D + e, garbage);
      const auto got = Attention(c).forward(q, k, v2, m, true);
      AttentionConfig rc = c;
      rc.backend = "REFERENCE";
      rc.backend_options.clear();
      const auto want = Attention(rc).forward(q, k, v2, m, true);
      const std::size_t es = dtype_size(dt);
      for (i64 h = 0; h < H; ++h)
        for (i64 i = 0; i < cs.sq; ++i) {
          bool poisoned = false;
          for (const i64 j : cs.bad) poisoned = poisoned || sees(h, i, j);
          const i64 row = (i * H + h) * D;
          const float lse = got.lse->data_as<float>()[h * cs.sq + i];
          if (poisoned) {
            EXPECT_TRUE(std::isnan(lse)) << what << " h" << h << " row " << i;
            EXPECT_TRUE(std::isnan(want.lse->data_as<float>()[h * cs.sq + i])) << what;
            for (i64 e = 0; e < D; ++e)
              ASSERT_TRUE(std::isnan(load_as_f32(got.out.data(), dt, row + e)))
                  << what << " h" << h << " row " << i << " col " << e;
          } else {
            ASSERT_EQ(std::memcmp(static_cast<const char*>(got.out.data()) + row * es,
                                  static_cast<const char*>(clean.out.data()) + row * es, D * es),
                      0)
                << what << " h" << h << " row " << i;
            EXPECT_EQ(lse, clean.lse->data_as<float>()[h * cs.sq + i]) << what;
            for (i64 e = 0; e < D; ++e) {
              const float x = load_as_f32(got.out.data(), dt, row + e),
                          y = load_as_f32(want.out.data(), dt, row + e);
              ASSERT_LE(std::fabs(x - y), int8_engine    ? 0.1f
                                          : bf16_engine  ? 0.05f
                                          : int16_engine ? 0.02f
                                                         : 1e-5f)
                  << what << " h" << h << " row " << i << " col " << e;
            }
          }
        }
    }
  }
}

// softmax_rows_pairs against softmax_rows of the same engine: the same m, l and alpha (up to the
// exponential an engine may take for bf16 probabilities), and the probabilities as bf16 pairs
// with zeros up to `pairs`; raw and natural units over two panels, with a row far down the
// float range (-1e38 in natural units, as a large finite mask leaves it: uniform, never
// underflowing to a row that saw nothing), a hidden row (natural units) and a NaN row.
TEST_P(FlashEngine, SoftmaxRowsPairsMatchesSoftmaxRows) {
  const flash::Engine& e = engine(GetParam());
  if (const auto why = e.unavailable()) GTEST_SKIP() << GetParam() << ": " << *why;
  const flash::TileKernels& kk = e.kernels();
  ASSERT_NE(kk.row_softmax.softmax_rows_pairs, nullptr);
  // 37 rows: two groups of 16 where an engine reduces rows in groups, and a tail; the special
  // rows in the first group, the second and the tail.
  constexpr int kRows = 37, kLds = 272, kLdp = 144;
  constexpr float kScale = 0.125f;
  const auto far_down = [](int r) { return r % 16 == 2; };
  const auto hidden = [](int r) { return r % 16 == 3; };
  const auto has_nan = [](int r) { return r % 16 == 4; };
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (const int keys : {1, 17, 64, 250, 256})
    for (const bool raw : {true, false}) {
      const int pairs = ((keys + 1) / 2 + 15) / 16 * 16;
      std::vector<float> s(kRows * kLds), m1(kRows, -INFINITY), l1(kRows, 0.0f), a1(kRows),
          m2 = m1, l2 = l1, a2(kRows);
      std::vector<double> m_want(kRows, -INFINITY), l_want(kRows, 0.0);
      for (int panel = 0; panel < 3; ++panel) {
        // Row r's logits grow with the panel in some rows (the reference moves), not in others.
        for (int r = 0; r < kRows; ++r)
          for (int j = 0; j < keys; ++j)
            s[r * kLds + j] = nd(rng) * (r % 3 == 0 ? 1.0f : float(panel + 1));
        for (int r = 0; r < kRows; ++r)
          for (int j = 0; j < keys; ++j) {
            if (far_down(r)) s[r * kLds + j] = -1e38f;  // finite (raw: -1.25e37 natural)
            if (hidden(r) && !raw) s[r * kLds + j] = -INFINITY;
          }
        for (int r = 0; r < kRows; ++r)
          if (has_nan(r)) s[r * kLds + keys / 2] = NAN;
        const std::vector<float> logits = s;
        std::vector<float> s2 = s;
        std::vector<std::uint32_t> p(kRows * kLdp, 0xdeadbeefu);
        kk.row_softmax.softmax_rows(s.data(), kLds, kRows, keys, kScale, raw, m1.data(), l1.data(),
                                    a1.data());
        kk.row_softmax.softmax_rows_pairs(s2.data(), kLds, kRows, keys, kScale, raw, m2.data(),
                                          l2.data(), a2.data(), p.data(), kLdp, pairs);
        const std::string what = GetParam() + " keys " + std::to_string(keys) +
                                 (raw ? " raw" : " natural") + " panel " + std::to_string(panel);
        for (int r = 0; r < kRows; ++r) {
          const auto* p16 = reinterpret_cast<const std::uint16_t*>(p.data() + r * kLdp);
          if (has_nan(r)) {
            EXPECT_TRUE(std::isnan(l1[r])) << what << " row " << r;
            EXPECT_TRUE(std::isnan(l2[r])) << what << " row " << r;
            EXPECT_TRUE(std::isnan(bf16_to_f32(p16[keys / 2]))) << what << " row " << r;
            continue;
          }
          // The lazy reference (kMaxHeadroom past the largest scaled logit when one passes it),
          // alpha and the running sum in double from the logits.
          const float sc = raw ? kScale : 1.0f;
          float top = -INFINITY;
          for (int j = 0; j < keys; ++j) top = std::max(top, logits[r * kLds + j] * sc);
          const float m_old = float(m_want[r]);
          const float m_new = top > m_old ? top + flash::kMaxHeadroom : m_old;
          const double m_use = m_new == -INFINITY ? 0.0 : double(m_new);
          const double alpha = std::exp(double(m_old) - m_use);
          double sum = 0.0;
          for (int j = 0; j < keys; ++j) sum += std::exp(double(logits[r * kLds + j]) * sc - m_use);
          m_want[r] = m_new;
          l_want[r] = l_want[r] * alpha + sum;
          EXPECT_EQ(m1[r], m_new) << what << " row " << r;
          EXPECT_EQ(m2[r], m_new) << what << " row " << r;
          EXPECT_NEAR(a1[r], alpha, 1e-5 * alpha) << what << " row " << r;
          EXPECT_NEAR(a2[r], alpha, 2e-4 * alpha) << what << " row " << r;
          EXPECT_NEAR(l1[r], l_want[r], 2e-5 * l_want[r]) << what << " row " << r;
          EXPECT_NEAR(l2[r], l_want[r], 2e-4 * l_want[r]) << what << " row " << r;
          for (int j = 0; j < keys; ++j) {
            const float want = s[r * kLds + j], got = bf16_to_f32(p16[j]);
            const double exact = std::exp(double(logits[r * kLds + j]) * sc - m_use);
            ASSERT_NEAR(want, exact, 1e-5 * exact + 1e-30) << what << " row " << r << " key " << j;
            ASSERT_NEAR(got, want, 2e-4 * want + want / 256.0f)
                << what << " row " << r << " key " << j;
            if (want == 0.0f) {
              ASSERT_EQ(p16[j], 0) << what << " key " << j;
            }
          }
          for (int j = keys; j < 2 * pairs; ++j) ASSERT_EQ(p16[j], 0) << what << " pad " << j;
          for (int j = 2 * pairs; j < 2 * kLdp; ++j)
            ASSERT_EQ(p16[j], j % 2 == 0 ? 0xbeefu : 0xdeadu) << what << " past pairs " << j;
        }
        for (int r = 0; r < kRows; ++r) {
          if (far_down(r)) {  // far down the range: every key equally likely, and seen
            EXPECT_GT(l1[r], 0.0f) << what;
            EXPECT_TRUE(std::isfinite(l1[r])) << what;
            for (int j = 1; j < keys; ++j) ASSERT_EQ(s[r * kLds + j], s[r * kLds]) << what;
          }
          if (hidden(r) && !raw) {  // hidden: nothing seen
            EXPECT_EQ(l1[r], 0.0f) << what;
            EXPECT_EQ(l2[r], 0.0f) << what;
          }
        }
      }
    }
}

// softmax_tile_codes (the integer P.V's softmax step) against softmax_tile of the same f32 engine:
// the same m, l and alpha bit for bit, and per row a scale pmax / top (pmax the largest
// probability softmax_tile gives) with codes round(p / scale) in [0, top], G to a 32-bit group,
// zeros past the tile's keys up to 64; three tiles (the reference moves), tiles of 1-64 keys,
// with a hidden row (scale 0, codes 0), a row far down the float range and a NaN row. Each
// block of 8 rows has its own offset, and m must be each row's own lazy maximum: the softmax
// takes a block's maximum while it works on the block before.
TEST(FlashSteps, SoftmaxTileCodesMatchesSoftmaxTile) {
  constexpr int kRowsP = 48, kLd = kRowsP + 16, kLdg = kRowsP + 16;
  const auto hidden = [](int r) { return r % 16 == 3; };
  const auto far_down = [](int r) { return r % 16 == 5; };
  const auto has_nan = [](int r) { return r == 20; };
  int ran = 0;
  for (const char* name : {"portable", "avx2", "avx512"}) {
    if (engine(name).unavailable()) continue;
    const flash::TileKernels& kk = engine(name).kernels();
    ASSERT_NE(kk.steps.softmax_tile_codes, nullptr) << name;
    ++ran;
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    for (const int group : {2, 4})
      for (const float top : {255.0f, 4095.0f}) {
        if (group == 4 && top > 255.0f) continue;  // 8 bits per code in a group of 4
        for (const int keys : {1, 3, 17, 63, 64}) {
          std::vector<float> m1(kRowsP, -INFINITY), l1(kRowsP, 0.0f), a1(kRowsP), m2 = m1, l2 = l1,
                                                                                  a2(kRowsP);
          for (int tile = 0; tile < 3; ++tile) {
            std::vector<float> st(std::size_t(keys) * kLd);
            for (int j = 0; j < keys; ++j)
              for (int r = 0; r < kRowsP; ++r) {
                float x = nd(rng) * float(tile + 1) + 40.0f * float((r / 8) % 3);
                if (hidden(r)) x = -INFINITY;
                if (far_down(r)) x = -1e38f + 1e32f * float(j);
                if (has_nan(r) && j == keys / 2) x = NAN;
                st[std::size_t(j) * kLd + r] = x;
              }
            std::vector<float> probs = st, ps(kRowsP, -1.0f);
            const std::vector<float> m_before = m1;
            std::vector<std::uint32_t> codes(std::size_t(flash::kTileKeys / group) * kLdg,
                                             0xdeadbeefu);
            kk.steps.softmax_tile(probs.data(), kLd, keys, kRowsP, m1.data(), l1.data(), a1.data(),
                                  nullptr);
            kk.steps.softmax_tile_codes(st.data(), kLd, keys, kRowsP, m2.data(), l2.data(),
                                        a2.data(), codes.data(), kLdg, ps.data(), group, top);
            const std::string what = std::string(name) + " group " + std::to_string(group) +
                                     " top " + std::to_string(int(top)) + " keys " +
                                     std::to_string(keys) + " tile " + std::to_string(tile);
            const int bits = 32 / group;
            const std::uint32_t mask = (1u << bits) - 1u;
            const auto code = [&](int r, int j) {
              return int(codes[std::size_t(j / group) * kLdg + r] >> (bits * (j % group)) & mask);
            };
            for (int r = 0; r < kRowsP; ++r) {
              const std::string row = what + " row " + std::to_string(r);
              if (has_nan(r)) {
                EXPECT_TRUE(std::isnan(l1[r])) << row;
                EXPECT_TRUE(std::isnan(l2[r])) << row;
                continue;
              }
              EXPECT_EQ(std::memcmp(&m1[r], &m2[r], sizeof(float)), 0) << row;
              float tile_max = -INFINITY;
              for (int j = 0; j < keys; ++j)
                tile_max = std::max(tile_max, st[std::size_t(j) * kLd + r]);
              const float m_want =
                  tile_max > m_before[r] ? tile_max + flash::kMaxHeadroom : m_before[r];
              EXPECT_EQ(m1[r], m_want) << row;
              EXPECT_EQ(std::memcmp(&l1[r], &l2[r], sizeof(float)), 0)
                  << row << ": " << l1[r] << " vs " << l2[r];
              EXPECT_EQ(std::memcmp(&a1[r], &a2[r], sizeof(float)), 0) << row;
              float pmax = 0.0f;
              for (int j = 0; j < keys; ++j) pmax = std::max(pmax, probs[std::size_t(j) * kLd + r]);
              if (hidden(r)) {
                EXPECT_EQ(pmax, 0.0f) << row;
                EXPECT_EQ(ps[r], 0.0f) << row;
              } else {
                EXPECT_GT(pmax, 0.0f) << row;
                EXPECT_NEAR(ps[r], pmax / top, 1e-6f * pmax / top) << row;
              }
              for (int j = 0; j < keys; ++j) {
                const float p = probs[std::size_t(j) * kLd + r];
                const int c = code(r, j);
                ASSERT_LE(c, int(top)) << row << " key " << j;
                if (ps[r] == 0.0f) {
                  ASSERT_EQ(c, 0) << row << " key " << j;
                } else {
                  ASSERT_NEAR(double(c), double(p) / double(ps[r]), 0.5 + 1e-3)
                      << row << " key " << j;
                }
              }
              for (int j = keys; j < flash::kTileKeys; ++j)
                ASSERT_EQ(code(r, j), 0) << row << " key " << j;
            }
            // The largest probability of each visible row takes the top code.
            for (int r = 0; r < kRowsP; ++r) {
              if (hidden(r) || has_nan(r)) continue;
              int best = 0;
              for (int j = 0; j < keys; ++j) best = std::max(best, code(r, j));
              EXPECT_EQ(best, int(top)) << what << " row " << r;
            }
          }
        }
      }
  }
  EXPECT_GE(ran, 1);
}

// avx512_bf16's softmax step writes P's bf16 pairs itself (softmax_tile_pairs) for its pv, which
// no longer packs ST: over three tiles of 1-64 keys its steps give the bits of the avx512 f32
// softmax (m, l and alpha) followed by the P.V of its emulated twin, which packs that softmax's
// f32 probabilities and computes vdpbf16ps lane by lane; ST keeps the logits. Rows hidden
// throughout, far down the float range, with a NaN logit, and blocks of rows at other offsets.
void expect_softmax_pairs_then_twin_pv(const char* real_name, const char* f32_name,
                                       const char* twin_name) {
  const flash::Engine& real = engine(real_name);
  if (const auto why = real.unavailable()) GTEST_SKIP() << real_name << ": " << *why;
  const flash::TileKernels& kk = real.kernels();
  const flash::TileKernels& f32 = engine(f32_name).kernels();
  const flash::TileKernels& twin = engine(twin_name).kernels();
  constexpr int kRowsP = 64, kRows = 50, kLd = kRowsP + 16, kD = 64, kDv = 64, kLdo = kDv + 16;
  const auto hidden = [](int r) { return r % 16 == 3; };
  const auto far_down = [](int r) { return r % 16 == 5; };
  const auto has_nan = [](int r) { return r == 20; };
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  const auto aligned = [](std::vector<unsigned char>& b) {
    return reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(b.data()) + 63) / 64 * 64);
  };
  std::vector<float> qt(std::size_t(kD) * kLd);
  for (float& x : qt) x = nd(rng);
  std::vector<unsigned char> ws_real(kk.formats.workspace_bytes(kRowsP, kD, kDv) + 64),
      ws_twin(twin.formats.workspace_bytes(kRowsP, kD, kDv) + 64);
  kk.formats.pack_q(qt.data(), kLd, kRowsP, kD, kDv, 0.125f, aligned(ws_real));
  twin.formats.pack_q(qt.data(), kLd, kRowsP, kD, kDv, 0.125f, aligned(ws_twin));
  std::vector<float> m1(kRowsP, -INFINITY), l1(kRowsP, 0.0f), a1(kRowsP), m2 = m1, l2 = l1,
                                                                          a2(kRowsP);
  std::vector<float> o1(std::size_t(kRowsP) * kLdo);
  for (float& x : o1) x = nd(rng);
  std::vector<float> o2 = o1;
  int tile = 0;
  for (const int keys : {64, 17, 1, 63}) {
    const std::string what = "tile " + std::to_string(tile) + " keys " + std::to_string(keys);
    std::vector<float> st(std::size_t(keys) * kLd), v(std::size_t(keys) * kDv);
    for (int j = 0; j < keys; ++j)
      for (int r = 0; r < kRowsP; ++r) {
        float x = nd(rng) * float(tile + 1) + 40.0f * float((r / 8) % 3);
        if (hidden(r)) x = -INFINITY;
        if (far_down(r)) x = -1e38f + 1e32f * float(j);
        if (has_nan(r) && j == keys / 2 && tile == 2) x = NAN;
        st[std::size_t(j) * kLd + r] = x;
      }
    for (float& x : v) x = nd(rng);
    std::vector<unsigned char> v_real(kk.formats.v_tile_bytes(kDv) + 64),
        v_twin(twin.formats.v_tile_bytes(kDv) + 64);
    kk.formats.pack_v(v.data(), kDv, keys, kDv, aligned(v_real));
    twin.formats.pack_v(v.data(), kDv, keys, kDv, aligned(v_twin));
    std::vector<float> st1 = st, st2 = st;
    kk.steps.softmax_tile(st1.data(), kLd, keys, kRowsP, m1.data(), l1.data(), a1.data(),
                          aligned(ws_real));
    EXPECT_EQ(std::memcmp(st1.data(), st.data(), st.size() * sizeof(float)), 0)
        << what << ": ST keeps the logits";
    kk.steps.pv(st1.data(), kLd, aligned(v_real), kDv, o1.data(), kLdo, a1.data(), kRows, keys, kDv,
                aligned(ws_real));
    f32.steps.softmax_tile(st2.data(), kLd, keys, kRowsP, m2.data(), l2.data(), a2.data(), nullptr);
    twin.steps.pv(st2.data(), kLd, aligned(v_twin), kDv, o2.data(), kLdo, a2.data(), kRows, keys,
                  kDv, aligned(ws_twin));
    for (int r = 0; r < kRowsP; ++r) {
      const std::string row = what + " row " + std::to_string(r);
      EXPECT_EQ(std::memcmp(&m1[r], &m2[r], sizeof(float)), 0) << row;
      if (has_nan(r) && tile >= 2) {
        EXPECT_TRUE(std::isnan(l1[r]) && std::isnan(l2[r])) << row;
      } else {
        EXPECT_EQ(std::memcmp(&l1[r], &l2[r], sizeof(float)), 0) << row;
        EXPECT_EQ(std::memcmp(&a1[r], &a2[r], sizeof(float)), 0) << row;
      }
      if (r >= kRows) continue;
      for (int c = 0; c < kDv; ++c) {
        const float x1 = o1[std::size_t(r) * kLdo + c], x2 = o2[std::size_t(r) * kLdo + c];
        if (std::isnan(x2)) {
          ASSERT_TRUE(std::isnan(x1)) << row << " column " << c;
        } else {
          ASSERT_EQ(std::memcmp(&x1, &x2, sizeof(float)), 0)
              << row << " column " << c << ": " << x1 << " vs " << x2;
        }
      }
    }
    ++tile;
  }
  // The NaN row's output is NaN from its tile on; the hidden rows saw nothing.
  EXPECT_TRUE(std::isnan(o1[std::size_t(20) * kLdo]));
  EXPECT_EQ(l1[3], 0.0f);
}

TEST(FlashSteps, Bf16SoftmaxPairsGiveTheBitsOfSoftmaxThenPacking) {
  expect_softmax_pairs_then_twin_pv("avx512_bf16", "avx512", "avx512_bf16_emulated");
}

// The same for neon_bf16 (BFDOT, run under qemu-aarch64 here) against the neon f32 softmax and
// the P.V of its twin, which models BFDOT's round-to-odd additions: the twin's arithmetic is the
// instruction's, bit for bit.
TEST(FlashSteps, NeonBf16SoftmaxPairsGiveTheBitsOfSoftmaxThenPacking) {
  expect_softmax_pairs_then_twin_pv("neon_bf16", "neon", "neon_bf16_emulated");
}

// Q.K^T of each bf16-dot engine gives its emulated twin's bits: logits of every size, with
// inputs whose products and sums round (the twin models the instruction's rounding, to nearest
// even in two FMAs for vdpbf16ps, to odd for BFDOT), denormal bf16 inputs (read as zero), keys
// whose products overflow to infinity (NaN logits) and a NaN query element; keys of 1-8 and odd
// head sizes (a missing odd element is zero).
TEST(FlashSteps, Bf16QkGivesTheTwinsBits) {
  for (const auto& [real_name, twin_name] : {std::pair{"avx512_bf16", "avx512_bf16_emulated"},
                                             std::pair{"neon_bf16", "neon_bf16_emulated"}}) {
    const flash::Engine& real = engine(real_name);
    if (real.unavailable()) continue;
    const flash::TileKernels& kk = real.kernels();
    const flash::TileKernels& twin = engine(twin_name).kernels();
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const auto aligned = [](std::vector<unsigned char>& b) {
      return reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(b.data()) + 63) / 64 * 64);
    };
    for (const int d : {64, 37, 128}) {
      constexpr int kRowsP = 64, kLd = kRowsP + 8;
      std::vector<float> qt(std::size_t(d) * kLd);
      for (std::size_t i = 0; i < qt.size(); ++i)
        qt[i] = i % 11 == 0 ? 1e-39f : nd(rng) * (i % 7 == 0 ? 300.0f : 1.0f);
      qt[std::size_t(3) * kLd + 9] = NAN;  // row 9's element 3
      for (const int keys : {64, 17, 1, 8}) {
        const std::string what =
            std::string(real_name) + " d " + std::to_string(d) + " keys " + std::to_string(keys);
        std::vector<float> k(std::size_t(keys) * d);
        for (std::size_t i = 0; i < k.size(); ++i) k[i] = nd(rng) * 4.0f + 0.5f;
        for (int e = 0; e < d; e += 3) k[std::size_t(e)] = 2e-39f;  // key 0: denormals
        if (keys > 2)
          for (int e = 0; e < d; ++e) k[std::size_t(2) * d + e] = 3e38f;  // key 2 overflows
        std::vector<unsigned char> ws1(kk.formats.workspace_bytes(kRowsP, d, d) + 64),
            ws2(twin.formats.workspace_bytes(kRowsP, d, d) + 64),
            k1(kk.formats.k_tile_bytes(d) + 64), k2(twin.formats.k_tile_bytes(d) + 64);
        kk.formats.pack_q(qt.data(), kLd, kRowsP, d, d, 0.09f, aligned(ws1));
        twin.formats.pack_q(qt.data(), kLd, kRowsP, d, d, 0.09f, aligned(ws2));
        kk.formats.pack_k(k.data(), d, keys, d, aligned(k1));
        twin.formats.pack_k(k.data(), d, keys, d, aligned(k2));
        std::vector<float> st1(std::size_t(keys) * kLd, 7.0f), st2 = st1;
        kk.steps.qk(aligned(k1), d, qt.data(), kLd, st1.data(), kLd, keys, kRowsP, d, aligned(ws1));
        twin.steps.qk(aligned(k2), d, qt.data(), kLd, st2.data(), kLd, keys, kRowsP, d,
                      aligned(ws2));
        for (int j = 0; j < keys; ++j)
          for (int r = 0; r < kRowsP; ++r) {
            const float x1 = st1[std::size_t(j) * kLd + r], x2 = st2[std::size_t(j) * kLd + r];
            if (std::isnan(x2)) {
              ASSERT_TRUE(std::isnan(x1)) << what << " key " << j << " row " << r;
            } else {
              ASSERT_EQ(std::memcmp(&x1, &x2, sizeof(float)), 0)
                  << what << " key " << j << " row " << r << ": " << x1 << " vs " << x2;
            }
          }
        if (keys > 2) {
          EXPECT_TRUE(std::isnan(st1[std::size_t(2) * kLd])) << what;
        }
        EXPECT_TRUE(std::isnan(st1[9]));
      }
    }
  }
}

std::vector<std::string> engine_names() {
  std::vector<std::string> names;
  for (const EngineInfo& e : flash_engines()) names.push_back(e.name);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Engines, FlashEngine, ::testing::ValuesIn(engine_names()),
                         [](const auto& tp) { return tp.param; });

}  // namespace
}  // namespace dattn
