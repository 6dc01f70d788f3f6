// One DiT forward of stable-diffusion.cpp's own model runners (Flux::FluxRunner,
// WAN::WanRunner and their compute(), as their load_from_file_and_test do) with random weights
// in the original tensor naming (BFL's Flux, Wan-AI's Wan 2.1) at real widths and reduced depth;
// no text encoder or VAE. Each attention path in turn, in one process:
//   ggml-fa    --diffusion-fa's path: ggml_flash_attn_ext (K/V cast to F16, keys padded to 256)
//   dattn      the same flash path routed to dattn_ggml_flash_attn_ext (dattn.patch), FLASH at
//              its default precision
//   dattn-sage the same with DATTN_GGML_BACKEND=SAGE
//   mul-mat    without --diffusion-fa: ggml_mul_mat + softmax (the full L_q x L_k matrix)
// and for each: seconds, peak resident memory (VmHWM, reset per path), the time of the model's
// attention calls alone (the same ggml_ext_attention_ext call in a graph of its own, times the
// number of calls), and the output's normwise difference from the first path.
//   sdcpp_dit_bench --model flux|wan [--width 1024 --height 1024] [--frames 81] [--depth N]
//                   [--single-depth N] [--threads 2] [--paths ggml-fa,dattn,dattn-sage,mul-mat]
//                   [--weights f16|f32] [--verbose]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "flux.hpp"  // brings ggml_extend_backend.hpp: sd.cpp's own ggml_backend_cpu_* wrappers
#include "wan.hpp"

namespace {

struct Options {
  std::string model = "flux";
  int width = 0, height = 0, frames = 81;
  int depth = 1, single_depth = 1;
  int threads = 2;
  std::vector<std::string> paths = {"ggml-fa", "dattn", "dattn-sage"};
  ggml_type weights = GGML_TYPE_F16;
  bool verbose = false;
};

[[noreturn]] void usage(const std::string& message) {
  std::fprintf(stderr,
               "%s\nusage: sdcpp_dit_bench --model flux|wan [--width W --height H] [--frames F] "
               "[--depth N] [--single-depth N] [--threads T] "
               "[--paths ggml-fa,dattn,dattn-sage,mul-mat] [--weights f16|f32] [--verbose]\n",
               message.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(a + " needs a value");
      return argv[++i];
    };
    auto integer = [&]() {
      const std::string v = value();
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || n < 1)
        usage(a + ": '" + v + "' is not an integer >= 1");
      return int(n);
    };
    // The integer flags and the field each sets.
    static const std::pair<const char*, int Options::*> kIntegers[] = {
        {"--width", &Options::width},
        {"--height", &Options::height},
        {"--frames", &Options::frames},
        {"--depth", &Options::depth},
        {"--single-depth", &Options::single_depth},
        {"--threads", &Options::threads}};
    const auto flag = std::find_if(std::begin(kIntegers), std::end(kIntegers),
                                   [&](const auto& f) { return a == f.first; });
    if (flag != std::end(kIntegers))
      o.*(flag->second) = integer();
    else if (a == "--model")
      o.model = value();
    else if (a == "--verbose")
      o.verbose = true;
    else if (a == "--weights") {
      const std::string w = value();
      if (w == "f16")
        o.weights = GGML_TYPE_F16;
      else if (w == "f32")
        o.weights = GGML_TYPE_F32;
      else
        usage("--weights: '" + w + "' is not valid; valid: f16, f32");
    } else if (a == "--paths") {
      o.paths.clear();
      std::stringstream ss(value());
      for (std::string p; std::getline(ss, p, ',');) {
        if (p != "ggml-fa" && p != "dattn" && p != "dattn-sage" && p != "mul-mat")
          usage("--paths: '" + p + "' is not valid; valid: ggml-fa, dattn, dattn-sage, mul-mat");
        o.paths.push_back(p);
      }
      if (o.paths.empty()) usage("--paths: give at least one path");
    } else {
      usage("unknown option " + a);
    }
  }
  if (o.model != "flux" && o.model != "wan")
    usage("--model: '" + o.model + "' is not valid; valid: flux, wan");
  if (o.width == 0) o.width = o.model == "flux" ? 1024 : 832;
  if (o.height == 0) o.height = o.model == "flux" ? 1024 : 480;
  if (o.width % 16 != 0 || o.height % 16 != 0)
    usage("--width and --height must be multiples of 16");
  if (o.model == "wan" && (o.frames - 1) % 4 != 0) usage("--frames must be 4k + 1 (Wan's VAE)");
  return o;
}

// Peak resident memory since the last reset (VmHWM), in MiB; reset by writing 5 to clear_refs.
void reset_peak_memory() {
  std::ofstream("/proc/self/clear_refs") << "5";
}
double peak_memory_mib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;
  return 0;
}

void log_callback(sd_log_level_t level, const char* text, void* verbose) {
  if (level >= SD_LOG_WARN || *static_cast<bool*>(verbose)) std::fputs(text, stderr);
}

// The tensor map a runner infers its parameters from: the names and shapes sd.cpp reads.
TensorStorage storage(const std::string& name, ggml_type type, std::vector<int64_t> ne) {
  return TensorStorage(name, type, ne.data(), int(ne.size()), 0);
}

// Every parameter of `tensors` typed as a checkpoint would store it: matrices in `weights`,
// vectors (norms, biases) in f32.
String2TensorStorage typed_map(const std::map<std::string, ggml_tensor*>& tensors,
                               ggml_type weights) {
  String2TensorStorage map;
  for (const auto& [name, t] : tensors) {
    const int dims = ggml_n_dims(t);
    std::vector<int64_t> ne(t->ne, t->ne + std::max(dims, 1));
    map[name] = storage(name, dims >= 2 ? weights : GGML_TYPE_F32, ne);
  }
  return map;
}

// Random weights: matrices N(0, 1/fan_in), biases 0, norm scales and other vectors 1.
void randomize(const std::map<std::string, ggml_tensor*>& tensors, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values;
  std::vector<char> bytes;
  for (const auto& [name, t] : tensors) {
    const int64_t n = ggml_nelements(t);
    values.resize(size_t(n));
    const int dims = ggml_n_dims(t);
    const bool bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    if (dims >= 2) {
      const double fan_in = double(n) / double(t->ne[dims - 1]);
      const float sigma = float(1.0 / std::sqrt(fan_in));
      for (auto& v : values) v = sigma * normal(rng);
    } else {
      for (auto& v : values) v = bias ? 0.0f : 1.0f;
    }
    bytes.resize(ggml_nbytes(t));
    if (t->type == GGML_TYPE_F32)
      std::memcpy(bytes.data(), values.data(), bytes.size());
    else if (t->type == GGML_TYPE_F16)
      ggml_fp32_to_fp16_row(values.data(), reinterpret_cast<ggml_fp16_t*>(bytes.data()), n);
    else if (t->type == GGML_TYPE_BF16)
      ggml_fp32_to_bf16_row(values.data(), reinterpret_cast<ggml_bf16_t*>(bytes.data()), n);
    else {
      std::fprintf(stderr, "%s: type %s is not filled by this harness\n", name.c_str(),
                   ggml_type_name(t->type));
      std::exit(1);
    }
    ggml_backend_tensor_set(t, bytes.data(), 0, bytes.size());
  }
}

sd::Tensor<float> random_tensor(std::vector<int64_t> shape, unsigned seed, float sigma = 1.0f) {
  sd::Tensor<float> t(std::move(shape));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  for (auto& v : t.values()) v = normal(rng);
  return t;
}

// Environment of one path (read by the patched ggml_ext_attention_ext when it builds a graph).
void enter_path(const std::string& path) {
  setenv("SD_DATTN", path == "dattn" || path == "dattn-sage" ? "1" : "0", 1);
  if (path == "dattn-sage")
    setenv("DATTN_GGML_BACKEND", "SAGE", 1);
  else
    unsetenv("DATTN_GGML_BACKEND");
}

// One attention call of shape (L_q, L_k, heads, D = 128) through sd.cpp's ggml_ext_attention_ext
// on `path`, in a graph of its own on the same backend: seconds.
double attention_seconds(ggml_backend_t backend, const std::string& path, int64_t lq, int64_t lk,
                         int64_t heads, int threads) {
  const int64_t d = 128, c = heads * d;
  ggml_init_params params{};
  params.mem_size = size_t(lq + 2 * lk) * size_t(c) * 4 + 64 * ggml_tensor_overhead() +
                    ggml_graph_overhead() + (size_t(16) << 20);
  params.no_alloc = true;
  ggml_context* ctx = ggml_init(params);
  ggml_tensor* q = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c, lq, 1);
  ggml_tensor* k = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c, lk, 1);
  ggml_tensor* v = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c, lk, 1);
  // The constant GGMLRunner puts in its graphs (ggml_ext_full builds the flash path's mask from
  // it).
  ggml_tensor* one = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 1);
  ggml_set_name(one, "ggml_runner_build_in_tensor:one");
  enter_path(path);
  ggml_tensor* out =
      ggml_ext_attention_ext(ctx, backend, q, k, v, heads, nullptr, false, path != "mul-mat");
  ggml_cgraph* gf = ggml_new_graph(ctx);
  ggml_build_forward_expand(gf, out);
  ggml_gallocr_t allocr = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
  double seconds = -1;
  if (ggml_gallocr_alloc_graph(allocr, gf)) {
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (ggml_tensor* t : {q, k, v}) {
      std::vector<float> x(size_t(ggml_nelements(t)));
      for (auto& e : x) e = normal(rng);
      ggml_backend_tensor_set(t, x.data(), 0, ggml_nbytes(t));
    }
    const float one_value = 1.0f;
    if (one->buffer != nullptr)
      ggml_backend_tensor_set(one, &one_value, 0, sizeof one_value);  // in the graph
    ggml_backend_cpu_set_n_threads(backend, threads);
    const auto t0 = std::chrono::steady_clock::now();
    if (ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS)
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  ggml_gallocr_free(allocr);
  ggml_free(ctx);
  return seconds;
}

double normwise(const sd::Tensor<float>& a, const sd::Tensor<float>& b) {
  if (a.numel() != b.numel() || a.numel() == 0) return NAN;
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(a.data()[i]) - double(b.data()[i]);
    num += d * d;
    den += double(b.data()[i]) * double(b.data()[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  sd_set_log_callback(log_callback, &o.verbose);
  ggml_backend_t backend = ggml_backend_cpu_init();
  const std::string prefix = "model.diffusion_model";
  const std::string p = prefix + ".";

  // What each model's runner infers its parameters from (BFL's and Wan-AI's names).
  String2TensorStorage names;
  struct AttentionCall {
    int64_t lq, lk, heads, count;
  };
  std::vector<AttentionCall> calls;
  int64_t tokens = 0;
  if (o.model == "flux") {
    names[p + "txt_in.weight"] = storage(p + "txt_in.weight", o.weights, {4096, 3072});
    names[p + "guidance_in.in_layer.weight"] =
        storage(p + "guidance_in.in_layer.weight", o.weights, {256, 3072});
    const std::string d =
        p + "double_blocks." + std::to_string(o.depth - 1) + ".txt_attn.norm.key_norm.scale";
    const std::string s =
        p + "single_blocks." + std::to_string(o.single_depth - 1) + ".norm.key_norm.scale";
    names[p + "double_blocks.0.txt_attn.norm.key_norm.scale"] =
        storage(p + "double_blocks.0.txt_attn.norm.key_norm.scale", GGML_TYPE_F32, {128});
    names[d] = storage(d, GGML_TYPE_F32, {128});
    names[s] = storage(s, GGML_TYPE_F32, {128});
    tokens = int64_t(o.width / 16) * (o.height / 16) + 512;
    calls.push_back({tokens, tokens, 24, o.depth + o.single_depth});
  } else {
    const std::string q0 = p + "blocks.0.self_attn.q.weight";
    const std::string ql = p + "blocks." + std::to_string(o.depth - 1) + ".self_attn.q.weight";
    names[q0] = storage(q0, o.weights, {1536, 1536});
    names[ql] = storage(ql, o.weights, {1536, 1536});
    tokens = int64_t((o.frames - 1) / 4 + 1) * (o.height / 16) * (o.width / 16);
    calls.push_back({tokens, tokens, 12, o.depth});  // self-attention over the grid
    calls.push_back({tokens, 512, 12, o.depth});     // cross-attention to the text
  }

  // Built twice: once to learn every parameter's name and shape, then with them all typed.
  auto make_runner = [&](const String2TensorStorage& map) -> std::shared_ptr<GGMLRunner> {
    if (o.model == "flux")
      return std::make_shared<Flux::FluxRunner>(backend, false, map, prefix, VERSION_FLUX, false);
    return std::make_shared<WAN::WanRunner>(backend, false, map, prefix, VERSION_WAN2);
  };
  auto param_tensors = [&](GGMLRunner& r) {
    std::map<std::string, ggml_tensor*> tensors;
    if (o.model == "flux")
      static_cast<Flux::FluxRunner&>(r).get_param_tensors(tensors, prefix);
    else
      static_cast<WAN::WanRunner&>(r).get_param_tensors(tensors, prefix);
    return tensors;
  };
  std::shared_ptr<GGMLRunner> runner;
  {
    auto probe = make_runner(names);
    runner = make_runner(typed_map(param_tensors(*probe), o.weights));
  }
  if (!runner->alloc_params_buffer()) {
    std::fprintf(stderr, "cannot allocate the parameters\n");
    return 1;
  }
  const auto tensors = param_tensors(*runner);
  size_t param_bytes = 0;
  for (const auto& [name, t] : tensors) param_bytes += ggml_nbytes(t);
  randomize(tensors, 1);

  std::printf(
      "sd.cpp %s DiT, random weights (%s, %.0f MiB, %zu tensors), depth %d%s, %dx%d%s: %lld "
      "tokens; "
      "%d threads; dattn %s\n",
      o.model.c_str(), ggml_type_name(o.weights), double(param_bytes) / 1048576.0, tensors.size(),
      o.depth,
      o.model == "flux" ? (" + " + std::to_string(o.single_depth) + " single").c_str() : "",
      o.width, o.height,
      o.model == "wan" ? (" x " + std::to_string(o.frames) + " frames").c_str() : "",
      (long long)tokens, o.threads, dattn_version());
  std::fflush(stdout);

  // The inputs: latents, timestep, text states (and Flux's pooled vector and guidance).
  const auto timesteps =
      sd::Tensor<float>::from_vector(std::vector<float>{o.model == "flux" ? 0.5f : 500.0f});
  const auto context = random_tensor({4096, 512, 1}, 11);
  sd::Tensor<float> x;
  if (o.model == "flux")
    x = random_tensor({o.width / 8, o.height / 8, 16, 1}, 10);
  else
    x = random_tensor({o.width / 8, o.height / 8, (o.frames - 1) / 4 + 1, 16}, 10);
  const auto y = random_tensor({768, 1}, 12);
  const auto guidance = sd::Tensor<float>::from_vector(std::vector<float>{3.5f});

  struct Result {
    std::string path;
    double seconds = 0, attention = 0, peak_mib = 0;
    sd::Tensor<float> out;
  };
  std::vector<Result> results;
  for (const std::string& path : o.paths) {
    enter_path(path);
    runner->set_flash_attention_enabled(path != "mul-mat");
    reset_peak_memory();
    const auto t0 = std::chrono::steady_clock::now();
    sd::Tensor<float> out;
    if (o.model == "flux")
      out = static_cast<Flux::FluxRunner&>(*runner).compute(o.threads, x, timesteps, context, {}, y,
                                                            guidance);
    else
      out = static_cast<WAN::WanRunner&>(*runner).compute(o.threads, x, timesteps, context);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double peak = peak_memory_mib();
    runner->free_compute_buffer();
    if (out.empty()) {
      std::printf("%-11s forward failed (see the messages above)\n", path.c_str());
      continue;
    }
    double attention = 0;
    for (const AttentionCall& c : calls)
      attention +=
          double(c.count) * attention_seconds(backend, path, c.lq, c.lk, c.heads, o.threads);
    results.push_back({path, seconds, attention, peak, std::move(out)});
    std::printf(
        "  %-11s forward %8.2f s, attention calls alone %8.2f s (%4.1f%%), peak RSS %8.0f MiB\n",
        path.c_str(), seconds, attention, 100.0 * attention / seconds, peak);
    std::fflush(stdout);
  }
  if (results.empty()) return 1;
  std::printf("%-11s %10s %8s %12s %7s %12s %16s\n", "path", "forward s", "vs first", "attention s",
              "share", "peak MiB", "diff vs first");
  for (const Result& r : results)
    std::printf("%-11s %10.2f %7.2fx %12.2f %6.1f%% %12.0f %16.3g\n", r.path.c_str(), r.seconds,
                results[0].seconds / r.seconds, r.attention, 100.0 * r.attention / r.seconds,
                r.peak_mib, normwise(r.out, results[0].out));
  for (const Result& r : results)
    for (float v : r.out.values())
      if (!std::isfinite(v)) {
        std::printf("%s: the output holds NaN or inf\n", r.path.c_str());
        return 1;
      }
  if (dattn_ggml_compute_errors() != 0) {
    std::printf("dattn_ggml compute errors: %ld (%s)\n", dattn_ggml_compute_errors(),
                dattn_ggml_last_compute_error());
    return 1;
  }
  ggml_backend_free(backend);
  return 0;
}
