#include "core/process_memory.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <new>

namespace dattn {
namespace detail {

namespace {

constexpr std::size_t kHuge = std::size_t(2) << 20;

std::size_t page_bytes() {
  static const std::size_t page = [] {
    const long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? std::size_t(p) : std::size_t(4096);
  }();
  return page;
}

std::size_t round_up(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

}  // namespace

Mapping::Mapping(std::size_t bytes) {
  const bool huge = bytes >= kHuge;
  const std::size_t capacity =
      round_up(std::max<std::size_t>(bytes, 1), huge ? kHuge : page_bytes());
  if (capacity < bytes) throw std::bad_alloc();  // the rounding wrapped
  const std::size_t slack = huge ? kHuge - page_bytes() : 0;
  if (capacity > SIZE_MAX - slack) throw std::bad_alloc();
  const std::size_t length = capacity + slack;
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) throw std::bad_alloc();
  auto* data = static_cast<unsigned char*>(base);
  if (huge) {
    // The 2 MiB-aligned part: the slack before and after it goes back at once.
    const auto at = reinterpret_cast<std::uintptr_t>(base);
    data = reinterpret_cast<unsigned char*>(round_up(at, kHuge));
    const std::size_t before = std::size_t(data - static_cast<unsigned char*>(base));
    if (before > 0) munmap(base, before);
    const std::size_t after = length - before - capacity;
    if (after > 0) munmap(data + capacity, after);
    base = data;
#if defined(MADV_HUGEPAGE)
    (void)madvise(data, capacity, MADV_HUGEPAGE);
#endif
  }
  base_ = base;
  length_ = capacity;
  data_ = data;
  capacity_ = capacity;
}

Mapping::~Mapping() {
  unmap();
}

Mapping::Mapping(Mapping&& other) noexcept
    : base_(other.base_), length_(other.length_), data_(other.data_), capacity_(other.capacity_) {
  other.base_ = other.data_ = nullptr;
  other.length_ = other.capacity_ = 0;
}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    unmap();
    base_ = other.base_;
    length_ = other.length_;
    data_ = other.data_;
    capacity_ = other.capacity_;
    other.base_ = other.data_ = nullptr;
    other.length_ = other.capacity_ = 0;
  }
  return *this;
}

void Mapping::unmap() noexcept {
  if (base_ != nullptr) munmap(base_, length_);
  base_ = data_ = nullptr;
  length_ = capacity_ = 0;
}

ProcessMemory& ProcessMemory::instance() {
  // Never destroyed: results may be released by static objects' destructors at exit.
  static ProcessMemory* const memory = new ProcessMemory();
  return *memory;
}

// ---- leases ----

ProcessMemory::Lease::Lease(Lease&& other) noexcept : buffer_(std::move(other.buffer_)) {}

ProcessMemory::Lease& ProcessMemory::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    give_back();
    buffer_ = std::move(other.buffer_);
  }
  return *this;
}

ProcessMemory::Lease::~Lease() {
  give_back();
}

void ProcessMemory::Lease::give_back() noexcept {
  if (!buffer_) return;
  ProcessMemory& pm = instance();
  {
    std::lock_guard lock(pm.mutex_);
    --pm.leases_;
    pm.in_use_bytes_ -= buffer_.capacity();
  }
  pm.put(std::move(buffer_));
}

ProcessMemory::Lease ProcessMemory::lease(std::size_t bytes) {
  Mapping m = take(bytes, true);
  std::lock_guard lock(mutex_);
  ++leases_;
  peak_leases_ = std::max(peak_leases_, leases_);
  in_use_bytes_ += m.capacity();
  return Lease(std::move(m));
}

void ProcessMemory::ensure(Lease& lease, std::size_t bytes) {
  if (lease.buffer_ && lease.capacity() >= bytes) return;
  lease = this->lease(bytes);
}

// The smallest idle buffer of at least `bytes` (for a result, of at most twice that: a result
// is held for as long as its owner likes); for a lease, else the largest idle one mapped anew;
// else a new mapping. The mapping itself is made outside the lock.
Mapping ProcessMemory::take(std::size_t bytes, bool lease) {
  Mapping spare;
  {
    std::lock_guard lock(mutex_);
    std::size_t best = idle_.size();
    for (std::size_t i = 0; i < idle_.size(); ++i) {
      const std::size_t c = idle_[i].capacity();
      if (c < bytes || (!lease && c / 2 > bytes)) continue;
      if (best == idle_.size() || c < idle_[best].capacity()) best = i;
    }
    if (best < idle_.size()) {
      Mapping m = std::move(idle_[best]);
      idle_.erase(idle_.begin() + std::ptrdiff_t(best));
      return m;
    }
    if (lease && !idle_.empty()) {
      const auto largest = std::max_element(
          idle_.begin(), idle_.end(), [](auto& a, auto& b) { return a.capacity() < b.capacity(); });
      spare = std::move(*largest);
      idle_.erase(largest);
    }
  }
  spare = Mapping();  // unmapped before the new one is made
  return Mapping(bytes);
}

void ProcessMemory::put(Mapping m) noexcept {
  std::lock_guard lock(mutex_);
  if (idle_.size() < idle_limit()) {
    idle_.push_back(std::move(m));
    return;
  }
  // Over the limit: the smallest of the idle buffers and this one goes.
  auto smallest = std::min_element(idle_.begin(), idle_.end(),
                                   [](auto& a, auto& b) { return a.capacity() < b.capacity(); });
  if (smallest != idle_.end() && smallest->capacity() < m.capacity()) std::swap(*smallest, m);
}  // m (what goes) unmapped on return

// ---- results ----

void* ProcessMemory::allocate(std::size_t bytes) {
  if (bytes < kResultMapBytes)
    return ::operator new (std::max<std::size_t>(bytes, 1), std::align_val_t{64});
  Mapping m = take(bytes, false);
  void* p = m.data();
  std::lock_guard lock(mutex_);
  in_use_bytes_ += m.capacity();
  results_.emplace(p, std::move(m));
  return p;
}

void ProcessMemory::release(void* p) noexcept {
  if (p == nullptr) return;
  Mapping m;
  {
    std::lock_guard lock(mutex_);
    const auto it = results_.find(p);
    if (it != results_.end()) {
      m = std::move(it->second);
      results_.erase(it);
      in_use_bytes_ -= m.capacity();
    }
  }
  if (!m) {
    ::operator delete (p, std::align_val_t{64});
    return;
  }
  put(std::move(m));
}

// ---- calls and layers ----

ProcessMemory::CallScope::CallScope() {
  ProcessMemory& pm = instance();
  std::lock_guard lock(pm.mutex_);
  ++pm.calls_;
  pm.peak_calls_ = std::max(pm.peak_calls_, pm.calls_);
}

ProcessMemory::CallScope::~CallScope() {
  ProcessMemory& pm = instance();
  std::lock_guard lock(pm.mutex_);
  --pm.calls_;
}

void ProcessMemory::layer_created() {
  std::lock_guard lock(mutex_);
  ++layers_;
}

void ProcessMemory::layer_destroyed() {
  bool last = false;
  {
    std::lock_guard lock(mutex_);
    last = --layers_ == 0;
  }
  if (last) empty();
}

std::size_t ProcessMemory::empty() {
  std::vector<Mapping> gone;
  std::size_t bytes = 0;
  {
    std::lock_guard lock(mutex_);
    gone.swap(idle_);
    // The bound starts again from what is in flight now: the next calls set it anew.
    peak_leases_ = leases_;
    peak_calls_ = calls_;
  }
  for (const Mapping& m : gone) bytes += m.capacity();
  return bytes;  // `gone` unmaps them, outside the lock
}

MemoryStats ProcessMemory::stats() const {
  std::lock_guard lock(mutex_);
  MemoryStats s;
  for (const Mapping& m : idle_) s.idle_bytes += m.capacity();
  s.idle_buffers = idle_.size();
  s.idle_limit = idle_limit();
  s.in_use_bytes = in_use_bytes_;
  s.calls_in_flight = calls_;
  s.live_layers = layers_;
  return s;
}

}  // namespace detail

MemoryStats memory_stats() {
  return detail::ProcessMemory::instance().stats();
}

std::size_t empty_cache() {
  return detail::ProcessMemory::instance().empty();
}

void* allocate_result(std::size_t bytes) {
  return detail::ProcessMemory::instance().allocate(bytes);
}

void release_result(void* p) noexcept {
  detail::ProcessMemory::instance().release(p);
}

}  // namespace dattn
