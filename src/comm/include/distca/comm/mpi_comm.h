// MpiComm: the Communicator over Open MPI, the engine distca runs on across machines (launched
// with mpirun or srun). Built when CMake finds MPI. Non-blocking operations are MPI requests
// that progress when test()/wait() call MPI_Test; all-to-all-v is point-to-point per peer, so a
// timeout names the peers whose bytes never came. abort() ends the whole job (MPI_Abort); a job
// whose ranks all know the outcome ends cleanly instead (agree_on_outcome, then MPI_Finalize).
#pragma once

#include <memory>
#include <string>
#include <vector>

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
  Result<std::unique_ptr<Work>> send_async(const void* data, int64_t bytes, int peer, int tag) override;
  Result<std::unique_ptr<Work>> recv_async(void* data, int64_t bytes, int peer, int tag) override;
  // One pass of MPI's progress engine. Every MPI call of MpiComm holds one lock, so this may run
  // on a progress thread beside the thread that posts and waits.
  Status progress() override;
  // MPI_Comm_split; the group's abort() still ends the whole job.
  Result<std::unique_ptr<Communicator>> split(int color, int key, const std::string& label) override;
  int world_rank() const override { return world_rank_; }
  // Prints `reason` (one line) and ends the whole job with exit code 1 (MPI_Abort).
  void abort(const std::string& reason) override;
  // The same with the exit code `code`.
  [[noreturn]] void abort_with(int code, const std::string& reason);

  // Every rank gives its exit code (0: done); returns the lowest failing rank and its code, or
  // {-1, 0} when every rank is done. Runs on a communicator of its own, so it is safe while
  // operations of the job are still pending. kInternal when not every rank joins within
  // `timeout` (a peer is stuck in an operation that waits for this rank): then only abort ends
  // the job.
  struct Outcome {
    int first_failed_rank = -1;
    int code = 0;
  };
  Result<Outcome> agree_on_outcome(int code, std::chrono::milliseconds timeout);

 private:
  MpiComm(int rank, int size, bool is_owner) : rank_(rank), size_(size), is_owner_(is_owner) {}
  // "rank 2" in the world; "rank 1 of dp (world rank 3)" in a group.
  std::string who(int rank) const;
  int rank_;
  int world_rank_ = 0;
  std::string label_;                 // "" for the world
  std::vector<int> world_ranks_;      // (size) each rank's world rank
  void* comm_ = nullptr;              // MPI_Comm* of the collectives: the world, or a split
  void* p2p_comm_ = nullptr;          // MPI_Comm*: a duplicate for point to point (its tags never meet the collectives')
  void* outcome_comm_ = nullptr;  // an MPI_Comm (a duplicate of the world) for agree_on_outcome
  int size_;
  bool is_owner_;
  uint64_t next_seq_ = 0;
  uint64_t next_p2p_seq_ = 0;
};

}  // namespace distca::comm
