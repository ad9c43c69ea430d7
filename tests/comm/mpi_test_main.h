// What every MPI test program starts with: MPI up (MpiComm), a 20 s collective timeout, the
// --fault flag, and a failure that prints the rank's error and ends the whole job.
#pragma once
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <memory>

#include "distca/comm/mpi_comm.h"

namespace distca::comm::testing {

struct MpiTest {
  std::unique_ptr<MpiComm> comm;
  bool is_fault = false;
  // Prints the error and aborts the job; returns the exit code for main.
  int fail(const Status& st) const {
    fmt::print(stderr, "rank {}: {}\n", comm->rank(), st.to_string());
    comm->abort(st.message());
    return 1;
  }
};

// nullptr comm (with the reason printed) when MPI cannot start.
inline MpiTest start_mpi_test(int* argc, char*** argv) {
  MpiTest t;
  auto created = MpiComm::create(argc, argv);
  if (!created.is_ok()) {
    fmt::print(stderr, "MpiComm: {}\n", created.status().message());
    return t;
  }
  t.comm = std::move(created.value());
  t.comm->set_timeout(std::chrono::seconds(20));
  t.is_fault = *argc > 1 && std::strcmp((*argv)[1], "--fault") == 0;
  return t;
}

}  // namespace distca::comm::testing
