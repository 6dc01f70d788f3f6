// Building a strategy from its name, the hybrid's sub-groups, and the usual row split.
#include <cctype>
#include <charconv>
#include <string>

#include "dattn/errors.hpp"
#include "dattn/parallel.hpp"
#include "parallel/spec.hpp"

namespace dattn {

namespace {

constexpr const char* kValid = "none, ulysses, ulysses-strict, ring, allgather, hybrid:UxR";

[[noreturn]] void bad_spec(std::string_view spec, const std::string& why) {
  throw InvalidArgument("parallel",
                        "parallel: '" + std::string(spec) + "' " + why + "; valid: " + kValid);
}

}  // namespace

std::shared_ptr<ParallelStrategy> make_hybrid_parallel(const std::shared_ptr<Communicator>& comm,
                                                       int ulysses, int ring) {
  if (!comm) throw InvalidArgument("communicator", "communicator: must not be null");
  if (ulysses <= 0 || ring <= 0 || ulysses * ring != comm->size())
    throw InvalidArgument("parallel", "parallel: hybrid " + std::to_string(ulysses) + "x" +
                                          std::to_string(ring) + " needs " +
                                          std::to_string(ulysses) + " * " + std::to_string(ring) +
                                          " == " + std::to_string(comm->size()) + " ranks");
  const int r = comm->rank();
  // Ulysses groups: ranks [g*U, (g+1)*U); ring groups: ranks with the same r % U.
  std::shared_ptr<Communicator> ulysses_comm = comm->split(r / ulysses);
  std::shared_ptr<Communicator> ring_comm = comm->split(r % ulysses);
  auto ring_strategy = std::make_shared<RingParallel>(std::move(ring_comm));
  return std::make_shared<UlyssesParallel>(std::move(ulysses_comm), false, std::move(ring_strategy),
                                           comm);
}

namespace parallel {

StrategySpec parse_strategy(std::string_view spec) {
  std::string s(spec);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "none" || s.empty()) return {StrategyKind::none};
  if (s == "ulysses") return {StrategyKind::ulysses};
  if (s == "ulysses-strict") return {StrategyKind::ulysses_strict};
  if (s == "ring") return {StrategyKind::ring};
  if (s == "allgather" || s == "allgather-kv") return {StrategyKind::allgather};
  if (s.rfind("hybrid:", 0) == 0) {
    const std::string dims = s.substr(7);
    const auto x = dims.find('x');
    int u = 0, r = 0;
    if (x == std::string::npos ||
        std::from_chars(dims.data(), dims.data() + x, u).ptr != dims.data() + x ||
        std::from_chars(dims.data() + x + 1, dims.data() + dims.size(), r).ptr !=
            dims.data() + dims.size() ||
        u <= 0 || r <= 0)
      bad_spec(spec, "is not hybrid:UxR with positive integers U and R");
    return {StrategyKind::hybrid, u, r};
  }
  bad_spec(spec, "is not a strategy");
}

}  // namespace parallel

std::shared_ptr<ParallelStrategy> make_parallel_strategy(
    std::string_view spec, const std::shared_ptr<Communicator>& comm) {
  const parallel::StrategySpec parsed = parallel::parse_strategy(spec);
  if (parsed.kind == parallel::StrategyKind::none) return std::make_shared<NoParallel>();
  if (!comm) throw InvalidArgument("communicator", "communicator: must not be null");
  switch (parsed.kind) {
    case parallel::StrategyKind::ulysses:
      return std::make_shared<UlyssesParallel>(comm, false);
    case parallel::StrategyKind::ulysses_strict:
      return std::make_shared<UlyssesParallel>(comm, true);
    case parallel::StrategyKind::ring:
      return std::make_shared<RingParallel>(comm);
    case parallel::StrategyKind::allgather:
      return std::make_shared<AllGatherKvParallel>(comm);
    case parallel::StrategyKind::hybrid:
      return make_hybrid_parallel(comm, parsed.ulysses, parsed.ring);
    case parallel::StrategyKind::none:
      break;
  }
  return std::make_shared<NoParallel>();
}

std::pair<std::int64_t, std::int64_t> shard_rows(std::int64_t total, int ranks, int rank) {
  if (ranks <= 0 || rank < 0 || rank >= ranks || total < 0)
    throw InvalidArgument("rank", "rank: " + std::to_string(rank) + " of " + std::to_string(ranks) +
                                      " ranks is not valid");
  const std::int64_t base = total / ranks, extra = total % ranks;
  const std::int64_t start = rank * base + std::min<std::int64_t>(rank, extra);
  return {start, base + (rank < extra ? 1 : 0)};
}

}  // namespace dattn
