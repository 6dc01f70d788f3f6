// Per-call workspaces for the calls of one layer. A call leases a buffer for its duration and
// gives it back when done: concurrent calls on one layer each get their own (no call waits for
// another's buffer), and once every concurrent caller has had one, nothing is allocated again.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

namespace dattn::detail {

template <class Buffer>
class WorkspacePool {
 public:
  // A buffer leased to one call; returned to the pool when the lease ends.
  class Lease {
   public:
    Lease(WorkspacePool& pool, std::unique_ptr<Buffer> buffer)
        : pool_(&pool), buffer_(std::move(buffer)) {}
    Lease(Lease&&) noexcept = default;
    Lease& operator=(Lease&&) noexcept = default;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      if (buffer_) pool_->give_back(std::move(buffer_));
    }
    Buffer& operator*() const { return *buffer_; }
    Buffer* operator->() const { return buffer_.get(); }

   private:
    WorkspacePool* pool_;
    std::unique_ptr<Buffer> buffer_;
  };

  // A free buffer, or a new (default-constructed) one when every buffer is leased.
  Lease acquire() {
    std::unique_ptr<Buffer> b;
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        b = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!b) b = std::make_unique<Buffer>();
    return Lease(*this, std::move(b));
  }

  // Buffers not leased right now.
  std::size_t idle() const {
    std::lock_guard lock(mutex_);
    return free_.size();
  }

 private:
  void give_back(std::unique_ptr<Buffer> b) {
    std::lock_guard lock(mutex_);
    free_.push_back(std::move(b));
  }

  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Buffer>> free_;
};

}  // namespace dattn::detail
