#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <tuple>

#include "dattn/attention.hpp"
#include "dattn/engines.hpp"
#include "dattn/errors.hpp"
#include "dattn/page_pool.hpp"
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
  // Exact backends: these compare to 1e-6 (SAGE's paged calls are held to its accuracy by
  // PagedConformance).
  for (const auto& b : Registry::global().all())
    if (b->supports_paged_kv() && b->exact()) names.push_back(b->name());
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
      std::string ran;  // the engine of run()'s latest call
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
        Attention layer(testing::layer_config(backend, hq, hkv, d, causal));
        layer.forward_paged(call);
        ran = layer.last_engine();
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
        // bf16 / f16 calls FLASH's automatic rule puts on the 16-bit integer lanes (where they
        // outrun the float mixes): logits of 13-bit codes, the LSE within 1e-3
        // (docs/semantics.md, "16-bit integer lanes").
        const std::vector<EngineInfo> engines = flash_engines();
        const bool int16 = std::any_of(engines.begin(), engines.end(), [&](const EngineInfo& e) {
          return e.name == ran && e.compute_dtype == "int16";
        });
        EXPECT_LE(testing::compare(got.second.view(), want.second.view()).max_abs,
                  int16 ? 1e-3 : 1e-4)
            << ran;
      }
    }
}

// A NaN or inf in the new V of one token reaches only the rows that see it (causal: the rows
// at or after its position; docs/semantics.md, "Finite masks and non-finite inputs"): they are
// NaN with LSE NaN, the earlier rows keep the bits they have with clean values.
TEST(Paged, NonFiniteNewValuesReachOnlyTheRowsThatSeeThem) {
  const i64 hq = 4, hkv = 2, d = 48, bs = 16, blocks = 16, len = 200, fresh = 120, bad = 50;
  for (const DType dtype : {DType::F32, DType::BF16})
    for (const float garbage : {NAN, INFINITY}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + std::to_string(garbage));
      const Tensor pool_k = random_tensor({blocks, bs, hkv, d}, dtype, 11);
      const Tensor pool_v = random_tensor({blocks, bs, hkv, d}, dtype, 12);
      PagedRow r{fresh, len, len - fresh, {}};
      for (i64 pg = 0; pg < (len + bs - 1) / bs; ++pg)
        r.block_table.push_back(std::int32_t(blocks - 1 - pg));
      const Tensor q = random_tensor({fresh, hq, d}, dtype, 13);
      const Tensor kn = random_tensor({fresh, hkv, d}, dtype, 14);
      const Tensor vn = random_tensor({fresh, hkv, d}, dtype, 15);
      Tensor vn_bad = Tensor::copy_of(vn.view());
      for (i64 e = 0; e < d; e += 5)
        store_from_f32(vn_bad.data(), dtype, bad * hkv * d + e, garbage);
      const auto run = [&](const std::string& backend, const Tensor& v_new) {
        Tensor pk = Tensor::copy_of(pool_k.view()), pv = Tensor::copy_of(pool_v.view());
        Tensor out = Tensor::zeros({fresh, hq, d}, dtype);
        Tensor lse = Tensor::zeros({hq, fresh}, DType::F32);
        PagedAttentionCall call;
        call.q = q.view(), call.k_new = kn.view(), call.v_new = v_new.view();
        call.out = out.view(), call.lse = lse.view();
        call.cache = {pk.view(), pv.view()};
        call.rows = {r};
        call.causal = true;
        call.softmax_scale = 1.0 / std::sqrt(double(d));
        Attention(testing::layer_config(backend, hq, hkv, d, true)).forward_paged(call);
        return std::pair{out, lse};
      };
      for (const std::string& backend : paged_backends()) {
        SCOPED_TRACE(backend);
        const auto clean = run(backend, vn);
        const auto got = run(backend, vn_bad);
        const std::size_t es = dtype_size(dtype);
        for (i64 t = 0; t < fresh; ++t)
          for (i64 h = 0; h < hq; ++h) {
            const float lse = got.second.data_as<float>()[h * fresh + t];
            const i64 row = (t * hq + h) * d;
            // Rows of KV head 0's query heads at or after the token see it (the garbage sits
            // in KV head 0 only).
            if (t >= bad && h / (hq / hkv) == 0) {
              EXPECT_TRUE(std::isnan(lse)) << t << " " << h;
              for (i64 e = 0; e < d; ++e)
                ASSERT_TRUE(std::isnan(load_as_f32(got.first.data(), dtype, row + e))) << t;
            } else {
              ASSERT_EQ(
                  std::memcmp(static_cast<const char*>(got.first.data()) + row * es,
                              static_cast<const char*>(clean.first.data()) + row * es, d * es),
                  0)
                  << t << " " << h;
              EXPECT_EQ(lse, clean.second.data_as<float>()[h * fresh + t]);
            }
          }
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

// int8 / fp8 pages: values round-trip within the format's bound (also after a later call grows
// a page's scale), attention stays close to f32 pages, and every paged backend reads the codes
// alike.
TEST(Paged, QuantizedPagesRoundTripAndAttendCloseToF32) {
  const i64 hq = 4, hkv = 2, d = 64, bs = 16, blocks = 24, seq = 200;
  for (const DType code : {DType::I8, DType::FP8_E4M3}) {
    SCOPED_TRACE(dtype_name(code));
    Tensor pk = Tensor::zeros({blocks, bs, hkv, d}, code),
           pv = Tensor::zeros({blocks, bs, hkv, d}, code);
    Tensor ks = Tensor::zeros({blocks, hkv}, DType::F32),
           vs = Tensor::zeros({blocks, hkv}, DType::F32);
    Tensor fk = Tensor::zeros({blocks, bs, hkv, d}, DType::F32),
           fv = Tensor::zeros({blocks, bs, hkv, d}, DType::F32);
    std::vector<std::int32_t> table(static_cast<std::size_t>(blocks));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(3));
    const Tensor k_all = random_tensor({seq, hkv, d}, DType::F32, 7);
    Tensor v_all = random_tensor({seq, hkv, d}, DType::F32, 8);
    // The second call's values are 4x larger: pages shared with the first call grow their scale.
    for (i64 n = 150 * hkv * d; n < v_all.numel(); ++n) v_all.data_as<float>()[n] *= 4.0f;
    const auto step = [&](i64 start, i64 fresh, const std::string& backend, Tensor& out) {
      const Tensor q = random_tensor({fresh, hq, d}, DType::F32, 9 + unsigned(start));
      PagedAttentionCall call;
      call.q = q.view();
      call.k_new = k_all.view().sliced(0, start, fresh);
      call.v_new = v_all.view().sliced(0, start, fresh);
      call.out = out.view();
      call.rows = {{fresh, start + fresh, start, table}};
      call.softmax_scale = 0.125;
      const Attention layer(testing::layer_config(backend, hq, hkv, d));
      call.cache = {pk.view(), pv.view(), ks.view(), vs.view()};
      layer.forward_paged(call);
      call.cache = {fk.view(), fv.view()};
      Tensor f32_out = Tensor::zeros({fresh, hq, d}, DType::F32);
      call.out = f32_out.view();
      layer.forward_paged(call);
      return f32_out;
    };
    for (const std::string& backend : paged_backends()) {
      SCOPED_TRACE(backend);
      Tensor out1 = Tensor::zeros({150, hq, d}, DType::F32),
             out2 = Tensor::zeros({50, hq, d}, DType::F32);
      const Tensor want1 = step(0, 150, backend, out1);
      const Tensor want2 = step(150, 50, backend, out2);
      // Round trip of every written value, against the bound of its page's final scale.
      double worst = 0;
      for (i64 pos = 0; pos < seq; ++pos) {
        const i64 slot = paged_slot(table, bs, pos);
        for (i64 h = 0; h < hkv; ++h)
          for (i64 e = 0; e < d; ++e)
            for (const auto& [pages, scales, src] :
                 {std::tuple<const Tensor*, const Tensor*, const Tensor*>{&pk, &ks, &k_all},
                  std::tuple<const Tensor*, const Tensor*, const Tensor*>{&pv, &vs, &v_all}}) {
              const float x = src->template data_as<float>()[(pos * hkv + h) * d + e];
              const float got =
                  paged_value(pages->view(), scales->view(), slot / bs, slot % bs, h, e);
              const float scale = scales->template data_as<float>()[(slot / bs) * hkv + h];
              // int8: half a step, twice (a value re-encoded when its page's scale grew).
              // fp8: 2^-4 relative (3 mantissa bits), twice, or half a subnormal step.
              const double bound = code == DType::I8
                                       ? double(scale)
                                       : std::max(std::fabs(x) * 0.13, double(scale) * 0x1p-9);
              worst = std::max(worst, std::fabs(got - x) / bound);
            }
      }
      EXPECT_LE(worst, 1.0);
      // What one scale per (page, head) allows on N(0, 1) inputs: int8 steps of absmax / 127
      // (~0.8% rms per value) and fp8's 3 mantissa bits (~3.6% rms) give 1.1e-2 and 3.8e-2
      // here, through both the logits and the values.
      const double limit = code == DType::I8 ? 1.5e-2 : 5e-2;
      EXPECT_LE(testing::compare(out1.view(), want1.view()).normwise_rel, limit);
      EXPECT_LE(testing::compare(out2.view(), want2.view()).normwise_rel, limit);
      // Reset the pools for the next backend.
      std::fill(ks.data_as<float>(), ks.data_as<float>() + ks.numel(), 0.0f);
      std::fill(vs.data_as<float>(), vs.data_as<float>() + vs.numel(), 0.0f);
    }
  }
}

TEST(Paged, QuantizedPagesNeedTheirScales) {
  Tensor pk = Tensor::zeros({2, 4, 1, 8}, DType::I8), pv = Tensor::zeros({2, 4, 1, 8}, DType::F32);
  Tensor q = random_tensor({3, 1, 8}, DType::F32, 1), kn = random_tensor({3, 1, 8}, DType::F32, 2);
  Tensor out = Tensor::zeros({3, 1, 8}, DType::F32);
  PagedAttentionCall call;
  call.q = q.view(), call.k_new = kn.view(), call.v_new = kn.view(), call.out = out.view();
  call.rows = {{3, 3, 0, {1}}};
  call.cache = {pk.view(), pv.view()};
  for (const std::string& backend : paged_backends()) {
    try {
      Attention(testing::layer_config(backend, 1, 1, 8)).forward_paged(call);
      ADD_FAILURE() << backend << " accepted int8 pages without scales";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.field(), "cache.k_scales");
    }
  }
}

TEST(PagePool, AllocatesFreesAndReportsCapacity) {
  PagePoolConfig c;
  c.num_blocks = 6, c.block_size = 4, c.kv_heads = 2, c.head_size = 8, c.layers = 3;
  PagePool pool(c);
  EXPECT_EQ(pool.capacity(), 6);
  const auto a = pool.allocate(4);
  EXPECT_EQ(a, (std::vector<std::int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(pool.free_pages(), 2);
  EXPECT_THROW(pool.allocate(3), Unsupported);
  EXPECT_EQ(pool.free_pages(), 2);  // nothing taken
  const std::vector<std::int32_t> back{1, 3};
  pool.free(back);
  EXPECT_EQ(pool.allocate(3), (std::vector<std::int32_t>{1, 3, 4}));
  const std::vector<std::int32_t> twice{0, 0}, stranger{5};
  EXPECT_THROW(pool.free(twice), InvalidArgument);
  EXPECT_THROW(pool.free(stranger), InvalidArgument);
  EXPECT_TRUE(pool.is_allocated(0));  // nothing freed by the failed calls
  EXPECT_EQ(pool.bytes(), std::size_t(2 * 3 * 6 * 4 * 2 * 8 * 4));
  c.block_size = 0;
  try {
    PagePool bad(c);
    ADD_FAILURE() << "block_size 0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.field(), "block_size");
  }
}

// Both layouts give every layer its own pages: writing layer 1 leaves layers 0 and 2 alone, and
// paged attention through either layout equals dense attention (every paged backend).
TEST(PagePool, LayersOfBothLayoutsAreIndependentAndAttendCorrectly) {
  for (const CacheLayout layout : {CacheLayout::layer_outermost, CacheLayout::block_outermost}) {
    PagePoolConfig c;
    c.num_blocks = 8, c.block_size = 16, c.kv_heads = 2, c.head_size = 32, c.layers = 3;
    c.layout = layout;
    PagePool pool(c);
    const std::int64_t hq = 4, seq = 50;
    const auto table = pool.allocate(4);
    const Tensor q = random_tensor({seq, hq, 32}, DType::F32, 1);
    const Tensor k = random_tensor({seq, 2, 32}, DType::F32, 2);
    const Tensor v = random_tensor({seq, 2, 32}, DType::F32, 3);
    for (const std::string& backend : paged_backends()) {
      SCOPED_TRACE(backend);
      Tensor out = Tensor::zeros({seq, hq, 32}, DType::F32);
      PagedAttentionCall call;
      call.q = q.view(), call.k_new = k.view(), call.v_new = v.view(), call.out = out.view();
      call.cache = pool.layer(1);
      call.rows = {{seq, seq, 0, table}};
      call.softmax_scale = 0.2;
      Attention(testing::layer_config(backend, hq, 2, 32)).forward_paged(call);
      for (const std::int64_t other : {0, 2}) {
        const PagedKvCache o = pool.layer(other);
        for (std::int64_t pg = 0; pg < 8; ++pg)
          EXPECT_EQ(paged_value(o.k_pages, o.k_scales, pg, 3, 1, 5), 0.0f);
      }
      AttentionConfig dc = testing::layer_config("REFERENCE", hq, 2, 32);
      dc.qkv_layout = QkvLayout::THD;
      dc.softmax_scale = 0.2;
      const auto dense = Attention(dc).forward(q.view(), k.view(), v.view());
      EXPECT_LE(testing::compare(out.view(), dense.out.view()).normwise_rel, 1e-5);
    }
  }
}

// Attention::last_engine(): the engine of the plan that ran the layer's latest call, dense or
// paged; empty before the first call and for a backend without engines.
TEST(Attention, LastEngineNamesTheEngineThatRanTheLatestCall) {
  const std::int64_t hq = 2, seq = 20, d = 16;
  const Tensor q = random_tensor({1, seq, hq, d}, DType::F32, 1);
  const Tensor k = random_tensor({1, seq, hq, d}, DType::F32, 2);
  const Tensor v = random_tensor({1, seq, hq, d}, DType::F32, 3);

  AttentionConfig c = testing::layer_config("FLASH", hq, hq, d);
  c.backend_options["isa"] = std::string("portable");
  const Attention flash(c);
  EXPECT_EQ(flash.last_engine(), "");
  (void)flash.forward(q.view(), k.view(), v.view());
  EXPECT_EQ(flash.last_engine(), "portable");

  // compute_dtype bf16 on f32 inputs under the emulated cap: the emulated bf16 engine.
  c.backend_options["isa"] = std::string("avx512_bf16_emulated");
  c.backend_options["compute_dtype"] = std::string("bf16");
  const Attention emulated(c);
  (void)emulated.forward(q.view(), k.view(), v.view());
  EXPECT_EQ(emulated.last_engine(), "avx512_bf16_emulated");

  const Attention reference(testing::layer_config("REFERENCE", hq, hq, d));
  (void)reference.forward(q.view(), k.view(), v.view());
  EXPECT_EQ(reference.last_engine(), "");

  // A paged call plans inside FLASH's forward_paged: its engine is reported all the same.
  PagePoolConfig pc;
  pc.num_blocks = 2, pc.block_size = 16, pc.kv_heads = hq, pc.head_size = d;
  PagePool pool(pc);
  Tensor out = Tensor::zeros({seq, hq, d}, DType::F32);
  PagedAttentionCall call;
  const auto rows = [&](const Tensor& t) { return TensorView(t.data(), DType::F32, {seq, hq, d}); };
  call.q = rows(q), call.k_new = rows(k), call.v_new = rows(v), call.out = out.view();
  call.cache = pool.layer(0);
  call.rows = {{seq, seq, 0, pool.allocate(2)}};
  AttentionConfig pc_config = testing::layer_config("FLASH", hq, hq, d);
  pc_config.backend_options["isa"] = std::string("portable");
  const Attention paged(pc_config);
  paged.forward_paged(call);
  EXPECT_EQ(paged.last_engine(), "portable");
}

// A denoising step on the cached prefix equals a full dense recompute of the target rows.
TEST(PrefixCache, LaterStepsReuseThePrefixAndEqualDenseRecompute) {
  PagePoolConfig c;
  c.num_blocks = 20, c.block_size = 16, c.kv_heads = 1, c.head_size = 64;
  PagePool pool(c);
  const std::int64_t prefix = 77, target = 45, all = prefix + target, hq = 2;
  PrefixCache cache(pool, prefix, target);
  Tensor k = random_tensor({all, 1, 64}, DType::F32, 1),
         v = random_tensor({all, 1, 64}, DType::F32, 2);
  for (const std::string& backend : paged_backends()) {
    SCOPED_TRACE(backend);
    const Attention layer(testing::layer_config(backend, hq, 1, 64));
    // Step 0: everything.
    const Tensor q0 = random_tensor({all, hq, 64}, DType::F32, 3);
    Tensor out0 = Tensor::zeros({all, hq, 64}, DType::F32);
    PagedAttentionCall call;
    call.cache = pool.layer(0);
    call.softmax_scale = 0.125;
    call.q = q0.view(), call.k_new = k.view(), call.v_new = v.view(), call.out = out0.view();
    call.rows = {cache.first_step()};
    layer.forward_paged(call);
    // Steps 1-2: new target K/V and queries; the prefix pages are reused.
    for (unsigned step = 1; step <= 2; ++step) {
      Tensor kt = random_tensor({target, 1, 64}, DType::F32, 10 + step);
      Tensor vt = random_tensor({target, 1, 64}, DType::F32, 20 + step);
      const Tensor qt = random_tensor({target, hq, 64}, DType::F32, 30 + step);
      Tensor out = Tensor::zeros({target, hq, 64}, DType::F32);
      call.q = qt.view(), call.k_new = kt.view(), call.v_new = vt.view(), call.out = out.view();
      call.rows = {cache.next_step()};
      layer.forward_paged(call);
      // Dense recompute on [prefix | new target].
      Tensor fk = Tensor::copy_of(k.view()), fv = Tensor::copy_of(v.view());
      copy_into(kt.view(), fk.view().sliced(0, prefix, target));
      copy_into(vt.view(), fv.view().sliced(0, prefix, target));
      AttentionConfig dc = testing::layer_config("REFERENCE", hq, 1, 64);
      dc.qkv_layout = QkvLayout::THD;
      dc.softmax_scale = 0.125;
      const auto dense = Attention(dc).forward(qt.view(), fk.view(), fv.view());
      EXPECT_LE(testing::compare(out.view(), dense.out.view()).normwise_rel, 1e-5);
    }
  }
}

// The chunk window: which chunks a new chunk sees and which pages are freed.
TEST(ChunkWindow, VisibleChunksAndFreedPagesForEveryWindowAndSink) {
  for (const auto& [window, sink] :
       {std::pair<std::int64_t, std::int64_t>{1, 0}, {2, 1}, {4, 0}, {4, 2}, {30, 3}, {51, 1}}) {
    SCOPED_TRACE("window " + std::to_string(window) + ", sink " + std::to_string(sink));
    PagePoolConfig c;
    c.num_blocks = 2 * (window + sink + 2), c.block_size = 4, c.kv_heads = 1, c.head_size = 8;
    PagePool pool(c);
    ChunkWindow w(pool, 8, window, sink);  // 2 pages per chunk
    const std::int64_t total = window + sink + 12;
    for (std::int64_t n = 0; n < total; ++n) {
      // Before chunk n: it sees chunks [0, sink) and [n - window, n).
      std::vector<std::int64_t> want;
      for (std::int64_t ch = 0; ch < n; ++ch)
        if (ch < sink || ch >= n - window) want.push_back(ch);
      ASSERT_EQ(w.visible_chunks(), want);
      for (int pass = 0; pass < 3; ++pass) {  // denoising passes reuse the same scratch pages
        const PagedRow row = w.pass();
        ASSERT_EQ(row.query_len, 8);
        ASSERT_EQ(row.seq_len, 8 * (std::int64_t(want.size()) + 1));
        ASSERT_EQ(row.kv_start_pos, row.seq_len - 8);
        ASSERT_EQ(row.block_table.size(), std::size_t(2 * (want.size() + 1)));
      }
      w.commit();
      // Held pages: exactly the chunks a later chunk can still see.
      std::int64_t held = 0;
      for (std::int64_t ch = 0; ch <= n; ++ch) {
        const bool kept = ch < sink || ch >= n + 1 - window;
        ASSERT_EQ(w.chunk_pages(ch).empty(), !kept) << "chunk " << ch;
        held += kept ? 2 : 0;
        for (const std::int32_t pg : w.chunk_pages(ch)) ASSERT_TRUE(pool.is_allocated(pg));
      }
      ASSERT_EQ(pool.free_pages(), pool.capacity() - held);
    }
    // A discarded pass returns its scratch pages.
    const std::int64_t before = pool.free_pages();
    (void)w.pass();
    w.discard();
    EXPECT_EQ(pool.free_pages(), before);
  }
}

// Piecewise causal/full attention on a paged call equals the dense piecewise call on the
// logical sequence (every paged backend).
TEST(Paged, PiecewiseSpansMatchDensePiecewiseAttention) {
  const i64 hq = 2, hkv = 1, d = 32, bs = 16, seq = 90, fresh = 40;
  const std::vector<std::pair<i64, i64>> spans{{3, 20}, {55, 70}};
  PagePoolConfig c;
  c.num_blocks = 8, c.block_size = bs, c.kv_heads = hkv, c.head_size = d;
  PagePool pool(c);
  const auto table = pool.allocate(6);
  const Tensor k = random_tensor({seq, hkv, d}, DType::F32, 1);
  const Tensor v = random_tensor({seq, hkv, d}, DType::F32, 2);
  const Tensor q = random_tensor({seq, hq, d}, DType::F32, 3);
  // Dense piecewise over the whole sequence.
  AttentionConfig dc = testing::layer_config("REFERENCE", hq, hkv, d, true);
  dc.qkv_layout = QkvLayout::THD;
  dc.softmax_scale = 0.25;
  AttentionMetadata meta;
  meta.full_attn_spans = FullAttnSpans{spans};
  const auto dense = Attention(dc).forward(q.view(), k.view(), v.view(), meta);
  for (const std::string& backend : paged_backends()) {
    SCOPED_TRACE(backend);
    // Fill the first seq - fresh rows, then the last `fresh` rows query with spans.
    PagedAttentionCall call;
    call.cache = pool.layer(0);
    call.softmax_scale = 0.25;
    call.causal = true;
    call.full_attn_spans = spans;
    Tensor out1 = Tensor::zeros({seq - fresh, hq, d}, DType::F32);
    call.q = q.view().sliced(0, 0, seq - fresh), call.k_new = k.view().sliced(0, 0, seq - fresh);
    call.v_new = v.view().sliced(0, 0, seq - fresh), call.out = out1.view();
    call.rows = {{seq - fresh, seq - fresh, 0, table}};
    const Attention layer(testing::layer_config(backend, hq, hkv, d, true));
    layer.forward_paged(call);
    Tensor out2 = Tensor::zeros({fresh, hq, d}, DType::F32);
    call.q = q.view().sliced(0, seq - fresh, fresh),
    call.k_new = k.view().sliced(0, seq - fresh, fresh);
    call.v_new = v.view().sliced(0, seq - fresh, fresh), call.out = out2.view();
    call.rows = {{fresh, seq, seq - fresh, table}};
    layer.forward_paged(call);
    // The second call's rows (positions 50..89, span [55, 70) included) all match; of the
    // first call's, those in span [3, 20) and the causal ones after it.
    EXPECT_LE(
        testing::compare(out2.view(), dense.out.view().sliced(0, seq - fresh, fresh)).normwise_rel,
        1e-5);
    EXPECT_LE(testing::compare(out1.view().sliced(0, 0, 40), dense.out.view().sliced(0, 0, 40))
                  .normwise_rel,
              1e-5);
  }
  PagedAttentionCall bad;
  bad.full_attn_spans = {{5, 3}};
  bad.causal = true;
  EXPECT_THROW(validate_paged_call(bad, hq, hkv, d), InvalidArgument);
}

}  // namespace
}  // namespace dattn
