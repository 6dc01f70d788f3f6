#include "core/prepare_call.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>

#include "dattn/errors.hpp"

namespace dattn::detail {

namespace {

using i64 = std::int64_t;

std::string shape_str(std::span<const i64> s) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

[[noreturn]] void invalid(const std::string& field, const std::string& msg) {
  throw InvalidArgument(field, field + ": " + msg);
}

// Size-1 dims get stride 0 so broadcasting never reads past them.
TensorView broadcastable(TensorView t) {
  std::array<i64, TensorView::kMaxDims> shape{}, strides{};
  for (int i = 0; i < t.ndim(); ++i) {
    shape[std::size_t(i)] = t.size(i);
    strides[std::size_t(i)] = t.size(i) == 1 ? 0 : t.stride(i);
  }
  return TensorView(t.data(), t.dtype(), std::span<const i64>(shape.data(), std::size_t(t.ndim())),
                    std::span<const i64>(strides.data(), std::size_t(t.ndim())), t.platform());
}

void require_float(const TensorView& t, const std::string& field) {
  if (!is_float_input_dtype(t.dtype()))
    invalid(field, "dtype " + std::string(dtype_name(t.dtype())) +
                       " is not supported; valid: f32, bf16, f16");
}

void require_host(const TensorView& t, const std::string& field) {
  if (t.platform() != Platform::cpu)
    throw Unsupported(field, field + ": must be a host (cpu) tensor to be read here, got " +
                                 std::string(platform_name(t.platform())));
}

// Reads a 1-D int32 tensor (cu_seqlens) after checking it.
std::vector<i64> read_int32_vector(const TensorView& t, const std::string& field) {
  if (t.dtype() != DType::I32)
    invalid(field, "dtype " + std::string(dtype_name(t.dtype())) + " is not valid; valid: i32");
  if (t.ndim() != 1) invalid(field, "expected a 1-D tensor, got " + t.describe());
  require_host(t, field);
  std::vector<i64> out(std::size_t(t.size(0)));
  const auto* p = static_cast<const std::int32_t*>(t.data());
  for (i64 i = 0; i < t.size(0); ++i) out[std::size_t(i)] = p[i * t.stride(0)];
  return out;
}

std::string vec_str(const std::vector<i64>& v) {
  return shape_str(std::span<const i64>(v.data(), v.size()));
}

// Checks cu_seqlens against the packed length; returns the largest document length.
i64 check_cu_seqlens(const std::vector<i64>& cu, i64 total, const std::string& field) {
  if (cu.empty()) invalid(field, "needs at least one entry ([0]); got none");
  if (cu.front() != 0) invalid(field, "must start at 0, got " + vec_str(cu));
  i64 longest = 0;
  for (std::size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1])
      invalid(field, "must be non-decreasing, but entry " + std::to_string(i) + " (" +
                         std::to_string(cu[i]) + ") < entry " + std::to_string(i - 1) + " (" +
                         std::to_string(cu[i - 1]) + ") in " + vec_str(cu));
    longest = std::max(longest, cu[i] - cu[i - 1]);
  }
  if (cu.back() != total)
    invalid(field, "last entry " + std::to_string(cu.back()) + " must equal the packed length " +
                       std::to_string(total) + (cu.back() > total ? " (past the end)" : ""));
  return longest;
}

std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

std::uint64_t view_signature(std::uint64_t h, const TensorView& t) {
  h = mix(h, std::uint64_t(t.dtype()));
  h = mix(h, std::uint64_t(t.ndim()));
  for (int i = 0; i < t.ndim(); ++i) {
    h = mix(h, std::uint64_t(t.size(i)));
    h = mix(h, std::uint64_t(t.stride(i)));
  }
  return h;
}

std::uint64_t problem_signature(const AttentionProblem& p) {
  std::uint64_t h = 0x5d1a77e5ULL;
  for (i64 v : {p.batch, p.sq, p.skv, p.hq, p.hkv, p.d, p.dv}) h = mix(h, std::uint64_t(v));
  for (const TensorView* t : {&p.q, &p.k, &p.v, &p.out}) h = view_signature(h, *t);
  h = mix(h, p.joint ? (p.joint->front ? 2 : 1) : 0);
  if (p.joint)
    for (const TensorView* t : {&p.joint->q, &p.joint->k, &p.joint->v}) h = view_signature(h, *t);
  h = mix(h, p.lse ? 1 : 0);
  h = mix(h, std::uint64_t(std::bit_cast<std::uint64_t>(p.softmax_scale)));
  h = mix(h, std::uint64_t(p.position_rule));
  for (const auto& [a, e] : p.full_spans) h = mix(mix(h, std::uint64_t(a)), std::uint64_t(e));
  h = mix(h, std::uint64_t(p.mask.kind));
  if (p.mask.kind != MaskKind::none) h = view_signature(h, p.mask.view);
  h = mix(h, p.zero_masked_query_rows ? 1 : 0);
  for (const Segment& s : p.segments)
    for (i64 v : {s.batch, s.q_begin, s.q_end, s.k_begin, s.k_end, s.q_pos0, s.k_pos0})
      h = mix(h, std::uint64_t(v));
  h = mix(h, std::bit_cast<std::uint64_t>(p.laser_input_scale));
  h = mix(h, std::uint64_t(p.kv_cache_dtype));
  return h;
}

struct JointViews {
  TensorView q, k, v;
  i64 rows = 0;
};

}  // namespace

TensorView unsqueezed(const TensorView& t, int dim) {
  std::array<i64, TensorView::kMaxDims> shape{}, strides{};
  int n = 0;
  for (int i = 0; i <= t.ndim(); ++i) {
    if (i == dim) {
      shape[std::size_t(n)] = 1;
      strides[std::size_t(n)] = 0;
      ++n;
    }
    if (i < t.ndim()) {
      shape[std::size_t(n)] = t.size(i);
      strides[std::size_t(n)] = t.stride(i);
      ++n;
    }
  }
  return TensorView(t.data(), t.dtype(), std::span<const i64>(shape.data(), std::size_t(n)),
                    std::span<const i64>(strides.data(), std::size_t(n)), t.platform());
}

TensorView to_bshd(const TensorView& t, QkvLayout layout, const std::string& field) {
  switch (layout) {
    case QkvLayout::BSHD:
      if (t.ndim() != 4) invalid(field, "expected [B, S, H, D] (BSHD), got " + t.describe());
      return t;
    case QkvLayout::BHSD: {
      if (t.ndim() != 4) invalid(field, "expected [B, H, S, D] (BHSD), got " + t.describe());
      const std::array<int, 4> perm{0, 2, 1, 3};
      return t.permuted(perm);
    }
    case QkvLayout::THD:
      if (t.ndim() != 3) invalid(field, "expected [T, H, D] (THD), got " + t.describe());
      return unsqueezed(t, 0);
  }
  return t;
}

PreparedCall prepare_call(const AttentionConfig& config, double softmax_scale, i64 num_kv_heads,
                          const AttentionInputs& in, const PrepareOptions& options) {
  static const AttentionMetadata kNoMetadata{};
  const AttentionMetadata& meta = in.metadata ? *in.metadata : kNoMetadata;
  const Extra& extra = meta.extra;
  const QkvLayout layout = config.qkv_layout;
  PreparedCall call;
  AttentionProblem& p = call.problem;

  // ---- Q, K, V, out: rank, layout, dtype, platform ----
  const TensorView q = to_bshd(in.q, layout, "query");
  const TensorView k = to_bshd(in.k, layout, "key");
  const TensorView v = to_bshd(in.v, layout, "value");
  require_float(q, "query");
  require_float(k, "key");
  require_float(v, "value");
  for (const auto& [t, name] : {std::pair{&k, "key"}, std::pair{&v, "value"}})
    if (t->platform() != q.platform())
      invalid(name, std::string("lives on ") + std::string(platform_name(t->platform())) +
                        " but query lives on " + std::string(platform_name(q.platform())));

  const i64 batch = q.size(0), sq_local = q.size(1), hq = q.size(2), d = q.size(3);
  const i64 skv_local = k.size(1), hkv = k.size(2), dv = v.size(3);
  if (k.size(0) != batch || v.size(0) != batch)
    invalid("key", "batch " + std::to_string(k.size(0)) + " (value " + std::to_string(v.size(0)) +
                       ") does not match query batch " + std::to_string(batch));
  if (v.size(1) != skv_local)
    invalid("value", "sequence length " + std::to_string(v.size(1)) +
                         " does not match key sequence length " + std::to_string(skv_local));
  if (hq != config.num_heads)
    invalid("query", "has " + std::to_string(hq) + " heads; the layer was built with num_heads = " +
                         std::to_string(config.num_heads));
  if (hkv != num_kv_heads || v.size(2) != hkv)
    invalid("key",
            "has " + std::to_string(hkv) + " heads (value " + std::to_string(v.size(2)) +
                "); the layer was built with num_kv_heads = " + std::to_string(num_kv_heads));
  if (d != config.head_size || k.size(3) != d)
    invalid("query",
            "head size " + std::to_string(d) + " (key " + std::to_string(k.size(3)) +
                ") does not match the layer's head_size = " + std::to_string(config.head_size));
  if (dv <= 0) invalid("value", "head size must be positive, got " + std::to_string(dv));

  // ---- joint tokens (SPEC §4) ----
  const int joint_count = int(meta.joint_query.has_value()) + int(meta.joint_key.has_value()) +
                          int(meta.joint_value.has_value());
  if (joint_count != 0 && joint_count != 3)
    invalid(!meta.joint_query ? "joint_query"
            : !meta.joint_key ? "joint_key"
                              : "joint_value",
            "joint_query, joint_key and joint_value come all three or none; this one is missing");
  JointViews joint;
  if (joint_count == 3) {
    joint.q = to_bshd(*meta.joint_query, layout, "joint_query");
    joint.k = to_bshd(*meta.joint_key, layout, "joint_key");
    joint.v = to_bshd(*meta.joint_value, layout, "joint_value");
    require_float(joint.q, "joint_query");
    require_float(joint.k, "joint_key");
    require_float(joint.v, "joint_value");
    joint.rows = joint.q.size(1);
    const std::array<std::pair<const TensorView*, std::array<i64, 3>>, 3> expect{
        {{&joint.q, {batch, hq, d}}, {&joint.k, {batch, hkv, d}}, {&joint.v, {batch, hkv, dv}}}};
    const std::array<const char*, 3> names{"joint_query", "joint_key", "joint_value"};
    for (std::size_t i = 0; i < 3; ++i) {
      const TensorView& t = *expect[i].first;
      const auto& e = expect[i].second;
      if (t.size(0) != e[0] || t.size(1) != joint.rows || t.size(2) != e[1] || t.size(3) != e[2])
        invalid(names[i], "expected [" + std::to_string(e[0]) + ", " + std::to_string(joint.rows) +
                              ", " + std::to_string(e[1]) + ", " + std::to_string(e[2]) +
                              "] (BSHD order), got " + t.describe());
      if (t.platform() != q.platform())
        invalid(names[i], std::string("lives on ") + std::string(platform_name(t.platform())) +
                              " but query lives on " + std::string(platform_name(q.platform())));
    }
    if (extra.cu_seqlens_q || extra.cu_seqlens_k)
      invalid("joint_query", "joint tokens cannot be combined with packed cu_seqlens");
    if (meta.query_ranges || meta.q_global_start || meta.k_global_start)
      invalid("joint_query", "joint tokens cannot be combined with query_ranges or global starts");
    if (meta.full_attn_spans)
      invalid("joint_query", "joint tokens cannot be combined with full_attn_spans");
    if (meta.packed_padding && options.honour_packed_padding)
      invalid("joint_query", "joint tokens cannot be combined with packed_padding");
    if (extra.valid_kv_length && meta.joint_strategy == JointStrategy::rear)
      invalid("valid_kv_length",
              "with joint tokens valid_kv_length needs joint_strategy 'front' (a key prefix)");
  } else if (meta.joint_attn_mask) {
    invalid("joint_attn_mask", "given without joint_query/joint_key/joint_value");
  }
  const bool front = meta.joint_strategy == JointStrategy::front;
  const i64 J = joint.rows;
  const i64 sq = sq_local + J, skv = skv_local + J;

  // ---- output and LSE ----
  const TensorView out = to_bshd(in.out, layout, "out");
  if (!(out.dtype() == DType::F32 || out.dtype() == DType::BF16 || out.dtype() == DType::F16))
    invalid("out", "dtype " + std::string(dtype_name(out.dtype())) +
                       " is not valid; valid: f32, bf16, f16");
  if (out.size(0) != batch || out.size(1) != sq || out.size(2) != hq || out.size(3) != dv)
    invalid("out", "expected [" + std::to_string(batch) + ", " + std::to_string(sq) + ", " +
                       std::to_string(hq) + ", " + std::to_string(dv) +
                       "] (BSHD order, joint rows included), got " + out.describe());
  if (out.platform() != q.platform()) invalid("out", "lives on a different platform than query");
  std::optional<TensorView> lse;
  if (in.lse) {
    TensorView l = *in.lse;
    if (layout == QkvLayout::THD && l.ndim() == 2) l = unsqueezed(l, 0);
    if (l.dtype() != DType::F32)
      invalid("lse", "dtype " + std::string(dtype_name(l.dtype())) + " is not valid; valid: f32");
    if (l.ndim() != 3 || l.size(0) != batch || l.size(1) != hq || l.size(2) != sq)
      invalid("lse", "expected f32 [" + std::to_string(batch) + ", " + std::to_string(hq) + ", " +
                         std::to_string(sq) + "], got " + l.describe());
    if (l.platform() != q.platform()) invalid("lse", "lives on a different platform than query");
    lse = l;
  }

  if (hkv <= 0 || hq % hkv != 0)
    invalid("num_kv_heads", "query heads " + std::to_string(hq) +
                                " must be a multiple of key/value heads " + std::to_string(hkv));

  // ---- masks (SPEC §3) ----
  const bool mask_skipped =
      extra.attention_mask_mode && *extra.attention_mask_mode == AttentionMaskMode::none;
  std::optional<TensorView> keep_keys_local;  // [B, Skv_local] bool
  std::optional<TensorView> dense_mask;       // [B|1, H|1, Sq, Skv]
  if (meta.attn_mask) {
    const TensorView& m = *meta.attn_mask;
    if (m.platform() != q.platform()) invalid("attn_mask", "lives on a different platform");
    if (m.ndim() == 2) {
      if (m.dtype() != DType::Bool)
        invalid("attn_mask", "a 2-D mask must be a bool keep-mask [B, Skv]; got dtype " +
                                 std::string(dtype_name(m.dtype())) +
                                 " (pass additive masks as 4-D [B|1, H|1, Sq, Skv])");
      if (m.size(0) != batch || m.size(1) != skv_local)
        invalid("attn_mask", "2-D mask must be [" + std::to_string(batch) + ", " +
                                 std::to_string(skv_local) + "], got " + m.describe());
      keep_keys_local = m;
    } else if (m.ndim() == 3 || m.ndim() == 4) {
      const TensorView m4 = broadcastable(m.ndim() == 3 ? unsqueezed(m, 1) : m);
      if (!(m4.dtype() == DType::Bool || is_float_input_dtype(m4.dtype())))
        invalid("attn_mask", "dtype " + std::string(dtype_name(m4.dtype())) +
                                 " is not valid; valid: bool (keep) or f32/bf16/f16 (additive)");
      const bool ok = (m4.size(0) == batch || m4.size(0) == 1) &&
                      (m4.size(1) == hq || m4.size(1) == 1) && m4.size(2) == sq &&
                      m4.size(3) == skv;
      if (!ok)
        invalid("attn_mask", "expected [" + std::to_string(batch) + "|1, " + std::to_string(hq) +
                                 "|1, " + std::to_string(sq) + ", " + std::to_string(skv) +
                                 "] (joint rows included), got " + m.describe());
      if (meta.joint_attn_mask)
        invalid("joint_attn_mask",
                "combines only with a 2-D attn_mask, not a " + std::to_string(m.ndim()) + "-D one");
      dense_mask = m4;
    } else {
      invalid("attn_mask", "rank " + std::to_string(m.ndim()) +
                               " is not valid; valid: 2-D [B, Skv] bool, 3-D [B, Sq, Skv], "
                               "4-D [B|1, H|1, Sq, Skv]");
    }
  }
  if (meta.joint_attn_mask) {
    const TensorView& jm = *meta.joint_attn_mask;
    if (jm.dtype() != DType::Bool || jm.ndim() != 2 || jm.size(0) != batch || jm.size(1) != J)
      invalid("joint_attn_mask", "expected bool [" + std::to_string(batch) + ", " +
                                     std::to_string(J) + "], got " + jm.describe());
  }

  // ---- packed variable-length batches (SPEC §5) ----
  const int varlen_count =
      int(extra.cu_seqlens_q.has_value()) + int(extra.cu_seqlens_k.has_value()) +
      int(extra.max_seqlen_q.has_value()) + int(extra.max_seqlen_k.has_value());
  std::vector<i64> cu_q, cu_k;
  if (varlen_count != 0 && varlen_count != 4) {
    std::string missing;
    if (!extra.cu_seqlens_q) missing += " cu_seqlens_q";
    if (!extra.cu_seqlens_k) missing += " cu_seqlens_k";
    if (!extra.max_seqlen_q) missing += " max_seqlen_q";
    if (!extra.max_seqlen_k) missing += " max_seqlen_k";
    invalid(extra.cu_seqlens_q ? (extra.cu_seqlens_k ? "max_seqlen_q" : "cu_seqlens_k")
                               : "cu_seqlens_q",
            "packed varlen needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k "
            "together; missing:" +
                missing);
  }
  const bool varlen = varlen_count == 4;
  if (varlen) {
    if (batch != 1)
      invalid("cu_seqlens_q",
              "packed varlen needs batch 1 (or THD), got batch " + std::to_string(batch));
    cu_q = read_int32_vector(*extra.cu_seqlens_q, "cu_seqlens_q");
    cu_k = read_int32_vector(*extra.cu_seqlens_k, "cu_seqlens_k");
    if (cu_q.size() != cu_k.size())
      invalid("cu_seqlens_k", "has " + std::to_string(cu_k.size()) +
                                  " entries but cu_seqlens_q has " + std::to_string(cu_q.size()) +
                                  "; both need docs + 1");
    const i64 longest_q = check_cu_seqlens(cu_q, sq, "cu_seqlens_q");
    const i64 longest_k = check_cu_seqlens(cu_k, skv, "cu_seqlens_k");
    if (*extra.max_seqlen_q < longest_q)
      invalid("max_seqlen_q", "= " + std::to_string(*extra.max_seqlen_q) +
                                  " is below the longest query document (" +
                                  std::to_string(longest_q) + ")");
    if (*extra.max_seqlen_k < longest_k)
      invalid("max_seqlen_k", "= " + std::to_string(*extra.max_seqlen_k) +
                                  " is below the longest key document (" +
                                  std::to_string(longest_k) + ")");
    if (meta.query_ranges || meta.q_global_start || meta.k_global_start)
      invalid("query_ranges",
              "positions inside packed documents are per document; "
              "query_ranges and global starts cannot be combined with cu_seqlens");
    if (meta.full_attn_spans)
      invalid("full_attn_spans", "piecewise spans cannot be combined with packed cu_seqlens");
  }

  // ---- packed padding (SPEC §6) ----
  const bool packed_padding = meta.packed_padding.has_value() && options.honour_packed_padding;
  if (packed_padding) {
    const PackedPaddingMetadata& pp = *meta.packed_padding;
    if (pp.q_length < 0 || pp.q_length > sq)
      invalid("packed_padding.q_length",
              "= " + std::to_string(pp.q_length) + " must be in [0, " + std::to_string(sq) + "]");
    if (pp.kv_length < 0 || pp.kv_length > skv)
      invalid("packed_padding.kv_length",
              "= " + std::to_string(pp.kv_length) + " must be in [0, " + std::to_string(skv) + "]");
    const auto pq = read_int32_vector(pp.cu_seqlens_q, "packed_padding.cu_seqlens_q");
    const auto pk = read_int32_vector(pp.cu_seqlens_k, "packed_padding.cu_seqlens_k");
    if (pq != std::vector<i64>{0, pp.q_length})
      invalid(
          "packed_padding.cu_seqlens_q",
          "must be [0, q_length] = [0, " + std::to_string(pp.q_length) + "], got " + vec_str(pq));
    if (pk != std::vector<i64>{0, pp.kv_length})
      invalid(
          "packed_padding.cu_seqlens_k",
          "must be [0, kv_length] = [0, " + std::to_string(pp.kv_length) + "], got " + vec_str(pk));
    if (varlen) {
      const auto real_pad = [](const std::vector<i64>& cu, i64 used, i64 total) {
        return cu == std::vector<i64>{0, used, total} ||
               (used == total && cu == std::vector<i64>{0, total});
      };
      if (!real_pad(cu_q, pp.q_length, sq) || !real_pad(cu_k, pp.kv_length, skv))
        invalid("packed_padding",
                "with cu_seqlens the packing must be [real, pad]: cu_seqlens_q "
                "= [0, q_length, total] and cu_seqlens_k = [0, kv_length, "
                "total]; got " +
                    vec_str(cu_q) + " and " + vec_str(cu_k));
    }
    p.features.add(Feature::packed_mask_free);
  }

  // ---- valid_kv_length (SPEC §6) ----
  if (extra.valid_kv_length) {
    const i64 vl = *extra.valid_kv_length;
    if (vl <= 0 || vl > skv_local)
      invalid("valid_kv_length", "= " + std::to_string(vl) +
                                     " must satisfy 0 < v <= Skv = " + std::to_string(skv_local));
    p.features.add(Feature::prefix_kv_slicing);
  }

  // ---- positions: global starts, query ranges, piecewise spans (SPEC §2, §7) ----
  const i64 k_pos0 = meta.k_global_start.value_or(0);
  if (k_pos0 < 0) invalid("k_global_start", "= " + std::to_string(k_pos0) + " must be >= 0");
  std::vector<QueryRange> ranges;
  if (meta.query_ranges) {
    if (meta.q_global_start)
      invalid("q_global_start", "give either q_global_start or query_ranges, not both");
    ranges = *meta.query_ranges;
    i64 expect = 0;
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      const QueryRange& r = ranges[i];
      if (r.local_start != expect || r.local_end < r.local_start || r.global_start < 0)
        invalid("query_ranges",
                "range " + std::to_string(i) + " (" + std::to_string(r.local_start) + ", " +
                    std::to_string(r.local_end) + ", " + std::to_string(r.global_start) +
                    ") breaks the tiling: ranges must cover local rows 0.." + std::to_string(sq) +
                    " contiguously with global_start >= 0");
      expect = r.local_end;
    }
    if (expect != sq)
      invalid("query_ranges", "cover local rows [0, " + std::to_string(expect) +
                                  ") but the query has " + std::to_string(sq) + " rows");
  } else {
    const i64 q_pos0 = meta.q_global_start.value_or(skv - sq);
    if (meta.q_global_start && q_pos0 < 0)
      invalid("q_global_start", "= " + std::to_string(q_pos0) + " must be >= 0");
    ranges.push_back({0, sq, q_pos0});
  }

  if (meta.full_attn_spans) {
    const FullAttnSpans& spans = *meta.full_attn_spans;
    if (static_cast<i64>(spans.size()) != batch)
      invalid("full_attn_spans", "has " + std::to_string(spans.size()) +
                                     " lists; one per sample (" + std::to_string(batch) +
                                     ") is needed");
    i64 global_end = k_pos0 + skv;
    for (const QueryRange& r : ranges)
      global_end = std::max(global_end, r.global_start + (r.local_end - r.local_start));
    for (std::size_t b = 0; b < spans.size(); ++b) {
      if (spans[b] != spans[0])
        invalid("full_attn_spans", "sample " + std::to_string(b) +
                                       " differs from sample 0; spans must be identical across "
                                       "the batch");
    }
    if (!spans.empty()) {
      i64 prev_end = 0;
      for (std::size_t i = 0; i < spans[0].size(); ++i) {
        const auto [a, e] = spans[0][i];
        const std::string which =
            "span " + std::to_string(i) + " [" + std::to_string(a) + ", " + std::to_string(e) + ")";
        if (a < 0 || e > global_end || a >= e)
          invalid("full_attn_spans", which + " is out of range or empty; valid: 0 <= a < e <= " +
                                         std::to_string(global_end));
        if (i > 0 && a < prev_end)
          invalid("full_attn_spans", which + " is unsorted or overlaps the previous span");
        prev_end = e;
      }
      p.full_spans = spans[0];
    }
    p.position_rule = PositionRule::piecewise;
    p.features.add(Feature::piecewise_spans);
  } else {
    p.position_rule = config.causal ? PositionRule::causal : PositionRule::full;
  }
  if (p.position_rule != PositionRule::full) p.features.add(Feature::causal);

  // ---- laser_input_scale (SPEC §8) ----
  if (extra.laser_input_scale) {
    const double f = *extra.laser_input_scale;
    if (!std::isfinite(f) || f < 1.0)
      invalid("laser_input_scale", "= " + std::to_string(f) + " must be finite and >= 1");
    p.laser_input_scale = f;
  }

  // ---- the problem: shapes, joint rows, merged masks ----
  p.batch = batch;
  p.sq = sq;
  p.skv = skv;
  p.hq = hq;
  p.hkv = hkv;
  p.d = d;
  p.dv = dv;
  p.softmax_scale = softmax_scale;
  p.out = out;
  p.lse = lse;
  p.kv_cache_dtype = extra.kv_cache_dtype.value_or(config.kv_cache_dtype);
  p.backend_options = &extra.backend;
  if (meta.video_layout) p.video_layout = &*meta.video_layout;
  if (lse) p.features.add(Feature::lse_output);

  // Joint rows stay in the caller's tensors; the problem reads them through q_row/k_row/v_row.
  p.q = q;
  p.k = k;
  p.v = v;
  if (J > 0) p.joint = JointRows{joint.q, joint.k, joint.v, front};

  if (!mask_skipped && (keep_keys_local || meta.joint_attn_mask)) {
    p.features.add(Feature::attention_mask);
    p.mask.kind = MaskKind::keep_keys;
    if (J == 0) {
      p.mask.view = *keep_keys_local;
    } else if (options.materialize) {
      if (keep_keys_local) require_host(*keep_keys_local, "attn_mask");
      require_host(*meta.joint_attn_mask, "joint_attn_mask");
      Tensor merged = Tensor::empty({batch, skv}, DType::Bool);
      auto* dst = merged.data_as<std::uint8_t>();
      for (i64 b = 0; b < batch; ++b) {
        for (i64 j = 0; j < skv; ++j) {
          const bool is_joint = front ? j < J : j >= skv_local;
          const i64 local_j = front ? j - J : j;
          const TensorView* src = is_joint
                                      ? (meta.joint_attn_mask ? &*meta.joint_attn_mask : nullptr)
                                      : (keep_keys_local ? &*keep_keys_local : nullptr);
          const i64 col = is_joint ? (front ? j : j - skv_local) : local_j;
          std::uint8_t keep = 1;
          if (src) {
            const auto* base = static_cast<const std::uint8_t*>(src->data());
            keep = base[b * src->stride(0) + col * src->stride(1)] != 0;
          }
          dst[b * skv + j] = keep;
        }
      }
      call.owned.push_back(merged);
      p.mask.view = merged.view();
    }
    p.zero_masked_query_rows = config.role == AttentionRole::self && sq == skv;
  } else if (!mask_skipped && dense_mask) {
    p.features.add(Feature::attention_mask);
    p.features.add(Feature::dense_attention_mask);
    p.mask.kind = dense_mask->dtype() == DType::Bool ? MaskKind::keep_dense : MaskKind::additive;
    p.mask.view = *dense_mask;
  }

  // ---- segments ----
  const i64 key_limit = extra.valid_kv_length ? *extra.valid_kv_length + (front ? J : 0) : skv;
  i64 real_docs = 0;
  if (varlen) {
    const std::size_t docs = cu_q.size() - 1;
    for (std::size_t dd = 0; dd < docs; ++dd) {
      if (packed_padding && dd == 1) continue;  // [real, pad]: the pad document outputs zeros
      const i64 qb = cu_q[dd], qe = cu_q[dd + 1], kb = cu_k[dd], ke = cu_k[dd + 1];
      if (qe == qb) continue;
      ++real_docs;
      const i64 kend = std::min(ke, key_limit);
      p.segments.push_back({0, qb, qe, std::min(kb, kend), kend, (ke - kb) - (qe - qb), 0});
    }
  } else if (packed_padding) {
    const PackedPaddingMetadata& pp = *meta.packed_padding;
    const i64 kend = std::min(pp.kv_length, key_limit);
    for (i64 b = 0; b < batch; ++b)
      if (pp.q_length > 0)
        p.segments.push_back({b, 0, pp.q_length, 0, kend, pp.kv_length - pp.q_length, 0});
    real_docs = 1;
  } else {
    for (i64 b = 0; b < batch; ++b)
      for (const QueryRange& r : ranges)
        if (r.local_end > r.local_start)
          p.segments.push_back(
              {b, r.local_start, r.local_end, 0, key_limit, r.global_start, k_pos0});
    real_docs = 1;
  }
  if (real_docs > 1) p.features.add(Feature::multi_doc_packed_varlen);

  p.signature = problem_signature(p);
  return call;
}

}  // namespace dattn::detail
