// VIDEO_SPARSE (docs/semantics.md, "Video token layout and VIDEO_SPARSE"): tiling, block selection
// and the block-sparse kernel against the reference backend under the equivalent token mask.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "dattn/attention.hpp"
#include "dattn/engines.hpp"
#include "dattn/errors.hpp"
#include "dattn/video_sparse.hpp"
#include "test_inputs.hpp"

namespace dattn {
namespace {

using i64 = std::int64_t;

std::vector<i64> tile_sizes(const VideoTiling& t) {
  std::vector<i64> s;
  for (const VideoBlock& b : t.blocks()) s.push_back(b.size());
  return s;
}

VideoTokenLayout one_tail(i64 prefix, LatentGrid g) {
  VideoTokenLayout l;
  l.prefix_len = prefix;
  l.latent_grid = g;
  return l;
}

TEST(VideoTiling, SpecExamples) {
  const VideoTiling a = VideoTiling::build(one_tail(0, {3, 10, 10}), 300, {4, 8, 8});
  EXPECT_EQ(tile_sizes(a), (std::vector<i64>{192, 48, 48, 12}));
  const VideoTiling b = VideoTiling::build(one_tail(0, {31, 22, 40}), 31 * 22 * 40, {4, 8, 8});
  EXPECT_EQ(b.blocks().size(), 120u);
  EXPECT_EQ(b.video_blocks(), 120);
  // Inside a tile, row-major (t, h, w): tile 0 of (3,10,10) starts with rows 0..7 then 10.
  EXPECT_EQ(a.order()[0], 0);
  EXPECT_EQ(a.order()[7], 7);
  EXPECT_EQ(a.order()[8], 10);
}

TEST(VideoTiling, PermutationRoundTripsAndSegmentsNeverShareABlock) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const auto pick = [&](i64 lo, i64 hi) {
      return std::uniform_int_distribution<i64>(lo, hi)(rng);
    };
    VideoTokenLayout layout;
    std::vector<std::pair<i64, i64>> segments;  // [begin, end) of each stretch, in rows
    i64 used = 0;
    if (trial % 2 == 0) {
      const LatentGrid g{pick(1, 6), pick(1, 9), pick(1, 9)};
      const i64 prefix = pick(0, 70);
      layout = one_tail(prefix, g);
      if (prefix > 0) segments.push_back({0, prefix});
      used = prefix + g[0] * g[1] * g[2];
      segments.push_back({prefix, used});
    } else {
      i64 at = 0;
      for (int s = 0, n = int(pick(1, 3)); s < n; ++s) {
        const i64 gap = pick(0, 20);
        if (gap > 0) segments.push_back({at, at + gap});
        at += gap;
        const LatentGrid g{pick(1, 4), pick(1, 6), pick(1, 6)};
        layout.video_spans.push_back(
            {at, g, s == 0 && n > 1 ? VideoRole::reference : VideoRole::target});
        segments.push_back({at, at + g[0] * g[1] * g[2]});
        at += g[0] * g[1] * g[2];
      }
      const i64 tail = pick(0, 15);
      if (tail > 0) segments.push_back({at, at + tail});
      used = at + tail;
      layout.used_len = used;
    }
    const i64 seq = used + pick(0, 9);
    const TileShape tile{pick(1, 4), pick(1, 4), pick(1, 4)};
    const VideoTiling t = VideoTiling::build(layout, seq, tile, pick(1, 32));
    ASSERT_EQ(t.used_len(), used);
    ASSERT_EQ(t.seq_len(), seq);
    // A permutation whose padding rows come last, in order.
    std::vector<i64> sorted = t.order();
    std::sort(sorted.begin(), sorted.end());
    for (i64 i = 0; i < seq; ++i) ASSERT_EQ(sorted[std::size_t(i)], i);
    for (i64 p = used; p < seq; ++p) ASSERT_EQ(t.order()[std::size_t(p)], p);
    // Blocks cover [0, used) in order; each lies inside one segment.
    i64 next = 0;
    for (const VideoBlock& b : t.blocks()) {
      ASSERT_EQ(b.begin, next);
      ASSERT_GT(b.size(), 0);
      next = b.end;
      const i64 first = t.order()[std::size_t(b.begin)];
      const auto seg = std::find_if(segments.begin(), segments.end(), [&](const auto& s) {
        return first >= s.first && first < s.second;
      });
      ASSERT_NE(seg, segments.end());
      for (i64 p = b.begin; p < b.end; ++p) {
        ASSERT_GE(t.order()[std::size_t(p)], seg->first);
        ASSERT_LT(t.order()[std::size_t(p)], seg->second);
      }
    }
    ASSERT_EQ(next, used);
    // untile(tile(x)) == x, along dimension 1 of a [2, S, 3, 5] tensor.
    const Tensor x = testing::random_tensor({2, seq, 3, 5}, DType::F32, 100u + unsigned(trial));
    const Tensor tiled = t.tile(x.view(), 1);
    const Tensor back = t.untile(tiled.view(), 1);
    ASSERT_TRUE(testing::bitwise_equal(back, x));
    const i64 p = t.position()[std::size_t(seq / 2)];
    EXPECT_EQ(tiled.data_as<float>()[(p * 3) * 5], x.data_as<float>()[((seq / 2) * 3) * 5]);
  }
}

TEST(VideoTiling, InvalidLayoutsNameTheField) {
  const auto field_of = [](const VideoTokenLayout& l, i64 seq) {
    try {
      (void)VideoTiling::build(l, seq, {4, 4, 4});
    } catch (const InvalidArgument& e) {
      return e.field();
    }
    return std::string("<none>");
  };
  // A one-tail layout that also states its used_len (vllm-omni's): the same layout when it is
  // prefix_len + t*h*w, an error naming used_len and the tail otherwise; with spans too, neither.
  VideoTokenLayout both = one_tail(3, {1, 2, 2});
  both.used_len = 7;
  EXPECT_EQ(field_of(both, 10), "<none>");
  EXPECT_EQ(VideoTiling::build(both, 10, {4, 4, 4}).used_len(),
            VideoTiling::build(one_tail(3, {1, 2, 2}), 10, {4, 4, 4}).used_len());
  both.used_len = 6;
  EXPECT_EQ(field_of(both, 10), "video_layout.used_len");
  try {
    (void)VideoTiling::build(both, 10, {4, 4, 4});
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("prefix_len = 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("used_len = 6"), std::string::npos) << e.what();
  }
  both.used_len = 7;
  both.video_spans = {{0, {1, 2, 2}, VideoRole::target}};
  EXPECT_EQ(field_of(both, 10), "video_layout");
  EXPECT_EQ(field_of(VideoTokenLayout{}, 10), "video_layout");
  EXPECT_EQ(field_of(one_tail(-1, {1, 2, 2}), 10), "video_layout.prefix_len");
  EXPECT_EQ(field_of(one_tail(0, {1, 0, 2}), 10), "video_layout.latent_grid");
  EXPECT_EQ(field_of(one_tail(8, {1, 2, 2}), 10), "video_layout");  // 12 rows > 10
  VideoTokenLayout spans;
  spans.used_len = 20;
  spans.video_spans = {{4, {1, 2, 2}, VideoRole::target}, {6, {1, 2, 2}, VideoRole::target}};
  EXPECT_EQ(field_of(spans, 20), "video_layout.video_spans[1]");  // overlaps
  spans.video_spans = {{4, {1, 2, 2}, VideoRole::target}};
  spans.used_len = 6;
  EXPECT_EQ(field_of(spans, 20), "video_layout.used_len");  // ends inside the span
  EXPECT_THROW((void)VideoTiling::build(one_tail(0, {1, 2, 2}), 10, {0, 4, 4}), InvalidArgument);
}

// ---- kernel ----

struct Case {
  i64 batch = 2, hq = 4, hkv = 1, d = 64, dv = 64;
  VideoTokenLayout layout = one_tail(5, {3, 5, 6});
  i64 seq = 5 + 90 + 7;  // 7 padding rows
  DType dtype = DType::F32;
};

struct SparseInputs {
  Tensor q, k, v, keep;
  AttentionMetadata meta;
};

SparseInputs inputs(const Case& c, std::uint32_t seed) {
  SparseInputs r;
  r.q = testing::random_tensor({c.batch, c.seq, c.hq, c.d}, c.dtype, seed);
  r.k = testing::random_tensor({c.batch, c.seq, c.hkv, c.d}, c.dtype, seed + 1);
  r.v = testing::random_tensor({c.batch, c.seq, c.hkv, c.dv}, c.dtype, seed + 2);
  // The trailing padding is masked, as a pipeline would.
  r.keep = Tensor::zeros({c.batch, c.seq}, DType::Bool);
  const i64 used = c.layout.used_length();
  for (i64 b = 0; b < c.batch; ++b)
    for (i64 j = 0; j < used; ++j) r.keep.data_as<std::uint8_t>()[b * c.seq + j] = 1;
  r.meta.attn_mask = r.keep.view();
  r.meta.video_layout = c.layout;
  return r;
}

AttentionConfig sparse_config(const Case& c, BackendOptions options) {
  AttentionConfig cfg = testing::layer_config("VIDEO_SPARSE", c.hq, c.hkv, c.d);
  cfg.backend_options = std::move(options);
  return cfg;
}

// The [B, H, S, S] token mask that `map` means under tiling `t`; padding rows and keys hidden.
Tensor token_mask(const BlockMap& map, const VideoTiling& t, i64 batch, i64 heads) {
  const i64 s = t.seq_len();
  Tensor m = Tensor::zeros({batch, heads, s, s}, DType::Bool);
  auto* bytes = m.data_as<std::uint8_t>();
  for (i64 b = 0; b < batch; ++b)
    for (i64 h = 0; h < heads; ++h)
      for (i64 qb = 0; qb < map.query_blocks; ++qb)
        for (std::int32_t kb : map.selected(b, h, qb)) {
          const VideoBlock& qbk = t.blocks()[std::size_t(qb)];
          const VideoBlock& kbk = t.blocks()[std::size_t(kb)];
          for (i64 pi = qbk.begin; pi < qbk.end; ++pi)
            for (i64 pj = kbk.begin; pj < kbk.end; ++pj)
              bytes[((b * heads + h) * s + t.order()[std::size_t(pi)]) * s +
                    t.order()[std::size_t(pj)]] = 1;
        }
  return m;
}

ForwardResult reference(const Case& c, const SparseInputs& r, const std::optional<Tensor>& mask) {
  AttentionConfig cfg = testing::layer_config("REFERENCE", c.hq, c.hkv, c.d);
  AttentionMetadata meta = r.meta;
  if (mask) meta.attn_mask = mask->view();
  return Attention(cfg).forward(r.q.view(), r.k.view(), r.v.view(), meta, true);
}

void expect_close(const ForwardResult& got, const ForwardResult& want, double tol) {
  const auto d = testing::compare(got.out.view(), want.out.view());
  EXPECT_FALSE(d.nan);
  EXPECT_LE(d.normwise_rel, tol) << "max abs " << d.max_abs;
  const auto l = testing::compare(got.lse->view(), want.lse->view());
  EXPECT_FALSE(l.nan);
  EXPECT_LE(l.max_abs, 1e-4);
}

TEST(VideoSparseKernel, EveryBlockSelectedEqualsDenseAttention) {
  for (const auto& [hq, hkv, d, dv] :
       {std::array<i64, 4>{4, 1, 64, 64}, {2, 2, 80, 40}, {3, 3, 59, 59}}) {
    Case c;
    c.hq = hq, c.hkv = hkv, c.d = d, c.dv = dv;
    SCOPED_TRACE(::testing::Message() << "H " << hq << ":" << hkv << " D " << d << " Dv " << dv);
    const SparseInputs r = inputs(c, 11);
    const Attention layer(sparse_config(c, {{"topk", i64(1000)}}));
    const ForwardResult got = layer.forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true);
    expect_close(got, reference(c, r, std::nullopt), 1e-5);
    // Padding rows are zero with LSE -inf.
    for (i64 e = 0; e < c.dv; ++e)
      EXPECT_EQ(got.out.data_as<float>()[((c.seq - 1) * c.hq) * c.dv + e], 0.0f);
    EXPECT_EQ(got.lse->data_as<float>()[c.seq - 1], -INFINITY);
  }
}

TEST(VideoSparseKernel, RandomExplicitMapEqualsReferenceUnderTheTokenMask) {
  for (const bool zero_prefix : {false, true}) {
    Case c;
    c.layout = one_tail(zero_prefix ? 0 : 9, {5, 7, 9});  // ragged edge tiles
    c.seq = c.layout.used_length() + 3;
    const VideoTiling t = VideoTiling::build(c.layout, c.seq, {4, 4, 4});
    const i64 nb = static_cast<i64>(t.blocks().size());
    Tensor map = testing::bool_tensor({c.batch, c.hq, nb, nb}, 5, 0.3);
    for (i64 row = 0; row < c.batch * c.hq * nb; ++row)  // every query block sees its own block
      map.data_as<std::uint8_t>()[row * nb + row % nb] = 1;
    const SparseInputs r = inputs(c, 21);
    const Attention layer(
        sparse_config(c, {{"selection", std::string("explicit")}, {"block_map", map.view()}}));
    const ForwardResult got = layer.forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true);
    // The same map through the public selection, expanded to tokens.
    AttentionProblem p;
    p.batch = c.batch, p.hq = c.hq;
    VideoSparseOptions o;
    o.selection = BlockSelection::explicit_map;
    o.block_map = map.view();
    const BlockMap m = select_blocks(p, {t, t}, o, nullptr);
    expect_close(got, reference(c, r, token_mask(m, t, c.batch, c.hq)), 1e-5);
  }
}

TEST(VideoSparseKernel, BlockIndicesAndCountsEqualTheSameBoolMap) {
  Case c;
  c.hq = c.hkv = 1;
  c.batch = 1;
  const VideoTiling t = VideoTiling::build(c.layout, c.seq, {4, 4, 4});
  const i64 nb = static_cast<i64>(t.blocks().size());
  Tensor map = Tensor::zeros({1, 1, nb, nb}, DType::Bool);
  std::vector<std::int32_t> idx, counts;
  for (i64 qb = 0; qb < nb; ++qb) {
    const std::vector<i64> pick{qb, (qb * 3 + 1) % nb};
    std::set<i64> unique(pick.begin(), pick.end());
    for (i64 kb : unique) map.data_as<std::uint8_t>()[qb * nb + kb] = 1;
    idx.push_back(std::int32_t(pick[0]));
    idx.push_back(std::int32_t(pick[1]));
    counts.push_back(2);
  }
  Tensor ti = Tensor::empty({1, 1, nb, 2}, DType::I32), tc = Tensor::empty({1, 1, nb}, DType::I32);
  std::copy(idx.begin(), idx.end(), ti.data_as<std::int32_t>());
  std::copy(counts.begin(), counts.end(), tc.data_as<std::int32_t>());
  const SparseInputs r = inputs(c, 3);
  const auto run = [&](BackendOptions o) {
    return Attention(sparse_config(c, std::move(o)))
        .forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true);
  };
  const ForwardResult a = run({{"selection", std::string("explicit")}, {"block_map", map.view()}});
  const ForwardResult b = run({{"selection", std::string("explicit")},
                               {"block_indices", ti.view()},
                               {"block_counts", tc.view()}});
  EXPECT_TRUE(testing::bitwise_equal(a.out, b.out));
}

TEST(VideoSparseKernel, TopkKeepsExactlyKVideoBlocksPlusThePrefix) {
  Case c;
  c.layout = one_tail(70, {4, 8, 8});  // 70 prefix rows: two dense blocks of 64 and 6
  c.seq = c.layout.used_length();
  const SparseInputs r = inputs(c, 31);
  const VideoTiling t = VideoTiling::build(c.layout, c.seq, {4, 4, 4});
  AttentionProblem p;
  p.batch = c.batch, p.sq = p.skv = c.seq, p.hq = c.hq, p.hkv = c.hkv, p.d = p.dv = c.d;
  p.q = r.q.view(), p.k = r.k.view(), p.v = r.v.view();
  p.softmax_scale = 0.125;
  for (i64 b = 0; b < c.batch; ++b) p.segments.push_back({b, 0, c.seq, 0, c.seq, 0, 0});
  for (const i64 k : {1, 2, 3, 4, 100}) {
    VideoSparseOptions o;
    o.topk = k;
    const BlockMap m = select_blocks(p, {t, t}, o, nullptr);
    for (i64 b = 0; b < c.batch; ++b)
      for (i64 h = 0; h < c.hq; ++h)
        for (i64 qb = 0; qb < m.query_blocks; ++qb) {
          const auto sel = m.selected(b, h, qb);
          const bool dense_q = t.blocks()[std::size_t(qb)].dense;
          i64 video = 0, dense = 0;
          for (std::int32_t kb : sel) (t.blocks()[std::size_t(kb)].dense ? dense : video) += 1;
          EXPECT_EQ(dense, 2);
          EXPECT_EQ(video, dense_q ? t.video_blocks() : std::min(k, t.video_blocks()));
        }
  }
  // The kernel with the same options equals the reference under the expanded mask.
  const Attention layer(sparse_config(c, {{"topk", i64(2)}}));
  const ForwardResult got = layer.forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true);
  p.softmax_scale = 1.0 / std::sqrt(double(c.d));
  VideoSparseOptions o;
  o.topk = 2;
  const BlockMap m = select_blocks(p, {t, t}, o, nullptr);
  const Tensor mask = token_mask(m, t, c.batch, c.hq);
  expect_close(got, reference(c, r, mask), 1e-5);
  // Sparsity: the fraction of (query, key) pairs of the token mask left out.
  i64 seen = 0;
  for (i64 n = 0; n < mask.numel(); ++n) seen += mask.data_as<std::uint8_t>()[n];
  const double pairs = double(c.batch * c.hq) * double(c.seq) * double(c.seq);
  EXPECT_NEAR(m.sparsity(t, t), 1.0 - double(seen) / pairs, 1e-12);
  EXPECT_GT(m.sparsity(t, t), 0.3);
}

// The brute-force window: among the windows [s, s + w) inside [0, n), the one whose centre is
// nearest the query tile (lowest s on ties).
bool in_window(i64 q, i64 k, i64 w, i64 n) {
  w = std::min(w, n);
  i64 best = 0;
  double dist = 1e30;
  for (i64 s = 0; s + w <= n; ++s) {
    const double c = double(s) + double(w - 1) / 2.0;
    const double dd = std::abs(c - double(q));
    if (dd < dist - 1e-9) dist = dd, best = s;
  }
  return k >= best && k < best + w;
}

TEST(VideoSparseKernel, SlidingWindowMatchesABruteForceWindowMask) {
  Case c;
  c.layout = one_tail(6, {6, 9, 7});
  c.seq = c.layout.used_length() + 4;
  const TileShape tile{2, 4, 3};
  const std::array<i64, 3> window{3, 2, 5};
  const SparseInputs r = inputs(c, 41);
  const Attention layer(sparse_config(c, {{"selection", std::string("sliding_tile")},
                                          {"tile", std::string("2,4,3")},
                                          {"window", std::string("3,2,5")}}));
  const ForwardResult got = layer.forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true);
  // Token mask by coordinates: prefix rows see and are seen by everything.
  const i64 s = c.seq, prefix = 6, used = c.layout.used_length();
  const LatentGrid g = *c.layout.latent_grid;
  Tensor mask = Tensor::zeros({1, 1, s, s}, DType::Bool);
  const auto tile_of = [&](i64 row) {
    const i64 v = row - prefix;
    const i64 z = v / (g[1] * g[2]), y = v / g[2] % g[1], x = v % g[2];
    return std::array<i64, 3>{z / tile[0], y / tile[1], x / tile[2]};
  };
  const std::array<i64, 3> tiles{(g[0] + 1) / 2, (g[1] + 3) / 4, (g[2] + 2) / 3};
  for (i64 i = 0; i < used; ++i)
    for (i64 j = 0; j < used; ++j) {
      bool see = i < prefix || j < prefix;
      if (!see) {
        const auto qi = tile_of(i), kj = tile_of(j);
        see = true;
        for (std::size_t a = 0; a < 3; ++a)
          see = see && in_window(qi[a], kj[a], window[a], tiles[a]);
      }
      mask.data_as<std::uint8_t>()[i * s + j] = see;
    }
  expect_close(got, reference(c, r, mask), 1e-5);
}

TEST(VideoSparseKernel, GateAddsTheCoarseBranch) {
  Case c;
  c.hq = 2, c.hkv = 1, c.batch = 1, c.d = 32, c.dv = 32;
  const SparseInputs r = inputs(c, 51);
  // Gate 0 and top-k = all: dense attention.
  const Tensor zero = Tensor::zeros({1, c.seq, c.hq}, DType::F32);
  const ForwardResult plain =
      Attention(sparse_config(c, {{"topk", i64(999)}, {"gate", zero.view()}}))
          .forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true);
  expect_close(plain, reference(c, r, std::nullopt), 1e-5);
  // A gate of g adds g x softmax(pooled scores) . pooled V, computed here in f64.
  const Tensor gate = testing::random_tensor({1, c.seq, c.hq}, DType::F32, 9);
  const ForwardResult gated =
      Attention(sparse_config(c, {{"topk", i64(999)}, {"gate", gate.view()}}))
          .forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true);
  const VideoTiling t = VideoTiling::build(c.layout, c.seq, {4, 4, 4});
  const i64 used = c.layout.used_length(), nb = static_cast<i64>(t.blocks().size());
  const auto pooled = [&](const Tensor& x, i64 heads, i64 h, i64 blk, i64 width) {
    std::vector<double> m(std::size_t(width), 0.0);
    const VideoBlock& bl = t.blocks()[std::size_t(blk)];
    for (i64 pos = bl.begin; pos < bl.end; ++pos)
      for (i64 e = 0; e < width; ++e)
        m[std::size_t(e)] +=
            x.data_as<float>()[(t.order()[std::size_t(pos)] * heads + h) * width + e];
    for (double& v : m) v /= double(bl.size());
    return m;
  };
  double worst = 0;
  for (i64 h = 0; h < c.hq; ++h)
    for (i64 qb = 0; qb < nb; ++qb) {
      const auto pq = pooled(r.q, c.hq, h, qb, c.d);
      std::vector<double> score(static_cast<std::size_t>(nb));
      double mx = -1e300;
      for (i64 kb = 0; kb < nb; ++kb) {
        const auto pk = pooled(r.k, 1, 0, kb, c.d);
        double sc = 0;
        for (i64 e = 0; e < c.d; ++e) sc += pq[std::size_t(e)] * pk[std::size_t(e)];
        score[std::size_t(kb)] = sc / std::sqrt(double(c.d));
        mx = std::max(mx, score[std::size_t(kb)]);
      }
      std::vector<double> coarse(std::size_t(c.dv), 0.0);
      double sum = 0;
      for (i64 kb = 0; kb < nb; ++kb) {
        const double w = std::exp(score[std::size_t(kb)] - mx);
        sum += w;
        const auto pv = pooled(r.v, 1, 0, kb, c.dv);
        for (i64 e = 0; e < c.dv; ++e) coarse[std::size_t(e)] += w * pv[std::size_t(e)];
      }
      const VideoBlock& bl = t.blocks()[std::size_t(qb)];
      for (i64 pos = bl.begin; pos < bl.end; ++pos) {
        const i64 row = t.order()[std::size_t(pos)];
        const float g = gate.data_as<float>()[row * c.hq + h];
        for (i64 e = 0; e < c.dv; ++e) {
          const std::size_t at = std::size_t((row * c.hq + h) * c.dv + e);
          const double want = plain.out.data_as<float>()[at] + g * coarse[std::size_t(e)] / sum;
          worst = std::max(worst, std::abs(double(gated.out.data_as<float>()[at]) - want));
        }
      }
    }
  EXPECT_LT(worst, 1e-5);
  (void)used;
}

TEST(VideoSparseKernel, JointTokensAreDenseRowsOfTheConcatenation) {
  Case c;
  c.batch = 1;
  const i64 joint = 5;
  c.layout = one_tail(joint, {3, 5, 6});  // the layout indexes [joint | video]
  c.seq = c.layout.used_length();
  const Tensor q = testing::random_tensor({1, c.seq - joint, c.hq, c.d}, DType::F32, 1);
  const Tensor k = testing::random_tensor({1, c.seq - joint, c.hkv, c.d}, DType::F32, 2);
  const Tensor v = testing::random_tensor({1, c.seq - joint, c.hkv, c.d}, DType::F32, 3);
  const Tensor jq = testing::random_tensor({1, joint, c.hq, c.d}, DType::F32, 4);
  const Tensor jk = testing::random_tensor({1, joint, c.hkv, c.d}, DType::F32, 5);
  const Tensor jv = testing::random_tensor({1, joint, c.hkv, c.d}, DType::F32, 6);
  AttentionMetadata meta;
  meta.joint_query = jq.view(), meta.joint_key = jk.view(), meta.joint_value = jv.view();
  meta.video_layout = c.layout;
  const ForwardResult got = Attention(sparse_config(c, {{"topk", i64(999)}}))
                                .forward(q.view(), k.view(), v.view(), meta, true);
  const ForwardResult want = Attention(testing::layer_config("REFERENCE", c.hq, c.hkv, c.d))
                                 .forward(q.view(), k.view(), v.view(), meta, true);
  expect_close(got, want, 1e-5);
}

TEST(VideoSparseKernel, Bf16InputsWithinTheirRounding) {
  Case c;
  c.dtype = DType::BF16;
  const SparseInputs r = inputs(c, 61);
  const ForwardResult got = Attention(sparse_config(c, {{"topk", i64(999)}}))
                                .forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true);
  const auto d = testing::compare(got.out.view(), reference(c, r, std::nullopt).out.view());
  EXPECT_LE(d.normwise_rel, testing::tolerance_for(DType::BF16));
}

// VIDEO_SPARSE runs on FLASH's engines: each one this CPU can run (emulated twins included, but
// where DATTN_TEST_TWINS=0), named by the isa option, on bf16 inputs and with compute_dtype bf16
// on f32 inputs, against REFERENCE under the selected blocks' token mask; with tiles of 64 keys
// (some clipped) and of 128 (a block in two key tiles), and keys a mask hides inside the blocks.
TEST(VideoSparseKernel, EveryEngineMatchesReference) {
  Case c;
  c.hq = 4, c.hkv = 2, c.d = 72, c.dv = 40;
  c.layout = one_tail(9, {5, 7, 9});
  c.seq = c.layout.used_length() + 3;
  for (const std::array<i64, 3> tile : {std::array<i64, 3>{4, 4, 4}, {4, 8, 4}}) {
    const VideoTiling t = VideoTiling::build(c.layout, c.seq, {tile[0], tile[1], tile[2]});
    const i64 nb = static_cast<i64>(t.blocks().size());
    Tensor map = testing::bool_tensor({c.batch, c.hq, nb, nb}, 7, 0.3);
    for (i64 row = 0; row < c.batch * c.hq * nb; ++row)
      map.data_as<std::uint8_t>()[row * nb + row % nb] = 1;
    AttentionProblem p;
    p.batch = c.batch, p.hq = c.hq;
    VideoSparseOptions so;
    so.selection = BlockSelection::explicit_map;
    so.block_map = map.view();
    Tensor mask = token_mask(select_blocks(p, {t, t}, so, nullptr), t, c.batch, c.hq);
    // Batch item 1 hides every seventh key (inside the blocks) from every row.
    const auto hidden = [](i64 b, i64 j) { return b == 1 && j % 7 == 3; };
    for (i64 b = 0; b < c.batch; ++b)
      for (i64 h = 0; h < c.hq; ++h)
        for (i64 i = 0; i < c.seq; ++i)
          for (i64 j = 0; j < c.seq; ++j)
            if (hidden(b, j))
              mask.data_as<std::uint8_t>()[((b * c.hq + h) * c.seq + i) * c.seq + j] = 0;
    for (const EngineInfo& e : flash_engines()) {
      // SAGE's int8 engines only cap the ladder here (qk_dtype int8: tests/test_sage.cpp).
      if (e.unavailable_reason || e.compute_dtype == "int8") continue;
      if (e.emulated && !testing::twins_in_engine_loops()) continue;
      for (const DType dt : {DType::F32, DType::BF16}) {
        SCOPED_TRACE(e.name + " " + std::string(dtype_name(dt)) + " tile " +
                     std::to_string(tile[1]));
        c.dtype = dt;
        SparseInputs r = inputs(c, 67);
        for (i64 j = 0; j < c.seq; ++j)
          if (hidden(1, j)) r.keep.data_as<std::uint8_t>()[c.seq + j] = 0;
        BackendOptions o{{"selection", std::string("explicit")},
                         {"block_map", map.view()},
                         {"isa", e.name},
                         {"tile", std::to_string(tile[0]) + "," + std::to_string(tile[1]) + "," +
                                      std::to_string(tile[2])}};
        if (dt == DType::F32) o["compute_dtype"] = std::string("bf16");
        const ForwardResult got = Attention(sparse_config(c, o))
                                      .forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true);
        // A self-attention layer's key mask also zeroes the query rows it hides.
        ForwardResult want = reference(c, r, mask);
        for (i64 i = 0; i < c.seq; ++i)
          if (hidden(1, i))
            for (i64 h = 0; h < c.hq; ++h)
              for (i64 e2 = 0; e2 < c.dv; ++e2)
                store_from_f32(want.out.data(), want.out.dtype(),
                               ((c.seq + i) * c.hq + h) * c.dv + e2, 0.0f);
        const auto d = testing::compare(got.out.view(), want.out.view());
        EXPECT_FALSE(d.nan);
        // The 16-bit integer lanes (named as the cap: they compute every call) at their
        // accuracy (tests/test_int16.cpp).
        EXPECT_LE(d.normwise_rel, e.compute_dtype == "bf16" || dt == DType::BF16 ? 1e-2
                                  : e.compute_dtype == "int16"                   ? 5e-3
                                                                                 : 1e-5);
      }
    }
  }
}

// ---- the contract around it ----

TEST(VideoSparseBackend, RefusesWhatItCannotServeAndFallsBackOnlyWhenAsked) {
  Case c;
  const SparseInputs r = inputs(c, 71);
  AttentionConfig cfg = sparse_config(c, {});
  cfg.causal = true;
  try {
    (void)Attention(cfg).forward(r.q.view(), r.k.view(), r.v.view(), r.meta);
    ADD_FAILURE() << "causal accepted";
  } catch (const Unsupported& e) {
    EXPECT_EQ(e.field(), "supports_causal");
    EXPECT_NE(std::string(e.what()).find("VIDEO_SPARSE"), std::string::npos);
  }
  cfg.causal = false;
  AttentionMetadata dense = r.meta;
  const Tensor m3 = testing::bool_tensor({c.batch, c.seq, c.seq}, 3, 0.7);
  dense.attn_mask = m3.view();
  EXPECT_THROW((void)Attention(cfg).forward(r.q.view(), r.k.view(), r.v.view(), dense),
               Unsupported);
  // Asked to fall back: the call runs densely (on FLASH) and says so.
  cfg.causal = true;
  cfg.allow_fallback = true;
  const Attention layer(cfg);
  Tensor out = Tensor::zeros({c.batch, c.seq, c.hq, c.dv}, DType::F32);
  const Backend& ran = layer.forward_into(r.q.view(), r.k.view(), r.v.view(), r.meta, out.view());
  EXPECT_EQ(ran.name(), "FLASH");
  // Automatic choice never picks an approximate backend.
  AttentionConfig autocfg = testing::layer_config("", c.hq, c.hkv, c.d);
  EXPECT_NE(Attention(autocfg).backend().name(), "VIDEO_SPARSE");
}

// The isa option caps the FLASH engine that runs the blocks; with compute_dtype bf16 an f32 call
// may run on a bf16 engine. last_engine() names it.
TEST(VideoSparseBackend, TheIsaOptionPicksTheEngine) {
  Case c;
  const SparseInputs r = inputs(c, 91);
  const ForwardResult want = reference(c, r, std::nullopt);
  for (const std::string isa : {"portable", "avx512_bf16_emulated", "amx_emulated"}) {
    SCOPED_TRACE(isa);
    const Attention layer(sparse_config(
        c, {{"topk", i64(1000)}, {"isa", isa}, {"compute_dtype", std::string("bf16")}}));
    const ForwardResult got = layer.forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true);
    if (isa == "portable") {
      expect_close(got, want, 1e-5);
    } else {  // Q and K rounded to bf16: the logits move by about 1e-3
      EXPECT_LE(testing::compare(got.out.view(), want.out.view()).normwise_rel, 1e-2);
      EXPECT_LE(testing::compare(got.lse->view(), want.lse->view()).max_abs, 1e-2);
    }
    EXPECT_EQ(layer.last_engine(), isa);
  }
  // The exact default keeps f32 inputs on an f32 engine under a bf16 cap.
  const Attention exact(
      sparse_config(c, {{"topk", i64(1000)}, {"isa", std::string("avx512_bf16_emulated")}}));
  expect_close(exact.forward(r.q.view(), r.k.view(), r.v.view(), r.meta, true), want, 1e-5);
  for (const EngineInfo& e : flash_engines())
    if (e.name == exact.last_engine()) {
      EXPECT_EQ(e.compute_dtype, "f32") << e.name;
    }
}

TEST(VideoSparseBackend, BadOptionsNameTheOption) {
  Case c;
  const SparseInputs r = inputs(c, 81);
  const auto field_of = [&](BackendOptions o) {
    try {
      (void)Attention(sparse_config(c, std::move(o)))
          .forward(r.q.view(), r.k.view(), r.v.view(), r.meta);
    } catch (const InvalidArgument& e) {
      return e.field();
    }
    return std::string("<none>");
  };
  EXPECT_EQ(field_of({{"selection", std::string("nearest")}}), "selection");
  EXPECT_EQ(field_of({{"tile", std::string("4,4")}}), "tile");
  EXPECT_EQ(field_of({{"window", std::string("3,x,3")}}), "window");
  EXPECT_EQ(field_of({{"sparsity", 1.5}}), "sparsity");
  EXPECT_EQ(field_of({{"topk", i64(0)}}), "topk");
  EXPECT_EQ(field_of({{"selection", std::string("explicit")}}), "block_indices");
  const Tensor wrong = Tensor::zeros({1, 1, 3, 3}, DType::Bool);
  EXPECT_EQ(field_of({{"selection", std::string("explicit")}, {"block_map", wrong.view()}}),
            "block_map");
  const Tensor gate = Tensor::zeros({c.batch, c.seq, c.hq + 1}, DType::F32);
  EXPECT_EQ(field_of({{"gate", gate.view()}}), "gate");
  EXPECT_EQ(field_of({{"unknown_key", i64(3)}}), "unknown_key");  // strict (semantics.md)
  // FLASH's engine options, checked as FLASH checks them.
  EXPECT_EQ(field_of({{"isa", std::string("sse9")}}), "isa");
  EXPECT_EQ(field_of({{"compute_dtype", std::string("f64")}}), "compute_dtype");
  // A bad layout is an InvalidArgument naming it; nothing is written.
  AttentionMetadata bad = r.meta;
  bad.video_layout = one_tail(0, {100, 100, 100});
  Tensor out = Tensor::empty({c.batch, c.seq, c.hq, c.dv}, DType::F32);
  std::fill(out.data_as<float>(), out.data_as<float>() + out.numel(), 3.0f);
  const Tensor before = Tensor::copy_of(out.view());
  try {
    (void)Attention(sparse_config(c, {}))
        .forward_into(r.q.view(), r.k.view(), r.v.view(), bad, out.view());
    ADD_FAILURE() << "a layout longer than the sequence was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.field(), "video_layout");
  }
  EXPECT_TRUE(testing::bitwise_equal(out, before));
}

}  // namespace
}  // namespace dattn
