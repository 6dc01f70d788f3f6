// A grow-only float buffer in 2 MiB-aligned memory, advised into transparent huge pages where
// the kernel offers them (Linux's `madvise` mode): the per-call K/V panels of FLASH and
// VIDEO_SPARSE are megabytes that the kernels stream tile by tile, and with 4 KiB pages every
// tile costs TLB misses (measured on an Intel Xeon, FLASH f32 at D 128 with its panels in L3:
// 120-123 -> 128-130 GFLOP/s on one core). The contents are not initialised.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace dattn::detail {

class HugePageBuffer {
 public:
  // At least `floats` floats; the old contents are not kept when it grows. Throws
  // std::bad_alloc when the memory is not there.
  float* get(std::size_t floats) {
    if (floats > capacity_) {
      constexpr std::size_t kHuge = std::size_t(2) << 20;
      const std::size_t bytes = (floats * sizeof(float) + kHuge - 1) / kHuge * kHuge;
      data_.reset();
      capacity_ = 0;
      data_.reset(static_cast<float*>(std::aligned_alloc(kHuge, bytes)));
      if (!data_) throw std::bad_alloc();
#if defined(MADV_HUGEPAGE)
      (void)madvise(data_.get(), bytes, MADV_HUGEPAGE);
#endif
      capacity_ = bytes / sizeof(float);
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
  std::size_t capacity_ = 0;
};

}  // namespace dattn::detail
