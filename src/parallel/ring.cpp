// Ring sequence parallelism (docs/semantics.md, "Sequence parallelism"): queries stay, K/V blocks
// travel around the ring, each step's partial (O, LSE) is merged into the result.
#include <algorithm>
#include <array>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "dattn/backend.hpp"
#include "dattn/errors.hpp"
#include "dattn/parallel.hpp"
#include "parallel/exchange.hpp"
#include "parallel/shard.hpp"

namespace dattn {

using parallel::i64;

RingParallel::RingParallel(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {
  if (!comm_) throw InvalidArgument("communicator", "communicator: must not be null");
}

int RingParallel::ranks() const {
  return comm_->size();
}

namespace {

// A partial result and the accumulator it merges into: f32 [B, S, H, Dv] and [B, H, S].
struct Partial {
  Tensor o, lse, part_o, part_lse;
  Partial(i64 batch, i64 rows, i64 heads, i64 dv)
      : o(Tensor::zeros({batch, rows, heads, dv}, DType::F32)),
        lse(Tensor::empty({batch, heads, rows}, DType::F32)),
        part_o(Tensor::empty({batch, rows, heads, dv}, DType::F32)),
        part_lse(Tensor::empty({batch, heads, rows}, DType::F32)) {
    std::fill_n(lse.data_as<float>(), lse.numel(), -std::numeric_limits<float>::infinity());
  }
};

void reject(const AttentionMetadata& m, bool causal) {
  const std::string who = "ring";
  if (m.attn_mask) parallel::unsupported(who, "attn_mask", "an attention mask");
  if (m.joint_attn_mask) parallel::unsupported(who, "joint_attn_mask", "a joint attention mask");
  if (m.extra.cu_seqlens_q || m.extra.cu_seqlens_k)
    parallel::unsupported(who, "cu_seqlens_q", "a packed variable-length batch");
  if (m.packed_padding) parallel::unsupported(who, "packed_padding", "packed padding");
  if (m.full_attn_spans) parallel::unsupported(who, "full_attn_spans", "piecewise attention");
  if (m.query_ranges || m.q_global_start || m.k_global_start)
    parallel::unsupported(who, "query_ranges",
                          "caller positions (the ring places the shards itself)");
  if (m.video_layout)
    parallel::unsupported(who, "video_layout",
                          "a video token layout (it describes the whole sequence; use ulysses)");
  if (causal && m.extra.valid_kv_length)
    parallel::unsupported(who, "valid_kv_length", "valid_kv_length with causal attention");
}

}  // namespace

void RingParallel::forward(const AttentionInputs& inputs, const ParallelContext& ctx,
                           const LocalAttention& local) const {
  Communicator& comm = *comm_;
  const int P = comm.size(), r = comm.rank();
  static const AttentionMetadata kNone{};
  const AttentionMetadata& meta = inputs.metadata ? *inputs.metadata : kNone;
  const AttentionMetadata base = parallel::without_joint(meta);

  // ---- 1. checks and the ranks' verdict, with everyone's lengths ----
  std::exception_ptr error;
  parallel::Shard s;
  std::vector<i64> header(parallel::kHeaderSize, 0);
  try {
    s = parallel::read_shard(inputs, ctx);
    reject(meta, ctx.causal);
    header = parallel::shard_header(s, false, meta);
  } catch (...) {
    error = std::current_exception();
  }
  const std::vector<i64> all = parallel::agree(comm, error, header);
  const parallel::ShardLengths lengths = parallel::check_headers(all, P);
  const std::vector<i64>& lkv = lengths.kv;
  const std::vector<i64>&offq = lengths.offq, &offkv = lengths.offkv;
  const i64 sq_all = lengths.sq_all(), skv_all = lengths.skv_all(), J = s.joint;
  const auto vl = meta.extra.valid_kv_length;
  if (vl && (*vl <= 0 || *vl > skv_all))
    throw InvalidArgument("valid_kv_length", "valid_kv_length: = " + std::to_string(*vl) +
                                                 " must satisfy 0 < v <= Skv = " +
                                                 std::to_string(skv_all) + " (all ranks' keys)");
  if (vl && J > 0 && !s.front)
    throw InvalidArgument("valid_kv_length",
                          "valid_kv_length: with joint tokens valid_kv_length needs joint_strategy "
                          "'front' (a key prefix)");

  // Global positions as on one process ([joint | image] or [image | joint], bottom-right);
  // shifted so that none is negative (only their order matters).
  const i64 shift = std::max<i64>(0, sq_all - skv_all);
  const i64 delta = skv_all - sq_all + shift;
  const i64 q_local_pos = delta + (s.front ? J : 0) + offq[std::size_t(r)];
  const i64 q_joint_pos = delta + (s.front ? 0 : sq_all);
  const i64 k_joint_pos = shift + (s.front ? 0 : skv_all);
  auto k_block_pos = [&](int src) { return shift + (s.front ? J : 0) + offkv[std::size_t(src)]; };

  const parallel::HeadSplit hs = parallel::split_heads(s.hq, s.hkv, P);
  const i64 jq0 = hs.q_start[std::size_t(r)], jqn = hs.q_count[std::size_t(r)];
  const i64 jk0 = hs.kv_start[std::size_t(r)], jkn = hs.kv_count[std::size_t(r)];

  Partial img(s.batch, s.sq, s.hq, s.dv);
  Partial jnt(s.batch, J, jqn, s.dv);

  // One (queries, keys) pair through the local kernel, merged into `acc`.
  auto attend = [&](const TensorView& q, i64 q_pos, const TensorView& k, const TensorView& v,
                    i64 k_pos, i64 heads, i64 kv_heads, Partial& acc, bool validate_only) {
    if (q.size(1) == 0 || heads == 0) return;
    if (!validate_only && k.size(1) == 0) return;
    if (ctx.causal && k_pos > q_pos + q.size(1) - 1) return;  // every key after every query
    AttentionMetadata m = base;
    m.extra.valid_kv_length.reset();
    m.q_global_start = q_pos;
    m.k_global_start = k_pos;
    AttentionInputs in{q, k, v, &m, acc.part_o.view(), acc.part_lse.view()};
    local({in, QkvLayout::BSHD, heads, kv_heads, validate_only});
    if (!validate_only)
      parallel::merge_partial(acc.o.view(), acc.lse.view(), acc.part_o.view(), acc.part_lse.view());
  };

  // ---- 2. this rank's own block is validated before anything moves ----
  try {
    attend(s.q, q_local_pos, s.k, s.v, k_block_pos(r), s.hq, s.hkv, img, true);
  } catch (...) {
    error = std::current_exception();
  }
  parallel::agree(comm, error);

  // ---- 3. the ring: K/V blocks packed contiguously, the next one in flight during compute ----
  const std::size_t ke = dtype_size(s.k.dtype()), ve = dtype_size(s.v.dtype());
  auto block_bytes = [&](int src) {
    const i64 n = s.batch * lkv[std::size_t(src)] * s.hkv;
    return std::size_t(n * s.d) * ke + std::size_t(n * s.dv) * ve;
  };
  std::size_t most = 1;
  for (int p = 0; p < P; ++p) most = std::max(most, block_bytes(p));
  std::array<std::unique_ptr<std::byte[]>, 2> buf{
      std::unique_ptr<std::byte[]>(new std::byte[most]),
      std::unique_ptr<std::byte[]>(P > 1 ? new std::byte[most] : nullptr)};
  auto block_views = [&](std::byte* data, int src) {
    const i64 len = lkv[std::size_t(src)];
    const std::array<i64, 4> ks{s.batch, len, s.hkv, s.d}, vs{s.batch, len, s.hkv, s.dv};
    TensorView k(data, s.k.dtype(), ks);
    TensorView v(data + std::size_t(s.batch * len * s.hkv * s.d) * ke, s.v.dtype(), vs);
    return std::pair{k, v};
  };
  {
    auto [k0, v0] = block_views(buf[0].get(), r);
    copy_into(s.k, k0);
    copy_into(s.v, v0);
  }
  for (int step = 0; step < P; ++step) {
    const int src = (r - step + P) % P;
    std::unique_ptr<PendingTransfer> transfer;
    if (step + 1 < P) {
      const int next_src = (src - 1 + P) % P;
      transfer = comm.start_send_recv(buf[std::size_t(step % 2)].get(), block_bytes(src),
                                      (r + 1) % P, buf[std::size_t((step + 1) % 2)].get(),
                                      block_bytes(next_src), (r - 1 + P) % P);
    }
    if (!error) {
      try {
        auto [kb, vb] = block_views(buf[std::size_t(step % 2)].get(), src);
        if (vl) {
          const i64 keep = std::clamp(*vl - offkv[std::size_t(src)], i64{0}, kb.size(1));
          kb = kb.sliced(1, 0, keep);
          vb = vb.sliced(1, 0, keep);
        }
        const i64 kpos = k_block_pos(src);
        if (step == 0 && J > 0 && !ctx.causal) {
          // Without causality positions do not matter: the joint keys and this rank's block
          // go through the kernel as one key sequence.
          const Tensor kc = Tensor::empty({s.batch, J + kb.size(1), s.hkv, s.d}, s.k.dtype());
          const Tensor vc = Tensor::empty({s.batch, J + kb.size(1), s.hkv, s.dv}, s.v.dtype());
          copy_into(*s.jk, kc.view().sliced(1, 0, J));
          copy_into(*s.jv, vc.view().sliced(1, 0, J));
          copy_into(kb, kc.view().sliced(1, J, kb.size(1)));
          copy_into(vb, vc.view().sliced(1, J, vb.size(1)));
          kb = kc.view();
          vb = vc.view();
          attend(s.q, q_local_pos, kb, vb, 0, s.hq, s.hkv, img, false);
          attend(s.jq->sliced(2, jq0, jqn), q_joint_pos, kb.sliced(2, jk0, jkn),
                 vb.sliced(2, jk0, jkn), 0, jqn, jkn, jnt, false);
        } else {
          if (step == 0 && J > 0) {
            attend(s.q, q_local_pos, *s.jk, *s.jv, k_joint_pos, s.hq, s.hkv, img, false);
            attend(s.jq->sliced(2, jq0, jqn), q_joint_pos, s.jk->sliced(2, jk0, jkn),
                   s.jv->sliced(2, jk0, jkn), k_joint_pos, jqn, jkn, jnt, false);
          }
          attend(s.q, q_local_pos, kb, vb, kpos, s.hq, s.hkv, img, false);
          if (J > 0)
            attend(s.jq->sliced(2, jq0, jqn), q_joint_pos, kb.sliced(2, jk0, jkn),
                   vb.sliced(2, jk0, jkn), kpos, jqn, jkn, jnt, false);
        }
      } catch (...) {
        error = std::current_exception();  // keep the ring turning; the ranks agree below
      }
    }
    if (transfer) transfer->wait();
  }
  parallel::agree(comm, error);

  // ---- 4. results: local rows as they are, joint rows gathered over heads ----
  copy_into(img.o.view(), s.out.sliced(1, s.out_local0(), s.sq));
  if (s.lse) copy_into(img.lse.view(), s.lse->sliced(2, s.out_local0(), s.sq));
  if (J > 0) {
    const Tensor jo = Tensor::copy_of(jnt.o.view(), s.out.dtype());
    std::vector<TensorView> send, recv;
    for (int p = 0; p < P; ++p) {
      const auto u = std::size_t(p);
      send.push_back(jo.view());
      recv.push_back(s.out.sliced(1, s.out_joint0(), J).sliced(2, hs.q_start[u], hs.q_count[u]));
      if (s.lse) {
        send.push_back(jnt.lse.view());
        recv.push_back(s.lse->sliced(2, s.out_joint0(), J).sliced(1, hs.q_start[u], hs.q_count[u]));
      }
    }
    parallel::exchange_views(comm, send, recv);
  }
}

}  // namespace dattn
