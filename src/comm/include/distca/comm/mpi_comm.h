// MpiComm: the Communicator over Open MPI, the engine distca runs on across machines (launched
// with mpirun or srun). Built when CMake finds MPI. Non-blocking operations are MPI requests
// that progress when test()/wait() call MPI_Test; all-to-all-v is point-to-point per peer, so a
// timeout names the peers whose bytes never came. abort() ends the whole job (MPI_Abort).
#pragma once

#include <memory>

#include "distca/comm/communicator.h"

namespace distca::comm {

class MpiComm final : public Communicator {
 public:
  // Initializes MPI (MPI_THREAD_SERIALIZED) unless it already is; the destructor finalizes it
  // when this object initialized it. MPI errors are returned as Statuses, not fatal.
  static Result<std::unique_ptr<MpiComm>> create(int* argc, char*** argv);
  ~MpiComm() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  Result<std::unique_ptr<Work>> all_to_all_v_async(const AllToAllV& a) override;
  Result<std::unique_ptr<Work>> all_reduce_sum_async(float* data, int64_t count) override;
  Result<std::unique_ptr<Work>> broadcast_async(void* data, int64_t bytes, int root) override;
  Result<std::unique_ptr<Work>> barrier_async() override;
  void abort(const std::string& reason) override;

 private:
  MpiComm(int rank, int size, bool is_owner) : rank_(rank), size_(size), is_owner_(is_owner) {}
  int rank_;
  int size_;
  bool is_owner_;
  uint64_t next_seq_ = 0;
};

}  // namespace distca::comm
