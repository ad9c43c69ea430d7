// Where a multi-rank command runs: under an MPI launcher (mpirun, srun) this process is one
// rank of an MpiComm; otherwise `local_ranks` threads over LocalComm in this process.
#pragma once
#include <functional>
#include <string>

#include "distca/comm/communicator.h"

namespace distca::tools {

bool is_under_mpi();

// Runs `body` on every rank. A failing rank's error is printed as "distca <command>: rank r:
// error: ..." and ends the job (MPI: the job is aborted; LocalComm: the other ranks' pending
// collectives fail); validate flags before calling. Returns the exit code: 0, 2 for invalid input, 1 otherwise.
int run_world(const std::string& command, int local_ranks, const std::function<Status(comm::Communicator&)>& body);

}  // namespace distca::tools
