// The plan (docs/design.md §5): every CA task with its server, the per-server load, the bytes each
// communication phase moves, and a hash. Plain data; finalize_plan() fills everything but the
// tasks, with the one byte counter the runtime also uses.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "distca/plan/batch.h"
#include "distca/plan/cost.h"

namespace distca::plan {

// Attention of query rows [q0, q1) of document `doc` against keys [k0, k1), run on `server`.
// Causal when k1 == q1: query row q sees keys [k0, q] (bottom-right aligned). Otherwise the
// key range lies wholly before the queries (k1 <= q0 + 1) and every row sees all of it.
struct Task {
  int32_t doc = 0;
  int64_t q0 = 0;
  int64_t q1 = 0;
  int64_t k0 = 0;
  int64_t k1 = 0;
  int32_t server = 0;

  bool is_causal() const { return k1 == q1; }
  int64_t q_len() const { return q1 - q0; }
  // (query, key) pairs the task computes.
  int64_t pairs() const;
  bool operator==(const Task&) const = default;
};

// Causal task over query rows [q0, q1) with its whole key prefix [0, q1).
inline Task causal_task(int32_t doc, int64_t q0, int64_t q1, int32_t server) {
  return Task{doc, q0, q1, 0, q1, server};
}

enum class Phase { kFwdDispatch = 0, kFwdReturn = 1, kBwdDispatch = 2, kBwdReturn = 3 };
inline constexpr int kNumPhases = 4;
const char* phase_name(Phase phase);

struct Flow {
  int32_t src = 0;
  int32_t dst = 0;
  int64_t bytes = 0;
};

// One phase's traffic: the bytes each rank sends and receives. Its flows (src, dst, bytes) are
// not kept here: where documents span many ranks they number up to R^2 (a server needs K/V from
// every rank its document spans), far more than the tasks and ranks a plan holds, so
// count_flows gives them to the few callers that need them (plan files, distca.Plan.traffic).
struct PhaseTraffic {
  int64_t total_bytes = 0;
  std::vector<int64_t> send_bytes;  // (R)
  std::vector<int64_t> recv_bytes;  // (R)
};

// Forward dispatch + return of one layer.
struct CommSummary {
  int64_t q_bytes = 0;
  int64_t kv_bytes = 0;
  int64_t out_bytes = 0;
  int64_t total_bytes = 0;
  int64_t max_send_bytes = 0;
  int64_t max_recv_bytes = 0;
};

// The busiest link of each phase: the most bytes any rank sends or receives in it (an
// all-to-all lasts as long as that rank's transfer).
struct LinkSummary {
  std::array<int64_t, kNumPhases> busiest{};  // per phase
  int64_t fwd_dispatch = 0;                   // busiest[kFwdDispatch]
  int64_t step = 0;                           // the sum over the phases: a step's exchanges, one after the other
};

struct Traffic {
  std::array<PhaseTraffic, kNumPhases> phases;  // of the backward mode counted
  CommSummary forward;
  // Each backward mode's busiest links and bytes over the four phases, indexed by BackwardMode:
  // the modes differ in the backward dispatch alone, so count_traffic counts both in one pass
  // (what minlink and --tolerance auto compare plans by, without counting them again).
  std::array<LinkSummary, 2> links{};
  std::array<int64_t, 2> all_phases_bytes{};
};

// What the backward sends to the servers. Stateless (the paper's): the server keeps nothing
// between forward and backward, so Q, O, dO, LSE and K/V are sent again. Stateful: the server
// keeps the forward's received Q/K/V and its O/LSE, so only dO is sent, plus the merged O and LSE
// for the rows of tasks that split the key range (the server holds only its partial ones).
enum class BackwardMode { kStateless = 0, kStateful = 1 };
const char* backward_mode_name(BackwardMode mode);

// The bytes of one layer that a task list moves, phase by phase. Q rows go from their owners
// to the task's server and O/LSE back, once per task (a query row in several tasks of a
// key-range split travels once for each); KV rows go once per (document, server): the union of
// the key ranges of that server's tasks of the document, less the rows the server owns.
// Stateful backward dispatch: dO per task row, plus O and LSE (bytes.out) for the rows of a
// split task (k0 > 0 or non-causal), since the server's own O/LSE of those rows are partial.
// The runtime sends exactly these bytes.
// Memory: O(R + tasks), whatever the number of flows.
Traffic count_traffic(const Batch& batch, const TokenBytes& bytes, const std::vector<Task>& tasks,
                      BackwardMode mode = BackwardMode::kStateless);

// The flows of one phase of the same count: sorted by (src, dst), no zero and no self flows; the
// flows' bytes sum to count_traffic's per-rank bytes. Memory: O(the phase's flows + R + tasks).
std::vector<Flow> count_flows(const Batch& batch, const TokenBytes& bytes, const std::vector<Task>& tasks, Phase phase,
                              BackwardMode mode = BackwardMode::kStateless);

LinkSummary busiest_links(const Traffic& traffic);  // of the mode counted: traffic.links[mode]
// The same from the tasks directly, the busiest links alone (what a planner comparing plans
// needs); total_bytes, if given, gets the bytes of all four phases.
LinkSummary busiest_links(const Batch& batch, const TokenBytes& bytes, const std::vector<Task>& tasks,
                          BackwardMode mode, int64_t* total_bytes = nullptr);

struct LoadSummary {
  double max = 0;
  double mean = 0;
  double imbalance = 0;        // max / mean of estimated seconds
  double pairs_imbalance = 0;  // max / mean of causal pairs (the paper's measure)
};

struct Plan {
  std::string policy;
  double tolerance = 0;
  std::vector<Task> tasks;           // sorted by (server, doc, q0, k0)
  std::vector<double> server_seconds;  // (R) estimated CA seconds per step
  std::vector<int64_t> server_pairs;   // (R)
  // (R) What one layer's attention rows take on each server (server_bytes below): the memory a
  // stateful server keeps per layer until that layer's backward.
  std::vector<int64_t> server_bytes;
  LoadSummary load;
  Traffic traffic;
  uint64_t hash = 0;
  // Whether max load <= (1 + tolerance) * mean holds, and why not when it does not.
  bool is_balanced = false;
  // minmax: true when the bound is guaranteed by construction (the largest shard fits in the
  // slack), not merely met.
  bool is_guaranteed = false;
  // False when a per-rank byte budget was asked for and cannot be kept.
  bool is_within_budget = true;
  // minbytes, when the asked budget is not kept: the smallest budget (bytes) with which it
  // balances and keeps it (to 0.1 %); 0 when not searched.
  int64_t smallest_kept_budget = 0;
  // The per-server memory cap the planner kept (PlannerOptions::max_server_bytes, resolved; 0:
  // none), and whether every server_bytes is within it.
  int64_t memory_cap = 0;
  bool is_within_memory = true;
  std::string note;
};

// Each server's bytes of one layer's attention rows under a task list: Q, O and LSE (bytes.q +
// bytes.out) for every query row of its tasks (a row in two tasks, twice: the runtime gives each
// task its own rows) and K and V (bytes.kv) for every key row of the union of its tasks' key
// ranges per document. Rows a server owns count like any other: the runtime copies them into
// its server buffers (runtime::buffer_bytes, whose forward set this is at 4-byte elements).
std::vector<int64_t> server_bytes(const TokenBytes& bytes, const std::vector<Task>& tasks, int32_t num_ranks);

// Per-server seconds and pairs of a task list under `cost`.
LoadSummary summarize_load(const std::vector<double>& seconds, const std::vector<int64_t>& pairs);

// Sorts the tasks canonically and fills loads, traffic, hash and is_balanced.
Plan finalize_plan(std::string policy, double tolerance, const Batch& batch, const CostModel& cost,
                   std::vector<Task> tasks);

// A 64-bit hash of the batch layout and the sorted task list.
uint64_t plan_hash(const Batch& batch, const std::vector<Task>& tasks);

}  // namespace distca::plan
