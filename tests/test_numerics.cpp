// Numerics at the edges (docs/semantics.md, "Non-finite inputs"): finite masks as low as
// torch.finfo(dtype).min are numbers, not hidden keys; NaN and +inf poison exactly the rows that
// look at them, on every backend and path (dense, every FLASH ISA, split-KV, paged, sparse,
// sequence-parallel merges); int8/fp8 K/V refuse non-finite values before anything is written.
#include <gtest/gtest.h>
#include <omp.h>

#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backends/flash/engines.hpp"
#include "dattn/attention.hpp"
#include "dattn/communicator.hpp"
#include "dattn/errors.hpp"
#include "dattn/page_pool.hpp"
#include "dattn/paged.hpp"
#include "dattn/parallel.hpp"
#include "dattn/registry.hpp"
#include "dense_oracle.hpp"
#include "parallel/exchange.hpp"
#include "test_inputs.hpp"

namespace dattn {
namespace {

using i64 = std::int64_t;
using testing::random_tensor;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// A backend and the options that pick one of its paths.
struct Engine {
  std::string backend;
  BackendOptions options;
  std::string name;
};

// REFERENCE and FLASH on every f32 engine this machine runs.
std::vector<Engine> dense_engines() {
  std::vector<Engine> e{{"REFERENCE", {}, "REFERENCE"}};
  for (const flash::Engine& engine : flash::engines())
    if (engine.available() && engine.compute == flash::ComputeDtype::f32)
      e.push_back(
          {"FLASH", {{"isa", std::string(engine.name)}}, "FLASH/" + std::string(engine.name)});
  return e;
}

// FLASH on every bf16 engine (real or emulated) this machine runs, with compute_dtype bf16 so
// that f32 inputs reach it: the same rules for masks and non-finite values, on the engines'
// own inner loops (amx: S rows with the scale folded into the exponent).
std::vector<Engine> bf16_engines() {
  std::vector<Engine> e;
  for (const flash::Engine& engine : flash::engines())
    if (engine.available() && engine.compute == flash::ComputeDtype::bf16)
      e.push_back({"FLASH",
                   {{"isa", std::string(engine.name)}, {"compute_dtype", std::string("bf16")}},
                   "FLASH/" + std::string(engine.name)});
  return e;
}

std::vector<Engine> every_engine() {
  std::vector<Engine> e = dense_engines();
  for (Engine& b : bf16_engines()) e.push_back(std::move(b));
  return e;
}

bool is_bf16(const Engine& e) {
  return e.options.contains("compute_dtype");
}

AttentionConfig config_for(const Engine& e, i64 hq, i64 hkv, i64 d, bool causal) {
  AttentionConfig c = testing::layer_config(e.backend, hq, hkv, d, causal);
  c.backend_options = e.options;
  return c;
}

// torch.finfo(dtype).min: the value models mask with.
float finfo_min(DType dtype) {
  switch (dtype) {
    case DType::BF16:
      return bf16_to_f32(0xff7f);
    case DType::F16:
      return -65504.0f;
    default:
      return std::numeric_limits<float>::lowest();
  }
}

float at(const TensorView& t, std::initializer_list<i64> idx) {
  i64 off = 0, n = 0;
  for (i64 i : idx) off += i * t.stride(int(n++));
  return load_as_f32(t.data(), t.dtype(), off);
}
void set(const Tensor& t, std::initializer_list<i64> idx, float value) {
  const TensorView v = t.view();
  i64 off = 0, n = 0;
  for (i64 i : idx) off += i * v.stride(int(n++));
  store_from_f32(t.data(), t.dtype(), off, value);
}

// ---- finite masks ----

// A [B, S, S] mask as [B, 1, S, S].
TensorView heads_of_one(const TensorView& t) {
  const std::array<i64, 4> shape{t.size(0), 1, t.size(1), t.size(2)};
  const std::array<i64, 4> strides{t.stride(0), 0, t.stride(1), t.stride(2)};
  return TensorView(t.data(), t.dtype(), shape, strides, t.platform());
}

struct FiniteMaskCase {
  DType dtype;
  int mask_rank;  // 3 or 4
  bool causal;
  // The mask value -1e38 instead of finfo.min: as far down, but a row's reference m times
  // log2(e) stays finite there (no shortcut may fold it into one rounded constant).
  bool minus_1e38 = false;
};

std::string finite_mask_name(const ::testing::TestParamInfo<FiniteMaskCase>& p) {
  return std::string(dtype_name(p.param.dtype)) + "_" + std::to_string(p.param.mask_rank) + "d" +
         (p.param.causal ? "_causal" : "") + (p.param.minus_1e38 ? "_minus1e38" : "");
}

class FiniteMask : public ::testing::TestWithParam<FiniteMaskCase> {};

// Rows 0-4 have every key masked with finfo.min (PyTorch: equal logits, mean(V), finite LSE),
// rows 5-12 about half of them, the rest an ordinary additive mask; against a float64 oracle
// that adds the mask to the scaled logits as PyTorch's math does.
TEST_P(FiniteMask, RowsMaskedWithTheLowestFiniteValueAttendUniformly) {
  const FiniteMaskCase c = GetParam();
  const i64 B = 2, S = 37, H = 4, HKV = 2, D = 24;
  const Tensor q = random_tensor({B, S, H, D}, c.dtype, 1);
  const Tensor k = random_tensor({B, S, HKV, D}, c.dtype, 2);
  const Tensor v = random_tensor({B, S, HKV, D}, c.dtype, 3);
  const i64 mh = c.mask_rank == 4 ? H : 1;
  Tensor mask = c.mask_rank == 4 ? random_tensor({B, mh, S, S}, c.dtype, 4)
                                 : random_tensor({B, S, S}, c.dtype, 4);
  const float lowest = c.minus_1e38 ? -1e38f : finfo_min(c.dtype);
  std::mt19937 rng(5);
  for (i64 b = 0; b < B; ++b)
    for (i64 h = 0; h < mh; ++h)
      for (i64 i = 0; i < 13; ++i)
        for (i64 j = 0; j < S; ++j)
          if (i < 5 || rng() % 2 == 0) {
            if (c.mask_rank == 4)
              set(mask, {b, h, i, j}, lowest);
            else
              set(mask, {b, i, j}, lowest);
          }
  const double scale = 1.0 / std::sqrt(double(D));
  const TensorView m4 = c.mask_rank == 4 ? mask.view() : heads_of_one(mask.view());
  const auto oracle =
      testing::dense_oracle(q.view(), k.view(), v.view(), scale,
                            [&](i64 b, i64 h, i64 i, i64 j) -> std::optional<double> {
                              if (c.causal && j > i) return std::nullopt;
                              return double(at(m4, {b, mh == 1 ? 0 : h, i, j}));
                            });
  for (const Engine& e : every_engine()) {
    SCOPED_TRACE(e.name);
    // The bf16 engines round f32 and f16 operands to bf16.
    const DType tol_dtype = is_bf16(e) ? DType::BF16 : c.dtype;
    AttentionMetadata meta;
    meta.attn_mask = mask.view();
    const auto r = Attention(config_for(e, H, HKV, D, c.causal))
                       .forward(q.view(), k.view(), v.view(), meta, true);
    const auto d = testing::compare(r.out.view(), oracle.out.view());
    EXPECT_FALSE(d.nan);
    EXPECT_LE(d.normwise_rel, 2 * testing::tolerance_for(tol_dtype));
    for (i64 b = 0; b < B; ++b)
      for (i64 h = 0; h < H; ++h)
        for (i64 i = 0; i < S; ++i) {
          const float got = at(r.lse->view(), {b, h, i});
          const float want = at(oracle.lse.view(), {b, h, i});
          ASSERT_TRUE(std::isfinite(got)) << b << " " << h << " " << i << ": " << got;
          EXPECT_NEAR(got, want, (is_bf16(e) ? 2e-2 : 1e-4) * std::max(1.0f, std::fabs(want)))
              << b << h << i;
        }
    // A fully masked row of a full (non-causal) layer is mean(V) of its KV head where the mask
    // value swallows the logits (f32 and bf16 lowest; f16's -65504 leaves them distinct).
    if (!c.causal && c.dtype != DType::F16)
      for (i64 e2 = 0; e2 < D; ++e2) {
        double mean = 0;
        for (i64 j = 0; j < S; ++j) mean += at(v.view(), {1, j, 1, e2});
        EXPECT_NEAR(at(r.out.view(), {1, 2, 3, e2}), mean / double(S),
                    4 * testing::tolerance_for(tol_dtype) + 1e-6);
      }
  }
}

INSTANTIATE_TEST_SUITE_P(
    DTypesRanksCausal, FiniteMask,
    ::testing::Values(FiniteMaskCase{DType::F32, 4, false}, FiniteMaskCase{DType::F32, 3, false},
                      FiniteMaskCase{DType::F32, 4, true}, FiniteMaskCase{DType::BF16, 4, false},
                      FiniteMaskCase{DType::BF16, 3, true}, FiniteMaskCase{DType::F16, 4, false},
                      FiniteMaskCase{DType::F16, 3, true},
                      FiniteMaskCase{DType::F32, 4, false, true},
                      FiniteMaskCase{DType::BF16, 3, false, true}),
    finite_mask_name);

// A 2-D key mask (bool) with a query row of a cross-attention call seeing no key: zeros and
// LSE -inf, never NaN, while the lowest finite value in a 4-D mask keeps a row alive.
TEST(FiniteMask, OnlyMinusInfinityOrFalseHidesAKey) {
  const i64 S = 20, D = 16;
  const Tensor q = random_tensor({1, 3, 1, D}, DType::F32, 1);
  const Tensor k = random_tensor({1, S, 1, D}, DType::F32, 2);
  const Tensor v = random_tensor({1, S, 1, D}, DType::F32, 3);
  for (const Engine& e : dense_engines()) {
    SCOPED_TRACE(e.name);
    Tensor keys = Tensor::zeros({1, S}, DType::Bool);  // every key hidden
    AttentionMetadata meta;
    meta.attn_mask = keys.view();
    const auto hidden =
        Attention(config_for(e, 1, 1, D, false)).forward(q.view(), k.view(), v.view(), meta, true);
    for (double x : testing::to_vector(hidden.out.view())) EXPECT_EQ(x, 0.0f);
    for (double l : testing::to_vector(hidden.lse->view())) EXPECT_EQ(l, -double(kInf));
    Tensor add = Tensor::zeros({1, 1, 3, S}, DType::F32);
    for (i64 n = 0; n < add.numel(); ++n) add.data_as<float>()[n] = -kInf;
    for (i64 j = 0; j < S; ++j) add.data_as<float>()[S + j] = finfo_min(DType::F32);  // row 1
    meta.attn_mask = add.view();
    const auto r =
        Attention(config_for(e, 1, 1, D, false)).forward(q.view(), k.view(), v.view(), meta, true);
    for (i64 e2 = 0; e2 < D; ++e2) {
      double mean = 0;
      for (i64 j = 0; j < S; ++j) mean += at(v.view(), {0, j, 0, e2});
      EXPECT_NEAR(at(r.out.view(), {0, 1, 0, e2}), mean / double(S), 1e-5);
      EXPECT_EQ(at(r.out.view(), {0, 0, 0, e2}), 0.0f);
    }
    EXPECT_NEAR(at(r.lse->view(), {0, 0, 1}), double(finfo_min(DType::F32)), 1e33);
    EXPECT_EQ(at(r.lse->view(), {0, 0, 0}), -kInf);
  }
}

// ---- non-finite inputs ----

// What a row must come out as.
enum class Expect { clean, nan, nan_or_clean, zero };

bool row_is_nan(const TensorView& out, const TensorView& lse, i64 b, i64 i, i64 h) {
  for (i64 e = 0; e < out.size(3); ++e)
    if (!std::isnan(at(out, {b, i, h, e}))) return false;
  return std::isnan(at(lse, {b, h, i}));
}
bool row_equals(const ForwardResult& got, const ForwardResult& clean, i64 b, i64 i, i64 h) {
  for (i64 e = 0; e < got.out.view().size(3); ++e) {
    const float a = at(got.out.view(), {b, i, h, e}), c = at(clean.out.view(), {b, i, h, e});
    if (!(std::fabs(a - c) <= 1e-6f * std::max(1.0f, std::fabs(c)))) return false;
  }
  const float a = at(got.lse->view(), {b, h, i}), c = at(clean.lse->view(), {b, h, i});
  return a == c || std::fabs(a - c) <= 1e-6f * std::max(1.0f, std::fabs(c));
}

void check_rows(const ForwardResult& got, const ForwardResult& clean,
                const std::function<Expect(i64, i64, i64)>& expect) {
  const i64 B = got.out.view().size(0), S = got.out.view().size(1), H = got.out.view().size(2);
  int nan_rows = 0;
  for (i64 b = 0; b < B; ++b)
    for (i64 i = 0; i < S; ++i)
      for (i64 h = 0; h < H; ++h) {
        const bool nan = row_is_nan(got.out.view(), got.lse->view(), b, i, h);
        nan_rows += nan;
        switch (expect(b, i, h)) {
          case Expect::clean:
            EXPECT_TRUE(row_equals(got, clean, b, i, h)) << "row b" << b << " i" << i << " h" << h;
            break;
          case Expect::nan:
            EXPECT_TRUE(nan) << "row b" << b << " i" << i << " h" << h << " is not NaN";
            break;
          case Expect::nan_or_clean:
            EXPECT_TRUE(nan || row_equals(got, clean, b, i, h)) << b << " " << i << " " << h;
            break;
          case Expect::zero:
            for (i64 e = 0; e < got.out.view().size(3); ++e)
              EXPECT_EQ(at(got.out.view(), {b, i, h, e}), 0.0f);
            EXPECT_EQ(at(got.lse->view(), {b, h, i}), -kInf);
            break;
        }
      }
  EXPECT_GT(nan_rows, 0);
}

enum class Poison { q_nan, k_nan, k_inf, q_minus_inf, v_nan, v_inf, mask_nan, mask_inf };

struct PoisonCase {
  Poison what;
  const char* name;
};

class NonFinite : public ::testing::TestWithParam<PoisonCase> {};

// Causal self-attention (rows i < j0 hide key j0), GQA 2:1, an additive 4-D mask, and a long
// enough sequence for several key tiles; one element poisoned. Every engine: the rows that
// look at the poison are NaN with LSE NaN, the rows of other heads and batches are exactly the
// clean result, and the rows that hide it are NaN or clean.
TEST_P(NonFinite, PoisonsExactlyTheRowsThatSeeIt) {
  const Poison what = GetParam().what;
  const i64 B = 2, S = 150, H = 4, HKV = 2, D = 20;
  const i64 b0 = 1, i0 = 90, j0 = 70, hk0 = 1, h0 = 2;  // h0 reads KV head hk0
  const Tensor q = random_tensor({B, S, H, D}, DType::F32, 1);
  const Tensor k = random_tensor({B, S, HKV, D}, DType::F32, 2);
  const Tensor v = random_tensor({B, S, HKV, D}, DType::F32, 3);
  const Tensor mask = random_tensor({B, H, S, S}, DType::F32, 4);
  const Tensor pq = Tensor::copy_of(q.view()), pk = Tensor::copy_of(k.view()),
               pv = Tensor::copy_of(v.view()), pm = Tensor::copy_of(mask.view());
  switch (what) {
    case Poison::q_nan:
      set(pq, {b0, i0, h0, 3}, kNaN);
      break;
    case Poison::q_minus_inf:
      set(pq, {b0, i0, h0, 3}, -kInf);
      break;
    case Poison::k_nan:
      set(pk, {b0, j0, hk0, 5}, kNaN);
      break;
    case Poison::k_inf:
      set(pk, {b0, j0, hk0, 5}, kInf);
      break;
    case Poison::v_nan:
      set(pv, {b0, j0, hk0, 7}, kNaN);
      break;
    case Poison::v_inf:
      set(pv, {b0, j0, hk0, 7}, kInf);
      break;
    case Poison::mask_nan:
      set(pm, {b0, h0, i0, j0}, kNaN);
      break;
    case Poison::mask_inf:
      set(pm, {b0, h0, i0, j0}, kInf);
      break;
  }
  const bool in_q = what == Poison::q_nan || what == Poison::q_minus_inf;
  const bool in_mask = what == Poison::mask_nan || what == Poison::mask_inf;
  const auto expect = [&](i64 b, i64 i, i64 h) {
    if (b != b0) return Expect::clean;
    if (in_q || in_mask) return (i == i0 && h == h0) ? Expect::nan : Expect::clean;
    if (h / (H / HKV) != hk0) return Expect::clean;
    return i >= j0 ? Expect::nan : Expect::nan_or_clean;
  };
  for (const Engine& e : every_engine()) {
    SCOPED_TRACE(e.name);
    AttentionMetadata clean_meta, meta;
    clean_meta.attn_mask = mask.view();
    meta.attn_mask = pm.view();
    const Attention layer(config_for(e, H, HKV, D, true));
    const auto clean = layer.forward(q.view(), k.view(), v.view(), clean_meta, true);
    const auto got = layer.forward(pq.view(), pk.view(), pv.view(), meta, true);
    check_rows(got, clean, expect);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Inputs, NonFinite,
    ::testing::Values(PoisonCase{Poison::q_nan, "q_nan"}, PoisonCase{Poison::k_nan, "k_nan"},
                      PoisonCase{Poison::k_inf, "k_inf"},
                      PoisonCase{Poison::q_minus_inf, "q_minus_inf"},
                      PoisonCase{Poison::v_nan, "v_nan"}, PoisonCase{Poison::v_inf, "v_inf"},
                      PoisonCase{Poison::mask_nan, "mask_nan"},
                      PoisonCase{Poison::mask_inf, "mask_inf"}),
    [](const ::testing::TestParamInfo<PoisonCase>& p) { return p.param.name; });

// A NaN query row that sees no key (its mask hides them all) is still a row with no visible
// key: zeros and LSE -inf.
TEST(NonFinite, ARowWithNoVisibleKeyStaysZero) {
  const i64 S = 40, D = 16;
  Tensor q = random_tensor({1, S, 1, D}, DType::F32, 1);
  const Tensor k = random_tensor({1, S, 1, D}, DType::F32, 2);
  const Tensor v = random_tensor({1, S, 1, D}, DType::F32, 3);
  Tensor keep = Tensor::zeros({1, 1, S, S}, DType::Bool);
  for (i64 n = 0; n < keep.numel(); ++n) keep.data_as<std::uint8_t>()[n] = 1;
  for (i64 j = 0; j < S; ++j) keep.data_as<std::uint8_t>()[7 * S + j] = 0;
  for (i64 e = 0; e < D; ++e) set(q, {0, 7, 0, e}, kNaN);
  for (const Engine& e : dense_engines()) {
    SCOPED_TRACE(e.name);
    AttentionMetadata meta;
    meta.attn_mask = keep.view();
    const auto r =
        Attention(config_for(e, 1, 1, D, false)).forward(q.view(), k.view(), v.view(), meta, true);
    for (i64 e2 = 0; e2 < D; ++e2) EXPECT_EQ(at(r.out.view(), {0, 7, 0, e2}), 0.0f);
    EXPECT_EQ(at(r.lse->view(), {0, 0, 7}), -kInf);
    EXPECT_TRUE(std::isfinite(at(r.out.view(), {0, 8, 0, 0})));
  }
}

// q.k past f32's range (inputs near 1e19): a backend computing in f32 returns NaN for the row,
// never the zeros of a row that saw no key; REFERENCE (f64) stays finite.
TEST(NonFinite, AnOverflowingDotProductGivesNaNNotZeros) {
  const i64 S = 30, D = 32;
  Tensor q = random_tensor({1, S, 1, D}, DType::F32, 1);
  Tensor k = random_tensor({1, S, 1, D}, DType::F32, 2);
  const Tensor v = random_tensor({1, S, 1, D}, DType::F32, 3);
  for (i64 e = 0; e < D; ++e) {
    set(q, {0, 4, 0, e}, 1e19f);
    for (i64 j = 0; j < S; ++j) set(k, {0, j, 0, e}, j % 2 ? -2e19f : 3e19f);
  }
  for (const Engine& e : dense_engines()) {
    SCOPED_TRACE(e.name);
    const auto r =
        Attention(config_for(e, 1, 1, D, false)).forward(q.view(), k.view(), v.view(), {}, true);
    const float x = at(r.out.view(), {0, 4, 0, 0});
    if (e.backend == "REFERENCE")
      EXPECT_TRUE(std::isfinite(x)) << x;
    else
      EXPECT_TRUE(row_is_nan(r.out.view(), r.lse->view(), 0, 4, 0)) << x;
  }
}

// Split-KV: one query block and a long key range run as parallel key ranges merged by LSE; a
// NaN in either range, or in the query, poisons the merged rows.
TEST(NonFinite, SplitKeyRangesMergeToNaN) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  const i64 S = 6, SKV = 700, D = 16;
  const Tensor q = random_tensor({1, S, 1, D}, DType::F32, 1);
  const Tensor k = random_tensor({1, SKV, 1, D}, DType::F32, 2);
  const Tensor v = random_tensor({1, SKV, 1, D}, DType::F32, 3);
  for (const Engine& e : dense_engines()) {
    SCOPED_TRACE(e.name);
    const Attention layer(config_for(e, 1, 1, D, false));
    const auto clean = layer.forward(q.view(), k.view(), v.view(), {}, true);
    for (const i64 j0 : {i64(10), i64(650)}) {
      Tensor pk = Tensor::copy_of(k.view());
      set(pk, {0, j0, 0, 2}, kNaN);
      check_rows(layer.forward(q.view(), pk.view(), v.view(), {}, true), clean,
                 [](i64, i64, i64) { return Expect::nan; });
      Tensor pv = Tensor::copy_of(v.view());
      set(pv, {0, j0, 0, 2}, kInf);
      check_rows(layer.forward(q.view(), k.view(), pv.view(), {}, true), clean,
                 [](i64, i64, i64) { return Expect::nan; });
    }
    Tensor pq = Tensor::copy_of(q.view());
    set(pq, {0, 3, 0, 0}, kNaN);
    check_rows(layer.forward(pq.view(), k.view(), v.view(), {}, true), clean,
               [](i64, i64 i, i64) { return i == 3 ? Expect::nan : Expect::clean; });
  }
  omp_set_num_threads(saved);
}

// ---- paged and quantized KV ----

std::vector<std::string> paged_backends() {
  std::vector<std::string> names;
  for (const auto& b : Registry::global().all())
    if (b->supports_paged_kv()) names.push_back(b->name());
  return names;
}

TEST(NonFinite, PagedRowsThatAttendANaNValueAreNaN) {
  const i64 T = 40, D = 16, BS = 8;
  Tensor storage = Tensor::zeros({2, 8, BS, 1, D}, DType::F32);
  const auto half = [&](i64 n) {  // [8, BS, 1, D] pages of storage[n]
    const TensorView s = storage.view().sliced(0, n, 1);
    const std::array<i64, 4> shape{8, BS, 1, D};
    const std::array<i64, 4> strides{s.stride(1), s.stride(2), s.stride(3), s.stride(4)};
    return TensorView(s.data(), DType::F32, shape, strides);
  };
  const TensorView kp = half(0), vp = half(1);
  const Tensor q = random_tensor({T, 2, D}, DType::F32, 1);
  const Tensor k = random_tensor({T, 1, D}, DType::F32, 2);
  Tensor v = random_tensor({T, 1, D}, DType::F32, 3);
  for (i64 e = 0; e < D; ++e) set(v, {17, 0, e}, e % 2 ? kNaN : kInf);
  for (const std::string& backend : paged_backends()) {
    SCOPED_TRACE(backend);
    Tensor out = Tensor::zeros({T, 2, D}, DType::F32);
    Tensor lse = Tensor::zeros({2, T}, DType::F32);
    PagedAttentionCall call;
    call.q = q.view(), call.k_new = k.view(), call.v_new = v.view(), call.out = out.view();
    call.lse = lse.view();
    call.cache = {kp, vp};
    call.rows = {{T, T, 0, {5, 1, 7, 0, 3}}};
    call.softmax_scale = 0.25;
    call.causal = true;
    Attention(testing::layer_config(backend, 2, 1, D)).forward_paged(call);
    for (i64 t = 0; t < T; ++t)
      for (i64 h = 0; h < 2; ++h) {
        const bool nan =
            std::isnan(at(out.view(), {t, h, 0})) && std::isnan(at(lse.view(), {h, t}));
        if (t >= 17) {
          EXPECT_TRUE(nan) << t;
        } else if (!nan) {
          EXPECT_TRUE(std::isfinite(at(out.view(), {t, h, 0}))) << t;
        }
      }
  }
}

// An inf or NaN bound for int8/fp8 pages is refused at write time, naming the tensor; pages and
// scales stay as they were.
TEST(NonFinite, QuantizedPagesRefuseNonFiniteValuesBeforeWriting) {
  for (const DType dtype : {DType::I8, DType::FP8_E4M3}) {
    PagePoolConfig pc;
    pc.num_blocks = 4, pc.block_size = 8, pc.kv_heads = 1, pc.head_size = 16, pc.dtype = dtype;
    PagePool pool(pc);
    const auto table = pool.allocate(2);
    const i64 T = 12;
    const Tensor q = random_tensor({T, 1, 16}, DType::F32, 1);
    const Tensor k = random_tensor({T, 1, 16}, DType::F32, 2);
    const Tensor v = random_tensor({T, 1, 16}, DType::F32, 3);
    for (const std::string& backend : paged_backends()) {
      SCOPED_TRACE(backend);
      const Attention layer(testing::layer_config(backend, 1, 1, 16));
      Tensor out = Tensor::zeros({T, 1, 16}, DType::F32);
      PagedAttentionCall call;
      call.q = q.view(), call.k_new = k.view(), call.v_new = v.view(), call.out = out.view();
      call.cache = pool.layer(0);
      call.rows = {{T, T, 0, table}};
      layer.forward_paged(call);  // a good first write
      const PagedKvCache cache = pool.layer(0);
      const Tensor pages_before = Tensor::copy_of(cache.k_pages);
      const Tensor scales_before = Tensor::copy_of(*cache.v_scales);
      const Tensor out_before = Tensor::copy_of(out.view());
      for (const bool value : {false, true})
        for (const float bad : {kNaN, kInf, -kInf}) {
          Tensor poisoned = Tensor::copy_of((value ? v : k).view());
          set(poisoned, {5, 0, 9}, bad);
          PagedAttentionCall c2 = call;
          (value ? c2.v_new : c2.k_new) = poisoned.view();
          try {
            layer.forward_paged(c2);
            ADD_FAILURE() << "accepted " << bad;
          } catch (const InvalidArgument& e) {
            EXPECT_EQ(e.field(), value ? "v_new" : "k_new");
          }
          EXPECT_TRUE(testing::bitwise_equal(Tensor::copy_of(cache.k_pages), pages_before));
          EXPECT_TRUE(testing::bitwise_equal(Tensor::copy_of(*cache.v_scales), scales_before));
          EXPECT_TRUE(testing::bitwise_equal(out, out_before));
        }
    }
  }
}

// kv_cache_dtype int8/fp8 on a dense call: an inf or NaN in K or V is an InvalidArgument and
// the output is untouched.
TEST(NonFinite, QuantizedDenseKvRefusesNonFiniteValues) {
  const Tensor q = random_tensor({1, 20, 2, 16}, DType::F32, 1);
  const Tensor k = random_tensor({1, 20, 2, 16}, DType::F32, 2);
  Tensor v = random_tensor({1, 20, 2, 16}, DType::F32, 3);
  set(v, {0, 11, 1, 4}, kInf);
  for (const std::string& backend : {std::string("FLASH"), std::string("REFERENCE")})
    for (const KvCacheDtype dt : {KvCacheDtype::int8, KvCacheDtype::fp8}) {
      SCOPED_TRACE(backend);
      AttentionConfig c = testing::layer_config(backend, 2, 2, 16);
      c.kv_cache_dtype = dt;
      Tensor out = Tensor::zeros({1, 20, 2, 16}, DType::F32);
      const Tensor before = Tensor::copy_of(out.view());
      try {
        Attention(c).forward_into(q.view(), k.view(), v.view(), {}, out.view());
        ADD_FAILURE() << "accepted inf in value";
      } catch (const InvalidArgument& e) {
        EXPECT_EQ(e.field(), "value");
        EXPECT_NE(std::string(e.what()).find("inf"), std::string::npos) << e.what();
      }
      EXPECT_TRUE(testing::bitwise_equal(out, before));
    }
}

// ---- VIDEO_SPARSE ----

// A NaN pooled key block ranks below every number: with top-1 of 8 video blocks no query block
// picks it, so every row stays finite; a NaN query row is NaN.
TEST(NonFinite, VideoSparseTopKRanksANaNBlockLast) {
  const i64 S = 32, D = 16;
  Tensor q = random_tensor({1, S, 2, D}, DType::F32, 1);
  Tensor k = random_tensor({1, S, 1, D}, DType::F32, 2);
  const Tensor v = random_tensor({1, S, 1, D}, DType::F32, 3);
  set(k, {0, 9, 0, 3}, kNaN);
  AttentionConfig c = testing::layer_config("VIDEO_SPARSE", 2, 1, D);
  c.backend_options = {{"topk", i64(1)}, {"tile", std::string("1,2,2")}};
  AttentionMetadata meta;
  VideoTokenLayout layout;
  layout.prefix_len = 0;
  layout.latent_grid = {2, 4, 4};
  meta.video_layout = layout;
  const Attention layer(c);
  const auto r = layer.forward(q.view(), k.view(), v.view(), meta, true);
  for (double x : testing::to_vector(r.out.view())) ASSERT_TRUE(std::isfinite(x));
  for (i64 e = 0; e < D; ++e) set(q, {0, 20, 1, e}, kNaN);
  const auto p = layer.forward(q.view(), k.view(), v.view(), meta, true);
  EXPECT_TRUE(row_is_nan(p.out.view(), p.lse->view(), 0, 20, 1));
  EXPECT_TRUE(std::isfinite(at(p.out.view(), {0, 20, 0, 0})));
}

// ---- sequence-parallel merges ----

// The (O, LSE) merge of ring steps keeps a NaN side NaN whichever side it is on.
TEST(NonFinite, PartialMergeKeepsNaN) {
  const auto make = [](float o, float l) {
    Tensor t = Tensor::empty({1, 1, 1, 2}, DType::F32), s = Tensor::empty({1, 1, 1}, DType::F32);
    t.data_as<float>()[0] = t.data_as<float>()[1] = o;
    s.data_as<float>()[0] = l;
    return std::pair{t, s};
  };
  for (const bool nan_first : {false, true}) {
    auto [o, l] = nan_first ? make(kNaN, kNaN) : make(1.0f, 0.5f);
    auto [po, pl] = nan_first ? make(1.0f, 0.5f) : make(kNaN, kNaN);
    parallel::merge_partial(o.view(), l.view(), po.view(), pl.view());
    EXPECT_TRUE(std::isnan(o.data_as<float>()[0]) && std::isnan(o.data_as<float>()[1]));
    EXPECT_TRUE(std::isnan(l.data_as<float>()[0]));
    auto [eo, el] = make(0.0f, -kInf);  // an empty accumulator takes the NaN as it is
    parallel::merge_partial(eo.view(), el.view(), o.view(), l.view());
    EXPECT_TRUE(std::isnan(el.data_as<float>()[0]));
  }
}

// Ring attention over two ranks (threads): a NaN key on rank 1 poisons the rows of both ranks
// that see it, like one process does.
TEST(NonFinite, RingAttentionPropagatesNaNAcrossRanks) {
  const i64 S = 24, D = 16;
  const Tensor q = random_tensor({1, S, 2, D}, DType::F32, 1);
  Tensor k = random_tensor({1, S, 1, D}, DType::F32, 2);
  const Tensor v = random_tensor({1, S, 1, D}, DType::F32, 3);
  set(k, {0, 18, 0, 1}, kNaN);
  const auto whole =
      Attention(testing::layer_config("FLASH", 2, 1, D)).forward(q.view(), k.view(), v.view());
  auto comms = make_in_process_group(2);
  std::vector<Tensor> outs(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      try {
        omp_set_num_threads(1);
        AttentionConfig c = testing::layer_config("FLASH", 2, 1, D);
        c.parallel = make_parallel_strategy("ring", comms[std::size_t(r)]);
        const auto [start, rows] = shard_rows(S, 2, r);
        const auto slice = [&](const Tensor& t) { return t.view().sliced(1, start, rows); };
        outs[std::size_t(r)] = Attention(c).forward(slice(q), slice(k), slice(v)).out;
      } catch (const std::exception& e) {
        errors[std::size_t(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[std::size_t(r)], "");
    const auto [start, rows] = shard_rows(S, 2, r);
    for (i64 i = 0; i < rows; ++i)
      for (i64 h = 0; h < 2; ++h)
        EXPECT_TRUE(std::isnan(at(outs[std::size_t(r)].view(), {0, i, h, 0})))
            << "rank " << r << " row " << i;
    (void)start;
  }
  EXPECT_TRUE(std::isnan(at(whole.out.view(), {0, 0, 0, 0})));
}

}  // namespace
}  // namespace dattn
