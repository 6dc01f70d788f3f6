// A strategy's name as make_parallel_strategy and parallel_bytes_sent take it.
#pragma once

#include <string_view>

namespace dattn::parallel {

enum class StrategyKind { none, ulysses, ulysses_strict, ring, allgather, hybrid };

struct StrategySpec {
  StrategyKind kind = StrategyKind::none;
  int ulysses = 0, ring = 0;  // hybrid:UxR
};

// Case-insensitive: none, ulysses, ulysses-strict, ring, allgather (or allgather-kv),
// hybrid:UxR with positive U and R. Throws InvalidArgument naming `parallel` otherwise.
StrategySpec parse_strategy(std::string_view spec);

}  // namespace dattn::parallel
