// Communicator: the collectives the CAD runtime and the training loop need, over bytes, with
// explicit asynchrony. Every rank calls the same operations in the same order (as with MPI).
// Non-blocking operations return a Work handle; they make progress only inside test() / wait()
// (or the implementation's own progress), and never hang: past the timeout, or when a peer has
// failed, they end with an error that names the peer.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "distca/core/status.h"

namespace distca::comm {

// One all-to-all-v: send_counts[r] bytes at send + send_offsets[r] go to rank r; recv_counts[p]
// bytes from rank p land at recv + recv_offsets[p]. Both sides must agree on every count.
struct AllToAllV {
  const std::byte* send = nullptr;
  std::span<const int64_t> send_counts;   // (R)
  std::span<const int64_t> send_offsets;  // (R)
  std::byte* recv = nullptr;
  std::span<const int64_t> recv_counts;   // (R)
  std::span<const int64_t> recv_offsets;  // (R)
};

class Work {
 public:
  virtual ~Work() = default;
  // Advances the operation; true once it is complete. An error is final.
  virtual Result<bool> test() = 0;
  // Until complete, the timeout, or a peer's failure.
  virtual Status wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "local" or "mpi"

  // REQUIRES: buffers stay valid, and send buffers unchanged, until the Work completes.
  virtual Result<std::unique_ptr<Work>> all_to_all_v_async(const AllToAllV& a) = 0;
  // Element-wise sum over ranks, in place; every rank gets bit-identical results.
  virtual Result<std::unique_ptr<Work>> all_reduce_sum_async(float* data, int64_t count) = 0;
  virtual Result<std::unique_ptr<Work>> broadcast_async(void* data, int64_t bytes, int root) = 0;
  virtual Result<std::unique_ptr<Work>> barrier_async() = 0;

  // Point to point: `bytes` bytes to (from) rank `peer` of this communicator, matched by
  // (sender, receiver, tag) in posting order, as MPI does; tag in [0, kMaxTag]. The sizes of a
  // matched send and receive must agree, else the receive ends with an error naming the sender
  // (under LocalComm the send too).
  static constexpr int kMaxTag = 32767;
  virtual Result<std::unique_ptr<Work>> send_async(const void* data, int64_t bytes, int peer, int tag) = 0;
  virtual Result<std::unique_ptr<Work>> recv_async(void* data, int64_t bytes, int peer, int tag) = 0;

  // A sub-group, collective over this communicator: the ranks that give the same color (>= 0)
  // form a communicator, ranked by key, then by rank here. `label` names the group in errors
  // ("dp", "pp"). A rank that fails in any group fails the whole job, as in the world.
  virtual Result<std::unique_ptr<Communicator>> split(int color, int key, const std::string& label) = 0;
  // This rank's rank in the world communicator the groups were split from.
  virtual int world_rank() const { return rank(); }

  // Advances pending non-blocking operations without waiting for any (a rank whose transfers
  // only move inside its own calls, as MPI's, calls this while it computes). Safe to call from a
  // second thread while the first posts and waits. Default: nothing to do (the transfers move
  // by themselves).
  virtual Status progress() { return Status::ok(); }

  // Blocking forms: start, then wait.
  Status all_to_all_v(const AllToAllV& a);
  Status all_reduce_sum(float* data, int64_t count);
  Status broadcast(void* data, int64_t bytes, int root);
  Status barrier();
  Status send(const void* data, int64_t bytes, int peer, int tag);
  Status recv(void* data, int64_t bytes, int peer, int tag);

  // Marks this rank failed with `reason`: the peers' pending and later operations end with an
  // error naming this rank (LocalComm), or the job is aborted (MpiComm).
  virtual void abort(const std::string& reason) = 0;

  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

 protected:
  // Checks an AllToAllV against this communicator's size.
  Status check(const AllToAllV& a) const;
  // Checks a point-to-point call ("send" or "recv") against this communicator.
  Status check_p2p(const char* what, const void* data, int64_t bytes, int peer, int tag) const;

 private:
  std::chrono::milliseconds timeout_{std::chrono::seconds(120)};
};

}  // namespace distca::comm
