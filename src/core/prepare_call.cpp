#include "core/prepare_call.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>

#include "core/tensor_checks.hpp"
#include "core/threads.hpp"
#include "core/video_layout.hpp"
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

// A vector for an error message: whole when short, else its first entries and its length (a
// message never grows with the input).
std::string vec_str(const std::vector<i64>& v) {
  constexpr std::size_t kWhole = 8, kHead = 4;
  if (v.size() <= kWhole) return shape_str(std::span<const i64>(v.data(), v.size()));
  std::string s = shape_str(std::span<const i64>(v.data(), kHead));
  s.pop_back();
  return s + ", ...] (" + std::to_string(v.size()) + " entries)";
}

// Checks cu_seqlens against the packed length; returns the largest document length.
i64 check_cu_seqlens(const std::vector<i64>& cu, i64 total, const std::string& field) {
  if (cu.empty()) invalid(field, "needs at least one entry ([0]); got none");
  if (cu.front() != 0)
    invalid(field,
            "must start at 0, but entry 0 is " + std::to_string(cu.front()) + " in " + vec_str(cu));
  i64 longest = 0;
  for (std::size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1])
      invalid(field, "must be non-decreasing, but entry " + std::to_string(i) + " (" +
                         std::to_string(cu[i]) + ") < entry " + std::to_string(i - 1) + " (" +
                         std::to_string(cu[i - 1]) + ")");
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
  h = mix(h, std::uint64_t(p.threads));
  return h;
}

struct JointViews {
  TensorView q, k, v;
  i64 rows = 0;
};

}  // namespace

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
      return t.unsqueezed(0);
  }
  return t;
}

namespace {

// Q, K, V in BSHD order with their sizes (joint rows not included).
struct Qkv {
  TensorView q, k, v;
  i64 batch = 0, sq_local = 0, skv_local = 0, hq = 0, hkv = 0, d = 0, dv = 0;
};

// ---- Q, K, V: rank, layout, dtype, platform, heads (docs/semantics.md, "Tensors") ----
Qkv check_qkv(const AttentionConfig& config, i64 num_kv_heads, const AttentionInputs& in) {
  const QkvLayout layout = config.qkv_layout;
  Qkv t;
  t.q = to_bshd(in.q, layout, "query");
  t.k = to_bshd(in.k, layout, "key");
  t.v = to_bshd(in.v, layout, "value");
  const TensorView &q = t.q, &k = t.k, &v = t.v;
  require_float(q, "query");
  require_float(k, "key");
  require_float(v, "value");
  for (const auto& [x, name] : {std::pair{&k, "key"}, std::pair{&v, "value"}})
    if (x->platform() != q.platform())
      invalid(name, std::string("lives on ") + std::string(platform_name(x->platform())) +
                        " but query lives on " + std::string(platform_name(q.platform())));

  t.batch = q.size(0), t.sq_local = q.size(1), t.hq = q.size(2), t.d = q.size(3);
  t.skv_local = k.size(1), t.hkv = k.size(2), t.dv = v.size(3);
  const i64 batch = t.batch, hq = t.hq, hkv = t.hkv, d = t.d;
  if (k.size(0) != batch || v.size(0) != batch)
    invalid("key", "batch " + std::to_string(k.size(0)) + " (value " + std::to_string(v.size(0)) +
                       ") does not match query batch " + std::to_string(batch));
  if (v.size(1) != t.skv_local)
    invalid("value", "sequence length " + std::to_string(v.size(1)) +
                         " does not match key sequence length " + std::to_string(t.skv_local));
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
  if (t.dv <= 0) invalid("value", "head size must be positive, got " + std::to_string(t.dv));
  return t;
}

// ---- joint tokens (docs/semantics.md, "Joint tokens") ----
JointViews check_joint(const AttentionMetadata& meta, QkvLayout layout, const Qkv& t,
                       const PrepareOptions& options) {
  const Extra& extra = meta.extra;
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
        {{&joint.q, {t.batch, t.hq, t.d}},
         {&joint.k, {t.batch, t.hkv, t.d}},
         {&joint.v, {t.batch, t.hkv, t.dv}}}};
    const std::array<const char*, 3> names{"joint_query", "joint_key", "joint_value"};
    for (std::size_t i = 0; i < 3; ++i) {
      const TensorView& x = *expect[i].first;
      const auto& e = expect[i].second;
      if (x.size(0) != e[0] || x.size(1) != joint.rows || x.size(2) != e[1] || x.size(3) != e[2])
        invalid(names[i], "expected [" + std::to_string(e[0]) + ", " + std::to_string(joint.rows) +
                              ", " + std::to_string(e[1]) + ", " + std::to_string(e[2]) +
                              "] (BSHD order), got " + x.describe());
      if (x.platform() != t.q.platform())
        invalid(names[i], std::string("lives on ") + std::string(platform_name(x.platform())) +
                              " but query lives on " + std::string(platform_name(t.q.platform())));
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
  return joint;
}

struct Outputs {
  TensorView out;
  std::optional<TensorView> lse;
};

// ---- output and LSE (docs/semantics.md, "Tensors") ----
Outputs check_outputs(const AttentionInputs& in, QkvLayout layout, const Qkv& t, i64 sq) {
  Outputs o;
  o.out = to_bshd(in.out, layout, "out");
  const TensorView& out = o.out;
  if (!(out.dtype() == DType::F32 || out.dtype() == DType::BF16 || out.dtype() == DType::F16))
    invalid("out", "dtype " + std::string(dtype_name(out.dtype())) +
                       " is not valid; valid: f32, bf16, f16");
  if (out.size(0) != t.batch || out.size(1) != sq || out.size(2) != t.hq || out.size(3) != t.dv)
    invalid("out", "expected [" + std::to_string(t.batch) + ", " + std::to_string(sq) + ", " +
                       std::to_string(t.hq) + ", " + std::to_string(t.dv) +
                       "] (BSHD order, joint rows included), got " + out.describe());
  if (out.platform() != t.q.platform()) invalid("out", "lives on a different platform than query");
  if (in.lse) {
    TensorView l = *in.lse;
    if (layout == QkvLayout::THD && l.ndim() == 2) l = l.unsqueezed(0);
    if (l.dtype() != DType::F32)
      invalid("lse", "dtype " + std::string(dtype_name(l.dtype())) + " is not valid; valid: f32");
    if (l.ndim() != 3 || l.size(0) != t.batch || l.size(1) != t.hq || l.size(2) != sq)
      invalid("lse", "expected f32 [" + std::to_string(t.batch) + ", " + std::to_string(t.hq) +
                         ", " + std::to_string(sq) + "], got " + l.describe());
    if (l.platform() != t.q.platform()) invalid("lse", "lives on a different platform than query");
    o.lse = l;
  }
  if (t.hkv <= 0 || t.hq % t.hkv != 0)
    invalid("num_kv_heads", "query heads " + std::to_string(t.hq) +
                                " must be a multiple of key/value heads " + std::to_string(t.hkv));
  return o;
}

struct Masks {
  bool skipped = false;                       // attention_mask_mode none: never read
  std::optional<TensorView> keep_keys_local;  // [B, Skv_local] bool
  std::optional<TensorView> dense;            // [B|1, H|1, Sq, Skv]
};

// ---- masks (docs/semantics.md, "Masks") ----
Masks check_masks(const AttentionMetadata& meta, const Qkv& t, i64 J, i64 sq, i64 skv) {
  const Extra& extra = meta.extra;
  Masks masks;
  masks.skipped =
      extra.attention_mask_mode && *extra.attention_mask_mode == AttentionMaskMode::none;
  if (meta.attn_mask) {
    const TensorView& m = *meta.attn_mask;
    if (m.platform() != t.q.platform()) invalid("attn_mask", "lives on a different platform");
    if (m.ndim() == 2) {
      if (m.dtype() != DType::Bool)
        invalid("attn_mask", "a 2-D mask must be a bool keep-mask [B, Skv]; got dtype " +
                                 std::string(dtype_name(m.dtype())) +
                                 " (pass additive masks as 4-D [B|1, H|1, Sq, Skv])");
      if (m.size(0) != t.batch || m.size(1) != t.skv_local)
        invalid("attn_mask", "2-D mask must be [" + std::to_string(t.batch) + ", " +
                                 std::to_string(t.skv_local) + "], got " + m.describe());
      masks.keep_keys_local = m;
    } else if (m.ndim() == 3 || m.ndim() == 4) {
      const TensorView m4 = broadcastable(m.ndim() == 3 ? m.unsqueezed(1) : m);
      if (!(m4.dtype() == DType::Bool || is_float_input_dtype(m4.dtype())))
        invalid("attn_mask", "dtype " + std::string(dtype_name(m4.dtype())) +
                                 " is not valid; valid: bool (keep) or f32/bf16/f16 (additive)");
      const bool ok = (m4.size(0) == t.batch || m4.size(0) == 1) &&
                      (m4.size(1) == t.hq || m4.size(1) == 1) && m4.size(2) == sq &&
                      m4.size(3) == skv;
      if (!ok)
        invalid("attn_mask", "expected [" + std::to_string(t.batch) + "|1, " +
                                 std::to_string(t.hq) + "|1, " + std::to_string(sq) + ", " +
                                 std::to_string(skv) + "] (joint rows included), got " +
                                 m.describe());
      if (meta.joint_attn_mask)
        invalid("joint_attn_mask",
                "combines only with a 2-D attn_mask, not a " + std::to_string(m.ndim()) + "-D one");
      masks.dense = m4;
    } else {
      invalid("attn_mask", "rank " + std::to_string(m.ndim()) +
                               " is not valid; valid: 2-D [B, Skv] bool, 3-D [B, Sq, Skv], "
                               "4-D [B|1, H|1, Sq, Skv]");
    }
  }
  if (meta.joint_attn_mask) {
    const TensorView& jm = *meta.joint_attn_mask;
    if (jm.dtype() != DType::Bool || jm.ndim() != 2 || jm.size(0) != t.batch || jm.size(1) != J)
      invalid("joint_attn_mask", "expected bool [" + std::to_string(t.batch) + ", " +
                                     std::to_string(J) + "], got " + jm.describe());
  }
  return masks;
}

struct Varlen {
  bool on = false;
  std::vector<i64> cu_q, cu_k;
};

// ---- packed variable-length batches (docs/semantics.md, "Packed variable-length batches") ----
Varlen check_varlen(const AttentionMetadata& meta, i64 batch, i64 sq, i64 skv) {
  const Extra& extra = meta.extra;
  const int varlen_count =
      int(extra.cu_seqlens_q.has_value()) + int(extra.cu_seqlens_k.has_value()) +
      int(extra.max_seqlen_q.has_value()) + int(extra.max_seqlen_k.has_value());
  Varlen v;
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
  v.on = varlen_count == 4;
  if (!v.on) return v;
  if (batch != 1)
    invalid("cu_seqlens_q",
            "packed varlen needs batch 1 (or THD), got batch " + std::to_string(batch));
  v.cu_q = read_int32_vector(*extra.cu_seqlens_q, "cu_seqlens_q");
  v.cu_k = read_int32_vector(*extra.cu_seqlens_k, "cu_seqlens_k");
  if (v.cu_q.size() != v.cu_k.size())
    invalid("cu_seqlens_k", "has " + std::to_string(v.cu_k.size()) +
                                " entries but cu_seqlens_q has " + std::to_string(v.cu_q.size()) +
                                "; both need docs + 1");
  const i64 longest_q = check_cu_seqlens(v.cu_q, sq, "cu_seqlens_q");
  const i64 longest_k = check_cu_seqlens(v.cu_k, skv, "cu_seqlens_k");
  if (*extra.max_seqlen_q < longest_q)
    invalid("max_seqlen_q", "= " + std::to_string(*extra.max_seqlen_q) +
                                " is below the longest query document (" +
                                std::to_string(longest_q) + ")");
  if (*extra.max_seqlen_k < longest_k)
    invalid("max_seqlen_k", "= " + std::to_string(*extra.max_seqlen_k) +
                                " is below the longest key document (" + std::to_string(longest_k) +
                                ")");
  if (meta.query_ranges || meta.q_global_start || meta.k_global_start)
    invalid("query_ranges",
            "positions inside packed documents are per document; "
            "query_ranges and global starts cannot be combined with cu_seqlens");
  if (meta.full_attn_spans)
    invalid("full_attn_spans", "piecewise spans cannot be combined with packed cu_seqlens");
  return v;
}

// ---- packed padding (docs/semantics.md, "Packed padding and prefix slicing"); returns whether it
// is honoured ----
bool check_packed_padding(const AttentionMetadata& meta, const PrepareOptions& options,
                          const Varlen& varlen, i64 sq, i64 skv) {
  if (!meta.packed_padding.has_value() || !options.honour_packed_padding) return false;
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
    invalid("packed_padding.cu_seqlens_q",
            "must be [0, q_length] = [0, " + std::to_string(pp.q_length) + "], got " + vec_str(pq));
  if (pk != std::vector<i64>{0, pp.kv_length})
    invalid(
        "packed_padding.cu_seqlens_k",
        "must be [0, kv_length] = [0, " + std::to_string(pp.kv_length) + "], got " + vec_str(pk));
  if (varlen.on) {
    const auto real_pad = [](const std::vector<i64>& cu, i64 used, i64 total) {
      return cu == std::vector<i64>{0, used, total} ||
             (used == total && cu == std::vector<i64>{0, total});
    };
    if (!real_pad(varlen.cu_q, pp.q_length, sq) || !real_pad(varlen.cu_k, pp.kv_length, skv))
      invalid("packed_padding",
              "with cu_seqlens the packing must be [real, pad]: cu_seqlens_q "
              "= [0, q_length, total] and cu_seqlens_k = [0, kv_length, "
              "total]; got " +
                  vec_str(varlen.cu_q) + " and " + vec_str(varlen.cu_k));
  }
  return true;
}

// ---- valid_kv_length (docs/semantics.md, "Packed padding and prefix slicing") ----
void check_valid_kv_length(const Extra& extra, i64 skv_local) {
  if (!extra.valid_kv_length) return;
  const i64 vl = *extra.valid_kv_length;
  if (vl <= 0 || vl > skv_local)
    invalid("valid_kv_length", "= " + std::to_string(vl) +
                                   " must satisfy 0 < v <= Skv = " + std::to_string(skv_local));
}

// ---- positions: global starts and query ranges (docs/semantics.md, "Positions and causality" and
// "Piecewise spans and query ranges"), all below kMaxPosition ---- Whether rows at [start, start +
// rows) stay below kMaxPosition (rows >= 0: no overflow).
bool positions_fit(i64 start, i64 rows) {
  return start < kMaxPosition && start <= kMaxPosition - rows;
}

const std::string kPositionBound = "2^62 (kMaxPosition)";

// The position of key row 0.
i64 check_k_global_start(const AttentionMetadata& meta, i64 skv) {
  const i64 k_pos0 = meta.k_global_start.value_or(0);
  if (k_pos0 < 0) invalid("k_global_start", "= " + std::to_string(k_pos0) + " must be >= 0");
  if (!positions_fit(k_pos0, skv))
    invalid("k_global_start", "= " + std::to_string(k_pos0) + " puts the " + std::to_string(skv) +
                                  " key rows past position " + kPositionBound);
  return k_pos0;
}

// The query ranges of the call (one range from q_global_start, or its default, when none).
std::vector<QueryRange> check_query_positions(const AttentionMetadata& meta, i64 sq, i64 skv) {
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
      if (!positions_fit(r.global_start, r.local_end - r.local_start))
        invalid("query_ranges",
                "range " + std::to_string(i) + " (" + std::to_string(r.local_start) + ", " +
                    std::to_string(r.local_end) + ", " + std::to_string(r.global_start) +
                    ") ends past position " + kPositionBound);
      expect = r.local_end;
    }
    if (expect != sq)
      invalid("query_ranges", "cover local rows [0, " + std::to_string(expect) +
                                  ") but the query has " + std::to_string(sq) + " rows");
  } else {
    const i64 q_pos0 = meta.q_global_start.value_or(skv - sq);
    if (meta.q_global_start && q_pos0 < 0)
      invalid("q_global_start", "= " + std::to_string(q_pos0) + " must be >= 0");
    if (meta.q_global_start && !positions_fit(q_pos0, sq))
      invalid("q_global_start", "= " + std::to_string(q_pos0) + " puts the " + std::to_string(sq) +
                                    " query rows past position " + kPositionBound);
    ranges.push_back({0, sq, q_pos0});
  }
  return ranges;
}

// ---- piecewise spans (docs/semantics.md, "Piecewise spans and query ranges"): the position rule
// of the call ----
void check_full_attn_spans(const AttentionMetadata& meta, const AttentionConfig& config,
                           const std::vector<QueryRange>& ranges, i64 batch, i64 k_pos0, i64 skv,
                           AttentionProblem& p) {
  if (!meta.full_attn_spans) {
    p.position_rule = config.causal ? PositionRule::causal : PositionRule::full;
    return;
  }
  const FullAttnSpans& spans = *meta.full_attn_spans;
  if (static_cast<i64>(spans.size()) != batch)
    invalid("full_attn_spans", "has " + std::to_string(spans.size()) + " lists; one per sample (" +
                                   std::to_string(batch) + ") is needed");
  // At most kMaxPosition: the starts and ranges were checked.
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
}

// ---- laser_input_scale (docs/semantics.md, "Other extra keys") ----
void check_laser_input_scale(const Extra& extra, AttentionProblem& p) {
  if (!extra.laser_input_scale) return;
  const double f = *extra.laser_input_scale;
  if (!std::isfinite(f) || f < 1.0)
    invalid("laser_input_scale", "= " + std::to_string(f) + " must be finite and >= 1");
  p.laser_input_scale = f;
}

// ---- the problem's mask: key padding merged with the joint key mask, or a dense mask ----
void resolve_mask(const AttentionMetadata& meta, const AttentionConfig& config,
                  const PrepareOptions& options, const Masks& masks, const JointViews& joint,
                  bool front, PreparedCall& call) {
  AttentionProblem& p = call.problem;
  const i64 J = joint.rows, batch = p.batch, skv = p.skv, skv_local = skv - J;
  if (!masks.skipped && (masks.keep_keys_local || meta.joint_attn_mask)) {
    p.features.add(Feature::attention_mask);
    p.mask.kind = MaskKind::keep_keys;
    if (J == 0) {
      p.mask.view = *masks.keep_keys_local;
    } else if (options.materialize) {
      if (masks.keep_keys_local) require_host(*masks.keep_keys_local, "attn_mask");
      require_host(*meta.joint_attn_mask, "joint_attn_mask");
      Tensor merged = Tensor::empty({batch, skv}, DType::Bool);
      auto* dst = merged.data_as<std::uint8_t>();
      for (i64 b = 0; b < batch; ++b) {
        for (i64 j = 0; j < skv; ++j) {
          const bool is_joint = front ? j < J : j >= skv_local;
          const i64 local_j = front ? j - J : j;
          const TensorView* src = is_joint
                                      ? (meta.joint_attn_mask ? &*meta.joint_attn_mask : nullptr)
                                      : (masks.keep_keys_local ? &*masks.keep_keys_local : nullptr);
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
    p.zero_masked_query_rows = config.role == AttentionRole::self && p.sq == skv;
  } else if (!masks.skipped && masks.dense) {
    p.features.add(Feature::attention_mask);
    p.features.add(Feature::dense_attention_mask);
    const TensorView& d = *masks.dense;
    if (d.dtype() == DType::Bool && d.stride(1) == 0 && d.stride(2) == 0) {
      // The same bool mask for every head and query row (HunyuanVideo's and diffusers'
      // [B|1, 1, 1, Skv] key masks, broadcast): a per-key mask, read once per key rather than
      // once per (row, key). Not SPEC's 2-D key padding: no query row is padding.
      const std::array<i64, 2> shape{p.batch, d.size(3)};
      const std::array<i64, 2> strides{d.size(0) == 1 ? 0 : d.stride(0), d.stride(3)};
      p.mask.kind = MaskKind::keep_keys;
      p.mask.view = TensorView(d.data(), DType::Bool, shape, strides, d.platform());
      p.zero_masked_query_rows = false;
    } else {
      p.mask.kind = d.dtype() == DType::Bool ? MaskKind::keep_dense : MaskKind::additive;
      p.mask.view = d;
    }
  }
}

// ---- segments: every metadata form as runs of query rows against key ranges ----
void build_segments(const AttentionMetadata& meta, const Varlen& varlen, bool packed_padding,
                    const std::vector<QueryRange>& ranges, i64 k_pos0, i64 J, bool front,
                    AttentionProblem& p) {
  const Extra& extra = meta.extra;
  const i64 batch = p.batch;
  const i64 key_limit = extra.valid_kv_length ? *extra.valid_kv_length + (front ? J : 0) : p.skv;
  i64 real_docs = 0;
  if (varlen.on) {
    const std::vector<i64>&cu_q = varlen.cu_q, &cu_k = varlen.cu_k;
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
}

// ---- memory (docs/semantics.md, "Tensors"): every view addresses real memory, and the outputs
// alias neither themselves nor an input, checked before anything is read or written ----
void check_memory(const AttentionInputs& in, const AttentionMetadata& meta) {
  struct Named {
    const TensorView* view;
    const char* field;
  };
  std::vector<Named> inputs{{&in.q, "query"}, {&in.k, "key"}, {&in.v, "value"}};
  const auto add = [&](const std::optional<TensorView>& t, const char* field) {
    if (t) inputs.push_back({&*t, field});
  };
  add(meta.attn_mask, "attn_mask");
  add(meta.joint_attn_mask, "joint_attn_mask");
  add(meta.joint_query, "joint_query");
  add(meta.joint_key, "joint_key");
  add(meta.joint_value, "joint_value");
  add(meta.extra.cu_seqlens_q, "cu_seqlens_q");
  add(meta.extra.cu_seqlens_k, "cu_seqlens_k");
  if (meta.packed_padding) {
    inputs.push_back({&meta.packed_padding->cu_seqlens_q, "packed_padding.cu_seqlens_q"});
    inputs.push_back({&meta.packed_padding->cu_seqlens_k, "packed_padding.cu_seqlens_k"});
  }
  for (const Named& t : inputs) check_view_memory(*t.view, t.field);
  for (const auto& [key, value] : meta.extra.backend)
    if (const auto* t = std::get_if<TensorView>(&value)) check_view_memory(*t, key);
  check_view_memory(in.out, "out");
  check_output_internal_overlap(in.out, "out");
  // An output row depends on its own query row alone, so out may be query itself.
  for (const Named& t : inputs)
    check_output_overlap(in.out, "out", *t.view, t.field, t.view == &in.q);
  if (in.lse) {
    check_view_memory(*in.lse, "lse");
    check_output_internal_overlap(*in.lse, "lse");
    check_output_overlap(*in.lse, "lse", in.out, "out");
    for (const Named& t : inputs) check_output_overlap(*in.lse, "lse", *t.view, t.field);
  }
}

}  // namespace

PreparedCall prepare_call(const AttentionConfig& config, double softmax_scale, i64 num_kv_heads,
                          const AttentionInputs& in, const PrepareOptions& options) {
  static const AttentionMetadata kNoMetadata{};
  const AttentionMetadata& meta = in.metadata ? *in.metadata : kNoMetadata;
  const Extra& extra = meta.extra;
  const QkvLayout layout = config.qkv_layout;
  PreparedCall call;
  AttentionProblem& p = call.problem;

  // Validation alone (a parallel strategy's shape-only views, options.materialize false)
  // reads no memory: the views' pointers are not set.
  if (options.materialize) check_memory(in, meta);
  const Qkv t = check_qkv(config, num_kv_heads, in);
  const JointViews joint = check_joint(meta, layout, t, options);
  const bool front = meta.joint_strategy == JointStrategy::front;
  const i64 J = joint.rows;
  const i64 sq = t.sq_local + J, skv = t.skv_local + J;
  const Outputs outputs = check_outputs(in, layout, t, sq);
  const Masks masks = check_masks(meta, t, J, sq, skv);
  const Varlen varlen = check_varlen(meta, t.batch, sq, skv);
  const bool packed_padding = check_packed_padding(meta, options, varlen, sq, skv);
  if (packed_padding) p.features.add(Feature::packed_mask_free);
  check_valid_kv_length(extra, t.skv_local);
  if (extra.valid_kv_length) p.features.add(Feature::prefix_kv_slicing);

  const i64 k_pos0 = check_k_global_start(meta, skv);
  const std::vector<QueryRange> ranges = check_query_positions(meta, sq, skv);
  check_full_attn_spans(meta, config, ranges, t.batch, k_pos0, skv, p);
  if (p.position_rule != PositionRule::full) p.features.add(Feature::causal);
  check_laser_input_scale(extra, p);
  // Dense backends ignore the layout but still reject one whose arithmetic overflows; its
  // readers check the rest (VideoTiling::build).
  if (meta.video_layout)
    validate_video_layout(*meta.video_layout, sq, VideoLayoutRules::arithmetic);

  // ---- the problem: shapes, joint rows, merged masks ----
  p.batch = t.batch;
  p.sq = sq;
  p.skv = skv;
  p.hq = t.hq;
  p.hkv = t.hkv;
  p.d = t.d;
  p.dv = t.dv;
  p.softmax_scale = softmax_scale;
  p.out = outputs.out;
  p.lse = outputs.lse;
  p.kv_cache_dtype = extra.kv_cache_dtype.value_or(config.kv_cache_dtype);
  p.backend_options = &extra.backend;
  p.threads = calling_threads();
  if (meta.video_layout) p.video_layout = &*meta.video_layout;
  if (outputs.lse) p.features.add(Feature::lse_output);

  // Joint rows stay in the caller's tensors; the problem reads them through q_row/k_row/v_row.
  p.q = t.q;
  p.k = t.k;
  p.v = t.v;
  if (J > 0) p.joint = JointRows{joint.q, joint.k, joint.v, front};

  resolve_mask(meta, config, options, masks, joint, front, call);
  build_segments(meta, varlen, packed_padding, ranges, k_pos0, J, front, p);

  p.signature = problem_signature(p);
  return call;
}

}  // namespace dattn::detail
