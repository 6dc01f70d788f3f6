// Communicator over MPI: all-to-all-v and all-gather as MPI collectives over bytes, send/recv
// pairs as MPI_Isend/MPI_Irecv, sub-groups through MPI_Comm_split (key = rank keeps the order).
#include <mpi.h>

#include <climits>
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

std::vector<int> as_ints(const std::vector<std::size_t>& v, const char* what) {
  std::vector<int> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = as_int(v[i], what);
  return out;
}

class MpiTransfer final : public PendingTransfer {
 public:
  MpiTransfer() = default;
  ~MpiTransfer() override {
    if (!done_) MPI_Waitall(2, requests_, MPI_STATUSES_IGNORE);
  }
  void wait() override {
    if (done_) return;
    done_ = true;
    check(MPI_Waitall(2, requests_, MPI_STATUSES_IGNORE), "MPI_Waitall");
  }
  MPI_Request requests_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};

 private:
  bool done_ = false;
};

class MpiCommunicator final : public Communicator {
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

  void all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                    const std::vector<std::size_t>& send_displs, void* recv,
                    const std::vector<std::size_t>& recv_counts,
                    const std::vector<std::size_t>& recv_displs) override {
    const std::vector<int> sc = as_ints(send_counts, "all_to_all_v"),
                           sd = as_ints(send_displs, "all_to_all_v"),
                           rc = as_ints(recv_counts, "all_to_all_v"),
                           rd = as_ints(recv_displs, "all_to_all_v");
    check(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE,
                        comm_),
          "MPI_Alltoallv");
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
    check(MPI_Irecv(recv, as_int(recv_bytes, "recv"), MPI_BYTE, source, kTag, comm_,
                    &t->requests_[0]),
          "MPI_Irecv");
    check(
        MPI_Isend(send, as_int(send_bytes, "send"), MPI_BYTE, dest, kTag, comm_, &t->requests_[1]),
        "MPI_Isend");
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
