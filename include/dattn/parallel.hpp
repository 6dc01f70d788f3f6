// Sequence parallelism (docs/semantics.md, "Sequence parallelism"): the seam between the layer and
// the strategies, and the strategies over a Communicator. Image rows are split contiguously over
// the ranks (any lengths; shard_rows gives the usual split); joint rows are replicated on every
// rank. Each rank calls the layer with its shard and gets its rows of the single-process result:
// the output has the joint rows and the local rows in joint-strategy order, as on one process.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "dattn/communicator.hpp"
#include "dattn/inputs.hpp"
#include "dattn/metadata.hpp"
#include "dattn/tensor.hpp"

namespace dattn {

// What a strategy knows of the layer.
struct ParallelContext {
  QkvLayout layout{};
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;
  bool causal = false;
  bool cross_role = false;  // the layer's role is "cross"
};

// One attention call on this process: the inputs in `layout`, with `num_heads` query and
// `num_kv_heads` KV heads (a strategy may hand the kernel a block of the layer's heads).
// validate_only: check it as the layer would, write nothing.
struct LocalCall {
  AttentionInputs inputs;
  QkvLayout layout{};
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;
  bool validate_only = false;
};
using LocalAttention = std::function<void(const LocalCall&)>;

class ParallelStrategy {
 public:
  virtual ~ParallelStrategy() = default;
  virtual std::string name() const = 0;
  // Ranks in the group (1 for none).
  virtual int ranks() const = 0;
  // Runs the call, exchanging shards between ranks as the strategy needs and calling `local`
  // for the attention on this process. Every rank checks its inputs and the ranks agree on the
  // verdict before any exchange: a bad input on one rank raises the same error on all.
  virtual void forward(const AttentionInputs& inputs, const ParallelContext& context,
                       const LocalAttention& local) const = 0;
};

// One process: runs the local attention as it is.
class NoParallel final : public ParallelStrategy {
 public:
  std::string name() const override { return "none"; }
  int ranks() const override { return 1; }
  void forward(const AttentionInputs& inputs, const ParallelContext& context,
               const LocalAttention& local) const override {
    local({inputs, context.layout, context.num_heads, context.num_kv_heads, false});
  }
};

// Ulysses: all-to-all from [B, S/P, H, D] to [B, S, H/P, D], attention on a block of heads,
// all-to-all back; joint Q/K/V head-sliced locally, joint output rows all-gathered over heads.
// Uneven (default): shards of any length (zero included), KV heads padded to a multiple of P
// and query heads by the GQA ratio. Strict: equal shards and Hq % P == Hkv % P == 0, else
// InvalidArgument. Metadata describes the whole sequence (cu_seqlens, spans, 4-D masks,
// valid_kv_length); a 2-D attn_mask is each rank's own [B, S_local] key mask.
// `inner` (hybrid) runs the attention of the head block instead of the local kernel; then
// `verdict` (the whole hybrid group) is where the ranks agree on errors.
class UlyssesParallel final : public ParallelStrategy {
 public:
  explicit UlyssesParallel(std::shared_ptr<Communicator> comm, bool strict = false,
                           std::shared_ptr<const ParallelStrategy> inner = nullptr,
                           std::shared_ptr<Communicator> verdict = nullptr);
  std::string name() const override;
  int ranks() const override;
  void forward(const AttentionInputs& inputs, const ParallelContext& context,
               const LocalAttention& local) const override;

 private:
  std::shared_ptr<Communicator> comm_;
  bool strict_;
  std::shared_ptr<const ParallelStrategy> inner_;
  std::shared_ptr<Communicator> verdict_;
};

// Ring: Q stays, K/V blocks rotate P-1 times (each transfer overlapped with the attention on
// the previous block), partial (O, LSE) merged. Causal by global positions (blocks after the
// queries skipped); joint K/V enter at step 0, joint queries are computed on a head block per
// rank and all-gathered; valid_kv_length (global) trims each block. Masks, packed cu_seqlens,
// piecewise spans, and causal with valid_kv_length are Unsupported.
class RingParallel final : public ParallelStrategy {
 public:
  explicit RingParallel(std::shared_ptr<Communicator> comm);
  std::string name() const override { return "ring"; }
  int ranks() const override;
  void forward(const AttentionInputs& inputs, const ParallelContext& context,
               const LocalAttention& local) const override;

 private:
  std::shared_ptr<Communicator> comm_;
};

// AllGather-KV: K/V gathered from every rank, local Q against all of it (non-causal; causal is
// Unsupported). Joint K/V attached in strategy order, joint queries on a head block per rank
// and all-gathered. Metadata describes the whole sequence: 3-D/4-D masks are row-sliced for
// the local rows, cu_seqlens_q is intersected with the local span, full_attn_spans see the
// local rows at their global positions; a 2-D attn_mask is each rank's [B, S_local] key mask.
class AllGatherKvParallel final : public ParallelStrategy {
 public:
  explicit AllGatherKvParallel(std::shared_ptr<Communicator> comm);
  std::string name() const override { return "allgather"; }
  int ranks() const override;
  void forward(const AttentionInputs& inputs, const ParallelContext& context,
               const LocalAttention& local) const override;

 private:
  std::shared_ptr<Communicator> comm_;
};

// Ulysses x Ring over `comm` (size ulysses * ring): Ulysses groups of contiguous ranks, Ring
// groups strided. Collective (splits the communicator).
std::shared_ptr<ParallelStrategy> make_hybrid_parallel(const std::shared_ptr<Communicator>& comm,
                                                       int ulysses, int ring);

// "none", "ulysses", "ulysses-strict", "ring", "allgather", "hybrid:UxR" (U * R = ranks).
// Throws InvalidArgument naming `parallel` for anything else. Collective for hybrid.
std::shared_ptr<ParallelStrategy> make_parallel_strategy(std::string_view spec,
                                                         const std::shared_ptr<Communicator>& comm);

// The contiguous shard of `total` rows for `rank` of `ranks`: the first total % ranks ranks
// get one row more. Returns {start, length}.
std::pair<std::int64_t, std::int64_t> shard_rows(std::int64_t total, int ranks, int rank);

}  // namespace dattn

namespace dattn {

// The shape of one sequence-parallel call, for parallel_bytes_sent.
struct ParallelTraffic {
  std::int64_t batch = 1;
  std::int64_t rows = 0;   // image rows of the whole sequence (queries and keys)
  std::int64_t joint = 0;  // joint rows (replicated)
  std::int64_t heads = 0, kv_heads = 0, head_size = 0, value_head_size = 0;
  std::size_t q_bytes = 4, kv_bytes = 4, out_bytes = 4;  // bytes per element
  bool lse = false;                                      // the LSE output is wanted
};

// Bytes that rank `rank` of `ranks` sends to other ranks in one call of strategy `spec` (as
// make_parallel_strategy takes it), with the rows split by shard_rows and no attention mask;
// the small header exchanges before each step are not counted. The strategies move exactly
// this (tests count it through a communicator).
std::int64_t parallel_bytes_sent(std::string_view spec, const ParallelTraffic& call, int ranks,
                                 int rank);

}  // namespace dattn
