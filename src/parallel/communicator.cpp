// The communicator's shared helpers and the in-process group (threads as ranks).
#include "dattn/communicator.hpp"

#include <atomic>
#include <barrier>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace dattn {

void Communicator::all_gather(const void* send, std::size_t bytes, void* recv) {
  const auto n = static_cast<std::size_t>(size());
  std::vector<std::size_t> counts(n, bytes), send_displs(n, 0), recv_displs(n);
  for (std::size_t p = 0; p < n; ++p) recv_displs[p] = p * bytes;
  all_to_all_v(send, counts, send_displs, recv, counts, recv_displs);
}

void Communicator::all_to_all(const void* send, std::size_t bytes, void* recv) {
  const auto n = static_cast<std::size_t>(size());
  std::vector<std::size_t> counts(n, bytes), displs(n);
  for (std::size_t p = 0; p < n; ++p) displs[p] = p * bytes;
  all_to_all_v(send, counts, displs, recv, counts, displs);
}

namespace {

// State shared by the ranks of one in-process group.
struct Group {
  explicit Group(int n)
      : size(n),
        barrier(n),
        posted(static_cast<std::size_t>(n)),
        split_colour(std::size_t(n)),
        split_group(std::size_t(n)) {}

  struct Posted {
    const char* send = nullptr;
    const std::vector<std::size_t>* counts = nullptr;
    const std::vector<std::size_t>* displs = nullptr;
  };

  int size;
  std::barrier<> barrier;
  std::vector<Posted> posted;
  std::atomic<bool> mismatch{false};
  // Point to point: FIFO of messages per (source, destination).
  std::mutex mail_mutex;
  std::condition_variable mail_cv;
  std::map<std::pair<int, int>, std::deque<std::vector<char>>> mail;
  // split(): colours posted by each rank and the sub-group made by each colour's first rank.
  std::vector<int> split_colour;
  std::vector<std::shared_ptr<Group>> split_group;
};

class InProcessTransfer final : public PendingTransfer {
 public:
  InProcessTransfer(std::shared_ptr<Group> g, int source, int me, void* recv, std::size_t bytes)
      : g_(std::move(g)), source_(source), me_(me), recv_(recv), bytes_(bytes) {}
  ~InProcessTransfer() override {
    if (!done_) wait_noexcept();
  }
  void wait() override {
    if (done_) return;
    done_ = true;
    std::vector<char> msg;
    {
      std::unique_lock lock(g_->mail_mutex);
      auto& box = g_->mail[{source_, me_}];
      g_->mail_cv.wait(lock, [&] { return !box.empty(); });
      msg = std::move(box.front());
      box.pop_front();
    }
    if (msg.size() != bytes_)
      throw std::logic_error("in-process send/recv: rank " + std::to_string(me_) + " expected " +
                             std::to_string(bytes_) + " bytes from rank " +
                             std::to_string(source_) + ", got " + std::to_string(msg.size()));
    if (bytes_ != 0) std::memcpy(recv_, msg.data(), bytes_);
  }

 private:
  void wait_noexcept() noexcept {
    try {
      wait();
    } catch (...) {
    }
  }
  std::shared_ptr<Group> g_;
  int source_, me_;
  void* recv_;
  std::size_t bytes_;
  bool done_ = false;
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }

  void all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                    const std::vector<std::size_t>& send_displs, void* recv,
                    const std::vector<std::size_t>& recv_counts,
                    const std::vector<std::size_t>& recv_displs) override {
    const auto n = static_cast<std::size_t>(g_->size);
    if (send_counts.size() != n || send_displs.size() != n || recv_counts.size() != n ||
        recv_displs.size() != n)
      throw std::logic_error("all_to_all_v: counts and displacements need one entry per rank");
    const auto me = static_cast<std::size_t>(rank_);
    g_->posted[me] = {static_cast<const char*>(send), &send_counts, &send_displs};
    g_->barrier.arrive_and_wait();
    for (std::size_t p = 0; p < n; ++p) {
      const Group::Posted& src = g_->posted[p];
      if ((*src.counts)[me] != recv_counts[p]) {
        g_->mismatch = true;
        continue;
      }
      if (recv_counts[p] != 0)
        std::memcpy(static_cast<char*>(recv) + recv_displs[p], src.send + (*src.displs)[me],
                    recv_counts[p]);
    }
    g_->barrier.arrive_and_wait();  // nobody's send buffer is read any more
    const bool bad = g_->mismatch.load();
    g_->barrier.arrive_and_wait();
    if (rank_ == 0) g_->mismatch = false;
    if (bad)
      throw std::logic_error("all_to_all_v: a rank's receive count differs from its sender's");
  }

  std::unique_ptr<PendingTransfer> start_send_recv(const void* send, std::size_t send_bytes,
                                                   int dest, void* recv, std::size_t recv_bytes,
                                                   int source) override {
    if (dest < 0 || dest >= g_->size || source < 0 || source >= g_->size)
      throw std::logic_error("start_send_recv: rank out of range");
    {
      std::lock_guard lock(g_->mail_mutex);
      const char* p = static_cast<const char*>(send);
      g_->mail[{rank_, dest}].emplace_back(p, p + send_bytes);
    }
    g_->mail_cv.notify_all();
    return std::make_unique<InProcessTransfer>(g_, source, rank_, recv, recv_bytes);
  }

  std::shared_ptr<Communicator> split(int colour) override {
    const auto me = static_cast<std::size_t>(rank_);
    g_->split_colour[me] = colour;
    g_->barrier.arrive_and_wait();
    int first = -1, members = 0, new_rank = 0;
    for (int p = 0; p < g_->size; ++p)
      if (g_->split_colour[std::size_t(p)] == colour) {
        if (first < 0) first = p;
        if (p < rank_) ++new_rank;
        ++members;
      }
    if (first == rank_) g_->split_group[me] = std::make_shared<Group>(members);
    g_->barrier.arrive_and_wait();
    std::shared_ptr<Group> sub = g_->split_group[std::size_t(first)];
    g_->barrier.arrive_and_wait();
    return std::make_shared<InProcessCommunicator>(std::move(sub), new_rank);
  }

 private:
  std::shared_ptr<Group> g_;
  int rank_;
};

}  // namespace

std::vector<std::shared_ptr<Communicator>> make_in_process_group(int size) {
  if (size <= 0) throw std::invalid_argument("make_in_process_group: size must be positive");
  auto g = std::make_shared<Group>(size);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(std::make_shared<InProcessCommunicator>(g, r));
  return comms;
}

}  // namespace dattn
