// No exception may leave an OpenMP parallel region (the runtime calls std::terminate). Work
// inside a region runs through ParallelFault::run, which keeps the first exception any thread
// throws (std::bad_alloc when a buffer cannot grow, say) and skips the work that follows once
// one has; after the region, rethrow() hands it to the caller. Every thread still reaches every
// barrier of the region, so a fault never deadlocks the team.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>
#include <utility>

namespace dattn::detail {

class ParallelFault {
 public:
  // Runs `work` unless a thread has already failed; an exception it throws is kept.
  template <class Work>
  void run(Work&& work) noexcept {
    if (failed()) return;
    try {
      std::forward<Work>(work)();
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!first_) first_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  bool failed() const noexcept { return failed_.load(std::memory_order_relaxed); }
  // After the region: throws the first exception kept, if any.
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr first_;
};

}  // namespace dattn::detail
