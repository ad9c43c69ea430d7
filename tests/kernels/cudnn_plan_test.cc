// CudnnAttention's host side (src/kernels/cudnn/cudnn_plan.h), in every build: shape buckets, graph
// keys (a training run's plans build a bounded number of graphs), task grouping into calls, the
// dK/dV scratch layout and its sums, and the refusals; plus what create() says without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <unordered_set>

#include "../../src/kernels/cudnn/cudnn_plan.h"
#include "distca/kernels/cuda.h"
#include "distca/kernels/cudnn.h"

namespace distca::kernels::cudnn {
namespace {

const AttnDims kDims{0, 0, 8, 2, 128};

AttnDims dims_for(const std::vector<AttnTask>& tasks, int64_t extra_q = 0, int64_t extra_kv = 0) {
  AttnDims d = kDims;
  for (const AttnTask& t : tasks) {
    d.num_q_rows = std::max(d.num_q_rows, t.q_offset + t.q_len);
    d.num_kv_rows = std::max(d.num_kv_rows, t.kv_offset + t.kv_len);
  }
  d.num_q_rows += extra_q;
  d.num_kv_rows += extra_kv;
  return d;
}

// A server's list: each document cut into causal shards over its shared prefix, then non-causal
// key-range pieces (one with no key) over random K/V rows. With `scatter`, the shards' query rows
// lie in random order (so consecutive shards are not adjacent and do not merge).
std::vector<AttnTask> server_tasks(std::mt19937_64& rng, const std::vector<int64_t>& docs, int64_t max_shard,
                                   bool scatter = true) {
  std::vector<AttnTask> tasks;
  int64_t q = 0, kv = 0;
  for (int64_t len : docs) {
    for (int64_t a = 0; a < len;) {
      const int64_t b = std::min(len, a + std::uniform_int_distribution<int64_t>(1, max_shard)(rng));
      tasks.push_back({q, b - a, kv, b, true});
      q += b - a;
      a = b;
    }
    kv += len;
  }
  if (scatter) {
    std::shuffle(tasks.begin(), tasks.end(), rng);
    int64_t at = 0;
    for (AttnTask& t : tasks) {
      t.q_offset = at;
      at += t.q_len;
    }
  }
  for (int c = 0; c < 3; ++c) {
    const int64_t q_len = std::uniform_int_distribution<int64_t>(1, 70)(rng);
    const int64_t kv_len = c == 0 ? 0 : std::uniform_int_distribution<int64_t>(1, kv)(rng);
    tasks.push_back({q, q_len, std::uniform_int_distribution<int64_t>(0, kv - kv_len)(rng), kv_len, false});
    q += q_len;
  }
  std::shuffle(tasks.begin(), tasks.end(), rng);
  return tasks;
}

TEST(CudnnPlan, BucketsArePowersOfTwoAboveAFloor) {
  EXPECT_EQ(bucket(1), 1);
  EXPECT_EQ(bucket(5), 8);
  EXPECT_EQ(bucket(8), 8);
  EXPECT_EQ(bucket(1, 64), 64);
  EXPECT_EQ(bucket(64, 64), 64);
  EXPECT_EQ(bucket(65, 64), 128);
  EXPECT_EQ(bucket(32769, 64), 65536);
}

TEST(CudnnPlan, EachTaskIsOneSlotOfItsMaskKindsCall) {
  std::mt19937_64 rng(3);
  const std::vector<AttnTask> tasks = server_tasks(rng, {97, 1, 131, 5, 1023}, 61);
  const AttnDims d = dims_for(tasks, 3, 2);
  auto plan = plan_calls(d, tasks, {.backward = false, .bf16 = true, .scale = 0.125f});
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  ASSERT_EQ(plan.value().calls.size(), 2u);
  std::set<int> seen;
  for (const Call& call : plan.value().calls) {
    const GraphKey& k = call.key;
    EXPECT_FALSE(k.backward);
    EXPECT_LE(call.slots.size(), call.tasks.size()) << "a slot computes one task or a merged run of them";
    EXPECT_GE(k.batch, static_cast<int64_t>(call.slots.size()));
    EXPECT_EQ(k.batch, bucket(static_cast<int64_t>(call.slots.size())));
    ASSERT_EQ(call.seq_q.size(), static_cast<size_t>(k.batch));
    ASSERT_EQ(call.q_off.size(), static_cast<size_t>(k.batch + 1));
    ASSERT_EQ(call.kv_off.size(), static_cast<size_t>(k.batch + 1));
    ASSERT_EQ(call.stats_off.size(), static_cast<size_t>(k.batch + 1));
    EXPECT_TRUE(call.dkv_off.empty());
    int64_t max_q = 0, max_kv = 0;
    for (int i : call.tasks) EXPECT_TRUE(seen.insert(i).second) << "task " << i << " in two calls";
    for (size_t slot = 0; slot < call.slots.size(); ++slot) {
      const AttnTask& t = call.slots[slot];
      EXPECT_EQ(t.is_causal, k.causal);
      EXPECT_GT(t.kv_len, 0) << "a task with no key is filled, not computed";
      EXPECT_EQ(call.seq_q[slot], t.q_len);
      EXPECT_EQ(call.seq_kv[slot], t.kv_len);
      EXPECT_EQ(call.q_off[slot], t.q_offset * d.num_q_heads * d.head_dim);
      EXPECT_EQ(call.stats_off[slot], t.q_offset * d.num_q_heads);
      EXPECT_EQ(call.kv_off[slot], t.kv_offset * d.num_kv_heads * d.head_dim);
      if (slot > 0) {
        EXPECT_GT(call.q_off[slot], call.q_off[slot - 1]) << "slots in query order";
      }
      max_q = std::max(max_q, t.q_len);
      max_kv = std::max(max_kv, t.kv_len);
    }
    EXPECT_EQ(k.s_q, bucket(max_q, 64));
    EXPECT_EQ(k.s_kv, bucket(max_kv, 64));
    for (size_t slot = call.slots.size(); slot < static_cast<size_t>(k.batch); ++slot) {
      EXPECT_EQ(call.seq_q[slot], 0);
      EXPECT_EQ(call.seq_kv[slot], 0);
    }
    for (size_t slot = call.slots.size(); slot < static_cast<size_t>(k.batch + 1); ++slot) {
      EXPECT_GE(call.q_off[slot], call.q_off[slot - 1]);
      EXPECT_LE(call.q_off[slot], d.num_q_rows * d.num_q_heads * d.head_dim);
    }
  }
  // Every task with work is in one call; the others' rows and the uncovered rows are filled.
  std::vector<bool> covered(d.num_q_rows, false);
  for (int i : seen) {
    for (int64_t r = 0; r < tasks[i].q_len; ++r) covered[tasks[i].q_offset + r] = true;
  }
  for (const auto& [begin, end] : plan.value().empty_q_rows) {
    for (int64_t r = begin; r < end; ++r) {
      EXPECT_FALSE(covered[r]) << "row " << r << " is both computed and filled";
      covered[r] = true;
    }
  }
  EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](bool c) { return c; })) << "a Q row nobody writes";
  int with_work = 0;
  for (const AttnTask& t : tasks) with_work += t.q_len > 0 && t.kv_len > 0;
  EXPECT_EQ(static_cast<int>(seen.size()), with_work);
}

TEST(CudnnPlan, ExactBatchHasNoEmptySlots) {
  std::mt19937_64 rng(4);
  const std::vector<AttnTask> tasks = server_tasks(rng, {300, 77}, 50);
  auto plan = plan_calls(dims_for(tasks), tasks, {.variants = {.exact_batch = true}});
  ASSERT_TRUE(plan.is_ok());
  for (const Call& call : plan.value().calls) EXPECT_EQ(call.key.batch, static_cast<int64_t>(call.slots.size()));
}

TEST(CudnnPlan, GraphVariantsParseAndTopLeftOnlyWhereEverySequenceIsSquare) {
  auto none = parse_graph_variants("");
  ASSERT_TRUE(none.is_ok());
  EXPECT_FALSE(none.value().exact_batch || none.value().top_left || !none.value().max_total);
  auto all = parse_graph_variants("top-left,no-max-total,exact-batch");
  ASSERT_TRUE(all.is_ok());
  EXPECT_TRUE(all.value().exact_batch && all.value().top_left && !all.value().max_total);
  auto bad = parse_graph_variants("top-left,fast");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("no graph variant 'fast' (known: exact-batch, top-left, no-max-total, dense, "
                                        "head-major-lse)"),
            std::string::npos) << bad.status().message();
  // A whole document (square) and, in another pass, shards whose queries see a longer prefix.
  const std::vector<AttnTask> whole = {{0, 300, 0, 300, true}};
  const std::vector<AttnTask> shards = {{0, 100, 0, 200, true}, {100, 50, 0, 60, true}, {150, 64, 200, 64, false}};
  for (bool backward : {false, true}) {
    PlanOptions options{.backward = backward, .variants = all.value()};
    auto square = plan_calls(dims_for(whole), whole, options);
    ASSERT_TRUE(square.is_ok());
    ASSERT_EQ(square.value().calls.size(), 1u);
    EXPECT_TRUE(square.value().calls[0].key.top_left);
    EXPECT_EQ(square.value().calls[0].key.max_total, !backward);
    auto mixed = plan_calls(dims_for(shards), shards, options);
    ASSERT_TRUE(mixed.is_ok());
    for (const Call& call : mixed.value().calls) EXPECT_FALSE(call.key.top_left) << "a call with a non-square sequence";
    auto plain = plan_calls(dims_for(whole), whole, {.backward = backward});
    ASSERT_TRUE(plain.is_ok());
    EXPECT_FALSE(plain.value().calls[0].key.top_left);
    EXPECT_TRUE(plain.value().calls[0].key.max_total);
    EXPECT_FALSE(plain.value().calls[0].key == square.value().calls[0].key) << "variants must not share a cached graph";
  }
}

// The dense variant: a call of one sequence gets a graph of its exact lengths, no workspace bound and
// the same offsets (its pointers move by them); a call of several sequences keeps the ragged graph.
TEST(CudnnPlan, DenseVariantOnlyForOneSequenceWithItsExactLengths) {
  auto dense = parse_graph_variants("dense");
  ASSERT_TRUE(dense.is_ok());
  EXPECT_TRUE(dense.value().dense);
  const std::vector<AttnTask> one = {{40, 77, 10, 300, true}};
  const std::vector<AttnTask> two = {{0, 100, 0, 200, true}, {100, 50, 300, 50, true}};  // two causal sequences
  for (bool backward : {false, true}) {
    auto plan = plan_calls(dims_for(one), one, {.backward = backward, .variants = dense.value()});
    ASSERT_TRUE(plan.is_ok());
    ASSERT_EQ(plan.value().calls.size(), 1u);
    const Call& call = plan.value().calls[0];
    EXPECT_TRUE(call.key.dense);
    EXPECT_EQ(call.key.batch, 1);
    EXPECT_EQ(call.key.s_q, 77);
    EXPECT_EQ(call.key.s_kv, 300);
    EXPECT_FALSE(call.key.max_total);
    auto ragged = plan_calls(dims_for(one), one, {.backward = backward});
    ASSERT_TRUE(ragged.is_ok());
    EXPECT_EQ(call.q_off, ragged.value().calls[0].q_off) << "a dense call starts at the sequence's rows";
    EXPECT_EQ(call.kv_off, ragged.value().calls[0].kv_off);
    EXPECT_EQ(call.stats_off, ragged.value().calls[0].stats_off);
    EXPECT_FALSE(call.key == ragged.value().calls[0].key) << "variants must not share a cached graph";
    auto mixed = plan_calls(dims_for(two), two, {.backward = backward, .variants = {.exact_batch = true, .dense = true}});
    ASSERT_TRUE(mixed.is_ok());
    ASSERT_EQ(mixed.value().calls.size(), 1u);
    EXPECT_EQ(mixed.value().calls[0].slots.size(), 2u);
    EXPECT_FALSE(mixed.value().calls[0].key.dense);
    // head-major-lse: only with dense, and only on the calls dense applies to.
    auto head_major = parse_graph_variants("dense,head-major-lse");
    ASSERT_TRUE(head_major.is_ok());
    auto hm_one = plan_calls(dims_for(one), one, {.backward = backward, .variants = head_major.value()});
    ASSERT_TRUE(hm_one.is_ok());
    EXPECT_TRUE(hm_one.value().calls[0].key.dense && hm_one.value().calls[0].key.head_major_lse);
    EXPECT_FALSE(hm_one.value().calls[0].key == call.key) << "variants must not share a cached graph";
    auto hm_two = plan_calls(dims_for(two), two, {.backward = backward, .variants = head_major.value()});
    ASSERT_TRUE(hm_two.is_ok());
    EXPECT_FALSE(hm_two.value().calls[0].key.head_major_lse);
  }
  auto alone = parse_graph_variants("head-major-lse");
  ASSERT_FALSE(alone.is_ok());
  EXPECT_NE(alone.status().message().find("head-major-lse applies to dense graphs only"), std::string::npos)
      << alone.status().message();
}

TEST(CudnnPlan, ATrainingRunBuildsABoundedNumberOfGraphs) {
  // 200 steps of a server's lists: documents of 1..32K tokens, shards of up to 4K.
  std::mt19937_64 rng(5);
  std::unordered_set<GraphKey, GraphKeyHash> keys;
  size_t calls = 0;
  for (int step = 0; step < 200; ++step) {
    std::vector<int64_t> docs;
    for (int64_t total = 0; total < 32768;) {
      const int64_t len = std::min<int64_t>(32768 - total, std::uniform_int_distribution<int64_t>(1, 32768)(rng));
      docs.push_back(len);
      total += len;
    }
    const std::vector<AttnTask> tasks = server_tasks(rng, docs, 4096);
    for (bool backward : {false, true}) {
      auto plan = plan_calls(dims_for(tasks), tasks, {.backward = backward, .scale = 0.088f});
      ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
      for (const Call& call : plan.value().calls) {
        keys.insert(call.key);
        ++calls;
      }
    }
  }
  EXPECT_GT(calls, 600u);
  std::printf("cuDNN graphs for 200 steps of a server's lists (forward and backward): %zu, for %zu calls\n",
              keys.size(), calls);
  EXPECT_LE(keys.size(), 60u) << "buckets must bound the graphs a run builds";
  EXPECT_GT(keys.size(), 2u);
}

TEST(CudnnPlan, KeysDifferInEverythingAGraphDependsOn) {
  const std::vector<AttnTask> tasks{{0, 100, 0, 100, true}};
  const AttnDims d = dims_for(tasks);
  auto key = [&](PlanOptions o, AttnDims dims) { return plan_calls(dims, tasks, o).value().calls.at(0).key; };
  const GraphKey base = key({.scale = 0.1f}, d);
  EXPECT_EQ(base, key({.scale = 0.1f}, d));
  EXPECT_NE(base, key({.scale = 0.2f}, d));
  EXPECT_NE(base, key({.bf16 = false, .scale = 0.1f}, d));
  EXPECT_NE(base, key({.backward = true, .scale = 0.1f}, d));
  AttnDims gqa = d;
  gqa.num_kv_heads = 4;
  EXPECT_NE(base, key({.scale = 0.1f}, gqa));
  AttnDims d64 = d;
  d64.head_dim = 64;
  EXPECT_NE(base, key({.scale = 0.1f}, d64));
  // A list in the same buckets shares the graph.
  const std::vector<AttnTask> other{{0, 90, 0, 120, true}};
  EXPECT_EQ(base, plan_calls(dims_for(other), other, {.scale = 0.1f}).value().calls.at(0).key);
  EXPECT_EQ(GraphKeyHash{}(base), GraphKeyHash{}(key({.scale = 0.1f}, d)));
}

TEST(CudnnPlan, DisjointKeysWriteDkDvInPlaceAndZeroUnreadRows) {
  const std::vector<AttnTask> tasks{{0, 50, 0, 50, true}, {50, 30, 60, 30, true}, {80, 10, 95, 5, false}};
  const AttnDims d = dims_for(tasks, 0, 7);
  auto plan = plan_calls(d, tasks, {.backward = true});
  ASSERT_TRUE(plan.is_ok());
  EXPECT_FALSE(plan.value().kv_scratch);
  for (const Call& call : plan.value().calls) EXPECT_TRUE(call.add_spans.empty());
  const std::vector<std::pair<int64_t, int64_t>> unread{{50, 60}, {90, 95}, {100, 107}};
  EXPECT_EQ(plan.value().empty_kv_rows, unread);
  for (const Call& call : plan.value().calls) {
    for (size_t slot = 0; slot < call.slots.size(); ++slot) EXPECT_EQ(call.dkv_off[slot], call.kv_off[slot]);
    EXPECT_EQ(call.key.total_q, bucket(d.num_q_rows, 64));
  }
}

// Emulates a backward through scratch: each call's slots write a slot-specific gradient into their
// scratch rows (which a call reuses from row 0), then the call's spans add them; the sums must be
// the per-row sums over the slots that read each row.
void expect_scratch_sums_exactly(const AttnDims& d, const Plan& plan) {
  const int64_t kv_row = d.num_kv_heads * d.head_dim;
  std::vector<double> expect(d.num_kv_rows, 0.0), got(d.num_kv_rows, 0.0);
  int64_t slot_id = 0;
  for (const Call& call : plan.calls) {
    std::vector<double> scratch(plan.kv_scratch_rows, 0.0);  // one element a row is enough for the layout
    int64_t used = 0;
    EXPECT_LE(call.key.total_kv, bucket(d.num_kv_rows, 64)) << "a call's scratch is at most the K/V rows";
    if (call.key.backward) {  // cuDNN's backward never gets two sequences sharing K/V rows
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (const AttnTask& t : call.slots) ranges.emplace_back(t.kv_offset, t.kv_offset + t.kv_len);
      std::sort(ranges.begin(), ranges.end());
      for (size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first) << "overlap in a call";
    }
    for (size_t slot = 0; slot < call.slots.size(); ++slot, ++slot_id) {
      const AttnTask& t = call.slots[slot];
      const int64_t first = call.dkv_off[slot] / kv_row;
      ASSERT_LE(first + t.kv_len, plan.kv_scratch_rows);
      ASSERT_LE(first + t.kv_len, call.key.total_kv);
      for (int64_t j = 0; j < t.kv_len; ++j) {
        const double g = 1.0 + static_cast<double>(slot_id) * 1000 + static_cast<double>(j);
        EXPECT_EQ(scratch[first + j], 0.0) << "two slots of a call share scratch rows";
        scratch[first + j] = g;
        expect[t.kv_offset + j] += g;
      }
      used = std::max(used, first + t.kv_len);
    }
    EXPECT_GE(call.key.total_kv, bucket(used, 64));
    for (const AddSpan& s : call.add_spans) {
      for (int64_t j = 0; j < s.rows; ++j) got[s.dst_row + j] += scratch[s.src_row + j];
    }
  }
  EXPECT_EQ(got, expect);
}

TEST(CudnnPlan, SharedKeysOrFp32SumsGoThroughScratchThatSumsExactly) {
  std::mt19937_64 rng(6);
  const std::vector<AttnTask> tasks = server_tasks(rng, {200, 17, 64, 1023}, 64);
  const AttnDims d = dims_for(tasks, 0, 5);
  ASSERT_TRUE(kv_ranges_overlap(tasks));
  for (bool fp32 : {false, true}) {
    auto planned = plan_calls(d, tasks, {.backward = true, .dkv_fp32 = fp32});
    ASSERT_TRUE(planned.is_ok());
    const Plan& plan = planned.value();
    EXPECT_TRUE(plan.kv_scratch);
    EXPECT_TRUE(plan.empty_kv_rows.empty()) << "the sums are zeroed whole";
    expect_scratch_sums_exactly(d, plan);
  }
  // Disjoint keys with fp32 sums asked for also go through scratch (cuDNN writes the storage dtype).
  const std::vector<AttnTask> disjoint{{0, 10, 0, 10, true}};
  EXPECT_TRUE(plan_calls(dims_for(disjoint), disjoint, {.backward = true, .dkv_fp32 = true}).value().kv_scratch);
}

// The keys query row `row` (an absolute Q row inside t) sees: [begin, end) of the K/V rows.
std::pair<int64_t, int64_t> sees(const AttnTask& t, int64_t row) {
  const int64_t r = row - t.q_offset;
  const int64_t end = t.is_causal ? std::clamp<int64_t>(t.kv_len - t.q_len + r + 1, 0, t.kv_len) : t.kv_len;
  return {t.kv_offset, t.kv_offset + end};
}

TEST(CudnnPlan, AdjacentPiecesMergeAndEveryQueryRowSeesTheSameKeys) {
  // 128 shards of one 16K document, in query order: one whole-document sequence, dK/dV in place.
  std::vector<AttnTask> shards;
  for (int64_t a = 0; a < 16384; a += 128) shards.push_back({a, 128, 0, a + 128, true});
  for (bool backward : {false, true}) {
    auto plan = plan_calls(dims_for(shards), shards, {.backward = backward});
    ASSERT_TRUE(plan.is_ok());
    ASSERT_EQ(plan.value().calls.size(), 1u);
    const Call& call = plan.value().calls[0];
    ASSERT_EQ(call.slots.size(), 1u);
    EXPECT_EQ(call.slots[0].q_len, 16384);
    EXPECT_EQ(call.slots[0].kv_len, 16384);
    EXPECT_EQ(call.tasks.size(), 128u);
    EXPECT_FALSE(plan.value().kv_scratch) << "one sequence: nothing to sum";
  }
  // Random lists, shards in order and scattered, non-causal pieces over equal keys in runs: every
  // query row of every slot sees exactly the keys it saw in its own task, and runs did merge.
  for (int seed = 0; seed < 20; ++seed) {
    std::mt19937_64 rng(100 + seed);
    std::vector<AttnTask> tasks = server_tasks(rng, {1, 5, 77, 1023, 300}, 90, seed % 2 == 1);
    int64_t q = dims_for(tasks).num_q_rows;
    for (int run = 0; run < 3; ++run) {  // non-causal pieces over the same keys, adjacent queries
      const int64_t kv_off = 10 * run, kv_len = 40 + run;
      for (int p = 0; p < 3; ++p) {
        const int64_t len = 1 + p * 7;
        tasks.push_back({q, len, kv_off, kv_len, false});
        q += len;
      }
    }
    const AttnDims d = dims_for(tasks);
    auto plan = plan_calls(d, tasks, {.backward = true});
    ASSERT_TRUE(plan.is_ok());
    std::vector<int> owner(d.num_q_rows, -1);
    for (size_t i = 0; i < tasks.size(); ++i) {
      if (tasks[i].q_len > 0 && tasks[i].kv_len > 0) {
        for (int64_t r = 0; r < tasks[i].q_len; ++r) owner[tasks[i].q_offset + r] = static_cast<int>(i);
      }
    }
    size_t slots = 0, covered = 0;
    for (const Call& call : plan.value().calls) {
      slots += call.slots.size();
      covered += call.tasks.size();
      for (const AttnTask& s : call.slots) {
        for (int64_t row = s.q_offset; row < s.q_offset + s.q_len; ++row) {
          ASSERT_GE(owner[row], 0);
          EXPECT_EQ(sees(s, row), sees(tasks[owner[row]], row)) << "seed " << seed << " row " << row;
        }
      }
    }
    int with_work = 0;
    for (const AttnTask& t : tasks) with_work += t.q_len > 0 && t.kv_len > 0;
    EXPECT_EQ(covered, static_cast<size_t>(with_work));
    EXPECT_LE(slots + 6, covered) << "the non-causal runs (and in-order shards) merge";
    if (seed % 2 == 0) {
      EXPECT_LE(slots, 5u + 2u + 3u) << "in-order shards: one slot a document";
    }
    if (plan.value().kv_scratch) expect_scratch_sums_exactly(d, plan.value());
  }
}

TEST(CudnnPlan, OverlappingSequencesGoToSeparateBackwardCallsAndTheForwardKeepsOne) {
  // 128 shards of a 16K document with their query rows reversed (none adjacent, none merge), Hkv 8 x
  // D 128: the H100 case whose dK was 13 % off with every shard in one backward call. Every shard
  // reads row 0, so the backward takes 128 calls of one sequence each; two documents' shards pair up.
  std::vector<AttnTask> shards;
  for (int64_t a = 0; a < 16384; a += 128) shards.push_back({16384 - 128 - a, 128, 0, a + 128, true});
  for (int64_t a = 0; a < 1024; a += 128) shards.push_back({16384 + 1024 - 128 - a, 128, 16384, a + 128, true});
  const AttnDims d{16384 + 1024, 16384 + 1024, 32, 8, 128};
  auto forward = plan_calls(d, shards, {});
  ASSERT_TRUE(forward.is_ok());
  EXPECT_EQ(forward.value().calls.size(), 1u) << "the forward reads shared K/V rows in one call";
  auto planned = plan_calls(d, shards, {.backward = true});
  ASSERT_TRUE(planned.is_ok()) << planned.status().to_string();
  const Plan& plan = planned.value();
  EXPECT_TRUE(plan.kv_scratch);
  EXPECT_EQ(plan.calls.size(), 128u) << "as many calls as the deepest overlap";
  EXPECT_LE(plan.kv_scratch_rows, d.num_kv_rows);
  size_t tasks = 0;
  for (const Call& call : plan.calls) tasks += call.tasks.size();
  EXPECT_EQ(tasks, shards.size());
  expect_scratch_sums_exactly(d, plan);
}

TEST(CudnnPlan, OffsetsPastInt32AreRefused) {
  const std::vector<AttnTask> tasks{{0, 10, 0, 10, true}};
  AttnDims d = dims_for(tasks);
  d.num_q_rows = int64_t{1} << 22;  // x 8 heads x 128 = 2^32 elements
  auto plan = plan_calls(d, tasks, {});
  ASSERT_FALSE(plan.is_ok());
  EXPECT_NE(plan.status().message().find("int32"), std::string::npos) << plan.status().to_string();
}

TEST(CudnnPlan, AListWithNothingToComputeHasNoCalls) {
  const std::vector<AttnTask> tasks{{0, 5, 0, 0, false}};
  auto plan = plan_calls(dims_for(tasks, 2), tasks, {.backward = true});
  ASSERT_TRUE(plan.is_ok());
  EXPECT_TRUE(plan.value().calls.empty());
  const std::vector<std::pair<int64_t, int64_t>> all{{0, 7}};
  EXPECT_EQ(plan.value().empty_q_rows, all);
}

TEST(CudnnAttentionHost, RefusesBadInputBeforeAnyDeviceWork) {
  // Head dim 96 and a task past the end: the checks shared with the distca kernel (validate) say so.
  CudaFwdArgs a;
  a.dims = {10, 10, 2, 2, 96};
  std::vector<AttnTask> tasks{{0, 10, 0, 10, true}};
  a.tasks = tasks;
  alignas(16) static char buffer[64];
  a.q = a.k = a.v = buffer;
  a.o = buffer;
  a.lse = reinterpret_cast<float*>(buffer);
  Status st = validate(a);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("head dims 64 and 128"), std::string::npos) << st.to_string();
  a.dims.head_dim = 64;
  tasks[0].kv_len = 11;
  st = validate(a);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
}

TEST(CudnnAttentionHost, CreateSaysWhyItCannotRun) {
  auto made = CudnnAttention::create();
  if (made.is_ok()) GTEST_SKIP() << "skipped: a GPU with cuDNN is here (the GPU tests cover it)";
  EXPECT_FALSE(made.status().message().empty());
  auto via = CudaAttention::create(-1, CudaKernel::kCudnn);
  EXPECT_FALSE(via.is_ok());
  EXPECT_EQ(cudnn_built(), !cudnn_version().empty());
  EXPECT_EQ(parse_cuda_kernel("cudnn").value(), CudaKernel::kCudnn);
  EXPECT_EQ(parse_cuda_kernel("distca").value(), CudaKernel::kDistca);
  EXPECT_FALSE(parse_cuda_kernel("flash").is_ok());
}

}  // namespace
}  // namespace distca::kernels::cudnn
