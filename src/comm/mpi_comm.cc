#include "distca/comm/mpi_comm.h"

#include <fmt/format.h>
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <mutex>
#include <thread>
#include <vector>

namespace distca::comm {
namespace {

Status mpi_status(int code, const char* what) {
  if (code == MPI_SUCCESS) return Status::ok();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return internal_error(fmt::format("{}: {}", what, std::string(text, len)));
}
#define DISTCA_MPI_CHECK(call) DISTCA_RETURN_IF_ERROR(mpi_status((call), #call))

// Bytes per MPI message: a larger transfer goes as several, in order (MPI does not overtake on
// one communicator and tag). At most Open MPI's TCP eager limit that tcp_eager_defaults sets, so
// that every piece goes into the socket buffers in the call that posts it (a 6 MB dispatch as one
// message took the rendezvous path and moved only inside MPI calls).
constexpr int64_t kMaxMessage = int64_t{4} << 20;

// MPI is initialized MPI_THREAD_SERIALIZED: one thread in MPI at a time. Every MPI call of this
// file holds this lock, so that a progress thread (Communicator::progress) may run beside the
// thread that posts and waits.
std::mutex& mpi_mutex() {
  static std::mutex mu;
  return mu;
}

class MpiWork final : public Work {
 public:
  MpiWork(const char* what, uint64_t seq, int rank, std::chrono::milliseconds timeout)
      : what_(what), seq_(seq), rank_(rank), timeout_(timeout) {}

  // expect_bytes >= 0: a receive that must bring exactly that many bytes.
  void add(MPI_Request request, int peer, int expect_bytes = -1) {
    requests_.push_back(request);
    peers_.push_back(peer);
    expect_.push_back(expect_bytes);
  }
  // Point to point: how the two ends are named in errors.
  void set_names(std::string self, std::string peer) {
    self_ = std::move(self);
    peer_ = std::move(peer);
  }

  Result<bool> test() override {
    if (is_done_) return true;
    std::lock_guard lock(mpi_mutex());
    int flag = 0;
    std::vector<MPI_Status> statuses(requests_.size());
    const int code = MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, statuses.data());
    if (code != MPI_SUCCESS && !peer_.empty()) {
      return internal_error(fmt::format("{} #{} on {} from {}: {} (a send of another size?)", what_, seq_, self_, peer_,
                                        mpi_status(code, "MPI_Testall").message()));
    }
    DISTCA_MPI_CHECK(code);
    if (flag) {
      for (size_t i = 0; i < expect_.size(); ++i) {
        int count = 0;
        if (expect_[i] >= 0 && MPI_Get_count(&statuses[i], MPI_BYTE, &count) == MPI_SUCCESS && count != expect_[i]) {
          return internal_error(fmt::format("{} of {} bytes on {}: {} sent {} bytes", what_, expect_[i], self_, peer_, count));
        }
      }
    }
    is_done_ = flag != 0;
    return is_done_;
  }

  Status wait() override {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (int spin = 0;; ++spin) {
      DISTCA_ASSIGN_OR_RETURN(bool done, test());
      if (done) return Status::ok();
      if (std::chrono::steady_clock::now() > deadline) break;
      if (spin > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    std::vector<int> late;
    std::lock_guard lock(mpi_mutex());
    for (std::size_t i = 0; i < requests_.size(); ++i) {
      int flag = 0;
      if (requests_[i] != MPI_REQUEST_NULL) MPI_Test(&requests_[i], &flag, MPI_STATUS_IGNORE);
      if (requests_[i] != MPI_REQUEST_NULL && !flag && (late.empty() || late.back() != peers_[i])) late.push_back(peers_[i]);
    }
    if (!peer_.empty()) {
      return internal_error(fmt::format("{} #{} on {}: timed out after {} ms waiting for {}", what_, seq_, self_, timeout_.count(), peer_));
    }
    const std::string who = late.empty() || late[0] < 0 ? std::string("the other ranks") : fmt::format("rank {}", fmt::join(late, ", rank "));
    return internal_error(fmt::format("{} #{} on rank {}: timed out after {} ms waiting for {}", what_, seq_, rank_, timeout_.count(), who));
  }

 private:
  const char* what_;
  uint64_t seq_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::vector<MPI_Request> requests_;
  std::vector<int> peers_;  // -1 for collectives
  std::vector<int> expect_;  // bytes a receive must bring, -1: any
  std::string self_, peer_;  // point to point
  bool is_done_ = false;
};

// Open MPI over TCP moves a message past its 64 KB eager limit only inside MPI calls (a
// rendezvous, then fragments as the socket drains), so nothing of a ping-pong exchange moves
// while the rank computes. Messages up to 4 MB sent eagerly into 4 MB socket buffers go to the
// kernel in the posting call, which sends them on its own (ping-pong over a shaped link: see
// docs/multihost.md). Defaults only: an OMPI_MCA_* of the user's (or mpirun --mca) wins.
void tcp_eager_defaults() {
  // The limits count the message's header too: a message of kMaxMessage bytes must fit.
  const std::string limit = std::to_string(kMaxMessage + 65536), buffer = std::to_string(kMaxMessage);
  for (const char* name : {"OMPI_MCA_btl_tcp_eager_limit", "OMPI_MCA_btl_tcp_rndv_eager_limit", "OMPI_MCA_btl_tcp_max_send_size"}) {
    setenv(name, limit.c_str(), /*overwrite=*/0);
  }
  for (const char* name : {"OMPI_MCA_btl_tcp_sndbuf", "OMPI_MCA_btl_tcp_rcvbuf"}) setenv(name, buffer.c_str(), /*overwrite=*/0);
}

}  // namespace

Result<std::unique_ptr<MpiComm>> MpiComm::create(int* argc, char*** argv) {
  int is_initialized = 0;
  DISTCA_MPI_CHECK(MPI_Initialized(&is_initialized));
  if (!is_initialized) {
    tcp_eager_defaults();
    int provided = 0;
    DISTCA_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided));
  }
  DISTCA_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  int rank = 0, size = 0;
  DISTCA_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  DISTCA_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  auto c = std::unique_ptr<MpiComm>(new MpiComm(rank, size, !is_initialized));
  c->world_rank_ = rank;
  for (int r = 0; r < size; ++r) c->world_ranks_.push_back(r);
  c->comm_ = new MPI_Comm(MPI_COMM_WORLD);
  auto* p2p = new MPI_Comm(MPI_COMM_NULL);
  c->p2p_comm_ = p2p;
  DISTCA_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, p2p));
  auto* outcome = new MPI_Comm(MPI_COMM_NULL);
  c->outcome_comm_ = outcome;
  DISTCA_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, outcome));
  return c;
}

MpiComm::~MpiComm() {
  std::lock_guard lock(mpi_mutex());
  for (void* p : {comm_, p2p_comm_, outcome_comm_}) {
    auto* c = static_cast<MPI_Comm*>(p);
    if (c != nullptr && *c != MPI_COMM_NULL && *c != MPI_COMM_WORLD) MPI_Comm_free(c);
    delete c;
  }
  if (is_owner_) MPI_Finalize();
}

std::string MpiComm::who(int rank) const {
  return label_.empty() ? fmt::format("rank {}", rank) : fmt::format("rank {} of {} (world rank {})", rank, label_, world_ranks_[rank]);
}

Result<std::unique_ptr<Communicator>> MpiComm::split(int color, int key, const std::string& label) {
  std::lock_guard lock(mpi_mutex());
  if (color < 0) return invalid_argument(fmt::format("split: color {} (must be >= 0)", color));
  if (label.empty()) return invalid_argument("split: a group needs a label");
  MPI_Comm parent = *static_cast<MPI_Comm*>(comm_);
  auto* group = new MPI_Comm(MPI_COMM_NULL);
  auto c = std::unique_ptr<MpiComm>(new MpiComm(0, 0, false));
  c->comm_ = group;  // freed by c from here on
  DISTCA_MPI_CHECK(MPI_Comm_split(parent, color, key, group));
  DISTCA_MPI_CHECK(MPI_Comm_set_errhandler(*group, MPI_ERRORS_RETURN));
  DISTCA_MPI_CHECK(MPI_Comm_rank(*group, &c->rank_));
  DISTCA_MPI_CHECK(MPI_Comm_size(*group, &c->size_));
  c->world_rank_ = world_rank_;
  c->label_ = label;
  c->world_ranks_.assign(c->size_, 0);
  DISTCA_MPI_CHECK(MPI_Allgather(&c->world_rank_, 1, MPI_INT, c->world_ranks_.data(), 1, MPI_INT, *group));
  auto* p2p = new MPI_Comm(MPI_COMM_NULL);
  c->p2p_comm_ = p2p;
  DISTCA_MPI_CHECK(MPI_Comm_dup(*group, p2p));
  c->set_timeout(timeout());
  return std::unique_ptr<Communicator>(std::move(c));
}

Result<std::unique_ptr<Work>> MpiComm::send_async(const void* data, int64_t bytes, int peer, int tag) {
  std::lock_guard lock(mpi_mutex());
  DISTCA_RETURN_IF_ERROR(check_p2p("send", data, bytes, peer, tag));
  auto work = std::make_unique<MpiWork>("send", next_p2p_seq_++, rank_, timeout());
  work->set_names(who(rank_), who(peer));
  // Chunks of one message keep their order (MPI does not overtake on one communicator and tag).
  for (int64_t off = 0; off == 0 || off < bytes; off += kMaxMessage) {
    MPI_Request r;
    const int n = static_cast<int>(std::min(kMaxMessage, bytes - off));
    DISTCA_MPI_CHECK(MPI_Isend(static_cast<const std::byte*>(data) + off, n, MPI_BYTE, peer, tag,
                               *static_cast<MPI_Comm*>(p2p_comm_), &r));
    work->add(r, peer);
  }
  return std::unique_ptr<Work>(std::move(work));
}

Result<std::unique_ptr<Work>> MpiComm::recv_async(void* data, int64_t bytes, int peer, int tag) {
  std::lock_guard lock(mpi_mutex());
  DISTCA_RETURN_IF_ERROR(check_p2p("recv", data, bytes, peer, tag));
  auto work = std::make_unique<MpiWork>("recv", next_p2p_seq_++, rank_, timeout());
  work->set_names(who(rank_), who(peer));
  for (int64_t off = 0; off == 0 || off < bytes; off += kMaxMessage) {
    MPI_Request r;
    const int n = static_cast<int>(std::min(kMaxMessage, bytes - off));
    DISTCA_MPI_CHECK(MPI_Irecv(static_cast<std::byte*>(data) + off, n, MPI_BYTE, peer, tag,
                               *static_cast<MPI_Comm*>(p2p_comm_), &r));
    work->add(r, peer, n);
  }
  return std::unique_ptr<Work>(std::move(work));
}

Result<MpiComm::Outcome> MpiComm::agree_on_outcome(int code, std::chrono::milliseconds timeout) {
  // One integer per rank: rank * 256 + code for a failure, INT_MAX when done; the minimum names
  // the lowest failing rank and its code.
  static_assert(INT_MAX / 256 > (1 << 20), "room for a million ranks");
  int value = code == 0 ? INT_MAX : rank_ * 256 + (code & 0xff);
  MPI_Request request;
  {
    std::lock_guard lock(mpi_mutex());
    DISTCA_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, &value, 1, MPI_INT, MPI_MIN, *static_cast<MPI_Comm*>(outcome_comm_), &request));
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int flag = 0;
    {
      std::lock_guard lock(mpi_mutex());
      DISTCA_MPI_CHECK(MPI_Test(&request, &flag, MPI_STATUS_IGNORE));
    }
    if (flag) break;
    if (std::chrono::steady_clock::now() > deadline) {
      return internal_error(fmt::format("rank {}: not every rank reached the end of the job within {} ms", rank_,
                                        timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (value == INT_MAX) return Outcome{};
  return Outcome{value / 256, value % 256};
}

Result<std::unique_ptr<Work>> MpiComm::all_to_all_v_async(const AllToAllV& a) {
  std::lock_guard lock(mpi_mutex());
  DISTCA_RETURN_IF_ERROR(check(a));
  if (a.send_counts[rank_] != a.recv_counts[rank_]) {
    return invalid_argument(fmt::format("all_to_all_v: rank {} sends itself {} bytes but expects {}", rank_,
                                        a.send_counts[rank_], a.recv_counts[rank_]));
  }
  const uint64_t seq = next_seq_++;
  const int tag = static_cast<int>(seq % 30000);
  auto work = std::make_unique<MpiWork>("all_to_all_v", seq, rank_, timeout());
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    for (int64_t off = 0; off < a.recv_counts[p]; off += kMaxMessage) {
      MPI_Request r;
      const int n = static_cast<int>(std::min(kMaxMessage, a.recv_counts[p] - off));
      DISTCA_MPI_CHECK(MPI_Irecv(a.recv + a.recv_offsets[p] + off, n, MPI_BYTE, p, tag, *static_cast<MPI_Comm*>(comm_), &r));
      work->add(r, p);
    }
  }
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    for (int64_t off = 0; off < a.send_counts[p]; off += kMaxMessage) {
      MPI_Request r;
      const int n = static_cast<int>(std::min(kMaxMessage, a.send_counts[p] - off));
      DISTCA_MPI_CHECK(MPI_Isend(a.send + a.send_offsets[p] + off, n, MPI_BYTE, p, tag, *static_cast<MPI_Comm*>(comm_), &r));
      work->add(r, p);
    }
  }
  if (a.recv_counts[rank_] > 0) {
    std::memcpy(a.recv + a.recv_offsets[rank_], a.send + a.send_offsets[rank_], static_cast<std::size_t>(a.recv_counts[rank_]));
  }
  return std::unique_ptr<Work>(std::move(work));
}

Result<std::unique_ptr<Work>> MpiComm::all_reduce_sum_async(float* data, int64_t count) {
  std::lock_guard lock(mpi_mutex());
  if (count < 0 || count > INT_MAX || (count > 0 && data == nullptr)) {
    return invalid_argument(fmt::format("all_reduce_sum: {} floats (at most {} per call)", count, INT_MAX));
  }
  auto work = std::make_unique<MpiWork>("all_reduce_sum", next_seq_++, rank_, timeout());
  MPI_Request r;
  DISTCA_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_FLOAT, MPI_SUM, *static_cast<MPI_Comm*>(comm_), &r));
  work->add(r, -1);
  return std::unique_ptr<Work>(std::move(work));
}

Result<std::unique_ptr<Work>> MpiComm::broadcast_async(void* data, int64_t bytes, int root) {
  std::lock_guard lock(mpi_mutex());
  if (root < 0 || root >= size_) return invalid_argument(fmt::format("broadcast: root {} is not a rank", root));
  if (bytes < 0 || bytes > INT_MAX || (bytes > 0 && data == nullptr)) return invalid_argument("broadcast: bad buffer");
  auto work = std::make_unique<MpiWork>("broadcast", next_seq_++, rank_, timeout());
  MPI_Request r;
  DISTCA_MPI_CHECK(MPI_Ibcast(data, static_cast<int>(bytes), MPI_BYTE, root, *static_cast<MPI_Comm*>(comm_), &r));
  work->add(r, rank_ == root ? -1 : root);
  return std::unique_ptr<Work>(std::move(work));
}

Result<std::unique_ptr<Work>> MpiComm::barrier_async() {
  std::lock_guard lock(mpi_mutex());
  auto work = std::make_unique<MpiWork>("barrier", next_seq_++, rank_, timeout());
  MPI_Request r;
  DISTCA_MPI_CHECK(MPI_Ibarrier(*static_cast<MPI_Comm*>(comm_), &r));
  work->add(r, -1);
  return std::unique_ptr<Work>(std::move(work));
}

Status MpiComm::progress() {
  // Any MPI call runs Open MPI's progress engine over every pending request; a probe is the
  // cheapest that touches nothing.
  std::lock_guard lock(mpi_mutex());
  int flag = 0;
  DISTCA_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, *static_cast<MPI_Comm*>(comm_), &flag, MPI_STATUS_IGNORE));
  return Status::ok();
}

void MpiComm::abort(const std::string& reason) { abort_with(1, reason); }

void MpiComm::abort_with(int code, const std::string& reason) {
  fmt::print(stderr, "{}\n", reason);
  std::fflush(stderr);
  // MPI_Abort asks mpirun, through this host's daemon, to end the job; where they cannot reach
  // each other it may never return. Then this process ends on its own, non-zero, which its
  // daemon sees (and mpirun, where it can).
  std::thread([code] {
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::_Exit(code);
  }).detach();
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; if it ever did, the job still ends
}

}  // namespace distca::comm
