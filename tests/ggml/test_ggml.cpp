// dattn_ggml_flash_attn_ext inside ggml graphs, against ggml_flash_attn_ext, the
// ggml_mul_mat + ggml_soft_max_ext path and a float64 reference on the same tensors: K/V
// f32/bf16/f16, masks (dense, key padding, broadcast over heads and batch, fully masked rows),
// GQA, odd lengths, D 64/128 (and Dv != D), thread counts; garbage under masked keys; inputs
// refused when the node is built; a fault while computing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dattn/dattn.h"
#include "dattn/ggml.h"
#include "ggml-cpu.h"

namespace {

using i64 = std::int64_t;
constexpr float kInf = std::numeric_limits<float>::infinity();

// text_padding: the last `text_pad` of the `text` tokens are padding, their keys hidden from
// every row and their rows seeing nothing (a self-attention: L_q == L_k).
enum class MaskKind {
  none,
  dense,
  key_padding,
  per_head,
  per_batch,
  fully_masked_rows,
  text_padding,
  partly_hidden_key  // key 40 hidden from rows 0-7 only
};

struct Case {
  i64 d = 64, dv = 64, lq = 37, lk = 53, heads = 4, kv_heads = 4, batch = 1;
  ggml_type kv = GGML_TYPE_F16;
  MaskKind mask = MaskKind::none;
  i64 mask_extra_rows = 0;  // mask ne[1] = lq + this
  i64 mask_extra_keys = 0;  // mask ne[0] = lk + this
  int threads = 2;
  // Two token populations, as an MM-DiT's joint sequence: the first `text` tokens from another
  // projection than the image ones (0: every token N(0, 1)-like).
  i64 text = 0, text_pad = 0;
};

std::string describe(const Case& c) {
  return "D=" + std::to_string(c.d) + " Dv=" + std::to_string(c.dv) +
         " Lq=" + std::to_string(c.lq) + " Lk=" + std::to_string(c.lk) +
         " H=" + std::to_string(c.heads) + " Hkv=" + std::to_string(c.kv_heads) +
         " N=" + std::to_string(c.batch) + " kv=" + ggml_type_name(c.kv) +
         " mask=" + std::to_string(int(c.mask)) + " threads=" + std::to_string(c.threads);
}

// One case's tensors in a ggml context (allocated), with the values the reference reads.
struct Graphs {
  ggml_context* ctx = nullptr;
  ggml_tensor *q = nullptr, *k = nullptr, *v = nullptr, *mask = nullptr;
  std::vector<float> qf, kf, vf, maskf;  // values as the tensors hold them (after rounding)
  i64 mask_ne[4] = {0, 0, 1, 1};
  ~Graphs() {
    if (ctx != nullptr) ggml_free(ctx);
  }
};

void store(ggml_tensor* t, const std::vector<float>& values, std::vector<float>& rounded) {
  const i64 n = ggml_nelements(t);
  rounded.resize(n);
  if (t->type == GGML_TYPE_F32) {
    std::copy(values.begin(), values.end(), static_cast<float*>(t->data));
    rounded = values;
  } else if (t->type == GGML_TYPE_F16) {
    auto* p = static_cast<ggml_fp16_t*>(t->data);
    for (i64 i = 0; i < n; ++i) {
      p[i] = ggml_fp32_to_fp16(values[i]);
      rounded[i] = ggml_fp16_to_fp32(p[i]);
    }
  } else {
    auto* p = static_cast<ggml_bf16_t*>(t->data);
    for (i64 i = 0; i < n; ++i) {
      p[i] = ggml_fp32_to_bf16(values[i]);
      rounded[i] = ggml_bf16_to_fp32(p[i]);
    }
  }
}

bool masked_out(const Case& c, i64 n, i64 h, i64 l, i64 j) {
  switch (c.mask) {
    case MaskKind::key_padding:
      return j >= c.lk - 7;
    case MaskKind::fully_masked_rows:
      return l % 5 == 2 || (j % 3 == 0);
    case MaskKind::per_head:
      return (j + h) % 4 == 0;
    case MaskKind::per_batch:
      return j > c.lk - 1 - 9 * (n + 1);
    case MaskKind::dense:
      return (l * 7 + j * 13) % 11 == 0;
    case MaskKind::partly_hidden_key:
      return j == 40 && l < 8;
    case MaskKind::text_padding: {
      const auto pad = [&](i64 t) { return t >= c.text - c.text_pad && t < c.text; };
      return pad(l) || pad(j);
    }
    default:
      return false;
  }
}

void build(const Case& c, Graphs& g, unsigned seed) {
  if (g.ctx != nullptr) ggml_free(g.ctx);  // rebuilt: the previous tensors go
  g.ctx = nullptr;
  g.mask = nullptr;
  g.maskf.clear();
  g.mask_ne[0] = g.mask_ne[1] = 0;
  g.mask_ne[2] = g.mask_ne[3] = 1;
  ggml_init_params params{};
  const i64 elems = c.d * c.lq * c.heads * c.batch +
                    2 * (c.d + c.dv) * c.lk * c.kv_heads * c.batch +
                    (c.lk + c.mask_extra_keys) * (c.lq + c.mask_extra_rows) * c.heads * c.batch +
                    8 * c.dv * c.heads * c.lq * c.batch + 4 * c.lk * c.lq * c.heads * c.batch;
  params.mem_size = static_cast<std::size_t>(elems) * 8 + (64u << 20);
  params.no_alloc = false;
  g.ctx = ggml_init(params);
  ASSERT_NE(g.ctx, nullptr);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random = [&](i64 n, float offset, float scale) {
    std::vector<float> x(n);
    for (auto& e : x) e = offset + scale * normal(rng);
    return x;
  };
  g.q = ggml_new_tensor_4d(g.ctx, GGML_TYPE_F32, c.d, c.lq, c.heads, c.batch);
  g.k = ggml_new_tensor_4d(g.ctx, c.kv, c.d, c.lk, c.kv_heads, c.batch);
  g.v = ggml_new_tensor_4d(g.ctx, c.kv, c.dv, c.lk, c.kv_heads, c.batch);
  if (c.text > 0) {
    // tests/test_sage_inputs.cpp's two MM-DiT populations: image tokens with per-channel
    // offsets N(0, 1) x 20 in K and x 3 in Q and log-normal channel gains (sigma 0.8), text
    // tokens with offsets x 2 in K and x 1 in Q and V x 3 (ggml order: [n][h][token][e]).
    std::lognormal_distribution<float> gain(0.0f, 0.8f);
    const auto per_channel = [&](i64 heads, float scale) {
      std::vector<float> x(std::size_t(heads * c.d));
      for (auto& e : x) e = scale * normal(rng);
      return x;
    };
    std::vector<float> gk(std::size_t(c.kv_heads * c.d)), gq(std::size_t(c.heads * c.d));
    for (auto& e : gk) e = gain(rng);
    for (auto& e : gq) e = gain(rng);
    const auto ik = per_channel(c.kv_heads, 20), iq = per_channel(c.heads, 3),
               tk = per_channel(c.kv_heads, 2), tq = per_channel(c.heads, 1);
    const auto fill = [&](const ggml_tensor* t, i64 heads, i64 width, auto value) {
      std::vector<float> x(std::size_t(ggml_nelements(t)));
      for (i64 n = 0; n < c.batch; ++n)
        for (i64 h = 0; h < heads; ++h)
          for (i64 l = 0; l < t->ne[1]; ++l)
            for (i64 e = 0; e < width; ++e)
              x[std::size_t(((n * heads + h) * t->ne[1] + l) * width + e)] =
                  value(l < c.text, std::size_t(h * c.d + e % c.d));
      return x;
    };
    store(g.q,
          fill(g.q, c.heads, c.d,
               [&](bool text, std::size_t ch) {
                 return text ? tq[ch] + normal(rng) : (iq[ch] + normal(rng)) * gq[ch];
               }),
          g.qf);
    store(g.k,
          fill(g.k, c.kv_heads, c.d,
               [&](bool text, std::size_t ch) {
                 return text ? tk[ch] + normal(rng) : (ik[ch] + normal(rng)) * gk[ch];
               }),
          g.kf);
    store(g.v,
          fill(g.v, c.kv_heads, c.dv,
               [&](bool text, std::size_t) { return normal(rng) * (text ? 3.0f : 1.0f); }),
          g.vf);
  } else {
    // Real models' logits: a common offset in K (softmax-invariant) and a spread of ~2-4.
    store(g.q, random(ggml_nelements(g.q), 0.1f, 1.0f), g.qf);
    store(g.k, random(ggml_nelements(g.k), 0.5f, 0.5f), g.kf);
    store(g.v, random(ggml_nelements(g.v), 0.0f, 1.0f), g.vf);
  }
  if (c.mask == MaskKind::none) return;
  g.mask_ne[0] = c.lk + c.mask_extra_keys;
  g.mask_ne[1] = c.lq + c.mask_extra_rows;
  g.mask_ne[2] = c.mask == MaskKind::per_head ? c.heads : 1;
  g.mask_ne[3] = c.mask == MaskKind::per_batch ? c.batch : 1;
  g.mask = ggml_new_tensor_4d(g.ctx, GGML_TYPE_F16, g.mask_ne[0], g.mask_ne[1], g.mask_ne[2],
                              g.mask_ne[3]);
  std::vector<float> m(ggml_nelements(g.mask));
  std::uniform_real_distribution<float> bias(-2.0f, 0.5f);
  for (i64 n = 0; n < g.mask_ne[3]; ++n)
    for (i64 h = 0; h < g.mask_ne[2]; ++h)
      for (i64 l = 0; l < g.mask_ne[1]; ++l)
        for (i64 j = 0; j < g.mask_ne[0]; ++j) {
          float& e = m[((n * g.mask_ne[2] + h) * g.mask_ne[1] + l) * g.mask_ne[0] + j];
          if (l >= c.lq || j >= c.lk)
            e = std::numeric_limits<float>::quiet_NaN();  // never read
          else
            e = masked_out(c, n, h, l, j) ? -kInf : (c.mask == MaskKind::dense ? bias(rng) : 0.0f);
        }
  store(g.mask, m, g.maskf);
}

// out[n][l][h][e] in float64 from the tensors' values; fully masked rows give 0 (ggml's rule).
std::vector<double> reference(const Case& c, const Graphs& g, float scale) {
  std::vector<double> out(c.batch * c.lq * c.heads * c.dv, 0.0);
  std::vector<double> s(c.lk);
  const i64 group = c.heads / c.kv_heads;
  for (i64 n = 0; n < c.batch; ++n)
    for (i64 h = 0; h < c.heads; ++h)
      for (i64 l = 0; l < c.lq; ++l) {
        const i64 kh = h / group;
        double mx = -INFINITY;
        for (i64 j = 0; j < c.lk; ++j) {
          double dot = 0;
          for (i64 e = 0; e < c.d; ++e)
            dot += double(g.qf[((n * c.heads + h) * c.lq + l) * c.d + e]) *
                   g.kf[((n * c.kv_heads + kh) * c.lk + j) * c.d + e];
          double mv = 0;
          if (g.mask != nullptr)
            mv = g.maskf[(((n % g.mask_ne[3]) * g.mask_ne[2] + (h % g.mask_ne[2])) * g.mask_ne[1] +
                          l) *
                             g.mask_ne[0] +
                         j];
          s[j] = dot * double(scale) + mv;
          mx = std::max(mx, s[j]);
        }
        double* o = &out[((n * c.lq + l) * c.heads + h) * c.dv];
        if (mx == -INFINITY) continue;
        double sum = 0;
        for (i64 j = 0; j < c.lk; ++j) {
          const double p = std::exp(s[j] - mx);
          sum += p;
          if (p == 0) continue;
          for (i64 e = 0; e < c.dv; ++e)
            o[e] += p * g.vf[((n * c.kv_heads + kh) * c.lk + j) * c.dv + e];
        }
        for (i64 e = 0; e < c.dv; ++e) o[e] /= sum;
      }
  return out;
}

// ||x - ref|| / ||ref|| (x in the result's [Dv, H, L_q, N] order = out[n][l][h][e]).
double normwise(const float* x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double dlt = double(x[i]) - ref[i];
    num += dlt * dlt;
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Writes `x` into every element of tokens [from, to) of `t` (all heads and batch items): the
// garbage a mask hides or padding holds.
void poison(ggml_tensor* t, i64 from, i64 to, float x) {
  for (i64 n = 0; n < t->ne[3]; ++n)
    for (i64 h = 0; h < t->ne[2]; ++h)
      for (i64 l = from; l < to; ++l) {
        char* row = static_cast<char*>(t->data) + l * t->nb[1] + h * t->nb[2] + n * t->nb[3];
        for (i64 e = 0; e < t->ne[0]; ++e) {
          if (t->type == GGML_TYPE_F32) reinterpret_cast<float*>(row)[e] = x;
          if (t->type == GGML_TYPE_F16)
            reinterpret_cast<ggml_fp16_t*>(row)[e] = ggml_fp32_to_fp16(x);
          if (t->type == GGML_TYPE_BF16)
            reinterpret_cast<ggml_bf16_t*>(row)[e] = ggml_fp32_to_bf16(x);
        }
      }
}

// Per head, over the rows `keep` selects, as tests/test_sage_inputs.cpp measures SAGE: the
// worst cosine similarity and the worst mean relative L1 against the reference.
struct HeadAccuracy {
  double cosine = 1.0, rel_l1 = 0.0;
};
template <class Keep>
HeadAccuracy per_head(const Case& c, const float* x, const std::vector<double>& ref, Keep keep) {
  HeadAccuracy a;
  for (i64 n = 0; n < c.batch; ++n)
    for (i64 h = 0; h < c.heads; ++h) {
      double dot = 0, xx = 0, rr = 0, l1 = 0, n1 = 0;
      for (i64 l = 0; l < c.lq; ++l) {
        if (!keep(l)) continue;
        for (i64 e = 0; e < c.dv; ++e) {
          const std::size_t at = std::size_t(((n * c.lq + l) * c.heads + h) * c.dv + e);
          dot += x[at] * ref[at];
          xx += double(x[at]) * x[at];
          rr += ref[at] * ref[at];
          l1 += std::fabs(x[at] - ref[at]);
          n1 += std::fabs(ref[at]);
        }
      }
      a.cosine = std::min(a.cosine, dot / std::sqrt(xx * rr));
      a.rel_l1 = std::max(a.rel_l1, l1 / n1);
    }
  return a;
}

std::vector<float> compute(Graphs& g, ggml_tensor* node, int threads) {
  ggml_cgraph* gf = ggml_new_graph(g.ctx);
  ggml_build_forward_expand(gf, node);
  EXPECT_EQ(ggml_graph_compute_with_ctx(g.ctx, gf, threads), GGML_STATUS_SUCCESS);
  const float* p = static_cast<const float*>(node->data);
  return std::vector<float>(p, p + ggml_nelements(node));
}

// ggml's own mul_mat + softmax path: [Dv, H, L_q, N].
ggml_tensor* mul_mat_path(Graphs& g, float scale) {
  ggml_tensor* kq = ggml_mul_mat(g.ctx, g.k, g.q);  // [L_k, L_q, H, N]
  ggml_tensor* mask = g.mask;
  if (mask != nullptr && (mask->ne[0] != kq->ne[0] || mask->ne[1] != kq->ne[1]))
    mask = ggml_cont(g.ctx, ggml_view_4d(g.ctx, mask, kq->ne[0], kq->ne[1], mask->ne[2],
                                         mask->ne[3], mask->nb[1], mask->nb[2], mask->nb[3], 0));
  kq = ggml_soft_max_ext(g.ctx, kq, mask, scale, 0.0f);
  ggml_tensor* vt = ggml_cont(g.ctx, ggml_permute(g.ctx, ggml_cast(g.ctx, g.v, GGML_TYPE_F32), 1, 0,
                                                  2, 3));  // [L_k, Dv, H_kv, N]
  ggml_tensor* kqv = ggml_mul_mat(g.ctx, vt, kq);          // [Dv, L_q, H, N]
  return ggml_cont(g.ctx, ggml_permute(g.ctx, kqv, 0, 2, 1, 3));
}

dattn_ggml_options precision(const char* p) {
  dattn_ggml_options o;
  dattn_ggml_options_init(&o);
  o.precision = p;
  return o;
}

// The operator's paths the tests walk: FLASH in f32, FLASH at the default precision, SAGE.
dattn_ggml_options path_options(const std::string& path) {
  dattn_ggml_options o;
  dattn_ggml_options_init(&o);
  o.precision = path == "f32" ? "f32" : "auto";
  o.backend = path == "sage" ? "SAGE" : "FLASH";
  return o;
}

// The operator's node for `path` over g's operands (no ALiBi, no softcap); nullptr, with
// dattn_last_error() set, where it is refused.
ggml_tensor* path_node(const Graphs& g, const std::string& path, float scale) {
  const auto o = path_options(path);
  return dattn_ggml_flash_attn_ext_with(g.ctx, g.q, g.k, g.v, g.mask, scale, 0.0f, 0.0f, &o);
}

struct Errors {
  double ggml = 0, dattn_f32 = 0, dattn_default = 0, mul_mat = 0;
};

Errors run_case(const Case& c, unsigned seed = 1) {
  Graphs g;
  build(c, g, seed);
  const float scale = 1.0f / std::sqrt(float(c.d));
  const auto ref = reference(c, g, scale);
  Errors e;
  ggml_tensor* ggml_node = ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, g.mask, scale, 0.0f, 0.0f);
  const auto f32 = precision("f32");
  ggml_tensor* f32_node =
      dattn_ggml_flash_attn_ext_with(g.ctx, g.q, g.k, g.v, g.mask, scale, 0.0f, 0.0f, &f32);
  ggml_tensor* default_node =
      dattn_ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, g.mask, scale, 0.0f, 0.0f);
  EXPECT_NE(f32_node, nullptr) << dattn_last_error();
  EXPECT_NE(default_node, nullptr) << dattn_last_error();
  if (f32_node == nullptr || default_node == nullptr) return e;
  for (ggml_tensor* node : {f32_node, default_node}) {
    EXPECT_EQ(node->type, GGML_TYPE_F32);
    EXPECT_EQ(node->ne[0], c.dv);
    EXPECT_EQ(node->ne[1], c.heads);
    EXPECT_EQ(node->ne[2], c.lq);
    EXPECT_EQ(node->ne[3], c.batch);
  }
  e.ggml = normwise(compute(g, ggml_node, c.threads).data(), ref);
  const auto ours = compute(g, f32_node, c.threads);
  e.dattn_f32 = normwise(ours.data(), ref);
  e.dattn_default = normwise(compute(g, default_node, c.threads).data(), ref);
  e.mul_mat = normwise(compute(g, mul_mat_path(g, scale), c.threads).data(), ref);
  for (float x : ours) EXPECT_TRUE(std::isfinite(x)) << describe(c);
  return e;
}

// f32: within 1.5x ggml_flash_attn_ext's own error (both near f32 rounding here; the floor is
// a few f32 ulps of the output, where the two only differ in summation order).
void expect_accurate(const Case& c) {
  SCOPED_TRACE(describe(c));
  const Errors e = run_case(c);
  std::printf(
      "%s: normwise error vs f64: ggml_flash_attn_ext %.3g, dattn f32 %.3g, dattn default "
      "%.3g, mul_mat+softmax %.3g\n",
      describe(c).c_str(), e.ggml, e.dattn_f32, e.dattn_default, e.mul_mat);
  EXPECT_LE(e.dattn_f32, 1.5 * e.ggml + 3e-7) << "ggml " << e.ggml << " mul_mat " << e.mul_mat;
  // The default: bf16 where the CPU has a fast bf16 engine (budget: FLASH's bf16 bound).
  EXPECT_LE(e.dattn_default, 1e-2) << "ggml " << e.ggml;
  // Sanity of the comparison itself (ggml's softmax makes NaN of a row with no visible key).
  if (c.mask != MaskKind::fully_masked_rows) {
    EXPECT_LE(e.mul_mat, 1e-2);
  }
  EXPECT_LE(e.ggml, 1e-2);
}

TEST(GgmlOperator, F16KeysAndValuesNoMask) {
  expect_accurate(Case{});
}

TEST(GgmlOperator, EveryKvTypeAndHeadSize) {
  for (ggml_type t : {GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_F32})
    for (i64 d : {64, 128}) {
      Case c;
      c.kv = t;
      c.d = c.dv = d;
      c.lq = 70;  // >= 64: ggml's tiled path
      c.lk = 131;
      expect_accurate(c);
    }
}

TEST(GgmlOperator, ShortQueriesOnGgmlsOneRowPath) {
  for (i64 lq : {1, 5, 63}) {
    Case c;
    c.lq = lq;
    c.lk = 600;
    expect_accurate(c);
    // Below 64 rows ggml rounds Q to F16 and accumulates P.V in F16 (F16 V): there even the
    // bf16 default is within 1.5x of ggml's own error.
    const Errors e = run_case(c, 2);
    EXPECT_LE(e.dattn_default, 1.5 * e.ggml) << describe(c);
  }
}

TEST(GgmlOperator, ValueHeadSizeDiffersFromKeys) {
  Case c;
  c.d = 64;
  c.dv = 80;
  c.lq = 33;
  expect_accurate(c);
}

TEST(GgmlOperator, GroupedQueryAttentionAndBatch) {
  Case c;
  c.heads = 6;
  c.kv_heads = 2;
  c.batch = 2;
  c.lq = 67;
  c.lk = 45;
  c.mask = MaskKind::dense;
  expect_accurate(c);
}

TEST(GgmlOperator, MasksOfEveryShape) {
  for (MaskKind m : {MaskKind::dense, MaskKind::key_padding, MaskKind::per_head,
                     MaskKind::per_batch, MaskKind::fully_masked_rows}) {
    Case c;
    c.mask = m;
    c.batch = 2;
    c.lq = 81;
    c.lk = 77;
    c.mask_extra_rows = m == MaskKind::dense ? 3 : 0;  // ne[1] > L_q: rows beyond never read
    c.mask_extra_keys = m == MaskKind::key_padding ? 5 : 0;
    expect_accurate(c);
  }
}

TEST(GgmlOperator, ThreadCountsGiveTheSameRows) {
  Case c;
  c.lq = 97;
  c.lk = 70;
  c.heads = 3;
  c.kv_heads = 3;
  c.mask = MaskKind::dense;
  Graphs g;
  build(c, g, 7);
  const float scale = 0.125f;
  for (const std::string path : {"f32", "auto", "sage"}) {
    ggml_tensor* node = path_node(g, path, scale);
    ASSERT_NE(node, nullptr) << dattn_last_error();
    const auto one = compute(g, node, 1);
    for (int threads : {2, 3, 5, 400}) {  // 400: more threads than rows of some heads
      const auto many = compute(g, node, threads);
      ASSERT_EQ(one.size(), many.size());
      for (std::size_t i = 0; i < one.size(); ++i)
        ASSERT_EQ(one[i], many[i]) << path << " threads " << threads << " element " << i;
    }
    if (path == "f32") {
      EXPECT_LE(normwise(one.data(), reference(c, g, scale)), 1e-6);
    }
  }
}

TEST(GgmlOperator, GarbageUnderMaskedKeysReachesNoRow) {
  for (ggml_type t : {GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_F32}) {
    Case c;
    c.kv = t;
    c.mask = MaskKind::key_padding;  // keys >= lk - 7 masked for every row
    c.lq = 40;
    c.lk = 90;
    Graphs g;
    build(c, g, 3);
    const float scale = 0.125f;
    for (const char* p : {"f32", "auto", "sage"}) {
      SCOPED_TRACE(std::string(ggml_type_name(t)) + " " + p);
      const auto o = path_options(p);
      ggml_tensor* node =
          dattn_ggml_flash_attn_ext_with(g.ctx, g.q, g.k, g.v, g.mask, scale, 0.0f, 0.0f, &o);
      ASSERT_NE(node, nullptr) << dattn_last_error();
      const auto clean = compute(g, node, 2);
      // NaN, infinities and huge values in the masked keys' K and V rows.
      for (const float x : {6.0e4f, std::numeric_limits<float>::quiet_NaN(), kInf, -kInf}) {
        poison(g.k, c.lk - 7, c.lk, x);
        poison(g.v, c.lk - 7, c.lk, -x);
        const auto dirty = compute(g, node, 2);
        for (std::size_t i = 0; i < clean.size(); ++i)
          ASSERT_EQ(clean[i], dirty[i]) << x << " " << i;
      }
      build(c, g, 3);  // fresh tensors for the next precision
    }
  }
}

TEST(GgmlOperator, NonFiniteValuesUnderAPartlyMaskedKeyReachOnlyTheRowsThatSeeIt) {
  // Key 40 is hidden by -inf from rows 0-7 only and its V row holds NaN or inf: rows 0-7 keep
  // the bits they have with a clean V (SAGE: with zeros there, its V codes sharing scales per
  // tile) and agree with ggml_flash_attn_ext; rows 8.., which attend it, are NaN
  // (docs/semantics.md, "Finite masks and non-finite inputs").
  for (ggml_type t : {GGML_TYPE_F16, GGML_TYPE_F32}) {
    Case c;
    c.kv = t;
    c.mask = MaskKind::partly_hidden_key;
    c.lq = 24;
    c.lk = 100;
    for (const char* p : {"f32", "auto", "sage"}) {
      for (const float x : {std::numeric_limits<float>::quiet_NaN(), kInf, -kInf}) {
        SCOPED_TRACE(std::string(ggml_type_name(t)) + " " + p + " " + std::to_string(x));
        Graphs g;
        build(c, g, 5);
        const float scale = 0.125f;
        const auto o = path_options(p);
        ggml_tensor* node =
            dattn_ggml_flash_attn_ext_with(g.ctx, g.q, g.k, g.v, g.mask, scale, 0.0f, 0.0f, &o);
        ASSERT_NE(node, nullptr) << dattn_last_error();
        if (std::string(p) == "sage") poison(g.v, 40, 41, 0.0f);
        const auto clean = compute(g, node, 2);
        poison(g.v, 40, 41, x);
        const auto dirty = compute(g, node, 2);
        const auto theirs =
            compute(g, ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, g.mask, scale, 0.0f, 0.0f), 2);
        for (i64 l = 0; l < c.lq; ++l)
          for (i64 h = 0; h < c.heads; ++h)
            for (i64 e = 0; e < c.dv; ++e) {
              const std::size_t at = std::size_t((l * c.heads + h) * c.dv + e);
              if (l < 8) {
                ASSERT_EQ(clean[at], dirty[at]) << "row " << l << " head " << h << " col " << e;
                ASSERT_TRUE(std::isfinite(theirs[at]));
                // ggml sums f16 V in f16.
                ASSERT_NEAR(dirty[at], theirs[at], std::string(p) == "f32" ? 1e-2 : 0.1);
              } else {
                ASSERT_TRUE(std::isnan(dirty[at])) << "row " << l << " head " << h << " col " << e;
              }
            }
      }
    }
  }
}

TEST(GgmlOperator, ViewsOfPermutedTensors) {
  // sd.cpp's q/k/v arrive as permuted views of [D, H, L, N] projections.
  Case c;
  c.lq = 45;
  c.lk = 45;
  Graphs g;
  build(c, g, 5);
  const float scale = 0.125f;
  // Tensors laid out [D, H, L, N], viewed as [D, L, H, N].
  auto permuted = [&](ggml_tensor* t) {
    ggml_tensor* dhl =
        ggml_cont(g.ctx, ggml_permute(g.ctx, t, 0, 2, 1, 3));  // [D, H, L, N] contiguous
    return ggml_permute(g.ctx, dhl, 0, 2, 1, 3);               // a view [D, L, H, N]
  };
  ggml_tensor *q = permuted(g.q), *k = permuted(g.k), *v = permuted(g.v);
  const auto f32 = precision("f32");
  ggml_tensor* ours = dattn_ggml_flash_attn_ext_with(g.ctx, q, k, v, nullptr, scale, 0, 0, &f32);
  ASSERT_NE(ours, nullptr) << dattn_last_error();
  ggml_tensor* theirs = ggml_flash_attn_ext(g.ctx, q, k, v, nullptr, scale, 0, 0);
  const auto a = compute(g, ours, 2);
  const auto b = compute(g, theirs, 2);
  const auto ref = reference(c, g, scale);
  EXPECT_LE(normwise(a.data(), ref), 1.5 * normwise(b.data(), ref) + 3e-7);
}

TEST(GgmlOperator, EmptyKeysGiveZeros) {
  Case c;
  c.lk = 0;
  c.lq = 9;
  Graphs g;
  build(c, g, 2);
  ggml_tensor* node = dattn_ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, nullptr, 0.125f, 0, 0);
  ASSERT_NE(node, nullptr) << dattn_last_error();
  for (float x : compute(g, node, 2)) EXPECT_EQ(x, 0.0f);
}

TEST(GgmlOperator, SageBackend) {
  Case c;
  c.lq = 200;
  c.lk = 180;
  c.d = c.dv = 128;
  Graphs g;
  build(c, g, 4);
  const float scale = 1.0f / std::sqrt(128.0f);
  dattn_ggml_options o;
  dattn_ggml_options_init(&o);
  o.backend = "SAGE";
  ggml_tensor* node =
      dattn_ggml_flash_attn_ext_with(g.ctx, g.q, g.k, g.v, nullptr, scale, 0, 0, &o);
  ASSERT_NE(node, nullptr) << dattn_last_error();
  EXPECT_LE(normwise(compute(g, node, 2).data(), reference(c, g, scale)), 3e-2);
}

// Two token populations (text and image from different projections, as an MM-DiT's joint
// sequence) with padded text tokens: every path within its bound, and garbage in the padding
// (Q, K and V of the padded tokens) moves no other row.
Case two_populations(ggml_type kv) {
  Case c;
  c.d = c.dv = 128;
  c.heads = 4;
  c.kv_heads = 2;
  c.text = 96;
  c.text_pad = 21;
  c.lq = c.lk = c.text + 384;
  c.kv = kv;
  c.mask = MaskKind::text_padding;
  return c;
}

TEST(GgmlOperator, TwoTokenPopulationsWithPaddedText) {
  for (ggml_type kv : {GGML_TYPE_F16, GGML_TYPE_F32}) {
    const Case c = two_populations(kv);
    SCOPED_TRACE(describe(c));
    Graphs g;
    build(c, g, 21);
    const float scale = 1.0f / std::sqrt(float(c.d));
    const auto ref = reference(c, g, scale);
    const auto real = [&](i64 l) { return l < c.text - c.text_pad || l >= c.text; };
    const double ggml_err = normwise(
        compute(g, ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, g.mask, scale, 0, 0), 2).data(), ref);
    for (const std::string path : {"f32", "auto", "sage"}) {
      ggml_tensor* node = path_node(g, path, scale);
      ASSERT_NE(node, nullptr) << dattn_last_error();
      const auto out = compute(g, node, 2);
      const double err = normwise(out.data(), ref);
      const HeadAccuracy a = per_head(c, out.data(), ref, real);
      std::printf(
          "two populations, %s K/V, %-4s: normwise %.3g (ggml_flash_attn_ext %.3g), "
          "per head cosine >= %.6f, rel L1 <= %.4f%%\n",
          ggml_type_name(kv), path.c_str(), err, ggml_err, a.cosine, 100 * a.rel_l1);
      if (path == "f32") {
        EXPECT_LE(err, 1.5 * ggml_err + 3e-7);
      } else if (path == "auto") {
        // bf16 where the CPU has a fast bf16 engine: K rounded to bf16 with its offsets (x 20,
        // unsmoothed, unlike SAGE's) costs far more than on N(0, 1) (docs/semantics.md,
        // "Compute precision": measured 1.5-2.1e-2 here on AMX; f32 elsewhere).
        EXPECT_LE(err, 3e-2);
        EXPECT_GE(a.cosine, 0.99);
      } else {  // SAGE's bound on these populations (docs/semantics.md, "SAGE")
        EXPECT_GE(a.cosine, 0.999);
        EXPECT_LE(a.rel_l1, 0.035);
      }
      // The padded tokens' rows see nothing: zeros.
      for (i64 l = c.text - c.text_pad; l < c.text; ++l)
        for (i64 e = 0; e < c.heads * c.dv; ++e)
          ASSERT_EQ(out[std::size_t(l * c.heads * c.dv + e)], 0.0f) << path << " row " << l;
      // Garbage in the padded tokens' Q, K and V moves no row, bit for bit.
      for (const float x : {1e4f, std::numeric_limits<float>::quiet_NaN(), kInf}) {
        for (ggml_tensor* t : {g.q, g.k, g.v}) poison(t, c.text - c.text_pad, c.text, x);
        const auto dirty = compute(g, node, 2);
        for (std::size_t i = 0; i < out.size(); ++i)
          ASSERT_EQ(out[i], dirty[i]) << path << " garbage " << x << " element " << i;
      }
      build(c, g, 21);  // clean tensors (the same values) for the next path
    }
  }
}

// Bad input: NULL, nothing added to the context, the field named.
void expect_refused(Graphs& g, ggml_tensor* q, ggml_tensor* k, ggml_tensor* v, ggml_tensor* mask,
                    float scale, float max_bias, float softcap, const char* field,
                    const dattn_ggml_options* o = nullptr) {
  int tensors_before = 0;
  for (ggml_tensor* t = ggml_get_first_tensor(g.ctx); t; t = ggml_get_next_tensor(g.ctx, t))
    ++tensors_before;
  ggml_tensor* node =
      dattn_ggml_flash_attn_ext_with(g.ctx, q, k, v, mask, scale, max_bias, softcap, o);
  EXPECT_EQ(node, nullptr) << field;
  EXPECT_STREQ(dattn_last_error_field(), field) << dattn_last_error();
  EXPECT_NE(std::string(dattn_last_error()).find(field), std::string::npos) << dattn_last_error();
  int tensors_after = 0;
  for (ggml_tensor* t = ggml_get_first_tensor(g.ctx); t; t = ggml_get_next_tensor(g.ctx, t))
    ++tensors_after;
  EXPECT_EQ(tensors_before, tensors_after) << field;
}

TEST(GgmlOperator, BadInputIsRefusedWhenTheNodeIsBuilt) {
  Case c;
  c.heads = 4;
  c.kv_heads = 2;
  c.mask = MaskKind::dense;
  Graphs g;
  build(c, g, 9);
  ggml_context* ctx = g.ctx;
  expect_refused(g, nullptr, g.k, g.v, nullptr, 0.1f, 0, 0, "q");
  ggml_tensor* q16 = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.d, c.lq, c.heads, 1);
  expect_refused(g, q16, g.k, g.v, nullptr, 0.1f, 0, 0, "q");
  ggml_tensor* k8 = ggml_new_tensor_4d(ctx, GGML_TYPE_Q8_0, c.d, c.lk, c.kv_heads, 1);
  expect_refused(g, g.q, k8, g.v, nullptr, 0.1f, 0, 0, "k");
  ggml_tensor* v32 = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, c.dv, c.lk, c.kv_heads, 1);
  expect_refused(g, g.q, g.k, v32, nullptr, 0.1f, 0, 0, "v");
  ggml_tensor* k3 = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.d, c.lk, 3, 1);
  ggml_tensor* v3 = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.dv, c.lk, 3, 1);
  expect_refused(g, g.q, k3, v3, nullptr, 0.1f, 0, 0, "k");
  ggml_tensor* kd = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.d + 1, c.lk, c.kv_heads, 1);
  expect_refused(g, g.q, kd, g.v, nullptr, 0.1f, 0, 0, "k");
  ggml_tensor* vshort = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.dv, c.lk - 1, c.kv_heads, 1);
  expect_refused(g, g.q, g.k, vshort, nullptr, 0.1f, 0, 0, "v");
  ggml_tensor* m32 = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, c.lk, c.lq);
  expect_refused(g, g.q, g.k, g.v, m32, 0.1f, 0, 0, "mask");
  ggml_tensor* mrows = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, c.lk, c.lq - 1);
  expect_refused(g, g.q, g.k, g.v, mrows, 0.1f, 0, 0, "mask");
  ggml_tensor* mheads = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, c.lk, c.lq, 3);
  expect_refused(g, g.q, g.k, g.v, mheads, 0.1f, 0, 0, "mask");
  ggml_tensor* mview = ggml_view_2d(ctx, g.mask, c.lk - 1, c.lq, g.mask->nb[1], 0);
  expect_refused(g, g.q, g.k, g.v, mview, 0.1f, 0, 0, "mask");
  expect_refused(g, g.q, g.k, g.v, g.mask, 0.1f, 8.0f, 0, "max_bias");
  expect_refused(g, g.q, g.k, g.v, g.mask, 0.1f, 0, 30.0f, "logit_softcap");
  expect_refused(g, g.q, g.k, g.v, g.mask, std::nanf(""), 0, 0, "scale");
  expect_refused(g, g.q, g.k, g.v, g.mask, -1.0f, 0, 0, "scale");
  auto bad_precision = precision("fp8");
  expect_refused(g, g.q, g.k, g.v, g.mask, 0.1f, 0, 0, "precision", &bad_precision);
  dattn_ggml_options bad_backend;
  dattn_ggml_options_init(&bad_backend);
  bad_backend.backend = "NOPE";
  expect_refused(g, g.q, g.k, g.v, g.mask, 0.1f, 0, 0, "backend", &bad_backend);
  const char* opts[] = {"compute_dtpye=bf16", nullptr};
  dattn_ggml_options misspelled;
  dattn_ggml_options_init(&misspelled);
  misspelled.options = opts;
  dattn_ggml_options old = misspelled;
  old.struct_size = 4;
  expect_refused(g, g.q, g.k, g.v, g.mask, 0.1f, 0, 0, "struct_size", &old);
  ggml_tensor* node =
      dattn_ggml_flash_attn_ext_with(ctx, g.q, g.k, g.v, g.mask, 0.1f, 0, 0, &misspelled);
  EXPECT_EQ(node, nullptr);
  EXPECT_NE(std::string(dattn_last_error()).find("compute_dtpye"), std::string::npos)
      << dattn_last_error();
}

TEST(GgmlOperator, EnvironmentChoosesBackendAndPrecision) {
  Case c;
  Graphs g;
  build(c, g, 11);
  ASSERT_EQ(setenv("DATTN_GGML_PRECISION", "half", 1), 0);
  EXPECT_EQ(dattn_ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, nullptr, 0.1f, 0, 0), nullptr);
  EXPECT_STREQ(dattn_last_error_field(), "precision");
  EXPECT_NE(std::string(dattn_last_error()).find("DATTN_GGML_PRECISION"), std::string::npos);
  ASSERT_EQ(setenv("DATTN_GGML_PRECISION", "F32", 1), 0);
  ASSERT_EQ(setenv("DATTN_GGML_BACKEND", "SAGE", 1), 0);
  // SAGE has no compute_dtype: precision f32 is refused for it.
  EXPECT_EQ(dattn_ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, nullptr, 0.1f, 0, 0), nullptr);
  EXPECT_STREQ(dattn_last_error_field(), "precision") << dattn_last_error();
  ASSERT_EQ(unsetenv("DATTN_GGML_PRECISION"), 0);
  EXPECT_NE(dattn_ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, nullptr, 0.1f, 0, 0), nullptr)
      << dattn_last_error();
  ASSERT_EQ(unsetenv("DATTN_GGML_BACKEND"), 0);
}

TEST(GgmlOperator, AFaultWhileComputingGivesNaNAndIsCounted) {
  Case c;
  Graphs g;
  build(c, g, 12);
  ggml_tensor* node = dattn_ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, nullptr, 0.1f, 0, 0);
  ASSERT_NE(node, nullptr) << dattn_last_error();
  const long before = dattn_ggml_compute_errors();
  void* saved = g.k->data;
  g.k->data = nullptr;  // K not allocated: the calls fail inside the operator
  const auto out = compute(g, node, 2);
  g.k->data = saved;
  EXPECT_GT(dattn_ggml_compute_errors(), before);
  EXPECT_NE(std::string(dattn_ggml_last_compute_error()).find("key"), std::string::npos)
      << dattn_ggml_last_compute_error();
  for (float x : out) EXPECT_TRUE(std::isnan(x));
  const auto fine = compute(g, node, 2);
  for (float x : fine) EXPECT_TRUE(std::isfinite(x));
}

}  // namespace
