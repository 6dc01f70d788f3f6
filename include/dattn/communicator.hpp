// The communicator that sequence parallelism runs over (docs/semantics.md, "Sequence parallelism"):
// a group of ranks that exchange bytes. Two implementations: MPI (dattn/mpi.hpp, library dattn_mpi)
// across processes, and an in-process group (threads as ranks) for tests. NCCL can be a third.
//
// Every collective must be called by every rank of the group in the same order; counts and
// displacements are in bytes. A rank sends to itself through the same calls.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace dattn {

// A started send/receive pair; wait() completes both (and is called by the destructor).
class PendingTransfer {
 public:
  virtual ~PendingTransfer() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Rank p's block for rank q is send[send_displs[q] .. + send_counts[q]) on rank p and lands in
  // recv[recv_displs[p] .. + recv_counts[p]) on rank q. Each vector has size() entries.
  virtual void all_to_all_v(const void* send, const std::vector<std::size_t>& send_counts,
                            const std::vector<std::size_t>& send_displs, void* recv,
                            const std::vector<std::size_t>& recv_counts,
                            const std::vector<std::size_t>& recv_displs) = 0;
  // Every rank sends `bytes` bytes; recv holds size() * bytes, rank p's at p * bytes.
  virtual void all_gather(const void* send, std::size_t bytes, void* recv);
  // Equal blocks of `bytes` to and from every rank.
  void all_to_all(const void* send, std::size_t bytes, void* recv);

  // Starts sending `send_bytes` to `dest` and receiving `recv_bytes` from `source`; the buffers
  // stay untouched (send) and unread (recv) until wait(). Pairs between two ranks arrive in
  // the order they were started.
  virtual std::unique_ptr<PendingTransfer> start_send_recv(const void* send, std::size_t send_bytes,
                                                           int dest, void* recv,
                                                           std::size_t recv_bytes, int source) = 0;

  // Collective: ranks with the same colour form a sub-group, ranked in this group's order.
  virtual std::shared_ptr<Communicator> split(int colour) = 0;
};

// `size` communicators of one in-process group, rank i at index i; each is used by one thread.
std::vector<std::shared_ptr<Communicator>> make_in_process_group(int size);

}  // namespace dattn
