// Ulysses sequence parallelism (docs/semantics.md, "Sequence parallelism"): rows -> heads
// all-to-all, attention on a head block over the whole sequence, heads -> rows all-to-all back.
#include <array>
#include <string>
#include <vector>

#include "dattn/backend.hpp"
#include "dattn/errors.hpp"
#include "dattn/parallel.hpp"
#include "parallel/exchange.hpp"
#include "parallel/shard.hpp"

namespace dattn {

using parallel::i64;

UlyssesParallel::UlyssesParallel(std::shared_ptr<Communicator> comm, bool strict,
                                 std::shared_ptr<const ParallelStrategy> inner,
                                 std::shared_ptr<Communicator> verdict)
    : comm_(std::move(comm)),
      strict_(strict),
      inner_(std::move(inner)),
      verdict_(verdict ? std::move(verdict) : comm_) {
  if (!comm_) throw InvalidArgument("communicator", "communicator: must not be null");
}

std::string UlyssesParallel::name() const {
  if (inner_)
    return "hybrid:" + std::to_string(comm_->size()) + "x" + std::to_string(inner_->ranks());
  return strict_ ? "ulysses-strict" : "ulysses";
}

int UlyssesParallel::ranks() const {
  return comm_->size() * (inner_ ? inner_->ranks() : 1);
}

void UlyssesParallel::forward(const AttentionInputs& inputs, const ParallelContext& ctx,
                              const LocalAttention& local) const {
  Communicator& comm = *comm_;
  const int P = comm.size(), r = comm.rank();
  const std::string who = name();
  static const AttentionMetadata kNone{};
  const AttentionMetadata& meta = inputs.metadata ? *inputs.metadata : kNone;

  // ---- 1. this rank's checks, then the verdict of all ranks with everyone's lengths ----
  std::exception_ptr error;
  parallel::Shard s;
  bool key_mask = false;
  std::vector<i64> header(parallel::kHeaderSize, 0);
  try {
    s = parallel::read_shard(inputs, ctx);
    key_mask = parallel::rank_key_mask(meta, s, who);
    if (strict_ && (s.hq % P != 0 || s.hkv % P != 0))
      throw InvalidArgument("num_heads", "num_heads: strict Ulysses needs num_heads (" +
                                             std::to_string(s.hq) + ") and num_kv_heads (" +
                                             std::to_string(s.hkv) + ") divisible by " +
                                             std::to_string(P) + " ranks; use uneven Ulysses");
    header = parallel::shard_header(s, key_mask, meta);
  } catch (...) {
    error = std::current_exception();
  }
  std::vector<i64> all;
  if (verdict_ == comm_) {
    all = parallel::agree(comm, error, header);
  } else {  // every rank of the hybrid agrees, then this group shares its lengths
    parallel::agree(*verdict_, error);
    all = parallel::agree(comm, nullptr, header);
  }
  parallel::ShardLengths lengths;
  try {  // the same verdict on every rank of the group; under hybrid, shared with all groups
    lengths = parallel::check_headers(all, P);
    for (int p = 0; p < P; ++p)
      if (strict_ && (lengths.q[std::size_t(p)] != lengths.q[0] ||
                      lengths.kv[std::size_t(p)] != lengths.kv[0]))
        throw InvalidArgument("query", "query: strict Ulysses needs equal shards; rank " +
                                           std::to_string(p) + " has " +
                                           std::to_string(lengths.q[std::size_t(p)]) +
                                           " rows, rank 0 has " + std::to_string(lengths.q[0]));
  } catch (...) {
    error = std::current_exception();
  }
  if (verdict_ != comm_ || error) parallel::agree(*verdict_, error);
  const std::vector<i64>&lq = lengths.q, &lkv = lengths.kv;
  const std::vector<i64>&offq = lengths.offq, &offkv = lengths.offkv;
  const i64 sq_all = lengths.sq_all(), skv_all = lengths.skv_all();
  const parallel::HeadSplit hs = parallel::split_heads(s.hq, s.hkv, P);
  const i64 qh0 = hs.q_start[std::size_t(r)], qhn = hs.q_count[std::size_t(r)];
  const i64 kh0 = hs.kv_start[std::size_t(r)], khn = hs.kv_count[std::size_t(r)];

  // ---- 2. the call the kernel will see (all heads, whole sequence), checked on placeholders
  // before anything moves: the metadata describes the whole sequence. (Under hybrid this
  // group holds a part of it: the ring checks its calls itself.) ----
  const i64 rows = s.joint + sq_all;
  const std::array<i64, 4> q_all{s.batch, sq_all, s.hq, s.d}, k_all{s.batch, skv_all, s.hkv, s.d},
      v_all{s.batch, skv_all, s.hkv, s.dv}, o_all{s.batch, rows, s.hq, s.dv};
  const std::array<i64, 3> l_all{s.batch, s.hq, rows};
  const std::array<i64, 2> m_all{s.batch, skv_all};
  if (!inner_) try {
      AttentionMetadata m = meta;
      if (key_mask) m.attn_mask = TensorView(nullptr, DType::Bool, m_all);
      if (s.joint > 0) m.joint_query = *s.jq, m.joint_key = *s.jk, m.joint_value = *s.jv;
      AttentionInputs in{
          TensorView(nullptr, s.q.dtype(), q_all),   TensorView(nullptr, s.k.dtype(), k_all),
          TensorView(nullptr, s.v.dtype(), v_all),   &m,
          TensorView(nullptr, s.out.dtype(), o_all), std::nullopt};
      if (s.lse) in.lse = TensorView(nullptr, DType::F32, l_all);
      local({in, QkvLayout::BSHD, s.hq, s.hkv, true});
    } catch (...) {
      error = std::current_exception();
    }
  parallel::agree(*verdict_, error);

  // ---- 3. rows -> heads: Q, K, V (and the key mask) of every rank for this rank's heads ----
  const Tensor qg = Tensor::empty({s.batch, sq_all, qhn, s.d}, s.q.dtype());
  const Tensor kg = Tensor::empty({s.batch, skv_all, khn, s.d}, s.k.dtype());
  const Tensor vg = Tensor::empty({s.batch, skv_all, khn, s.dv}, s.v.dtype());
  Tensor mg;
  {
    if (key_mask) mg = Tensor::empty({s.batch, skv_all}, DType::Bool);
    std::vector<TensorView> send, recv;
    for (int p = 0; p < P; ++p) {
      const auto u = std::size_t(p);
      send.push_back(s.q.sliced(2, hs.q_start[u], hs.q_count[u]));
      send.push_back(s.k.sliced(2, hs.kv_start[u], hs.kv_count[u]));
      send.push_back(s.v.sliced(2, hs.kv_start[u], hs.kv_count[u]));
      recv.push_back(qg.view().sliced(1, offq[u], lq[u]));
      recv.push_back(kg.view().sliced(1, offkv[u], lkv[u]));
      recv.push_back(vg.view().sliced(1, offkv[u], lkv[u]));
      if (key_mask) {
        send.push_back(*meta.attn_mask);
        recv.push_back(mg.view().sliced(1, offkv[u], lkv[u]));
      }
    }
    parallel::exchange_views(comm, send, recv);
  }

  // ---- 4. attention on this rank's heads over the whole sequence ----
  const Tensor og = Tensor::zeros({s.batch, rows, qhn, s.dv}, s.out.dtype());
  Tensor lg;
  if (s.lse) lg = Tensor::zeros({s.batch, qhn, rows}, DType::F32);
  if (qhn > 0) {
    try {
      AttentionMetadata m = meta;
      if (key_mask) m.attn_mask = mg.view();
      if (meta.attn_mask && meta.attn_mask->ndim() == 4 && meta.attn_mask->size(1) != 1 &&
          meta.attn_mask->size(1) == s.hq)
        m.attn_mask = meta.attn_mask->sliced(1, qh0, qhn);
      if (s.joint > 0) {
        m.joint_query = s.jq->sliced(2, qh0, qhn);
        m.joint_key = s.jk->sliced(2, kh0, khn);
        m.joint_value = s.jv->sliced(2, kh0, khn);
      }
      AttentionInputs in{qg.view(), kg.view(), vg.view(), &m, og.view(), std::nullopt};
      if (s.lse) in.lse = lg.view();
      if (inner_) {
        ParallelContext inner_ctx = ctx;
        inner_ctx.layout = QkvLayout::BSHD;
        inner_ctx.num_heads = qhn;
        inner_ctx.num_kv_heads = khn;
        inner_->forward(in, inner_ctx, local);
      } else {
        local({in, QkvLayout::BSHD, qhn, khn, false});
      }
    } catch (...) {
      error = std::current_exception();
    }
  }
  parallel::agree(*verdict_, error);

  // ---- 5. heads -> rows: local rows of every head block; joint rows gathered over heads ----
  std::vector<TensorView> send, recv;
  const i64 g_joint0 = s.front ? 0 : sq_all, g_local0 = s.front ? s.joint : 0;
  for (int p = 0; p < P; ++p) {
    const auto u = std::size_t(p);
    send.push_back(og.view().sliced(1, g_local0 + offq[u], lq[u]));
    recv.push_back(s.out.sliced(1, s.out_local0(), s.sq).sliced(2, hs.q_start[u], hs.q_count[u]));
    send.push_back(og.view().sliced(1, g_joint0, s.joint));
    recv.push_back(
        s.out.sliced(1, s.out_joint0(), s.joint).sliced(2, hs.q_start[u], hs.q_count[u]));
    if (s.lse) {
      send.push_back(lg.view().sliced(2, g_local0 + offq[u], lq[u]));
      recv.push_back(
          s.lse->sliced(2, s.out_local0(), s.sq).sliced(1, hs.q_start[u], hs.q_count[u]));
      send.push_back(lg.view().sliced(2, g_joint0, s.joint));
      recv.push_back(
          s.lse->sliced(2, s.out_joint0(), s.joint).sliced(1, hs.q_start[u], hs.q_count[u]));
    }
  }
  parallel::exchange_views(comm, send, recv);
}

}  // namespace dattn
