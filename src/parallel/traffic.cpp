// What each strategy sends per call, from the shapes alone (the same splits the strategies use).
#include <cctype>
#include <charconv>
#include <string>
#include <vector>

#include "dattn/errors.hpp"
#include "dattn/parallel.hpp"
#include "parallel/exchange.hpp"

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
  std::string s(spec);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const Sizes sz{call.batch,        call.joint,         call.heads,
                 call.kv_heads,     call.head_size,     call.value_head_size,
                 i64(call.q_bytes), i64(call.kv_bytes), i64(call.out_bytes),
                 call.lse};
  std::vector<i64> len;
  for (int p = 0; p < ranks; ++p) len.push_back(shard_rows(call.rows, ranks, p).second);
  if (s == "none") return 0;
  if (s == "ulysses" || s == "ulysses-strict") return ulysses(sz, len, rank);
  if (s == "ring") return ring(sz, len, rank);
  if (s == "allgather" || s == "allgather-kv") return allgather(sz, len, rank);
  if (s.rfind("hybrid:", 0) == 0) {
    const std::string dims = s.substr(7);
    const auto x = dims.find('x');
    int U = 0, R = 0;
    if (x == std::string::npos ||
        std::from_chars(dims.data(), dims.data() + x, U).ptr != dims.data() + x ||
        std::from_chars(dims.data() + x + 1, dims.data() + dims.size(), R).ptr !=
            dims.data() + dims.size() ||
        U <= 0 || R <= 0 || U * R != ranks)
      throw InvalidArgument("parallel",
                            "parallel: '" + std::string(spec) +
                                "' is not hybrid:UxR with U * R == " + std::to_string(ranks));
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
  throw InvalidArgument("parallel", "parallel: '" + std::string(spec) +
                                        "' is not a strategy; valid: none, ulysses, "
                                        "ulysses-strict, ring, allgather, hybrid:UxR");
}

}  // namespace dattn
