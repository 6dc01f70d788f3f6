#include "parallel/shard.hpp"

#include <array>
#include <cstdint>
#include <string>

#include "core/prepare_call.hpp"
#include "dattn/backend.hpp"
#include "dattn/errors.hpp"

namespace dattn::parallel {

namespace {

[[noreturn]] void invalid(const std::string& field, const std::string& msg) {
  throw InvalidArgument(field, field + ": " + msg);
}

std::string dims(std::initializer_list<i64> d) {
  std::string s = "[";
  for (i64 x : d) s += (s.size() > 1 ? ", " : "") + std::to_string(x);
  return s + "]";
}

TensorView checked(const TensorView& t, QkvLayout layout, const char* field) {
  const TensorView v = detail::to_bshd(t, layout, field);
  if (v.platform() != Platform::cpu)
    throw Unsupported(field, std::string(field) + ": sequence parallelism runs on cpu tensors");
  return v;
}

void require_float(const TensorView& t, const char* field) {
  if (!is_float_input_dtype(t.dtype()))
    invalid(field,
            "dtype " + std::string(dtype_name(t.dtype())) + " is not valid; valid: f32, bf16, f16");
}

}  // namespace

Shard read_shard(const AttentionInputs& in, const ParallelContext& ctx) {
  static const AttentionMetadata kNone{};
  const AttentionMetadata& meta = in.metadata ? *in.metadata : kNone;
  Shard s;
  s.q = checked(in.q, ctx.layout, "query");
  s.k = checked(in.k, ctx.layout, "key");
  s.v = checked(in.v, ctx.layout, "value");
  s.out = checked(in.out, ctx.layout, "out");
  require_float(s.q, "query");
  require_float(s.k, "key");
  require_float(s.v, "value");
  require_float(s.out, "out");
  s.batch = s.q.size(0), s.sq = s.q.size(1), s.hq = s.q.size(2), s.d = s.q.size(3);
  s.skv = s.k.size(1), s.hkv = s.k.size(2), s.dv = s.v.size(3);
  if (s.hq != ctx.num_heads)
    invalid("query",
            "has " + std::to_string(s.hq) +
                " heads; the layer was built with num_heads = " + std::to_string(ctx.num_heads));
  if (s.hkv != ctx.num_kv_heads)
    invalid("key", "has " + std::to_string(s.hkv) +
                       " heads; the layer was built with num_kv_heads = " +
                       std::to_string(ctx.num_kv_heads));
  if (s.k.size(0) != s.batch || s.k.size(3) != s.d)
    invalid("key", "expected " + dims({s.batch, s.skv, s.hkv, s.d}) + " (BSHD order), got " +
                       s.k.describe());
  if (s.v.size(0) != s.batch || s.v.size(1) != s.skv || s.v.size(2) != s.hkv)
    invalid("value", "expected " + dims({s.batch, s.skv, s.hkv, s.dv}) + " (BSHD order), got " +
                         s.v.describe());
  const int joint_count = int(meta.joint_query.has_value()) + int(meta.joint_key.has_value()) +
                          int(meta.joint_value.has_value());
  if (joint_count != 0 && joint_count != 3)
    invalid(!meta.joint_query ? "joint_query"
            : !meta.joint_key ? "joint_key"
                              : "joint_value",
            "joint_query, joint_key and joint_value come all three or none; this one is missing");
  s.front = meta.joint_strategy == JointStrategy::front;
  if (joint_count == 3) {
    s.jq = checked(*meta.joint_query, ctx.layout, "joint_query");
    s.jk = checked(*meta.joint_key, ctx.layout, "joint_key");
    s.jv = checked(*meta.joint_value, ctx.layout, "joint_value");
    require_float(*s.jq, "joint_query");
    require_float(*s.jk, "joint_key");
    require_float(*s.jv, "joint_value");
    s.joint = s.jq->size(1);
    const std::array<std::pair<const TensorView*, std::array<i64, 3>>, 3> want{
        {{&*s.jq, {s.batch, s.hq, s.d}},
         {&*s.jk, {s.batch, s.hkv, s.d}},
         {&*s.jv, {s.batch, s.hkv, s.dv}}}};
    const std::array<const char*, 3> names{"joint_query", "joint_key", "joint_value"};
    for (std::size_t i = 0; i < 3; ++i) {
      const TensorView& t = *want[i].first;
      const auto& e = want[i].second;
      if (t.size(0) != e[0] || t.size(1) != s.joint || t.size(2) != e[1] || t.size(3) != e[2])
        invalid(names[i], "expected " + dims({e[0], s.joint, e[1], e[2]}) + " (BSHD order), got " +
                              t.describe());
    }
  } else if (meta.joint_attn_mask) {
    invalid("joint_attn_mask", "given without joint_query/joint_key/joint_value");
  }
  const i64 rows = s.sq + s.joint;
  if (s.out.size(0) != s.batch || s.out.size(1) != rows || s.out.size(2) != s.hq ||
      s.out.size(3) != s.dv)
    invalid("out", "expected " + dims({s.batch, rows, s.hq, s.dv}) +
                       " (BSHD order, joint rows included), got " + s.out.describe());
  if (in.lse) {
    const TensorView l =
        ctx.layout == QkvLayout::THD && in.lse->ndim() == 2 ? in.lse->unsqueezed(0) : *in.lse;
    if (l.dtype() != DType::F32 || l.ndim() != 3 || l.size(0) != s.batch || l.size(1) != s.hq ||
        l.size(2) != rows)
      invalid("lse", "expected f32 " + dims({s.batch, s.hq, rows}) + ", got " + in.lse->describe());
    s.lse = l;
  }
  return s;
}

namespace {

i64 mix(i64 h, i64 x) {
  auto u = static_cast<std::uint64_t>(h) ^ static_cast<std::uint64_t>(x);
  u *= 0x100000001b3ull;
  u ^= u >> 29;
  return static_cast<i64>(u);
}

i64 mix_ints(i64 h, const std::optional<TensorView>& t) {
  if (!t) return mix(h, -1);
  h = mix(h, t->numel());
  if (t->dtype() == DType::I32 && t->ndim() == 1)
    for (i64 i = 0; i < t->size(0); ++i)
      h = mix(h, static_cast<const std::int32_t*>(t->data())[i * t->stride(0)]);
  return h;
}

}  // namespace

i64 metadata_fingerprint(const AttentionMetadata& m) {
  i64 h = 0x6461747461;
  const Extra& e = m.extra;
  h = mix(h, e.kv_cache_dtype ? i64(*e.kv_cache_dtype) : -1);
  h = mix_ints(h, e.cu_seqlens_q);
  h = mix_ints(h, e.cu_seqlens_k);
  h = mix(h, e.max_seqlen_q.value_or(-1));
  h = mix(h, e.max_seqlen_k.value_or(-1));
  h = mix(h, e.attention_mask_mode ? i64(*e.attention_mask_mode) : -1);
  h = mix(h, e.laser_input_scale ? static_cast<i64>(*e.laser_input_scale * 1048576.0) : -1);
  h = mix(h, m.full_attn_spans ? i64(m.full_attn_spans->size()) : -1);
  if (m.full_attn_spans)
    for (const auto& spans : *m.full_attn_spans)
      for (const auto& [a, b] : spans) h = mix(mix(h, a), b);
  h = mix(h, m.query_ranges ? i64(m.query_ranges->size()) : -1);
  if (m.query_ranges)
    for (const QueryRange& r : *m.query_ranges)
      h = mix(mix(mix(h, r.local_start), r.local_end), r.global_start);
  h = mix(h, m.q_global_start.value_or(-1));
  h = mix(h, m.k_global_start.value_or(-1));
  h = mix(h, m.packed_padding ? m.packed_padding->q_length : -1);
  h = mix(h, m.packed_padding ? m.packed_padding->kv_length : -1);
  h = mix(h, m.joint_attn_mask ? 1 : 0);
  if (m.attn_mask && m.attn_mask->ndim() != 2) {
    h = mix(h, m.attn_mask->ndim());
    for (int i = 0; i < m.attn_mask->ndim(); ++i) h = mix(h, m.attn_mask->size(i));
    h = mix(h, i64(m.attn_mask->dtype()));
  }
  return h;
}

std::vector<i64> shard_header(const Shard& s, bool key_mask, const AttentionMetadata& m) {
  return {s.sq,
          s.skv,
          s.joint,
          key_mask ? 1 : 0,
          s.batch,
          s.hq,
          s.hkv,
          s.d,
          s.dv,
          static_cast<i64>(s.q.dtype()),
          static_cast<i64>(s.k.dtype()),
          static_cast<i64>(s.v.dtype()),
          static_cast<i64>(s.out.dtype()),
          s.lse ? 1 : 0,
          m.extra.valid_kv_length.value_or(-1),
          s.front ? 1 : 0,
          metadata_fingerprint(m)};
}

ShardLengths check_headers(const std::vector<i64>& all, int ranks) {
  static const std::array<const char*, kHeaderSize> field{
      "query", "key",   "joint_query",     "attn_mask",      "query",   "query",
      "key",   "query", "value",           "query",          "key",     "value",
      "out",   "lse",   "valid_kv_length", "joint_strategy", "metadata"};
  static const std::array<const char*, kHeaderSize> what{
      "",
      "",
      "joint rows (replicated on every rank)",
      "a 2-D key mask (on every rank or none)",
      "batch",
      "query heads",
      "key/value heads",
      "head size",
      "value head size",
      "query dtype",
      "key dtype",
      "value dtype",
      "output dtype",
      "LSE output (wanted on every rank or none)",
      "valid_kv_length",
      "joint_strategy",
      "the metadata of the whole sequence (cu_seqlens, spans, positions, "
      "mask mode and shape, kv_cache_dtype, laser_input_scale)"};
  ShardLengths l;
  for (int p = 0; p < ranks; ++p) {
    const std::size_t at = std::size_t(p) * kHeaderSize;
    l.q.push_back(all[at]);
    l.kv.push_back(all[at + 1]);
    for (std::size_t i = 2; i < kHeaderSize; ++i)
      if (all[at + i] != all[i])
        invalid(field[i], std::string(what[i]) + " differs between ranks: rank " +
                              std::to_string(p) + " has " + std::to_string(all[at + i]) +
                              ", rank 0 has " + std::to_string(all[i]));
  }
  l.offq = exclusive_offsets(l.q);
  l.offkv = exclusive_offsets(l.kv);
  return l;
}

bool rank_key_mask(const AttentionMetadata& meta, const Shard& s, const std::string& who) {
  if (!meta.attn_mask || meta.attn_mask->ndim() != 2) return false;
  const TensorView& m = *meta.attn_mask;
  if (m.dtype() != DType::Bool || m.size(0) != s.batch || m.size(1) != s.skv)
    invalid("attn_mask", "a 2-D mask under " + who + " is this rank's bool key mask " +
                             dims({s.batch, s.skv}) + ", got " + m.describe());
  return true;
}

AttentionMetadata without_joint(const AttentionMetadata& meta) {
  AttentionMetadata m = meta;
  m.joint_query.reset();
  m.joint_key.reset();
  m.joint_value.reset();
  m.joint_attn_mask.reset();
  return m;
}

void unsupported(const std::string& strategy, const std::string& field, const std::string& what) {
  throw Unsupported(
      field, field + ": " + what + " is not supported by " + strategy + " sequence parallelism");
}

}  // namespace dattn::parallel
