// AllGather-KV sequence parallelism (docs/semantics.md, "Sequence parallelism"): every rank gathers
// all K/V and attends its own query rows against them.
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/prepare_call.hpp"
#include "dattn/backend.hpp"
#include "dattn/errors.hpp"
#include "dattn/parallel.hpp"
#include "parallel/exchange.hpp"
#include "parallel/shard.hpp"

namespace dattn {

using parallel::i64;

AllGatherKvParallel::AllGatherKvParallel(std::shared_ptr<Communicator> comm)
    : comm_(std::move(comm)) {
  if (!comm_) throw InvalidArgument("communicator", "communicator: must not be null");
}

int AllGatherKvParallel::ranks() const {
  return comm_->size();
}

namespace {

// cu_seqlens through the validator's reader; at least [0, total].
std::vector<i64> read_cu(const TensorView& t, const char* field) {
  std::vector<i64> v = detail::read_int32_vector(t, field);
  if (v.size() < 2)
    throw InvalidArgument(field,
                          std::string(field) + ": expected int32 [docs + 1], got " + t.describe());
  return v;
}

// Local query ranges: the global ranges (or one range at `q_start`) intersected with the local
// rows [off, off + rows), renumbered from 0.
std::vector<QueryRange> local_ranges(const std::vector<QueryRange>& global, i64 off, i64 rows) {
  std::vector<QueryRange> out;
  for (const QueryRange& g : global) {
    const i64 a = std::max(g.local_start, off), e = std::min(g.local_end, off + rows);
    if (a < e) out.push_back({a - off, e - off, g.global_start + (a - g.local_start)});
  }
  return out;
}

}  // namespace

void AllGatherKvParallel::forward(const AttentionInputs& inputs, const ParallelContext& ctx,
                                  const LocalAttention& local) const {
  Communicator& comm = *comm_;
  const int P = comm.size(), r = comm.rank();
  const std::string who = "allgather";
  static const AttentionMetadata kNone{};
  const AttentionMetadata& meta = inputs.metadata ? *inputs.metadata : kNone;

  // ---- 1. checks and the verdict, with everyone's lengths ----
  std::exception_ptr error;
  parallel::Shard s;
  bool key_mask = false;
  std::vector<i64> header(parallel::kHeaderSize, 0);
  try {
    s = parallel::read_shard(inputs, ctx);
    if (ctx.causal) parallel::unsupported(who, "causal", "causal attention");
    if (meta.packed_padding) parallel::unsupported(who, "packed_padding", "packed padding");
    if (meta.video_layout)
      parallel::unsupported(who, "video_layout",
                            "a video token layout (it describes the whole sequence; use ulysses)");
    key_mask = parallel::rank_key_mask(meta, s, who);
    if (meta.joint_attn_mask) {
      const TensorView& jm = *meta.joint_attn_mask;
      if (jm.dtype() != DType::Bool || jm.ndim() != 2 || jm.size(0) != s.batch ||
          jm.size(1) != s.joint)
        throw InvalidArgument("joint_attn_mask",
                              "joint_attn_mask: expected bool [" + std::to_string(s.batch) + ", " +
                                  std::to_string(s.joint) + "], got " + jm.describe());
      if (meta.attn_mask && meta.attn_mask->ndim() != 2)
        throw InvalidArgument("joint_attn_mask",
                              "joint_attn_mask: combines only with a 2-D attn_mask");
    }
    if (s.joint > 0 && (meta.extra.cu_seqlens_q || meta.full_attn_spans || meta.query_ranges ||
                        meta.q_global_start || meta.k_global_start))
      throw InvalidArgument("joint_query",
                            "joint_query: joint tokens cannot be combined with cu_seqlens, "
                            "full_attn_spans, query_ranges or global starts");
    if (meta.extra.valid_kv_length && s.joint > 0 && !s.front)
      throw InvalidArgument("valid_kv_length",
                            "valid_kv_length: with joint tokens valid_kv_length needs "
                            "joint_strategy 'front' (a key prefix)");
    if (meta.extra.cu_seqlens_q && meta.extra.cu_seqlens_k && s.batch != 1)
      throw InvalidArgument("cu_seqlens_q", "cu_seqlens_q: packed batches need batch 1");
    header = parallel::shard_header(s, key_mask, meta);
  } catch (...) {
    error = std::current_exception();
  }
  const std::vector<i64> all = parallel::agree(comm, error, header);
  const parallel::ShardLengths lengths = parallel::check_headers(all, P);
  const std::vector<i64>& lkv = lengths.kv;
  const std::vector<i64>&offq = lengths.offq, &offkv = lengths.offkv;
  const i64 sq_all = lengths.sq_all(), skv_all = lengths.skv_all(), J = s.joint;
  const i64 off = offq[std::size_t(r)];
  const i64 kv_rows = J + skv_all;
  const i64 k_local0 = s.front ? J : 0, k_joint0 = s.front ? 0 : skv_all;
  const bool merged_mask = key_mask || meta.joint_attn_mask.has_value();

  const parallel::HeadSplit hs = parallel::split_heads(s.hq, s.hkv, P);
  const i64 jq0 = hs.q_start[std::size_t(r)], jqn = hs.q_count[std::size_t(r)];
  const i64 jk0 = hs.kv_start[std::size_t(r)], jkn = hs.kv_count[std::size_t(r)];
  const i64 q_rows_all = J + sq_all;
  const i64 q_local0 = (s.front ? J : 0) + off, q_joint0 = s.front ? 0 : sq_all;
  const bool self_rows = !ctx.cross_role && sq_all == skv_all;
  const bool mask_skipped =
      meta.extra.attention_mask_mode && *meta.extra.attention_mask_mode == AttentionMaskMode::none;
  Tensor cu_local;

  // One call: query rows `q` (rows from row0 of the whole query sequence, heads h0..h0+hn)
  // against all keys `kall`/`vall` (KV heads kh0..kh0+khn) with the merged key mask `keys`.
  auto run = [&](const TensorView& q, i64 row0, i64 h0, i64 hn, i64 kh0, i64 khn,
                 const TensorView& kall, const TensorView& vall,
                 const std::optional<TensorView>& keys, const TensorView& o, const TensorView& l,
                 bool validate) {
    if (q.size(1) == 0 || hn == 0) return;
    AttentionMetadata m = parallel::without_joint(meta);
    if (keys) m.attn_mask = *keys;
    if (meta.extra.valid_kv_length && J > 0)
      m.extra.valid_kv_length = *meta.extra.valid_kv_length + J;
    if (meta.attn_mask && meta.attn_mask->ndim() >= 3) {  // whole-sequence mask: rows and heads
      const TensorView& am = *meta.attn_mask;
      if (am.size(am.ndim() - 2) != q_rows_all)
        throw InvalidArgument(
            "attn_mask", "attn_mask: under allgather a " + std::to_string(am.ndim()) +
                             "-D mask covers all ranks' query rows (" + std::to_string(q_rows_all) +
                             "), got " + am.describe());
      TensorView rows = am.sliced(am.ndim() - 2, row0, q.size(1));
      if (am.ndim() == 4 && am.size(1) == s.hq && s.hq != 1) rows = rows.sliced(1, h0, hn);
      m.attn_mask = rows;
    }
    if (meta.extra.cu_seqlens_q) {
      const std::vector<i64> cq = read_cu(*meta.extra.cu_seqlens_q, "cu_seqlens_q");
      if (cq.back() != sq_all)
        throw InvalidArgument("cu_seqlens_q",
                              "cu_seqlens_q: under allgather it describes all "
                              "ranks' rows; last entry " +
                                  std::to_string(cq.back()) + " != " + std::to_string(sq_all));
      cu_local = Tensor::empty({i64(cq.size())}, DType::I32);
      auto* c = cu_local.data_as<std::int32_t>();
      i64 longest = 0;
      for (std::size_t i = 0; i < cq.size(); ++i) {
        c[i] = static_cast<std::int32_t>(std::clamp(cq[i] - off, i64{0}, q.size(1)));
        if (i > 0) longest = std::max<i64>(longest, c[i] - c[i - 1]);
      }
      m.extra.cu_seqlens_q = cu_local.view();
      m.extra.max_seqlen_q = std::max<i64>(longest, 1);
    } else {
      // Positions of these rows as on one process (bottom-right unless the caller says).
      std::vector<QueryRange> global;
      if (meta.query_ranges) {
        global = *meta.query_ranges;
        if (global.empty() || global.back().local_end != sq_all)
          throw InvalidArgument("query_ranges",
                                "query_ranges: under allgather they describe all "
                                "ranks' rows [0, " +
                                    std::to_string(sq_all) + ")");
      } else {
        global.push_back({0, q_rows_all, meta.q_global_start.value_or(kv_rows - q_rows_all)});
      }
      m.q_global_start.reset();
      m.query_ranges = local_ranges(global, row0, q.size(1));
    }
    AttentionInputs in{q, kall.sliced(2, kh0, khn), vall.sliced(2, kh0, khn), &m, o, l};
    local({in, QkvLayout::BSHD, hn, khn, validate});
    // Self-attention with a key mask: a query row whose own key is masked is padding.
    if (!validate && keys && self_rows && !mask_skipped) {
      const auto* keep = static_cast<const std::uint8_t*>(keys->data());
      const Tensor zero = Tensor::zeros({1, 1, hn, s.dv}, o.dtype());
      for (i64 b = 0; b < s.batch; ++b)
        for (i64 i = 0; i < q.size(1); ++i)
          if (keep[b * kv_rows + row0 + i] == 0) {
            copy_into(zero.view(), o.sliced(0, b, 1).sliced(1, i, 1));
            for (i64 h = 0; h < hn; ++h)
              static_cast<float*>(l.data())[(b * hn + h) * q.size(1) + i] =
                  -std::numeric_limits<float>::infinity();
          }
    }
  };
  auto both = [&](const TensorView& kall, const TensorView& vall,
                  const std::optional<TensorView>& keys, const TensorView& lo, const TensorView& ll,
                  const TensorView& jo, const TensorView& jl, bool validate) {
    run(s.q, q_local0, 0, s.hq, 0, s.hkv, kall, vall, keys, lo, ll, validate);
    if (J > 0)
      run(s.jq->sliced(2, jq0, jqn), q_joint0, jq0, jqn, jk0, jkn, kall, vall, keys, jo, jl,
          validate);
  };

  // ---- 2. the calls this rank will make, checked on placeholders before anything moves ----
  const std::array<i64, 4> kshape{s.batch, kv_rows, s.hkv, s.d},
      vshape{s.batch, kv_rows, s.hkv, s.dv};
  const std::array<i64, 2> mshape{s.batch, kv_rows};
  const std::array<i64, 4> loshape{s.batch, s.sq, s.hq, s.dv}, joshape{s.batch, J, jqn, s.dv};
  const std::array<i64, 3> llshape{s.batch, s.hq, s.sq}, jlshape{s.batch, jqn, J};
  try {
    std::optional<TensorView> keys;
    if (merged_mask) keys = TensorView(nullptr, DType::Bool, mshape);
    both(TensorView(nullptr, s.k.dtype(), kshape), TensorView(nullptr, s.v.dtype(), vshape), keys,
         TensorView(nullptr, s.out.dtype(), loshape), TensorView(nullptr, DType::F32, llshape),
         TensorView(nullptr, s.out.dtype(), joshape), TensorView(nullptr, DType::F32, jlshape),
         true);
  } catch (...) {
    error = std::current_exception();
  }
  parallel::agree(comm, error);

  // ---- 3. K/V (and the key mask) of every rank, joint rows in strategy order ----
  const Tensor kf = Tensor::empty(kshape, s.k.dtype());
  const Tensor vf = Tensor::empty(vshape, s.v.dtype());
  Tensor mf;
  if (J > 0) {
    copy_into(*s.jk, kf.view().sliced(1, k_joint0, J));
    copy_into(*s.jv, vf.view().sliced(1, k_joint0, J));
  }
  if (merged_mask) {
    mf = Tensor::empty(mshape, DType::Bool);
    std::fill_n(mf.data_as<std::uint8_t>(), mf.numel(), std::uint8_t{1});
    if (meta.joint_attn_mask) copy_into(*meta.joint_attn_mask, mf.view().sliced(1, k_joint0, J));
  }
  {
    std::vector<TensorView> send, recv;
    for (int p = 0; p < P; ++p) {
      const auto u = std::size_t(p);
      send.push_back(s.k);
      send.push_back(s.v);
      recv.push_back(kf.view().sliced(1, k_local0 + offkv[u], lkv[u]));
      recv.push_back(vf.view().sliced(1, k_local0 + offkv[u], lkv[u]));
      if (key_mask) {
        send.push_back(*meta.attn_mask);
        recv.push_back(mf.view().sliced(1, k_local0 + offkv[u], lkv[u]));
      }
    }
    parallel::exchange_views(comm, send, recv);
  }

  // ---- 4. local query rows (all heads) and joint query rows (a head block) ----
  const Tensor lo = Tensor::zeros(loshape, s.out.dtype());
  const Tensor ll = Tensor::zeros(llshape, DType::F32);
  const Tensor jo = Tensor::zeros(joshape, s.out.dtype());
  const Tensor jl = Tensor::zeros(jlshape, DType::F32);
  try {
    std::optional<TensorView> keys;
    if (merged_mask) keys = mf.view();
    both(kf.view(), vf.view(), keys, lo.view(), ll.view(), jo.view(), jl.view(), false);
  } catch (...) {
    error = std::current_exception();
  }
  parallel::agree(comm, error);

  // ---- 5. results ----
  copy_into(lo.view(), s.out.sliced(1, s.out_local0(), s.sq));
  if (s.lse) copy_into(ll.view(), s.lse->sliced(2, s.out_local0(), s.sq));
  if (J > 0) {
    std::vector<TensorView> send, recv;
    for (int p = 0; p < P; ++p) {
      const auto u = std::size_t(p);
      send.push_back(jo.view());
      recv.push_back(s.out.sliced(1, s.out_joint0(), J).sliced(2, hs.q_start[u], hs.q_count[u]));
      if (s.lse) {
        send.push_back(jl.view());
        recv.push_back(s.lse->sliced(2, s.out_joint0(), J).sliced(1, hs.q_start[u], hs.q_count[u]));
      }
    }
    parallel::exchange_views(comm, send, recv);
  }
}

}  // namespace dattn
