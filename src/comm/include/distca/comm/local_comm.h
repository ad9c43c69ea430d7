// LocalComm: R ranks as threads of one process, exchanging through shared memory. Used by most
// tests (no MPI needed) and by single-process runs. Operations progress inside test()/wait() of
// the ranks involved; a rank that fails (abort(), or LocalWorld::run's body throwing or
// returning an error) makes every peer's pending and later operations fail with its reason.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "distca/comm/communicator.h"

namespace distca::comm {

class LocalWorld {
 public:
  explicit LocalWorld(int num_ranks);
  ~LocalWorld();
  LocalWorld(const LocalWorld&) = delete;
  LocalWorld& operator=(const LocalWorld&) = delete;

  int size() const;
  Communicator& comm(int rank);

  // Runs body(comm) on one thread per rank and returns each rank's status. A body that throws
  // or returns an error aborts the world, so its peers end with an error naming it.
  static std::vector<Status> run(int num_ranks, const std::function<Status(Communicator&)>& body,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(120));

  struct Shared;  // the state the ranks share (defined in local_comm.cc)

 private:
  class Comm;
  std::shared_ptr<Shared> shared_;
  std::vector<std::unique_ptr<Comm>> comms_;
};

}  // namespace distca::comm
