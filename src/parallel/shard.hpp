// One rank's inputs as [B, S, H, E] views, checked before any exchange.
#pragma once

#include <optional>

#include "dattn/parallel.hpp"
#include "parallel/exchange.hpp"

namespace dattn::parallel {

struct Shard {
  TensorView q, k, v, out;
  std::optional<TensorView> lse;         // [B, Hq, J + Sq]
  std::optional<TensorView> jq, jk, jv;  // joint rows, [B, J, H, E]
  i64 batch = 0, sq = 0, skv = 0, hq = 0, hkv = 0, d = 0, dv = 0, joint = 0;
  bool front = true;
  // Rows of `out` (and LSE) holding the joint rows and the local rows.
  i64 out_joint0() const { return front ? 0 : sq; }
  i64 out_local0() const { return front ? joint : 0; }
};

// Checks what every strategy needs before it moves anything: ranks and shapes of Q/K/V, the
// output, the LSE and the joint tensors against each other and the layer's heads. Throws
// InvalidArgument naming the field.
Shard read_shard(const AttentionInputs& in, const ParallelContext& ctx);

// What the ranks exchange before anything else: each rank's lengths and what they must share
// (joint rows, key mask present, batch, heads, head sizes, dtypes, LSE wanted).
// (valid_kv_length, joint strategy and a fingerprint of the rest of the metadata, which
// describes the whole sequence and so must be the same everywhere).
std::vector<i64> shard_header(const Shard& s, bool key_mask, const AttentionMetadata& meta);
constexpr std::size_t kHeaderSize = 17;
i64 metadata_fingerprint(const AttentionMetadata& meta);
// Every rank's lengths from the gathered headers; throws InvalidArgument (the same on every
// rank) where a rank differs from rank 0 in what they must share.
struct ShardLengths {
  std::vector<i64> q, kv;        // rows of each rank
  std::vector<i64> offq, offkv;  // where each rank's rows start, and the totals at the end
  i64 sq_all() const { return offq.back(); }
  i64 skv_all() const { return offkv.back(); }
};
ShardLengths check_headers(const std::vector<i64>& all, int ranks);

// True when `meta` has a 2-D attn_mask: then it must be this rank's bool key mask
// [B, S_local] (else InvalidArgument naming the strategy `who`).
bool rank_key_mask(const AttentionMetadata& meta, const Shard& s, const std::string& who);

// A copy of `meta` without the joint tensors and mask (the strategy attaches them itself).
AttentionMetadata without_joint(const AttentionMetadata& meta);

// The strategy's name in messages: "<name>: ".
[[noreturn]] void unsupported(const std::string& strategy, const std::string& field,
                              const std::string& what);

}  // namespace dattn::parallel
