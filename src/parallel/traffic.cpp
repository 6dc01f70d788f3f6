// What each strategy sends per call, from the shapes alone (the same splits the strategies use).
#include <string>
#include <vector>

#include "dattn/errors.hpp"
#include "dattn/parallel.hpp"
#include "parallel/exchange.hpp"
#include "parallel/spec.hpp"

namespace dattn {

namespace {

using parallel::i64;

struct Sizes {
  i64 batch, joint, hq, hkv, d, dv;
  i64 q, kv, out;  // bytes per element
  bool lse;
  i64 out_row(i64 heads) const { return heads * (dv * out + (lse ? 4 : 0)); }
  i64 kv_row(i64 heads) const { return heads * (d + dv) * kv; }
};

// Joint output rows gathered over the head blocks of `ranks` ranks.
i64 joint_gather(const Sizes& s, const parallel::HeadSplit& hs, int ranks, int r) {
  return s.joint * s.batch * s.out_row(hs.q_count[std::size_t(r)]) * (ranks - 1);
}

i64 ulysses(const Sizes& s, const std::vector<i64>& len, int r) {
  const int P = int(len.size());
  const parallel::HeadSplit hs = parallel::split_heads(s.hq, s.hkv, P);
  i64 bytes = 0;
  for (int p = 0; p < P; ++p) {
    if (p == r) continue;
    const auto u = std::size_t(p);
    bytes += len[std::size_t(r)] * s.batch *
             (hs.q_count[u] * s.d * s.q + s.kv_row(hs.kv_count[u]));    // rows -> heads
    bytes += len[u] * s.batch * s.out_row(hs.q_count[std::size_t(r)]);  // heads -> rows
  }
  return bytes + joint_gather(s, hs, P, r);
}

i64 ring(const Sizes& s, const std::vector<i64>& len, int r) {
  const int P = int(len.size());
  i64 bytes = 0;
  for (int step = 0; step + 1 < P; ++step)
    bytes += s.batch * len[std::size_t((r - step + P) % P)] * s.kv_row(s.hkv);
  return bytes + joint_gather(s, parallel::split_heads(s.hq, s.hkv, P), P, r);
}

i64 allgather(const Sizes& s, const std::vector<i64>& len, int r) {
  const int P = int(len.size());
  return (P - 1) * s.batch * len[std::size_t(r)] * s.kv_row(s.hkv) +
         joint_gather(s, parallel::split_heads(s.hq, s.hkv, P), P, r);
}

}  // namespace

std::int64_t parallel_bytes_sent(std::string_view spec, const ParallelTraffic& call, int ranks,
                                 int rank) {
  if (ranks <= 0 || rank < 0 || rank >= ranks)
    throw InvalidArgument("rank", "rank: " + std::to_string(rank) + " of " + std::to_string(ranks) +
                                      " ranks is not valid");
  const Sizes sz{call.batch,        call.joint,         call.heads,
                 call.kv_heads,     call.head_size,     call.value_head_size,
                 i64(call.q_bytes), i64(call.kv_bytes), i64(call.out_bytes),
                 call.lse};
  std::vector<i64> len;
  for (int p = 0; p < ranks; ++p) len.push_back(shard_rows(call.rows, ranks, p).second);
  const parallel::StrategySpec parsed = parallel::parse_strategy(spec);
  switch (parsed.kind) {
    case parallel::StrategyKind::none:
      return 0;
    case parallel::StrategyKind::ulysses:
    case parallel::StrategyKind::ulysses_strict:
      return ulysses(sz, len, rank);
    case parallel::StrategyKind::ring:
      return ring(sz, len, rank);
    case parallel::StrategyKind::allgather:
      return allgather(sz, len, rank);
    case parallel::StrategyKind::hybrid:
      break;
  }
  const int U = parsed.ulysses, R = parsed.ring;
  if (U * R != ranks)
    throw InvalidArgument("parallel", "parallel: hybrid " + std::to_string(U) + "x" +
                                          std::to_string(R) + " needs " + std::to_string(U) +
                                          " * " + std::to_string(R) +
                                          " == " + std::to_string(ranks) + " ranks");
  const int g = rank / U, u = rank % U;
  // Ulysses inside group g (its members' shards), then the ring over the groups' rows with
  // this rank's head block.
  std::vector<i64> members(len.begin() + g * U, len.begin() + (g + 1) * U), groups;
  for (int q = 0; q < R; ++q) {
    i64 rows = 0;
    for (int m = 0; m < U; ++m) rows += len[std::size_t(q * U + m)];
    groups.push_back(rows);
  }
  const parallel::HeadSplit hs = parallel::split_heads(sz.hq, sz.hkv, U);
  Sizes inner = sz;
  inner.hq = hs.q_count[std::size_t(u)];
  inner.hkv = hs.kv_count[std::size_t(u)];
  const i64 ring_bytes = inner.hq > 0 ? ring(inner, groups, g) : 0;
  return ulysses(sz, members, u) + ring_bytes;
}

}  // namespace dattn
