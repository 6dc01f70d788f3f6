// FLASH-specific properties beyond the conformance suite: thread splits, plan reuse, scratch
// size, ISA levels agreeing, the laser scale.
#include <gtest/gtest.h>
#include <omp.h>

#include <random>

#include "backends/flash/kernels.hpp"
#include "core/prepare_call.hpp"
#include "dattn/attention.hpp"
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

TEST(Flash, ScratchPerThreadStaysWithin256KiBUpToHeadSize128) {
  const auto backend = Registry::global().find("FLASH");
  for (const auto& [hq, hkv] : {std::pair<i64, i64>{24, 24}, {28, 7}, {24, 1}})
    for (i64 d : {32, 64, 80, 96, 128}) {
      AttentionConfig c = flash_config(hq, hkv, d, false);
      auto q = Tensor::empty({1, 1000, hq, d}, DType::BF16),
           k = Tensor::empty({1, 1000, hkv, d}, DType::BF16);
      Tensor out = Tensor::empty({1, 1000, hq, d}, DType::BF16);
      const AttentionInputs in{q, k, k, nullptr, out, std::nullopt};
      const auto call = detail::prepare_call(c, 0.1, hkv, in, {});
      ImplConfig ic;
      ic.num_heads = hq;
      ic.num_kv_heads = hkv;
      ic.head_size = d;
      const auto plan = backend->make_impl(ic)->plan(call.problem);
      EXPECT_LE(plan->scratch_bytes_per_thread(), 256u * 1024u)
          << "H " << hq << ":" << hkv << " D " << d << ": " << plan->to_string();
    }
}

TEST(Flash, EveryIsaLevelAgreesWithThePortableOne) {
  auto q = random_tensor({1, 131, 4, 96}, DType::F16, 4),
       k = random_tensor({1, 150, 2, 96}, DType::F16, 5),
       v = random_tensor({1, 150, 2, 96}, DType::F16, 6);
  AttentionConfig c = flash_config(4, 2, 96, true);
  c.backend_options["isa"] = std::string("portable");
  const auto base = Attention(c).forward(q, k, v, {}, true);
  for (const char* isa : {"avx2", "avx512"}) {
    c.backend_options["isa"] = std::string(isa);
    try {
      const auto got = Attention(c).forward(q, k, v, {}, true);
      EXPECT_LE(testing::compare(got.out.view(), base.out.view()).max_abs, 2e-3) << isa;
      EXPECT_LE(testing::compare(got.lse->view(), base.lse->view()).max_abs, 1e-4) << isa;
    } catch (const NotAvailable&) {
      // this CPU lacks the level
    }
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
  for (flash::Isa isa : flash::available_isas()) {
    const flash::TileKernels& k = flash::kernels_for(isa);
    for (DType dt : {DType::BF16, DType::F16}) {
      std::vector<std::uint16_t> got(src.size()), want(src.size());
      k.store_row(src.data(), 1.0f, std::int64_t(src.size()), dt, got.data());
      for (std::size_t n = 0; n < src.size(); ++n)
        want[n] = dt == DType::BF16 ? f32_to_bf16(src[n]) : f32_to_f16(src[n]);
      for (std::size_t n = 0; n < src.size(); ++n) {
        if (std::isnan(src[n])) {
          EXPECT_TRUE(std::isnan(load_as_f32(got.data(), dt, std::int64_t(n))));
          continue;
        }
        ASSERT_EQ(got[n], want[n])
            << flash::isa_name(isa) << " " << dtype_name(dt) << " " << src[n];
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
      const auto call = detail::prepare_call(fc, 0.125, c.hkv, in, {});
      ImplConfig ic;
      ic.num_heads = c.hq;
      ic.num_kv_heads = c.hkv;
      ic.head_size = 64;
      const auto plan = Registry::global().find("FLASH")->make_impl(ic)->plan(call.problem);
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

#include <thread>

#include "core/workspace_pool.hpp"

namespace dattn {
namespace {

// Two leases held at once are two buffers; a returned buffer is reused, not reallocated.
TEST(WorkspacePool, ConcurrentLeasesGetTheirOwnBufferAndBuffersAreReused) {
  detail::WorkspacePool<std::vector<float>> pool;
  const float* first = nullptr;
  {
    auto a = pool.acquire();
    auto b = pool.acquire();
    a->resize(100);
    b->resize(100);
    EXPECT_NE(a->data(), b->data());
    first = a->data();
  }
  EXPECT_EQ(pool.idle(), 2u);
  auto c = pool.acquire();
  auto d = pool.acquire();
  EXPECT_TRUE(c->data() == first || d->data() == first);
  EXPECT_EQ(pool.idle(), 0u);
}

// Concurrent calls on one layer, split-KV (FLASH) and packed K/V buffers (VIDEO_SPARSE)
// included, give what each call gives alone.
TEST(WorkspacePool, ConcurrentCallsOnOneLayerGiveTheirOwnResults) {
  for (const std::string backend : {"FLASH", "VIDEO_SPARSE"}) {
    SCOPED_TRACE(backend);
    AttentionConfig c = testing::layer_config(backend, 2, 1, 16);
    if (backend == "VIDEO_SPARSE") c.backend_options = {{"topk", i64(2)}};
    const Attention layer(c);
    AttentionMetadata meta;
    VideoTokenLayout layout;
    layout.prefix_len = 0;
    layout.latent_grid = {2, 8, 8};
    meta.video_layout = layout;
    std::vector<std::array<Tensor, 3>> inputs;
    std::vector<ForwardResult> alone;
    for (std::uint32_t s = 0; s < 4; ++s) {
      // 4 query rows against 128 keys: fewer query blocks than threads, so FLASH splits keys.
      const i64 sq = backend == "FLASH" ? 4 : 128;
      inputs.push_back({random_tensor({1, sq, 2, 16}, DType::F32, 10 * s + 1),
                        random_tensor({1, 128, 1, 16}, DType::F32, 10 * s + 2),
                        random_tensor({1, 128, 1, 16}, DType::F32, 10 * s + 3)});
      alone.push_back(layer.forward(inputs[s][0], inputs[s][1], inputs[s][2], meta, true));
    }
    std::vector<ForwardResult> together(4);
    std::vector<std::thread> threads;
    for (std::size_t s = 0; s < 4; ++s)
      threads.emplace_back([&, s] {
        omp_set_num_threads(2);
        for (int rep = 0; rep < 20; ++rep)
          together[s] = layer.forward(inputs[s][0], inputs[s][1], inputs[s][2], meta, true);
      });
    for (auto& t : threads) t.join();
    for (std::size_t s = 0; s < 4; ++s) {
      EXPECT_TRUE(testing::bitwise_equal(together[s].out, alone[s].out)) << s;
      EXPECT_TRUE(testing::bitwise_equal(*together[s].lse, *alone[s].lse)) << s;
    }
  }
}

}  // namespace
}  // namespace dattn
