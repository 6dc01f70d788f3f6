// The calling context's thread count, as the library uses it.
#pragma once

#include <omp.h>

#include <algorithm>

#include "dattn/threads.hpp"

namespace dattn::detail {

// omp_get_max_threads() of the calling thread, clamped to [1, kMaxThreads].
inline int calling_threads() {
  return std::clamp(omp_get_max_threads(), 1, kMaxThreads);
}

}  // namespace dattn::detail
