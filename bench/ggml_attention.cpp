// ggml_flash_attn_ext against dattn_ggml_flash_attn_ext (include/dattn/ggml.h) inside ggml
// graphs on ggml's own thread pool: F32 Q, F16 K/V (stable-diffusion.cpp's --diffusion-fa
// path), interleaved rounds, best of each; GFLOP/s = 4 Lq Lk D H / seconds.
//   bench_ggml_attention [--workload flux-1024|wan-480p|NAME:LQ:LK:H:D] [--threads 2]
//                        [--rounds 3] [--mul-mat] [--skip-ggml]
// --mul-mat adds ggml's mul_mat + softmax path (the full L_q x L_k matrix per head in f32).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dattn/dattn.h"
#include "dattn/ggml.h"
#include "ggml-cpu.h"

namespace {

struct Workload {
  std::string name;
  long lq, lk, heads, d;
};

Workload parse_workload(const std::string& s) {
  if (s == "flux-1024") return {s, 4608, 4608, 4, 128};
  if (s == "wan-480p") return {s, 32760, 32760, 2, 128};
  Workload w;
  char name[64] = {0};
  if (std::sscanf(s.c_str(), "%63[^:]:%ld:%ld:%ld:%ld", name, &w.lq, &w.lk, &w.heads, &w.d) == 5) {
    w.name = name;
    return w;
  }
  std::fprintf(stderr,
               "--workload: '%s' is not valid; valid: flux-1024, wan-480p, NAME:LQ:LK:H:D\n",
               s.c_str());
  std::exit(2);
}

struct Path {
  std::string name;
  std::function<ggml_tensor*(ggml_context*, ggml_tensor*, ggml_tensor*, ggml_tensor*, float)> build;
  double best = 1e30;
  ggml_tensor* node = nullptr;
  ggml_cgraph* graph = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  Workload w = parse_workload("flux-1024");
  int threads = 2, rounds = 3;
  bool mul_mat = false, skip_ggml = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--workload")
      w = parse_workload(value());
    else if (a == "--threads")
      threads = std::atoi(value().c_str());
    else if (a == "--rounds")
      rounds = std::atoi(value().c_str());
    else if (a == "--mul-mat")
      mul_mat = true;
    else if (a == "--skip-ggml")
      skip_ggml = true;
    else {
      std::fprintf(
          stderr, "unknown option %s; valid: --workload --threads --rounds --mul-mat --skip-ggml\n",
          a.c_str());
      return 2;
    }
  }
  if (threads < 1 || rounds < 1) {
    std::fprintf(stderr, "--threads and --rounds must be >= 1\n");
    return 2;
  }

  std::vector<Path> paths;
  if (!skip_ggml)
    paths.push_back({"ggml_flash_attn_ext (F16 K/V)",
                     [](ggml_context* c, ggml_tensor* q, ggml_tensor* k, ggml_tensor* v, float s) {
                       ggml_tensor* r = ggml_flash_attn_ext(c, q, k, v, nullptr, s, 0, 0);
                       ggml_flash_attn_ext_set_prec(r, GGML_PREC_F32);
                       return r;
                     }});
  auto dattn_path = [](const char* backend, const char* precision) {
    return [backend, precision](ggml_context* c, ggml_tensor* q, ggml_tensor* k, ggml_tensor* v,
                                float s) {
      dattn_ggml_options o;
      dattn_ggml_options_init(&o);
      o.backend = backend;
      o.precision = precision;
      ggml_tensor* r = dattn_ggml_flash_attn_ext_with(c, q, k, v, nullptr, s, 0, 0, &o);
      if (r == nullptr) {
        std::fprintf(stderr, "dattn_ggml_flash_attn_ext: %s\n", dattn_last_error());
        std::exit(1);
      }
      return r;
    };
  };
  paths.push_back({"dattn FLASH (default precision)", dattn_path("FLASH", "auto")});
  paths.push_back({"dattn FLASH f32", dattn_path("FLASH", "f32")});
  paths.push_back({"dattn SAGE", dattn_path("SAGE", "auto")});
  if (mul_mat)
    paths.push_back({"ggml mul_mat + soft_max",
                     [](ggml_context* c, ggml_tensor* q, ggml_tensor* k, ggml_tensor* v, float s) {
                       ggml_tensor* kq = ggml_soft_max_ext(c, ggml_mul_mat(c, k, q), nullptr, s, 0);
                       ggml_tensor* vt = ggml_cont(c, ggml_transpose(c, v));
                       return ggml_cont(c, ggml_permute(c, ggml_mul_mat(c, vt, kq), 0, 2, 1, 3));
                     }});

  const double flop = 4.0 * double(w.lq) * double(w.lk) * double(w.d) * double(w.heads);
  const std::size_t qo = std::size_t(w.lq) * std::size_t(w.d * w.heads) * 4;  // q or an output
  const std::size_t kv = std::size_t(w.lk) * std::size_t(w.d * w.heads) * 2;
  std::size_t bytes =
      qo + 2 * kv + paths.size() * (qo + ggml_graph_overhead()) + (std::size_t(64) << 20);
  if (mul_mat)  // K.Q^T and its softmax in f32, V^T, P.V and its permuted copy
    bytes += 2 * std::size_t(w.lq) * std::size_t(w.lk) * std::size_t(w.heads) * 4 + kv + 2 * qo;
  bytes = bytes / 4 * 5 + (std::size_t(256) << 20);  // ggml objects, alignment
  ggml_init_params params{bytes, nullptr, false};
  ggml_context* ctx = ggml_init(params);
  if (ctx == nullptr) {
    std::fprintf(stderr, "ggml_init: cannot allocate %zu bytes\n", bytes);
    return 1;
  }
  ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, w.d, w.lq, w.heads, 1);
  ggml_tensor* k = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, w.d, w.lk, w.heads, 1);
  ggml_tensor* v = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, w.d, w.lk, w.heads, 1);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (long i = 0; i < ggml_nelements(q); ++i) static_cast<float*>(q->data)[i] = normal(rng);
  for (ggml_tensor* t : {k, v})
    for (long i = 0; i < ggml_nelements(t); ++i)
      static_cast<ggml_fp16_t*>(t->data)[i] = ggml_fp32_to_fp16(normal(rng));
  const float scale = 1.0f / std::sqrt(float(w.d));
  for (Path& p : paths) {
    p.node = p.build(ctx, q, k, v, scale);
    p.graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(p.graph, p.node);
  }
  std::printf(
      "workload %s: Lq %ld, Lk %ld, %ld heads, D %ld; %d threads (ggml's pool), "
      "best of %d interleaved rounds; dattn %s\n",
      w.name.c_str(), w.lq, w.lk, w.heads, w.d, threads, rounds, dattn_version());
  for (int r = 0; r < rounds; ++r)
    for (Path& p : paths) {
      const auto t0 = std::chrono::steady_clock::now();
      if (ggml_graph_compute_with_ctx(ctx, p.graph, threads) != GGML_STATUS_SUCCESS) {
        std::fprintf(stderr, "%s: ggml_graph_compute failed\n", p.name.c_str());
        return 1;
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      p.best = std::min(p.best, s);
    }
  // The split's cost: the same FLASH layer as one dattn_forward over every row on `threads`
  // OpenMP threads of dattn's own, outside ggml (C ABI, the operator's default precision).
  double direct_best = 1e30;
  {
    dattn_layer_config c;
    dattn_layer_config_init(&c);
    c.num_heads = int(w.heads);
    c.head_size = int(w.d);
    c.softmax_scale = scale;
    c.backend = "FLASH";
    const char* opts[] = {"compute_dtype=bf16", nullptr};
    c.options = opts;
    c.threads = threads;
    dattn_layer* layer = nullptr;
    if (dattn_layer_create(&c, &layer) != DATTN_OK) {
      std::fprintf(stderr, "dattn_layer_create: %s\n", dattn_last_error());
      return 1;
    }
    std::vector<float> out(std::size_t(w.lq * w.heads * w.d));
    // ggml's [D, L, H, 1] as BSHD [1, L, H, D]: strides (.., D, L * D, 1).
    int64_t q_shape[4] = {1, w.lq, w.heads, w.d},
            q_strides[4] = {w.lq * w.heads * w.d, w.d, w.lq * w.d, 1};
    int64_t k_shape[4] = {1, w.lk, w.heads, w.d},
            k_strides[4] = {w.lk * w.heads * w.d, w.d, w.lk * w.d, 1};
    DLTensor qt{q->data, {kDLCPU, 0}, 4, {kDLFloat, 32, 1}, q_shape, q_strides, 0};
    DLTensor kt{k->data, {kDLCPU, 0}, 4, {kDLFloat, 16, 1}, k_shape, k_strides, 0};
    DLTensor vt{v->data, {kDLCPU, 0}, 4, {kDLFloat, 16, 1}, k_shape, k_strides, 0};
    DLTensor ot{out.data(), {kDLCPU, 0}, 4, {kDLFloat, 32, 1}, q_shape, nullptr, 0};
    for (int r = 0; r < rounds; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      if (dattn_forward(layer, &qt, &kt, &vt, nullptr, &ot, nullptr) != DATTN_OK) {
        std::fprintf(stderr, "dattn_forward: %s\n", dattn_last_error());
        return 1;
      }
      direct_best =
          std::min(direct_best,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    dattn_layer_destroy(layer);
  }
  // Differences against the first path's output.
  const float* base = static_cast<const float*>(paths[0].node->data);
  const double base_rate = flop / paths[0].best / 1e9;
  std::printf("%-34s %10s %10s %8s %14s\n", "path", "seconds", "GFLOP/s", "vs first", "rel. diff");
  for (Path& p : paths) {
    const float* x = static_cast<const float*>(p.node->data);
    double num = 0, den = 0;
    for (long i = 0; i < ggml_nelements(p.node); ++i) {
      num += double(x[i] - base[i]) * double(x[i] - base[i]);
      den += double(base[i]) * double(base[i]);
    }
    const double rate = flop / p.best / 1e9;
    std::printf("%-34s %10.3f %10.1f %7.2fx %14.3g\n", p.name.c_str(), p.best, rate,
                rate / base_rate, std::sqrt(num / (den > 0 ? den : 1)));
  }
  std::printf("%-34s %10.3f %10.1f %7.2fx %14s\n", "(dattn_forward alone, its threads)",
              direct_best, flop / direct_best / 1e9, flop / direct_best / 1e9 / base_rate, "");
  if (dattn_ggml_compute_errors() != 0)
    std::printf("dattn_ggml compute errors: %ld (%s)\n", dattn_ggml_compute_errors(),
                dattn_ggml_last_compute_error());
  ggml_free(ctx);
  return 0;
}
