// The thread limit of dattn and the one bound every OpenMP region of the project uses.
#pragma once

namespace dattn {

// The most OpenMP threads dattn accepts or uses. A thread count above it is rejected where one
// is given (measure_peak_gflops, the CLI's --threads), and the library bounds OpenMP's default
// (omp_get_max_threads(), e.g. from OMP_NUM_THREADS) by it.
inline constexpr int kMaxThreads = 1024;

// The threads dattn uses when none is given: the calling context's omp_get_max_threads(), in
// [1, kMaxThreads]. Where OMP_NUM_THREADS is beyond what OpenMP's int can hold (2^31 reads as
// -2^31 there, 2^32 + 2 as 2), dattn reads the variable itself: a value above the bound counts as
// kMaxThreads, an unparsable one as OpenMP's default, a list by its first entry. Every OpenMP
// region of the library and of the CLI runs with at most this many threads.
int default_threads();

// For the life of the object, default_threads() in the calling thread is `threads` (clamped to
// [1, kMaxThreads]; 0 or less leaves it as it is); the previous count comes back on destruction.
// OpenMP's thread count is a per-thread setting, so this never affects calls made by other
// threads (the Python package uses it to follow PyTorch's torch.get_num_threads()).
class ScopedThreads {
 public:
  explicit ScopedThreads(int threads);
  ~ScopedThreads();
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;

 private:
  int previous_ = 0;  // 0: nothing was changed
};

// The logical CPUs this process may run on (its affinity mask, what `nproc` counts; at least 1).
int affinity_cpus();

}  // namespace dattn
