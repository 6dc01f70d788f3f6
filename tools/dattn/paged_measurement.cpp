// The paged forms of `dattn run` / `dattn bench`: a workload's rows through forward_paged with
// shuffled block tables (`--paged BS`), and the prefix-reuse workload (a cached prefix reused by
// every denoising step, against recomputing every row).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>

#include "dattn/attention.hpp"
#include "dattn/errors.hpp"
#include "dattn/page_pool.hpp"
#include "measurement.hpp"

namespace dattn::cli {

namespace {

using i64 = std::int64_t;

double seconds_of(const std::function<void()>& f, int reps) {
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < std::max(reps, 1); ++r) {
    const auto start = std::chrono::steady_clock::now();
    f();
    best = std::min(
        best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

// [B, S, H, E] contiguous as [B * S, H, E].
TensorView as_rows(const Tensor& t) {
  const TensorView v = t.view();
  return TensorView(v.data(), v.dtype(), {v.size(0) * v.size(1), v.size(2), v.size(3)});
}

DType page_dtype_of(const Measurement& m) {
  if (m.kv_dtype == KvCacheDtype::int8) return DType::I8;
  if (m.kv_dtype == KvCacheDtype::fp8) return DType::FP8_E4M3;
  return m.page_dtype.value_or(m.dtype);
}

RunReport base_report(const Measurement& m, const std::string& backend, int threads) {
  const Workload& w = m.workload;
  RunReport r;
  r.backend = backend;
  r.selection = "explicit";
  r.workload = w.name;
  r.layout = "paged";
  r.dtype = std::string(dtype_name(m.dtype));
  r.threads = threads;
  r.seed = m.seed;
  r.reps = std::max(m.reps, 1);
  r.shape = {w.batch, w.query_rows, w.key_rows, w.heads, w.kv_heads, w.head_size, w.joint_rows};
  return r;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw InvalidArgument("workload", what);
}

}  // namespace

RunReport measure_paged(const Measurement& m) {
  const Workload& w = m.workload;
  require(!w.packed() && w.joint_rows == 0 && w.mask == WorkloadMask::none &&
              w.query_rows == w.key_rows && w.prefix_rows == 0,
          "--paged runs self-attention workloads without joint rows, masks or packing (" + w.name +
              " has some)");
  if (m.threads > 0) omp_set_num_threads(m.threads);
  const int threads = default_threads();
  const i64 bs = m.page_block, pages_per_seq = (w.key_rows + bs - 1) / bs;
  PagePoolConfig pc;
  pc.num_blocks = w.batch * pages_per_seq;
  pc.block_size = bs;
  pc.kv_heads = w.kv_heads;
  pc.head_size = w.head_size;
  pc.dtype = page_dtype_of(m);
  PagePool pool(pc);
  std::vector<std::int32_t> ids = pool.allocate(pc.num_blocks);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(static_cast<unsigned>(m.seed)));

  const WorkloadInputs in = build_workload_inputs(w, m.dtype, m.seed);
  Tensor out = Tensor::zeros({w.batch * w.query_rows, w.heads, w.head_size}, m.dtype);
  PagedAttentionCall call;
  call.q = as_rows(in.q);
  call.k_new = as_rows(in.k);
  call.v_new = as_rows(in.v);
  call.out = out.view();
  call.cache = pool.layer(0);
  call.causal = w.causal;
  call.softmax_scale = 1.0 / std::sqrt(double(w.head_size));
  for (i64 b = 0; b < w.batch; ++b)
    call.rows.push_back({w.query_rows, w.key_rows, 0,
                         std::vector<std::int32_t>(ids.begin() + b * pages_per_seq,
                                                   ids.begin() + (b + 1) * pages_per_seq)});
  AttentionConfig config = workload_attention_config(w, m.dtype);
  config.backend = m.backend;
  config.backend_options = engine_options(m);  // the sparse options don't apply to pages
  const Attention layer(config);
  check_engine_options(m, layer.backend().name());
  if (m.progress)
    std::cerr << m.progress_prefix << "paged warm-up on " << layer.backend().name() << "\n";
  layer.forward_paged(call);
  RunReport r = base_report(m, layer.backend().name(), threads);
  r.seconds = seconds_of([&] { layer.forward_paged(call); }, m.reps);
  const std::string engine = layer.last_engine();
  r.flops = attention_flops(w);
  r.gflops = r.flops / r.seconds * 1e-9;
  r.page_block = bs;
  r.page_dtype = std::string(dtype_name(pc.dtype));
  if (m.kv_dtype != KvCacheDtype::unquantized) {
    r.kv_dtype = std::string(kv_cache_dtype_name(m.kv_dtype));
    r.kv_cache_bytes = double(pool.bytes());
    r.kv_f32_bytes = double(pool.bytes() - 2 * std::size_t(pc.num_blocks * pc.kv_heads) * 4) * 4;
  }
  if (m.check_rows > 0) {
    // Against dense attention on the logical sequences with f32 (or the inputs') K/V.
    AttentionConfig dense = config;
    dense.backend = "FLASH";
    Tensor want = Tensor::zeros({w.batch, w.query_rows, w.heads, w.head_size}, m.dtype);
    Attention(dense).forward_into(in.q.view(), in.k.view(), in.v.view(), in.metadata, want.view());
    const double err = normwise_rel_err(out.view(), want.view());
    if (m.kv_dtype != KvCacheDtype::unquantized) r.kv_rel_err = err;
    r.check = RowCheck{w.batch * w.query_rows, 0.0, err};
    r.checked_against = "FLASH dense, normwise over every row";
  }
  fill_peak(r, engine, threads);
  return r;
}

RunReport measure_prefix_reuse(const Measurement& m) {
  const Workload& w = m.workload;
  if (m.threads > 0) omp_set_num_threads(m.threads);
  const int threads = default_threads();
  const i64 prefix = w.prefix_rows, target = w.query_rows - prefix, all = w.query_rows;
  const i64 bs = m.page_block > 0 ? m.page_block : 64;
  PagePoolConfig pc;
  pc.num_blocks = (all + bs - 1) / bs;
  pc.block_size = bs;
  pc.kv_heads = w.kv_heads;
  pc.head_size = w.head_size;
  pc.dtype = page_dtype_of(m);
  PagePool pool(pc);
  PrefixCache cache(pool, prefix, target);

  const WorkloadInputs in = build_workload_inputs(w, m.dtype, m.seed);
  AttentionConfig config = workload_attention_config(w, m.dtype);
  config.backend = m.backend;
  config.backend_options = engine_options(m);
  const Attention layer(config);
  check_engine_options(m, layer.backend().name());
  const auto progress = [&m](const std::string& s) {
    if (m.progress) std::cerr << m.progress_prefix << s << std::endl;
  };

  // Recompute: every row attends every row, each step.
  progress("recomputing all " + std::to_string(all) + " rows...");
  Tensor dense_out = Tensor::zeros({1, all, w.heads, w.head_size}, m.dtype);
  layer.forward_into(in.q.view(), in.k.view(), in.v.view(), {}, dense_out.view());
  const double recompute = seconds_of(
      [&] { layer.forward_into(in.q.view(), in.k.view(), in.v.view(), {}, dense_out.view()); },
      m.reps);

  // Step 0 fills [prefix | target]; later steps rewrite and query the target rows only.
  progress("step 0: filling the paged cache...");
  Tensor out0 = Tensor::zeros({all, w.heads, w.head_size}, m.dtype);
  PagedAttentionCall call;
  call.cache = pool.layer(0);
  call.softmax_scale = 1.0 / std::sqrt(double(w.head_size));
  call.q = as_rows(in.q), call.k_new = as_rows(in.k), call.v_new = as_rows(in.v);
  call.out = out0.view();
  call.rows = {cache.first_step()};
  layer.forward_paged(call);
  Tensor out = Tensor::zeros({target, w.heads, w.head_size}, m.dtype);
  call.q = as_rows(in.q).sliced(0, prefix, target);
  call.k_new = as_rows(in.k).sliced(0, prefix, target);
  call.v_new = as_rows(in.v).sliced(0, prefix, target);
  call.out = out.view();
  call.rows = {cache.next_step()};
  progress("timing denoising steps on the cached prefix...");
  layer.forward_paged(call);
  RunReport r = base_report(m, layer.backend().name(), threads);
  r.seconds = seconds_of([&] { layer.forward_paged(call); }, m.reps);
  const std::string engine = layer.last_engine();  // of the timed steps, not the recompute
  r.recompute_seconds = recompute;
  r.flops = 4.0 * double(w.head_size) * double(target) * double(all) * double(w.heads);
  r.gflops = r.flops / r.seconds * 1e-9;
  r.page_block = bs;
  r.page_dtype = std::string(dtype_name(pc.dtype));
  r.shape.sq = target;
  if (m.check_rows > 0) {
    // The target rows of a step equal the recomputed ones (same inputs).
    const TensorView want = dense_out.view().sliced(1, prefix, target);
    const TensorView got(out.data(), out.dtype(), {1, target, w.heads, w.head_size});
    r.check = RowCheck{target, 0.0, normwise_rel_err(got, Tensor::copy_of(want).view())};
    r.checked_against = "the recomputed rows, normwise";
  }
  fill_peak(r, engine, threads);
  return r;
}

}  // namespace dattn::cli
