#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "dattn/attention.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"
#include "test_inputs.hpp"

namespace dattn {
namespace {

using i64 = std::int64_t;
using testing::random_tensor;

TEST(Paged, SlotMappingExample) {
  const std::vector<std::int32_t> table{7, 3};
  std::vector<i64> slots;
  for (i64 pos = 2; pos <= 6; ++pos) slots.push_back(paged_slot(table, 4, pos));
  EXPECT_EQ(slots, (std::vector<i64>{30, 31, 12, 13, 14}));
  EXPECT_THROW(paged_slot(table, 4, 8), InvalidArgument);
}

// The backends that claim supports_paged_kv.
std::vector<std::string> paged_backends() {
  std::vector<std::string> names;
  for (const auto& b : Registry::global().all())
    if (b->supports_paged_kv()) names.push_back(b->name());
  return names;
}

// A multi-layer cache holding `layers` layers; returns layer `layer`'s view in either layout.
struct MultiLayerCache {
  Tensor storage;
  TensorView k, v;
};
MultiLayerCache make_cache(bool block_outermost, i64 layers, i64 layer, i64 blocks, i64 bs, i64 hkv,
                           i64 d) {
  MultiLayerCache c;
  // [2 (k, v), layers, blocks, bs, hkv, d] or [2, blocks, layers, bs, hkv, d]
  c.storage = testing::nan_tensor({2, layers, blocks, bs, hkv, d}, DType::F32);
  const i64 page = bs * hkv * d;
  const std::array<i64, 4> shape{blocks, bs, hkv, d};
  const std::array<i64, 4> strides{block_outermost ? layers * page : page, hkv * d, d, 1};
  const i64 layer_off = block_outermost ? layer * page : layer * blocks * page;
  float* base = c.storage.data_as<float>();
  c.k = TensorView(base + layer_off, DType::F32, shape, strides);
  c.v = TensorView(base + layers * blocks * page + layer_off, DType::F32, shape, strides);
  return c;
}

TEST(Paged, EqualsDenseOnTheLogicalSequenceForPermutedPagesAndBothLayouts) {
  const i64 hq = 4, hkv = 2, d = 8;
  for (const bool block_outermost : {false, true})
    for (const i64 bs : {1, 16, 64})
      for (const bool causal : {false, true}) {
        SCOPED_TRACE("bs=" + std::to_string(bs) +
                     (block_outermost ? " block-outer" : " layer-outer") +
                     (causal ? " causal" : ""));
        // Two sequences: lengths 37 (prefix 30 cached + 7 new) and 19 (all new).
        const std::vector<std::pair<i64, i64>> seqs{{37, 30}, {19, 0}};
        i64 pages_needed = 0;
        for (const auto& s : seqs) pages_needed += (s.first + bs - 1) / bs;
        const i64 blocks = pages_needed + 3;
        MultiLayerCache cache = make_cache(block_outermost, 2, 1, blocks, bs, hkv, d);
        std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), std::mt19937(static_cast<unsigned>(bs)));
        std::size_t next = 0;
        PagedAttentionCall call;
        call.cache = {cache.k, cache.v};
        call.causal = causal;
        call.softmax_scale = 0.3;
        i64 total_new = 0;
        for (const auto& [len, start] : seqs) {
          PagedRow row;
          row.seq_len = len;
          row.kv_start_pos = start;
          row.query_len = len - start;
          for (i64 pg = 0; pg < (len + bs - 1) / bs; ++pg) row.block_table.push_back(ids[next++]);
          call.rows.push_back(row);
          total_new += row.query_len;
        }
        // Logical full sequences, and the cached prefix pre-written into its pages.
        std::vector<Tensor> full_k, full_v;
        for (std::size_t r = 0; r < seqs.size(); ++r) {
          full_k.push_back(
              random_tensor({1, seqs[r].first, hkv, d}, DType::F32, 100 + unsigned(r)));
          full_v.push_back(
              random_tensor({1, seqs[r].first, hkv, d}, DType::F32, 200 + unsigned(r)));
          for (i64 pos = 0; pos < call.rows[r].kv_start_pos; ++pos) {
            const i64 slot = paged_slot(call.rows[r].block_table, bs, pos);
            for (i64 h = 0; h < hkv; ++h)
              for (i64 e = 0; e < d; ++e) {
                const std::array<i64, 4> idx{slot / bs, slot % bs, h, e};
                *static_cast<float*>(cache.k.element_ptr(idx)) =
                    full_k[r].data_as<float>()[(pos * hkv + h) * d + e];
                *static_cast<float*>(cache.v.element_ptr(idx)) =
                    full_v[r].data_as<float>()[(pos * hkv + h) * d + e];
              }
          }
        }
        Tensor q = random_tensor({total_new, hq, d}, DType::F32, 300);
        Tensor kn = Tensor::empty({total_new, hkv, d}, DType::F32),
               vn = Tensor::empty({total_new, hkv, d}, DType::F32);
        i64 t0 = 0;
        for (std::size_t r = 0; r < seqs.size(); ++r) {
          const i64 n = call.rows[r].query_len, start = call.rows[r].kv_start_pos;
          std::memcpy(kn.data_as<float>() + t0 * hkv * d,
                      full_k[r].data_as<float>() + start * hkv * d, std::size_t(n * hkv * d) * 4);
          std::memcpy(vn.data_as<float>() + t0 * hkv * d,
                      full_v[r].data_as<float>() + start * hkv * d, std::size_t(n * hkv * d) * 4);
          t0 += n;
        }
        Tensor out = Tensor::zeros({total_new, hq, d}, DType::F32);
        Tensor lse = Tensor::zeros({hq, total_new}, DType::F32);
        call.q = q.view();
        call.k_new = kn.view();
        call.v_new = vn.view();
        call.out = out.view();
        call.lse = lse.view();
        for (const std::string& backend : paged_backends()) {
          SCOPED_TRACE(backend);
          std::fill(out.data_as<float>(), out.data_as<float>() + out.numel(), NAN);
          const Attention layer(testing::layer_config(backend, hq, hkv, d, causal));
          layer.forward_paged(call);
          // Dense attention on each logical sequence.
          t0 = 0;
          for (std::size_t r = 0; r < seqs.size(); ++r) {
            const i64 n = call.rows[r].query_len;
            AttentionConfig c;
            c.num_heads = hq;
            c.num_kv_heads = hkv;
            c.head_size = d;
            c.causal = causal;
            c.softmax_scale = 0.3;
            c.backend = "REFERENCE";
            c.qkv_layout = QkvLayout::THD;
            const TensorView fk = full_k[r].view(), fv = full_v[r].view();
            const auto thd = testing::without_batch_dim;
            const auto dense =
                Attention(c).forward(q.view().sliced(0, t0, n), thd(fk), thd(fv), {}, true);
            const auto diff = testing::compare(out.view().sliced(0, t0, n), dense.out.view());
            EXPECT_FALSE(diff.nan);
            EXPECT_LE(diff.max_abs, 1e-6);
            EXPECT_LE(testing::compare(lse.view().sliced(1, t0, n), dense.lse->view()).max_abs,
                      1e-5);
            t0 += n;
          }
        }
      }
}

// Every paged backend against REFERENCE on the same pool: half-precision pages, GQA 4:1, a head
// size that is no multiple of a SIMD width, odd lengths, many rows, causal or not.
TEST(Paged, HalfPrecisionPagesWithGqaMatchReference) {
  const i64 hq = 8, hkv = 2, d = 80, bs = 16, blocks = 40;
  for (const DType dtype : {DType::BF16, DType::F16, DType::F32})
    for (const bool causal : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (causal ? " causal" : ""));
      Tensor pool_k = random_tensor({blocks, bs, hkv, d}, dtype, 1);
      Tensor pool_v = random_tensor({blocks, bs, hkv, d}, dtype, 2);
      std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), std::mt19937(5));
      // {seq_len, new rows}: a long cached prefix, a fresh sequence, a single query.
      const std::vector<std::pair<i64, i64>> seqs{{301, 77}, {45, 45}, {133, 1}};
      std::vector<PagedRow> rows;
      std::size_t next = 0;
      i64 total = 0;
      for (const auto& [len, fresh] : seqs) {
        PagedRow r{fresh, len, len - fresh, {}};
        for (i64 pg = 0; pg < (len + bs - 1) / bs; ++pg) r.block_table.push_back(ids[next++]);
        rows.push_back(r);
        total += fresh;
      }
      const Tensor q = random_tensor({total, hq, d}, dtype, 3);
      const Tensor kn = random_tensor({total, hkv, d}, dtype, 4);
      const Tensor vn = random_tensor({total, hkv, d}, dtype, 5);
      const auto run = [&](const std::string& backend, Tensor& pk, Tensor& pv) {
        PagedAttentionCall call;
        Tensor out = Tensor::zeros({total, hq, d}, dtype);
        Tensor lse = Tensor::zeros({hq, total}, DType::F32);
        call.q = q.view(), call.k_new = kn.view(), call.v_new = vn.view();
        call.out = out.view(), call.lse = lse.view();
        call.cache = {pk.view(), pv.view()};
        call.rows = rows;
        call.causal = causal;
        call.softmax_scale = 1.0 / std::sqrt(double(d));
        Attention(testing::layer_config(backend, hq, hkv, d, causal)).forward_paged(call);
        return std::pair{out, lse};
      };
      Tensor ref_k = Tensor::copy_of(pool_k.view()), ref_v = Tensor::copy_of(pool_v.view());
      const auto want = run("REFERENCE", ref_k, ref_v);
      for (const std::string& backend : paged_backends()) {
        SCOPED_TRACE(backend);
        Tensor k = Tensor::copy_of(pool_k.view()), v = Tensor::copy_of(pool_v.view());
        const auto got = run(backend, k, v);
        EXPECT_TRUE(testing::bitwise_equal(k, ref_k)) << "new K written differently";
        EXPECT_TRUE(testing::bitwise_equal(v, ref_v)) << "new V written differently";
        const auto diff = testing::compare(got.first.view(), want.first.view());
        EXPECT_FALSE(diff.nan);
        EXPECT_LE(diff.normwise_rel, testing::tolerance_for(dtype));
        EXPECT_LE(testing::compare(got.second.view(), want.second.view()).max_abs, 1e-4);
      }
    }
}

TEST(Paged, InvalidCallsRaiseAndLeaveThePoolUntouched) {
  const i64 hkv = 1, d = 4, bs = 4, blocks = 4;
  MultiLayerCache cache = make_cache(false, 1, 0, blocks, bs, hkv, d);
  for (i64 n = 0; n < cache.storage.numel(); ++n) cache.storage.data_as<float>()[n] = float(n);
  const Tensor before = Tensor::copy_of(cache.storage.view());
  Tensor q = random_tensor({4, 1, d}, DType::F32, 1), kn = random_tensor({4, 1, d}, DType::F32, 2);
  Tensor out = Tensor::zeros({4, 1, d}, DType::F32);
  for (const std::string& backend : paged_backends()) {
    SCOPED_TRACE(backend);
    const Attention layer(testing::layer_config(backend, 1, 1, d, false));
    const auto call_with = [&](std::vector<PagedRow> rows, bool causal = false) {
      PagedAttentionCall c;
      c.q = q.view();
      c.k_new = kn.view();
      c.v_new = kn.view();
      c.out = out.view();
      c.cache = {cache.k, cache.v};
      c.rows = std::move(rows);
      c.causal = causal;
      return c;
    };
    const std::vector<std::vector<PagedRow>> bad{
        {{4, 3, 0, {0}}},                  // kv_start_pos + query_len > seq_len
        {{4, 9, 0, {0, 1}}},               // table too short for seq_len
        {{4, 4, 0, {7}}},                  // page id outside the pool
        {{2, 2, 0, {1}}, {2, 2, 0, {1}}},  // two rows write the same slots
        {{3, 4, 0, {0}}},                  // total rows 3 != 4 packed rows
        {{-1, 4, 0, {0}}},
    };
    for (const auto& rows : bad) {
      EXPECT_THROW(layer.forward_paged(call_with(rows)), InvalidArgument);
      EXPECT_TRUE(testing::bitwise_equal(cache.storage, before));
    }
    EXPECT_THROW(layer.forward_paged(call_with({{4, 8, 2, {0, 1}}}, true)), InvalidArgument);
    EXPECT_TRUE(testing::bitwise_equal(cache.storage, before));
  }
}

}  // namespace
}  // namespace dattn
