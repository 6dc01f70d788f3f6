#include "dattn/threads.hpp"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <thread>

#include "core/strings.hpp"

namespace dattn {
namespace {

// The first entry of OMP_NUM_THREADS ("8", " 8 ", "8,4") as a non-negative integer; nullopt when
// unset or unparsable (OpenMP then takes its default too), including a value past 2^64.
std::optional<std::uint64_t> omp_num_threads_env() {
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (env == nullptr) return std::nullopt;
  std::string_view s(env);
  s = detail::trimmed(s.substr(0, s.find(',')));
  if (s.empty()) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    if (__builtin_mul_overflow(v, 10u, &v) || __builtin_add_overflow(v, unsigned(c - '0'), &v))
      return std::nullopt;
  }
  return v;
}

}  // namespace

int default_threads() {
  const int omp = omp_get_max_threads();
  // OpenMP keeps the count as an unsigned long and returns it as an int: a value past INT_MAX
  // wraps. Recognise the wrapped value of the variable and read the variable instead.
  static const std::optional<std::uint64_t> env = omp_num_threads_env();
  if (env && *env > std::uint64_t(INT_MAX) &&
      omp == static_cast<int>(static_cast<std::uint32_t>(*env)))
    return kMaxThreads;
  return std::clamp(omp, 1, kMaxThreads);
}

ScopedThreads::ScopedThreads(int threads) {
  if (threads <= 0) return;
  previous_ = omp_get_max_threads();
  omp_set_num_threads(std::clamp(threads, 1, kMaxThreads));
}

ScopedThreads::~ScopedThreads() {
  if (previous_ > 0) omp_set_num_threads(previous_);
}

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const auto n = static_cast<int>(std::thread::hardware_concurrency());
  return n > 0 ? n : 1;
}

}  // namespace dattn
