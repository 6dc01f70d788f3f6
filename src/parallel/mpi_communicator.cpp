// Communicator over MPI: all-to-all-v as non-blocking sends and receives with every peer in
// pieces of at most 1 GiB (no 2 GiB cap per block), all-gather as MPI_Allgather, send/recv
// pairs as MPI_Isend/MPI_Irecv, sub-groups through MPI_Comm_split (key = rank keeps the order).
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>

#include "dattn/errors.hpp"
#include "dattn/mpi.hpp"

namespace dattn {

namespace {

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw std::runtime_error(std::string(what) + ": " + std::string(text, std::size_t(len)));
}

int as_int(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw Unsupported("communicator", std::string(what) + ": " + std::to_string(n) +
                                          " bytes in one MPI block; at most " +
                                          std::to_string(INT_MAX) + " are supported");
  return static_cast<int>(n);
}

class MpiTransfer final : public PendingTransfer {
 public:
  MpiTransfer() = default;
  ~MpiTransfer() override {
    if (!done_ && !requests_.empty())
      MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE);
  }
  void wait() override {
    if (done_) return;
    done_ = true;
    if (!requests_.empty())
      check(MPI_Waitall(static_cast<int>(requests_.size()), requests_.data(), MPI_STATUSES_IGNORE),
            "MPI_Waitall");
  }
  std::vector<MPI_Request> requests_;

 private:
  bool done_ = false;
};

class MpiCommunicator final : public Communicator {
  static constexpr std::size_t kPiece = std::size_t{1} << 30;
  static constexpr int kCollectiveTag = 0x6462;  // "db"

 public:
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm) {
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // Point to point with every peer rather than MPI_Alltoallv, whose int counts would cap a
  // block at 2 GiB: each block goes in pieces of at most kPiece bytes (a large exchange is
  // pairwise inside MPI anyway). This rank's own block is a memcpy.
  void all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                    const std::vector<std::size_t>& send_displs, void* recv,
                    const std::vector<std::size_t>& recv_counts,
                    const std::vector<std::size_t>& recv_displs) override {
    const auto n = static_cast<std::size_t>(size_);
    if (send_counts.size() != n || send_displs.size() != n || recv_counts.size() != n ||
        recv_displs.size() != n)
      throw std::logic_error("all_to_all_v: counts and displacements need one entry per rank");
    const auto me = static_cast<std::size_t>(rank_);
    std::vector<MPI_Request> requests;
    auto pieces = [&](std::size_t bytes, auto&& post) {
      for (std::size_t at = 0; at < bytes; at += kPiece)
        post(at, static_cast<int>(std::min(kPiece, bytes - at)));
    };
    for (std::size_t p = 0; p < n; ++p) {
      if (p == me) continue;
      pieces(recv_counts[p], [&](std::size_t at, int count) {
        requests.emplace_back();
        check(MPI_Irecv(static_cast<char*>(recv) + recv_displs[p] + at, count, MPI_BYTE, int(p),
                        kCollectiveTag, comm_, &requests.back()),
              "MPI_Irecv");
      });
    }
    for (std::size_t k = 1; k < n; ++k) {  // staggered, so that not every rank sends to rank 0
      const std::size_t p = (me + k) % n;
      pieces(send_counts[p], [&](std::size_t at, int count) {
        requests.emplace_back();
        check(MPI_Isend(static_cast<const char*>(send) + send_displs[p] + at, count, MPI_BYTE,
                        int(p), kCollectiveTag, comm_, &requests.back()),
              "MPI_Isend");
      });
    }
    if (recv_counts[me] != send_counts[me])
      throw std::logic_error("all_to_all_v: this rank's own block differs in size");
    if (send_counts[me] != 0)
      std::memcpy(static_cast<char*>(recv) + recv_displs[me],
                  static_cast<const char*>(send) + send_displs[me], send_counts[me]);
    check(MPI_Waitall(static_cast<int>(requests.size()), requests.data(), MPI_STATUSES_IGNORE),
          "MPI_Waitall");
  }

  void all_gather(const void* send, std::size_t bytes, void* recv) override {
    const int n = as_int(bytes, "all_gather");
    check(MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_), "MPI_Allgather");
  }

  std::unique_ptr<PendingTransfer> start_send_recv(const void* send, std::size_t send_bytes,
                                                   int dest, void* recv, std::size_t recv_bytes,
                                                   int source) override {
    auto t = std::make_unique<MpiTransfer>();
    constexpr int kTag = 0x6461;  // "da"
    for (std::size_t at = 0; at < recv_bytes; at += kPiece) {
      t->requests_.emplace_back();
      check(MPI_Irecv(static_cast<char*>(recv) + at,
                      static_cast<int>(std::min(kPiece, recv_bytes - at)), MPI_BYTE, source, kTag,
                      comm_, &t->requests_.back()),
            "MPI_Irecv");
    }
    for (std::size_t at = 0; at < send_bytes; at += kPiece) {
      t->requests_.emplace_back();
      check(MPI_Isend(static_cast<const char*>(send) + at,
                      static_cast<int>(std::min(kPiece, send_bytes - at)), MPI_BYTE, dest, kTag,
                      comm_, &t->requests_.back()),
            "MPI_Isend");
    }
    return t;
  }

  std::shared_ptr<Communicator> split(int colour) override {
    MPI_Comm sub = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, colour, rank_, &sub), "MPI_Comm_split");
    return std::make_shared<MpiCommunicator>(sub);
  }

 private:
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

MpiSession::MpiSession(int* argc, char*** argv) {
  if (mpi_initialized()) return;
  int provided = 0;
  check(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  owns_ = true;
}

MpiSession::~MpiSession() {
  if (!owns_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

bool mpi_initialized() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized != 0 && finalized == 0;
}

std::shared_ptr<Communicator> mpi_world() {
  if (!mpi_initialized())
    throw NotAvailable("communicator", "MPI is not initialised (create an MpiSession first)");
  MPI_Comm dup = MPI_COMM_NULL;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &dup), "MPI_Comm_dup");
  return std::make_shared<MpiCommunicator>(dup);
}

}  // namespace dattn
