// SAGE (8-bit Q.K^T on FLASH's driver) beyond the conformance suite: every int8 engine computes
// the same logits bit for bit (integers are exact; the twins emulate the instructions), the
// accuracy against REFERENCE on Gaussian inputs and on inputs shaped like DiT activations (K
// with per-channel offsets far above its spread, Q with heavy-tailed channels, rows of near-equal
// logits) with K smoothing on and off, non-finite and extreme values, the LSE with smoothing,
// VIDEO_SPARSE on the int8 engines, and the options.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backends/flash/engines.hpp"
#include "backends/flash/kernels.hpp"
#include "dattn/attention.hpp"
#include "dattn/engines.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"
#include "engine_logits.hpp"
#include "test_inputs.hpp"

namespace dattn {
namespace {

// The head sizes of the accuracy tests below: 64 and 128; under the sanitizers 128 alone (the
// same code paths, whole channel groups: CI time).
std::vector<std::int64_t> head_sizes() {
  if (testing::kSanitized) return {128};
  return {64, 128};
}

using i64 = std::int64_t;
using testing::random_tensor;

std::vector<const flash::Engine*> int8_engines(bool available_only = true) {
  std::vector<const flash::Engine*> out;
  for (const flash::Engine& e : flash::engines())
    if (e.compute == flash::ComputeDtype::int8 && (!available_only || e.available()))
      out.push_back(&e);
  return out;
}

// The engines of the long accuracy loops: int8_engines(), the twins left out where
// DATTN_TEST_TWINS=0 (testing::twins_in_engine_loops).
std::vector<const flash::Engine*> int8_accuracy_engines() {
  std::vector<const flash::Engine*> out = int8_engines();
  if (!testing::twins_in_engine_loops())
    std::erase_if(out, [](const flash::Engine* e) { return e->emulated; });
  return out;
}

AttentionConfig sage_config(i64 hq, i64 hkv, i64 d, const std::string& isa = "",
                            bool causal = false) {
  AttentionConfig c = testing::layer_config("SAGE", hq, hkv, d, causal);
  if (!isa.empty()) c.backend_options["isa"] = isa;
  return c;
}

// Per head: the cosine similarity and the mean relative L1 (sum |a - b| / sum |b|) of the output
// against REFERENCE's.
struct HeadAccuracy {
  double worst_cosine = 1.0, worst_rel_l1 = 0.0;
};
HeadAccuracy per_head(const Tensor& got, const Tensor& want) {
  const i64 b = want.view().size(0), s = want.view().size(1), h = want.view().size(2),
            e = want.view().size(3);
  const std::vector<double> g = testing::to_vector(got.view()), w = testing::to_vector(want.view());
  HeadAccuracy a;
  for (i64 hh = 0; hh < h; ++hh) {
    double dot = 0, gg = 0, ww = 0, l1 = 0, n1 = 0;
    for (i64 bb = 0; bb < b; ++bb)
      for (i64 i = 0; i < s; ++i)
        for (i64 x = 0; x < e; ++x) {
          const std::size_t at = std::size_t(((bb * s + i) * h + hh) * e + x);
          dot += g[at] * w[at];
          gg += g[at] * g[at];
          ww += w[at] * w[at];
          l1 += std::fabs(g[at] - w[at]);
          n1 += std::fabs(w[at]);
        }
    a.worst_cosine = std::min(a.worst_cosine, dot / std::sqrt(gg * ww));
    a.worst_rel_l1 = std::max(a.worst_rel_l1, l1 / n1);
  }
  return a;
}

ForwardResult reference(AttentionConfig c, const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionMetadata& m = {}) {
  c.backend = "REFERENCE";
  c.backend_options.clear();
  return Attention(c).forward(q.view(), k.view(), v.view(), m, true);
}

// Inputs shaped like a DiT's attention activations: K with a per-channel offset 10-50x its
// spread (what SageAttention's smoothing removes), Q with a few heavy-tailed channels, V plain.
struct DitLike {
  Tensor q, k, v;
};
DitLike dit_like(i64 s, i64 h, i64 d, std::uint32_t seed) {
  DitLike x{Tensor::empty({1, s, h, d}, DType::F32), Tensor::empty({1, s, h, d}, DType::F32),
            random_tensor({1, s, h, d}, DType::F32, seed + 2)};
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::student_t_distribution<float> heavy(2.0f);
  std::uniform_real_distribution<float> u(10.0f, 50.0f);
  std::vector<float> offset(std::size_t(h * d));
  for (float& o : offset) o = u(rng) * (rng() % 2 ? 1.0f : -1.0f);
  for (i64 i = 0; i < s; ++i)
    for (i64 hh = 0; hh < h; ++hh)
      for (i64 e = 0; e < d; ++e) {
        const std::size_t at = std::size_t((i * h + hh) * d + e);
        x.k.data_as<float>()[at] = offset[std::size_t(hh * d + e)] + n(rng);
        x.q.data_as<float>()[at] = (e % 16 == 3 ? heavy(rng) * 4.0f : n(rng)) * 0.3f;
      }
  return x;
}

// Every int8 engine (real ones this CPU runs, every twin) gives the same S^T bit for bit: the
// same codes and scales (the vector quantizers included: a key and a query row that are not
// finite), exact integer dots, the same two scale multiplies.
TEST(SageEngines, EveryEngineComputesTheSameLogitsBitForBit) {
  const std::vector<const flash::Engine*> engines = int8_engines();
  ASSERT_GE(engines.size(), 5u);  // portable_int8 and the four twins run everywhere
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 2.0f);
  // `extreme`: every element +-2, so every code is +-127 and every pair of products reaches the
  // 16-bit pair sums' largest magnitude (avx2_int8's vpmaddubsw: |q| <= 127 against k, or against
  // k's complement -k - 1 where q < 0, so 2 x 127 x 128 where k = 127); the logits are then
  // exactly 0.125 q . k up to f32 rounding.
  std::bernoulli_distribution coin(0.5);
  for (const bool extreme : {false, true})
    for (const int d : {64, 59, 128})
      for (const int keys : {64, 37, 1}) {
        const int rows = 61;
        const auto draw = [&] { return extreme ? (coin(rng) ? 2.0f : -2.0f) : n(rng); };
        std::vector<std::vector<float>> results;
        std::vector<float> k(std::size_t(keys) * (d + 16));
        for (float& x : k) x = draw();
        std::vector<float> qt(std::size_t(d) * 64 * 2, 0.0f);
        for (int e = 0; e < d; ++e)
          for (int r = 0; r < rows; ++r) qt[std::size_t(e) * 128 + r] = draw();
        k[3] = INFINITY;  // key 0 is not finite: its logits are NaN in every row
        qt[std::size_t(d / 2) * 128 + 7] = NAN;  // query row 7 is not: its logits are NaN
        for (const flash::Engine* e : engines) {
          SCOPED_TRACE(std::string(e->name) + " d " + std::to_string(d) + " keys " +
                       std::to_string(keys) + (extreme ? " extreme" : ""));
          const testing::EngineLogits got = testing::engine_logits(*e, qt, k, d, keys, rows);
          ASSERT_TRUE(got.ok);
          const std::vector<float>& mine = got.logits;
          for (int r = 0; r < rows; ++r) EXPECT_TRUE(std::isnan(mine[std::size_t(r)])) << r;
          for (int j = 0; j < keys; ++j)
            EXPECT_TRUE(std::isnan(mine[std::size_t(j) * rows + 7])) << j;
          if (extreme)
            for (int j = 1; j < keys; ++j)
              for (int r = 0; r < rows; ++r) {
                if (r == 7) continue;
                double dot = 0.0;
                for (int ch = 0; ch < d; ++ch)
                  dot += double(qt[std::size_t(ch) * 128 + r]) * k[std::size_t(j) * (d + 16) + ch];
                ASSERT_NEAR(mine[std::size_t(j) * rows + r], 0.125 * dot, 1e-5 * 0.5 * d)
                    << "key " << j << " row " << r;
              }
          results.push_back(mine);
        }
        for (std::size_t n2 = 1; n2 < results.size(); ++n2)
          EXPECT_EQ(
              std::memcmp(results[n2].data(), results[0].data(), results[0].size() * sizeof(float)),
              0)
              << engines[n2]->name << " vs " << engines[0]->name;
      }
}

// An engine's K and V tiles are its twin's byte for byte, for each integer P.V: the vector
// quantizers of the real engines (avx2_int8's pack_key_row and pack_v_pairs, avx512_vnni's
// pack_key_row) make the portable loops' scales and codes, tails past a whole vector, columns
// and keys that are not finite, all zeros or huge included.
TEST(SageEngines, KAndVTilesAreTheTwinsBytes) {
  std::mt19937 rng(17);
  std::normal_distribution<float> n(0.0f, 3.0f);
  int compared = 0;
  for (const flash::Engine* e : int8_engines()) {
    if (e->emulated) continue;
    const flash::Engine* twin = nullptr;
    for (const flash::Engine* t : int8_engines())
      if (t->name == std::string(e->name) + "_emulated") twin = t;
    if (twin == nullptr) continue;
    for (const flash::PvDtype pv : {flash::PvDtype::int8, flash::PvDtype::int16}) {
      const flash::TileKernels& a = flash::int8_engine_kernels(*e, pv);
      const flash::TileKernels& b = flash::int8_engine_kernels(*twin, pv);
      for (const int d : {64, 59, 128, 80})
        for (const int keys : {64, 37, 1}) {
          SCOPED_TRACE(std::string(e->name) + (pv == flash::PvDtype::int8 ? " int8" : " int16") +
                       " d " + std::to_string(d) + " keys " + std::to_string(keys));
          const std::int64_t ld = d + 16;
          std::vector<float> x(std::size_t(keys) * ld);
          for (float& v : x) v = n(rng);
          for (int j = 0; j < keys; ++j) {
            x[std::size_t(j) * ld + 1] = 0.0f;   // an all-zero column
            x[std::size_t(j) * ld + 2] = 1e30f;  // a huge one
          }
          x[std::size_t(keys / 2) * ld + 5] = NAN;             // a column and a key with a NaN,
          x[std::size_t(keys - 1) * ld + (d - 1)] = INFINITY;  // another with an inf (a tail)
          const int dv = (d + a.col_align - 1) / a.col_align * a.col_align;
          ASSERT_EQ(a.formats.k_tile_bytes(d), b.formats.k_tile_bytes(d));
          ASSERT_EQ(a.formats.v_tile_bytes(dv), b.formats.v_tile_bytes(dv));
          std::vector<float> v(std::size_t(keys) * (dv + 16), 0.0f);
          for (int j = 0; j < keys; ++j)
            std::copy_n(x.data() + std::size_t(j) * ld, d, v.data() + std::size_t(j) * (dv + 16));
          const auto packed = [&](const flash::TileKernels& kk, bool key) {
            const std::size_t bytes =
                key ? kk.formats.k_tile_bytes(d) : kk.formats.v_tile_bytes(dv);
            std::vector<unsigned char> buf(bytes + 64, 0);
            auto* t = reinterpret_cast<unsigned char*>(
                (reinterpret_cast<std::uintptr_t>(buf.data()) + 63) / 64 * 64);
            if (key)
              kk.formats.pack_k(x.data(), ld, keys, d, t);
            else
              kk.formats.pack_v(v.data(), dv + 16, keys, dv, t);
            return std::vector<unsigned char>(t, t + bytes);
          };
          EXPECT_EQ(packed(a, true), packed(b, true)) << "K tiles";
          EXPECT_EQ(packed(a, false), packed(b, false)) << "V tiles";
          ++compared;
        }
    }
  }
  std::printf("[ tiles ] %d real engine / twin pairs x shapes compared\n", compared);
}

// The documented accuracy (docs/semantics.md, "SAGE"): cosine >= 0.9995 and mean relative L1
// <= 1% per head against REFERENCE, on every int8 engine, D 64 and 128, Gaussian and DiT-like
// inputs with smoothing on; smoothing is what keeps DiT-like K accurate.
TEST(Sage, AccuracyAgainstReferencePerHead) {
  for (const flash::Engine* e : int8_accuracy_engines())
    for (const i64 d : head_sizes())
      for (const bool dit : {false, true}) {
        const i64 s = 200, h = 2;
        SCOPED_TRACE(std::string(e->name) + " D" + std::to_string(d) +
                     (dit ? " DiT-like" : " Gaussian"));
        DitLike x = dit ? dit_like(s, h, d, 11)
                        : DitLike{random_tensor({1, s, h, d}, DType::F32, 1),
                                  random_tensor({1, s, h, d}, DType::F32, 2),
                                  random_tensor({1, s, h, d}, DType::F32, 3)};
        AttentionConfig c = sage_config(h, h, d, std::string(e->name));
        const ForwardResult want = reference(c, x.q, x.k, x.v);
        const ForwardResult got =
            Attention(c).forward(x.q.view(), x.k.view(), x.v.view(), {}, true);
        const HeadAccuracy a = per_head(got.out, want.out);
        std::printf("[ accuracy ] %-22s D%-3lld %-9s cosine %.6f  rel L1 %.4f%%\n",
                    std::string(e->name).c_str(), static_cast<long long>(d),
                    dit ? "DiT-like" : "Gaussian", a.worst_cosine, 100 * a.worst_rel_l1);
        EXPECT_GE(a.worst_cosine, 0.9995);
        EXPECT_LE(a.worst_rel_l1, 0.01);
        // The LSE carries the smoothing's shift back: REFERENCE's to 5e-2.
        const auto l = testing::compare(got.lse->view(), want.lse->view());
        EXPECT_LE(l.max_abs, 5e-2);
        if (dit) {  // without smoothing the offsets take the codes' range
          c.backend_options["smooth_k"] = false;
          const ForwardResult raw = Attention(c).forward(x.q.view(), x.k.view(), x.v.view());
          const HeadAccuracy b = per_head(raw.out, want.out);
          EXPECT_GT(b.worst_rel_l1, a.worst_rel_l1);
        }
      }
}

// pv_dtype int8 (P and V as 8-bit codes on the engine's integer dot): measured against
// REFERENCE like the default, on every int8 engine (amx_int8 runs avx512_vnni's and says so), with
// its own documented bounds (docs/semantics.md, "SAGE": cosine >= 0.9995, mean relative L1 <=
// 1.6%, above the default's), the default's LSE; NaN in V stays visible; a last key tile with
// only some keys (203 rows) and GQA.
TEST(Sage, Int8PvAccuracyAgainstReference) {
  for (const flash::Engine* e : int8_accuracy_engines())
    for (const i64 d : head_sizes())
      for (const bool dit : {false, true}) {
        const i64 s = 203, hq = 4, hkv = 2;
        SCOPED_TRACE(std::string(e->name) + " D" + std::to_string(d) +
                     (dit ? " DiT-like" : " Gaussian"));
        DitLike x = dit ? dit_like(s, hkv, d, 71)
                        : DitLike{random_tensor({1, s, hkv, d}, DType::F32, 1),
                                  random_tensor({1, s, hkv, d}, DType::F32, 2),
                                  random_tensor({1, s, hkv, d}, DType::F32, 3)};
        const Tensor q =
            dit ? dit_like(s, hq, d, 72).q : random_tensor({1, s, hq, d}, DType::F32, 4);
        AttentionConfig c = sage_config(hq, hkv, d, std::string(e->name));
        c.backend_options["pv_dtype"] = std::string("int8");
        const Attention layer(c);
        const ForwardResult got = layer.forward(q.view(), x.k.view(), x.v.view(), {}, true);
        const std::string ran = layer.last_engine();
        EXPECT_TRUE(ran == e->name || (e->name == "amx_int8" && ran == "avx512_vnni") ||
                    (e->name == "amx_int8_emulated" && ran == "avx512_vnni_emulated"))
            << ran;
        const ForwardResult want = reference(c, q, x.k, x.v);
        const HeadAccuracy a = per_head(got.out, want.out);
        std::printf("[ accuracy ] pv int8 %-22s D%-3lld %-9s cosine %.6f  rel L1 %.4f%%\n",
                    std::string(e->name).c_str(), static_cast<long long>(d),
                    dit ? "DiT-like" : "Gaussian", a.worst_cosine, 100 * a.worst_rel_l1);
        EXPECT_GE(a.worst_cosine, 0.9995);
        EXPECT_LE(a.worst_rel_l1, 0.016);
        // The softmax (hence the LSE) is the default P.V's (amx_int8's rounds its exponential for
        // bf16, 8.6e-5): P.V's codes do not reach it.
        c.backend_options.erase("pv_dtype");
        const ForwardResult base = Attention(c).forward(q.view(), x.k.view(), x.v.view(), {}, true);
        const std::vector<double> gl = testing::to_vector(got.lse->view()),
                                  bl = testing::to_vector(base.lse->view());
        for (std::size_t i = 0; i < gl.size(); ++i)
          ASSERT_NEAR(gl[i], bl[i], 1e-4 * std::max(1.0, std::fabs(bl[i]))) << i;
        EXPECT_GT(a.worst_rel_l1, per_head(base.out, want.out).worst_rel_l1);
      }
  // A NaN in V: the rows that attend it are NaN, as PyTorch shows them.
  const i64 s = 70, h = 1, d = 64;
  Tensor q = random_tensor({1, s, h, d}, DType::F32, 81),
         k = random_tensor({1, s, h, d}, DType::F32, 82),
         v = random_tensor({1, s, h, d}, DType::F32, 83);
  v.data_as<float>()[40 * d + 3] = NAN;
  AttentionConfig c = sage_config(h, h, d, "", true);
  c.backend_options["pv_dtype"] = std::string("int8");
  const ForwardResult got = Attention(c).forward(q.view(), k.view(), v.view());
  // Rows from 40 on attend the NaN; earlier rows of its tile hide it and may be NaN (0 x NaN,
  // docs/semantics.md), rows of other tiles are not.
  for (i64 i = 0; i < s; ++i) {
    const bool nan = std::isnan(got.out.data_as<float>()[i * d + 3]);
    if (i >= 40) {
      EXPECT_TRUE(nan) << i;
    }
  }
}

// pv_dtype auto is, bit for bit, int16 on the engines whose integer dot takes int16 pairs
// (avx512_vnni, avx_vnni, avx2_int8 and their twins: chosen by measurement, docs/semantics.md)
// and f32 on portable_int8 and the AArch64 engines (neon_dotprod, neon_i8mm and their twins:
// NEON's int16 multiply-adds are no faster than FMLA); amx_int8 keeps its own bf16 tiles
// (neither).
TEST(Sage, AutoPvDtypeIsTheMeasuredChoice) {
  const i64 s = 150, hq = 4, hkv = 2, d = 64;
  const Tensor q = random_tensor({1, s, hq, d}, DType::F32, 61),
               k = random_tensor({1, s, hkv, d}, DType::F32, 62),
               v = random_tensor({1, s, hkv, d}, DType::F32, 63);
  int checked = 0;
  for (const flash::Engine* e : int8_engines()) {
    const std::string name(e->name);
    SCOPED_TRACE(name);
    AttentionConfig c = sage_config(hq, hkv, d, name);
    const auto run = [&](const char* pv) {
      if (pv != nullptr) c.backend_options["pv_dtype"] = std::string(pv);
      const std::vector<double> out =
          testing::to_vector(Attention(c).forward(q.view(), k.view(), v.view()).out.view());
      c.backend_options.erase("pv_dtype");
      return out;
    };
    const std::vector<double> deflt = run(nullptr), automatic = run("auto");
    EXPECT_EQ(deflt, automatic);
    const bool int16 = name.rfind("avx512_vnni", 0) == 0 || name.rfind("avx_vnni", 0) == 0 ||
                       name.rfind("avx2_int8", 0) == 0;
    if (int16) {
      EXPECT_EQ(deflt, run("int16"));
      EXPECT_NE(deflt, run("f32"));
    } else if (name == "portable_int8" || name.rfind("neon_", 0) == 0) {
      EXPECT_EQ(deflt, run("f32"));
      EXPECT_NE(deflt, run("int16"));
    } else {  // amx_int8 and its twin: bf16 tiles
      EXPECT_NE(deflt, run("int16"));
      EXPECT_NE(deflt, run("f32"));
    }
    ++checked;
  }
  EXPECT_GE(checked, 5);  // every twin runs anywhere
}

// The AArch64 engines' emulated twins give portable_int8's outputs and LSE bit for bit with
// every P.V (auto and f32: the portable f32 one; int16 and int8: the same codes, whose integer
// products are summed exactly whatever the grouping): their logits are every int8 engine's, and
// their softmax is the portable one. GQA, a causal mask, odd sizes and a non-finite K row.
TEST(Sage, ArmTwinsGivePortableInt8sBits) {
  const i64 s = 97, hq = 4, hkv = 2;
  for (const i64 d : {64, 37}) {
    const Tensor q = random_tensor({1, s, hq, d}, DType::F32, 71),
                 k = random_tensor({1, s, hkv, d}, DType::F32, 72),
                 v = random_tensor({1, s, hkv, d}, DType::F32, 73);
    k.data_as<float>()[(5 * hkv + 1) * d + 3] = std::numeric_limits<float>::quiet_NaN();
    for (const char* pv : {"auto", "f32", "int16", "int8"}) {
      const auto run = [&](const std::string& isa) {
        AttentionConfig c = sage_config(hq, hkv, d, isa, /*causal=*/true);
        c.backend_options["pv_dtype"] = std::string(pv);
        const ForwardResult r = Attention(c).forward(q.view(), k.view(), v.view(), {}, true);
        std::vector<std::uint32_t> bits;
        for (const TensorView& t : {r.out.view(), r.lse->view()})
          for (const double x : testing::to_vector(t)) {
            const float f = static_cast<float>(x);
            std::uint32_t b;
            std::memcpy(&b, &f, sizeof(b));
            bits.push_back(std::isnan(f) ? 0x7fc00000u : b);
          }
        return bits;
      };
      const std::vector<std::uint32_t> portable = run("portable_int8");
      for (const char* twin : {"neon_dotprod_emulated", "neon_i8mm_emulated"})
        EXPECT_EQ(run(twin), portable) << twin << " d " << d << " pv_dtype " << pv;
    }
  }
}

// pv_dtype int16 (P and V as 12- and 13-bit codes in int16 pairs, avx512_vnni's auto): on every
// int8 engine, its error against REFERENCE is the f32 P.V's within 0.05% (mean relative L1 per
// head) and below the bf16 P.V's where the engine has one, the LSE is f32's; NaN in V stays
// visible; codes at their largest (V of 1e4 in one column, a row whose softmax is one key) do not
// wrap the int32 lanes. (A twin's softmax is the portable one, so only its logits are its real
// engine's bit for bit: SageEngines.)
TEST(Sage, Int16PvIsAsAccurateAsF32Pv) {
  for (const flash::Engine* e : int8_accuracy_engines())
    for (const i64 d : head_sizes())
      for (const bool dit : {false, true}) {
        const i64 s = 203, hq = 4, hkv = 2;
        SCOPED_TRACE(std::string(e->name) + " D" + std::to_string(d) +
                     (dit ? " DiT-like" : " Gaussian"));
        DitLike x = dit ? dit_like(s, hkv, d, 91)
                        : DitLike{random_tensor({1, s, hkv, d}, DType::F32, 1),
                                  random_tensor({1, s, hkv, d}, DType::F32, 2),
                                  random_tensor({1, s, hkv, d}, DType::F32, 3)};
        const Tensor q =
            dit ? dit_like(s, hq, d, 92).q : random_tensor({1, s, hq, d}, DType::F32, 4);
        AttentionConfig c = sage_config(hq, hkv, d, std::string(e->name));
        const auto run = [&](const char* pv) {
          c.backend_options["pv_dtype"] = std::string(pv);
          return Attention(c).forward(q.view(), x.k.view(), x.v.view(), {}, true);
        };
        const ForwardResult want = reference(c, q, x.k, x.v);
        const ForwardResult got = run("int16"), exact = run("f32");
        const HeadAccuracy a = per_head(got.out, want.out), f = per_head(exact.out, want.out);
        std::printf("[ accuracy ] pv int16 %-22s D%-3lld %-9s rel L1 %.4f%% (f32 P.V %.4f%%)\n",
                    std::string(e->name).c_str(), static_cast<long long>(d),
                    dit ? "DiT-like" : "Gaussian", 100 * a.worst_rel_l1, 100 * f.worst_rel_l1);
        EXPECT_LE(std::fabs(a.worst_rel_l1 - f.worst_rel_l1), 5e-4);
        EXPECT_GE(a.worst_cosine, 0.9995);
        try {
          const HeadAccuracy b = per_head(run("bf16").out, want.out);
          EXPECT_LT(a.worst_rel_l1, b.worst_rel_l1);
        } catch (const NotAvailable&) {  // no bf16 P.V on this engine and CPU
        }
        const std::vector<double> gl = testing::to_vector(got.lse->view()),
                                  fl = testing::to_vector(exact.lse->view());
        for (std::size_t i = 0; i < gl.size(); ++i)
          ASSERT_NEAR(gl[i], fl[i], 1e-4 * std::max(1.0, std::fabs(fl[i]))) << i;
      }
  // Codes at their largest and a NaN in V.
  const i64 s = 130, h = 1, d = 64;
  Tensor q = random_tensor({1, s, h, d}, DType::F32, 93),
         k = random_tensor({1, s, h, d}, DType::F32, 94),
         v = random_tensor({1, s, h, d}, DType::F32, 95);
  for (i64 j = 0; j < s; ++j) v.data_as<float>()[j * d + 5] = 1e4f;
  for (i64 e = 0; e < d; ++e) q.data_as<float>()[7 * d + e] = 40.0f * k.data_as<float>()[9 * d + e];
  for (const flash::Engine* e : int8_engines()) {
    SCOPED_TRACE(e->name);
    AttentionConfig c = sage_config(h, h, d, std::string(e->name));
    c.backend_options["pv_dtype"] = std::string("int16");
    const ForwardResult want = reference(c, q, k, v);
    const ForwardResult got = Attention(c).forward(q.view(), k.view(), v.view());
    EXPECT_LE(per_head(got.out, want.out).worst_rel_l1, 0.01);
    Tensor nv = Tensor::copy_of(v.view());
    nv.data_as<float>()[100 * d + 3] = NAN;
    const ForwardResult poisoned = Attention(c).forward(q.view(), k.view(), nv.view());
    for (i64 i = 0; i < s; ++i)
      EXPECT_TRUE(std::isnan(poisoned.out.data_as<float>()[i * d + 3])) << i;
  }
}

// Long rows of near-equal logits (small Q): the softmax is nearly uniform and the error stays
// in the output's rounding.
TEST(Sage, NearEqualLogitsStayAccurate) {
  const i64 s = 600, h = 2, d = 64;
  Tensor q = random_tensor({1, s, h, d}, DType::F32, 21),
         k = random_tensor({1, s, h, d}, DType::F32, 22),
         v = random_tensor({1, s, h, d}, DType::F32, 23);
  for (i64 n = 0; n < q.numel(); ++n) q.data_as<float>()[n] *= 1e-3f;
  const AttentionConfig c = sage_config(h, h, d);
  const HeadAccuracy a =
      per_head(Attention(c).forward(q.view(), k.view(), v.view()).out, reference(c, q, k, v).out);
  EXPECT_GE(a.worst_cosine, 0.9995);
  EXPECT_LE(a.worst_rel_l1, 0.01);
}

// NaN or inf stays visible where PyTorch would show it: a NaN in one query row makes that row
// NaN only; an inf in one key makes every row that sees it NaN (causal: the rows before it keep
// their values, so smoothing is off for that head's keys); all-zero Q and K (scale 0) give the
// mean of V; huge finite values are scaled, not overflowed.
TEST(Sage, NonFiniteZeroAndHugeValues) {
  const i64 s = 96, h = 1, d = 64;
  for (const flash::Engine* e : int8_engines()) {
    SCOPED_TRACE(e->name);
    Tensor q = random_tensor({1, s, h, d}, DType::F32, 31),
           k = random_tensor({1, s, h, d}, DType::F32, 32),
           v = random_tensor({1, s, h, d}, DType::F32, 33);
    q.data_as<float>()[5 * d + 2] = NAN;
    k.data_as<float>()[70 * d + 1] = INFINITY;
    AttentionConfig c = sage_config(h, h, d, std::string(e->name), true);
    const ForwardResult got = Attention(c).forward(q.view(), k.view(), v.view());
    const ForwardResult want = reference(c, q, k, v);
    for (i64 i = 0; i < s; ++i) {
      const float x = got.out.data_as<float>()[i * d];
      const bool nan_wanted = std::isnan(want.out.data_as<float>()[i * d]);
      EXPECT_EQ(std::isnan(x), nan_wanted) << "row " << i;
      EXPECT_EQ(nan_wanted, i == 5 || i >= 70) << "row " << i;
    }
    // Rows that see neither keep SAGE's accuracy.
    for (i64 i = 0; i < 70; ++i) {
      if (i == 5) continue;
      for (i64 x = 0; x < d; ++x)
        EXPECT_NEAR(got.out.data_as<float>()[i * d + x], want.out.data_as<float>()[i * d + x], 0.05)
            << i;
    }

    Tensor zq = Tensor::zeros({1, s, h, d}, DType::F32),
           zk = Tensor::zeros({1, s, h, d}, DType::F32);
    c.causal = false;
    const auto zero = Attention(c).forward(zq.view(), zk.view(), v.view());
    const auto zero_want = reference(c, zq, zk, v);
    // Exact logits (all 0); P.V in bf16 on the avx512_vnni engines rounds V.
    EXPECT_LE(testing::compare(zero.out.view(), zero_want.out.view()).normwise_rel,
              testing::tolerance_for(DType::BF16));

    Tensor hq = random_tensor({1, s, h, d}, DType::F32, 34),
           hk = random_tensor({1, s, h, d}, DType::F32, 35);
    for (i64 n = 0; n < hq.numel(); ++n) {
      hq.data_as<float>()[n] *= 1e18f;
      hk.data_as<float>()[n] *= 1e-18f;
    }
    const auto huge = Attention(c).forward(hq.view(), hk.view(), v.view());
    const auto huge_want = reference(c, hq, hk, v);
    const auto dh = testing::compare(huge.out.view(), huge_want.out.view());
    EXPECT_FALSE(dh.nan);
    EXPECT_LE(dh.normwise_rel, 2e-2);
  }
}

// VIDEO_SPARSE's selected blocks on SAGE's engines (qk_dtype int8): its dense answer (every block
// selected) at SAGE's accuracy; a bad qk_dtype names the option.
TEST(Sage, VideoSparseRunsOnTheInt8Engines) {
  const i64 s = 128, h = 2, d = 64;
  Tensor q = random_tensor({1, s, h, d}, DType::F32, 41),
         k = random_tensor({1, s, h, d}, DType::F32, 42),
         v = random_tensor({1, s, h, d}, DType::F32, 43);
  AttentionConfig c = testing::layer_config("VIDEO_SPARSE", h, h, d);
  c.backend_options["topk"] = i64(1000);
  c.backend_options["qk_dtype"] = std::string("int8");
  const Attention layer(c);
  const ForwardResult got = layer.forward(q.view(), k.view(), v.view());
  bool int8 = false;  // one of SAGE's engines (avx512_vnni has no "int8" in its name)
  for (const flash::Engine* e : int8_engines()) int8 = int8 || layer.last_engine() == e->name;
  EXPECT_TRUE(int8) << layer.last_engine();
  const HeadAccuracy a = per_head(got.out, reference(c, q, k, v).out);
  EXPECT_GE(a.worst_cosine, 0.9995);
  c.backend_options["qk_dtype"] = std::string("int4");
  try {
    (void)Attention(c);
    ADD_FAILURE() << "qk_dtype int4 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.field(), "qk_dtype");
  }
}

// VIDEO_SPARSE with qk_dtype int8 smooths K as SAGE does (one driver): per (batch item, KV head)
// over its visible keys and the valid queries of its query heads. On DiT-like inputs with GQA
// and a key-padding mask, every int8 engine keeps SAGE's accuracy against REFERENCE (every
// block selected) and the LSE; with smooth_k off the error grows; a sparse selection equals
// VIDEO_SPARSE's f32 answer for the same blocks to SAGE's accuracy; smooth_k must be a bool.
TEST(Sage, VideoSparseInt8SmoothsLikeSage) {
  const i64 s = 160, hq = 4, hkv = 2, d = 64;
  DitLike x = dit_like(s, hkv, d, 61);
  Tensor q = dit_like(s, hq, d, 62).q;
  Tensor mask = Tensor::zeros({1, s}, DType::Bool);
  for (i64 j = 0; j < s; ++j) mask.data_as<std::uint8_t>()[j] = j < 131 ? 1 : 0;
  AttentionMetadata m;
  m.attn_mask = mask.view();
  for (const flash::Engine* e : int8_engines()) {
    SCOPED_TRACE(e->name);
    AttentionConfig c = testing::layer_config("VIDEO_SPARSE", hq, hkv, d);
    c.backend_options["topk"] = i64(1000);
    c.backend_options["qk_dtype"] = std::string("int8");
    c.backend_options["isa"] = std::string(e->name);
    const ForwardResult want = reference(c, q, x.k, x.v, m);
    const ForwardResult got = Attention(c).forward(q.view(), x.k.view(), x.v.view(), m, true);
    const HeadAccuracy a = per_head(got.out, want.out);
    EXPECT_GE(a.worst_cosine, 0.9995);
    EXPECT_LE(a.worst_rel_l1, 0.01);
    const std::vector<double> gl = testing::to_vector(got.lse->view()),
                              wl = testing::to_vector(want.lse->view());
    for (std::size_t i = 0; i < gl.size(); ++i) {
      if (std::isinf(wl[i])) {  // a padding row (the key mask hides its query too)
        EXPECT_EQ(gl[i], wl[i]) << i;
        continue;
      }
      ASSERT_NEAR(gl[i], wl[i], 5e-2) << i;
    }
    c.backend_options["smooth_k"] = false;
    const HeadAccuracy raw =
        per_head(Attention(c).forward(q.view(), x.k.view(), x.v.view(), m).out, want.out);
    std::printf(
        "[ accuracy ] VIDEO_SPARSE %-22s smoothed: cosine %.6f rel L1 %.4f%%; "
        "unsmoothed: cosine %.6f rel L1 %.4f%%\n",
        std::string(e->name).c_str(), a.worst_cosine, 100 * a.worst_rel_l1, raw.worst_cosine,
        100 * raw.worst_rel_l1);
    EXPECT_GT(raw.worst_rel_l1, a.worst_rel_l1);
  }
  AttentionConfig c = testing::layer_config("VIDEO_SPARSE", hq, hkv, d);
  c.backend_options["topk"] = i64(2);
  c.backend_options["tile"] = std::string("1,1,32");
  const ForwardResult f32 = Attention(c).forward(q.view(), x.k.view(), x.v.view(), m);
  c.backend_options["qk_dtype"] = std::string("int8");
  const ForwardResult int8 = Attention(c).forward(q.view(), x.k.view(), x.v.view(), m);
  const HeadAccuracy sparse = per_head(int8.out, f32.out);
  EXPECT_GE(sparse.worst_cosine, 0.9995);
  EXPECT_LE(sparse.worst_rel_l1, 0.01);
  c.backend_options["pv_dtype"] = std::string("int8");  // P.V in 8 bits on the sparse blocks too
  const HeadAccuracy pv8 =
      per_head(Attention(c).forward(q.view(), x.k.view(), x.v.view(), m).out, f32.out);
  EXPECT_GE(pv8.worst_cosine, 0.9995);
  EXPECT_LE(pv8.worst_rel_l1, 0.016);
  c.backend_options.erase("pv_dtype");
  c.backend_options["balance_qk"] = std::string("no");
  try {
    (void)Attention(c);
    ADD_FAILURE() << "balance_qk 'no' accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.field(), "balance_qk");
  }
}

// amx_int8 (its twin here): its own inner loop (int8 tiles for Q.K^T, bf16 tiles for P.V) on
// FLASH's and VIDEO_SPARSE's drivers, with masks, causal rows and GQA; pv_dtype f32 runs
// avx512_vnni's f32 P.V and says so.
TEST(Sage, AmxInt8TwinOnBothDrivers) {
  const i64 s = 157, hq = 4, hkv = 2, d = 72;
  Tensor q = random_tensor({1, s, hq, d}, DType::F32, 51),
         k = random_tensor({1, s, hkv, d}, DType::F32, 52),
         v = random_tensor({1, s, hkv, d}, DType::F32, 53);
  for (const bool causal : {false, true}) {
    AttentionConfig c = sage_config(hq, hkv, d, "amx_int8_emulated", causal);
    const Attention layer(c);
    const ForwardResult got = layer.forward(q.view(), k.view(), v.view(), {}, true);
    EXPECT_EQ(layer.last_engine(), "amx_int8_emulated");
    const ForwardResult want = reference(c, q, k, v);
    const HeadAccuracy a = per_head(got.out, want.out);
    EXPECT_GE(a.worst_cosine, 0.9995) << causal;
    EXPECT_LE(a.worst_rel_l1, 0.01) << causal;
    const std::vector<double> gl = testing::to_vector(got.lse->view()),
                              wl = testing::to_vector(want.lse->view());
    for (std::size_t i = 0; i < gl.size(); ++i) ASSERT_NEAR(gl[i], wl[i], 5e-2) << i;
    c.backend_options["pv_dtype"] = std::string("f32");
    const Attention f32_pv(c);
    (void)f32_pv.forward(q.view(), k.view(), v.view());
    EXPECT_EQ(f32_pv.last_engine(), "avx512_vnni_emulated");
  }
  AttentionConfig c = testing::layer_config("VIDEO_SPARSE", hq, hkv, d);
  c.backend_options["topk"] = i64(1000);
  c.backend_options["qk_dtype"] = std::string("int8");
  c.backend_options["isa"] = std::string("amx_int8_emulated");
  const Attention sparse(c);
  const ForwardResult got = sparse.forward(q.view(), k.view(), v.view());
  EXPECT_EQ(sparse.last_engine(), "amx_int8_emulated");
  EXPECT_GE(per_head(got.out, reference(c, q, k, v).out).worst_cosine, 0.9995);
}

TEST(Sage, BadOptionsNameTheOption) {
  const auto field_of = [](BackendOptions o) -> std::string {
    AttentionConfig c = sage_config(2, 2, 64);
    c.backend_options = std::move(o);
    try {
      (void)Attention(c);
    } catch (const Error& e) {
      return e.field();
    }
    return "";
  };
  EXPECT_EQ(field_of({{"pv_dtype", std::string("f64")}}), "pv_dtype");
  EXPECT_EQ(field_of({{"smooth_k", std::string("yes")}}), "smooth_k");
  EXPECT_EQ(field_of({{"isa", std::string("sse9")}}), "isa");
  // bf16 P.V where the engine has none here: NotAvailable naming pv_dtype; the twin has one.
  EXPECT_EQ(
      field_of({{"isa", std::string("avx2_int8_emulated")}, {"pv_dtype", std::string("bf16")}}),
      "pv_dtype");
  EXPECT_EQ(
      field_of({{"isa", std::string("avx512_vnni_emulated")}, {"pv_dtype", std::string("bf16")}}),
      "");
}

// Construction options are strict on every built-in backend (docs/semantics.md, "Options"): an
// unknown or misspelled key is InvalidArgument naming it, listing the valid ones and the near
// miss; the messages name the backend the user chose; the per-call slot stays tolerant.
TEST(BackendOptions, UnknownKeysAreRefusedNamingThem) {
  const auto error_of = [](const std::string& backend, BackendOptions o) -> std::string {
    AttentionConfig c = testing::layer_config(backend, 2, 2, 64);
    c.backend_options = std::move(o);
    try {
      (void)Attention(c);
    } catch (const InvalidArgument& e) {
      return e.field() + ": " + e.what();
    }
    return "";
  };
  const std::string sage = error_of("SAGE", {{"pv_dtyp", std::string("int8")}});
  EXPECT_EQ(sage.rfind("pv_dtyp: ", 0), 0u) << sage;
  EXPECT_NE(sage.find("not an option of SAGE"), std::string::npos) << sage;
  EXPECT_NE(sage.find("did you mean 'pv_dtype'"), std::string::npos) << sage;
  EXPECT_NE(sage.find("rotate"), std::string::npos) << sage;  // the valid ones listed
  EXPECT_EQ(error_of("SAGE", {{" pv_dtype", std::string("int8")}}).rfind(" pv_dtype: ", 0), 0u);
  EXPECT_EQ(error_of("FLASH", {{"pv_dtype", std::string("int8")}}).rfind("pv_dtype: ", 0), 0u);
  EXPECT_EQ(error_of("FLASH", {{"sparsity", 0.9}}).rfind("sparsity: ", 0), 0u);
  EXPECT_EQ(error_of("VIDEO_SPARSE", {{"spasity", 0.9}}).rfind("spasity: ", 0), 0u);
  EXPECT_NE(error_of("REFERENCE", {{"rotate", true}}).find("it takes none"), std::string::npos);
  // The options each declares pass.
  EXPECT_EQ(error_of("SAGE", {{"pv_dtype", std::string("int8")},
                              {"rotate", false},
                              {"smooth_k", true},
                              {"balance_qk", true}}),
            "");
  EXPECT_EQ(error_of("FLASH", {{"compute_dtype", std::string("bf16")}}), "");
  EXPECT_EQ(error_of("VIDEO_SPARSE", {{"sparsity", 0.5}, {"qk_dtype", std::string("int8")}}), "");
  // The backend chosen, not "FLASH", in an engine error.
  const std::string isa = error_of("SAGE", {{"isa", std::string("sse9")}});
  EXPECT_NE(isa.find("not an engine of SAGE"), std::string::npos) << isa;
  EXPECT_EQ(isa.find("FLASH"), std::string::npos) << isa;
  // rotate must be a bool.
  EXPECT_EQ(error_of("SAGE", {{"rotate", std::string("yes")}}).rfind("rotate: ", 0), 0u);
  // The per-call slot ignores what it does not know.
  const Tensor q = random_tensor({1, 8, 2, 64}, DType::F32, 1);
  AttentionMetadata m;
  m.extra.backend["no_such_key"] = std::int64_t(1);
  EXPECT_NO_THROW((void)Attention(testing::layer_config("SAGE", 2, 2, 64))
                      .forward(q.view(), q.view(), q.view(), m));
}

// rotate (default true) changes only the codes: the answer stays within SAGE's bound either way,
// with d a power of two or not (block-diagonal Hadamard, never a padded d), and the two differ.
TEST(Sage, RotationKeepsTheAnswer) {
  for (const i64 d : {40, 59, 64, 72, 80, 96, 128}) {
    SCOPED_TRACE("D" + std::to_string(d));
    const DitLike x = dit_like(150, 2, d, 91);
    AttentionConfig c = sage_config(2, 2, d);
    const ForwardResult on = Attention(c).forward(x.q.view(), x.k.view(), x.v.view());
    c.backend_options["rotate"] = false;
    const ForwardResult off = Attention(c).forward(x.q.view(), x.k.view(), x.v.view());
    const ForwardResult want = reference(c, x.q, x.k, x.v);
    const HeadAccuracy a = per_head(on.out, want.out), b = per_head(off.out, want.out);
    EXPECT_GE(a.worst_cosine, 0.9995);
    EXPECT_LE(a.worst_rel_l1, 0.01);
    EXPECT_GE(b.worst_cosine, 0.9995);
    EXPECT_FALSE(testing::bitwise_equal(on.out, off.out));
  }
}

// Approximate, so never the automatic choice; FLASH never runs an int8 engine.
TEST(Sage, IsChosenOnlyExplicitly) {
  AttentionConfig c = testing::layer_config("", 2, 2, 64);
  EXPECT_NE(Attention(c).backend().name(), "SAGE");
  EXPECT_FALSE(Registry::global().find("SAGE")->exact());
  for (const auto dt : {DType::F32, DType::BF16})
    for (const auto cd : {flash::ComputeDtype::f32, flash::ComputeDtype::bf16})
      EXPECT_NE(flash::select_engine(nullptr, dt, cd).compute, flash::ComputeDtype::int8);
  const flash::Engine& sage = flash::select_engine(nullptr, DType::F32, flash::ComputeDtype::int8);
  EXPECT_EQ(sage.compute, flash::ComputeDtype::int8);
  EXPECT_FALSE(sage.emulated);
}

}  // namespace
}  // namespace dattn
