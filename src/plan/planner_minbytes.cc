// minbytes: balances like minmax (max load <= (1 + eps) * mean) but moves query x key blocks,
// shaped so that the busiest rank sends and receives as few bytes as possible.
//
// Why blocks: a query shard moved with its whole causal key prefix (the paper's task shape)
// makes the receiver pay for every key before the shard, however little work it takes. A block
// of a rows x b keys computes a * b pairs and costs a * Q + b * K bytes, where Q and K are what
// a query row and a key row cost over the four phases with the stateful backward (Q, partial
// O/LSE back, dO with the merged O/LSE, partial dQ back; K/V, fp32 dK/dV back). For a given
// amount of work that is least when a * Q = b * K, and grows only as the square root of the
// work. At 32 query and 8 KV heads in bf16, Q = 41,216 and K = 12,288 bytes: the best block has
// about 3.4 times as many keys as rows.
//
//   1. Every piece starts at home as one causal task: a band of rows [r0, r1) with keys [c, q]
//      for each row q (c = 0 at first).
//   2. cap = (1 + eps) * mean_lb (mean_lb: every document one task, a floor of the true mean).
//   3. Receivers get a soft intake t (water filling): min(room, t) over the servers below cap
//      adds up to the senders' excess, so the work spreads over many receivers instead of
//      filling the emptiest ones first (the largest intake sets the largest receive).
//   4. Senders, largest excess first, shed their excess in k equal blocks, k as few as the
//      largest intake allows. Each block goes preferably to a receiver that has none yet (a
//      receiver pays for every block it takes), the one with the least intake that holds it;
//      else to the receiver holding it that receives the fewest bytes so far. Of the sender's
//      bands, the cut with the fewest bytes per second of wanted work moved wins. A block takes
//      rows [x, r1) of a band and keys [c, e), e <= x, so it lies wholly below the diagonal (a
//      non-causal task); the band's rows [x, r1) keep keys [e, q]. Where no block fits, a tail
//      of the band, or the whole band, moves as a causal task. Keys the receiver owns or
//      already receives cost nothing. Cuts land on multiples of g. When the soft intakes are
//      spent, a new water level over the rooms left covers the excess left.
//      The rows [x, r1) left with keys [e, q] continue the block just cut: more of their keys
//      for the same receiver extend that block (consider_extension) instead of making another
//      task there, so a receiver never holds two tasks of the same rows over abutting keys.
//   4b. With hosts (minlink's variant, MinbytesShape::host_fill): before step 4, a sender whose
//      excess is many rooms' worth ships it in a few equal blocks to hosts, receivers that hand
//      their own work on to the others first (reserve_hosts: which senders, how many blocks).
//   5. The owner of a query row merges the partial O/LSE of its row's tasks (the runtime does).
// A per-rank byte budget (forward dispatch + return, send and receive, as minmax's) skips moves
// that would break it; when the plan cannot keep it, the note names the smallest budget this
// planner keeps, found by bisection. A per-server memory cap (PlannerOptions::max_server_bytes
// resolved, memory_cap.h) skips moves that would take a receiver's rows over it: Q, O and LSE
// of each query row it computes, K and V of each key row it holds (Plan::server_bytes), counted
// as moves add them (a sender's rows leave with a whole band or a suffix; its keys are counted
// as kept, so the count never falls below the plan's).
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <memory_resource>
#include <set>

#include "distca/core/check.h"
#include "budget.h"
#include "memory_cap.h"
#include "minbytes.h"
#include "scratch.h"
#include "distca/plan/planner.h"

namespace distca::plan {
namespace {

struct Band {  // causal task: rows [r0, r1), each row q sees keys [c, q]
  int32_t doc;
  int64_t r0, r1, c;
  int32_t server;
  double seconds = 0;  // its cost (MinbytesPlanner::set_seconds), kept as the band changes
  int32_t ext = -1;    // the block cut off it last (rows [r0, r1), keys [k0, c)), which its keys continue
};

struct Block {  // non-causal task: rows [q0, q1) see keys [k0, k1), k1 <= q0
  int32_t doc;
  int64_t q0, q1, k0, k1;
  int32_t server;
};

struct Move {
  int32_t band = -1;
  bool is_whole = false;
  int64_t x = 0;  // rows [x, r1) of the band
  int64_t e = 0;  // keys [c, e); -1: rows [x, r1) move as a causal task (a suffix)
  int32_t dst = -1;
  double seconds = 0;  // what the receiver gains
  double shed = 0;     // what the sender loses (less than seconds when the cut adds a task there)
  double bytes = 0;    // all four phases (move_bytes)
  double score = 0;    // bytes per second of work moved
  int32_t ext = -1;    // >= 0: keys [c, e) extend this block of dst's (consider_extension)
};

// The lists minbytes keeps between plans (scratch.h), with its arena's buffer.
struct KeptLists {
  std::vector<Band> bands;
  std::vector<Block> blocks;
};

class MinbytesPlanner {
 public:
  // mean: the mean load the cap is (1 + eps) times (0: every document as one task's).
  MinbytesPlanner(const Batch& batch, const CostModel& cost, const PlannerOptions& options, int64_t budget,
                  const MinbytesShape& shape = {}, double mean = 0)
      : batch_(batch), cost_(cost), options_(options), budget_(budget), memory_cap_(std::max<int64_t>(0, options.max_server_bytes)),
        mean_(mean), intake_scale_(shape.intake_scale),
        host_fill_(budget == 0 ? shape.host_fill : 0.0), host_every_(shape.host_every), g_(options.granularity),
        g_shift_((g_ & (g_ - 1)) == 0 ? std::countr_zero(static_cast<uint64_t>(g_)) : -1),
        num_ranks_(batch.num_ranks), load_(num_ranks_, 0.0), memory_(num_ranks_, 0) {
    // Per rank and per document lists from one arena (freed at once with the planner): most hold
    // one or two entries, and allocating each from the heap cost a fifth of a plan's time.
    server_bands_.reserve(num_ranks_);
    bands_.swap(lease_.lists().bands);
    blocks_.swap(lease_.lists().blocks);
    bands_.clear();
    blocks_.clear();
    server_bands_.resize(num_ranks_);  // each list from the arena (the outer list's resource)
    held_.reserve(batch.num_docs());
    held_by_server_.reserve(batch.num_docs());
    held_.resize(batch.num_docs());
    held_by_server_.resize(batch.num_docs());
    const TokenBytes& tb = cost_.token_bytes();
    // What a row costs over the four phases with the stateful backward: a query row of a split
    // task goes out as Q, comes back as partial O/LSE, goes out again as dO with the merged
    // O/LSE, and comes back as partial dQ; a key row goes out as K/V and comes back as fp32
    // dK/dV. A row whose only task moves (a causal task from key 0) skips the merged O/LSE.
    q_whole_ = static_cast<double>(tb.q + tb.out + tb.bwd_do + tb.bwd_dq);
    q_held_ = tb.q + tb.out;
    kv_held_ = tb.kv;
    q_ = q_whole_ + static_cast<double>(tb.out);
    kv_ = static_cast<double>(tb.kv + tb.bwd_dkv);
    seconds_per_pair_ = cost_.pair_seconds(1);
    overhead_ = cost_.task_seconds(cost_.profile().tile_rows, 0, 1);
    tile_rows_ = cost_.profile().tile_rows;
    slowest_seconds_per_pair_ = cost_.slowest_pair_seconds();
  }

  ~MinbytesPlanner() {
    if (bands_.capacity() * sizeof(Band) <= kMaxScratchBytes) lease_.lists().bands.swap(bands_);
    if (blocks_.capacity() * sizeof(Block) <= kMaxScratchBytes) lease_.lists().blocks.swap(blocks_);
  }
  const std::vector<int32_t>& passed_over() const { return passed_over_; }
  MinbytesPlanner(const MinbytesPlanner&) = delete;
  MinbytesPlanner& operator=(const MinbytesPlanner&) = delete;

  Plan run() {
    for (const Piece& p : batch_.pieces) add_band(Band{p.doc, p.begin, p.end, 0, p.rank});
    double lower_total = 0;
    for (int32_t d = 0; d < batch_.num_docs(); ++d) lower_total += causal_seconds(0, batch_.doc_lengths[d], 0);
    cap_ = (1.0 + options_.tolerance) * (mean_ > 0 ? mean_ : lower_total / num_ranks_);
    if (budget_ > 0) start_budget();

    // 3. The soft intake t: sum over receivers of min(room, t) covers the excess.
    double excess = 0;
    std::vector<int32_t> senders;
    for (int32_t s = 0; s < num_ranks_; ++s) {
      if (load_[s] > cap_) {
        excess += load_[s] - cap_;
        senders.push_back(s);
      }
    }
    std::stable_sort(senders.begin(), senders.end(), [&](int32_t a, int32_t b) { return load_[a] > load_[b]; });
    reserved_.assign(num_ranks_, 0);
    std::vector<Hosting> hosted;
    if (host_fill_ > 0) hosted = reserve_hosts(senders, excess);
    set_intakes(excess);
    for (const Hosting& h : hosted) host(h.sender, h.host, h.block);
    if (!hosted.empty()) {  // their rooms left over serve the rest
      reserved_.assign(num_ranks_, 0);
      refill_receivers();
    }
    for (int32_t s : senders) shed(s, cap_);

    std::vector<Task> tasks;
    for (const Band& b : bands_) {
      if (b.r0 < b.r1) tasks.push_back(Task{b.doc, b.r0, b.r1, b.c, b.r1, b.server});
    }
    for (const Block& b : blocks_) {
      if (b.k0 < b.k1) tasks.push_back(Task{b.doc, b.q0, b.q1, b.k0, b.k1, b.server});
    }
    Plan plan = finalize_plan("minbytes", options_.tolerance, batch_, cost_, std::move(tasks));
    if (budget_ > 0) {
      const auto& fwd = plan.traffic.forward;
      plan.is_within_budget = is_budget_feasible_ && fwd.max_send_bytes <= budget_ && fwd.max_recv_bytes <= budget_;
    }
    if (memory_cap_ > 0) {
      plan.memory_cap = memory_cap_;
      plan.is_within_memory = *std::max_element(plan.server_bytes.begin(), plan.server_bytes.end()) <= memory_cap_;
    }
    plan.note = plan.is_balanced ? "bound met" : "bound not met";
    if (!hosted.empty()) {
      std::vector<int32_t> hosted_senders;
      for (const Hosting& h : hosted) hosted_senders.push_back(h.sender);
      std::sort(hosted_senders.begin(), hosted_senders.end());
      hosted_senders.erase(std::unique(hosted_senders.begin(), hosted_senders.end()), hosted_senders.end());
      plan.note += fmt::format(", {} host receivers for {} sender{}", hosted.size(), hosted_senders.size(),
                               hosted_senders.size() == 1 ? "" : "s");
    }
    if (!plan.is_balanced && !stuck_.empty()) {
      // Name the busiest server of the finished plan (a server that got stuck early may have been
      // passed by another one), and why its work could not move.
      const auto busiest = static_cast<int32_t>(std::max_element(load_.begin(), load_.end()) - load_.begin());
      const bool was_stuck = std::find(stuck_.begin(), stuck_.end(), busiest) != stuck_.end();
      plan.note = fmt::format("the busiest server, {}, stays at {:.4f} x cap: {}{}", busiest, load_[busiest] / cap_,
                              was_stuck ? "no receiver has room for a block of its work" : "the planner ran out of moves",
                              was_stuck && budget_ > 0   ? " within --max-rank-bytes"
                              : was_stuck && memory_cap_ > 0 ? " within the memory cap"
                                                             : "");
    }
    return plan;
  }

 private:
  // Seconds of a causal band and of a block.
  double causal_seconds(int64_t r0, int64_t r1, int64_t c) const {
    return r1 > r0 ? cost_.task_seconds(r1 - r0, causal_pairs(r0, r1) - c * (r1 - r0), r1 - c) : 0.0;
  }
  double block_seconds(int64_t rows, int64_t keys) const {
    return rows > 0 && keys > 0 ? cost_.task_seconds(rows, rows * keys, keys) : 0.0;
  }
  double band_seconds(const Band& b) const { return b.seconds; }
  void set_seconds(Band& b) const { b.seconds = causal_seconds(b.r0, b.r1, b.c); }
  // Multiples of g (rounding towards zero, as integer division does); a shift where g is a power
  // of two (the command line's only kind), which these, called for every shape tried, need.
  int64_t floor_g(int64_t x) const { return g_shift_ >= 0 && x >= 0 ? (x >> g_shift_) << g_shift_ : x / g_ * g_; }
  int64_t ceil_g(int64_t x) const { return floor_g(x + g_ - 1); }

  void add_band(Band b) {
    set_seconds(b);
    server_bands_[b.server].push_back(static_cast<int32_t>(bands_.size()));
    bands_.push_back(b);
    load_[b.server] += band_seconds(b);
    memory_[b.server] += (b.r1 - b.r0) * q_held_ + unheld_keys(b.doc, b.c, b.r1, b.server) * kv_held_;
    hold(b.doc, b.server, b.c, b.r1);
  }

  // held_[doc]: (server, [lo, hi)) key rows a server receives or owns for its tasks, in the order
  // taken; merged lazily (a handful per document). held_by_server_[doc]: the same by server, so
  // that one server's ranges are found by bisection: a document spread over hundreds of
  // receivers has as many entries, and walking them all for every shape tried made a plan
  // quadratic (80 % of one 131072-token document over 8,192 ranks' 8 s).
  void hold(int32_t doc, int32_t server, int64_t lo, int64_t hi) {
    held_[doc].push_back({server, lo, hi});
    auto& h = held_by_server_[doc];
    h.insert(std::upper_bound(h.begin(), h.end(), server, [](int32_t s, const Held& x) { return s < x.server; }),
             Held{server, lo, hi});
  }
  // The entries of held_by_server_[doc] of `server`.
  auto held_by(int32_t doc, int32_t server) const {
    const auto& h = held_by_server_[doc];
    return std::equal_range(h.begin(), h.end(), Held{server, 0, 0},
                            [](const Held& a, const Held& b) { return a.server < b.server; });
  }
  // Whether `server` holds key rows of `doc` (held_).
  bool holds_keys(int32_t doc, int32_t server) const {
    const auto [first, last] = held_by(doc, server);
    return first != last;
  }

  // Keys of [k0, k1) of `doc` that `server` does not hold yet (held_, owned or not).
  int64_t unheld_keys(int32_t doc, int64_t k0, int64_t k1, int32_t server) const {
    if (k1 <= k0) return 0;
    if (!holds_keys(doc, server)) return k1 - k0;
    auto& have = have_;  // scratch, reused
    have.clear();
    const auto [first, last] = held_by(doc, server);
    for (auto h = first; h != last; ++h) have.emplace_back(h->lo, h->hi);
    std::sort(have.begin(), have.end());
    int64_t at = k0, missing = 0;
    for (const auto& [lo, hi] : have) {
      if (hi <= at) continue;
      if (lo >= k1) break;
      missing += std::max<int64_t>(0, std::min(lo, k1) - at);
      at = std::max(at, hi);
      if (at >= k1) return missing;
    }
    return missing + (k1 - at);
  }

  // The rows a move adds to its receiver's memory (add_band's count for a whole band or a suffix,
  // which the move makes a new band of dst's).
  int64_t memory_added(const Move& m) const {
    const Band& b = bands_[m.band];
    if (m.ext >= 0) return unheld_keys(b.doc, b.c, m.e, m.dst) * kv_held_;
    if (m.is_whole) return (b.r1 - b.r0) * q_held_ + unheld_keys(b.doc, b.c, b.r1, m.dst) * kv_held_;
    if (m.e < 0) return (b.r1 - m.x) * q_held_ + unheld_keys(b.doc, b.c, b.r1, m.dst) * kv_held_;
    return (b.r1 - m.x) * q_held_ + unheld_keys(b.doc, b.c, m.e, m.dst) * kv_held_;
  }
  bool fits_memory(const Move& m) const { return memory_cap_ == 0 || memory_[m.dst] + memory_added(m) <= memory_cap_; }

  // Calls fn(owner, rows) for the rows of keys [k0, k1) of `doc` that `dst` neither owns nor
  // already receives.
  template <typename Fn>
  void for_each_missing_key(int32_t doc, int64_t k0, int64_t k1, int32_t dst, Fn&& fn) const {
    auto emit = [&](int64_t a, int64_t b) {
      if (a < b) {
        for_each_owner(batch_, doc, a, b, [&](int32_t owner, int64_t rows) {
          if (owner != dst) fn(owner, rows);
        });
      }
    };
    if (!holds_keys(doc, dst)) {
      emit(k0, k1);  // the common case: dst holds nothing of the document
      return;
    }
    auto& have = have_;  // scratch, reused
    have.clear();
    const auto [first, last] = held_by(doc, dst);
    for (auto h = first; h != last; ++h) have.emplace_back(h->lo, h->hi);
    std::sort(have.begin(), have.end());
    int64_t at = k0;
    for (const auto& [lo, hi] : have) {
      if (hi <= at) continue;
      if (lo >= k1) break;
      emit(at, std::min(lo, k1));
      at = std::max(at, hi);
      if (at >= k1) return;
    }
    emit(at, k1);
  }

  // Forward flows of running rows [q0, q1) x keys [k0, k1) of `doc` on `dst`: Q out and O/LSE
  // back for rows dst does not own, keys it lacks. Calls fn(src, dst, bytes).
  template <typename Fn>
  void for_each_flow(int32_t doc, int64_t q0, int64_t q1, int64_t k0, int64_t k1, int32_t dst, Fn&& fn) const {
    const TokenBytes& tb = cost_.token_bytes();
    for_each_owner(batch_, doc, q0, q1, [&](int32_t owner, int64_t rows) {
      if (owner == dst) return;
      fn(owner, dst, rows * tb.q);
      fn(dst, owner, rows * tb.out);
    });
    for_each_missing_key(doc, k0, k1, dst, [&](int32_t owner, int64_t rows) { fn(owner, dst, rows * tb.kv); });
  }

  // The bytes of all four phases (q_ and kv_ per row) of running rows [q0, q1) x keys [k0, k1)
  // of `doc` on `dst`: rows it does not own, keys it neither owns nor already receives.
  double move_bytes(int32_t doc, int64_t q0, int64_t q1, int64_t k0, int64_t k1, int32_t dst) const {
    const bool is_whole_rows = k0 == 0 && k1 == q1;  // a causal task from key 0: its rows' only task
    double bytes = 0;
    for_each_owner(batch_, doc, q0, q1, [&](int32_t owner, int64_t rows) {
      if (owner != dst) bytes += static_cast<double>(rows) * (is_whole_rows ? q_whole_ : q_);
    });
    for_each_missing_key(doc, k0, k1, dst, [&](int32_t, int64_t rows) { bytes += static_cast<double>(rows) * kv_; });
    return bytes;
  }

  // move_bytes where dst holds nothing of the document (holds_any is false): every row and key
  // is sent, so the bytes need no walk over owners and held ranges (the same sum: whole numbers
  // of bytes, exact in a double).
  double fresh_bytes(int64_t rows, bool is_whole_rows, int64_t keys) const {
    return static_cast<double>(rows) * (is_whole_rows ? q_whole_ : q_) + static_cast<double>(keys) * kv_;
  }

  // The end of the longest key range [c, e') of `rows` rows whose block fits in `room`, of e and
  // the multiples of g in (c, e); c when none fits. A block's seconds grow with its keys, so by
  // bisection.
  int64_t fitting_keys_end(int64_t rows, int64_t c, int64_t e, double room) const {
    if (e <= c || block_seconds(rows, e - c) <= room) return e;
    int64_t lo = floor_g(c) + g_, hi = floor_g(e - 1);  // the multiples of g in (c, e)
    // A block's seconds lie between its pairs at the top rate and at the slowest (each times the
    // short-shard factor, plus the overhead): keys past the top rate's fit do not fit, keys
    // within the slowest rate's do. That leaves a multiple or two to bisect (none on a flat
    // profile), where bisecting all of (c, e) took a quarter of consider_block.
    const double tile = rows < tile_rows_ ? static_cast<double>(tile_rows_) / static_cast<double>(rows) : 1.0;
    const double per_key = static_cast<double>(rows) * tile;  // pairs per key, shard factor in
    const double free = room - overhead_;
    if (free <= 0) return c;
    if (const double most = free / (per_key * seconds_per_pair_); most < static_cast<double>(hi - c)) {
      hi = std::max(lo, floor_g(c + static_cast<int64_t>(most)) + g_);  // one multiple over: rounding
      hi = std::min(hi, floor_g(e - 1));
    }
    if (const double least = free / (per_key * slowest_seconds_per_pair_); least >= static_cast<double>(g_)) {
      const int64_t sure = std::min(hi, floor_g(c + static_cast<int64_t>(least)) - g_);  // one under: rounding
      if (sure > lo && block_seconds(rows, sure - c) <= room) lo = sure;
    }
    if (lo > hi || block_seconds(rows, lo - c) > room) return c;
    while (lo < hi) {  // lo fits; the largest multiple in [lo, hi] that fits
      const int64_t mid = lo + (((hi - lo) / g_ + 1) / 2) * g_;
      if (block_seconds(rows, mid - c) <= room) lo = mid; else hi = mid - g_;
    }
    return lo;
  }

  // The block of band `id` for `dst` that moves about `want` seconds with the fewest bytes
  // (or the band's largest block when it cannot hold that much), never above `room`.
  void consider_block(int32_t id, int32_t dst, double want, double room, bool dst_holds, Move& best) const {
    const Band& b = bands_[id];
    const double want_pairs = std::max(1.0, (want - overhead_) / seconds_per_pair_);
    const double span = static_cast<double>(b.r1 - b.c);  // rows + keys of a block fit in it
    const double ideal = std::sqrt(want_pairs * kv_ / q_);  // rows of the cheapest block
    const double disc = span * span - 4 * want_pairs;
    double options[5] = {ideal, span / 2};
    int count = 2;
    if (disc >= 0) {  // rows a with a * (span - a) = want: the block's extremes that still hold it
      options[count++] = (span - std::sqrt(disc)) / 2;
      options[count++] = (span + std::sqrt(disc)) / 2;
    }
    options[count++] = static_cast<double>(b.r1 - b.r0);
    // The shape by its plain bytes (rows x q + keys x kv); then the exact bytes (keys the
    // receiver holds are free) of that one.
    Move shape;
    double shape_price = 0;
    int64_t tried[5];  // the cuts x already tried: options that round to one cut give one shape
    int num_tried = 0;
    for (int i = 0; i < count; ++i) {
      const auto a_want = static_cast<int64_t>(std::ceil(options[i]));
      int64_t x = std::max(b.r0, floor_g(b.r1 - std::max<int64_t>(a_want, 1)));
      if (x >= b.r1) x = b.r0;
      if (std::find(tried, tried + num_tried, x) != tried + num_tried) continue;
      tried[num_tried++] = x;
      const int64_t rows = b.r1 - x;
      const int64_t max_keys = x - b.c;
      if (rows <= 0 || max_keys <= 0) continue;
      const auto keys_want = static_cast<int64_t>(std::ceil(want_pairs / static_cast<double>(rows)));
      int64_t e = std::min(x, ceil_g(b.c + std::min(keys_want, max_keys)));
      // want_pairs is at the top rate; a profile whose short key ranges run slower makes the
      // block longer than wanted: one correction by the block's own rate.
      if (const double s = block_seconds(rows, e - b.c); s > want && s > overhead_ && want > overhead_) {
        const auto keys = static_cast<int64_t>(static_cast<double>(e - b.c) * (want - overhead_) / (s - overhead_));
        e = std::min(x, ceil_g(b.c + std::max<int64_t>(1, keys)));
      }
      e = fitting_keys_end(rows, b.c, e, room);
      if (memory_cap_ > 0) {  // the keys the receiver's memory room holds beside the rows (all of them new, at most)
        const int64_t free_keys = (memory_cap_ - memory_[dst] - rows * q_held_) / kv_held_;
        if (free_keys < e - b.c && !dst_holds) e = b.c + std::max<int64_t>(0, floor_g(free_keys));
      }
      if (e <= b.c) continue;
      const double shed = band_seconds(b) - causal_seconds(b.r0, x, b.c) - causal_seconds(x, b.r1, e);
      if (shed <= 0) continue;
      const double plain = static_cast<double>(rows) * q_ + static_cast<double>(e - b.c) * kv_;
      const double p = price(plain, shed, want);
      if (shape.band < 0 || p < shape_price) {
        const Move m{id, false, x, e, dst, block_seconds(rows, e - b.c), shed, plain, p};
        if (!fits_memory(m)) continue;
        shape = m;
        shape_price = p;
      }
    }
    if (shape.band < 0) return;
    shape.bytes = dst_holds ? move_bytes(b.doc, shape.x, b.r1, b.c, shape.e, dst) : shape.bytes;  // plain
    shape.score = price(shape.bytes, shape.shed, want);
    if (best.band < 0 || shape.score < best.score) best = shape;
  }

  // Rows [x, r1) of band `id` moved as one causal task (keys [c, q]): the tail of the band
  // whose seconds come closest to `want` from below, never above `room`. It is what a band too
  // narrow for a block (near the diagonal, or a short document) can still give.
  void consider_suffix(int32_t id, int32_t dst, double want, double room, bool dst_holds, Move& best) const {
    const Band& b = bands_[id];
    const double limit = std::min(want, room);
    // Largest tail within the limit: x from the aligned cuts in (r0, r1), by bisection.
    int64_t lo = floor_g(b.r0) + g_, hi = floor_g(b.r1 - 1);  // candidate cuts x, multiples of g
    if (lo > hi) return;
    if (causal_seconds(hi, b.r1, b.c) > limit) return;
    while (lo < hi) {  // smallest aligned x with seconds(x, r1) <= limit
      const int64_t mid = floor_g(lo + (hi - lo) / 2);
      const int64_t x = std::max(mid, lo);
      if (causal_seconds(x, b.r1, b.c) <= limit) hi = x; else lo = x + g_;
    }
    // That tail, and the next larger one if the room holds it: a tail just short of the want
    // leaves a sliver of excess that costs another move.
    for (const int64_t x : {hi, hi - g_}) {
      if (x <= b.r0 || x >= b.r1 || x < b.c) continue;
      const double seconds = causal_seconds(x, b.r1, b.c);
      if (seconds > room) continue;
      const double shed = band_seconds(b) - causal_seconds(b.r0, x, b.c);
      if (shed <= 0) continue;
      const double bytes =
          dst_holds ? move_bytes(b.doc, x, b.r1, b.c, b.r1, dst) : fresh_bytes(b.r1 - x, b.c == 0, b.r1 - b.c);
      const double score = price(bytes, shed, want);
      const Move m{id, false, x, -1, dst, seconds, shed, bytes, score};
      if ((best.band < 0 || score < best.score) && fits_memory(m)) best = m;
    }
  }

  void consider_whole(int32_t id, int32_t dst, double want, double room, bool dst_holds, Move& best) const {
    const Band& b = bands_[id];
    const double seconds = band_seconds(b);
    if (seconds > room || seconds <= 0) return;
    const double bytes =
        dst_holds ? move_bytes(b.doc, b.r0, b.r1, b.c, b.r1, dst) : fresh_bytes(b.r1 - b.r0, b.c == 0, b.r1 - b.c);
    const double score = price(bytes, seconds, want);
    const Move m{id, true, b.r0, b.r1, dst, seconds, seconds, bytes, score};
    if ((best.band < 0 || score < best.score) && fits_memory(m)) best = m;
  }

  // Keys [c, e) of band `id` added to the block that dst already computes for the same rows
  // (the block last cut off this band, to dst): the boundary between them moves, so dst takes
  // no new task, no query row again and no short key range of its own; a new block of the same
  // work costs dst a task's overhead, its rows' bytes again, and runs at the rate of its own,
  // shorter key range. The largest e, a multiple of g up to the wanted work, whose added seconds
  // fit the room.
  void consider_extension(int32_t id, int32_t dst, double want, double room, Move& best) const {
    const Band& b = bands_[id];
    const int32_t ext = extendable(b, dst);
    if (ext < 0) return;
    const Block& k = blocks_[ext];
    const int64_t rows = b.r1 - b.r0;
    const double before = block_seconds(rows, k.k1 - k.k0);
    auto gain = [&](int64_t e) { return block_seconds(rows, e - k.k0) - before; };
    const double want_pairs = std::max(1.0, want / seconds_per_pair_);
    int64_t lo = floor_g(b.c) + g_;  // the multiples of g in (c, r0]: a block ends at or before its first row
    int64_t hi = std::min(floor_g(b.r0), ceil_g(b.c + static_cast<int64_t>(std::ceil(want_pairs / static_cast<double>(rows)))));
    if (lo > hi || gain(lo) > room) return;
    while (lo < hi) {  // lo fits; the largest multiple in [lo, hi] that fits
      const int64_t mid = lo + (((hi - lo) / g_ + 1) / 2) * g_;
      if (gain(mid) <= room) lo = mid; else hi = mid - g_;
    }
    const double shed = band_seconds(b) - causal_seconds(b.r0, b.r1, lo);
    if (shed <= 0) return;
    double bytes = 0;
    for_each_missing_key(b.doc, b.c, lo, dst, [&](int32_t, int64_t n) { bytes += static_cast<double>(n) * kv_; });
    const double score = price(bytes, shed, want);
    const Move m{id, false, b.r0, lo, dst, gain(lo), shed, bytes, score, ext};
    if ((best.band < 0 || score < best.score) && fits_memory(m)) best = m;
  }

  // The block of dst's whose keys band b's continue for the same rows (b.ext, where it still
  // is one), else -1.
  int32_t extendable(const Band& b, int32_t dst) const {
    if (b.ext < 0) return -1;
    const Block& k = blocks_[b.ext];
    return k.server == dst && k.q0 == b.r0 && k.q1 == b.r1 && k.k1 == b.c && k.k0 < k.k1 ? b.ext : -1;
  }

  // Forward flows of a move (for_each_flow): an extension's rows are at dst already.
  template <typename Fn>
  void for_each_move_flow(const Move& m, Fn&& fn) const {
    const Band& b = bands_[m.band];
    const TokenBytes& tb = cost_.token_bytes();
    if (m.ext >= 0) {
      for_each_missing_key(b.doc, b.c, m.e, m.dst, [&](int32_t owner, int64_t rows) { fn(owner, m.dst, rows * tb.kv); });
    } else if (m.is_whole) {
      for_each_flow(b.doc, b.r0, b.r1, b.c, b.r1, m.dst, fn);
    } else if (m.e < 0) {
      for_each_flow(b.doc, m.x, b.r1, b.c, b.r1, m.dst, fn);
    } else {
      for_each_flow(b.doc, m.x, b.r1, b.c, m.e, m.dst, fn);
    }
  }

  bool fits_budget(const Move& m) const {
    if (budget_ == 0) return true;
    std::vector<std::pair<int32_t, int64_t>> sends, recvs;
    for_each_move_flow(m, [&](int32_t src, int32_t to, int64_t bytes) {
      sends.emplace_back(src, bytes);
      recvs.emplace_back(to, bytes);
    });
    return !exceeds_budget(sends, send_, budget_) && !exceeds_budget(recvs, recv_, budget_);
  }

  // The best move of s's bands to dst, or none.
  // `bands`: the sender's live bands, largest first. A band of w seconds can give no move
  // cheaper than 2 sqrt(Q K p) bytes (Q of a whole row, the cheaper) for the p pairs of min(w, want) (a rows x b keys hold at
  // most a * b pairs; p at the profile's slowest rate, the fewest pairs those seconds hold), so once that floor exceeds the best price found, no smaller band can win
  // and the search stops; unless dst holds keys or rows of the band's document (then they are
  // free and the floor does not hold).
  Move best_move_to(const std::vector<int32_t>& bands, int32_t dst, double target, double intake) const {
    Move here;
    const double room = cap_ - load_[dst];
    if (room <= 0) return here;
    // A server with no soft intake left (or none given: it was a sender) takes up to its room.
    const double want = std::min(target, intake > 0 ? std::min(intake, room) : room);
    const double per_move = static_cast<double>(g_) * (q_ + kv_);
    for (int32_t id : bands) {
      const Band& b = bands_[id];
      const double w = std::min(band_seconds(b), want);
      const bool dst_holds = holds_any(b.doc, dst);
      if (here.band >= 0 && !dst_holds) {
        const double pairs = std::max(0.0, (w - overhead_) / slowest_seconds_per_pair_);
        if ((per_move + 2 * std::sqrt(q_whole_ * kv_ * pairs)) / w >= here.score) break;
      }
      consider_block(id, dst, want, room, dst_holds, here);
      consider_suffix(id, dst, want, room, dst_holds, here);
      consider_whole(id, dst, want, std::min(room, std::max(want, intake)), dst_holds, here);
      consider_extension(id, dst, want, room, here);
    }
    if (here.band >= 0 && (!fits_budget(here) || !fits_memory(here))) here.band = -1;
    return here;
  }

  // Whether dst owns rows of `doc` or receives some of its keys already.
  bool holds_any(int32_t doc, int32_t dst) const {
    if (holds_keys(doc, dst)) return true;
    for (int32_t p : batch_.doc_pieces[doc]) {
      if (batch_.pieces[p].rank == dst) return true;
    }
    return false;
  }

  // Hosts (host_fill > 0). A receiver takes at most its room, so a sender whose excess is many
  // rooms' worth ships it in many small blocks, and bytes per pair fall only with a block's size
  // (they grow as the square root of its work): the sender's link is then the busiest. Instead,
  // such a sender's excess goes in a few blocks of up to host_fill x cap to hosts: receivers that
  // first hand their own work on to the other receivers (a second hop for the work, not for any
  // row: every row still goes from its owner to the server that computes with it), so the plan
  // moves more bytes in all (short documents handed on cost more per pair). Hosts are the
  // receivers whose own work, largest bands first, costs the fewest bytes to hand on, up to half
  // of the receivers. Returns who hosts whom, in the order to fill them; `excess` becomes what
  // the soft intakes must cover: the senders' excess not hosted and the hosts' work to hand on.
  struct Hosting {  // the host takes `block` seconds of the sender's work
    int32_t sender, host;
    double block;
  };
  std::vector<Hosting> reserve_hosts(const std::vector<int32_t>& senders, double& excess) {
    std::vector<Hosting> hosted;
    const double block = host_fill_ * cap_;
    if (!(block > 0)) return hosted;
    // The receivers by what handing on their own work costs until the block fits: their largest
    // bands first (a band of n rows moved whole costs n rows of Q and K/V, for about n^2 / 2
    // pairs, so long documents hand on cheaply).
    std::vector<int32_t> order;
    std::vector<double> hand_on(num_ranks_, 0.0);
    std::vector<int32_t> own;
    for (int32_t k = 0; k < num_ranks_; ++k) {
      if (load_[k] >= cap_) continue;
      order.push_back(k);
      double need = block - (cap_ - load_[k]);
      own.assign(server_bands_[k].begin(), server_bands_[k].end());
      std::sort(own.begin(), own.end(), [&](int32_t a, int32_t b) { return band_seconds(bands_[a]) > band_seconds(bands_[b]); });
      for (int32_t id : own) {
        if (need <= 0) break;
        const Band& b = bands_[id];
        const double share = std::min(1.0, need / band_seconds(b));
        hand_on[k] += share * static_cast<double>(b.r1 - b.r0) * (q_whole_ + kv_);
        need -= band_seconds(b);
      }
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return hand_on[a] < hand_on[b]; });
    // A sender's excess E goes in n = ceil(E / (fill x cap)) equal blocks, one to each of n
    // hosts: its link then carries about sqrt(n E) of pair-bytes, against about E / sqrt(level)
    // into rooms of the water level, so hosts pay where E / n is above the level. But the
    // receivers' rooms come out below the level (senders compete for them): hosting down to
    // 0.75 x the level, measured with distca bench planner --fresh 3 at eps 0.02 and 0.05 (32
    // plans), lowered the busiest step link on 3 and raised it on 3 (by at most 2.1 %), and the
    // worst over its bound from 1.418 to 1.298.
    // n rounds up, so an excess just above a multiple of the fill costs a whole block more (2.78
    // caps at fill 0.9: 4 blocks, sum of square roots 3.33, against 2.89 for 3): where blocks of
    // at most kHostFillMost x cap hold it in one fewer, that is n (distca bench planner --fresh 3,
    // eps 0.02 and 0.05: minlink's step link within 1.15x its bound on 29 of 32, was 22).
    // Hosts cost bytes, so unless host_every, a sender after the first is hosted only where its
    // link into rooms of half the water level (rooms come out well below it), sqrt(k E) for k such
    // blocks, would top 0.8 x the busiest hosted sender's sqrt(n E) (minlink re-plans if it missed).
    constexpr double kHostFillMost = 0.95;
    const double water = water_level(excess), level = 0.75 * water;
    double busiest_hosted = 0;
    size_t next = 0;
    for (int32_t s : senders) {
      const double left = load_[s] - cap_;
      const int n = std::min(static_cast<int>(std::ceil(left / block - 1e-9)),
                             static_cast<int>(std::ceil(left / (kHostFillMost * cap_) - 1e-9)));
      const double each = left / n;
      if (each < level || next + n > order.size() / 2) continue;
      if (!host_every_) {
        const double k = std::ceil(left / (0.5 * water) - 1e-9);
        if (busiest_hosted > 0 && std::sqrt(k * left) <= 0.8 * busiest_hosted) {
          passed_over_.push_back(s);
          continue;
        }
        busiest_hosted = std::max(busiest_hosted, std::sqrt(n * left));
      }
      for (int i = 0; i < n; ++i) {
        const int32_t h = order[next++];
        reserved_[h] = 1;
        hosted.push_back({s, h, each});
        excess += std::max(0.0, each - (cap_ - load_[h])) - each;
      }
    }
    return hosted;
  }

  // Host h hands on its own work until `block` seconds fit, then takes a block of s's work of
  // about that size (of s's bands, the cheapest per second, as any move).
  void host(int32_t s, int32_t h, double block) {
    block = std::min(block, load_[s] - cap_);
    if (block <= 0) return;
    hand_on(h, std::max(0.0, cap_ - block));
    std::vector<int32_t> live;
    for (int32_t id : server_bands_[s]) {
      if (bands_[id].server == s && bands_[id].r0 < bands_[id].r1) live.push_back(id);
    }
    std::stable_sort(live.begin(), live.end(),
                     [&](int32_t a, int32_t b) { return band_seconds(bands_[a]) > band_seconds(bands_[b]); });
    const Move m = best_move_to(live, h, block, cap_ - load_[h]);
    if (m.band >= 0) apply(m);
  }

  // Host h's own work, handed on until its load is at most `limit`: whole bands, largest first
  // (they cost the fewest bytes per pair), each to the receiver with the most soft intake left
  // whose room holds it (a band whole costs its rows wherever it goes: no search); what no
  // receiver holds whole goes as shed() cuts it.
  void hand_on(int32_t h, double limit) {
    std::vector<int32_t> own;
    for (int32_t id : server_bands_[h]) {
      if (bands_[id].server == h && bands_[id].r0 < bands_[id].r1) own.push_back(id);
    }
    std::stable_sort(own.begin(), own.end(),
                     [&](int32_t a, int32_t b) { return band_seconds(bands_[a]) > band_seconds(bands_[b]); });
    for (int32_t id : own) {
      if (load_[h] <= limit) return;
      const Band& b = bands_[id];
      const double seconds = band_seconds(b);
      int32_t dst = -1;
      int looked = 0;
      for (auto it = receivers_.begin(); it != receivers_.end() && looked < 8; ++it, ++looked) {
        if (it->second != h && cap_ - load_[it->second] >= seconds) {
          dst = it->second;
          break;
        }
      }
      if (dst < 0) continue;
      apply(Move{id, true, b.r0, b.r1, dst, seconds, seconds, move_bytes(b.doc, b.r0, b.r1, b.c, b.r1, dst), 0});
    }
    if (load_[h] > limit) shed(h, limit);
  }

  // 4. Moves blocks off server s until it is at or below `limit` (the cap; lower for a host
  // handing its work on). Candidates: as above, plus the servers that already receive keys of
  // s's documents (more rows against keys they hold cost only the rows) and, when none of those
  // can take a block, the servers with the most room.
  void shed(int32_t s, double limit) {
    std::vector<int32_t> candidates, live;
    // The excess goes in k equal blocks, k as few as the largest intake allows: a sender's last
    // block is then no remainder that shares a receiver with another sender's remainder (a
    // receiver of two blocks receives more than of one block of the same work).
    int moves_left = 1;
    if (!receivers_.empty() && -receivers_.begin()->first > 0) {
      moves_left = static_cast<int>(std::ceil((load_[s] - limit) / -receivers_.begin()->first - 1e-9));
    }
    while (load_[s] > limit) {
      const double excess = load_[s] - limit;
      const double target = excess / std::max(1, moves_left);
      candidates.clear();
      // A receiver pays for each block it takes (bytes grow as the square root of a block's
      // work), so blocks go to receivers that have none yet, the one with the least intake that
      // still holds the target (the roomier ones stay for larger blocks); failing that, of the
      // receivers that hold the target, the one that receives the fewest bytes so far; and the
      // receivers with the most intake left.
      auto fit = fresh_.lower_bound({target, -1});
      for (int n = 0; n < 2 && fit != fresh_.end(); ++n, ++fit) {
        if (fit->second != s) candidates.push_back(fit->second);
      }
      if (candidates.empty()) {
        int32_t least = -1;
        for (const auto& [neg_intake, k] : receivers_) {
          if (-neg_intake < target) break;
          if (k != s && (least < 0 || received_[k] < received_[least])) least = k;
        }
        if (least >= 0) candidates.push_back(least);
      }
      for (auto it = receivers_.begin(); it != receivers_.end() && candidates.size() < 2; ++it) {
        if (it->second != s) candidates.push_back(it->second);
      }
      // The latest few servers to receive keys of s's documents.
      const size_t first_held = candidates.size();
      for (auto id = server_bands_[s].rbegin(); id != server_bands_[s].rend(); ++id) {
        const Band& b = bands_[*id];
        if (b.server != s || b.r0 >= b.r1) continue;
        for (auto h = held_[b.doc].rbegin(); h != held_[b.doc].rend() && candidates.size() < first_held + 3; ++h) {
          if (h->server != s && intake_[h->server] > 0 && cap_ - load_[h->server] > 0) candidates.push_back(h->server);
        }
        if (candidates.size() >= first_held + 3) break;
      }
      std::sort(candidates.begin(), candidates.end());
      candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
      live.clear();
      for (int32_t id : server_bands_[s]) {
        if (bands_[id].server == s && bands_[id].r0 < bands_[id].r1) live.push_back(id);
      }
      std::stable_sort(live.begin(), live.end(),
                       [&](int32_t a, int32_t b) { return band_seconds(bands_[a]) > band_seconds(bands_[b]); });
      Move best;
      for (int32_t dst : candidates) {
        if (dst == s) continue;
        const Move m = best_move_to(live, dst, target, intake_[dst]);
        if (m.band >= 0 && (best.band < 0 || better(m, best, excess))) best = m;
      }
      if (best.band < 0) {  // by room: the roomiest servers, however much intake they had
        std::vector<int32_t> order;
        for (int32_t k = 0; k < num_ranks_; ++k) {
          if (!reserved_[k]) order.push_back(k);
        }
        const size_t top = std::min<size_t>(8, order.size());
        std::partial_sort(order.begin(), order.begin() + top, order.end(),
                          [&](int32_t a, int32_t b) { return load_[a] < load_[b]; });
        for (size_t i = 0; i < top; ++i) {
          if (order[i] == s) continue;
          const Move m = best_move_to(live, order[i], excess, cap_ - load_[order[i]]);
          if (m.band >= 0 && (best.band < 0 || better(m, best, excess))) best = m;
        }
      }
      if (best.band < 0) {
        if (limit == cap_) stuck_.push_back(s);
        return;
      }
      --moves_left;
      const double before = load_[s];
      apply(best);
      DISTCA_CHECK(load_[s] < before) << "minbytes: a move did not lower server " << s << "'s load";
    }
  }

  // Bytes per second of the wanted work a move clears: work beyond `want` earns nothing (it
  // would overfill the receiver or overshoot the excess), and each move costs one tile of rows
  // and keys more than its bytes (a message, a task), else slivers whose keys the receiver
  // already holds look free and the excess goes in countless tiny moves.
  double price(double bytes, double shed, double want) const {
    return (bytes + static_cast<double>(g_) * (q_ + kv_)) / std::min(shed, want);
  }
  // Of two moves to different receivers, the one that clears more of the excess per byte.
  bool better(const Move& a, const Move& b, double excess) const {
    return price(a.bytes, a.shed, excess) < price(b.bytes, b.shed, excess);
  }

  void apply(const Move& m) {
    Band& b = bands_[m.band];
    const int32_t src = b.server;
    // Work of the rows of dst's block that the band's keys continue joins that block: never two
    // tasks of one server for the same rows over abutting key ranges.
    const int32_t ext = m.is_whole || (m.e >= 0 && m.x == b.r0) ? extendable(b, m.dst) : -1;
    if (budget_ > 0) {
      Move counted = m;
      counted.ext = m.is_whole ? -1 : ext;  // a whole band's rows travel again: counted whole
      for_each_move_flow(counted, [&](int32_t from, int32_t to, int64_t bytes) {
        send_[from] += bytes;
        recv_[to] += bytes;
      });
    }
    load_[src] -= band_seconds(b);
    if (ext >= 0 && !m.is_whole) {  // the band's first keys join dst's block
      Block& k = blocks_[ext];
      const int64_t rows = b.r1 - b.r0;
      memory_[m.dst] += unheld_keys(b.doc, k.k1, m.e, m.dst) * kv_held_;
      load_[m.dst] += block_seconds(rows, m.e - k.k0) - block_seconds(rows, k.k1 - k.k0);
      hold(b.doc, m.dst, k.k1, m.e);
      k.k1 = m.e;
      b.c = m.e;
      set_seconds(b);
      load_[src] += band_seconds(b);
    } else if (m.is_whole) {
      Band moved{b.doc, b.r0, b.r1, b.c, m.dst};
      moved.ext = b.ext;  // the same rows and keys: a block its keys continue still does
      if (ext >= 0) {  // the band and dst's block become one causal task from the block's first key
        Block& k = blocks_[ext];
        load_[m.dst] -= block_seconds(k.q1 - k.q0, k.k1 - k.k0);
        moved.c = k.k0;
        moved.ext = -1;
        k.k1 = k.k0;  // empty: no task
      }
      memory_[src] -= (b.r1 - b.r0) * q_held_;
      b.r1 = b.r0;  // dead
      set_seconds(b);
      add_band(moved);
    } else if (m.e < 0) {
      const Band moved{b.doc, m.x, b.r1, b.c, m.dst};
      memory_[src] -= (b.r1 - m.x) * q_held_;
      b.r1 = m.x;
      set_seconds(b);
      load_[src] += band_seconds(b);
      add_band(moved);
    } else {
      Band upper{b.doc, m.x, b.r1, m.e, src};
      set_seconds(upper);
      upper.ext = static_cast<int32_t>(blocks_.size());
      blocks_.push_back(Block{b.doc, m.x, b.r1, b.c, m.e, m.dst});
      load_[m.dst] += block_seconds(b.r1 - m.x, m.e - b.c);
      memory_[m.dst] += (b.r1 - m.x) * q_held_ + unheld_keys(b.doc, b.c, m.e, m.dst) * kv_held_;
      hold(b.doc, m.dst, b.c, m.e);
      b.r1 = m.x;
      set_seconds(b);
      load_[src] += band_seconds(b);
      if (upper.r0 < upper.r1) {
        server_bands_[src].push_back(static_cast<int32_t>(bands_.size()));
        bands_.push_back(upper);
        load_[src] += band_seconds(upper);
      }
    }
    const int32_t dst = m.dst;
    fresh_.erase({intake_[dst], dst});
    received_[dst] += m.bytes;
    receivers_.erase({-intake_[dst], dst});
    intake_[dst] = std::max(0.0, intake_[dst] - m.seconds);
    const double room = cap_ - load_[dst];
    if (intake_[dst] > 0 && room > 0) receivers_.insert({-intake_[dst], dst});
    if (receivers_.empty()) refill_receivers();
  }

  // When every soft intake is spent, a new water level over the rooms left covers the excess
  // left (the first level's blocks came out larger than their targets, or geometry left gaps).
  void refill_receivers() {
    double excess = 0;
    for (int32_t k = 0; k < num_ranks_; ++k) excess += std::max(0.0, load_[k] - cap_);
    set_intakes(excess);
  }

  // The level t with sum over the receivers (not hosts) of min(room, t) = 1.05 x excess, or the
  // largest room if they fall short.
  double water_level(double excess) const {
    double lo = 0, hi = 0;
    for (int32_t k = 0; k < num_ranks_; ++k) {
      if (!reserved_[k]) hi = std::max(hi, cap_ - load_[k]);
    }
    for (int it = 0; it < 60 && hi > 0; ++it) {
      const double t = (lo + hi) / 2;
      double sum = 0;
      for (int32_t k = 0; k < num_ranks_; ++k) {
        if (!reserved_[k]) sum += std::clamp(cap_ - load_[k], 0.0, t);
      }
      if (sum >= 1.05 * excess) hi = t; else lo = t;
    }
    return hi;
  }

  // intake = min(room, t) at the water level t (hosts take none).
  void set_intakes(double excess) {
    double top = 0;
    for (int32_t k = 0; k < num_ranks_; ++k) {
      if (!reserved_[k]) top = std::max(top, cap_ - load_[k]);
    }
    const double level = water_level(excess);
    const double hi = intake_scale_ > 1e300 ? top : std::min(top, level * intake_scale_);  // a higher level: fewer receivers, larger blocks
    receivers_.clear();
    fresh_.clear();
    intake_.assign(num_ranks_, 0.0);
    received_.resize(num_ranks_, 0.0);
    for (int32_t k = 0; k < num_ranks_; ++k) {
      if (reserved_[k]) continue;
      intake_[k] = std::clamp(cap_ - load_[k], 0.0, hi);
      if (intake_[k] <= 0) continue;
      receivers_.insert({-intake_[k], k});
      if (received_[k] == 0) fresh_.insert({intake_[k], k});
    }
  }

  void start_budget() {
    std::vector<Task> tasks;
    for (const Band& b : bands_) tasks.push_back(Task{b.doc, b.r0, b.r1, b.c, b.r1, b.server});
    forward_rank_bytes(batch_, cost_.token_bytes(), tasks, send_, recv_);
    for (int32_t k = 0; k < num_ranks_; ++k) {
      if (send_[k] > budget_ || recv_[k] > budget_) is_budget_feasible_ = false;
    }
  }

  const Batch& batch_;
  const CostModel& cost_;
  const PlannerOptions& options_;
  const int64_t budget_;
  const int64_t memory_cap_;  // per server (0: none)
  const double mean_;
  const double intake_scale_;  // the soft intake's level over the water level (1: spread the most)
  const double host_fill_;     // hosts' block, a share of the cap (0: no hosts)
  const bool host_every_;      // MinbytesShape::host_every
  const int64_t g_;
  const int g_shift_;  // log2(g) where g is a power of two, else -1
  const int32_t num_ranks_;
  double q_ = 0, q_whole_ = 0, kv_ = 0;  // bytes per query row (split, whole) and key row moved, all phases
  double seconds_per_pair_ = 0, slowest_seconds_per_pair_ = 0, overhead_ = 0;
  int64_t tile_rows_ = 0;
  int64_t q_held_ = 0, kv_held_ = 0;  // memory of a query row and a key row held (Plan::server_bytes)
  double cap_ = 0;
  std::vector<Band> bands_;
  std::vector<Block> blocks_;
  std::vector<double> load_;                       // (R) seconds
  std::vector<int64_t> memory_;                    // (R) bytes held, an upper bound of server_bytes
  ScratchLease<KeptLists> lease_;                  // the arena's buffer, bands_ and blocks_
  std::pmr::monotonic_buffer_resource arena_{lease_.buffer(), lease_.buffer_size(),
                                             &lease_};  // the lists below; declared before them
  std::pmr::vector<std::pmr::vector<int32_t>> server_bands_{&arena_}; // (R) band ids, moved ones included
  struct Held {
    int32_t server;
    int64_t lo, hi;
  };
  std::pmr::vector<std::pmr::vector<Held>> held_{&arena_};  // (docs)
  mutable std::vector<std::pair<int64_t, int64_t>> have_;  // for_each_missing_key's scratch
  std::pmr::vector<std::pmr::vector<Held>> held_by_server_{&arena_};  // (docs) held_[doc] sorted by server (stable)
  std::vector<char> reserved_;                     // (R) hosts, while they are filled
  std::vector<double> intake_;                     // (R) soft intake left
  std::set<std::pair<double, int32_t>> receivers_; // (-intake, server)
  std::set<std::pair<double, int32_t>> fresh_;     // (intake, server) of receivers without a block
  std::vector<double> received_;                   // (R) bytes of the moves each took so far
  std::vector<int64_t> send_, recv_;               // (R) forward dispatch + return bytes so far
  bool is_budget_feasible_ = true;
  std::vector<int32_t> stuck_;  // servers left above the cap with no receiver for their work
  std::vector<int32_t> passed_over_;  // senders with hosts' worth of excess not hosted (reserve_hosts)
};

bool keeps_budget(const Plan& plan, int64_t budget) {
  return plan.is_balanced && plan.traffic.forward.max_send_bytes <= budget && plan.traffic.forward.max_recv_bytes <= budget;
}

// A plan at the cap (1 + eps) x mean. The mean is first every document as one task's, a floor:
// cuts add tasks (each with its overhead) and shorter key ranges, which run slower, so at a small
// eps the cap can lie below the mean the plan ends with, and no plan meets it (receivers fill to
// the cap and the last senders find no room). Then it plans again at the last plan's own mean,
// up to kCapRetries times while none is balanced, and keeps the most balanced. Measured on one
// 131072-token document over 8 servers: on the simulator's H200 profile (Llama-34B) at eps
// 0.0004, 1.011x the mean with the first plan alone, 1.00015x with the second; on the profile of
// PlanMinbytes.MeetsASmallEpsWhereCutsRaiseTheMeanAboveTheCap, 1.10x alone.
Plan plan_at_cap(const Batch& batch, const CostModel& cost, const PlannerOptions& options, int64_t budget,
                 const MinbytesShape& shape = {}, std::vector<int32_t>* passed_over = nullptr) {
  constexpr int kCapRetries = 3;
  Plan plan;
  double mean = 0;  // the latest plan's (0 at first: every document as one task's)
  // Under a memory cap a plan that misses the bound is one whose receivers are full: planning
  // again at its mean does not help, and the cap's search (memory_cap.h) pays for every plan.
  const int retries = options.max_server_bytes > 0 ? 0 : kCapRetries;
  for (int round = 0; round == 0 || (round <= retries && !plan.is_balanced); ++round) {
    MinbytesPlanner planner(batch, cost, options, budget, shape, mean);
    Plan next = planner.run();
    mean = next.load.mean;
    if (round == 0 || next.load.imbalance < plan.load.imbalance) {
      plan = std::move(next);
      if (passed_over != nullptr) *passed_over = planner.passed_over();
    }
  }
  return plan;
}

}  // namespace

Result<Plan> plan_minbytes_shaped(const Batch& batch, const CostModel& cost, const PlannerOptions& options,
                                  const MinbytesShape& shape, std::vector<int32_t>* passed_over) {
  DISTCA_RETURN_IF_ERROR(options.validate());
  return plan_at_cap(batch, cost, options, options.max_rank_bytes, shape, passed_over);
}

namespace {

Result<Plan> plan_minbytes_capped(const Batch& batch, const CostModel& cost, const PlannerOptions& options) {
  const int64_t budget = options.max_rank_bytes;
  Plan plan = plan_at_cap(batch, cost, options, budget);
  if (budget == 0 || keeps_budget(plan, budget)) return plan;
  // The smallest budget this planner keeps (balanced and within it): a kept budget from the
  // unbudgeted plan's own largest send or receive up, then bisection down to the asked one.
  const Plan free = MinbytesPlanner(batch, cost, options, 0).run();
  if (!free.is_balanced) {
    plan.note += fmt::format("; --max-rank-bytes {} not kept (minbytes does not balance this batch even without one)", budget);
    return plan;
  }
  int64_t hi = std::max({free.traffic.forward.max_send_bytes, free.traffic.forward.max_recv_bytes, budget + 1});
  for (int tries = 0; !keeps_budget(MinbytesPlanner(batch, cost, options, hi).run(), hi); ++tries) {
    if (tries == 30) {
      plan.note += fmt::format("; --max-rank-bytes {} not kept, nor any budget up to {} bytes", budget, hi);
      return plan;
    }
    hi += hi / 4 + 1;
  }
  int64_t lo = budget;
  while (hi - lo > std::max<int64_t>(1, hi / 1000)) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keeps_budget(MinbytesPlanner(batch, cost, options, mid).run(), mid)) hi = mid; else lo = mid;
  }
  plan.smallest_kept_budget = hi;
  plan.note += fmt::format("; --max-rank-bytes {} not kept: the smallest budget minbytes keeps on this batch is {} "
                           "bytes ({:.3f} GiB, within 0.1 %)", budget, hi, static_cast<double>(hi) / (1 << 30));
  return plan;
}

}  // namespace

Result<Plan> plan_minbytes(const Batch& batch, const CostModel& cost, const PlannerOptions& options) {
  return plan_within_memory(batch, cost, options, [&](const PlannerOptions& o) { return plan_minbytes_capped(batch, cost, o); });
}


}  // namespace distca::plan
