#include "distca/runtime/pingpong.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <numeric>

#include "distca/plan/cost.h"

namespace distca::runtime {

Result<NanoBatches> split_nano_batches(const plan::Batch& batch) {
  DISTCA_RETURN_IF_ERROR(batch.validate());
  const int32_t num_docs = batch.num_docs();
  std::vector<int32_t> order(num_docs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return batch.doc_lengths[a] > batch.doc_lengths[b]; });
  std::vector<int> nano_of(num_docs, 0);
  std::array<int64_t, 2> pairs{0, 0}, tokens{0, 0};
  for (int32_t doc : order) {
    const int64_t len = batch.doc_lengths[doc];
    const int n = std::tie(pairs[1], tokens[1]) < std::tie(pairs[0], tokens[0]) ? 1 : 0;
    nano_of[doc] = n;
    pairs[n] += plan::causal_pairs(0, len);
    tokens[n] += len;
  }

  // Piece rows in the micro-batch's linear layout.
  std::vector<int64_t> piece_row(batch.pieces.size());
  std::vector<int64_t> rank_rows(batch.num_ranks, 0);
  for (size_t i = 0; i < batch.pieces.size(); ++i) {
    piece_row[i] = rank_rows[batch.pieces[i].rank];
    rank_rows[batch.pieces[i].rank] += batch.pieces[i].length();
  }

  NanoBatches out;
  std::vector<int32_t> new_id(num_docs, -1);
  for (int32_t doc = 0; doc < num_docs; ++doc) {
    const int n = nano_of[doc];
    new_id[doc] = static_cast<int32_t>(out.docs[n].size());
    out.docs[n].push_back(doc);
  }
  for (int n = 0; n < 2; ++n) {
    plan::Batch& b = out.batches[n];
    b.num_ranks = batch.num_ranks;
    for (int32_t doc : out.docs[n]) b.doc_lengths.push_back(batch.doc_lengths[doc]);
    out.rows[n].assign(batch.num_ranks, {});
  }
  for (size_t i = 0; i < batch.pieces.size(); ++i) {  // by rank, then position: the order kept
    const plan::Piece& p = batch.pieces[i];
    const int n = nano_of[p.doc];
    out.batches[n].pieces.push_back(plan::Piece{new_id[p.doc], p.begin, p.end, p.rank});
    for (int64_t r = 0; r < p.length(); ++r) out.rows[n][p.rank].push_back(piece_row[i] + r);
  }
  for (int n = 0; n < 2; ++n) {
    plan::Batch& b = out.batches[n];
    int64_t most = 1;
    for (const auto& rows : out.rows[n]) most = std::max<int64_t>(most, static_cast<int64_t>(rows.size()));
    b.tokens_per_rank = most;
    b.index();
    DISTCA_RETURN_IF_ERROR(b.validate());
  }
  return out;
}

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Adds fn's time to `seconds` and to the nano-batch's own counter.
Status timed(const std::function<Status()>& fn, double& seconds, double& nano_seconds) {
  if (!fn) return Status::ok();
  const auto t = Clock::now();
  Status st = fn();
  const double s = since(t);
  seconds += s;
  nano_seconds += s;
  return st;
}

Status check_chains(const std::vector<Stage>& a, const std::vector<Stage>& b) {
  if (a.size() != b.size()) {
    return invalid_argument(fmt::format("ping-pong: the nano-batches have {} and {} stages; they must match",
                                        a.size(), b.size()));
  }
  for (const auto* chain : {&a, &b}) {
    for (const Stage& s : *chain) {
      if (!s.compute || static_cast<bool>(s.start_comm) != static_cast<bool>(s.finish_comm)) {
        return invalid_argument("ping-pong: every stage computes, and starts and finishes its communication together");
      }
    }
  }
  return Status::ok();
}

}  // namespace

Result<ScheduleTiming> run_sequential(std::vector<Stage>& a, std::vector<Stage>& b) {
  DISTCA_RETURN_IF_ERROR(check_chains(a, b));
  ScheduleTiming t;
  const auto start = Clock::now();
  for (int n = 0; n < 2; ++n) {
    for (Stage& s : n == 0 ? a : b) {
      DISTCA_RETURN_IF_ERROR(timed(s.compute, t.compute_seconds, t.nano_compute_seconds[n]));
      DISTCA_RETURN_IF_ERROR(timed(s.start_comm, t.comm_seconds, t.nano_comm_seconds[n]));
      DISTCA_RETURN_IF_ERROR(timed(s.finish_comm, t.comm_seconds, t.nano_comm_seconds[n]));
    }
  }
  t.seconds = since(start);
  return t;
}

Result<ScheduleTiming> run_pingpong(std::vector<Stage>& a, std::vector<Stage>& b) {
  DISTCA_RETURN_IF_ERROR(check_chains(a, b));
  ScheduleTiming t;
  const auto start = Clock::now();
  for (size_t i = 0; i < a.size(); ++i) {
    for (int n = 0; n < 2; ++n) {
      std::vector<Stage>& chain = n == 0 ? a : b;
      if (i > 0) DISTCA_RETURN_IF_ERROR(timed(chain[i - 1].finish_comm, t.comm_seconds, t.nano_comm_seconds[n]));
      DISTCA_RETURN_IF_ERROR(timed(chain[i].compute, t.compute_seconds, t.nano_compute_seconds[n]));
      DISTCA_RETURN_IF_ERROR(timed(chain[i].start_comm, t.comm_seconds, t.nano_comm_seconds[n]));
    }
  }
  if (!a.empty()) {
    DISTCA_RETURN_IF_ERROR(timed(a.back().finish_comm, t.comm_seconds, t.nano_comm_seconds[0]));
    DISTCA_RETURN_IF_ERROR(timed(b.back().finish_comm, t.comm_seconds, t.nano_comm_seconds[1]));
  }
  t.seconds = since(start);
  return t;
}

}  // namespace distca::runtime
