#include "backends/reference/reference.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <variant>
#include <vector>

#include "core/kv_quant.hpp"
#include "core/paged_problem.hpp"
#include "core/process_memory.hpp"
#include "dattn/errors.hpp"

namespace dattn {

namespace {

using i64 = std::int64_t;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

class ReferencePlan final : public Plan {
 public:
  using Plan::Plan;
  std::string to_string() const override {
    return "REFERENCE plan: scalar loops, f64 accumulation, one query row at a time";
  }
};

// Reads element (b, s, h, e) of a [B, S, H, E] view as f64.
double at4(const TensorView& t, i64 b, i64 s, i64 h, i64 e) {
  return load_as_f32(t.data(), t.dtype(),
                     b * t.stride(0) + s * t.stride(1) + h * t.stride(2) + e * t.stride(3));
}

// The row loop shared by dense and paged calls. The keys and values of one (batch item, KV
// head) are read once into panels (K transposed, [d][skv], so that a row's logits are one pass
// over channels with the keys in the inner loop; V as rows, [skv][dv]), then every query row of
// that KV head's group is computed against them. Each logit and each output channel is still
// summed in f64 in the natural order (channels for a logit, keys for an output), so the panels
// change the speed, not the arithmetic.
class RowComputer {
 public:
  explicit RowComputer(const AttentionProblem& p) : p_(p), f_(p.laser_input_scale) {
    scale_ = p.softmax_scale * f_ * f_;
    const std::size_t skv = std::size_t(std::max<i64>(p.skv, 0));
    qrow_.resize(std::size_t(p.d));
    logits_.resize(skv);
    acc_.resize(std::size_t(p.dv));
    // The panels are per-call buffers (megabytes at a DiT's lengths): leased from the
    // process's (core/process_memory.hpp), never blocks of the C heap.
    const std::size_t d = std::size_t(std::max<i64>(p.d, 0)),
                      dv = std::size_t(std::max<i64>(p.dv, 0));
    kt_lease_ = detail::ProcessMemory::instance().lease(d * skv * sizeof(float));
    v_lease_ = detail::ProcessMemory::instance().lease(skv * dv * sizeof(float));
    kt_ = kt_lease_.as<float>();
    v_ = v_lease_.as<float>();
  }

  // Reads every key and value row of batch item `b`, KV head `hk` into the panels.
  void load_kv(i64 b, i64 hk) {
    const std::size_t skv = std::size_t(p_.skv);
    for (i64 j = 0; j < p_.skv; ++j) {
      const RowRef kr = p_.k_row(j);
      for (i64 e = 0; e < p_.d; ++e)
        kt_[std::size_t(e) * skv + std::size_t(j)] = float(at4(*kr.view, b, kr.row, hk, e));
      const RowRef vr = p_.v_row(j);
      float* vrow = v_ + std::size_t(j) * std::size_t(p_.dv);
      for (i64 e = 0; e < p_.dv; ++e) vrow[e] = float(at4(*vr.view, b, vr.row, hk, e));
    }
  }

  // Computes query row `i` of batch item `b` for the query heads of KV head `hk` (whose keys
  // and values load_kv read last).
  void compute(i64 b, i64 i, i64 hk) {
    const Segment* seg = find_segment(b, i);
    const bool padded = seg == nullptr || (p_.zero_masked_query_rows && !p_.mask.keeps_key(b, i));
    const i64 group = p_.group_size();
    for (i64 h = hk * group; h < (hk + 1) * group; ++h) {
      if (padded) {
        write(b, i, h, nullptr, 0.0, kNegInf);
        continue;
      }
      head(*seg, b, i, h);
    }
  }

 private:
  const Segment* find_segment(i64 b, i64 i) const {
    const auto it = std::upper_bound(p_.segments.begin(), p_.segments.end(), std::pair{b, i},
                                     [](const std::pair<i64, i64>& key, const Segment& s) {
                                       return key.first < s.batch ||
                                              (key.first == s.batch && key.second < s.q_begin);
                                     });
    if (it == p_.segments.begin()) return nullptr;
    const Segment& s = *(it - 1);
    return (s.batch == b && i >= s.q_begin && i < s.q_end) ? &s : nullptr;
  }

  // Additive bias of (b, h, i, j), or -inf when the mask hides the key.
  double mask_bias(i64 b, i64 h, i64 i, i64 j) const {
    const TensorView& m = p_.mask.view;
    switch (p_.mask.kind) {
      case MaskKind::none:
        return 0.0;
      case MaskKind::keep_keys:
        return p_.mask.keeps_key(b, j) ? 0.0 : kNegInf;
      case MaskKind::keep_dense:
      case MaskKind::additive: {
        const i64 off = b * m.stride(0) + h * m.stride(1) + i * m.stride(2) + j * m.stride(3);
        if (p_.mask.kind == MaskKind::keep_dense)
          return static_cast<const std::uint8_t*>(m.data())[off] != 0 ? 0.0 : kNegInf;
        return load_as_f32(m.data(), m.dtype(), off);
      }
    }
    return 0.0;
  }

  // logits_[j] = sum over channels of q[e] * k[j][e] / f, for keys [j0, j1).
  void dots(i64 j0, i64 j1) {
    const std::size_t skv = std::size_t(p_.skv);
    std::fill(logits_.begin() + j0, logits_.begin() + j1, 0.0);
    for (i64 e = 0; e < p_.d; ++e) {
      const double q = qrow_[std::size_t(e)];
      const float* k = kt_ + std::size_t(e) * skv;
      double* s = logits_.data();
      // Each key's sum is its own lane: vectorising over keys keeps every sum's order.
      if (f_ == 1.0) {
#pragma omp simd
        for (i64 j = j0; j < j1; ++j) s[j] += q * double(k[j]);
      } else {
#pragma omp simd
        for (i64 j = j0; j < j1; ++j) s[j] += q * (double(k[j]) / f_);
      }
    }
  }

  void head(const Segment& seg, i64 b, i64 i, i64 h) {
    const RowRef qr = p_.q_row(i);
    for (i64 e = 0; e < p_.d; ++e) qrow_[std::size_t(e)] = at4(*qr.view, b, qr.row, h, e) / f_;
    const i64 pos_q = seg.q_pos0 + (i - seg.q_begin);
    const i64 limit = p_.key_position_limit(pos_q);
    // Keys at positions >= limit are hidden: the visible ones are a prefix of the segment's.
    const i64 k_end = limit <= seg.k_pos0
                          ? seg.k_begin
                          : seg.k_begin + std::min(seg.k_end - seg.k_begin, limit - seg.k_pos0);
    dots(seg.k_begin, k_end);
    // The row rule of docs/semantics.md: a visible logit that is NaN or +inf (or a dot product
    // that is not finite: Q or K held an inf or NaN) poisons the row, and so does a value that
    // is not finite in a V row it attends; -inf hides a key; no visible key gives zeros.
    double m = kNegInf;
    bool poisoned = false;
    for (i64 j = seg.k_begin; j < seg.k_end; ++j) {
      double& s = logits_[std::size_t(j)];
      if (j >= k_end) {
        s = kNegInf;
        continue;
      }
      const double bias = mask_bias(b, h, i, j);
      if (bias == kNegInf) {
        s = kNegInf;
        continue;
      }
      const double dot = s;
      s = std::isfinite(dot) ? scale_ * dot + bias : std::numeric_limits<double>::quiet_NaN();
      if (std::isnan(s) || s == -kNegInf) poisoned = true;
      if (s > m) m = s;
    }
    if (poisoned) {
      write_nan(b, i, h);
      return;
    }
    if (m == kNegInf) {  // no visible key
      write(b, i, h, nullptr, 0.0, kNegInf);
      return;
    }
    std::fill(acc_.begin(), acc_.end(), 0.0);
    double sum = 0.0;
    for (i64 j = seg.k_begin; j < seg.k_end; ++j) {
      const double s = logits_[std::size_t(j)];
      if (s == kNegInf) continue;
      const double w = std::exp(s - m);
      sum += w;
      const float* v = v_ + std::size_t(j) * std::size_t(p_.dv);
      double* acc = acc_.data();
      if (f_ == 1.0) {
#pragma omp simd
        for (i64 e = 0; e < p_.dv; ++e) acc[e] += w * double(v[e]);
      } else {
#pragma omp simd
        for (i64 e = 0; e < p_.dv; ++e) acc[e] += w * (double(v[e]) / f_);
      }
    }
    for (double x : acc_)
      if (!std::isfinite(x)) {
        write_nan(b, i, h);
        return;
      }
    write(b, i, h, acc_.data(), f_ / sum, m + std::log(sum));
  }

  void write_nan(i64 b, i64 i, i64 h) {
    std::fill(acc_.begin(), acc_.end(), std::numeric_limits<double>::quiet_NaN());
    write(b, i, h, acc_.data(), 1.0, std::numeric_limits<double>::quiet_NaN());
  }

  // Writes out[b, i, h, :] = acc * factor (zeros when acc is null) and the LSE.
  void write(i64 b, i64 i, i64 h, const double* acc, double factor, double lse) {
    const TensorView& o = p_.out;
    const i64 base = b * o.stride(0) + i * o.stride(1) + h * o.stride(2);
    for (i64 e = 0; e < p_.dv; ++e)
      store_from_f32(o.data(), o.dtype(), base + e * o.stride(3),
                     acc ? static_cast<float>(acc[e] * factor) : 0.0f);
    if (p_.lse) {
      const TensorView& l = *p_.lse;
      static_cast<float*>(l.data())[b * l.stride(0) + h * l.stride(1) + i * l.stride(2)] =
          static_cast<float>(lse);
    }
  }

  const AttentionProblem& p_;
  double f_;
  double scale_;
  std::vector<double> qrow_, logits_, acc_;
  detail::ProcessMemory::Lease kt_lease_, v_lease_;
  float* kt_ = nullptr;  // one (batch item, KV head)'s keys [d][skv]
  float* v_ = nullptr;   // and values [skv][dv]
};

// Query rows to compute: all, or the "reference_rows" option.
std::vector<i64> rows_to_compute(const AttentionProblem& p) {
  std::vector<i64> rows;
  if (p.backend_options) {
    if (const auto it = p.backend_options->find("reference_rows"); it != p.backend_options->end()) {
      const TensorView* t = std::get_if<TensorView>(&it->second);
      if (t == nullptr || t->dtype() != DType::I32 || t->ndim() != 1 ||
          t->platform() != Platform::cpu)
        throw InvalidArgument("reference_rows", "reference_rows must be a 1-D i32 cpu tensor");
      for (i64 n = 0; n < t->size(0); ++n) {
        const i64 r = static_cast<const std::int32_t*>(t->data())[n * t->stride(0)];
        if (r < 0 || r >= p.sq)
          throw InvalidArgument("reference_rows", "reference_rows: row " + std::to_string(r) +
                                                      " is outside [0, " + std::to_string(p.sq) +
                                                      ")");
        rows.push_back(r);
      }
      return rows;
    }
  }
  rows.resize(std::size_t(p.sq));
  for (i64 i = 0; i < p.sq; ++i) rows[std::size_t(i)] = i;
  return rows;
}

// K and V through a quantized cache: each part (the caller's rows, the joint rows)
// quantized per (batch, 64-token block, head) and dequantized, as a kernel reading such a
// cache sees them.
TensorView dequantized(const TensorView& t, KvCacheDtype dtype, const char* field,
                       std::vector<Tensor>& keep) {
  Tensor out = Tensor::empty(t.shape(), DType::F32);
  detail::quantize_dequantize_kv(t, dtype, out.view(), field);
  keep.push_back(out);
  return out.view();
}

void compute_problem(const AttentionProblem& problem) {
  const std::vector<i64> rows = rows_to_compute(problem);
  AttentionProblem p = problem;
  std::vector<Tensor> keep;
  if (p.kv_cache_dtype != KvCacheDtype::unquantized) {
    p.k = dequantized(p.k, p.kv_cache_dtype, "key", keep);
    p.v = dequantized(p.v, p.kv_cache_dtype, "value", keep);
    if (p.joint) {
      p.joint->k = dequantized(p.joint->k, p.kv_cache_dtype, "joint_key", keep);
      p.joint->v = dequantized(p.joint->v, p.kv_cache_dtype, "joint_value", keep);
    }
  }
  RowComputer rc(p);
  for (i64 b = 0; b < p.batch; ++b)
    for (i64 hk = 0; hk < p.hkv; ++hk) {
      rc.load_kv(b, hk);
      for (i64 i : rows) rc.compute(b, i, hk);
    }
}

// [T, H, E] rows [t0, t0 + n) as a [1, n, H, E] view.
TensorView rows_as_batch(const TensorView& t, i64 t0, i64 n) {
  return t.sliced(0, t0, n).unsqueezed(0);
}

class ReferenceImpl final : public Impl {
 public:
  using Impl::Impl;

  std::unique_ptr<Plan> plan(const AttentionProblem& problem) const override {
    return std::make_unique<ReferencePlan>(problem.signature);
  }

  void forward_paged(const PagedAttentionCall& call) const override {
    const ImplConfig& c = config();
    validate_paged_call(call, c.num_heads, c.num_kv_heads, c.head_size);
    if (call.q.platform() != Platform::cpu) no_platform(call.q.platform());
    const TensorView& kp = call.cache.k_pages;
    const TensorView& vp = call.cache.v_pages;
    const i64 bs = kp.size(1), hkv = kp.size(2), d = kp.size(3), dv = vp.size(3);
    // 1. write the rows' new K/V into their slots (quantizing into int8/fp8 pages).
    write_paged_kv(call);
    // 2. each row attends keys [0, seq_len) gathered through its table.
    i64 t0 = 0;
    for (const PagedRow& r : call.rows) {
      Tensor kg = Tensor::empty({1, r.seq_len, hkv, d}, DType::F32);
      Tensor vg = Tensor::empty({1, r.seq_len, hkv, dv}, DType::F32);
      for (i64 pos = 0; pos < r.seq_len; ++pos) {
        const i64 slot = paged_slot(r.block_table, bs, pos);
        for (i64 h = 0; h < hkv; ++h) {
          for (i64 e = 0; e < d; ++e)
            kg.data_as<float>()[(pos * hkv + h) * d + e] =
                paged_value(kp, call.cache.k_scales, slot / bs, slot % bs, h, e);
          for (i64 e = 0; e < dv; ++e)
            vg.data_as<float>()[(pos * hkv + h) * dv + e] =
                paged_value(vp, call.cache.v_scales, slot / bs, slot % bs, h, e);
        }
      }
      AttentionProblem p;
      p.batch = 1;
      p.sq = r.query_len;
      p.skv = r.seq_len;
      p.hq = c.num_heads;
      p.hkv = hkv;
      p.d = d;
      p.dv = dv;
      p.q = rows_as_batch(call.q, t0, r.query_len);
      p.k = kg.view();
      p.v = vg.view();
      p.out = rows_as_batch(call.out, t0, r.query_len);
      if (call.lse) p.lse = detail::lse_as_batch(call.lse->sliced(1, t0, r.query_len));
      detail::apply_paged_rules(call, p);
      if (r.query_len > 0)
        p.segments.push_back({0, 0, r.query_len, 0, r.seq_len, r.seq_len - r.query_len, 0});
      RowComputer rc(p);
      for (i64 hk = 0; hk < p.hkv; ++hk) {
        rc.load_kv(0, hk);
        for (i64 i = 0; i < p.sq; ++i) rc.compute(0, i, hk);
      }
      t0 += r.query_len;
    }
  }

 protected:
  void run_cpu(const Plan&, const AttentionProblem& problem) const override {
    compute_problem(problem);
  }
};

// Every flag.
BackendCapabilities reference_capabilities() {
  BackendCapabilities c;
  c.accept_output_buffer = true;
  c.supports_piecewise_spans = true;
  c.supports_paged_kv = true;
  c.supports_prefix_kv_slicing = true;
  c.supports_packed_mask_free = true;
  c.supports_multi_doc_packed_varlen = true;
  c.supports_attention_mask = true;
  c.indexes_kv_by_block_stride = true;
  c.supported_platforms = std::vector<Platform>{Platform::cpu};
  c.kv_cache_dtypes = {{Platform::cpu, {KvCacheDtype::fp8, KvCacheDtype::int8}}};
  return c;
}

class ReferenceBackend final : public Backend {
 public:
  ReferenceBackend() : Backend(reference_capabilities()) {}
  std::string name() const override { return "REFERENCE"; }
  std::string description() const override {
    return "the oracle: plain loops accumulating in f64, every feature; slow on purpose";
  }
  int priority() const override { return 0; }  // automatic choice takes it last
  std::unique_ptr<Impl> make_impl(const ImplConfig& config) const override {
    // REFERENCE has no engines: it ignores DATTN_ISA, but an engine option given to it is an
    // error rather than silently meaningless.
    for (const char* key : {"isa", "compute_dtype"})
      if (config.backend_kwargs.count(key) != 0)
        throw InvalidArgument(key, std::string("backend option ") + key +
                                       ": REFERENCE has no engines (it computes in f64); " + key +
                                       " is an option of FLASH and VIDEO_SPARSE");
    return std::make_unique<ReferenceImpl>(*this, config);
  }
  std::optional<std::vector<std::string>> option_names() const override {
    return std::vector<std::string>{};
  }
};

}  // namespace

std::shared_ptr<const Backend> make_reference_backend() {
  return std::make_shared<ReferenceBackend>();
}

}  // namespace dattn
