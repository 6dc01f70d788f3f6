// Building a strategy from its name, the hybrid's sub-groups, and the usual row split.
#include <charconv>
#include <string>

#include "dattn/errors.hpp"
#include "dattn/parallel.hpp"

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

std::shared_ptr<ParallelStrategy> make_parallel_strategy(
    std::string_view spec, const std::shared_ptr<Communicator>& comm) {
  std::string s(spec);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "none" || s.empty()) return std::make_shared<NoParallel>();
  if (!comm) throw InvalidArgument("communicator", "communicator: must not be null");
  if (s == "ulysses") return std::make_shared<UlyssesParallel>(comm, false);
  if (s == "ulysses-strict") return std::make_shared<UlyssesParallel>(comm, true);
  if (s == "ring") return std::make_shared<RingParallel>(comm);
  if (s == "allgather" || s == "allgather-kv") return std::make_shared<AllGatherKvParallel>(comm);
  if (s.rfind("hybrid:", 0) == 0) {
    const std::string dims = s.substr(7);
    const auto x = dims.find('x');
    int u = 0, r = 0;
    if (x == std::string::npos ||
        std::from_chars(dims.data(), dims.data() + x, u).ptr != dims.data() + x ||
        std::from_chars(dims.data() + x + 1, dims.data() + dims.size(), r).ptr !=
            dims.data() + dims.size())
      bad_spec(spec, "is not hybrid:UxR with integers U and R");
    return make_hybrid_parallel(comm, u, r);
  }
  bad_spec(spec, "is not a strategy");
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
