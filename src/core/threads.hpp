// The calling context's thread count, as the library uses it.
#pragma once

#include "dattn/threads.hpp"

namespace dattn::detail {

// The calling context's thread count (dattn::default_threads(): omp_get_max_threads() within
// [1, kMaxThreads], OMP_NUM_THREADS read by dattn where OpenMP's int wrapped it).
inline int calling_threads() {
  return default_threads();
}

}  // namespace dattn::detail
