// Validation at the edges of the integer range (docs/semantics.md, "Errors": no input, however
// malformed, may crash the process): positions and video layouts whose sums overflow, error
// messages about huge vectors, thread counts, and plans that must follow the caller's thread count.
#include <gtest/gtest.h>
#include <omp.h>

#include <array>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "dattn/attention.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/errors.hpp"
#include "dattn/paged.hpp"
#include "test_inputs.hpp"

namespace dattn {
namespace {

using i64 = std::int64_t;
using testing::random_tensor;

constexpr i64 B = 2, S = 6, H = 2, D = 8;
constexpr i64 kMax = std::numeric_limits<i64>::max();
constexpr i64 kBound = i64(1) << 62;  // kMaxPosition

struct Inputs {
  Tensor q = random_tensor({B, S, H, D}, DType::F32, 1);
  Tensor k = random_tensor({B, S, H, D}, DType::F32, 2);
  Tensor v = random_tensor({B, S, H, D}, DType::F32, 3);
  Tensor out = Tensor::zeros({B, S, H, D}, DType::F32);
};

// The field of the InvalidArgument that `meta` raises on `backend`; "<none>" when the call runs.
std::string field_of(const std::string& backend, bool causal, const AttentionMetadata& meta) {
  Inputs in;
  const Attention layer(testing::layer_config(backend, H, H, D, causal));
  try {
    layer.forward_into(in.q, in.k, in.v, meta, in.out);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(e.field()), std::string::npos) << e.what();
    EXPECT_LT(std::string(e.what()).size(), 1024u) << e.what();
    return e.field();
  }
  return "<none>";
}

AttentionMetadata with_layout(VideoTokenLayout layout) {
  AttentionMetadata m;
  m.video_layout = std::move(layout);
  return m;
}

VideoTokenLayout one_tail(i64 prefix, LatentGrid grid) {
  return VideoTokenLayout{prefix, grid, std::nullopt, {}};
}

VideoTokenLayout one_span(i64 used, i64 start, LatentGrid grid) {
  VideoTokenLayout l;
  l.used_len = used;
  l.video_spans = {{start, grid, VideoRole::target}};
  return l;
}

class VideoLayoutOverflow : public ::testing::TestWithParam<std::string> {};

// Every backend, dense ones included, rejects a layout whose arithmetic overflows or whose
// positions reach 2^62; VIDEO_SPARSE used to grow memory until allocation failed.
TEST_P(VideoLayoutOverflow, RaisesInvalidArgumentNamingTheField) {
  const std::string& backend = GetParam();
  EXPECT_EQ(field_of(backend, false, with_layout(one_tail(kMax, {1, 1, 1}))),
            "video_layout.prefix_len");
  EXPECT_EQ(field_of(backend, false, with_layout(one_tail(kMax - 3, {2, 2, 2}))),
            "video_layout.prefix_len");
  EXPECT_EQ(field_of(backend, false, with_layout(one_tail(kBound, {1, 1, 1}))),
            "video_layout.prefix_len");
  EXPECT_EQ(field_of(backend, false, with_layout(one_tail(0, {i64(1) << 30, 1 << 30, 1 << 30}))),
            "video_layout.latent_grid");
  EXPECT_EQ(field_of(backend, false, with_layout(one_tail(0, {i64(1) << 40, 1 << 20, 1 << 20}))),
            "video_layout.latent_grid");
  EXPECT_EQ(field_of(backend, false, with_layout(one_span(S, kMax - 3, {2, 2, 2}))),
            "video_layout.video_spans[0].start");
  EXPECT_EQ(field_of(backend, false, with_layout(one_span(S, kBound - 4, {2, 2, 2}))),
            "video_layout.video_spans[0].start");
  EXPECT_EQ(field_of(backend, false, with_layout(one_span(kMax, 0, {1, 2, 2}))),
            "video_layout.used_len");
  VideoTokenLayout two = one_span(S, 0, {1, 1, 2});
  two.video_spans.push_back({kMax - 1, {1, 1, 4}, VideoRole::reference});
  EXPECT_EQ(field_of(backend, false, with_layout(two)), "video_layout.video_spans[1].start");
  // A sound layout still runs.
  EXPECT_EQ(field_of(backend, false, with_layout(one_tail(2, {1, 2, 2}))), "<none>");
}

INSTANTIATE_TEST_SUITE_P(Backends, VideoLayoutOverflow,
                         ::testing::Values("FLASH", "REFERENCE", "VIDEO_SPARSE"));

class PositionBound : public ::testing::TestWithParam<std::string> {};

// Positions stay below 2^62 (kMaxPosition), sums included; beyond is InvalidArgument. FLASH
// used to return zero rows where REFERENCE attended every key.
TEST_P(PositionBound, StartsAndRangesPastTwoToThe62AreRejected) {
  const std::string& backend = GetParam();
  const auto field = [&](auto set) {
    AttentionMetadata m;
    set(m);
    return field_of(backend, true, m);
  };
  EXPECT_EQ(field([](AttentionMetadata& m) { m.q_global_start = kBound; }), "q_global_start");
  EXPECT_EQ(field([](AttentionMetadata& m) { m.q_global_start = kMax - 2; }), "q_global_start");
  EXPECT_EQ(field([](AttentionMetadata& m) { m.q_global_start = kBound - S + 1; }),
            "q_global_start");
  EXPECT_EQ(field([](AttentionMetadata& m) { m.k_global_start = kBound; }), "k_global_start");
  EXPECT_EQ(field([](AttentionMetadata& m) { m.k_global_start = kMax - 2; }), "k_global_start");
  EXPECT_EQ(field([](AttentionMetadata& m) {
              m.query_ranges = std::vector<QueryRange>{{0, S, kMax - 2}};
            }),
            "query_ranges");
  EXPECT_EQ(field([](AttentionMetadata& m) {
              m.query_ranges = std::vector<QueryRange>{{0, 3, 0}, {3, S, kBound - 1}};
            }),
            "query_ranges");
  // Spans whose end passes 2^62 (reachable before only through wrapped starts).
  EXPECT_NE(field([](AttentionMetadata& m) {
              m.k_global_start = kMax - 2;
              m.q_global_start = kMax - S;
              m.full_attn_spans = FullAttnSpans{{{kBound, kMax - 1}}, {{kBound, kMax - 1}}};
            }),
            "<none>");
  // The largest valid positions run, and both backends agree on them.
  EXPECT_EQ(field([](AttentionMetadata& m) {
              m.q_global_start = kBound - S;
              m.k_global_start = kBound - S;
            }),
            "<none>");
}

INSTANTIATE_TEST_SUITE_P(Backends, PositionBound, ::testing::Values("FLASH", "REFERENCE"));

TEST(PositionBound, LargestPositionsGiveTheSameResultOnFlashAndReference) {
  AttentionMetadata m;
  m.q_global_start = kBound - S - 2;
  m.k_global_start = kBound - S;  // the first two query rows see no key
  std::vector<Tensor> outs;
  for (const char* backend : {"FLASH", "REFERENCE"}) {
    Inputs in;
    Attention(testing::layer_config(backend, H, H, D, true))
        .forward_into(in.q, in.k, in.v, m, in.out);
    outs.push_back(in.out);
  }
  EXPECT_LT(testing::compare(outs[0], outs[1]).max_abs, 1e-5);
  // Row 0 sees nothing (zeros), row 2 sees key 0 only (its value row).
  EXPECT_EQ(outs[0].data_as<float>()[0], 0.0f);
  EXPECT_NE(outs[0].data_as<float>()[2 * H * D], 0.0f);
}

// A paged call of one row against a small pool, with `row` and `spans` as given.
std::string paged_field(const PagedRow& row, std::vector<std::pair<i64, i64>> spans) {
  const i64 bs = 4, blocks = 4;
  Tensor kp = Tensor::zeros({blocks, bs, H, D}, DType::F32);
  Tensor vp = Tensor::zeros({blocks, bs, H, D}, DType::F32);
  const i64 t = std::min<i64>(std::max<i64>(row.query_len, 0), 8);
  Tensor q = random_tensor({t, H, D}, DType::F32, 4);
  Tensor kn = random_tensor({t, H, D}, DType::F32, 5);
  Tensor vn = random_tensor({t, H, D}, DType::F32, 6);
  Tensor out = Tensor::zeros({t, H, D}, DType::F32);
  PagedAttentionCall call;
  call.cache = {kp.view(), vp.view()};
  call.q = q.view();
  call.k_new = kn.view();
  call.v_new = vn.view();
  call.out = out.view();
  call.rows = {row};
  call.causal = !spans.empty();
  call.full_attn_spans = std::move(spans);
  for (const char* backend : {"REFERENCE", "FLASH"}) {
    try {
      Attention(testing::layer_config(backend, H, H, D, call.causal)).forward_paged(call);
    } catch (const InvalidArgument& e) {
      return e.field();
    }
  }
  return "<none>";
}

TEST(PositionBound, PagedRowsAndSpansPastTwoToThe62AreRejected) {
  const std::vector<std::int32_t> table{0, 1, 2, 3};
  // kv_start_pos + query_len wraps below seq_len.
  EXPECT_EQ(paged_field({4, 8, kMax - 1, table}, {}), "rows[0]");
  // seq_len so large that the page count wraps: the table looked long enough.
  EXPECT_EQ(paged_field({1, kMax, 0, table}, {}), "rows[0]");
  EXPECT_EQ(paged_field({1, kBound + 1, kBound, table}, {}), "rows[0]");
  EXPECT_EQ(paged_field({2, 2, 0, table}, {{0, kBound + 1}}), "full_attn_spans");
  EXPECT_EQ(paged_field({2, 2, 0, table}, {{0, kBound}}), "<none>");
}

// A 2M-entry cu_seqlens that decreases once: the message quotes the entries, not the vector.
TEST(ErrorMessages, HugeVectorsAreQuotedByTheirOffendingEntries) {
  const i64 n = 2'000'000, bad = 1'500'000;
  std::vector<std::int32_t> cq(static_cast<std::size_t>(n)), ck(static_cast<std::size_t>(n));
  for (i64 i = 0; i < n; ++i) {
    cq[std::size_t(i)] = static_cast<std::int32_t>(std::min<i64>(i, S));
    ck[std::size_t(i)] = cq[std::size_t(i)];
  }
  cq[std::size_t(bad)] = 2;  // after 6: decreasing
  Tensor tq = testing::int32_tensor(cq), tk = testing::int32_tensor(ck);
  Tensor q = random_tensor({S, H, D}, DType::F32, 1), k = random_tensor({S, H, D}, DType::F32, 2);
  Tensor out = Tensor::zeros({S, H, D}, DType::F32);
  AttentionConfig cfg = testing::layer_config("REFERENCE", H, H, D);
  cfg.qkv_layout = QkvLayout::THD;
  const Attention layer(cfg);
  const auto message = [&](const AttentionMetadata& m, const std::string& field) {
    try {
      layer.forward_into(q, k, k, m, out);
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.field(), field) << std::string(e.what()).substr(0, 300);
      return std::string(e.what());
    }
    ADD_FAILURE() << "no error";
    return std::string();
  };
  AttentionMetadata m;
  m.extra.cu_seqlens_q = tq.view();
  m.extra.cu_seqlens_k = tk.view();
  m.extra.max_seqlen_q = S;
  m.extra.max_seqlen_k = S;
  std::string msg = message(m, "cu_seqlens_q");
  EXPECT_LT(msg.size(), 1024u) << msg.substr(0, 300);
  EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg.substr(0, 300);

  // A long packed_padding.cu_seqlens_q (it must be [0, q_length]).
  AttentionMetadata pm;
  Tensor two = testing::int32_tensor({0, S});
  pm.packed_padding = PackedPaddingMetadata{S, S, tk.view(), two.view()};
  msg = message(pm, "packed_padding.cu_seqlens_q");
  EXPECT_LT(msg.size(), 1024u) << msg.substr(0, 300);
  EXPECT_NE(msg.find("2000000 entries"), std::string::npos) << msg.substr(0, 300);
  // A short vector is still quoted whole.
  Tensor three = testing::int32_tensor({0, 1, S});
  pm.packed_padding = PackedPaddingMetadata{S, S, three.view(), two.view()};
  msg = message(pm, "packed_padding.cu_seqlens_q");
  EXPECT_NE(msg.find("[0, 1, 6]"), std::string::npos) << msg;
}

TEST(Threads, PeakMeasurementRejectsMoreThanTheLimit) {
  try {
    (void)measure_peak_gflops(100000, 0.01);
    ADD_FAILURE() << "100000 threads accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.field(), "threads");
    EXPECT_NE(std::string(e.what()).find("1024"), std::string::npos) << e.what();
  }
}

// The plans a layer made while running `calls` (thread counts), as DATTN_VERBOSE prints them.
std::string plans_made(const std::string& backend, const std::vector<int>& calls) {
  Inputs in;
  const AttentionConfig cfg = testing::layer_config(backend, H, H, D);
  const Attention layer(cfg);
  const int before = omp_get_max_threads();
  ::setenv("DATTN_VERBOSE", "1", 1);
  ::testing::internal::CaptureStderr();
  for (const int threads : calls) {
    omp_set_num_threads(threads);
    layer.forward_into(in.q, in.k, in.v, AttentionMetadata{}, in.out);
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  ::unsetenv("DATTN_VERBOSE");
  omp_set_num_threads(before);
  return log;
}

// A plan is cached by the problem's signature, which includes the calling context's thread
// count: a plan made on one thread does not make a later two-thread call run on one.
TEST(Threads, APlanFollowsTheCallersThreadCount) {
  for (const char* backend : {"FLASH", "VIDEO_SPARSE"}) {
    SCOPED_TRACE(backend);
    const std::string log = plans_made(backend, {1, 2, 1});
    EXPECT_NE(log.find("1 thread(s)"), std::string::npos) << log;
    EXPECT_NE(log.find("2 thread(s)"), std::string::npos) << log;
  }
}

// OMP_NUM_THREADS above the limit is clamped to it, not passed on to the OpenMP runtime.
TEST(Threads, OpenMpDefaultAboveTheLimitIsClamped) {
  const std::string log = plans_made("FLASH", {100000});
  EXPECT_NE(log.find("1024 thread(s)"), std::string::npos) << log;
}

// ---- memory the views describe (docs/semantics.md, "Tensors") ----

// The field of the InvalidArgument that a call with these views raises, "<none>" when it runs;
// `out` must then hold what it held before.
std::string memory_field(const std::string& backend, const TensorView& q, const TensorView& k,
                         const TensorView& v, const TensorView& out) {
  const Attention layer(testing::layer_config(backend, H, H, D));
  try {
    layer.forward_into(q, k, v, AttentionMetadata{}, out);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(e.field()), std::string::npos) << e.what();
    return e.field();
  }
  return "<none>";
}

const char* const kDenseBackends[] = {"FLASH", "REFERENCE", "VIDEO_SPARSE"};

TEST(Memory, LyingViewsAreRefusedNamingTheTensor) {
  Inputs in;
  const std::array<i64, 4> shape{B, S, H, D};
  const std::array<i64, 4> huge{i64(1) << 62, i64(1) << 61, i64(1) << 60, 1};
  const TensorView null_q(nullptr, DType::F32, shape);
  const TensorView overflow_k(in.k.data(), DType::F32, shape, huge);
  const TensorView misaligned_v(static_cast<char*>(in.v.data()) + 1, DType::F32, shape);
  const TensorView null_out(nullptr, DType::F32, shape);
  for (const char* backend : kDenseBackends) {
    SCOPED_TRACE(backend);
    EXPECT_EQ(memory_field(backend, null_q, in.k, in.v, in.out), "query");
    EXPECT_EQ(memory_field(backend, in.q, overflow_k, in.v, in.out), "key");
    EXPECT_EQ(memory_field(backend, in.q, in.k, misaligned_v, in.out), "value");
    EXPECT_EQ(memory_field(backend, in.q, in.k, in.v, null_out), "out");
  }
  // An empty view may have a null pointer.
  const std::array<i64, 4> none{B, 0, H, D};
  const TensorView empty_q(nullptr, DType::F32, none);
  Tensor empty_out = Tensor::zeros({B, 0, H, D}, DType::F32);
  EXPECT_EQ(memory_field("FLASH", empty_q, in.k, in.v, empty_out), "<none>");
}

TEST(Memory, AnOutputThatOverlapsItselfOrAnInputIsRefusedBeforeAnythingIsWritten) {
  Inputs in;
  const std::array<i64, 4> shape{B, S, H, D};
  // One row of D floats seen as every row: an expanded tensor.
  Tensor row = random_tensor({D}, DType::F32, 9);
  const Tensor before = Tensor::copy_of(row);
  const std::array<i64, 4> expanded{0, 0, 0, 1};
  const TensorView self_overlap(row.data(), DType::F32, shape, expanded);
  // Out and K over one buffer, half a tensor apart: both dense, their bytes intersect.
  const i64 n = B * S * H * D;
  Tensor buffer = random_tensor({2 * n}, DType::F32, 10);
  const TensorView k_half(buffer.data(), DType::F32, shape);
  const TensorView out_half(buffer.data_as<float>() + n / 2, DType::F32, shape);
  const Tensor buffer_before = Tensor::copy_of(buffer);
  for (const char* backend : kDenseBackends) {
    SCOPED_TRACE(backend);
    EXPECT_EQ(memory_field(backend, in.q, in.k, in.v, self_overlap), "out");
    EXPECT_TRUE(testing::bitwise_equal(row, before));
    EXPECT_EQ(memory_field(backend, in.q, k_half, in.v, out_half), "out");
    EXPECT_EQ(memory_field(backend, in.q, in.k, in.v, in.k), "out");  // out is K itself
    EXPECT_EQ(memory_field(backend, in.q, in.k, in.v, in.v), "out");
    EXPECT_TRUE(testing::bitwise_equal(buffer, buffer_before));
  }
}

// Views that interleave in one buffer without sharing an element are accepted (overlap is not
// decided for views that are not dense), and out may be Q itself: each output row depends on its
// own query row alone.
TEST(Memory, InterleavedViewsAndOutIntoQueryComputeRight) {
  // [B, S, 4, H, D]: q, k, v and out are slices 0..3 of dim 2.
  Tensor packed = random_tensor({B, S, 4, H, D}, DType::F32, 11);
  const std::array<i64, 4> shape{B, S, H, D};
  const std::array<i64, 4> strides{S * 4 * H * D, 4 * H * D, D, 1};
  const auto slice = [&](i64 i) {
    return TensorView(packed.data_as<float>() + i * H * D, DType::F32, shape, strides);
  };
  const Tensor q = Tensor::copy_of(slice(0)), k = Tensor::copy_of(slice(1)),
               v = Tensor::copy_of(slice(2));
  const Attention ref(testing::layer_config("REFERENCE", H, H, D));
  Tensor want = Tensor::zeros({B, S, H, D}, DType::F32);
  ref.forward_into(q, k, v, AttentionMetadata{}, want);
  for (const char* backend : {"FLASH", "REFERENCE"}) {
    SCOPED_TRACE(backend);
    const Attention layer(testing::layer_config(backend, H, H, D));
    Tensor work = Tensor::copy_of(packed);
    const auto view = [&](i64 i) {
      return TensorView(work.data_as<float>() + i * H * D, DType::F32, shape, strides);
    };
    layer.forward_into(view(0), view(1), view(2), AttentionMetadata{}, view(3));
    EXPECT_LT(testing::compare(view(3), want).normwise_rel, 1e-5);
    Tensor q_in_place = Tensor::copy_of(q);
    layer.forward_into(q_in_place, k, v, AttentionMetadata{}, q_in_place);
    EXPECT_LT(testing::compare(q_in_place, want).normwise_rel, 1e-5);
  }
}

TEST(Memory, PagedCallsRefuseLyingAndOverlappingViews) {
  const i64 blocks = 4, bs = 4, t = 3;
  Tensor kp = Tensor::zeros({blocks, bs, H, D}, DType::F32);
  Tensor vp = Tensor::zeros({blocks, bs, H, D}, DType::F32);
  Tensor q = random_tensor({t, H, D}, DType::F32, 1), kn = random_tensor({t, H, D}, DType::F32, 2),
         vn = random_tensor({t, H, D}, DType::F32, 3), out = Tensor::zeros({t, H, D}, DType::F32);
  const Attention layer(testing::layer_config("FLASH", H, H, D));
  const auto field = [&](const TensorView& qv, const TensorView& ov, const TensorView& kpv) {
    PagedAttentionCall call{qv, kn,  vn,    ov, std::nullopt, PagedKvCache(kpv, vp),
                            {}, 1.0, false, {}};
    call.rows.push_back(PagedRow{t, t, 0, {0}});
    try {
      layer.forward_paged(call);
    } catch (const InvalidArgument& e) {
      return e.field();
    }
    return std::string("<none>");
  };
  const std::array<i64, 3> shape{t, H, D};
  EXPECT_EQ(field(TensorView(nullptr, DType::F32, shape), out, kp), "q");
  EXPECT_EQ(field(q, kn, kp), "out");  // out is k_new
  const std::array<i64, 3> zero{0, 0, 1};
  EXPECT_EQ(field(q, TensorView(out.data(), DType::F32, shape, zero), kp), "out");
  EXPECT_EQ(field(q, out, vp), "cache.v_pages");  // the K and V pages are one tensor
  EXPECT_EQ(field(q, out, kp), "<none>");
}

}  // namespace
}  // namespace dattn
