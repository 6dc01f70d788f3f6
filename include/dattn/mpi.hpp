// The MPI communicator (library dattn_mpi, built where MPI is found). mpi.h stays inside the
// library: callers see only dattn::Communicator.
#pragma once

#include <memory>

#include "dattn/communicator.hpp"

namespace dattn {

// Initialises MPI (thread level FUNNELED: only the calling thread talks to MPI) unless it is
// already initialised, and finalises it on destruction if it initialised it. One per process.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

 private:
  bool owns_ = false;
};

// True when MPI is initialised (an MpiSession is alive or the program initialised MPI itself).
bool mpi_initialized();
// MPI_COMM_WORLD as a Communicator (its own duplicate, so that dattn's messages never meet the
// program's). Needs an initialised MPI.
std::shared_ptr<Communicator> mpi_world();

}  // namespace dattn
