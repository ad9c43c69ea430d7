#include "distca/layout/step_split.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <tuple>

namespace distca::layout {

namespace {

// The two nano-batches of a document assignment (nano_of[doc] is 0 or 1).
Result<NanoBatches> build_nano_batches(const plan::Batch& batch, const std::vector<int>& nano_of) {
  const int32_t num_docs = batch.num_docs();
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

}  // namespace

Result<NanoBatches> split_step_by_documents(const plan::Batch& batch) {
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
  return build_nano_batches(batch, nano_of);
}

namespace {

// A task at a document split position p: the part of its queries before p (nano-batch A's) and
// the rest (B's). A causal task over keys [0, q1) may be cut: A's part [q0, p) reads keys
// [0, p) and B's [p, q1) keys [0, q1). Any other task lies on one side (p never cuts it).
std::array<std::optional<plan::Task>, 2> parts_at(const plan::Task& t, int64_t p) {
  if (t.q1 <= p) return {t, std::nullopt};
  if (t.q0 >= p) return {std::nullopt, t};
  plan::Task a = t, b = t;
  a.q1 = a.k1 = p;
  b.q0 = p;
  return {a, b};
}

bool is_cuttable(const plan::Task& t) { return t.k0 == 0 && t.is_causal(); }

// One document's candidate split positions and, for each, what it puts in nano-batch A less
// what it puts in B, per cell of work (see doc_splits).
struct DocSplits {
  std::vector<int64_t> positions;                           // ascending; 0 (all in B) .. length (all in A)
  std::vector<std::vector<std::pair<int, double>>> delta;   // per position: A's work - B's, per cell
  std::vector<double> twice_rows;                           // per position: K/V rows a server gets twice
  double weight = 0;                                        // the document's work over every cell
};

// The 4R cells of a document's work: its attention seconds on each server (from the plan), its
// linear work on each rank (tokens priced at `weights.token`), and the bytes each rank sends and
// receives in the forward's exchanges (priced at `weights.byte`; the backward's mirror them), for
// a split at each candidate position, at most kMaxPositions of them: the task boundaries no task
// straddles, and with held K/V also points inside the tasks that may be cut (whose K/V prefix
// B's server then holds from A: nothing is received twice).
struct CellWeights {
  double token = 1, byte = 0;
};
DocSplits doc_splits(const plan::Batch& batch, int32_t doc, const std::vector<const plan::Task*>& tasks,
                     const plan::CostModel& cost, CellWeights weights, bool hold_kv) {
  constexpr size_t kMaxPositions = 33;
  constexpr int64_t kCutsPerTask = 8, kCutAlign = 64;
  const int R = batch.num_ranks;
  const int64_t len = batch.doc_lengths[doc];
  std::vector<int64_t> bounds{0, len};
  for (const plan::Task* t : tasks) {
    bounds.push_back(t->q0);
    if (!hold_kv || !is_cuttable(*t)) continue;
    for (int64_t i = 1; i < kCutsPerTask; ++i) {
      const int64_t at = (t->q0 + t->q_len() * i / kCutsPerTask) / kCutAlign * kCutAlign;
      if (at > t->q0 && at < t->q1) bounds.push_back(at);
    }
  }
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  std::erase_if(bounds, [&](int64_t p) {
    return std::any_of(tasks.begin(), tasks.end(), [&](const plan::Task* t) {
      return t->q0 < p && p < t->q1 && !(hold_kv && is_cuttable(*t));
    });
  });
  DocSplits d;
  if (bounds.size() > kMaxPositions) {  // evenly spaced, both ends kept
    for (size_t i = 0; i < kMaxPositions; ++i) d.positions.push_back(bounds[i * (bounds.size() - 1) / (kMaxPositions - 1)]);
    d.positions.erase(std::unique(d.positions.begin(), d.positions.end()), d.positions.end());
  } else {
    d.positions = bounds;
  }
  auto add = [](std::vector<std::pair<int, double>>& v, int cell, double w) {
    for (auto& [c, x] : v) {
      if (c == cell) { x += w; return; }
    }
    v.emplace_back(cell, w);
  };
  auto seconds = [&](const plan::Task& t) { return cost.task_seconds(t.q_len(), t.pairs(), t.k1 - t.k0); };
  const plan::TokenBytes& tb = cost.token_bytes();
  // Rows [lo, hi) of the document moving to server s at `per_row` bytes: each owner's send and
  // s's receive, signed for the nano-batch (+A, -B).
  auto move = [&](std::vector<std::pair<int, double>>& v, int64_t lo, int64_t hi, int s, int64_t per_row, double sign) {
    if (lo >= hi || weights.byte <= 0) return;
    plan::for_each_owner(batch, doc, lo, hi, [&](int32_t owner, int64_t rows) {
      if (owner == s) return;
      const double w = sign * weights.byte * static_cast<double>(rows * per_row);
      add(v, 2 * R + owner, w);
      add(v, 3 * R + s, w);
    });
  };
  for (const plan::Task* t : tasks) d.weight += seconds(*t);
  for (int32_t i : batch.doc_pieces[doc]) d.weight += weights.token * static_cast<double>(batch.pieces[i].length());
  for (int64_t p : d.positions) {
    std::vector<std::pair<int, double>> delta;
    // Per server, the key hull of its A tasks and of its B tasks. Without held K/V their
    // overlap, less the rows the server holds itself, is what it receives twice.
    std::vector<std::array<int64_t, 4>> hull(static_cast<size_t>(R), {len, 0, len, 0});
    for (const plan::Task* t : tasks) {
      const auto parts = parts_at(*t, p);
      for (int n = 0; n < 2; ++n) {
        if (!parts[n]) continue;
        const double sign = n == 0 ? 1.0 : -1.0;
        add(delta, t->server, sign * seconds(*parts[n]));
        move(delta, parts[n]->q0, parts[n]->q1, t->server, tb.q + tb.out, sign);  // Q there, O and LSE back
        auto& h = hull[t->server];
        h[2 * n] = std::min(h[2 * n], parts[n]->k0);
        h[2 * n + 1] = std::max(h[2 * n + 1], parts[n]->k1);
      }
    }
    double twice = 0;
    for (int s = 0; s < R; ++s) {
      const auto& h = hull[s];
      move(delta, h[0], h[1], s, tb.kv, 1.0);
      const int64_t lo = std::max(h[0], h[2]), hi = std::min(h[1], h[3]);
      if (hold_kv && lo < hi) {  // B receives its hull less A's (A's hull holds [lo, hi))
        move(delta, h[2], lo, s, tb.kv, -1.0);
        move(delta, hi, h[3], s, tb.kv, -1.0);
        continue;
      }
      move(delta, h[2], h[3], s, tb.kv, -1.0);
      if (lo >= hi) continue;
      int64_t own = 0;
      for (int32_t i : batch.doc_pieces[doc]) {
        const plan::Piece& pc = batch.pieces[i];
        if (pc.rank == s) own += std::max<int64_t>(0, std::min(hi, pc.end) - std::max(lo, pc.begin));
      }
      twice += static_cast<double>(hi - lo - own);
    }
    for (int32_t i : batch.doc_pieces[doc]) {
      const plan::Piece& pc = batch.pieces[i];
      const int64_t in_a = std::clamp(p, pc.begin, pc.end) - pc.begin;
      add(delta, R + pc.rank, weights.token * static_cast<double>(in_a - (pc.length() - in_a)));
    }
    d.delta.push_back(std::move(delta));
    d.twice_rows.push_back(twice);
  }
  return d;
}

// The nano-batches of split positions (doc d's queries [0, split[d]) in A, the rest in B).
Result<NanoBatches> build_positional(const plan::Batch& batch, const std::vector<int64_t>& split) {
  const int R = batch.num_ranks;
  std::vector<int64_t> piece_row(batch.pieces.size());
  std::vector<int64_t> rank_rows(R, 0);
  for (size_t i = 0; i < batch.pieces.size(); ++i) {
    piece_row[i] = rank_rows[batch.pieces[i].rank];
    rank_rows[batch.pieces[i].rank] += batch.pieces[i].length();
  }
  NanoBatches out;
  std::array<std::vector<int32_t>, 2> new_id;
  for (int n = 0; n < 2; ++n) {
    new_id[n].assign(batch.num_docs(), -1);
    out.batches[n].num_ranks = R;
    out.rows[n].assign(R, {});
  }
  for (int32_t doc = 0; doc < batch.num_docs(); ++doc) {
    const int64_t len = batch.doc_lengths[doc], p = split[doc];
    if (p > 0) {
      new_id[0][doc] = static_cast<int32_t>(out.docs[0].size());
      out.docs[0].push_back(doc);
      out.batches[0].doc_lengths.push_back(p);
    }
    if (p < len) {
      new_id[1][doc] = static_cast<int32_t>(out.docs[1].size());
      out.docs[1].push_back(doc);
      out.batches[1].doc_lengths.push_back(len);
    }
  }
  out.context_rows.assign(R, 0);
  // Per rank: A's own pieces, then its context pieces (prefixes of split documents); B's layout
  // starts with the same context pieces, then its own.
  std::vector<std::vector<size_t>> by_rank(R);
  for (size_t i = 0; i < batch.pieces.size(); ++i) by_rank[batch.pieces[i].rank].push_back(i);
  for (int r = 0; r < R; ++r) {
    std::vector<plan::Piece> context;
    std::vector<int64_t> context_rows;
    for (size_t i : by_rank[r]) {
      const plan::Piece& pc = batch.pieces[i];
      const int64_t p = split[pc.doc], len = batch.doc_lengths[pc.doc];
      const int64_t a_end = std::min(p, pc.end);
      if (a_end > pc.begin) {
        plan::Piece a{new_id[0][pc.doc], pc.begin, a_end, pc.rank};
        if (p < len) {
          context.push_back(a);
          for (int64_t t = pc.begin; t < a_end; ++t) context_rows.push_back(piece_row[i] + t - pc.begin);
        } else {
          out.batches[0].pieces.push_back(a);
          for (int64_t t = pc.begin; t < a_end; ++t) out.rows[0][r].push_back(piece_row[i] + t - pc.begin);
        }
      }
    }
    for (const plan::Piece& c : context) out.batches[0].pieces.push_back(c);
    out.rows[0][r].insert(out.rows[0][r].end(), context_rows.begin(), context_rows.end());
    out.context_rows[r] = static_cast<int64_t>(context_rows.size());
    for (const plan::Piece& c : context) {
      out.batches[1].pieces.push_back(plan::Piece{new_id[1][out.docs[0][c.doc]], c.begin, c.end, c.rank});
    }
    for (size_t i : by_rank[r]) {
      const plan::Piece& pc = batch.pieces[i];
      const int64_t b_begin = std::max(split[pc.doc], pc.begin);
      if (b_begin >= pc.end) continue;
      out.batches[1].pieces.push_back(plan::Piece{new_id[1][pc.doc], b_begin, pc.end, pc.rank});
      for (int64_t t = b_begin; t < pc.end; ++t) out.rows[1][r].push_back(piece_row[i] + t - pc.begin);
    }
  }
  for (int n = 0; n < 2; ++n) {
    plan::Batch& b = out.batches[n];
    int64_t most = 1;
    for (int r = 0; r < R; ++r) {
      most = std::max<int64_t>(most, static_cast<int64_t>(out.rows[n][r].size()) + (n == 1 ? out.context_rows[r] : 0));
    }
    b.tokens_per_rank = most;
    b.index();
    DISTCA_RETURN_IF_ERROR(b.validate());
  }
  return out;
}

}  // namespace

Result<NanoSplit> split_step(const plan::Batch& batch, const plan::Plan& plan, const plan::CostModel& cost,
                             SplitOptions options) {
  DISTCA_RETURN_IF_ERROR(batch.validate());
  const int32_t num_docs = batch.num_docs();
  const int R = batch.num_ranks;
  std::vector<std::vector<const plan::Task*>> tasks_of(num_docs);
  double attention_total = 0;
  for (const plan::Task& t : plan.tasks) {
    if (t.doc < 0 || t.doc >= num_docs || t.server < 0 || t.server >= R) {
      return invalid_argument(fmt::format("split_step: the plan names document {} on server {}, but the batch has {} "
                                          "documents on {} ranks", t.doc, t.server, num_docs, R));
    }
    tasks_of[t.doc].push_back(&t);
    attention_total += cost.task_seconds(t.q_len(), t.pairs(), t.k1 - t.k0);
  }
  int64_t token_total = 0;
  for (const plan::Piece& p : batch.pieces) token_total += p.length();
  // All tokens weigh what all attention weighs: both halves of each tick of the schedule count;
  // and so do all the bytes of the forward's exchanges, each counted at its sender and receiver.
  CellWeights weights;
  weights.token = token_total > 0 && attention_total > 0 ? attention_total / static_cast<double>(token_total) : 1.0;
  const auto& phases = plan.traffic.phases;
  const int64_t exchanged = phases[static_cast<int>(plan::Phase::kFwdDispatch)].total_bytes +
                            phases[static_cast<int>(plan::Phase::kFwdReturn)].total_bytes;
  weights.byte = exchanged > 0 ? attention_total / static_cast<double>(2 * exchanged) : 0.0;
  std::vector<DocSplits> docs(num_docs);
  std::vector<double> weight(num_docs, 0.0);
  for (int32_t d = 0; d < num_docs; ++d) {
    docs[d] = doc_splits(batch, d, tasks_of[d], cost, weights, options.hold_kv);
    weight[d] = docs[d].weight;
  }
  // K/V rows received twice, at most 4 % of the rows the plan's forward dispatch moves.
  const plan::TokenBytes& tb = cost.token_bytes();
  const int64_t fwd_bytes = plan.traffic.phases[static_cast<int>(plan::Phase::kFwdDispatch)].total_bytes;
  const double budget_rows = tb.kv > 0 ? 0.04 * static_cast<double>(fwd_bytes) / static_cast<double>(tb.kv) : 0.0;

  // diff[cell] = A's work - B's: pick each document's position with the least sum of squares.
  std::vector<double> diff(static_cast<size_t>(4 * R), 0.0);
  std::vector<int> choice(num_docs, -1);
  double twice = 0;
  auto apply = [&](int32_t d, int k, double sign) {
    for (const auto& [cell, x] : docs[d].delta[k]) diff[cell] += sign * x;
    twice += sign * docs[d].twice_rows[k];
  };
  auto choose = [&](int32_t d) {
    int best = -1;
    double best_score = 0;
    for (size_t k = 0; k < docs[d].positions.size(); ++k) {
      if (docs[d].twice_rows[k] > 0 && twice + docs[d].twice_rows[k] > budget_rows) continue;
      double score = 0;
      for (const auto& [cell, x] : docs[d].delta[k]) score += (diff[cell] + x) * (diff[cell] + x) - diff[cell] * diff[cell];
      if (best < 0 || score < best_score) best = static_cast<int>(k), best_score = score;
    }
    return best;  // position 0 (all in B) never receives anything twice, so there is one
  };
  std::vector<int32_t> order(num_docs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return weight[a] > weight[b]; });
  for (int pass = 0; pass < 3; ++pass) {  // the greedy pass, then two revisits
    for (int32_t d : order) {
      if (choice[d] >= 0) apply(d, choice[d], -1.0);
      choice[d] = choose(d);
      apply(d, choice[d], 1.0);
    }
  }
  std::vector<int64_t> split(num_docs);
  for (int32_t d = 0; d < num_docs; ++d) split[d] = docs[d].positions[choice[d]];

  NanoSplit out;
  DISTCA_ASSIGN_OR_RETURN(out.nano, build_positional(batch, split));
  std::array<std::vector<int32_t>, 2> new_id;
  for (int n = 0; n < 2; ++n) {
    new_id[n].assign(num_docs, -1);
    for (size_t i = 0; i < out.nano.docs[n].size(); ++i) new_id[n][out.nano.docs[n][i]] = static_cast<int32_t>(i);
  }
  std::array<std::vector<plan::Task>, 2> tasks;
  for (const plan::Task& t : plan.tasks) {
    const auto parts = parts_at(t, split[t.doc]);
    for (int n = 0; n < 2; ++n) {
      if (!parts[n]) continue;
      tasks[n].push_back(*parts[n]);
      tasks[n].back().doc = new_id[n][t.doc];
    }
  }
  if (options.hold_kv) {  // B's servers hold A's K/V: A's layout, in B's document numbering
    for (KvInterval in : kv_layout(tasks[0])) {
      in.doc = new_id[1][out.nano.docs[0][in.doc]];
      if (in.doc >= 0) out.held_kv.push_back(in);
    }
  }
  for (int n = 0; n < 2; ++n) {
    out.plans[n] = plan::finalize_plan(plan.policy, plan.tolerance, out.nano.batches[n], cost, std::move(tasks[n]));
  }
  return out;
}

}  // namespace distca::layout
