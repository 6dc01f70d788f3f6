// The thread limit of dattn.
#pragma once

namespace dattn {

// The most OpenMP threads dattn accepts or uses. A thread count above it is rejected where one
// is given (measure_peak_gflops, the CLI's --threads), and the library clamps OpenMP's default
// (omp_get_max_threads(), e.g. from OMP_NUM_THREADS) to it.
inline constexpr int kMaxThreads = 1024;

}  // namespace dattn
