// The CAD runtime over LocalComm: distributed equals colocated, exact routing, the plan's
// bytes, edge cases, hash checks and failures.
#include <gtest/gtest.h>

#include <algorithm>

#include <array>
#include <chrono>
#include <cstring>
#include <random>

#include "distca/comm/emulated_link.h"
#include "distca/comm/local_comm.h"
#include "distca/plan/plan.h"
#include "distca/plan/verify.h"
#include "harness.h"
#include "rank_status.h"

namespace distca::runtime {
namespace {

using comm::Communicator;
using comm::LocalWorld;
using plan::BackwardMode;

using distca::testing::expect_all_ok;

// Random documents (some of one token, some longer than a rank) packed into R ranks of T.
plan::Batch random_batch(uint64_t seed, int R, int64_t T) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> lengths;
  int64_t total = 0;
  while (total < R * T) {
    const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
    const int64_t len = kind == 0 ? 1 : kind < 4 ? std::uniform_int_distribution<int64_t>(2, 40)(rng)
                                                 : std::uniform_int_distribution<int64_t>(20, 3 * T)(rng);
    lengths.push_back(len);
    total += len;
  }
  auto batch = plan::pack_documents(lengths, R, T);
  EXPECT_TRUE(batch.is_ok()) << batch.status().to_string();
  return batch.value();
}

plan::Plan must_plan(const plan::Batch& batch, const std::string& policy) {
  auto plan = testing::make_plan(batch, policy);
  EXPECT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_TRUE(plan::verify_tasks(batch, plan.value().tasks).is_ok());
  return plan.value();
}

// A plan with hand-placed tasks (finalize_plan sorts them and fills the hash).
plan::Plan hand_plan(const plan::Batch& batch, std::vector<plan::Task> tasks) {
  auto model = plan::model_preset("llama-8b");
  const plan::CostModel cost(model.value(), plan::ThroughputProfile{});
  plan::Plan p = plan::finalize_plan("hand", 0.05, batch, cost, std::move(tasks));
  EXPECT_TRUE(plan::verify_tasks(batch, p.tasks).is_ok());
  return p;
}

TEST(Dispatcher, DistributedEqualsColocatedForEveryPolicyAndRankCount) {
  int minbytes_splits = 0;  // minbytes' key-range splits: the cases must really have them
  for (int R : {1, 2, 3, 4, 7}) {
    for (const std::string policy : {"none", "distca", "minmax", "minbytes"}) {
      for (BackwardMode mode : {BackwardMode::kStateless, BackwardMode::kStateful}) {
        SCOPED_TRACE(fmt::format("R={} policy={} mode={}", R, policy, plan::backward_mode_name(mode)));
        const plan::Batch batch = random_batch(100 + R, R, 160);
        const plan::Plan plan = must_plan(batch, policy);
        if (policy == "minbytes") {
          minbytes_splits += static_cast<int>(std::count_if(plan.tasks.begin(), plan.tasks.end(), [](const plan::Task& t) {
            return t.k0 > 0 || !t.is_causal();
          }));
        }
        testing::DispatchCase c;
        c.seed = 7 * R + 1;
        c.mode = mode;
        expect_all_ok(LocalWorld::run(R, [&](Communicator& comm) {
          return testing::check_against_colocated(comm, batch, plan, c);
        }));
      }
    }
  }
  // One long document on rank 0 and short ones elsewhere: minbytes cuts it into key-split blocks.
  for (int R : {2, 3, 4, 7}) {
    std::vector<std::vector<int64_t>> ranks(R, std::vector<int64_t>(8, 20));
    ranks[0] = {160};
    const plan::Batch batch = plan::batch_from_ranks(ranks, 160).value();
    // At 160 tokens the default GPU profile's per-task overhead (64 us a step) outweighs any
    // block, and the planner rightly cuts nothing: price tasks by their pairs alone here.
    plan::ThroughputProfile free_tasks;
    free_tasks.task_overhead_seconds = 0;
    free_tasks.tile_rows = 16;
    const plan::CostModel cost(plan::model_preset("llama-8b").value(), free_tasks);
    const plan::Plan plan = plan::plan_minbytes(batch, cost, plan::PlannerOptions{0.05, 16, 0}).value();
    ASSERT_TRUE(plan::verify_tasks(batch, plan.tasks).is_ok());
    minbytes_splits += static_cast<int>(std::count_if(plan.tasks.begin(), plan.tasks.end(), [](const plan::Task& t) {
      return t.k0 > 0 || !t.is_causal();
    }));
    for (BackwardMode mode : {BackwardMode::kStateless, BackwardMode::kStateful}) {
      SCOPED_TRACE(fmt::format("skewed R={} mode={}", R, plan::backward_mode_name(mode)));
      testing::DispatchCase c;
      c.seed = 11 * R;
      c.mode = mode;
      expect_all_ok(LocalWorld::run(R, [&](Communicator& comm) {
        return testing::check_against_colocated(comm, batch, plan, c);
      }));
    }
  }
  EXPECT_GT(minbytes_splits, 0);
}

TEST(Dispatcher, GqaAndWideHeads) {
  const plan::Batch batch = random_batch(5, 3, 200);
  const plan::Plan plan = must_plan(batch, "minmax");
  for (layout::HeadShape heads : {layout::HeadShape{8, 1, 64}, layout::HeadShape{2, 2, 128}}) {
    testing::DispatchCase c;
    c.heads = heads;
    c.num_threads = 2;
    expect_all_ok(LocalWorld::run(3, [&](Communicator& comm) { return testing::check_against_colocated(comm, batch, plan, c); }));
  }
}

TEST(Dispatcher, EveryRowGoesToItsServerSlotAndComesBackToItsPlace) {
  for (int R : {1, 2, 3, 4, 7}) {
    for (const std::string policy : {"none", "distca", "minmax", "minbytes"}) {
      for (BackwardMode mode : {BackwardMode::kStateless, BackwardMode::kStateful}) {
        SCOPED_TRACE(fmt::format("R={} policy={} mode={}", R, policy, plan::backward_mode_name(mode)));
        const plan::Batch batch = random_batch(300 + R, R, 256);
        const plan::Plan plan = must_plan(batch, policy);
        expect_all_ok(LocalWorld::run(R, [&](Communicator& comm) { return testing::check_routing(comm, batch, plan, mode); }));
      }
    }
  }
}

TEST(Dispatcher, EdgeCases) {
  struct Edge {
    std::string name;
    std::vector<std::vector<int64_t>> ranks;
    int64_t tokens_per_rank;
  };
  const std::vector<Edge> edges = {
      {"one rank", {{5, 1, 60}}, 0},
      {"ranks with no tokens", {{}, {70, 3}, {}, {1, 1, 1}}, 80},
      {"one-token documents", {{1, 1, 1}, {1}, {1, 1}}, 3},
  };
  for (const Edge& e : edges) {
    SCOPED_TRACE(e.name);
    auto batch = plan::batch_from_ranks(e.ranks, e.tokens_per_rank);
    ASSERT_TRUE(batch.is_ok()) << batch.status().to_string();
    const int R = batch.value().num_ranks;
    for (const std::string policy : {"none", "minmax"}) {
      const plan::Plan plan = must_plan(batch.value(), policy);
      expect_all_ok(LocalWorld::run(R, [&](Communicator& c) { return testing::check_against_colocated(c, batch.value(), plan, {}); }));
      expect_all_ok(LocalWorld::run(R, [&](Communicator& c) {
        return testing::check_routing(c, batch.value(), plan, BackwardMode::kStateless);
      }));
    }
  }
  // One document spanning all ranks; everything served by rank 0, or each shard by a rank that
  // does not own it; ranks 1.. serve nothing in the first plan.
  auto spanning = plan::pack_documents({4 * 50}, 4, 50);
  ASSERT_TRUE(spanning.is_ok());
  const plan::Batch& b = spanning.value();
  std::vector<plan::Task> on_zero, rotated;
  for (int i = 0; i < 8; ++i) {
    on_zero.push_back(plan::causal_task(0, i * 25, (i + 1) * 25, 0));
    rotated.push_back(plan::causal_task(0, i * 25, (i + 1) * 25, (i / 2 + 1) % 4));
  }
  for (const auto& tasks : {on_zero, rotated}) {
    const plan::Plan plan = hand_plan(b, tasks);
    for (BackwardMode mode : {BackwardMode::kStateless, BackwardMode::kStateful}) {
      testing::DispatchCase c;
      c.mode = mode;
      expect_all_ok(LocalWorld::run(4, [&](Communicator& comm) { return testing::check_against_colocated(comm, b, plan, c); }));
      expect_all_ok(LocalWorld::run(4, [&](Communicator& comm) { return testing::check_routing(comm, b, plan, mode); }));
    }
  }
}

TEST(Dispatcher, StatelessAndStatefulBytesDifferOnlyInTheBackwardDispatch) {
  const plan::Batch batch = random_batch(9, 4, 256);
  const plan::Plan plan = must_plan(batch, "minmax");
  const plan::TokenBytes tb = plan::token_bytes(4, 2, 32, 4, plan::GradReturn::kFp32);
  const auto stateless = plan::count_traffic(batch, tb, plan.tasks, BackwardMode::kStateless);
  const auto stateful = plan::count_traffic(batch, tb, plan.tasks, BackwardMode::kStateful);
  const auto bwd = static_cast<int>(plan::Phase::kBwdDispatch);
  for (int p = 0; p < plan::kNumPhases; ++p) {
    if (p == bwd) continue;
    EXPECT_EQ(stateless.phases[p].total_bytes, stateful.phases[p].total_bytes) << plan::phase_name(static_cast<plan::Phase>(p));
  }
  // Stateless re-sends Q, O, LSE with dO, and K/V; stateful sends dO alone.
  const int64_t q_rows = stateless.forward.q_bytes / tb.q;
  EXPECT_GT(q_rows, 0);
  EXPECT_EQ(stateful.phases[bwd].total_bytes, q_rows * tb.bwd_do);
  EXPECT_EQ(stateless.phases[bwd].total_bytes, q_rows * tb.bwd_q + stateless.forward.kv_bytes);
}

TEST(Dispatcher, StatefulBackwardNeedsItsForwardBuffers) {
  const plan::Batch batch = random_batch(11, 2, 64);
  const plan::Plan plan = must_plan(batch, "minmax");
  auto statuses = LocalWorld::run(2, [&](Communicator& comm) -> Status {
    DispatchOptions options;
    options.backward_mode = BackwardMode::kStateful;
    DISTCA_ASSIGN_OR_RETURN(auto d, Dispatcher::create(comm, batch, plan, {2, 1, 32}, options));
    ServerBuffers fresh;
    std::vector<float> x(d->num_local_rows() * 64 + 1);
    Status st = d->backward({nullptr, nullptr, nullptr, nullptr, nullptr, x.data(), x.data(), x.data(), x.data()}, fresh);
    if (st.is_ok() || st.message().find("forward filled") == std::string::npos) {
      return internal_error("want a refusal naming the forward's buffers, got " + st.to_string());
    }
    return Status::ok();
  });
  expect_all_ok(statuses);
}

TEST(Dispatcher, StagesOutOfOrderAreRefused) {
  const plan::Batch batch = random_batch(12, 1, 64);
  const plan::Plan plan = must_plan(batch, "none");
  expect_all_ok(LocalWorld::run(1, [&](Communicator& comm) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto d, Dispatcher::create(comm, batch, plan, {2, 1, 32}));
    if (d->compute().is_ok() || d->finish_comm().is_ok() || d->start_return().is_ok()) {
      return internal_error("stages out of order accepted");
    }
    return Status::ok();
  }));
}

TEST(Dispatcher, ADifferentPlanOnOneRankIsAnErrorOnEveryRank) {
  const plan::Batch batch = random_batch(13, 3, 128);
  const plan::Plan good = must_plan(batch, "minmax");
  const plan::Plan other = must_plan(batch, "none");
  ASSERT_NE(good.hash, other.hash);
  auto statuses = LocalWorld::run(3, [&](Communicator& comm) -> Status {
    auto d = Dispatcher::create(comm, batch, comm.rank() == 2 ? other : good, {2, 1, 32});
    return d.is_ok() ? Status::ok() : d.status();
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_FALSE(statuses[r].is_ok()) << "rank " << r;
    EXPECT_NE(statuses[r].message().find(r == 2 ? "differs from rank 0's" : "1 rank(s)"), std::string::npos)
        << statuses[r].message();
  }
  // A plan whose tasks were edited after hashing is refused before anything moves.
  plan::Plan edited = good;
  std::swap(edited.tasks.front().server, edited.tasks.back().server);
  auto one = LocalWorld::run(1, [&](Communicator& comm) -> Status {
    plan::Plan p = must_plan(plan::pack_documents({10, 20}, 1, 30).value(), "none");
    p.hash ^= 1;
    auto d = Dispatcher::create(comm, plan::pack_documents({10, 20}, 1, 30).value(), p, {2, 1, 32});
    return d.is_ok() ? Status::ok() : d.status();
  });
  ASSERT_FALSE(one[0].is_ok());
  EXPECT_NE(one[0].message().find("does not match its batch and tasks"), std::string::npos) << one[0].message();
}

plan::Plan must_split(const plan::Batch& batch, const plan::Plan& causal, uint64_t seed) {
  auto split = testing::split_key_ranges(batch, causal, seed);
  EXPECT_TRUE(split.is_ok()) << split.status().to_string();
  return split.value();
}

// Key-range splits: a query row's partial (O, LSE) from several servers, itself included, merged
// at its owner; dQ summed there; the same answer as colocated attention and the plan's bytes.
TEST(Dispatcher, KeySplitPlansEqualColocated) {
  int num_split = 0;
  for (int R = 1; R <= 7; ++R) {
    for (const std::string policy : {"none", "distca", "minmax", "minbytes"}) {
      const plan::Batch batch = random_batch(500 + R, R, 160);
      const plan::Plan plan = must_split(batch, must_plan(batch, policy), 40 + R);
      for (const plan::Task& t : plan.tasks) num_split += !t.is_causal();
      for (BackwardMode mode : {BackwardMode::kStateless, BackwardMode::kStateful}) {
        SCOPED_TRACE(fmt::format("R={} policy={} mode={}", R, policy, plan::backward_mode_name(mode)));
        testing::DispatchCase c;
        c.seed = 11 * R + 3;
        c.mode = mode;
        expect_all_ok(LocalWorld::run(R, [&](Communicator& comm) {
          return testing::check_against_colocated(comm, batch, plan, c);
        }));
        expect_all_ok(LocalWorld::run(R, [&](Communicator& comm) { return testing::check_routing(comm, batch, plan, mode); }));
      }
    }
  }
  EXPECT_GT(num_split, 100);  // the random splits did split
}

// By hand: one document over two ranks of 32; rows [32, 64) see keys [0, 32) in a non-causal
// task and [32, q] in a causal one, on the same server (the rows go to it twice), on different
// servers, or cut again by query and key.
TEST(Dispatcher, KeySplitHandPlansEqualColocated) {
  auto batch = plan::pack_documents({64}, 2, 32);
  ASSERT_TRUE(batch.is_ok());
  const std::vector<std::vector<plan::Task>> cases = {
      {plan::causal_task(0, 0, 32, 0), {0, 32, 64, 0, 32, 1}, {0, 32, 64, 32, 64, 1}},
      {plan::causal_task(0, 0, 32, 1), {0, 32, 64, 0, 32, 0}, {0, 32, 64, 32, 64, 1}},
      {plan::causal_task(0, 0, 32, 0), {0, 32, 40, 0, 10, 1}, {0, 40, 64, 0, 10, 0}, {0, 32, 64, 10, 20, 1},
       {0, 32, 64, 20, 30, 0}, {0, 32, 64, 30, 64, 0}},
  };
  for (const auto& tasks : cases) {
    const plan::Plan plan = hand_plan(batch.value(), tasks);
    for (BackwardMode mode : {BackwardMode::kStateless, BackwardMode::kStateful}) {
      testing::DispatchCase c;
      c.mode = mode;
      expect_all_ok(LocalWorld::run(2, [&](Communicator& comm) { return testing::check_against_colocated(comm, batch.value(), plan, c); }));
      expect_all_ok(LocalWorld::run(2, [&](Communicator& comm) { return testing::check_routing(comm, batch.value(), plan, mode); }));
    }
  }
}

// The merge and the dQ sum run in a fixed order, so two runs give the same bits even when the
// ranks reach the exchanges in a different order (a link latency per rank, reversed between runs).
TEST(Dispatcher, KeySplitRunsAreBitwiseDeterministic) {
  const int R = 4;
  const plan::Batch batch = random_batch(77, R, 200);
  const plan::Plan plan = must_split(batch, must_plan(batch, "minmax"), 78);
  const testing::GlobalLayout g = testing::global_layout(batch);
  for (BackwardMode mode : {BackwardMode::kStateless, BackwardMode::kStateful}) {
    SCOPED_TRACE(plan::backward_mode_name(mode));
    testing::DispatchCase c;
    c.mode = mode;
    c.num_threads = 2;
    const testing::GlobalInputs in = testing::random_inputs(g, c);
    expect_all_ok(LocalWorld::run(R, [&](Communicator& base) -> Status {
      std::array<testing::LocalOutputs, 2> runs;
      for (int run = 0; run < 2; ++run) {
        const int slow = run == 0 ? base.rank() : R - 1 - base.rank();
        comm::EmulatedLink link(base, {0.002 * slow, 0});
        DispatchOptions options;
        options.backward_mode = mode;
        options.num_threads = c.num_threads;
        DISTCA_ASSIGN_OR_RETURN(auto d, Dispatcher::create(link, batch, plan, c.heads, options));
        DISTCA_ASSIGN_OR_RETURN(runs[run], testing::run_local(*d, g.local_rows[base.rank()], in));
      }
      auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
      };
      const testing::LocalOutputs& a = runs[0];
      const testing::LocalOutputs& b = runs[1];
      if (!same_bits(a.o, b.o) || !same_bits(a.lse, b.lse) || !same_bits(a.dq, b.dq) || !same_bits(a.dk, b.dk) ||
          !same_bits(a.dv, b.dv)) {
        return internal_error(fmt::format("rank {}: two runs of the same plan differ", base.rank()));
      }
      return Status::ok();
    }));
  }
}

// DispatchOptions::poll reaches the default CPU kernel: every rank's server polls while it
// computes its tasks (ping-pong's MPI progress), and the results are those of a run without it.
TEST(Dispatcher, PollRunsInsideTheServerKernelAndChangesNothing) {
  const int R = 3;
  const plan::Batch batch = random_batch(91, R, 300);
  const plan::Plan plan = must_plan(batch, "minmax");
  const testing::GlobalLayout g = testing::global_layout(batch);
  testing::DispatchCase c;
  c.mode = BackwardMode::kStateful;
  c.num_threads = 1;  // the calling thread runs every work item, so it polls
  const testing::GlobalInputs in = testing::random_inputs(g, c);
  expect_all_ok(LocalWorld::run(R, [&](Communicator& comm) -> Status {
    int polls = 0;
    std::array<testing::LocalOutputs, 2> runs;
    for (int run = 0; run < 2; ++run) {
      DispatchOptions options;
      options.backward_mode = c.mode;
      options.num_threads = c.num_threads;
      if (run == 1) options.poll = [&polls, &comm] { ++polls, (void)comm.progress(); };
      DISTCA_ASSIGN_OR_RETURN(auto d, Dispatcher::create(comm, batch, plan, c.heads, options));
      DISTCA_ASSIGN_OR_RETURN(runs[run], testing::run_local(*d, g.local_rows[comm.rank()], in));
    }
    if (polls == 0) return internal_error(fmt::format("rank {}: the server kernel never polled", comm.rank()));
    for (auto [a, b] : {std::pair{&runs[0].o, &runs[1].o}, {&runs[0].dq, &runs[1].dq}, {&runs[0].dk, &runs[1].dk},
                        {&runs[0].dv, &runs[1].dv}}) {
      if (a->size() != b->size() || std::memcmp(a->data(), b->data(), a->size() * sizeof(float)) != 0) {
        return internal_error(fmt::format("rank {}: polling changed a result", comm.rank()));
      }
    }
    return Status::ok();
  }));
}

// Stateful backward of a split row needs its merged O and LSE from the owner.
TEST(Dispatcher, StatefulBackwardOfAKeySplitPlanNeedsTheMergedOutputs) {
  auto batch = plan::pack_documents({64}, 2, 32);
  ASSERT_TRUE(batch.is_ok());
  const plan::Plan plan =
      hand_plan(batch.value(), {plan::causal_task(0, 0, 32, 0), {0, 32, 64, 0, 32, 0}, {0, 32, 64, 32, 64, 1}});
  auto statuses = LocalWorld::run(2, [&](Communicator& comm) -> Status {
    DispatchOptions options;
    options.backward_mode = BackwardMode::kStateful;
    DISTCA_ASSIGN_OR_RETURN(auto d, Dispatcher::create(comm, batch.value(), plan, {2, 1, 32}, options));
    const int64_t n = d->num_local_rows();
    std::vector<float> q(n * 64), kv(n * 32), o(n * 64), lse(n * 2), dq(n * 64), dkv(n * 32);
    ServerBuffers s;
    DISTCA_RETURN_IF_ERROR(d->forward({q.data(), kv.data(), kv.data(), o.data(), lse.data()}, s));
    // Rank 1 owns the split rows [32, 64); the refusal comes before anything is posted, so rank 0
    // does not start a backward that would wait for it.
    if (comm.rank() == 0) return Status::ok();
    Status st = d->backward({nullptr, nullptr, nullptr, nullptr, nullptr, q.data(), dq.data(), dkv.data(), dkv.data()}, s);
    if (st.is_ok() || st.message().find("o and lse") == std::string::npos) {
      return internal_error("want a refusal naming o and lse, got " + st.to_string());
    }
    return Status::ok();
  });
  expect_all_ok(statuses);
}

TEST(Dispatcher, ARankThatThrowsMidPassEndsEveryRankPromptly) {
  const plan::Batch batch = random_batch(14, 4, 128);
  const plan::Plan plan = must_plan(batch, "minmax");
  const auto start = std::chrono::steady_clock::now();
  auto statuses = LocalWorld::run(4, [&](Communicator& comm) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto d, Dispatcher::create(comm, batch, plan, {2, 1, 32}));
    const int64_t n = d->num_local_rows();
    std::vector<float> q(n * 64 + 1), kv(n * 32 + 1), o(n * 64 + 1), lse(n * 2 + 1);
    ServerBuffers s;
    DISTCA_RETURN_IF_ERROR(d->forward({q.data(), kv.data(), kv.data(), o.data(), lse.data()}, s));
    if (comm.rank() == 2) throw std::runtime_error("rank 2 fails between passes (fault test)");
    return d->forward({q.data(), kv.data(), kv.data(), o.data(), lse.data()}, s);
  }, std::chrono::seconds(30));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10.0);
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(statuses[r].is_ok()) << "rank " << r;
    EXPECT_NE(statuses[r].message().find("rank 2"), std::string::npos) << statuses[r].message();
  }
}

}  // namespace
}  // namespace distca::runtime

namespace distca::runtime {
namespace {

// Colocated attention over documents that stay on their ranks moves nothing, so the dispatcher
// posts no exchange at all (ranks do not wait for each other at every layer); a document that
// spans ranks needs its key prefix moved, and then every rank joins the exchange.
TEST(Dispatcher, ColocatedPlansWithNoSpanningDocumentPostNoExchange) {
  struct Case {
    std::vector<std::vector<int64_t>> ranks;
    int64_t tokens_per_rank;
    bool is_silent;
  };
  const std::vector<Case> cases = {{{{40, 24}, {64}, {1, 63}}, 64, true}, {{{64}, {64}}, 64, true}};
  for (const Case& c : cases) {
    auto batch = plan::batch_from_ranks(c.ranks, c.tokens_per_rank);
    ASSERT_TRUE(batch.is_ok());
    const plan::Plan plan = must_plan(batch.value(), "none");
    expect_all_ok(LocalWorld::run(batch.value().num_ranks, [&](Communicator& inner) -> Status {
      comm::EmulatedLink link(inner, {});
      const layout::HeadShape heads{2, 1, 32};
      DISTCA_ASSIGN_OR_RETURN(auto d, Dispatcher::create(link, batch.value(), plan, heads));
      if (d->is_silent() != c.is_silent) return internal_error("is_silent is wrong");
      link.reset_counters();
      const auto n = static_cast<size_t>(d->num_local_rows());
      std::vector<float> q(n * 2 * 32, 0.5f), kv(n * 32, 0.25f), o(q.size()), lse(n * 2);
      ServerBuffers server;
      DISTCA_RETURN_IF_ERROR(d->forward({q.data(), kv.data(), kv.data(), o.data(), lse.data()}, server));
      if (link.counters().operations != 0) return internal_error("a silent plan posted an exchange");
      return testing::check_against_colocated(inner, batch.value(), plan, {});
    }));
  }
  // One document across two ranks: rank 1 needs rank 0's keys.
  auto spanning = plan::pack_documents({100}, 2, 64);
  ASSERT_TRUE(spanning.is_ok());
  const plan::Plan plan = must_plan(spanning.value(), "none");
  expect_all_ok(LocalWorld::run(2, [&](Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto d, Dispatcher::create(c, spanning.value(), plan, layout::HeadShape{2, 1, 32}));
    return d->is_silent() ? internal_error("a spanning document needs an exchange") : Status::ok();
  }));
}

}  // namespace
}  // namespace distca::runtime
