// Measuring one workload on one backend: inputs, warm-up, best of N timed calls, the error of a
// sample of rows against REFERENCE, and the machine's peak. Shared by `dattn run` and
// `dattn bench`.
#include "measurement.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <vector>

#include "block_map_png.hpp"
#include "dattn/attention.hpp"
#include "dattn/cpu_info.hpp"
#include "dattn/engines.hpp"
#include "dattn/errors.hpp"
#include "dattn/registry.hpp"
#include "dattn/threads.hpp"
#include "dattn/video_sparse.hpp"

namespace dattn::cli {

namespace {

using i64 = std::int64_t;

// `view` as [B, S, H, E]: BSHD as it is, THD with a batch dim of 1 in front.
TensorView as_bshd(const TensorView& view, QkvLayout layout) {
  if (layout != QkvLayout::THD) return view;
  return view.unsqueezed(0);
}

// Up to `count` of the rows [0, rows), spread evenly, the first and the last included.
// Example: rows 333, count 4 -> 0, 111, 221, 332.
std::vector<std::int32_t> sample_rows(i64 rows, i64 count) {
  std::vector<std::int32_t> sample;
  if (rows <= 0 || count <= 0) return sample;
  if (count >= rows || count == 1) {
    for (i64 i = 0; i < std::min(rows, count); ++i) sample.push_back(static_cast<std::int32_t>(i));
    return sample;
  }
  for (i64 n = 0; n < count; ++n)
    sample.push_back(static_cast<std::int32_t>((n * (rows - 1) + (count - 1) / 2) / (count - 1)));
  sample.erase(std::unique(sample.begin(), sample.end()), sample.end());
  return sample;
}

// Recomputes `rows` with REFERENCE and compares them with `out` (every batch item and head).
RowCheck check_against_reference(const Workload& workload, DType dtype, KvCacheDtype kv,
                                 const WorkloadInputs& inputs, const TensorView& out, i64 rows) {
  const std::vector<std::int32_t> sample = sample_rows(workload.output_rows(), rows);
  Tensor rows_tensor = Tensor::empty({i64(sample.size())}, DType::I32);
  std::copy(sample.begin(), sample.end(), rows_tensor.data_as<std::int32_t>());

  AttentionConfig config = workload_attention_config(workload, dtype);
  config.backend = "REFERENCE";
  config.kv_cache_dtype = kv;  // the same quantized K/V, so that the check sees the kernel
  const Attention reference(config);
  AttentionMetadata metadata = inputs.metadata;
  metadata.extra.backend["reference_rows"] = rows_tensor.view();
  const Tensor expected = Tensor::zeros(out.shape(), DType::F32);
  reference.forward_into(inputs.q, inputs.k, inputs.v, metadata, expected.view());

  const TensorView got = as_bshd(out, workload.layout());
  const TensorView want = as_bshd(expected.view(), workload.layout());
  double max_abs = 0, max_ref = 0;
  for (i64 b = 0; b < got.size(0); ++b)
    for (const std::int32_t row : sample)
      for (i64 h = 0; h < got.size(2); ++h)
        for (i64 e = 0; e < got.size(3); ++e) {
          const std::array<i64, 4> index{b, row, h, e};
          const double x = load_as_f32(got.element_ptr(index), got.dtype(), 0);
          const double y = load_as_f32(want.element_ptr(index), want.dtype(), 0);
          const double diff = std::fabs(x - y);
          max_abs =
              std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::max(max_abs, diff);
          max_ref = std::max(max_ref, std::fabs(y));
        }
  RowCheck check;
  check.rows = i64(sample.size());
  check.max_abs_err = max_abs;
  check.max_rel_err = max_ref > 0 ? max_abs / max_ref : max_abs;
  return check;
}

// Output buffer of `workload`: BSHD [B, J + Sq, Hq, D], THD [T, Hq, D].
Tensor output_buffer(const Workload& w, DType dtype) {
  if (w.layout() == QkvLayout::THD)
    return Tensor::zeros({w.query_rows, w.heads, w.head_size}, dtype);
  return Tensor::zeros({w.batch, w.output_rows(), w.heads, w.head_size}, dtype);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// f64 attention of sampled rows under the block map of `s`, compared with `out`.
RowCheck masked_reference_check(const Workload& w, const WorkloadInputs& in, const TensorView& out,
                                const VideoSparseSelection& s, double scale, i64 rows) {
  const std::vector<std::int32_t> sample = sample_rows(w.output_rows(), rows);
  const TensorView q = as_bshd(in.q.view(), w.layout()), k = as_bshd(in.k.view(), w.layout()),
                   v = as_bshd(in.v.view(), w.layout()), got = as_bshd(out, w.layout());
  const VideoTiling& qt = s.tiling.queries;
  const VideoTiling& kt = s.tiling.keys;
  std::vector<i64> block_of(std::size_t(qt.used_len()));
  for (std::size_t n = 0; n < qt.blocks().size(); ++n)
    for (i64 p = qt.blocks()[n].begin; p < qt.blocks()[n].end; ++p)
      block_of[std::size_t(p)] = i64(n);
  const bool masked = w.mask == WorkloadMask::key_padding;
  const bool self = w.role == AttentionRole::self && w.query_rows == w.key_rows;
  const auto kept = [&](i64 b, i64 j) {
    return !masked || in.attn_mask.data_as<std::uint8_t>()[b * w.key_rows + j] != 0;
  };
  const i64 group = w.heads / w.kv_heads, d = w.head_size;
  const auto at = [](const TensorView& t, i64 b, i64 r, i64 h, i64 e) {
    const std::array<i64, 4> index{b, r, h, e};
    return double(load_as_f32(t.element_ptr(index), t.dtype(), 0));
  };
  double max_abs = 0, max_ref = 0;
  std::vector<double> logit, want(static_cast<std::size_t>(d));
  std::vector<i64> keys;
  for (i64 b = 0; b < got.size(0); ++b)
    for (const std::int32_t row : sample)
      for (i64 h = 0; h < w.heads; ++h) {
        std::fill(want.begin(), want.end(), 0.0);
        const i64 pos = qt.position()[std::size_t(row)];
        keys.clear();
        if (pos < qt.used_len() && (!self || kept(b, row)))
          for (std::int32_t kb : s.map.selected(b, h, block_of[std::size_t(pos)]))
            for (i64 p = kt.blocks()[std::size_t(kb)].begin; p < kt.blocks()[std::size_t(kb)].end;
                 ++p)
              if (kept(b, kt.order()[std::size_t(p)])) keys.push_back(kt.order()[std::size_t(p)]);
        if (!keys.empty()) {
          logit.assign(keys.size(), 0.0);
          double mx = -std::numeric_limits<double>::infinity(), sum = 0;
          for (std::size_t n = 0; n < keys.size(); ++n) {
            for (i64 e = 0; e < d; ++e)
              logit[n] += at(q, b, row, h, e) * at(k, b, keys[n], h / group, e);
            logit[n] *= scale;
            mx = std::max(mx, logit[n]);
          }
          for (std::size_t n = 0; n < keys.size(); ++n) {
            const double p = std::exp(logit[n] - mx);
            sum += p;
            for (i64 e = 0; e < d; ++e) want[std::size_t(e)] += p * at(v, b, keys[n], h / group, e);
          }
          for (double& x : want) x /= sum;
        }
        for (i64 e = 0; e < d; ++e) {
          const double diff = std::fabs(at(got, b, row, h, e) - want[std::size_t(e)]);
          max_abs =
              std::isnan(diff) ? std::numeric_limits<double>::infinity() : std::max(max_abs, diff);
          max_ref = std::max(max_ref, std::fabs(want[std::size_t(e)]));
        }
      }
  RowCheck check;
  check.rows = i64(sample.size());
  check.max_abs_err = max_abs;
  check.max_rel_err = max_ref > 0 ? max_abs / max_ref : max_abs;
  return check;
}

// The sparse backend's report: its block sparsity (and the flops it computes), the error of
// sampled rows against REFERENCE under its block mask, the normwise error of the whole output
// against dense attention (FLASH), and the picture of its block map.
void sparse_report(const Measurement& m, const AttentionConfig& config, const WorkloadInputs& in,
                   const TensorView& out, RunReport& report) {
  const Workload& w = m.workload;
  const AttentionInputs call{in.q.view(), in.k.view(), in.v.view(), &in.metadata, out, {}};
  const auto start = std::chrono::steady_clock::now();
  const VideoSparseSelection s = video_sparse_selection(config, call);
  report.selection_seconds = seconds_since(start);
  const double sparsity = s.map.sparsity(s.tiling.queries, s.tiling.keys);
  report.block_sparsity = sparsity;
  report.flops = 4.0 * double(w.head_size) * (1.0 - sparsity) *
                 double(s.tiling.queries.used_len()) * double(s.tiling.keys.used_len()) *
                 double(w.heads * w.batch);
  const double scale = 1.0 / std::sqrt(double(w.head_size));
  if (m.check_rows > 0 && w.joint_rows == 0) {
    report.check = masked_reference_check(w, in, out, s, scale, m.check_rows);
    report.checked_against = "REFERENCE under the block mask";
  } else if (w.joint_rows > 0) {
    report.checked_against = "none (joint rows)";
  }
  if (!m.mask_png.empty()) write_block_map_png(m.mask_png, s.map, s.tiling, 0, 0);
  if (m.check_rows == 0) return;  // no accuracy checks at all
  AttentionConfig dense = config;
  dense.backend = "FLASH";
  dense.backend_options.clear();
  const Tensor want = Tensor::zeros(out.shape(), out.dtype());
  Attention(dense).forward_into(in.q.view(), in.k.view(), in.v.view(), in.metadata, want.view());
  report.dense_rel_err = normwise_rel_err(out, want.view());
}

}  // namespace

void print_workloads(std::ostream& os) {
  std::size_t width = 0;
  for (const Workload& w : workloads()) width = std::max(width, w.name.size());
  for (const Workload& w : workloads())
    os << "  " << w.name << std::string(width - w.name.size() + 2, ' ') << w.description << '\n';
}

void add_measure_options(CLI::App& command, MeasureOptions& options) {
  command
      .add_option("--threads,-t", options.threads,
                  "OpenMP threads, 1 to " + std::to_string(kMaxThreads) + " (default: OpenMP's)")
      ->check(count_in(1, kMaxThreads));
  command
      .add_option("--heads", options.heads,
                  "Override the query head count (KV heads keep the GQA ratio)")
      ->check(count_in(1, 4096));
  command
      .add_option("--check-rows", options.check_rows,
                  "Query rows recomputed with REFERENCE to measure the error (0 = no check; for a "
                  "sparse backend also no comparison with dense attention)")
      ->check(count_in(0, std::numeric_limits<std::int32_t>::max()))
      ->capture_default_str();
  command.add_option("--seed", options.seed, "Seed of the random inputs")->capture_default_str();
  command
      .add_option("--signal", options.signal,
                  "Input values: random (N(0, 1)) or smooth (a smooth signal over the video grid, "
                  "where attention is local)")
      ->check(CLI::IsMember({"random", "smooth"}))
      ->capture_default_str();
  auto* sparsity =
      command
          .add_option(
              "--sparsity", options.sparsity,
              "VIDEO_SPARSE top-k: fraction of the video key blocks skipped (default 0.875)")
          ->check(CLI::Range(0.0, 0.999999));
  auto* topk = command
                   .add_option("--topk", options.topk,
                               "VIDEO_SPARSE top-k: video key blocks kept per query block")
                   ->check(count_in(1, std::numeric_limits<std::int32_t>::max()));
  command
      .add_option("--window", options.window,
                  "VIDEO_SPARSE sliding tile selection: window wt,wh,ww in tiles")
      ->excludes(sparsity)
      ->excludes(topk);
  command.add_option("--tile", options.tile, "VIDEO_SPARSE tile t,h,w (default 4,4,4)");
  command
      .add_option("--kv-dtype", options.kv_dtype,
                  "Quantized K/V: fp8 or int8 (dense calls: kv_cache_dtype; with --paged: the "
                  "pages); reports the cache's bytes and the error against f32 K/V")
      ->check(CLI::IsMember({"fp8", "int8"}));
  command
      .add_option("--paged", options.paged,
                  "Run the workload through forward_paged with pages of this many tokens "
                  "(shuffled block tables)")
      ->check(count_in(1, 1 << 20));
  command
      .add_option("--page-dtype", options.page_dtype,
                  "Dtype of the pages with --paged (default: the inputs'; --kv-dtype overrides)")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  command
      .add_option("--compute-dtype", options.compute_dtype,
                  "FLASH / VIDEO_SPARSE backend option compute_dtype: f32 (exact to the inputs, "
                  "the default), bf16 (f32/f16 inputs may then run on a bf16 engine) or int16 "
                  "(the 16-bit integer-lane engines: avx2_int16, avx_vnni_int16, "
                  "avx512_vnni_int16)")
      ->check(CLI::IsMember({"f32", "bf16", "int16"}));
  command
      .add_option("--pv-dtype", options.pv_dtype,
                  "SAGE backend option pv_dtype: auto (the default: int16 on avx512_vnni, "
                  "avx_vnni and avx2_int8, bf16 tiles on amx_int8, f32 on portable_int8 and the "
                  "AArch64 engines), bf16, "
                  "f32, int16 (12- and 13-bit codes in "
                  "16-bit integer lanes: more accurate than bf16), or int8 (P and V as 8-bit "
                  "codes: fastest, least accurate); an error with the other backends")
      ->check(CLI::IsMember({"auto", "bf16", "f32", "int16", "int8"}));
  std::string engines;
  for (const EngineInfo& e : flash_engines()) engines += (engines.empty() ? "" : ", ") + e.name;
  command
      .add_option("--isa", options.isa,
                  "FLASH / VIDEO_SPARSE / SAGE backend option isa: cap the engines at this one (an "
                  "emulated engine by its exact name): " +
                      engines)
      ->check(CLI::Validator(
          [engines](std::string& name) -> std::string {
            for (const EngineInfo& e : flash_engines())
              if (names_equal(name, e.name)) return {};
            return "'" + name + "' is not a FLASH engine; valid: " + engines;
          },
          "ENGINE"));
  command.add_flag("--fallback", options.fallback,
                   "Run a call the chosen backend cannot serve on the best exact backend that can "
                   "(reported), instead of failing");
}

std::optional<Workload> workload_or_report(const std::string& name, const MeasureOptions& options) {
  const Workload* found = find_workload(name);
  if (found == nullptr) {
    std::cerr << "error: unknown workload '" << Error::bounded(name, 80) << "'; valid workloads:\n";
    print_workloads(std::cerr);
    return std::nullopt;
  }
  return options.heads > 0 ? with_heads(*found, options.heads) : *found;
}

Measurement measurement_for(const Workload& workload, const MeasureOptions& options) {
  Measurement m;
  m.workload = workload;
  m.threads = options.threads;
  m.check_rows = options.check_rows;
  m.seed = options.seed;
  m.smooth_signal = options.signal == "smooth";
  m.allow_fallback = options.fallback;
  if (!options.window.empty()) {
    m.flag_options["selection"] = std::string("sliding_tile");
    m.flag_options["window"] = options.window;
  }
  if (options.topk) m.flag_options["topk"] = *options.topk;
  if (options.sparsity) m.flag_options["sparsity"] = *options.sparsity;
  if (!options.tile.empty()) m.flag_options["tile"] = options.tile;
  if (!options.kv_dtype.empty()) m.kv_dtype = parse_kv_cache_dtype(options.kv_dtype);
  m.page_block = options.paged;
  if (!options.page_dtype.empty()) m.page_dtype = parse_dtype(options.page_dtype);
  if (!options.compute_dtype.empty()) m.flag_options["compute_dtype"] = options.compute_dtype;
  if (!options.isa.empty()) m.flag_options["isa"] = options.isa;
  if (!options.pv_dtype.empty()) m.flag_options["pv_dtype"] = options.pv_dtype;
  return m;
}

namespace {
std::string trimmed(const std::string& s) {
  const std::size_t first = s.find_first_not_of(" \t");
  if (first == std::string::npos) return {};
  return s.substr(first, s.find_last_not_of(" \t") - first + 1);
}
}  // namespace

BackendSpec parse_backend_spec(const std::string& spec) {
  BackendSpec out;
  const std::size_t colon = spec.find(':');
  out.name = trimmed(spec.substr(0, colon));
  if (colon == std::string::npos) return out;
  out.options = trimmed(spec.substr(colon + 1));
  if (out.options.empty()) return out;
  std::size_t at = colon + 1;
  while (at <= spec.size()) {
    const std::size_t end = std::min(spec.find(',', at), spec.size());
    const std::string item = spec.substr(at, end - at);
    const std::size_t eq = item.find('=');
    const std::string key = trimmed(item.substr(0, eq));
    if (eq == std::string::npos || key.empty())
      throw InvalidArgument("backend", "--backend " + spec + ": '" + item +
                                           "' is not key=value; valid: NAME or "
                                           "NAME:key=value,key=value");
    out.parsed[key] = parse_option_value(item.substr(eq + 1));
    at = end + 1;
  }
  return out;
}

BackendOptions engine_options(const Measurement& m) {
  BackendOptions out;
  for (const BackendOptions* from : {&m.backend_options, &m.flag_options})
    for (const char* key : {"isa", "compute_dtype"})
      if (const auto it = from->find(key); it != from->end()) out.insert(*it);
  return out;
}

std::shared_ptr<const Backend> resolve_backend(const std::string& backend,
                                               const AttentionConfig& config) {
  BackendRequest r;
  r.platform = config.platform;
  r.head_size = config.head_size;
  r.dtype = config.dtype;
  r.kv_cache_dtype = config.kv_cache_dtype;
  std::optional<std::string_view> name;
  if (!backend.empty() && !names_equal(backend, "auto")) name = backend;
  return Registry::global().select(r, name, nullptr).backend;
}

BackendOptions layer_options(const Measurement& m, const Backend& backend) {
  BackendOptions out = m.backend_options;
  const std::optional<std::vector<std::string>> names = backend.option_names();
  for (const auto& [key, value] : m.flag_options)
    if (!names || std::find(names->begin(), names->end(), key) != names->end())
      out.emplace(key, value);  // an explicit NAME:key=value wins
  return out;
}

void check_flag_options(const Measurement& m, const std::vector<std::string>& backends) {
  const AttentionConfig config = workload_attention_config(m.workload, m.dtype);
  std::vector<std::shared_ptr<const Backend>> chosen;
  for (const std::string& b : backends) chosen.push_back(resolve_backend(b, config));
  for (const auto& [key, value] : m.flag_options) {
    if (key == "isa" || key == "compute_dtype") continue;  // check_engine_options says more
    bool taken = false;
    std::string names;
    for (const auto& b : chosen) {
      const std::optional<std::vector<std::string>> keys = b->option_names();
      taken = taken || !keys || std::find(keys->begin(), keys->end(), key) != keys->end();
      names += (names.empty() ? "" : ", ") + b->name();
    }
    if (taken) continue;
    const std::string flag = key == "selection" || key == "window" ? "--window"
                             : key == "pv_dtype"                   ? "--pv-dtype"
                                                                   : "--" + key;
    std::string takers;
    for (const auto& b : Registry::global().all()) {
      const std::optional<std::vector<std::string>> keys = b->option_names();
      if (keys && std::find(keys->begin(), keys->end(), key) != keys->end())
        takers += (takers.empty() ? "" : ", ") + b->name();
    }
    throw InvalidArgument(
        key, flag + " is an option of " + (takers.empty() ? std::string("no backend") : takers) +
                 "; the chosen backend" + (chosen.size() > 1 ? "s (" : " (") + names + ") do" +
                 (chosen.size() > 1 ? "" : "es") + " not take it");
  }
  // The flags that shape the measurement itself: every chosen backend must serve them (bench
  // runs each combination with them).
  const auto refuse = [&](const std::string& field, const std::string& flag,
                          const std::string& what, const Backend& b, auto serves) {
    std::string takers;
    for (const auto& other : Registry::global().all())
      if (serves(*other)) takers += (takers.empty() ? "" : ", ") + other->name();
    throw InvalidArgument(field, flag + " " + what + "; backend " + b.name() +
                                     " does not (backends that do: " +
                                     (takers.empty() ? std::string("none") : takers) + ")");
  };
  for (const auto& b : chosen) {
    if (!m.mask_png.empty() && !names_equal(b->name(), "VIDEO_SPARSE"))
      refuse("mask_png", "--mask-png", "writes a block-sparse backend's block map", *b,
             [](const Backend& x) { return names_equal(x.name(), "VIDEO_SPARSE"); });
    if (m.page_block > 0 && !b->supports_paged_kv())
      refuse("paged", "--paged", "runs the workload through paged KV", *b,
             [](const Backend& x) { return x.supports_paged_kv(); });
    const KvCacheDtype kv = m.kv_dtype;
    if (m.page_block == 0 && kv != KvCacheDtype::unquantized &&
        !b->supports_kv_cache_dtype(kv, Platform::cpu))
      refuse("kv_dtype", "--kv-dtype", "quantizes K and V", *b,
             [kv](const Backend& x) { return x.supports_kv_cache_dtype(kv, Platform::cpu); });
  }
  if (m.page_dtype && m.page_block == 0)
    throw InvalidArgument("page_dtype",
                          "--page-dtype sets the dtype of the pages of --paged; without --paged "
                          "there are none");
}

void check_engine_options(const Measurement& m, const std::string& backend) {
  const BackendOptions engine = engine_options(m);
  if (engine.empty()) return;
  const bool isa = engine.count("isa") != 0;
  const std::string option = isa ? "--isa" : "--compute-dtype";
  const bool sage = names_equal(backend, "SAGE");
  if (sage && !isa)
    throw InvalidArgument("compute_dtype",
                          "--compute-dtype applies to FLASH and VIDEO_SPARSE; SAGE computes Q.K^T "
                          "in int8 and P.V as its backend option pv_dtype says");
  if (!backend.empty() && !names_equal(backend, "auto") && !names_equal(backend, "FLASH") &&
      !names_equal(backend, "VIDEO_SPARSE") && !sage)
    throw InvalidArgument(isa ? "isa" : "compute_dtype",
                          option +
                              " applies to FLASH's engines (run by FLASH, VIDEO_SPARSE and SAGE); "
                              "backend " +
                              backend + " has none");
  if (const auto it = engine.find("isa"); it != engine.end())
    for (const EngineInfo& e : flash_engines())
      if (names_equal(std::get<std::string>(it->second), e.name) && e.unavailable_reason)
        throw NotAvailable("isa", "--isa " + e.name + ": this CPU cannot run engine " + e.name +
                                      ": " + *e.unavailable_reason);
}

void fill_run(RunReport& report, const Measurement& m, const Backend& ran, const Attention& layer,
              int threads, double seconds) {
  const Workload& w = m.workload;
  report.backend = ran.name();
  report.selection = layer.selection().source;
  report.workload = w.name;
  report.layout = std::string(qkv_layout_name(w.layout()));
  report.dtype = std::string(dtype_name(m.dtype));
  report.threads = threads;
  report.seed = m.seed;
  report.reps = std::max(m.reps, 1);
  report.shape = {w.batch,    w.query_rows, w.key_rows,  w.heads,
                  w.kv_heads, w.head_size,  w.joint_rows};
  report.seconds = seconds;
  report.gflops = report.flops / seconds * 1e-9;
}

std::string peak_kind_of_engine(const std::string& engine) {
  for (const EngineInfo& e : flash_engines()) {
    if (e.name != engine) continue;
    if (e.emulated) return {};
    if (e.compute_dtype == "f32") return "f32_fma";
    if (e.name == "avx512_bf16" || e.name == "neon_bf16") return "bf16_dot";
    if (e.name == "amx") return "amx_bf16";
    if (e.name == "amx_int8") return "amx_int8";
    if (e.compute_dtype == "int8") return "int8_dot";    // SAGE's: Q.K^T's rate (P.V runs below it)
    if (e.compute_dtype == "int16") return "int16_dot";  // the 16-bit integer lanes
    return {};                                           // an engine whose peak is not measured
  }
  return {};
}

std::optional<double> peak_of_kind(const PeakGflops& peak, const std::string& kind) {
  if (kind == "f32_fma") return peak.f32_fma;
  if (kind == "bf16_dot") return peak.bf16_dot;
  if (kind == "amx_bf16") return peak.amx_bf16;
  if (kind == "int8_dot") return peak.int8_dot;
  if (kind == "int16_dot") return peak.int16_dot;
  if (kind == "amx_int8") return peak.amx_int8;
  return std::nullopt;
}

void fill_peak(RunReport& report, const std::string& engine, int threads) {
  report.engine = engine;
  report.peak_kind = peak_kind_of_engine(engine);
  report.peak_gflops.reset();
  report.efficiency.reset();
  report.no_peak.clear();
  if (engine.empty()) {
    report.no_peak = "backend " + report.backend + " has no engines";
    return;
  }
  if (report.peak_kind.empty()) {
    bool emulated = false;
    for (const EngineInfo& e : flash_engines()) emulated |= e.name == engine && e.emulated;
    report.no_peak = emulated ? "engine " + engine + " is emulated: its speed is not the hardware's"
                              : "no measured peak for engine " + engine;
    return;
  }
  // Measured only when a peak is wanted (REFERENCE and emulated runs skip it).
  const std::optional<double> peak = peak_of_kind(measure_peak_gflops(threads), report.peak_kind);
  if (!peak || !(*peak > 0)) {
    report.no_peak = "the " + report.peak_kind + " peak of engine " + engine + " was not measured";
    report.peak_kind.clear();
    return;
  }
  report.peak_gflops = *peak;
  report.efficiency = report.gflops / *peak;
}

double normwise_rel_err(const TensorView& a, const TensorView& b) {
  double num = 0, den = 0;
  for (i64 n = 0; n < b.numel(); ++n) {
    const double x = load_as_f32(a.data(), a.dtype(), n);
    const double y = load_as_f32(b.data(), b.dtype(), n);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

RunReport measure(const Measurement& m) {
  if (m.workload.prefix_rows > 0) return measure_prefix_reuse(m);
  if (m.page_block > 0) return measure_paged(m);
  const Workload& workload = m.workload;
  const auto progress = [&m](const std::string& message) {
    if (m.progress) std::cerr << m.progress_prefix << message << std::endl;
  };
  if (m.threads > 0) omp_set_num_threads(m.threads);
  const int threads = default_threads();

  AttentionConfig config = workload_attention_config(workload, m.dtype);
  config.backend = m.backend;
  config.allow_fallback = m.allow_fallback;
  config.kv_cache_dtype = m.kv_dtype;
  config.backend_options = layer_options(m, *resolve_backend(m.backend, config));
  const Attention layer(config);
  check_engine_options(m, layer.backend().name());

  progress("building inputs of " + workload.name + "...");
  WorkloadInputs inputs = build_workload_inputs(workload, m.dtype, m.seed);
  if (m.smooth_signal) fill_smooth_video_signal(inputs, workload, m.seed);
  const Tensor out = output_buffer(workload, m.dtype);

  progress("warm-up on " + layer.backend().name() + "...");
  const Backend& ran =
      layer.forward_into(inputs.q, inputs.k, inputs.v, inputs.metadata, out.view());
  progress("timing " + std::to_string(m.reps) + " run(s)...");
  double seconds = std::numeric_limits<double>::infinity();
  for (int rep = 0; rep < std::max(m.reps, 1); ++rep) {
    const auto start = std::chrono::steady_clock::now();
    layer.forward_into(inputs.q, inputs.k, inputs.v, inputs.metadata, out.view());
    seconds = std::min(seconds, seconds_since(start));
  }
  const std::string engine = layer.last_engine();

  RunReport report;
  report.signal = m.smooth_signal ? "smooth" : "random";
  report.flops = attention_flops(workload);
  report.dense_flops = report.flops;
  if (names_equal(ran.name(), "VIDEO_SPARSE")) {
    progress("checking the sparse result against its block mask and dense attention...");
    sparse_report(m, config, inputs, out.view(), report);
  } else if (m.check_rows > 0) {
    progress("checking " + std::to_string(std::min(m.check_rows, workload.output_rows())) +
             " rows against REFERENCE...");
    report.check =
        check_against_reference(workload, m.dtype, m.kv_dtype, inputs, out.view(), m.check_rows);
    if (!ran.exact()) {  // SAGE: approximate dense attention, also against FLASH's whole output
      progress("comparing the whole output with FLASH...");
      AttentionConfig dense = config;
      dense.backend = "FLASH";
      dense.backend_options.clear();
      const Tensor want = output_buffer(workload, m.dtype);
      Attention(dense).forward_into(inputs.q, inputs.k, inputs.v, inputs.metadata, want.view());
      report.dense_rel_err = normwise_rel_err(out.view(), want.view());
    }
  }

  if (m.kv_dtype != KvCacheDtype::unquantized) {
    report.kv_dtype = std::string(kv_cache_dtype_name(m.kv_dtype));
    // Codes of one byte, one f32 scale per (batch, 64-token block, head), K and V.
    const auto part = [&](i64 rows, i64 heads) {
      return double(workload.batch) *
             (double(rows * heads * workload.head_size) + 4.0 * double((rows + 63) / 64 * heads));
    };
    const i64 keys = workload.key_rows;
    report.kv_cache_bytes =
        2.0 * (part(keys, workload.kv_heads) + part(workload.joint_rows, workload.kv_heads));
    report.kv_f32_bytes =
        2.0 * 4.0 * double(workload.batch) *
        double((keys + workload.joint_rows) * workload.kv_heads * workload.head_size);
    if (m.check_rows > 0) {
      progress("comparing with f32 K/V...");
      AttentionConfig f32 = config;
      f32.kv_cache_dtype = KvCacheDtype::unquantized;
      const Tensor want = output_buffer(workload, m.dtype);
      Attention(f32).forward_into(inputs.q, inputs.k, inputs.v, inputs.metadata, want.view());
      report.kv_rel_err = normwise_rel_err(out.view(), want.view());
    }
  }
  fill_run(report, m, ran, layer, threads, seconds);
  fill_peak(report, engine, threads);
  return report;
}

}  // namespace dattn::cli
