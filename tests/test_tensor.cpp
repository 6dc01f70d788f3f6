#include <gtest/gtest.h>

#include <array>
#include <vector>

#include "dattn/errors.hpp"
#include "dattn/tensor.hpp"

namespace dattn {
namespace {

TEST(TensorView, ContiguousStridesPermuteAndSlice) {
  Tensor t = Tensor::zeros({2, 3, 4}, DType::F32);
  EXPECT_TRUE(t.view().is_contiguous());
  EXPECT_EQ(t.view().stride(0), 12);
  const std::array<int, 3> perm{2, 0, 1};
  const TensorView p = t.view().permuted(perm);
  EXPECT_EQ(p.size(0), 4);
  EXPECT_EQ(p.stride(0), 1);
  EXPECT_FALSE(p.is_contiguous());
  const TensorView s = t.view().sliced(1, 1, 2);
  EXPECT_EQ(s.size(1), 2);
  EXPECT_EQ(static_cast<float*>(s.data()), t.data_as<float>() + 4);
  EXPECT_THROW(t.view().sliced(1, 2, 2), InvalidArgument);
  const std::array<int, 3> bad{0, 0, 1};
  EXPECT_THROW(t.view().permuted(bad), InvalidArgument);
}

TEST(TensorView, UnsqueezedInsertsASizeOneDimOfStrideZero) {
  Tensor t = Tensor::zeros({2, 3, 4}, DType::F32);
  const TensorView s = t.view().sliced(2, 1, 2);  // strides [12, 4, 1], not contiguous
  const TensorView front = s.unsqueezed(0);
  ASSERT_EQ(front.ndim(), 4);
  EXPECT_EQ(std::vector<std::int64_t>(front.shape().begin(), front.shape().end()),
            (std::vector<std::int64_t>{1, 2, 3, 2}));
  EXPECT_EQ(std::vector<std::int64_t>(front.strides().begin(), front.strides().end()),
            (std::vector<std::int64_t>{0, 12, 4, 1}));
  EXPECT_EQ(front.data(), s.data());
  EXPECT_EQ(front.dtype(), DType::F32);
  const TensorView middle = s.unsqueezed(1);
  EXPECT_EQ(std::vector<std::int64_t>(middle.strides().begin(), middle.strides().end()),
            (std::vector<std::int64_t>{12, 0, 4, 1}));
  EXPECT_EQ(middle.size(1), 1);
  const TensorView back = s.unsqueezed(3);
  EXPECT_EQ(back.size(3), 1);
  EXPECT_EQ(back.stride(3), 0);
  EXPECT_EQ(back.size(2), 2);
  // Every element is where it was.
  const std::array<std::int64_t, 4> at{1, 0, 2, 1};
  const std::array<std::int64_t, 3> was{1, 2, 1};
  EXPECT_EQ(middle.element_ptr(at), s.element_ptr(was));
  EXPECT_THROW((void)s.unsqueezed(4), InvalidArgument);
  EXPECT_THROW((void)s.unsqueezed(-1), InvalidArgument);
  TensorView full = s;
  for (int i = 0; i < 3; ++i) full = full.unsqueezed(0);
  EXPECT_EQ(full.ndim(), TensorView::kMaxDims);
  EXPECT_THROW((void)full.unsqueezed(0), InvalidArgument);
}

TEST(TensorView, CopyIntoConvertsAndFollowsStrides) {
  Tensor a = Tensor::empty({2, 3}, DType::F32);
  for (int i = 0; i < 6; ++i) a.data_as<float>()[i] = static_cast<float>(i) + 0.5f;
  const std::array<int, 2> perm{1, 0};
  Tensor b = Tensor::copy_of(a.view().permuted(perm), DType::BF16);
  EXPECT_EQ(bf16_to_f32(b.data_as<std::uint16_t>()[1]), 3.5f);  // b[0][1] = a[1][0]
}

TEST(DLPack, RoundTripKeepsEveryField) {
  Tensor t = Tensor::zeros({2, 5, 3}, DType::BF16);
  const std::array<int, 3> perm{0, 2, 1};
  const TensorView v = t.view().permuted(perm);
  DLPackShapeStorage storage;
  const DLTensor dl = to_dlpack(v, storage);
  EXPECT_EQ(dl.dtype.code, kDLBfloat);
  EXPECT_EQ(dl.ndim, 3);
  const TensorView back = from_dlpack(dl);
  EXPECT_EQ(back.dtype(), DType::BF16);
  EXPECT_EQ(back.data(), v.data());
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(back.size(i), v.size(i));
    EXPECT_EQ(back.stride(i), v.stride(i));
  }
  for (DType dt : {DType::F32, DType::F16, DType::I8, DType::I32, DType::Bool, DType::FP8_E4M3}) {
    Tensor x = Tensor::zeros({4}, dt);
    DLPackShapeStorage st;
    EXPECT_EQ(from_dlpack(to_dlpack(x.view(), st)).dtype(), dt);
  }
}

TEST(DLPack, NullStridesMeanContiguousAndByteOffsetApplies) {
  float data[6] = {0, 1, 2, 3, 4, 5};
  std::int64_t shape[2] = {2, 2};
  DLTensor dl{};
  dl.data = data;
  dl.device = {kDLCPU, 0};
  dl.ndim = 2;
  dl.dtype = {kDLFloat, 32, 1};
  dl.shape = shape;
  dl.strides = nullptr;
  dl.byte_offset = 2 * sizeof(float);
  const TensorView v = from_dlpack(dl);
  EXPECT_EQ(static_cast<float*>(v.data())[0], 2.0f);
  EXPECT_EQ(v.stride(0), 2);
}

TEST(DLPack, RejectsWhatDattnCannotHold) {
  float data[1] = {0};
  std::int64_t shape[1] = {1};
  DLTensor dl{};
  dl.data = data;
  dl.device = {kDLCPU, 0};
  dl.ndim = 1;
  dl.shape = shape;
  dl.dtype = {kDLFloat, 64, 1};
  EXPECT_THROW(from_dlpack(dl), InvalidArgument);
  dl.dtype = {kDLFloat, 32, 4};
  EXPECT_THROW(from_dlpack(dl), InvalidArgument);
  dl.dtype = {kDLFloat, 32, 1};
  dl.device = {kDLVulkan, 0};
  EXPECT_THROW(from_dlpack(dl), InvalidArgument);
  dl.device = {kDLCUDA, 1};
  EXPECT_EQ(from_dlpack(dl).platform(), Platform::cuda);
}

TEST(Platform, ParseIsCaseInsensitiveAndListsValid) {
  EXPECT_EQ(parse_platform("CUDA"), Platform::cuda);
  try {
    parse_platform("tpu");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("musa"), std::string::npos);
  }
}

}  // namespace
}  // namespace dattn
