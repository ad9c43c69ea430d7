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
#include <tuple>

namespace distca::comm {

namespace {
enum class Kind { kAllToAllV, kAllReduce, kBroadcast, kBarrier, kSplit };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllToAllV: return "all_to_all_v";
    case Kind::kAllReduce: return "all_reduce_sum";
    case Kind::kBroadcast: return "broadcast";
    case Kind::kBarrier: return "barrier";
    case Kind::kSplit: return "split";
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
  std::vector<int> color, key;  // (R) split
  std::string label;            // split
  std::map<int, std::shared_ptr<LocalWorld::Shared>> groups;  // split: by color, made by the first to finish
};

// What every group of one world shares: one lock, one wake-up, one failure.
struct Core {
  std::mutex mu;
  std::condition_variable cv;
  bool has_failed = false;
  int failed_rank = -1;  // in the world
  std::string reason;

  Status failure() const { return internal_error(fmt::format("rank {} failed: {}", failed_rank, reason)); }
};

// A point-to-point message, from its post until a receive copies it.
struct Message {
  const std::byte* data = nullptr;
  int64_t bytes = 0;
  bool is_consumed = false;
  std::string error;  // set by a receive of another size
};

// One group (the world, or a split of it).
struct LocalWorld::Shared {
  Shared(std::shared_ptr<Core> c, std::vector<int> world, std::string name)
      : core(std::move(c)), num_ranks(static_cast<int>(world.size())), world_ranks(std::move(world)), label(std::move(name)) {}
  std::shared_ptr<Core> core;
  const int num_ranks;
  const std::vector<int> world_ranks;  // (num_ranks) each rank's rank in the world
  const std::string label;             // "" for the world
  std::map<uint64_t, Slot> slots;
  // Point to point, by (sender, receiver, tag): messages by their index in posting order, and
  // how many sends and receives were posted.
  using Key = std::tuple<int, int, int>;
  std::map<Key, std::map<uint64_t, std::shared_ptr<Message>>> mailbox;
  std::map<Key, uint64_t> sends_posted, recvs_posted;

  // "rank 2" in the world; "rank 1 of dp (world rank 3)" in a group.
  std::string who(int rank) const {
    return label.empty() ? fmt::format("rank {}", rank) : fmt::format("rank {} of {} (world rank {})", rank, label, world_ranks[rank]);
  }
};

namespace {

class LocalWork final : public Work {
 public:
  LocalWork(std::shared_ptr<LocalWorld::Shared> shared, uint64_t seq, int rank, Kind kind,
            std::chrono::milliseconds timeout, std::optional<AllToAllV> args)
      : shared_(std::move(shared)), seq_(seq), rank_(rank), kind_(kind), timeout_(timeout),
        copied_(shared_->num_ranks, false), args_(std::move(args)) {}

  Result<bool> test() override {
    std::unique_lock lock(shared_->core->mu);
    return advance(lock);
  }

  Status wait() override {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    std::unique_lock lock(shared_->core->mu);
    for (;;) {
      Result<bool> done = advance(lock);
      if (!done.is_ok()) return done.status();
      if (done.value()) return Status::ok();
      if (shared_->core->cv.wait_until(lock, deadline) == std::cv_status::timeout) {
        Result<bool> last = advance(lock);
        if (!last.is_ok()) return last.status();
        if (last.value()) return Status::ok();
        return internal_error(fmt::format("{} #{} on {}: timed out after {} ms waiting for {}",
                                          kind_name(kind_), seq_, shared_->who(rank_), timeout_.count(), waiting_for()));
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
    std::vector<std::string> names;
    for (int p : peers) names.push_back(shared_->who(p));
    return fmt::format("{}", fmt::join(names, ", "));
  }

  void finish(Slot& s) {
    is_done_ = true;
    if (++s.num_done == shared_->num_ranks) shared_->slots.erase(seq_);
    shared_->core->cv.notify_all();
  }

  // REQUIRES: lock held. Copies happen under the lock too: one copier at a time per world keeps
  // the bookkeeping obviously right (an earlier version copied unlocked and lost a race that
  // ThreadSanitizer found); tests move kilobytes, and benchmarks model links with a delay.
  Result<bool> advance(std::unique_lock<std::mutex>& lock) {
    if (is_done_) return true;
    if (shared_->core->has_failed) {
      // An all-reduce whose sum is already made (it lives in the slot) completes: the peer
      // failed after it, and every rank must see the same result of the same operation.
      auto it = shared_->slots.find(seq_);
      if (kind_ != Kind::kAllReduce || it == shared_->slots.end() || !it->second.is_sum_ready) return shared_->core->failure();
    }
    Slot& s = slot();
    const int R = shared_->num_ranks;
    switch (kind_) {
      case Kind::kBarrier:
        if (s.num_posted == R) finish(s);
        break;
      case Kind::kSplit:
        if (s.num_posted < R) break;
        if (s.groups.empty()) {
          // The first rank to see every color makes every group, members by (key, rank).
          std::map<int, std::vector<std::pair<int, int>>> members;
          for (int p = 0; p < R; ++p) members[s.color[p]].push_back({s.key[p], p});
          for (auto& [color, m] : members) {
            std::sort(m.begin(), m.end());
            std::vector<int> world;
            for (const auto& km : m) world.push_back(shared_->world_ranks[km.second]);
            s.groups[color] = std::make_shared<LocalWorld::Shared>(shared_->core, std::move(world), s.label);
          }
        }
        group_ = s.groups.at(s.color[rank_]);
        finish(s);
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
        if (!ready.empty()) shared_->core->cv.notify_all();
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
          shared_->core->cv.notify_all();
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

 public:
  std::shared_ptr<LocalWorld::Shared> group_;  // split: this rank's new group
};

// A point-to-point operation: advance() (under the lock) says whether it is done; wait() runs it
// to the end, the timeout, or a peer's failure.
class P2pWork : public Work {
 public:
  P2pWork(std::shared_ptr<LocalWorld::Shared> shared, int rank, int peer, int tag, std::chrono::milliseconds timeout)
      : shared_(std::move(shared)), rank_(rank), peer_(peer), tag_(tag), timeout_(timeout) {}

  Result<bool> test() override {
    std::unique_lock lock(shared_->core->mu);
    return advance();
  }
  Status wait() override {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    std::unique_lock lock(shared_->core->mu);
    for (;;) {
      DISTCA_ASSIGN_OR_RETURN(bool done, advance());
      if (done) return Status::ok();
      if (shared_->core->cv.wait_until(lock, deadline) == std::cv_status::timeout) {
        DISTCA_ASSIGN_OR_RETURN(bool last, advance());
        if (last) return Status::ok();
        return internal_error(timed_out());
      }
    }
  }

 protected:
  // REQUIRES: lock held.
  virtual Result<bool> advance() = 0;
  virtual std::string timed_out() const = 0;
  std::shared_ptr<LocalWorld::Shared> shared_;
  int rank_, peer_, tag_;
  std::chrono::milliseconds timeout_;
};

// A send: done once a receive has copied it.
class SendWork final : public P2pWork {
 public:
  SendWork(std::shared_ptr<LocalWorld::Shared> shared, std::shared_ptr<Message> m, int rank, int peer, int tag,
           std::chrono::milliseconds timeout)
      : P2pWork(std::move(shared), rank, peer, tag, timeout), m_(std::move(m)) {}

 private:
  Result<bool> advance() override {
    if (!m_->error.empty()) return internal_error(m_->error);
    if (m_->is_consumed) return true;
    if (shared_->core->has_failed) return shared_->core->failure();
    return false;
  }
  std::string timed_out() const override {
    return fmt::format("send of {} bytes (tag {}) from {} to {}: timed out after {} ms: {} never received it", m_->bytes,
                       tag_, shared_->who(rank_), shared_->who(peer_), timeout_.count(), shared_->who(peer_));
  }
  std::shared_ptr<Message> m_;
};

// A receive: copies the message of its index from (peer, rank, tag) once it is posted.
class RecvWork final : public P2pWork {
 public:
  RecvWork(std::shared_ptr<LocalWorld::Shared> shared, std::byte* data, int64_t bytes, int rank, int peer, int tag,
           uint64_t index, std::chrono::milliseconds timeout)
      : P2pWork(std::move(shared), rank, peer, tag, timeout), data_(data), bytes_(bytes), index_(index) {}

 private:
  Result<bool> advance() override {
    if (is_done_) return true;
    auto& box = shared_->mailbox[{peer_, rank_, tag_}];
    auto it = box.find(index_);
    if (it == box.end()) {
      if (shared_->core->has_failed) return shared_->core->failure();
      return false;
    }
    Message& m = *it->second;
    if (m.bytes != bytes_) {
      m.error = fmt::format("send of {} bytes (tag {}) from {} to {}, which receives {} bytes", m.bytes, tag_,
                            shared_->who(peer_), shared_->who(rank_), bytes_);
      box.erase(it);
      shared_->core->cv.notify_all();
      return internal_error(m.error);
    }
    if (bytes_ > 0) std::memcpy(data_, m.data, static_cast<std::size_t>(bytes_));
    m.is_consumed = true;
    box.erase(it);
    is_done_ = true;
    shared_->core->cv.notify_all();
    return true;
  }
  std::string timed_out() const override {
    return fmt::format("recv of {} bytes (tag {}) on {}: timed out after {} ms waiting for {}", bytes_, tag_,
                       shared_->who(rank_), timeout_.count(), shared_->who(peer_));
  }
  std::byte* data_;
  int64_t bytes_;
  uint64_t index_;
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

  Result<std::unique_ptr<Work>> send_async(const void* data, int64_t bytes, int peer, int tag) override {
    DISTCA_RETURN_IF_ERROR(check_p2p("send", data, bytes, peer, tag));
    auto m = std::make_shared<Message>();
    m->data = static_cast<const std::byte*>(data);
    m->bytes = bytes;
    {
      std::lock_guard lock(shared_->core->mu);
      if (shared_->core->has_failed) return shared_->core->failure();
      const LocalWorld::Shared::Key key{rank_, peer, tag};
      shared_->mailbox[key][shared_->sends_posted[key]++] = m;
      shared_->core->cv.notify_all();
    }
    return std::unique_ptr<Work>(std::make_unique<SendWork>(shared_, std::move(m), rank_, peer, tag, timeout()));
  }

  Result<std::unique_ptr<Work>> recv_async(void* data, int64_t bytes, int peer, int tag) override {
    DISTCA_RETURN_IF_ERROR(check_p2p("recv", data, bytes, peer, tag));
    uint64_t index = 0;
    {
      std::lock_guard lock(shared_->core->mu);
      if (shared_->core->has_failed) return shared_->core->failure();
      index = shared_->recvs_posted[{peer, rank_, tag}]++;
    }
    return std::unique_ptr<Work>(std::make_unique<RecvWork>(shared_, static_cast<std::byte*>(data), bytes, rank_, peer, tag,
                                                            index, timeout()));
  }

  Result<std::unique_ptr<Communicator>> split(int color, int key, const std::string& label) override {
    if (color < 0) return invalid_argument(fmt::format("split: color {} (must be >= 0)", color));
    if (label.empty()) return invalid_argument("split: a group needs a label");
    DISTCA_ASSIGN_OR_RETURN(std::unique_ptr<Work> work, post(Kind::kSplit, std::nullopt, [&](Slot& s) {
                              if (s.color.empty()) s.color.assign(size(), 0), s.key.assign(size(), 0), s.label = label;
                              s.color[rank_] = color;
                              s.key[rank_] = key;
                              return Status::ok();
                            }));
    DISTCA_RETURN_IF_ERROR(work->wait());
    std::shared_ptr<LocalWorld::Shared> group = static_cast<LocalWork&>(*work).group_;
    const int world = shared_->world_ranks[rank_];
    const auto& members = group->world_ranks;
    const int rank = static_cast<int>(std::find(members.begin(), members.end(), world) - members.begin());
    auto comm = std::make_unique<Comm>(std::move(group), rank);
    comm->set_timeout(timeout());
    return std::unique_ptr<Communicator>(std::move(comm));
  }

  int world_rank() const override { return shared_->world_ranks[rank_]; }

  void abort(const std::string& reason) override {
    std::lock_guard lock(shared_->core->mu);
    if (!shared_->core->has_failed) {
      shared_->core->has_failed = true;
      shared_->core->failed_rank = shared_->world_ranks[rank_];
      shared_->core->reason = reason;
    }
    shared_->core->cv.notify_all();
  }

 private:
  template <typename Fill>
  Result<std::unique_ptr<Work>> post(Kind kind, std::optional<AllToAllV> args, Fill&& fill) {
    const uint64_t seq = next_seq_++;
    {
      std::lock_guard lock(shared_->core->mu);
      if (shared_->core->has_failed) return shared_->core->failure();
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
      shared_->core->cv.notify_all();
    }
    return std::unique_ptr<Work>(std::make_unique<LocalWork>(shared_, seq, rank_, kind, timeout(), args));
  }

  std::shared_ptr<Shared> shared_;
  int rank_;
  uint64_t next_seq_ = 0;
};

namespace {
std::vector<int> iota_ranks(int n) {
  std::vector<int> r(static_cast<size_t>(std::max(n, 0)));
  for (int i = 0; i < n; ++i) r[i] = i;
  return r;
}
}  // namespace

LocalWorld::LocalWorld(int num_ranks) : shared_(std::make_shared<Shared>(std::make_shared<Core>(), iota_ranks(num_ranks), "")) {
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
