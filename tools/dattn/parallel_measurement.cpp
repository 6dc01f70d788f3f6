// `dattn run --parallel`: one workload over the ranks of MPI_COMM_WORLD. Every rank builds the
// same inputs from the seed, takes its contiguous shard of the rows, and runs the strategy;
// rank 0 reports the slowest rank's time, the group's GFLOP/s, and the error of every row
// against one process running the same inputs.
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <vector>

#include "dattn/attention.hpp"
#include "dattn/errors.hpp"
#include "dattn/parallel.hpp"
#include "measurement.hpp"
#ifdef DATTN_HAVE_MPI
#include "dattn/mpi.hpp"
#endif

namespace dattn::cli {

#ifndef DATTN_HAVE_MPI

std::optional<RunReport> measure_parallel(const Measurement&, const std::string&) {
  throw NotAvailable("parallel",
                     "parallel: this dattn was built without MPI; install "
                     "libopenmpi-dev and openmpi-bin, then rebuild");
}

#else

namespace {

using i64 = std::int64_t;

// `t` sliced to rows [start, start + n) of its sequence dim (1 for BSHD, 0 for THD).
TensorView rows_of(const TensorView& t, QkvLayout layout, i64 start, i64 n) {
  return t.sliced(layout == QkvLayout::THD ? 0 : 1, start, n);
}

// A barrier: a one-byte all-gather.
void barrier(Communicator& comm) {
  std::vector<char> all(static_cast<std::size_t>(comm.size()));
  const char one = 1;
  comm.all_gather(&one, 1, all.data());
}

}  // namespace

std::optional<RunReport> measure_parallel(const Measurement& m, const std::string& parallel) {
  static MpiSession session(nullptr, nullptr);
  const std::shared_ptr<Communicator> world = mpi_world();
  const int P = world->size(), rank = world->rank();
  const Workload& w = m.workload;
  if (m.page_block > 0 || w.prefix_rows > 0)
    throw Unsupported("parallel",
                      "parallel: --parallel runs dense workloads, not --paged or "
                      "prefix-reuse");
  const auto progress = [&](const std::string& message) {
    if (m.progress && rank == 0) std::cerr << m.progress_prefix << message << std::endl;
  };
  if (m.threads > 0) omp_set_num_threads(m.threads);
  const int threads = default_threads();
  const QkvLayout layout = w.layout();

  AttentionConfig config = workload_attention_config(w, m.dtype);
  config.backend = m.backend;
  config.allow_fallback = m.allow_fallback;
  config.kv_cache_dtype = m.kv_dtype;
  config.backend_options = layer_options(m, *resolve_backend(m.backend, config));
  AttentionConfig pconfig = config;
  pconfig.parallel = make_parallel_strategy(parallel, world);
  const Attention layer(pconfig);
  check_engine_options(m, layer.backend().name());

  progress("building inputs of " + w.name + " on " + std::to_string(P) + " ranks...");
  const WorkloadInputs inputs = build_workload_inputs(w, m.dtype, m.seed);
  const auto [q0, qn] = shard_rows(w.query_rows, P, rank);
  const auto [k0, kn] = shard_rows(w.key_rows, P, rank);
  AttentionMetadata meta = inputs.metadata;
  if (meta.attn_mask && meta.attn_mask->ndim() == 2)
    meta.attn_mask = meta.attn_mask->sliced(1, k0, kn);
  const TensorView q = rows_of(inputs.q, layout, q0, qn);
  const TensorView k = rows_of(inputs.k, layout, k0, kn);
  const TensorView v = rows_of(inputs.v, layout, k0, kn);
  const i64 local_rows = w.joint_rows + qn;
  const Tensor out = layout == QkvLayout::THD
                         ? Tensor::zeros({local_rows, w.heads, w.head_size}, m.dtype)
                         : Tensor::zeros({w.batch, local_rows, w.heads, w.head_size}, m.dtype);

  progress("warm-up on " + layer.backend().name() + " (" + parallel + ")...");
  const Backend& ran = layer.forward_into(q, k, v, meta, out.view());
  progress("timing " + std::to_string(std::max(m.reps, 1)) + " run(s)...");
  double seconds = std::numeric_limits<double>::infinity();
  for (int rep = 0; rep < std::max(m.reps, 1); ++rep) {
    barrier(*world);
    const auto start = std::chrono::steady_clock::now();
    layer.forward_into(q, k, v, meta, out.view());
    const double mine =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::vector<double> all(static_cast<std::size_t>(P));
    world->all_gather(&mine, sizeof(double), all.data());
    seconds = std::min(seconds, *std::max_element(all.begin(), all.end()));
  }
  const std::string engine = layer.last_engine();

  // Every rank's local rows to rank 0, which compares them with one process.
  std::optional<RowCheck> check;
  if (m.check_rows > 0) {
    const i64 B = layout == QkvLayout::THD ? 1 : w.batch;
    const bool rear = w.joint_strategy == JointStrategy::rear;
    const i64 joint0 = rear ? 0 : w.joint_rows;
    auto local_part = [&](const TensorView& o, i64 start, i64 n) {
      return rows_of(o, layout, start, n);
    };
    const i64 row_elems = w.heads * w.head_size;
    const Tensor mine = Tensor::empty({B * qn * row_elems}, DType::F32);
    {
      const TensorView src = local_part(out.view(), joint0, qn);
      copy_into(src, TensorView(mine.data(), DType::F32, src.shape()));
    }
    const auto n = std::size_t(P);
    std::vector<std::size_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
    std::size_t total = 0;
    if (rank != 0) sc[0] = mine.nbytes();
    if (rank == 0)
      for (int p = 1; p < P; ++p) {
        rd[std::size_t(p)] = total;
        rc[std::size_t(p)] = std::size_t(B * shard_rows(w.query_rows, P, p).second * row_elems) * 4;
        total += rc[std::size_t(p)];
      }
    std::vector<float> gathered(std::max<std::size_t>(total / 4, 1));
    world->all_to_all_v(mine.data(), sc, sd, gathered.data(), rc, rd);
    if (rank == 0) {
      progress("comparing every row with one process...");
      const Attention single(config);
      const Tensor want =
          Tensor::zeros(out.shape().size() == 3
                            ? std::vector<i64>{w.output_rows(), w.heads, w.head_size}
                            : std::vector<i64>{w.batch, w.output_rows(), w.heads, w.head_size},
                        m.dtype);
      single.forward_into(inputs.q, inputs.k, inputs.v, inputs.metadata, want.view());
      double max_abs = 0, max_ref = 0;
      auto compare = [&](const TensorView& got, const TensorView& ref) {
        const Tensor g = Tensor::copy_of(got, DType::F32), r = Tensor::copy_of(ref, DType::F32);
        for (i64 i = 0; i < g.numel(); ++i) {
          const double d = std::fabs(double(g.data_as<float>()[i]) - r.data_as<float>()[i]);
          max_abs = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(max_abs, d);
          max_ref = std::max(max_ref, double(std::fabs(r.data_as<float>()[i])));
        }
      };
      const i64 want_joint0 = rear ? w.query_rows : 0;
      const i64 got_joint0 = rear ? qn : 0;
      if (w.joint_rows > 0)
        compare(rows_of(out.view(), layout, got_joint0, w.joint_rows),
                rows_of(want.view(), layout, want_joint0, w.joint_rows));
      for (int p = 0; p < P; ++p) {
        const auto [s0, sn] = shard_rows(w.query_rows, P, p);
        const TensorView ref = rows_of(want.view(), layout, joint0 + s0, sn);
        if (p == 0) {
          compare(rows_of(out.view(), layout, joint0, sn), ref);
        } else {
          float* base = gathered.data() + rd[std::size_t(p)] / 4;
          compare(TensorView(base, DType::F32, ref.shape()), ref);
        }
      }
      check = RowCheck{w.output_rows(), max_abs, max_ref > 0 ? max_abs / max_ref : max_abs};
    }
  }
  if (rank != 0) return std::nullopt;

  RunReport report;
  report.flops = attention_flops(w);
  report.dense_flops = report.flops;
  report.check = check;
  report.checked_against = "one process (" + ran.name() + ")";
  fill_run(report, m, ran, layer, threads, seconds);
  report.parallel = pconfig.parallel->name();
  report.ranks = P;
  ParallelTraffic t;
  t.batch = layout == QkvLayout::THD ? 1 : w.batch;
  t.rows = w.query_rows;
  t.joint = w.joint_rows;
  t.heads = w.heads, t.kv_heads = w.kv_heads, t.head_size = t.value_head_size = w.head_size;
  t.q_bytes = t.kv_bytes = t.out_bytes = dtype_size(m.dtype);
  double most = 0;
  for (int p = 0; p < P; ++p) most = std::max(most, double(parallel_bytes_sent(parallel, t, P, p)));
  report.bytes_sent = most;
  fill_peak(report, engine, threads);
  if (report.peak_gflops) {
    *report.peak_gflops *= P;
    report.efficiency = report.gflops / *report.peak_gflops;
  }
  return report;
}

#endif

}  // namespace dattn::cli
