#include "distca/comm/mpi_comm.h"

#include <fmt/format.h>
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
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

constexpr int64_t kMaxMessage = int64_t{1} << 30;  // bytes per MPI message (counts are int)

class MpiWork final : public Work {
 public:
  MpiWork(const char* what, uint64_t seq, int rank, std::chrono::milliseconds timeout)
      : what_(what), seq_(seq), rank_(rank), timeout_(timeout) {}

  void add(MPI_Request request, int peer) {
    requests_.push_back(request);
    peers_.push_back(peer);
  }

  Result<bool> test() override {
    if (is_done_) return true;
    int flag = 0;
    DISTCA_MPI_CHECK(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, MPI_STATUSES_IGNORE));
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
    for (std::size_t i = 0; i < requests_.size(); ++i) {
      int flag = 0;
      if (requests_[i] != MPI_REQUEST_NULL) MPI_Test(&requests_[i], &flag, MPI_STATUS_IGNORE);
      if (requests_[i] != MPI_REQUEST_NULL && !flag && (late.empty() || late.back() != peers_[i])) late.push_back(peers_[i]);
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
  bool is_done_ = false;
};

}  // namespace

Result<std::unique_ptr<MpiComm>> MpiComm::create(int* argc, char*** argv) {
  int is_initialized = 0;
  DISTCA_MPI_CHECK(MPI_Initialized(&is_initialized));
  if (!is_initialized) {
    int provided = 0;
    DISTCA_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided));
  }
  DISTCA_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  int rank = 0, size = 0;
  DISTCA_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  DISTCA_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  auto c = std::unique_ptr<MpiComm>(new MpiComm(rank, size, !is_initialized));
  auto* outcome = new MPI_Comm(MPI_COMM_NULL);
  c->outcome_comm_ = outcome;
  DISTCA_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, outcome));
  return c;
}

MpiComm::~MpiComm() {
  auto* outcome = static_cast<MPI_Comm*>(outcome_comm_);
  if (outcome != nullptr && *outcome != MPI_COMM_NULL) MPI_Comm_free(outcome);
  delete outcome;
  if (is_owner_) MPI_Finalize();
}

Result<MpiComm::Outcome> MpiComm::agree_on_outcome(int code, std::chrono::milliseconds timeout) {
  // One integer per rank: rank * 256 + code for a failure, INT_MAX when done; the minimum names
  // the lowest failing rank and its code.
  static_assert(INT_MAX / 256 > (1 << 20), "room for a million ranks");
  int value = code == 0 ? INT_MAX : rank_ * 256 + (code & 0xff);
  MPI_Request request;
  DISTCA_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, &value, 1, MPI_INT, MPI_MIN, *static_cast<MPI_Comm*>(outcome_comm_), &request));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int flag = 0;
    DISTCA_MPI_CHECK(MPI_Test(&request, &flag, MPI_STATUS_IGNORE));
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
      DISTCA_MPI_CHECK(MPI_Irecv(a.recv + a.recv_offsets[p] + off, n, MPI_BYTE, p, tag, MPI_COMM_WORLD, &r));
      work->add(r, p);
    }
  }
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    for (int64_t off = 0; off < a.send_counts[p]; off += kMaxMessage) {
      MPI_Request r;
      const int n = static_cast<int>(std::min(kMaxMessage, a.send_counts[p] - off));
      DISTCA_MPI_CHECK(MPI_Isend(a.send + a.send_offsets[p] + off, n, MPI_BYTE, p, tag, MPI_COMM_WORLD, &r));
      work->add(r, p);
    }
  }
  if (a.recv_counts[rank_] > 0) {
    std::memcpy(a.recv + a.recv_offsets[rank_], a.send + a.send_offsets[rank_], static_cast<std::size_t>(a.recv_counts[rank_]));
  }
  return std::unique_ptr<Work>(std::move(work));
}

Result<std::unique_ptr<Work>> MpiComm::all_reduce_sum_async(float* data, int64_t count) {
  if (count < 0 || count > INT_MAX || (count > 0 && data == nullptr)) {
    return invalid_argument(fmt::format("all_reduce_sum: {} floats (at most {} per call)", count, INT_MAX));
  }
  auto work = std::make_unique<MpiWork>("all_reduce_sum", next_seq_++, rank_, timeout());
  MPI_Request r;
  DISTCA_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &r));
  work->add(r, -1);
  return std::unique_ptr<Work>(std::move(work));
}

Result<std::unique_ptr<Work>> MpiComm::broadcast_async(void* data, int64_t bytes, int root) {
  if (root < 0 || root >= size_) return invalid_argument(fmt::format("broadcast: root {} is not a rank", root));
  if (bytes < 0 || bytes > INT_MAX || (bytes > 0 && data == nullptr)) return invalid_argument("broadcast: bad buffer");
  auto work = std::make_unique<MpiWork>("broadcast", next_seq_++, rank_, timeout());
  MPI_Request r;
  DISTCA_MPI_CHECK(MPI_Ibcast(data, static_cast<int>(bytes), MPI_BYTE, root, MPI_COMM_WORLD, &r));
  work->add(r, rank_ == root ? -1 : root);
  return std::unique_ptr<Work>(std::move(work));
}

Result<std::unique_ptr<Work>> MpiComm::barrier_async() {
  auto work = std::make_unique<MpiWork>("barrier", next_seq_++, rank_, timeout());
  MPI_Request r;
  DISTCA_MPI_CHECK(MPI_Ibarrier(MPI_COMM_WORLD, &r));
  work->add(r, -1);
  return std::unique_ptr<Work>(std::move(work));
}

void MpiComm::abort(const std::string& reason) { abort_with(1, reason); }

void MpiComm::abort_with(int code, const std::string& reason) {
  fmt::print(stderr, "{}\n", reason);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; if it ever did, the job still ends
}

}  // namespace distca::comm
