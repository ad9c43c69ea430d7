#include "distca/comm/local_comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

namespace distca::comm {

namespace {
enum class Kind { kAllToAllV, kAllReduce, kBroadcast, kBarrier };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllToAllV: return "all_to_all_v";
    case Kind::kAllReduce: return "all_reduce_sum";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kBarrier: return "barrier";
  }
  return "?";
}
}  // namespace

// One collective in flight, shared by the ranks taking part.
struct Slot {
  Kind kind;
  int first_rank;  // who posted first (for mismatch messages)
  std::vector<bool> posted;
  int num_posted = 0;
  int num_done = 0;
  // (R) each rank's send side, copied at post: a peer that sends nothing to a rank may finish
  // (and free its argument arrays) before that rank looks.
  std::vector<const std::byte*> send;
  std::vector<std::vector<int64_t>> send_counts, send_offsets;
  std::vector<int> readers_left;    // (R) peers still to copy from this rank's send buffer
  std::vector<float*> data;         // (R) all-reduce buffers / broadcast pointers (as bytes)
  int64_t count = 0;                // all-reduce elements / broadcast bytes
  int root = 0;
  bool is_summing = false;
  bool is_sum_ready = false;
  std::vector<float> sum;
};

struct LocalWorld::Shared {
  explicit Shared(int r) : num_ranks(r) {}
  const int num_ranks;
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Slot> slots;
  bool has_failed = false;
  int failed_rank = -1;
  std::string reason;

  Status failure() const { return internal_error(fmt::format("rank {} failed: {}", failed_rank, reason)); }
};

namespace {

class LocalWork final : public Work {
 public:
  LocalWork(std::shared_ptr<LocalWorld::Shared> shared, uint64_t seq, int rank, Kind kind,
            std::chrono::milliseconds timeout, std::optional<AllToAllV> args)
      : shared_(std::move(shared)), seq_(seq), rank_(rank), kind_(kind), timeout_(timeout),
        copied_(shared_->num_ranks, false), args_(std::move(args)) {}

  Result<bool> test() override {
    std::unique_lock lock(shared_->mu);
    return advance(lock);
  }

  Status wait() override {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    std::unique_lock lock(shared_->mu);
    for (;;) {
      Result<bool> done = advance(lock);
      if (!done.is_ok()) return done.status();
      if (done.value()) return Status::ok();
      if (shared_->cv.wait_until(lock, deadline) == std::cv_status::timeout) {
        Result<bool> last = advance(lock);
        if (!last.is_ok()) return last.status();
        if (last.value()) return Status::ok();
        return internal_error(fmt::format("{} #{} on rank {}: timed out after {} ms waiting for {}",
                                          kind_name(kind_), seq_, rank_, timeout_.count(), waiting_for()));
      }
    }
  }

 private:
  Slot& slot() { return shared_->slots.at(seq_); }

  std::string waiting_for() {
    Slot& s = slot();
    std::vector<int> peers;
    for (int p = 0; p < shared_->num_ranks; ++p) {
      if (!s.posted[p]) peers.push_back(p);
    }
    if (peers.empty() && kind_ == Kind::kAllToAllV) {
      return fmt::format("{} peer(s) to read this rank's data", s.readers_left[rank_]);
    }
    return fmt::format("rank {}", fmt::join(peers, ", rank "));
  }

  void finish(Slot& s) {
    is_done_ = true;
    if (++s.num_done == shared_->num_ranks) shared_->slots.erase(seq_);
    shared_->cv.notify_all();
  }

  // REQUIRES: lock held. Copies happen under the lock too: one copier at a time per world keeps
  // the bookkeeping obviously right (an earlier version copied unlocked and lost a race that
  // ThreadSanitizer found); tests move kilobytes, and benchmarks model links with a delay.
  Result<bool> advance(std::unique_lock<std::mutex>& lock) {
    if (is_done_) return true;
    if (shared_->has_failed) {
      // An all-reduce whose sum is already made (it lives in the slot) completes: the peer
      // failed after it, and every rank must see the same result of the same operation.
      auto it = shared_->slots.find(seq_);
      if (kind_ != Kind::kAllReduce || it == shared_->slots.end() || !it->second.is_sum_ready) return shared_->failure();
    }
    Slot& s = slot();
    const int R = shared_->num_ranks;
    switch (kind_) {
      case Kind::kBarrier:
        if (s.num_posted == R) finish(s);
        break;
      case Kind::kAllToAllV: {
        const AllToAllV& mine = *args_;
        std::vector<int> ready;
        for (int p = 0; p < R; ++p) {
          if (!copied_[p] && s.posted[p]) ready.push_back(p);
        }
        for (int p : ready) {
          if (s.send_counts[p][rank_] != mine.recv_counts[p]) {
            return internal_error(fmt::format("all_to_all_v #{}: rank {} sends {} bytes to rank {}, which expects {}",
                                              seq_, p, s.send_counts[p][rank_], rank_, mine.recv_counts[p]));
          }
        }
        for (int p : ready) {
          if (mine.recv_counts[p] > 0) {
            std::memcpy(mine.recv + mine.recv_offsets[p], s.send[p] + s.send_offsets[p][rank_],
                        static_cast<std::size_t>(mine.recv_counts[p]));
          }
        }
        for (int p : ready) {
          copied_[p] = true;
          if (s.send_counts[p][rank_] > 0) --s.readers_left[p];
        }
        if (!ready.empty()) shared_->cv.notify_all();
        if (std::all_of(copied_.begin(), copied_.end(), [](bool b) { return b; }) && s.readers_left[rank_] == 0) finish(s);
        break;
      }
      case Kind::kAllReduce: {
        if (s.num_posted < R) break;
        if (!s.is_summing) {
          // The first rank to see every input sums them, in rank order, for everyone.
          s.is_summing = true;
          lock.unlock();
          std::vector<float> sum(s.data[0], s.data[0] + s.count);
          for (int p = 1; p < R; ++p)
            for (int64_t i = 0; i < s.count; ++i) sum[i] += s.data[p][i];
          lock.lock();
          s.sum = std::move(sum);
          s.is_sum_ready = true;
          shared_->cv.notify_all();
        }
        if (!s.is_sum_ready) break;
        std::copy(s.sum.begin(), s.sum.end(), s.data[rank_]);
        finish(s);
        break;
      }
      case Kind::kBroadcast: {
        if (rank_ == s.root) {
          if (s.readers_left[rank_] == 0) finish(s);
          break;
        }
        if (!s.posted[s.root]) break;
        std::memcpy(s.data[rank_], s.data[s.root], static_cast<std::size_t>(s.count));
        --s.readers_left[s.root];
        finish(s);
        break;
      }
    }
    return is_done_;
  }

  std::shared_ptr<LocalWorld::Shared> shared_;
  uint64_t seq_;
  int rank_;
  Kind kind_;
  std::chrono::milliseconds timeout_;
  std::vector<bool> copied_;
  std::optional<AllToAllV> args_;  // this rank's all-to-all-v (the caller keeps its arrays alive)
  bool is_done_ = false;
};

}  // namespace

class LocalWorld::Comm final : public Communicator {
 public:
  Comm(std::shared_ptr<Shared> shared, int rank) : shared_(std::move(shared)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return shared_->num_ranks; }
  std::string name() const override { return "local"; }

  Result<std::unique_ptr<Work>> all_to_all_v_async(const AllToAllV& a) override {
    DISTCA_RETURN_IF_ERROR(check(a));
    return post(Kind::kAllToAllV, a, [&](Slot& s) {
      s.send[rank_] = a.send;
      s.send_counts[rank_].assign(a.send_counts.begin(), a.send_counts.end());
      s.send_offsets[rank_].assign(a.send_offsets.begin(), a.send_offsets.end());
      s.readers_left[rank_] = static_cast<int>(std::count_if(a.send_counts.begin(), a.send_counts.end(), [](int64_t c) { return c > 0; }));
      return Status::ok();
    });
  }

  Result<std::unique_ptr<Work>> all_reduce_sum_async(float* data, int64_t count) override {
    if (count < 0 || (count > 0 && data == nullptr)) return invalid_argument("all_reduce_sum: bad buffer");
    return post(Kind::kAllReduce, std::nullopt, [&](Slot& s) {
      if (s.num_posted > 0 && s.count != count) {
        return internal_error(fmt::format("all_reduce_sum: rank {} reduces {} floats, rank {} reduces {}", rank_, count, s.first_rank, s.count));
      }
      s.count = count;
      s.data[rank_] = data;
      return Status::ok();
    });
  }

  Result<std::unique_ptr<Work>> broadcast_async(void* data, int64_t bytes, int root) override {
    if (root < 0 || root >= size()) return invalid_argument(fmt::format("broadcast: root {} is not a rank", root));
    if (bytes < 0 || (bytes > 0 && data == nullptr)) return invalid_argument("broadcast: bad buffer");
    return post(Kind::kBroadcast, std::nullopt, [&](Slot& s) {
      if (s.num_posted > 0 && (s.count != bytes || s.root != root)) {
        return internal_error(fmt::format("broadcast: ranks {} and {} disagree on size or root", rank_, s.first_rank));
      }
      s.count = bytes;
      s.root = root;
      s.data[rank_] = static_cast<float*>(data);
      if (rank_ == root) s.readers_left[rank_] = size() - 1;
      return Status::ok();
    });
  }

  Result<std::unique_ptr<Work>> barrier_async() override {
    return post(Kind::kBarrier, std::nullopt, [](Slot&) { return Status::ok(); });
  }

  void abort(const std::string& reason) override {
    std::lock_guard lock(shared_->mu);
    if (!shared_->has_failed) {
      shared_->has_failed = true;
      shared_->failed_rank = rank_;
      shared_->reason = reason;
    }
    shared_->cv.notify_all();
  }

 private:
  template <typename Fill>
  Result<std::unique_ptr<Work>> post(Kind kind, std::optional<AllToAllV> args, Fill&& fill) {
    const uint64_t seq = next_seq_++;
    {
      std::lock_guard lock(shared_->mu);
      if (shared_->has_failed) return shared_->failure();
      const int R = shared_->num_ranks;
      auto [it, is_new] = shared_->slots.try_emplace(seq);
      Slot& s = it->second;
      if (is_new) {
        s.kind = kind;
        s.first_rank = rank_;
        s.posted.assign(R, false);
        s.send.assign(R, nullptr);
        s.send_counts.resize(R);
        s.send_offsets.resize(R);
        s.readers_left.assign(R, 0);
        s.data.assign(R, nullptr);
      } else if (s.kind != kind) {
        return internal_error(fmt::format("operation #{}: rank {} called {} but rank {} called {}", seq, rank_,
                                          kind_name(kind), s.first_rank, kind_name(s.kind)));
      }
      DISTCA_RETURN_IF_ERROR(fill(s));
      s.posted[rank_] = true;
      ++s.num_posted;
      shared_->cv.notify_all();
    }
    return std::unique_ptr<Work>(std::make_unique<LocalWork>(shared_, seq, rank_, kind, timeout(), args));
  }

  std::shared_ptr<Shared> shared_;
  int rank_;
  uint64_t next_seq_ = 0;
};

LocalWorld::LocalWorld(int num_ranks) : shared_(std::make_shared<Shared>(num_ranks)) {
  DISTCA_CHECK(num_ranks >= 1) << "a LocalWorld needs at least one rank";
  for (int r = 0; r < num_ranks; ++r) comms_.push_back(std::make_unique<Comm>(shared_, r));
}
LocalWorld::~LocalWorld() = default;

int LocalWorld::size() const { return shared_->num_ranks; }
Communicator& LocalWorld::comm(int rank) { return *comms_.at(rank); }

std::vector<Status> LocalWorld::run(int num_ranks, const std::function<Status(Communicator&)>& body,
                                    std::chrono::milliseconds timeout) {
  LocalWorld world(num_ranks);
  std::vector<Status> statuses(num_ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < num_ranks; ++r) {
    threads.emplace_back([&, r] {
      Communicator& c = world.comm(r);
      c.set_timeout(timeout);
      try {
        statuses[r] = body(c);
      } catch (const std::exception& e) {
        statuses[r] = internal_error(fmt::format("exception: {}", e.what()));
      }
      if (!statuses[r].is_ok()) c.abort(statuses[r].message());
    });
  }
  for (auto& t : threads) t.join();
  return statuses;
}

}  // namespace distca::comm
