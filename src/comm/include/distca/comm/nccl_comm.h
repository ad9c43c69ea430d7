// NcclComm: the Communicator over NCCL, for buffers in CUDA device memory (one GPU per rank).
// Built when CMake finds the CUDA toolkit and libnccl (DISTCA_HAVE_NCCL); it compiles and links
// without a GPU, and create() then says that there is none. What it has run on: reports/gpu/.
//
// Every buffer passed to an operation is device memory of device(). Operations run in posting
// order on one CUDA stream (stream(): a private one, or the caller's): the caller orders the
// kernels that fill or read the buffers with that stream (pass its own stream, or synchronize).
//
// The NCCL communicator is nonblocking (ncclConfig_t::blocking = 0): no NCCL call blocks the
// host, so every wait is bounded. A Work is complete when NCCL has enqueued the operation and a
// CUDA event recorded after it has fired. wait() ends with an error past timeout(), or when NCCL
// reports an asynchronous error; then the NCCL communicator is aborted (ncclCommAbort) and every
// later operation fails with the reason. create() and split() are bounded by the same timeout.
//
// Differences from MpiComm, all forced by NCCL:
// - Point to point has no tags: a send and a receive between two ranks match in posting order
//   (the tag is only checked to be in [0, kMaxTag]). Their sizes must agree: NCCL does not check,
//   and a mismatch is undefined (it may hang until the timeout). Sends and receives are issued
//   together, in one NCCL group, at the next flush (a test() or wait() of any Work of this
//   communicator, or its next collective), so that the ones posted before a wait progress
//   together, as MPI's do (one after the other on the stream, two ranks that both receive
//   before they send would deadlock).
// - all_to_all_v cannot check that a peer's count agrees with this rank's (REQUIRES, as above).
// - abort() ends this rank's NCCL communicator only: its peers learn of it when their pending
//   operations time out or NCCL reports a remote error. A job that must end at once also aborts
//   the communicator it bootstrapped from (MpiComm::abort ends the whole job).
// - Two ranks of one communicator on the same GPU are not supported by NCCL.
//
// Thread safety: the communicator and its Works may be used from several threads (one lock).
#pragma once

#include <memory>
#include <string>

#include "distca/comm/communicator.h"

namespace distca::comm {

struct NcclCommOptions {
  // The CUDA device of this rank; -1: this rank's index among the ranks on its machine
  // (node_local_rank) modulo the machine's device count.
  int device = -1;
  // A cudaStream_t of `device` that every operation runs on; nullptr: a stream of its own.
  // REQUIRES: outlives the communicator and the groups split from it.
  void* stream = nullptr;
};

class NcclComm final : public Communicator {
 public:
  // Collective over `bootstrap` (an MpiComm, or a LocalComm whose ranks are threads with a GPU
  // each), which carries the NCCL unique id from rank 0 to the others. Rank r of the result is
  // rank r of `bootstrap`; the result takes bootstrap.timeout(). A rank that cannot take part (no
  // CUDA device, a failing CUDA or NCCL call) fails on every rank: its own Status names the call
  // and CUDA's or NCCL's error string, the others name it.
  static Result<std::unique_ptr<NcclComm>> create(Communicator& bootstrap, NcclCommOptions options = {});
  // Finalizes and destroys the NCCL communicator (ncclCommAbort when that does not finish within
  // timeout()); Works still pending end with an error.
  ~NcclComm() override;

  int rank() const override;
  int size() const override;
  std::string name() const override { return "nccl"; }
  int world_rank() const override;

  // ncclGroupStart, ncclSend/ncclRecv of ncclInt8 for every peer with a non-zero count,
  // ncclGroupEnd; this rank's own segment is a device-to-device copy on the same stream.
  Result<std::unique_ptr<Work>> all_to_all_v_async(const AllToAllV& a) override;
  // ncclAllReduce (float, sum), in place; NCCL gives every rank the same bits.
  Result<std::unique_ptr<Work>> all_reduce_sum_async(float* data, int64_t count) override;
  // ncclBroadcast of ncclInt8, in place.
  Result<std::unique_ptr<Work>> broadcast_async(void* data, int64_t bytes, int root) override;
  // A one-float all-reduce on a buffer of the communicator's own.
  Result<std::unique_ptr<Work>> barrier_async() override;
  Result<std::unique_ptr<Work>> send_async(const void* data, int64_t bytes, int peer, int tag) override;
  Result<std::unique_ptr<Work>> recv_async(void* data, int64_t bytes, int peer, int tag) override;
  // ncclCommSplit; the group runs on a stream of its own (or on the caller's stream, when this
  // communicator was given one) and takes this communicator's timeout.
  Result<std::unique_ptr<Communicator>> split(int color, int key, const std::string& label) override;
  // Prints `reason` (one line) and aborts this rank's NCCL communicator: its pending operations
  // end, and every operation after fails with the reason.
  void abort(const std::string& reason) override;

  int device() const;
  void* stream() const;  // the cudaStream_t the operations run on

  // This rank's index among the ranks of `comm` on the same machine (same host name), in rank
  // order. Collective over `comm`.
  static Result<int> node_local_rank(Communicator& comm);

  struct State;  // defined in nccl_comm.cc

 private:
  explicit NcclComm(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace distca::comm
