#include "distca/comm/nccl_comm.h"
#include "distca/core/cuda_status.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace distca::comm {
namespace {

using Clock = std::chrono::steady_clock;

// ncclInProgress is not an error: a nonblocking communicator answers it while NCCL finishes the
// call in the background (the caller polls ncclCommGetAsyncError).
Status nccl_status(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess || r == ncclInProgress) return Status::ok();
  const char* last = ncclGetLastError(comm);
  return internal_error(fmt::format("{} failed: {}{}{}", what, ncclGetErrorString(r), last != nullptr && *last ? ": " : "",
                                    last != nullptr ? last : ""));
}
#define DISTCA_NCCL_CHECK(call) DISTCA_RETURN_IF_ERROR(nccl_status((call), #call))

// Device memory freed when it goes out of scope.
struct DeviceBuffer {
  void* ptr = nullptr;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr != nullptr) (void)cudaFree(ptr);
  }
};

// One posted operation. Its event is recorded on the stream once NCCL has enqueued it (at once,
// or later when the nonblocking communicator reports the enqueue done). Point-to-point
// operations are issued later still: together, in one NCCL group, at the next flush.
struct Op {
  Op(std::string w, std::string peers) : what(std::move(w)), waiting_for(std::move(peers)) {}
  ~Op() {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;
  std::string what;         // "all_to_all_v #3"
  std::string waiting_for;  // for timeouts: "rank 1, rank 2" or "the other ranks"
  cudaEvent_t event = nullptr;
  bool is_enqueued = false;
  std::string error;        // set when issuing it failed
};

// A send or receive waiting for the next flush.
struct PendingP2p {
  bool is_send = false;
  void* data = nullptr;
  int64_t bytes = 0;
  int peer = 0;
  std::shared_ptr<Op> op;
};

// Buffers NCCL may read or write: device (or managed) memory of `device`.
Status check_device_buffer(const char* what, const void* p, int device) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // not a pointer CUDA knows: clear the error it left
    return invalid_argument(fmt::format("{}: buffer {} is not CUDA device memory", what, p));
  }
  if ((attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) ||
      (attr.type == cudaMemoryTypeDevice && attr.device != device)) {
    return invalid_argument(fmt::format("{}: buffer {} is not device memory of CUDA device {} (NcclComm moves device "
                                        "buffers; copy host data to the device first)",
                                        what, p, device));
  }
  return Status::ok();
}

// The calls of one NCCL group: every call runs (NCCL needs the ncclGroupEnd), the first error wins.
template <typename Calls>
ncclResult_t nccl_group(const Calls& calls) {
  if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
  const ncclResult_t first = calls();
  const ncclResult_t end = ncclGroupEnd();
  return first != ncclSuccess && first != ncclInProgress ? first : end;
}

}  // namespace

struct NcclComm::State {
  ~State() {
    CudaDeviceScope scope(device);
    if (comm != nullptr) (void)ncclCommAbort(comm);  // a create that failed after ncclCommInitRank
    if (barrier_scratch != nullptr) (void)cudaFree(barrier_scratch);
    if (owns_stream && stream != nullptr) (void)cudaStreamDestroy(stream);
  }

  // "rank 2" in the world; "rank 1 of dp (world rank 3)" in a group.
  std::string who(int r) const {
    if (label.empty()) return fmt::format("rank {}", r);
    if (static_cast<size_t>(r) >= world_ranks.size()) return fmt::format("rank {} of {}", r, label);  // while split gathers them
    return fmt::format("rank {} of {} (world rank {})", r, label, world_ranks[r]);
  }

  // REQUIRES: mu held, device current. Reads the communicator's state: an asynchronous error
  // aborts it; when an enqueue in progress has finished, records those operations' events.
  Status poll(const std::string& what) {
    if (comm == nullptr) return internal_error(fmt::format("{} on {}: the NCCL communicator was {}", what, who(rank), closed));
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t r = ncclCommGetAsyncError(comm, &state); r != ncclSuccess) state = r;
    if (state == ncclInProgress) return Status::ok();
    if (state != ncclSuccess) {
      const char* last = ncclGetLastError(comm);
      const std::string message = fmt::format("{} on {}: NCCL reported an error: {}{}{}; the communicator is aborted", what,
                                              who(rank), ncclGetErrorString(state), last != nullptr && *last ? ": " : "",
                                              last != nullptr ? last : "");
      abort_locked(message);
      return internal_error(message);
    }
    const std::vector<std::shared_ptr<Op>> done = std::move(enqueuing);
    enqueuing.clear();
    return record(done);
  }

  // REQUIRES: mu held, device current. The events of operations NCCL has enqueued.
  Status record(const std::vector<std::shared_ptr<Op>>& ops) {
    for (const std::shared_ptr<Op>& op : ops) {
      if (Status st = cuda_status(cudaEventRecord(op->event, stream), "cudaEventRecord"); !st.is_ok()) {
        const std::string message = fmt::format("{} on {}: {}; the communicator is aborted", op->what, who(rank), st.message());
        abort_locked(message);
        return internal_error(message);
      }
      op->is_enqueued = true;
    }
    return Status::ok();
  }

  // REQUIRES: mu held, device current. Until no enqueue is in progress (NCCL takes no call on a
  // nonblocking communicator before); past `deadline` the communicator is aborted.
  Status settle(Clock::time_point deadline, const std::string& what, std::chrono::milliseconds timeout) {
    for (int spin = 0;; ++spin) {
      DISTCA_RETURN_IF_ERROR(poll(what));
      if (enqueuing.empty()) return Status::ok();
      if (Clock::now() > deadline) {
        const std::string message =
            fmt::format("{} on {}: NCCL did not finish enqueuing {} within {} ms (waiting for {}); the communicator is aborted",
                        what, who(rank), enqueuing[0]->what, timeout.count(), enqueuing[0]->waiting_for);
        abort_locked(message);
        return internal_error(message);
      }
      if (spin > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // REQUIRES: mu held, device current, no enqueue in progress. Issues the pending sends and
  // receives in one NCCL group, so that they progress together (as MPI's do): a pair of ranks
  // that both receive before they send does not deadlock on the stream.
  Status flush_p2p() {
    if (p2p_pending.empty()) return Status::ok();
    std::vector<PendingP2p> batch = std::move(p2p_pending);
    p2p_pending.clear();
    std::vector<std::shared_ptr<Op>> ops;
    for (const PendingP2p& m : batch) ops.push_back(m.op);
    const ncclResult_t r = nccl_group_of(batch);
    if (r == ncclInProgress) {
      enqueuing = std::move(ops);
      return Status::ok();
    }
    if (r != ncclSuccess) {
      const std::string error = nccl_status(r, "ncclSend/ncclRecv", comm).message();
      for (const std::shared_ptr<Op>& op : ops) op->error = error;
      return Status::ok();  // each operation's Work reports it
    }
    return record(ops);
  }

  ncclResult_t nccl_group_of(const std::vector<PendingP2p>& batch);

  // REQUIRES: mu held.
  void abort_locked(const std::string& reason) {
    if (comm == nullptr) return;
    CudaDeviceScope scope(device);
    (void)ncclCommAbort(comm);
    comm = nullptr;
    closed = fmt::format("aborted ({})", reason);
    enqueuing.clear();
    p2p_pending.clear();
  }

  std::mutex mu;
  ncclComm_t comm = nullptr;     // null once aborted or destroyed (`closed` says which)
  std::string closed;
  cudaStream_t stream = nullptr;
  bool owns_stream = false;
  float* barrier_scratch = nullptr;  // (1) device memory the barrier reduces
  int device = 0;
  int rank = 0;
  int size = 0;
  int world_rank = 0;
  std::string label;             // "" for a communicator made by create()
  std::vector<int> world_ranks;  // (size) each rank's world rank (groups only)
  std::vector<std::shared_ptr<Op>> enqueuing;  // the operations NCCL is still enqueuing
  std::vector<PendingP2p> p2p_pending;         // sends and receives not issued yet, in posting order
  uint64_t next_seq = 0;
};

ncclResult_t NcclComm::State::nccl_group_of(const std::vector<PendingP2p>& batch) {
  return nccl_group([&]() {
    ncclResult_t first = ncclSuccess;
    for (const PendingP2p& m : batch) {
      const ncclResult_t r = m.is_send ? ncclSend(m.data, static_cast<size_t>(m.bytes), ncclInt8, m.peer, comm, stream)
                                       : ncclRecv(m.data, static_cast<size_t>(m.bytes), ncclInt8, m.peer, comm, stream);
      if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
    }
    return first;
  });
}

namespace {

using State = NcclComm::State;

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<State> state, std::shared_ptr<Op> op, std::chrono::milliseconds timeout)
      : state_(std::move(state)), op_(std::move(op)), timeout_(timeout) {}

  Result<bool> test() override {
    if (is_done_) return true;
    std::lock_guard lock(state_->mu);
    CudaDeviceScope scope(state_->device);
    DISTCA_RETURN_IF_ERROR(scope.status());
    // 1. The communicator's state (finished enqueues, asynchronous errors); the pending sends and
    //    receives are issued once nothing is being enqueued.
    DISTCA_RETURN_IF_ERROR(state_->poll(op_->what));
    if (state_->enqueuing.empty()) DISTCA_RETURN_IF_ERROR(state_->flush_p2p());
    if (!op_->error.empty()) return internal_error(fmt::format("{} on {}: {}", op_->what, state_->who(state_->rank), op_->error));
    if (!op_->is_enqueued) return false;
    // 2. The operation's event.
    const cudaError_t e = cudaEventQuery(op_->event);
    if (e == cudaErrorNotReady) return false;
    if (e != cudaSuccess) {
      return internal_error(fmt::format("{} on {}: {}", op_->what, state_->who(state_->rank),
                                        cuda_status(e, "cudaEventQuery").message()));
    }
    is_done_ = true;
    return true;
  }

  Status wait() override {
    const auto deadline = Clock::now() + timeout_;
    for (int spin = 0;; ++spin) {
      DISTCA_ASSIGN_OR_RETURN(bool done, test());
      if (done) return Status::ok();
      if (Clock::now() > deadline) break;
      if (spin > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    std::lock_guard lock(state_->mu);
    const std::string message =
        fmt::format("{} on {}: timed out after {} ms waiting for {}; the NCCL communicator is aborted", op_->what,
                    state_->who(state_->rank), timeout_.count(), op_->waiting_for);
    state_->abort_locked(message);
    return internal_error(message);
  }

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<Op> op_;
  std::chrono::milliseconds timeout_;
  bool is_done_ = false;
};

// Posts one operation: `issue` makes its NCCL calls (and CUDA calls on the stream) and returns
// NCCL's answer; ncclInProgress leaves the operation's event to be recorded by a later poll.
// Sends and receives posted before it are issued first (posting order is stream order).
Result<std::unique_ptr<Work>> post(const std::shared_ptr<State>& state, std::chrono::milliseconds timeout,
                                   const char* kind, std::string waiting_for,
                                   const std::function<Result<ncclResult_t>(State&)>& issue) {
  std::lock_guard lock(state->mu);
  State& s = *state;
  const std::string what = fmt::format("{} #{}", kind, s.next_seq++);
  CudaDeviceScope scope(s.device);
  DISTCA_RETURN_IF_ERROR(scope.status());
  const auto deadline = Clock::now() + timeout;
  DISTCA_RETURN_IF_ERROR(s.settle(deadline, what, timeout));
  DISTCA_RETURN_IF_ERROR(s.flush_p2p());
  DISTCA_RETURN_IF_ERROR(s.settle(deadline, what, timeout));
  auto op = std::make_shared<Op>(what, std::move(waiting_for));
  DISTCA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&op->event, cudaEventDisableTiming));
  DISTCA_ASSIGN_OR_RETURN(const ncclResult_t r, issue(s));
  if (r == ncclInProgress) {
    s.enqueuing.push_back(op);
  } else if (r != ncclSuccess) {
    return internal_error(fmt::format("{} on {}: {}", what, s.who(s.rank), nccl_status(r, kind, s.comm).message()));
  } else {
    DISTCA_RETURN_IF_ERROR(s.record({op}));
  }
  return std::unique_ptr<Work>(std::make_unique<NcclWork>(state, op, timeout));
}

// Queues a send or receive for the next flush (a test() or wait() of any Work, or the next
// collective); NCCL has no tags, so messages between two ranks match in posting order.
Result<std::unique_ptr<Work>> post_p2p(const std::shared_ptr<State>& state, std::chrono::milliseconds timeout, bool is_send,
                                       void* data, int64_t bytes, int peer) {
  std::lock_guard lock(state->mu);
  State& s = *state;
  const char* kind = is_send ? "send" : "recv";
  auto op = std::make_shared<Op>(fmt::format("{} #{}", kind, s.next_seq++), s.who(peer));
  if (s.comm == nullptr) return internal_error(fmt::format("{} on {}: the NCCL communicator was {}", op->what, s.who(s.rank), s.closed));
  CudaDeviceScope scope(s.device);
  DISTCA_RETURN_IF_ERROR(scope.status());
  DISTCA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&op->event, cudaEventDisableTiming));
  if (bytes == 0) {
    // An empty message moves nothing: both sides agree on the size, so neither issues it.
    DISTCA_RETURN_IF_ERROR(s.record({op}));
  } else {
    s.p2p_pending.push_back({is_send, data, bytes, peer, op});
  }
  return std::unique_ptr<Work>(std::make_unique<NcclWork>(state, op, timeout));
}

// Until `comm` (not null) has finished what it was doing in the background, or the deadline.
// Returns its final state; ncclInProgress means the deadline passed.
ncclResult_t wait_ready(ncclComm_t comm, Clock::time_point deadline) {
  for (int spin = 0;; ++spin) {
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t r = ncclCommGetAsyncError(comm, &state); r != ncclSuccess) return r;
    if (state != ncclInProgress || Clock::now() > deadline) return state;
    if (spin > 100) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// Every rank gives its local outcome; every rank fails when one does (its own error, or one that
// names the failing ranks), so that no rank waits for a peer that will never come.
Status agree(Communicator& bootstrap, const Status& local, const char* what) {
  std::vector<float> failed(static_cast<size_t>(bootstrap.size()), 0.0f);
  failed[static_cast<size_t>(bootstrap.rank())] = local.is_ok() ? 0.0f : 1.0f;
  const Status st = bootstrap.all_reduce_sum(failed.data(), static_cast<int64_t>(failed.size()));
  if (!local.is_ok()) return local;
  if (!st.is_ok()) return st;
  std::vector<int> bad;
  for (size_t p = 0; p < failed.size(); ++p) {
    if (failed[p] > 0) bad.push_back(static_cast<int>(p));
  }
  if (bad.empty()) return Status::ok();
  return internal_error(fmt::format("{} on rank {}: rank {} failed (its own error says why)", what, bootstrap.rank(),
                                    fmt::join(bad, ", rank ")));
}

// The device this rank uses: `requested`, or the node-local rank modulo the device count.
Status pick_device(int requested, int local_rank, int* device) {
  if (requested < -1) return invalid_argument(fmt::format("CUDA device {} (give a device index, or -1)", requested));
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    (void)cudaGetLastError();
    return not_found(fmt::format("no CUDA device: {}", cuda_status(e, "cudaGetDeviceCount").message()));
  }
  if (count == 0) return not_found("no CUDA device: cudaGetDeviceCount found none");
  if (requested >= count) return invalid_argument(fmt::format("CUDA device {} does not exist ({} found)", requested, count));
  *device = requested >= 0 ? requested : local_rank % count;
  return Status::ok();
}

// A stream (given, or made), the barrier's scratch float, and a stream of `s.device`.
Status make_stream_and_scratch(State& s, void* given_stream) {
  if (given_stream != nullptr) {
    s.stream = static_cast<cudaStream_t>(given_stream);
  } else {
    DISTCA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    s.owns_stream = true;
  }
  DISTCA_CUDA_RETURN_IF_ERROR(cudaMalloc(&s.barrier_scratch, sizeof(float)));
  DISTCA_CUDA_RETURN_IF_ERROR(cudaMemset(s.barrier_scratch, 0, sizeof(float)));
  return Status::ok();
}

// ncclCommInitRankConfig (nonblocking) until the communicator is ready, or the deadline.
Status init_state(State& s, const ncclUniqueId& id, void* given_stream, std::chrono::milliseconds timeout) {
  CudaDeviceScope scope(s.device);
  DISTCA_RETURN_IF_ERROR(scope.status());
  DISTCA_RETURN_IF_ERROR(make_stream_and_scratch(s, given_stream));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  DISTCA_NCCL_CHECK(ncclCommInitRankConfig(&s.comm, s.size, id, s.rank, &config));
  if (s.comm == nullptr) return internal_error("ncclCommInitRankConfig returned no communicator");
  const ncclResult_t state = wait_ready(s.comm, Clock::now() + timeout);
  if (state == ncclInProgress) {
    return internal_error(fmt::format("ncclCommInitRankConfig did not finish within {} ms (a rank that never joined?)",
                                      timeout.count()));
  }
  return nccl_status(state, "ncclCommInitRankConfig", s.comm);
}

}  // namespace

NcclComm::NcclComm(std::shared_ptr<State> state) : state_(std::move(state)) {}

NcclComm::~NcclComm() {
  std::lock_guard lock(state_->mu);
  State& s = *state_;
  if (s.comm == nullptr) return;
  CudaDeviceScope scope(s.device);
  const auto deadline = Clock::now() + timeout();
  s.p2p_pending.clear();  // never issued: their Works end with an error
  if (!s.settle(deadline, "destroy", timeout()).is_ok()) return;  // aborted
  // ncclCommFinalize flushes what was posted; the communicator is quiescent when its state leaves
  // ncclInProgress. Then ncclCommDestroy frees it without blocking.
  ncclResult_t state = ncclCommFinalize(s.comm);
  if (state == ncclSuccess || state == ncclInProgress) state = wait_ready(s.comm, deadline);
  if (state == ncclSuccess) {
    (void)ncclCommDestroy(s.comm);
    s.comm = nullptr;
    s.closed = "destroyed";
    return;
  }
  const std::string reason = state == ncclInProgress
                                 ? fmt::format("ncclCommFinalize did not finish within {} ms", timeout().count())
                                 : nccl_status(state, "ncclCommFinalize", s.comm).message();
  fmt::print(stderr, "NcclComm on {}: {}; aborting the communicator\n", s.who(s.rank), reason);
  s.abort_locked(reason);
}

int NcclComm::rank() const { return state_->rank; }
int NcclComm::size() const { return state_->size; }
int NcclComm::world_rank() const { return state_->world_rank; }
int NcclComm::device() const { return state_->device; }
void* NcclComm::stream() const { return state_->stream; }

Result<int> NcclComm::node_local_rank(Communicator& comm) {
  constexpr int64_t kName = 256;  // bytes per host name (HOST_NAME_MAX is 64 on Linux)
  const int R = comm.size(), me = comm.rank();
  std::vector<char> mine(kName, '\0'), all(static_cast<size_t>(R * kName), '\0');
  if (gethostname(mine.data(), kName - 1) != 0) {
    return internal_error(fmt::format("gethostname failed: {}", std::strerror(errno)));
  }
  // An all-gather of the names: every rank sends its one name to every rank.
  std::vector<int64_t> send_counts(R, kName), send_offsets(R, 0), recv_counts(R, kName), recv_offsets(R);
  for (int p = 0; p < R; ++p) recv_offsets[p] = p * kName;
  DISTCA_RETURN_IF_ERROR(comm.all_to_all_v({reinterpret_cast<const std::byte*>(mine.data()), send_counts, send_offsets,
                                            reinterpret_cast<std::byte*>(all.data()), recv_counts, recv_offsets}));
  int local = 0;
  for (int p = 0; p < me; ++p) local += std::strncmp(all.data() + p * kName, mine.data(), kName) == 0 ? 1 : 0;
  return local;
}

Result<std::unique_ptr<NcclComm>> NcclComm::create(Communicator& bootstrap, NcclCommOptions options) {
  const int R = bootstrap.size(), me = bootstrap.rank();
  const auto prefix = [me](const Status& st) {
    return st.is_ok() ? st : Status(st.code(), fmt::format("NcclComm on rank {}: {}", me, st.message()));
  };
  DISTCA_ASSIGN_OR_RETURN(const int local_rank, node_local_rank(bootstrap));

  // 1. The device, and NCCL's unique id on rank 0; a rank that fails fails every rank.
  int device = 0;
  ncclUniqueId id{};
  Status local = pick_device(options.device, local_rank, &device);
  if (local.is_ok() && me == 0) local = nccl_status(ncclGetUniqueId(&id), "ncclGetUniqueId");
  DISTCA_RETURN_IF_ERROR(agree(bootstrap, prefix(local), "NcclComm::create"));

  // 2. The id from rank 0 to every rank, over the bootstrap communicator.
  DISTCA_RETURN_IF_ERROR(bootstrap.broadcast(&id, static_cast<int64_t>(sizeof id), 0));

  // 3. Every rank joins the NCCL communicator; a rank that could not fails every rank (the
  //    others' communicators are aborted when `state` goes).
  auto state = std::make_shared<State>();
  state->device = device;
  state->rank = me;
  state->size = R;
  state->world_rank = bootstrap.world_rank();
  local = init_state(*state, id, options.stream, bootstrap.timeout());
  DISTCA_RETURN_IF_ERROR(agree(bootstrap, prefix(local), "NcclComm::create"));
  auto c = std::unique_ptr<NcclComm>(new NcclComm(std::move(state)));
  c->set_timeout(bootstrap.timeout());
  return c;
}

Result<std::unique_ptr<Work>> NcclComm::all_to_all_v_async(const AllToAllV& a) {
  DISTCA_RETURN_IF_ERROR(check(a));
  const int me = rank();
  if (a.send_counts[me] != a.recv_counts[me]) {
    return invalid_argument(fmt::format("all_to_all_v: rank {} sends itself {} bytes but expects {}", me, a.send_counts[me],
                                        a.recv_counts[me]));
  }
  std::vector<std::string> peers;
  bool is_sending = false, is_receiving = false;
  for (int p = 0; p < size(); ++p) {
    is_sending |= a.send_counts[p] > 0;
    is_receiving |= a.recv_counts[p] > 0;
    if (p != me && (a.send_counts[p] > 0 || a.recv_counts[p] > 0)) peers.push_back(state_->who(p));
  }
  if (is_sending) DISTCA_RETURN_IF_ERROR(check_device_buffer("all_to_all_v send", a.send, device()));
  if (is_receiving) DISTCA_RETURN_IF_ERROR(check_device_buffer("all_to_all_v recv", a.recv, device()));
  const std::string waiting_for = peers.empty() ? std::string("no peer") : fmt::format("{}", fmt::join(peers, ", "));
  return post(state_, timeout(), "all_to_all_v", waiting_for, [&a, me](State& s) -> Result<ncclResult_t> {
    if (a.recv_counts[me] > 0) {
      DISTCA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(a.recv + a.recv_offsets[me], a.send + a.send_offsets[me],
                                        static_cast<size_t>(a.recv_counts[me]), cudaMemcpyDeviceToDevice, s.stream));
    }
    return nccl_group([&]() {
      ncclResult_t first = ncclSuccess;
      auto keep_first = [&first](ncclResult_t r) {
        if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
      };
      for (int p = 0; p < s.size; ++p) {
        if (p == me) continue;
        if (a.recv_counts[p] > 0) {
          keep_first(ncclRecv(a.recv + a.recv_offsets[p], static_cast<size_t>(a.recv_counts[p]), ncclInt8, p, s.comm, s.stream));
        }
        if (a.send_counts[p] > 0) {
          keep_first(ncclSend(a.send + a.send_offsets[p], static_cast<size_t>(a.send_counts[p]), ncclInt8, p, s.comm, s.stream));
        }
      }
      return first;
    });
  });
}

Result<std::unique_ptr<Work>> NcclComm::all_reduce_sum_async(float* data, int64_t count) {
  if (count < 0 || (count > 0 && data == nullptr)) return invalid_argument(fmt::format("all_reduce_sum: bad buffer ({} floats)", count));
  if (count > 0) DISTCA_RETURN_IF_ERROR(check_device_buffer("all_reduce_sum", data, device()));
  return post(state_, timeout(), "all_reduce_sum", "the other ranks", [data, count](State& s) -> Result<ncclResult_t> {
    return ncclAllReduce(data, data, static_cast<size_t>(count), ncclFloat, ncclSum, s.comm, s.stream);
  });
}

Result<std::unique_ptr<Work>> NcclComm::broadcast_async(void* data, int64_t bytes, int root) {
  if (root < 0 || root >= size()) return invalid_argument(fmt::format("broadcast: root {} is not a rank of {}", root, size()));
  if (bytes < 0 || (bytes > 0 && data == nullptr)) return invalid_argument(fmt::format("broadcast: bad buffer ({} bytes)", bytes));
  if (bytes > 0) DISTCA_RETURN_IF_ERROR(check_device_buffer("broadcast", data, device()));
  const std::string from = rank() == root ? std::string("the other ranks") : state_->who(root);
  return post(state_, timeout(), "broadcast", from, [data, bytes, root](State& s) -> Result<ncclResult_t> {
    return ncclBroadcast(data, data, static_cast<size_t>(bytes), ncclInt8, root, s.comm, s.stream);
  });
}

Result<std::unique_ptr<Work>> NcclComm::barrier_async() {
  return post(state_, timeout(), "barrier", "the other ranks", [](State& s) -> Result<ncclResult_t> {
    return ncclAllReduce(s.barrier_scratch, s.barrier_scratch, 1, ncclFloat, ncclSum, s.comm, s.stream);
  });
}

Result<std::unique_ptr<Work>> NcclComm::send_async(const void* data, int64_t bytes, int peer, int tag) {
  DISTCA_RETURN_IF_ERROR(check_p2p("send", data, bytes, peer, tag));
  if (bytes > 0) DISTCA_RETURN_IF_ERROR(check_device_buffer("send", data, device()));
  return post_p2p(state_, timeout(), true, const_cast<void*>(data), bytes, peer);
}

Result<std::unique_ptr<Work>> NcclComm::recv_async(void* data, int64_t bytes, int peer, int tag) {
  DISTCA_RETURN_IF_ERROR(check_p2p("recv", data, bytes, peer, tag));
  if (bytes > 0) DISTCA_RETURN_IF_ERROR(check_device_buffer("recv", data, device()));
  return post_p2p(state_, timeout(), false, data, bytes, peer);
}

Result<std::unique_ptr<Communicator>> NcclComm::split(int color, int key, const std::string& label) {
  if (color < 0) return invalid_argument(fmt::format("split: color {} (must be >= 0)", color));
  if (label.empty()) return invalid_argument("split: a group needs a label");
  auto group = std::make_shared<State>();
  {
    std::lock_guard lock(state_->mu);
    State& s = *state_;
    const std::string what = fmt::format("split #{} ({})", s.next_seq++, label);
    CudaDeviceScope scope(s.device);
    DISTCA_RETURN_IF_ERROR(scope.status());
    const auto deadline = Clock::now() + timeout();
    DISTCA_RETURN_IF_ERROR(s.settle(deadline, what, timeout()));
    DISTCA_RETURN_IF_ERROR(s.flush_p2p());
    DISTCA_RETURN_IF_ERROR(s.settle(deadline, what, timeout()));
    group->device = s.device;
    group->world_rank = s.world_rank;
    group->label = label;
    DISTCA_RETURN_IF_ERROR(make_stream_and_scratch(*group, s.owns_stream ? nullptr : s.stream));
    // 1. ncclCommSplit (the group inherits the nonblocking config); both communicators are ready
    //    when their states leave ncclInProgress.
    const ncclResult_t r = ncclCommSplit(s.comm, color, key, &group->comm, nullptr);
    if (Status st = nccl_status(r, "ncclCommSplit", s.comm); !st.is_ok()) {
      return internal_error(fmt::format("{} on {}: {}", what, s.who(s.rank), st.message()));
    }
    ncclResult_t parent = wait_ready(s.comm, deadline);
    ncclResult_t child = group->comm != nullptr ? wait_ready(group->comm, deadline) : ncclInternalError;
    if (parent != ncclSuccess || child != ncclSuccess) {
      const std::string message =
          parent == ncclInProgress || child == ncclInProgress
              ? fmt::format("{} on {}: ncclCommSplit did not finish within {} ms; the communicator is aborted", what,
                            s.who(s.rank), timeout().count())
              : fmt::format("{} on {}: ncclCommSplit failed: {}; the communicator is aborted", what, s.who(s.rank),
                            ncclGetErrorString(parent != ncclSuccess ? parent : child));
      s.abort_locked(message);  // the group's communicator is aborted when `group` goes
      return internal_error(message);
    }
    DISTCA_NCCL_CHECK(ncclCommUserRank(group->comm, &group->rank));
    DISTCA_NCCL_CHECK(ncclCommCount(group->comm, &group->size));
  }
  auto c = std::unique_ptr<NcclComm>(new NcclComm(group));
  c->set_timeout(timeout());

  // 2. The group's world ranks (for its error messages): an all-gather over the group itself.
  CudaDeviceScope scope(group->device);
  DISTCA_RETURN_IF_ERROR(scope.status());
  DeviceBuffer ranks;  // (size + 1) int32: the gathered ranks, then this rank's
  DISTCA_CUDA_RETURN_IF_ERROR(cudaMalloc(&ranks.ptr, static_cast<size_t>(group->size + 1) * sizeof(int32_t)));
  auto* all = static_cast<int32_t*>(ranks.ptr);
  const int32_t mine = group->world_rank;
  DISTCA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(all + group->size, &mine, sizeof mine, cudaMemcpyHostToDevice, group->stream));
  DISTCA_ASSIGN_OR_RETURN(auto work, post(group, timeout(), "split's all-gather", "the other ranks of the group",
                                          [all](State& s) -> Result<ncclResult_t> {
                                            return ncclAllGather(all + s.size, all, 1, ncclInt32, s.comm, s.stream);
                                          }));
  DISTCA_RETURN_IF_ERROR(work->wait());
  group->world_ranks.assign(static_cast<size_t>(group->size), 0);
  DISTCA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(group->world_ranks.data(), all, static_cast<size_t>(group->size) * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, group->stream));
  DISTCA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(group->stream));
  return std::unique_ptr<Communicator>(std::move(c));
}

void NcclComm::abort(const std::string& reason) {
  fmt::print(stderr, "{}\n", reason);
  std::fflush(stderr);
  std::lock_guard lock(state_->mu);
  state_->abort_locked(reason);
}

}  // namespace distca::comm
