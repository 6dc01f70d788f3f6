// The process's large buffers (include/dattn/memory.hpp, core/process_memory.hpp): leases are
// reused across layers and shapes, concurrent ones are distinct, what stays idle is bounded by
// what calls held at once, empty_cache() and the last layer gone give it back; and a model's
// worth of layers called once each keeps no memory per layer.
#include <gtest/gtest.h>
#include <omp.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/process_memory.hpp"
#include "dattn/attention.hpp"
#include "dattn/memory.hpp"
#include "test_inputs.hpp"

namespace dattn {
namespace {

using i64 = std::int64_t;
using detail::ProcessMemory;

// Tests here change the process's pool: each starts from an empty one.
class ProcessMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override { empty_cache(); }
};

TEST_F(ProcessMemoryTest, ConcurrentLeasesAreDistinctAndReturnedOnesAreReused) {
  ProcessMemory& pm = ProcessMemory::instance();
  const void* first = nullptr;
  {
    ProcessMemory::Lease a = pm.lease(100000), b = pm.lease(100000);
    EXPECT_NE(a.data(), b.data());
    EXPECT_GE(a.capacity(), 100000u);
    first = a.data();
    std::memset(a.data(), 1, 100000);  // writable, the whole size asked
    std::memset(b.data(), 2, 100000);
  }
  EXPECT_GE(memory_stats().idle_buffers, 2u);
  ProcessMemory::Lease c = pm.lease(50000), d = pm.lease(100000);
  EXPECT_TRUE(c.data() == first || d.data() == first);
  EXPECT_EQ(memory_stats().idle_buffers, 0u);
}

TEST_F(ProcessMemoryTest, ALargerLeaseRemapsAnIdleBufferInsteadOfAddingOne) {
  ProcessMemory& pm = ProcessMemory::instance();
  { ProcessMemory::Lease a = pm.lease(1 << 20); }
  ASSERT_EQ(memory_stats().idle_buffers, 1u);
  for (std::size_t mib = 2; mib <= 8; ++mib) {
    ProcessMemory::Lease l = pm.lease(mib << 20);  // a new shape, larger each time
    EXPECT_GE(l.capacity(), mib << 20);
    std::memset(l.data(), 3, mib << 20);
  }
  const MemoryStats s = memory_stats();
  EXPECT_EQ(s.idle_buffers, 1u);  // not one per size
  EXPECT_GE(s.idle_bytes, std::size_t(8) << 20);
}

TEST_F(ProcessMemoryTest, EmptyCacheGivesTheIdleBuffersBackAndLeavesLeasesAlone) {
  ProcessMemory& pm = ProcessMemory::instance();
  ProcessMemory::Lease held = pm.lease(3 << 20);
  { ProcessMemory::Lease a = pm.lease(5 << 20); }
  EXPECT_GE(empty_cache(), std::size_t(5) << 20);
  EXPECT_EQ(memory_stats().idle_bytes, 0u);
  EXPECT_GE(memory_stats().in_use_bytes, std::size_t(3) << 20);
  std::memset(held.data(), 4, 3 << 20);  // still mapped
  EXPECT_EQ(empty_cache(), 0u);
  EXPECT_EQ(memory_stats().idle_limit, 1u);  // the bound starts again from what is in flight
}

TEST_F(ProcessMemoryTest, ResultsFromTheThresholdOnAreMappedAndReusedWhenFreed) {
  ProcessMemory& pm = ProcessMemory::instance();
  void* small = pm.allocate(1000);
  void* big = pm.allocate(ProcessMemory::kResultMapBytes);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(big) % 4096, 0u);  // a mapping of its own
  const std::size_t in_use = memory_stats().in_use_bytes;
  EXPECT_GE(in_use, ProcessMemory::kResultMapBytes);
  pm.release(small);
  pm.release(big);
  EXPECT_LT(memory_stats().in_use_bytes, in_use);
  { const ProcessMemory::CallScope call; }  // a call has run: idle buffers may stay
  void* again = pm.allocate(ProcessMemory::kResultMapBytes);
  pm.release(again);
  void* other = pm.allocate(ProcessMemory::kResultMapBytes);
  EXPECT_EQ(other, again);  // the idle one, not a new mapping
  pm.release(other);
  pm.release(nullptr);
}

// The idle buffers never outnumber the most leases held at once plus two per call in flight,
// however many results are freed at once.
TEST_F(ProcessMemoryTest, IdleBuffersAreBoundedByWhatCallsHeldAtOnce) {
  ProcessMemory& pm = ProcessMemory::instance();
  std::vector<void*> results;
  {
    const ProcessMemory::CallScope call;
    ProcessMemory::Lease a = pm.lease(1 << 20);
    for (int i = 0; i < 40; ++i) results.push_back(pm.allocate(std::size_t(1) << 20));
  }
  for (void* p : results) pm.release(p);
  const MemoryStats s = memory_stats();
  EXPECT_LE(s.idle_buffers, s.idle_limit);
  EXPECT_LT(s.idle_buffers, 40u);
}

TEST_F(ProcessMemoryTest, TheLastLayerDestroyedGivesTheIdleBuffersBack) {
  const std::size_t before = memory_stats().live_layers;
  if (before != 0) GTEST_SKIP() << before << " layers alive in this process (a static one)";
  {
    const Attention layer(testing::layer_config("FLASH", 2, 2, 64));
    EXPECT_EQ(memory_stats().live_layers, 1u);
    const Tensor q = testing::random_tensor({1, 300, 2, 64}, DType::F32, 1);
    (void)layer.forward(q, q, q);
    EXPECT_GT(memory_stats().idle_bytes, 0u);  // the call's panels and scratch
  }
  EXPECT_EQ(memory_stats().live_layers, 0u);
  EXPECT_EQ(memory_stats().idle_bytes, 0u);
}

// Concurrent calls on one layer, split-KV (FLASH) and packed K/V buffers (VIDEO_SPARSE)
// included, give what each call gives alone: each leases its own buffers.
TEST(ProcessMemory, ConcurrentCallsOnOneLayerGiveTheirOwnResults) {
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
      inputs.push_back({testing::random_tensor({1, sq, 2, 16}, DType::F32, 10 * s + 1),
                        testing::random_tensor({1, 128, 1, 16}, DType::F32, 10 * s + 2),
                        testing::random_tensor({1, 128, 1, 16}, DType::F32, 10 * s + 3)});
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

// Buffers are reused across layers and shapes with whatever the last call left in them: a call
// whose idle buffers hold garbage (NaN, inf and huge bit patterns, in every size class) gives
// bit for bit the answer it gives on fresh zeroed mappings, on every backend with buffers (FLASH
// f32 and bf16 with split keys, SAGE, VIDEO_SPARSE, REFERENCE), with a key-padding mask.
TEST_F(ProcessMemoryTest, GarbageLeftInReusedBuffersChangesNoAnswer) {
  ProcessMemory& pm = ProcessMemory::instance();
  const auto poison = [&pm] {
    const ProcessMemory::CallScope call;  // lets the poisoned buffers stay idle
    std::vector<ProcessMemory::Lease> held;
    for (const std::size_t bytes :
         {std::size_t(4) << 10, std::size_t(64) << 10, std::size_t(1) << 20, std::size_t(3) << 20,
          std::size_t(12) << 20}) {
      held.push_back(pm.lease(bytes));
      auto* f = held.back().as<std::uint32_t>();
      for (std::size_t i = 0; i < held.back().capacity() / 4; ++i)
        f[i] = i % 3 == 0 ? 0x7fc00000u : i % 3 == 1 ? 0x7f800000u : 0x7f7fffffu;
    }
  };
  struct Case {
    std::string backend;
    DType dtype;
    i64 sq;
  };
  for (const Case& cs : {Case{"FLASH", DType::F32, 4}, Case{"FLASH", DType::BF16, 300},
                         Case{"SAGE", DType::F32, 300}, Case{"VIDEO_SPARSE", DType::F32, 128},
                         Case{"REFERENCE", DType::F32, 40}}) {
    SCOPED_TRACE(cs.backend + " " + std::string(dtype_name(cs.dtype)));
    AttentionConfig c = testing::layer_config(cs.backend, 2, 1, 64);
    if (cs.backend == "VIDEO_SPARSE") c.backend_options = {{"topk", i64(2)}};
    const Attention layer(c);
    AttentionMetadata meta;
    Tensor mask = Tensor::empty(std::vector<i64>{1, 128}, DType::Bool);
    if (cs.backend == "VIDEO_SPARSE") {
      VideoTokenLayout layout;
      layout.prefix_len = 0;
      layout.latent_grid = {2, 8, 8};
      meta.video_layout = layout;
    } else {
      auto* keep = static_cast<std::uint8_t*>(mask.view().data());
      for (i64 j = 0; j < 128; ++j) keep[j] = j < 100;  // the last 28 keys are padding
      meta.attn_mask = mask.view();
    }
    const Tensor q = testing::random_tensor({1, cs.sq, 2, 64}, cs.dtype, 1);
    const Tensor k = testing::random_tensor({1, 128, 1, 64}, cs.dtype, 2);
    const Tensor v = testing::random_tensor({1, 128, 1, 64}, cs.dtype, 3);
    empty_cache();
    const ForwardResult fresh = layer.forward(q, k, v, meta, true);
    empty_cache();
    poison();
    ASSERT_GE(memory_stats().idle_buffers, 5u);
    const ForwardResult reused = layer.forward(q, k, v, meta, true);
    EXPECT_TRUE(testing::bitwise_equal(reused.out, fresh.out));
    EXPECT_TRUE(testing::bitwise_equal(*reused.lse, *fresh.lse));
  }
}

std::size_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * std::size_t(sysconf(_SC_PAGESIZE));
}

// A model's layers called once each, as one denoising step calls them (a new layer per
// attention layer, each output dropped), after one 30 MiB block was freed as a pipeline's own
// tensors are (glibc then serves blocks up to that size from its heap, where the small objects
// each new layer keeps used to pin the freed outputs: 4 MiB more per layer at this shape): the
// RSS grows by less than 32 MiB from layer 2 to layer 12, on every backend with buffers.
// Not under the sanitizers (their allocator is not glibc's).
TEST(LayerMemory, LayersCalledOnceEachKeepNoMemoryPerLayer) {
  if (testing::kSanitized) GTEST_SKIP() << "RSS under the sanitizers' allocator says nothing";
  const i64 sq = 2048, skv = 64, h = 32, d = 64;  // outputs of 16 MiB (f32), little compute
  const Tensor q = testing::random_tensor({1, sq, h, d}, DType::F32, 1);
  const Tensor k = testing::random_tensor({1, skv, h, d}, DType::F32, 2);
  const Tensor v = testing::random_tensor({1, skv, h, d}, DType::F32, 3);
  for (const std::string backend : {"FLASH", "SAGE"}) {
    SCOPED_TRACE(backend);
    {
      void* block = std::malloc(std::size_t(30) << 20);
      ASSERT_NE(block, nullptr);
      std::memset(block, 1, std::size_t(30) << 20);
      std::free(block);
    }
    std::vector<std::unique_ptr<Attention>> layers;
    std::size_t after_first = 0;
    for (int n = 0; n < 12; ++n) {
      AttentionConfig c = testing::layer_config(backend, h, h, d);
      c.role = AttentionRole::cross;
      layers.push_back(std::make_unique<Attention>(c));
      (void)layers.back()->forward(q, k, v);
      if (n == 0) after_first = rss_bytes();
    }
    const std::size_t growth = rss_bytes() > after_first ? rss_bytes() - after_first : 0;
    EXPECT_LT(growth, std::size_t(32) << 20)
        << "RSS grew by " << (growth >> 20) << " MiB from layer 2 to 12";
  }
}

}  // namespace
}  // namespace dattn
