// docs/semantics.md, "Errors": every invalid input raises a typed error naming the field, and
// nothing is written.
#include <gtest/gtest.h>

#include <functional>

#include "dattn/attention.hpp"
#include "dattn/errors.hpp"
#include "test_inputs.hpp"

namespace dattn {
namespace {

using i64 = std::int64_t;
using testing::random_tensor;

constexpr i64 B = 2, S = 6, H = 4, HKV = 2, D = 8;

// A valid call that each case breaks in one way.
struct Call {
  Tensor q = random_tensor({B, S, H, D}, DType::F32, 1);
  Tensor k = random_tensor({B, S, HKV, D}, DType::F32, 2);
  Tensor v = random_tensor({B, S, HKV, D}, DType::F32, 3);
  Tensor out = Tensor::empty({B, S, H, D}, DType::F32);
  std::optional<Tensor> lse = Tensor::empty({B, H, S}, DType::F32);
  AttentionMetadata meta;
  std::vector<Tensor> keep;  // tensors the metadata points into
  AttentionConfig config = [] {
    AttentionConfig c;
    c.num_heads = H;
    c.num_kv_heads = HKV;
    c.head_size = D;
    c.backend = "REFERENCE";
    return c;
  }();

  TensorView hold(Tensor t) {
    keep.push_back(t);
    return t.view();
  }
  void varlen(std::vector<std::int32_t> cq, std::vector<std::int32_t> ck) {
    meta.extra.cu_seqlens_q = hold(testing::int32_tensor(cq));
    meta.extra.cu_seqlens_k = hold(testing::int32_tensor(ck));
    meta.extra.max_seqlen_q = 100;
    meta.extra.max_seqlen_k = 100;
  }
  // Batch 1 so that packed metadata is otherwise valid.
  void batch_one() {
    q = random_tensor({1, S, H, D}, DType::F32, 1);
    k = random_tensor({1, S, HKV, D}, DType::F32, 2);
    v = random_tensor({1, S, HKV, D}, DType::F32, 3);
    out = Tensor::empty({1, S, H, D}, DType::F32);
    lse = Tensor::empty({1, H, S}, DType::F32);
  }
  void joint(i64 j) {
    meta.joint_query = hold(random_tensor({B, j, H, D}, DType::F32, 4));
    meta.joint_key = hold(random_tensor({B, j, HKV, D}, DType::F32, 5));
    meta.joint_value = hold(random_tensor({B, j, HKV, D}, DType::F32, 6));
    out = Tensor::empty({B, S + j, H, D}, DType::F32);
    lse = Tensor::empty({B, H, S + j}, DType::F32);
  }
};

struct ErrorCase {
  const char* name;
  const char* field;  // the field the error must name
  std::function<void(Call&)> breaks;
  enum Kind { invalid, unsupported } kind = invalid;
};

const std::vector<ErrorCase>& error_cases() {
  static const std::vector<ErrorCase> cases{
      {"QueryRankWrong", "query",
       [](Call& c) {
         c.q = Tensor::empty({B, S, H * D}, DType::F32);
       }},
      {"BatchMismatch", "key",
       [](Call& c) {
         c.k = random_tensor({1, S, HKV, D}, DType::F32, 9);
       }},
      {"ValueLengthMismatch", "value",
       [](Call& c) {
         c.v = random_tensor({B, S + 1, HKV, D}, DType::F32, 9);
       }},
      {"QueryHeadsDifferFromLayer", "query",
       [](Call& c) {
         c.q = random_tensor({B, S, H * 2, D}, DType::F32, 9);
         c.out = Tensor::empty({B, S, H * 2, D}, DType::F32);
       }},
      {"KvHeadsDifferFromLayer", "key",
       [](Call& c) {
         c.k = random_tensor({B, S, 1, D}, DType::F32, 9);
         c.v = random_tensor({B, S, 1, D}, DType::F32, 9);
       }},
      {"HeadSizeDiffers", "query",
       [](Call& c) {
         c.k = random_tensor({B, S, HKV, D + 1}, DType::F32, 9);
       }},
      {"QueryDtypeInteger", "query",
       [](Call& c) {
         c.q = Tensor::zeros({B, S, H, D}, DType::I32);
       }},
      {"OutputShapeWrong", "out",
       [](Call& c) {
         c.out = Tensor::empty({B, S + 1, H, D}, DType::F32);
       }},
      {"OutputDtypeInteger", "out",
       [](Call& c) {
         c.out = Tensor::empty({B, S, H, D}, DType::I8);
       }},
      {"LseDtypeNotF32", "lse",
       [](Call& c) {
         c.lse = Tensor::empty({B, H, S}, DType::BF16);
       }},
      {"LseShapeWrong", "lse",
       [](Call& c) {
         c.lse = Tensor::empty({B, S, H}, DType::F32);
       }},
      {"CuSeqlensNotStartingAtZero", "cu_seqlens_q",
       [](Call& c) {
         c.batch_one();
         c.varlen({1, 6}, {0, 6});
       }},
      {"CuSeqlensDecreasing", "cu_seqlens_q",
       [](Call& c) {
         c.batch_one();
         c.varlen({0, 4, 3, 6}, {0, 2, 4, 6});
       }},
      {"CuSeqlensPastTheEnd", "cu_seqlens_k",
       [](Call& c) {
         c.batch_one();
         c.varlen({0, 6}, {0, 7});
       }},
      {"CuSeqlensShortOfTheEnd", "cu_seqlens_q",
       [](Call& c) {
         c.batch_one();
         c.varlen({0, 5}, {0, 6});
       }},
      {"CuSeqlensWrongLength", "cu_seqlens_k",
       [](Call& c) {
         c.batch_one();
         c.varlen({0, 3, 6}, {0, 6});
       }},
      {"CuSeqlensWrongDtype", "cu_seqlens_q",
       [](Call& c) {
         c.batch_one();
         c.varlen({0, 6}, {0, 6});
         c.meta.extra.cu_seqlens_q = c.hold(Tensor::zeros({2}, DType::F32));
       }},
      {"CuSeqlensWithBatchTwo", "cu_seqlens_q",
       [](Call& c) {
         c.varlen({0, 6}, {0, 6});
       }},
      {"CuSeqlensIncompleteSet", "max_seqlen_q",
       [](Call& c) {
         c.batch_one();
         c.varlen({0, 6}, {0, 6});
         c.meta.extra.max_seqlen_q.reset();
       }},
      {"MaxSeqlenBelowLongestDocument", "max_seqlen_k",
       [](Call& c) {
         c.batch_one();
         c.varlen({0, 6}, {0, 6});
         c.meta.extra.max_seqlen_k = 5;
       }},
      {"SpansUnsorted", "full_attn_spans",
       [](Call& c) {
         c.meta.full_attn_spans = FullAttnSpans{{{3, 4}, {1, 2}}, {{3, 4}, {1, 2}}};
       }},
      {"SpansOverlapping", "full_attn_spans",
       [](Call& c) {
         c.meta.full_attn_spans = FullAttnSpans{{{1, 4}, {3, 5}}, {{1, 4}, {3, 5}}};
       }},
      {"SpanOutOfRange", "full_attn_spans",
       [](Call& c) {
         c.meta.full_attn_spans = FullAttnSpans{{{2, 99}}, {{2, 99}}};
       }},
      {"SpanEmpty", "full_attn_spans",
       [](Call& c) {
         c.meta.full_attn_spans = FullAttnSpans{{{2, 2}}, {{2, 2}}};
       }},
      {"SpansDifferAcrossBatch", "full_attn_spans",
       [](Call& c) {
         c.meta.full_attn_spans = FullAttnSpans{{{1, 3}}, {{1, 4}}};
       }},
      {"SpansWrongCount", "full_attn_spans",
       [](Call& c) {
         c.meta.full_attn_spans = FullAttnSpans{{{1, 3}}};
       }},
      {"QueryRangesWithGap", "query_ranges",
       [](Call& c) {
         c.meta.query_ranges = std::vector<QueryRange>{{0, 2, 0}, {3, 6, 3}};
       }},
      {"QueryRangesShort", "query_ranges",
       [](Call& c) {
         c.meta.query_ranges = std::vector<QueryRange>{{0, 5, 0}};
       }},
      {"QueryRangesAndGlobalStart", "q_global_start",
       [](Call& c) {
         c.meta.query_ranges = std::vector<QueryRange>{{0, 6, 0}};
         c.meta.q_global_start = 0;
       }},
      {"MaskRankFive", "attn_mask",
       [](Call& c) {
         c.meta.attn_mask = c.hold(Tensor::zeros({B, 1, 1, S, S}, DType::Bool));
       }},
      {"MaskShapeWrong", "attn_mask",
       [](Call& c) {
         c.meta.attn_mask = c.hold(Tensor::zeros({B, H, S, S + 1}, DType::Bool));
       }},
      {"MaskTwoDFloat", "attn_mask",
       [](Call& c) {
         c.meta.attn_mask = c.hold(Tensor::zeros({B, S}, DType::F32));
       }},
      {"MaskIntegerDtype", "attn_mask",
       [](Call& c) {
         c.meta.attn_mask = c.hold(Tensor::zeros({B, 1, S, S}, DType::I32));
       }},
      {"JointPartial", "joint_value",
       [](Call& c) {
         c.joint(3);
         c.meta.joint_value.reset();
       }},
      {"JointShapeWrong", "joint_key",
       [](Call& c) {
         c.joint(3);
         c.meta.joint_key = c.hold(random_tensor({B, 2, HKV, D}, DType::F32, 7));
       }},
      {"JointMaskWithoutJointTokens", "joint_attn_mask",
       [](Call& c) {
         c.meta.joint_attn_mask = c.hold(Tensor::zeros({B, 3}, DType::Bool));
       }},
      {"JointMaskShapeWrong", "joint_attn_mask",
       [](Call& c) {
         c.joint(3);
         c.meta.joint_attn_mask = c.hold(Tensor::zeros({B, 4}, DType::Bool));
       }},
      {"ValidKvLengthZero", "valid_kv_length", [](Call& c) { c.meta.extra.valid_kv_length = 0; }},
      {"ValidKvLengthPastSkv", "valid_kv_length",
       [](Call& c) { c.meta.extra.valid_kv_length = S + 1; }},
      {"LaserScaleBelowOne", "laser_input_scale",
       [](Call& c) { c.meta.extra.laser_input_scale = 0.5; }},
      {"PackedPaddingLengthOutOfRange", "packed_padding.q_length",
       [](Call& c) {
         Tensor cu = testing::int32_tensor({0, S + 1});
         c.meta.packed_padding =
             PackedPaddingMetadata{S + 1, S, c.hold(cu), c.hold(testing::int32_tensor({0, S}))};
       }},
      {"PackedPaddingCuSeqlensDisagree", "packed_padding.cu_seqlens_q",
       [](Call& c) {
         c.meta.packed_padding = PackedPaddingMetadata{4, 4, c.hold(testing::int32_tensor({0, 3})),
                                                       c.hold(testing::int32_tensor({0, 4}))};
       }},
      {"PackedPaddingNotRealPad", "packed_padding",
       [](Call& c) {
         c.batch_one();
         c.varlen({0, 2, 4, 6}, {0, 2, 4, 6});
         c.meta.packed_padding = PackedPaddingMetadata{2, 2, c.hold(testing::int32_tensor({0, 2})),
                                                       c.hold(testing::int32_tensor({0, 2}))};
       }},
  };
  return cases;
}

void PrintTo(const ErrorCase& c, std::ostream* os) {
  *os << c.name;
}

class Errors : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(Errors, RaisesTypedErrorNamingTheFieldAndWritesNothing) {
  const ErrorCase& ec = GetParam();
  Call c;
  ec.breaks(c);
  // Sentinels in the output buffers: nothing may change them.
  for (i64 n = 0; n < c.out.numel(); ++n) store_from_f32(c.out.data(), c.out.dtype(), n, 7.0f);
  if (c.lse)
    for (i64 n = 0; n < c.lse->numel(); ++n) store_from_f32(c.lse->data(), c.lse->dtype(), n, 7.0f);
  const Tensor out_before = Tensor::copy_of(c.out.view());
  const std::optional<Tensor> lse_before =
      c.lse ? std::optional<Tensor>(Tensor::copy_of(c.lse->view())) : std::nullopt;
  const Attention layer(c.config);
  std::optional<TensorView> lse_view;
  if (c.lse) lse_view = c.lse->view();
  try {
    layer.forward_into(c.q, c.k, c.v, c.meta, c.out, lse_view);
    FAIL() << "no error raised";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(ec.kind, ErrorCase::invalid) << e.what();
    EXPECT_EQ(e.field(), ec.field) << e.what();
    EXPECT_NE(std::string(e.what()).find(ec.field), std::string::npos) << e.what();
  } catch (const Unsupported& e) {
    EXPECT_EQ(ec.kind, ErrorCase::unsupported) << e.what();
    EXPECT_EQ(e.field(), ec.field) << e.what();
  }
  EXPECT_TRUE(testing::bitwise_equal(c.out, out_before));
  if (c.lse) {
    EXPECT_TRUE(testing::bitwise_equal(*c.lse, *lse_before));
  }
}

INSTANTIATE_TEST_SUITE_P(Spec13, Errors, ::testing::ValuesIn(error_cases()),
                         [](const auto& tp) { return std::string(tp.param.name); });

TEST(ConstructionErrors, BadLayerConfigs) {
  AttentionConfig c;
  c.num_heads = 6;
  c.num_kv_heads = 4;
  c.head_size = 8;
  c.backend = "REFERENCE";
  try {
    Attention{c};
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.field(), "num_kv_heads");
  }
  c.num_kv_heads = 3;
  c.head_size = 0;
  EXPECT_THROW(Attention{c}, InvalidArgument);
  c.head_size = 8;
  c.backend = "no_such_backend";
  try {
    Attention{c};
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.field(), "backend");
    EXPECT_NE(std::string(e.what()).find("REFERENCE"), std::string::npos);
  }
  c.backend = "REFERENCE";
  c.platform = Platform::npu;
  EXPECT_THROW(Attention{c}, NotAvailable);  // REFERENCE runs on cpu only
}

TEST(ConstructionErrors, StringsParseOrNameTheValidChoices) {
  const auto names_valid = [](auto&& fn, const char* field, const char* valid) {
    try {
      fn();
      ADD_FAILURE() << field;
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.field(), field);
      EXPECT_NE(std::string(e.what()).find(valid), std::string::npos) << e.what();
    }
  };
  names_valid([] { parse_joint_strategy("middle"); }, "joint_strategy", "front, rear");
  names_valid([] { parse_kv_cache_dtype("fp4"); }, "kv_cache_dtype", "fp8, int8");
  names_valid([] { parse_attention_mask_mode("sometimes"); }, "attention_mask_mode", "arbitrary");
  names_valid([] { parse_platform("tpu"); }, "platform", "cuda");
  names_valid([] { parse_qkv_layout("SBHD"); }, "qkv_layout", "THD");
  names_valid([] { parse_attention_role("both"); }, "role", "cross");
  EXPECT_EQ(parse_kv_cache_dtype("auto"), KvCacheDtype::unquantized);
  EXPECT_EQ(parse_kv_cache_dtype("float"), KvCacheDtype::unquantized);
  EXPECT_EQ(parse_kv_cache_dtype("FP8"), KvCacheDtype::fp8);
}

}  // namespace
}  // namespace dattn
