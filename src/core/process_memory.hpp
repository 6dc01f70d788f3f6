// The process's large buffers (include/dattn/memory.hpp): anonymous mappings, never blocks of
// the C heap, shared by every layer and shape.
//
// - A call leases what it needs for its duration (lease(): K/V panels, per-thread scratch,
//   split-KV partials, packed keys) and gives it back when the lease ends. A lease takes the
//   smallest idle buffer that holds it; where none does, the largest idle one is mapped anew at
//   the size asked (so the idle buffers never outnumber what calls have held at once), else a
//   new mapping. Concurrent callers never wait for each other's buffers.
// - Results (memory that outlives the call that makes it: the outputs dattn allocates, C++
//   Tensors) come from allocate() and go back through release(); from kResultMapBytes on they are
//   mappings too, taken from the idle buffers where one fits (at most twice the size asked).
// - A buffer given back stays idle while fewer than idle_limit are: the most leases held at once
//   plus twice the most calls in flight at once (a call's output and LSE), so memory held
//   between calls is bounded by the calls in flight, not by layers; past the limit the smallest
//   goes. empty() unmaps the idle ones and starts the bound again from what is in flight;
//   the last Attention destroyed does it too.
#pragma once

#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "dattn/memory.hpp"

namespace dattn::detail {

// One anonymous private mapping of at least `bytes` (page-rounded; from 2 MiB on 2 MiB-aligned
// and advised into transparent huge pages, where the kernels stream it tile by tile and 4 KiB
// pages cost TLB misses). Contents are zero when new, stale when reused. Throws std::bad_alloc.
class Mapping {
 public:
  Mapping() = default;
  explicit Mapping(std::size_t bytes);
  ~Mapping();
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  void* data() const { return data_; }
  std::size_t capacity() const { return capacity_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  void unmap() noexcept;
  void* base_ = nullptr;  // the whole mapped range (alignment slack included)
  std::size_t length_ = 0;
  void* data_ = nullptr;
  std::size_t capacity_ = 0;
};

class ProcessMemory {
 public:
  // Results smaller than this are ordinary heap blocks (they cannot pin much).
  static constexpr std::size_t kResultMapBytes = std::size_t(64) << 10;

  static ProcessMemory& instance();

  // A buffer of at least `bytes` held until the lease ends (or moves on). An empty lease
  // (default-constructed) holds nothing.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();

    void* data() const { return buffer_.data(); }
    template <class T>
    T* as() const {
      return static_cast<T*>(buffer_.data());
    }
    std::size_t capacity() const { return buffer_.capacity(); }

   private:
    friend class ProcessMemory;
    explicit Lease(Mapping m) : buffer_(std::move(m)) {}
    void give_back() noexcept;
    Mapping buffer_;
  };

  Lease lease(std::size_t bytes);
  // A lease re-taken at `bytes` where it holds less (its contents are not kept).
  void ensure(Lease& lease, std::size_t bytes);

  // Result memory, 64-byte aligned; release() takes back exactly what allocate() gave.
  void* allocate(std::size_t bytes);
  void release(void* p) noexcept;

  // One call in flight for its lifetime (counted toward idle_limit).
  class CallScope {
   public:
    CallScope();
    ~CallScope();
    CallScope(const CallScope&) = delete;
    CallScope& operator=(const CallScope&) = delete;
  };

  // Live Attention objects: the last one destroyed empties the idle buffers.
  void layer_created();
  void layer_destroyed();

  std::size_t empty();
  MemoryStats stats() const;

 private:
  ProcessMemory() = default;
  Mapping take(std::size_t bytes, bool lease);  // under no lock
  void put(Mapping m) noexcept;                 // idle or unmapped
  std::size_t idle_limit() const { return peak_leases_ + 2 * peak_calls_; }

  mutable std::mutex mutex_;
  std::vector<Mapping> idle_;
  std::unordered_map<void*, Mapping> results_;  // live mapped results by address
  std::size_t leases_ = 0, peak_leases_ = 0;
  std::size_t calls_ = 0, peak_calls_ = 0;
  std::size_t in_use_bytes_ = 0;
  std::size_t layers_ = 0;
};

}  // namespace dattn::detail
