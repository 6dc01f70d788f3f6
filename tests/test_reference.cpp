// REFERENCE against an independent oracle built from the rules of docs/semantics.md, feature by
// feature.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "dattn/attention.hpp"
#include "dattn/errors.hpp"
#include "dense_oracle.hpp"

namespace dattn {
namespace {

using testing::compare;
using testing::dense_oracle;
using testing::random_tensor;
using i64 = std::int64_t;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

Attention reference_layer(i64 hq, i64 hkv, i64 d, bool causal = false,
                          AttentionRole role = AttentionRole::self,
                          QkvLayout layout = QkvLayout::BSHD) {
  AttentionConfig c = testing::layer_config("reference", hq, hkv, d, causal);
  c.role = role;
  c.qkv_layout = layout;
  return Attention(c);
}

double scale_of(i64 d) {
  return 1.0 / std::sqrt(double(d));
}

void expect_matches(const ForwardResult& got, const testing::OracleResult& want,
                    double tol = 1e-6) {
  const auto d = compare(got.out.view(), want.out.view());
  EXPECT_FALSE(d.nan);
  EXPECT_LE(d.max_abs, tol);
  if (got.lse) {
    const auto l = compare(got.lse->view(), want.lse.view());
    EXPECT_FALSE(l.nan);
    EXPECT_LE(l.max_abs, tol * 10);
  }
}

TEST(Reference, HandComputedTwoKeys) {
  // One query, two keys, D = 1, scale 1: logits 0 and ln 3 -> weights 1/4, 3/4.
  Tensor q = Tensor::empty({1, 1, 1, 1}, DType::F32), k = Tensor::empty({1, 2, 1, 1}, DType::F32),
         v = Tensor::empty({1, 2, 1, 1}, DType::F32);
  q.data_as<float>()[0] = 1.0f;
  k.data_as<float>()[0] = 0.0f;
  k.data_as<float>()[1] = static_cast<float>(std::log(3.0));
  v.data_as<float>()[0] = 10.0f;
  v.data_as<float>()[1] = 20.0f;
  AttentionConfig c;
  c.num_heads = 1;
  c.head_size = 1;
  c.softmax_scale = 1.0;
  c.backend = "REFERENCE";
  const auto r = Attention(c).forward(q, k, v, {}, true);
  EXPECT_NEAR(r.out.data_as<float>()[0], 17.5, 1e-5);
  EXPECT_NEAR(r.lse->data_as<float>()[0], std::log(4.0), 1e-6);
}

TEST(Reference, DenseGqaMatchesOracle) {
  const i64 B = 2, Sq = 7, Skv = 9, Hq = 4, Hkv = 2, D = 5, Dv = 3;
  auto q = random_tensor({B, Sq, Hq, D}, DType::F32, 1),
       k = random_tensor({B, Skv, Hkv, D}, DType::F32, 2),
       v = random_tensor({B, Skv, Hkv, Dv}, DType::F32, 3);
  const auto got = reference_layer(Hq, Hkv, D).forward(q, k, v, {}, true);
  const auto want = dense_oracle(q, k, v, scale_of(D), [](i64, i64, i64, i64) { return 0.0; });
  expect_matches(got, want);
}

TEST(Reference, CausalBottomRightAlignment) {
  for (const auto& [Sq, Skv] : {std::pair<i64, i64>{6, 6}, {3, 8}, {8, 3}}) {
    SCOPED_TRACE("Sq=" + std::to_string(Sq) + " Skv=" + std::to_string(Skv));
    auto q = random_tensor({1, Sq, 2, 4}, DType::F32, 4),
         k = random_tensor({1, Skv, 2, 4}, DType::F32, 5),
         v = random_tensor({1, Skv, 2, 4}, DType::F32, 6);
    const auto got = reference_layer(2, 2, 4, true).forward(q, k, v, {}, true);
    const i64 off = Skv - Sq;
    const auto want =
        dense_oracle(q, k, v, 0.5, [&](i64, i64, i64 i, i64 j) -> std::optional<double> {
          if (j > i + off) return std::nullopt;
          return 0.0;
        });
    expect_matches(got, want);
    if (Sq > Skv) {  // the first rows see no key: zero and -inf, never NaN
      EXPECT_EQ(got.lse->data_as<float>()[0], -std::numeric_limits<float>::infinity());
    }
  }
}

TEST(Reference, GlobalStartsOverrideAlignment) {
  auto q = random_tensor({1, 4, 1, 4}, DType::F32, 7),
       k = random_tensor({1, 6, 1, 4}, DType::F32, 8),
       v = random_tensor({1, 6, 1, 4}, DType::F32, 9);
  AttentionMetadata m;
  m.q_global_start = 10;
  m.k_global_start = 9;  // keys at 9..14, queries at 10..13
  const auto got = reference_layer(1, 1, 4, true).forward(q, k, v, m, true);
  const auto want = dense_oracle(q, k, v, 0.5, [](i64, i64, i64 i, i64 j) -> std::optional<double> {
    if (9 + j > 10 + i) return std::nullopt;
    return 0.0;
  });
  expect_matches(got, want);
}

TEST(Reference, KeyPaddingMaskSelfZeroesPaddedRowsCrossComputesThem) {
  const i64 B = 2, S = 6;
  auto q = random_tensor({B, S, 2, 4}, DType::F32, 10),
       k = random_tensor({B, S, 2, 4}, DType::F32, 11),
       v = random_tensor({B, S, 2, 4}, DType::F32, 12);
  Tensor mask = testing::bool_tensor({B, S}, 13, 0.6);
  mask.data_as<std::uint8_t>()[0] = 1;
  AttentionMetadata m;
  m.attn_mask = mask.view();
  const auto keep = [&](i64 b, i64 j) { return mask.data_as<std::uint8_t>()[b * S + j] != 0; };
  for (AttentionRole role : {AttentionRole::self, AttentionRole::cross}) {
    SCOPED_TRACE(std::string(attention_role_name(role)));
    const auto got = reference_layer(2, 2, 4, false, role).forward(q, k, v, m, true);
    const auto want =
        dense_oracle(q, k, v, 0.5, [&](i64 b, i64, i64 i, i64 j) -> std::optional<double> {
          if (role == AttentionRole::self && !keep(b, i)) return std::nullopt;
          if (!keep(b, j)) return std::nullopt;
          return 0.0;
        });
    expect_matches(got, want);
  }
}

TEST(Reference, DenseMasksBroadcastBoolAdditiveAnd3D) {
  const i64 B = 2, Sq = 5, Skv = 7, H = 3, D = 4;
  auto q = random_tensor({B, Sq, H, D}, DType::F32, 14),
       k = random_tensor({B, Skv, H, D}, DType::F32, 15),
       v = random_tensor({B, Skv, H, D}, DType::F32, 16);
  // bool [1, H, Sq, Skv] broadcast over batch
  {
    Tensor mask = testing::bool_tensor({1, H, Sq, Skv}, 17, 0.5);
    AttentionMetadata m;
    m.attn_mask = mask.view();
    const auto got = reference_layer(H, H, D).forward(q, k, v, m, true);
    const auto want =
        dense_oracle(q, k, v, 0.5, [&](i64, i64 h, i64 i, i64 j) -> std::optional<double> {
          if (!mask.data_as<std::uint8_t>()[(h * Sq + i) * Skv + j]) return std::nullopt;
          return 0.0;
        });
    expect_matches(got, want);
  }
  // additive f32 [B, 1, Sq, Skv] with -inf entries; bf16 additive too
  for (DType mt : {DType::F32, DType::BF16}) {
    Tensor mask = random_tensor({B, 1, Sq, Skv}, mt, 18);
    for (i64 n = 0; n < mask.numel(); n += 3)
      store_from_f32(mask.data(), mt, n, -std::numeric_limits<float>::infinity());
    AttentionMetadata m;
    m.attn_mask = mask.view();
    const auto got = reference_layer(H, H, D).forward(q, k, v, m, true);
    const auto want =
        dense_oracle(q, k, v, 0.5, [&](i64 b, i64, i64 i, i64 j) -> std::optional<double> {
          const double x = load_as_f32(mask.data(), mt, (b * Sq + i) * Skv + j);
          if (x == kNegInf) return std::nullopt;
          return x;
        });
    expect_matches(got, want);
  }
  // 3-D [B, Sq, Skv] bool
  {
    Tensor mask = testing::bool_tensor({B, Sq, Skv}, 19, 0.5);
    AttentionMetadata m;
    m.attn_mask = mask.view();
    const auto got = reference_layer(H, H, D).forward(q, k, v, m, true);
    const auto want =
        dense_oracle(q, k, v, 0.5, [&](i64 b, i64, i64 i, i64 j) -> std::optional<double> {
          if (!mask.data_as<std::uint8_t>()[(b * Sq + i) * Skv + j]) return std::nullopt;
          return 0.0;
        });
    expect_matches(got, want);
  }
}

TEST(Reference, MaskModeNoneSkipsTheMask) {
  auto q = random_tensor({1, 4, 1, 4}, DType::F32, 20),
       k = random_tensor({1, 4, 1, 4}, DType::F32, 21),
       v = random_tensor({1, 4, 1, 4}, DType::F32, 22);
  Tensor mask = Tensor::zeros({1, 4}, DType::Bool);  // all false, but promised all-true
  AttentionMetadata m;
  m.attn_mask = mask.view();
  m.extra.attention_mask_mode = AttentionMaskMode::none;
  const auto got = reference_layer(1, 1, 4).forward(q, k, v, m);
  const auto plain = reference_layer(1, 1, 4).forward(q, k, v);
  EXPECT_TRUE(testing::bitwise_equal(got.out, plain.out));
}

struct VarlenCase {
  std::vector<std::int32_t> cq, ck;
  bool causal;
};

TEST(Reference, VarlenDocumentsAreBlockDiagonalWithPerDocumentCausality) {
  for (const VarlenCase& vc :
       {VarlenCase{{0, 3, 3, 8, 9}, {0, 4, 4, 9, 13}, true},
        VarlenCase{{0, 5, 11}, {0, 5, 11}, false}, VarlenCase{{0, 0, 4}, {0, 2, 2}, true}}) {
    const i64 T = vc.cq.back(), Tk = vc.ck.back();
    auto q = random_tensor({1, T, 2, 4}, DType::F32, 23),
         k = random_tensor({1, Tk, 1, 4}, DType::F32, 24),
         v = random_tensor({1, Tk, 1, 4}, DType::F32, 25);
    Tensor cq = testing::int32_tensor(vc.cq), ck = testing::int32_tensor(vc.ck);
    AttentionMetadata m;
    m.extra.cu_seqlens_q = cq.view();
    m.extra.cu_seqlens_k = ck.view();
    m.extra.max_seqlen_q = 64;
    m.extra.max_seqlen_k = 64;
    const auto got = reference_layer(2, 1, 4, vc.causal).forward(q, k, v, m, true);
    const auto doc_of = [](const std::vector<std::int32_t>& cu, i64 r) {
      for (std::size_t d = 0; d + 1 < cu.size(); ++d)
        if (r >= cu[d] && r < cu[d + 1]) return static_cast<i64>(d);
      return i64{-1};
    };
    const auto want =
        dense_oracle(q, k, v, 0.5, [&](i64, i64, i64 i, i64 j) -> std::optional<double> {
          const i64 d = doc_of(vc.cq, i);
          if (d < 0 || doc_of(vc.ck, j) != d) return std::nullopt;
          const i64 lq = vc.cq[d + 1] - vc.cq[d], lk = vc.ck[d + 1] - vc.ck[d];
          const i64 pi = lk - lq + (i - vc.cq[d]), pj = j - vc.ck[d];
          if (vc.causal && pj > pi) return std::nullopt;
          return 0.0;
        });
    expect_matches(got, want);
  }
}

TEST(Reference, RealPadPackingWithAndWithoutPackedPadding) {
  const i64 T = 10, used = 7;
  auto q = random_tensor({1, T, 1, 4}, DType::F32, 26),
       k = random_tensor({1, T, 1, 4}, DType::F32, 27),
       v = random_tensor({1, T, 1, 4}, DType::F32, 28);
  Tensor cu = testing::int32_tensor({0, used, T}), pq = testing::int32_tensor({0, used});
  AttentionMetadata m;
  m.extra.cu_seqlens_q = cu.view();
  m.extra.cu_seqlens_k = cu.view();
  m.extra.max_seqlen_q = T;
  m.extra.max_seqlen_k = T;
  const auto two_docs = reference_layer(1, 1, 4).forward(q, k, v, m);
  m.packed_padding = PackedPaddingMetadata{used, used, pq.view(), pq.view()};
  const auto real_pad = reference_layer(1, 1, 4).forward(q, k, v, m);
  const auto want_pad =
      dense_oracle(q, k, v, 0.5, [&](i64, i64, i64 i, i64 j) -> std::optional<double> {
        if (i >= used || j >= used) return std::nullopt;
        return 0.0;
      });
  expect_matches(real_pad, want_pad);
  const auto want_docs =
      dense_oracle(q, k, v, 0.5, [&](i64, i64, i64 i, i64 j) -> std::optional<double> {
        if ((i < used) != (j < used)) return std::nullopt;
        return 0.0;
      });
  expect_matches(two_docs, want_docs);
  // Packed padding alone (no cu_seqlens), batch 2: valid outputs ignore padded inputs.
  auto q2 = random_tensor({2, T, 1, 4}, DType::F32, 29),
       k2 = random_tensor({2, T, 1, 4}, DType::F32, 30),
       v2 = random_tensor({2, T, 1, 4}, DType::F32, 31);
  AttentionMetadata pm;
  pm.packed_padding = PackedPaddingMetadata{used, used, pq.view(), pq.view()};
  const auto a = reference_layer(1, 1, 4).forward(q2, k2, v2, pm);
  for (i64 r = used; r < T; ++r)
    for (i64 e = 0; e < 4; ++e) k2.data_as<float>()[r * 4 + e] = 1e6f;
  const auto b = reference_layer(1, 1, 4).forward(q2, k2, v2, pm);
  EXPECT_TRUE(testing::bitwise_equal(a.out, b.out));
}

TEST(Reference, ValidKvLengthEqualsKeyPaddingAndComposesWithMask) {
  const i64 Sq = 5, Skv = 9, vl = 6;
  auto q = random_tensor({2, Sq, 2, 4}, DType::F32, 32),
       k = random_tensor({2, Skv, 2, 4}, DType::F32, 33),
       v = random_tensor({2, Skv, 2, 4}, DType::F32, 34);
  Tensor mask = testing::bool_tensor({2, 1, Sq, Skv}, 35, 0.7);
  AttentionMetadata m;
  m.extra.valid_kv_length = vl;
  m.attn_mask = mask.view();
  const auto got = reference_layer(2, 2, 4, true).forward(q, k, v, m, true);
  const auto want =
      dense_oracle(q, k, v, 0.5, [&](i64 b, i64, i64 i, i64 j) -> std::optional<double> {
        if (j >= vl || j > i + (Skv - Sq) || !mask.data_as<std::uint8_t>()[(b * Sq + i) * Skv + j])
          return std::nullopt;
        return 0.0;
      });
  expect_matches(got, want);
}

TEST(Reference, PiecewiseSpansWithQueryRanges) {
  // Keys at global 0..11; local queries: rows 0..3 at global 2..5, rows 4..6 at global 9..11.
  const i64 Skv = 12;
  auto q = random_tensor({2, 7, 1, 4}, DType::F32, 36),
       k = random_tensor({2, Skv, 1, 4}, DType::F32, 37),
       v = random_tensor({2, Skv, 1, 4}, DType::F32, 38);
  const std::vector<std::pair<i64, i64>> spans{{3, 6}, {8, 10}};
  AttentionMetadata m;
  m.full_attn_spans = FullAttnSpans{spans, spans};
  m.query_ranges = std::vector<QueryRange>{{0, 4, 2}, {4, 7, 9}};
  const auto got = reference_layer(1, 1, 4).forward(q, k, v, m, true);
  const auto pos = [](i64 i) { return i < 4 ? 2 + i : 9 + (i - 4); };
  const auto want =
      dense_oracle(q, k, v, 0.5, [&](i64, i64, i64 i, i64 j) -> std::optional<double> {
        const i64 p = pos(i);
        bool vis = j <= p;
        for (const auto& [a, e] : spans)
          if (p >= a && p < e && j < e) vis = true;
        if (!vis) return std::nullopt;
        return 0.0;
      });
  expect_matches(got, want);
  // An empty span list means fully causal, not unrestricted.
  AttentionMetadata empty;
  empty.full_attn_spans = FullAttnSpans{{}, {}};
  empty.query_ranges = m.query_ranges;
  const auto causal = reference_layer(1, 1, 4).forward(q, k, v, empty, true);
  const auto want_causal =
      dense_oracle(q, k, v, 0.5, [&](i64, i64, i64 i, i64 j) -> std::optional<double> {
        if (j > pos(i)) return std::nullopt;
        return 0.0;
      });
  expect_matches(causal, want_causal);
}

TEST(Reference, JointTokensFrontAndRearWithMergedMasks) {
  const i64 B = 2, S = 5, J = 3, H = 2, D = 4;
  auto q = random_tensor({B, S, H, D}, DType::F32, 39),
       k = random_tensor({B, S, H, D}, DType::F32, 40),
       v = random_tensor({B, S, H, D}, DType::F32, 41);
  auto jq = random_tensor({B, J, H, D}, DType::F32, 42),
       jk = random_tensor({B, J, H, D}, DType::F32, 43),
       jv = random_tensor({B, J, H, D}, DType::F32, 44);
  Tensor mask = testing::bool_tensor({B, S}, 45, 0.7),
         jmask = testing::bool_tensor({B, J}, 46, 0.7);
  for (JointStrategy strategy : {JointStrategy::front, JointStrategy::rear}) {
    SCOPED_TRACE(std::string(joint_strategy_name(strategy)));
    AttentionMetadata m;
    m.joint_query = jq.view();
    m.joint_key = jk.view();
    m.joint_value = jv.view();
    m.joint_strategy = strategy;
    m.attn_mask = mask.view();
    m.joint_attn_mask = jmask.view();
    const auto got = reference_layer(H, H, D).forward(q, k, v, m, true);
    ASSERT_EQ(got.out.shape()[1], J + S);
    // Build the concatenation by hand and the merged keep vector.
    const bool front = strategy == JointStrategy::front;
    const auto cat = [&](const Tensor& local, const Tensor& joint) {
      Tensor t = Tensor::empty({B, J + S, H, D}, DType::F32);
      copy_into(joint.view(), t.view().sliced(1, front ? 0 : S, J));
      copy_into(local.view(), t.view().sliced(1, front ? J : 0, S));
      return t;
    };
    const Tensor cq = cat(q, jq), ck = cat(k, jk), cv = cat(v, jv);
    const auto keep = [&](i64 b, i64 j) {
      const bool joint = front ? j < J : j >= S;
      if (joint) return jmask.data_as<std::uint8_t>()[b * J + (front ? j : j - S)] != 0;
      return mask.data_as<std::uint8_t>()[b * S + (front ? j - J : j)] != 0;
    };
    const auto want =
        dense_oracle(cq, ck, cv, 0.5, [&](i64 b, i64, i64 i, i64 j) -> std::optional<double> {
          if (!keep(b, i) || !keep(b, j)) return std::nullopt;  // self-attention: padded rows zero
          return 0.0;
        });
    expect_matches(got, want);
  }
}

TEST(Reference, LaserScalePowerOfTwoIsBitExact) {
  auto q = random_tensor({1, 9, 2, 8}, DType::F32, 47),
       k = random_tensor({1, 11, 2, 8}, DType::F32, 48),
       v = random_tensor({1, 11, 2, 8}, DType::F32, 49);
  const auto plain = reference_layer(2, 2, 8, true).forward(q, k, v, {}, true);
  AttentionMetadata m;
  m.extra.laser_input_scale = 4.0;
  const auto scaled = reference_layer(2, 2, 8, true).forward(q, k, v, m, true);
  EXPECT_TRUE(testing::bitwise_equal(plain.out, scaled.out));
  EXPECT_TRUE(testing::bitwise_equal(*plain.lse, *scaled.lse));
  m.extra.laser_input_scale = 3.0;
  const auto odd = reference_layer(2, 2, 8, true).forward(q, k, v, m, true);
  EXPECT_LE(compare(odd.out.view(), plain.out.view()).max_abs, 1e-6);
}

TEST(Reference, EmptyKeysGiveZerosAndMinusInfinity) {
  auto q = random_tensor({2, 3, 2, 4}, DType::F32, 50);
  Tensor k = Tensor::empty({2, 0, 2, 4}, DType::F32), v = Tensor::empty({2, 0, 2, 4}, DType::F32);
  const auto r = reference_layer(2, 2, 4, true).forward(q, k, v, {}, true);
  for (i64 n = 0; n < r.out.numel(); ++n) EXPECT_EQ(r.out.data_as<float>()[n], 0.0f);
  for (i64 n = 0; n < r.lse->numel(); ++n)
    EXPECT_EQ(r.lse->data_as<float>()[n], -std::numeric_limits<float>::infinity());
}

TEST(Reference, LayoutsAndStridedViewsAgree) {
  const i64 B = 2, S = 6, H = 4, D = 8;
  // A fused QKV projection [B, S, 3, H, D]: Q/K/V are strided views into it.
  auto qkv = random_tensor({B, S, 3, H, D}, DType::F32, 51);
  const auto view_of = [&](i64 which) {
    const std::array<i64, 4> shape{B, S, H, D};
    const std::array<i64, 4> strides{S * 3 * H * D, 3 * H * D, D, 1};
    return TensorView(qkv.data_as<float>() + which * H * D, DType::F32, shape, strides);
  };
  const TensorView q = view_of(0), k = view_of(1), v = view_of(2);
  const auto base = reference_layer(H, H, D, true).forward(q, k, v, {}, true);
  const Tensor qc = Tensor::copy_of(q), kc = Tensor::copy_of(k), vc = Tensor::copy_of(v);
  const auto contiguous = reference_layer(H, H, D, true).forward(qc, kc, vc, {}, true);
  EXPECT_TRUE(testing::bitwise_equal(base.out, contiguous.out));
  // BHSD: the same data permuted.
  const std::array<int, 4> perm{0, 2, 1, 3};
  const auto bhsd = reference_layer(H, H, D, true, AttentionRole::self, QkvLayout::BHSD)
                        .forward(q.permuted(perm), k.permuted(perm), v.permuted(perm), {}, true);
  const Tensor back = Tensor::copy_of(bhsd.out.view().permuted(perm));
  EXPECT_TRUE(testing::bitwise_equal(back, base.out));
  // THD with batch 1.
  const TensorView q1 = qc.view().sliced(0, 0, 1), k1 = kc.view().sliced(0, 0, 1),
                   v1 = vc.view().sliced(0, 0, 1);
  const auto thd_in = testing::without_batch_dim;
  const auto thd = reference_layer(H, H, D, true, AttentionRole::self, QkvLayout::THD)
                       .forward(thd_in(q1), thd_in(k1), thd_in(v1), {}, true);
  const Tensor base0 = Tensor::copy_of(base.out.view().sliced(0, 0, 1));
  EXPECT_EQ(std::memcmp(thd.out.data(), base0.data(), base0.nbytes()), 0);
}

TEST(Reference, QuantizedKvErrorWithinFormatBounds) {
  auto q = random_tensor({1, 33, 2, 64}, DType::F32, 52),
       k = random_tensor({1, 150, 2, 64}, DType::F32, 53),
       v = random_tensor({1, 150, 2, 64}, DType::F32, 54);
  const auto exact = reference_layer(2, 2, 64).forward(q, k, v);
  // Bounds from the formats: e4m3 rounds with a relative rms error of about 2.6% per element,
  // int8 with per-(64-token block, head) absmax scales about 1%; K and V errors add up.
  for (const auto& [dtype, bound] :
       {std::pair{KvCacheDtype::fp8, 5e-2}, {KvCacheDtype::int8, 2e-2}}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dtype)));
    AttentionConfig c;
    c.num_heads = 2;
    c.head_size = 64;
    c.backend = "REFERENCE";
    c.kv_cache_dtype = dtype;
    const auto quant = Attention(c).forward(q, k, v);
    const auto d = compare(quant.out.view(), exact.out.view());
    EXPECT_GT(d.max_abs, 0.0);  // it really quantized
    EXPECT_LE(d.normwise_rel, bound);
  }
}

TEST(Reference, ReferenceRowsComputesOnlyThoseRows) {
  auto q = random_tensor({2, 9, 2, 4}, DType::F32, 55),
       k = random_tensor({2, 9, 2, 4}, DType::F32, 56),
       v = random_tensor({2, 9, 2, 4}, DType::F32, 57);
  const auto full = reference_layer(2, 2, 4, true).forward(q, k, v);
  Tensor rows = testing::int32_tensor({1, 8});
  AttentionMetadata m;
  m.extra.backend["reference_rows"] = rows.view();
  const auto some = reference_layer(2, 2, 4, true).forward(q, k, v, m);
  for (i64 b = 0; b < 2; ++b)
    for (i64 i = 0; i < 9; ++i)
      for (i64 n = 0; n < 2 * 4; ++n) {
        const i64 at = (b * 9 + i) * 8 + n;
        const float want = (i == 1 || i == 8) ? full.out.data_as<float>()[at] : 0.0f;
        EXPECT_EQ(some.out.data_as<float>()[at], want);
      }
}

TEST(Reference, RunTwiceIsBitwiseEqual) {
  auto q = random_tensor({1, 13, 4, 16}, DType::BF16, 58),
       k = random_tensor({1, 17, 1, 16}, DType::BF16, 59),
       v = random_tensor({1, 17, 1, 16}, DType::BF16, 60);
  const Attention layer = reference_layer(4, 1, 16, true);
  const auto a = layer.forward(q, k, v, {}, true), b = layer.forward(q, k, v, {}, true);
  EXPECT_TRUE(testing::bitwise_equal(a.out, b.out));
  EXPECT_TRUE(testing::bitwise_equal(*a.lse, *b.lse));
}

}  // namespace
}  // namespace dattn
