// Nano-batch split, the ping-pong schedule through real dispatchers (same results as one pass
// at a time), and the overlap itself over an emulated link.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <thread>

#include <fmt/format.h>

#include "distca/comm/local_comm.h"
#include "distca/runtime/pingpong.h"
#include "harness.h"

namespace distca::runtime {
namespace {

using comm::Communicator;
using comm::LocalWorld;

TEST(NanoBatches, SplitWholeDocumentsKeepingRanksAndHalvingTheWork) {
  auto batch = plan::pack_documents({500, 20, 300, 1, 77, 260, 90, 9, 400, 33}, 3, 560);
  ASSERT_TRUE(batch.is_ok());
  const plan::Batch& b = batch.value();
  auto split = split_nano_batches(b);
  ASSERT_TRUE(split.is_ok()) << split.status().to_string();
  const NanoBatches& s = split.value();
  std::vector<int> seen(b.num_docs(), 0);
  std::array<int64_t, 2> pairs{0, 0};
  for (int n = 0; n < 2; ++n) {
    ASSERT_TRUE(s.batches[n].validate().is_ok());
    for (size_t i = 0; i < s.docs[n].size(); ++i) {
      const int32_t doc = s.docs[n][i];
      ++seen[doc];
      EXPECT_EQ(s.batches[n].doc_lengths[i], b.doc_lengths[doc]);
      pairs[n] += plan::causal_pairs(0, b.doc_lengths[doc]);
    }
    for (const plan::Piece& p : s.batches[n].pieces) {  // the same rank holds the same tokens
      const int32_t doc = s.docs[n][p.doc];
      bool found = false;
      for (int32_t i : b.doc_pieces[doc]) found |= b.pieces[i].rank == p.rank && b.pieces[i].begin == p.begin && b.pieces[i].end == p.end;
      EXPECT_TRUE(found) << "doc " << doc << " [" << p.begin << ", " << p.end << ") on rank " << p.rank;
    }
  }
  for (int c : seen) EXPECT_EQ(c, 1);
  // Rows: each rank's rows split exactly between the two halves.
  for (int r = 0; r < b.num_ranks; ++r) {
    std::vector<int64_t> all = s.rows[0][r];
    all.insert(all.end(), s.rows[1][r].begin(), s.rows[1][r].end());
    std::sort(all.begin(), all.end());
    for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<int64_t>(i));
  }
  // Longest first to the lighter half: the halves differ by at most the longest document's work.
  EXPECT_LE(std::abs(pairs[0] - pairs[1]), plan::causal_pairs(0, 500));
  EXPECT_LT(std::abs(pairs[0] - pairs[1]), (pairs[0] + pairs[1]) / 10);
}

TEST(NanoBatches, OneDocumentLeavesAnEmptyHalf) {
  auto split = split_nano_batches(plan::pack_documents({64}, 2, 32).value());
  ASSERT_TRUE(split.is_ok()) << split.status().to_string();
  EXPECT_EQ(split.value().batches[1].num_docs(), 0);
  EXPECT_TRUE(split.value().rows[1][0].empty());
}

// Ping-pong forward + backward of both nano-batches through dispatchers gives bit-identical
// results to running each pass whole.
TEST(PingPong, SameResultsAsOnePassAtATime) {
  const int R = 3;
  auto batch = plan::pack_documents({200, 30, 1, 150, 260, 70, 15, 90}, R, 272);
  ASSERT_TRUE(batch.is_ok());
  auto split = split_nano_batches(batch.value());
  ASSERT_TRUE(split.is_ok());
  std::array<plan::Plan, 2> plans;
  for (int n = 0; n < 2; ++n) {
    auto p = testing::make_plan(split.value().batches[n], "minmax");
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    plans[n] = p.value();
  }
  for (auto mode : {plan::BackwardMode::kStateless, plan::BackwardMode::kStateful}) {
    auto statuses = LocalWorld::run(R, [&](Communicator& comm) -> Status {
      const HeadShape heads{4, 2, 32};
      struct Nano {
        std::unique_ptr<Dispatcher> d;
        std::vector<float> q, k, v, d_o, o, lse, dq, dk, dv;
        ServerBuffers s;
      };
      std::array<Nano, 2> nanos;
      std::mt19937_64 rng(comm.rank() + 1);
      std::normal_distribution<float> normal;
      for (int n = 0; n < 2; ++n) {
        DispatchOptions options;
        options.backward_mode = mode;
        options.num_threads = 1;
        DISTCA_ASSIGN_OR_RETURN(nanos[n].d, Dispatcher::create(comm, split.value().batches[n], plans[n], heads, options));
        const int64_t rows = nanos[n].d->num_local_rows();
        for (auto* t : {&nanos[n].q, &nanos[n].d_o}) t->resize(rows * 128);
        for (auto* t : {&nanos[n].k, &nanos[n].v}) t->resize(rows * 64);
        for (auto* t : {&nanos[n].q, &nanos[n].d_o, &nanos[n].k, &nanos[n].v}) {
          for (float& x : *t) x = normal(rng);
        }
        nanos[n].o.resize(rows * 128), nanos[n].lse.resize(rows * 4), nanos[n].dq.resize(rows * 128);
        nanos[n].dk.resize(rows * 64), nanos[n].dv.resize(rows * 64);
      }
      auto fwd = [](Nano& x) { return ForwardArgs{x.q.data(), x.k.data(), x.v.data(), x.o.data(), x.lse.data()}; };
      auto bwd = [](Nano& x) {
        return BackwardArgs{x.q.data(), x.k.data(), x.v.data(), x.o.data(), x.lse.data(), x.d_o.data(), x.dq.data(), x.dk.data(), x.dv.data()};
      };
      // Whole passes first.
      std::array<std::vector<float>, 2> want;
      for (Nano& x : nanos) {
        DISTCA_RETURN_IF_ERROR(x.d->forward(fwd(x), x.s));
        DISTCA_RETURN_IF_ERROR(x.d->backward(bwd(x), x.s));
      }
      for (int n = 0; n < 2; ++n) {
        for (auto* t : {&nanos[n].o, &nanos[n].lse, &nanos[n].dq, &nanos[n].dk, &nanos[n].dv}) {
          want[n].insert(want[n].end(), t->begin(), t->end());
          std::fill(t->begin(), t->end(), NAN);
        }
      }
      // The same as staged chains, interleaved.
      std::array<std::vector<Stage>, 2> chains;
      for (int n = 0; n < 2; ++n) {
        Nano& x = nanos[n];
        Dispatcher* d = x.d.get();
        auto finish = [d] { return d->finish_comm(); };
        auto start_return = [d] { return d->start_return(); };
        chains[n].push_back({[] { return Status::ok(); }, [&x, d, fwd] { return d->start_forward(fwd(x), x.s); }, finish});
        chains[n].push_back({[d] { return d->compute(); }, start_return, finish});
        chains[n].push_back({[] { return Status::ok(); }, [&x, d, bwd] { return d->start_backward(bwd(x), x.s); }, finish});
        chains[n].push_back({[d] { return d->compute(); }, start_return, finish});
      }
      DISTCA_RETURN_IF_ERROR(run_pingpong(chains[0], chains[1]).status());
      for (int n = 0; n < 2; ++n) {
        std::vector<float> got;
        for (auto* t : {&nanos[n].o, &nanos[n].lse, &nanos[n].dq, &nanos[n].dk, &nanos[n].dv}) got.insert(got.end(), t->begin(), t->end());
        if (std::memcmp(got.data(), want[n].data(), got.size() * sizeof(float)) != 0) {
          return internal_error(fmt::format("rank {}: nano-batch {} differs between ping-pong and whole passes", comm.rank(), n));
        }
      }
      return Status::ok();
    });
    for (int r = 0; r < R; ++r) EXPECT_TRUE(statuses[r].is_ok()) << statuses[r].to_string();
  }
}

// The schedule's overlap, with sleeping "compute" and a link whose every operation takes the
// same time: sequential pays compute + comm for every stage; ping-pong hides each communication
// behind the other nano-batch's compute but the last.
TEST(PingPong, HidesCommunicationBehindTheOtherNanoBatch) {
  const auto unit = std::chrono::milliseconds(25);
  const int stages = 4;
  auto statuses = LocalWorld::run(2, [&](Communicator& base) -> Status {
    comm::EmulatedLink link(base, {std::chrono::duration<double>(unit).count(), 0});
    std::array<std::vector<Stage>, 2> chains;
    std::array<std::unique_ptr<comm::Work>, 2> work;
    for (int n = 0; n < 2; ++n) {
      for (int i = 0; i < stages; ++i) {
        chains[n].push_back({[unit] { std::this_thread::sleep_for(unit); return Status::ok(); },
                             [&link, &work, n]() -> Status {
                               DISTCA_ASSIGN_OR_RETURN(work[n], link.barrier_async());
                               return Status::ok();
                             },
                             [&work, n] { return work[n]->wait(); }});
      }
    }
    DISTCA_ASSIGN_OR_RETURN(ScheduleTiming seq, run_sequential(chains[0], chains[1]));
    DISTCA_ASSIGN_OR_RETURN(ScheduleTiming pp, run_pingpong(chains[0], chains[1]));
    const double u = std::chrono::duration<double>(unit).count();
    // Sequential: 2 * stages * (compute + comm) = 16 units; ping-pong: 2 * stages compute + 1 comm = 9.
    if (seq.seconds < 2 * stages * 2 * u * 0.99) return internal_error(fmt::format("sequential took {} s, less than its sleeps", seq.seconds));
    for (const ScheduleTiming& t : {seq, pp}) {
      // Each nano-batch's own compute and communication add up to the schedule's.
      if (std::abs(t.nano_compute_seconds[0] + t.nano_compute_seconds[1] - t.compute_seconds) > 1e-9 ||
          std::abs(t.nano_comm_seconds[0] + t.nano_comm_seconds[1] - t.comm_seconds) > 1e-9) {
        return internal_error("the nano-batches' times do not add up to the schedule's");
      }
      // Both nano-batches slept `stages` units of compute.
      for (double c : t.nano_compute_seconds) {
        if (c < stages * u * 0.99) return internal_error(fmt::format("a nano-batch computed {} s, less than its sleeps", c));
      }
    }
    if (pp.seconds > seq.seconds * 0.75) {
      return internal_error(fmt::format("ping-pong {:.3f} s vs sequential {:.3f} s: the communication was not hidden", pp.seconds, seq.seconds));
    }
    return Status::ok();
  });
  for (const Status& st : statuses) EXPECT_TRUE(st.is_ok()) << st.to_string();
}

TEST(PingPong, MismatchedChainsAreRefused) {
  std::vector<Stage> a(2, Stage{[] { return Status::ok(); }, nullptr, nullptr});
  std::vector<Stage> b(1, Stage{[] { return Status::ok(); }, nullptr, nullptr});
  EXPECT_FALSE(run_pingpong(a, b).is_ok());
  std::vector<Stage> c(2, Stage{[] { return Status::ok(); }, [] { return Status::ok(); }, nullptr});
  EXPECT_FALSE(run_sequential(a, c).is_ok());
}

// A chain shaped like a training step's: per layer a linear stage that ends by posting the
// dispatch and an attention stage that ends by posting the return, forward then backward, and a
// last linear stage.
std::vector<Stage> step_chain(int layers) {
  auto ok = [] { return Status::ok(); };
  std::vector<Stage> chain;
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < layers; ++i) {
      const int l = pass == 0 ? i : layers - 1 - i;
      const char* dir = pass == 0 ? "fwd" : "bwd";
      chain.push_back({ok, ok, ok, fmt::format("L{} {} linear", l, dir), fmt::format("L{} {} dispatch", l, dir)});
      chain.push_back({ok, ok, ok, fmt::format("L{} {} attention", l, dir), fmt::format("L{} {} return", l, dir)});
    }
  }
  chain.push_back({ok, nullptr, nullptr, "last linear", ""});
  return chain;
}

TEST(PingPongSchedule, EveryComputeButTheEndsOverlapsTheOtherNanoBatchsCommunication) {
  for (int stages : {1, 2, 9, 17}) {
    const std::vector<ComputeOverlap> pp = overlaps(pingpong_schedule(stages));
    ASSERT_EQ(pp.size(), static_cast<size_t>(2 * stages));
    for (size_t k = 0; k < pp.size(); ++k) {
      const ComputeOverlap& c = pp[k];
      EXPECT_EQ(c.nano, static_cast<int>(k % 2));  // A and B alternate
      EXPECT_EQ(c.stage, static_cast<int>(k / 2));
      // A(i) runs under B's communication i - 1, B(i) under A's communication i: never its own.
      const std::vector<std::pair<int, int>> want =
          c.nano == 0 ? (c.stage == 0 ? std::vector<std::pair<int, int>>{} : std::vector<std::pair<int, int>>{{1, c.stage - 1}})
                      : std::vector<std::pair<int, int>>{{0, c.stage}};
      EXPECT_EQ(c.in_flight, want) << "stages " << stages << ", compute " << k;
    }
    for (const ComputeOverlap& c : overlaps(sequential_schedule(stages))) EXPECT_TRUE(c.in_flight.empty());
  }
}

TEST(PingPongSchedule, EachLayerRunsThePapersFourTicksForwardAndBackward) {
  const std::vector<Stage> a = step_chain(2), b = step_chain(2);
  const std::vector<std::string> lines = describe(pingpong_schedule(static_cast<int>(a.size())), a, b);
  ASSERT_EQ(lines.size(), 2 * a.size());
  // Layer 1 forward (stages 2, 3) and layer 1 backward (stages 4, 5): linear under the other's
  // return (or dispatch), attention under the other's dispatch (or return).
  const std::vector<std::string> want = {
      "A L1 fwd linear | in flight: B L0 fwd return",
      "B L1 fwd linear | in flight: A L1 fwd dispatch",
      "A L1 fwd attention | in flight: B L1 fwd dispatch",
      "B L1 fwd attention | in flight: A L1 fwd return",
      "A L1 bwd linear | in flight: B L1 fwd return",
      "B L1 bwd linear | in flight: A L1 bwd dispatch",
      "A L1 bwd attention | in flight: B L1 bwd dispatch",
      "B L1 bwd attention | in flight: A L1 bwd return",
  };
  EXPECT_EQ(std::vector<std::string>(lines.begin() + 4, lines.begin() + 12), want);
  EXPECT_EQ(lines.front(), "A L0 fwd linear | nothing in flight");
  EXPECT_EQ(lines.back(), "B last linear | nothing in flight");  // A's last stage moves nothing
  EXPECT_EQ(lines[lines.size() - 2], "A last linear | in flight: B L0 bwd return");
  for (const std::string& line : describe(sequential_schedule(static_cast<int>(a.size())), a, b)) {
    EXPECT_TRUE(line.ends_with("nothing in flight")) << line;
  }
}

TEST(PingPongSchedule, SchedulesThatBreakAChainsOrderAreRefused) {
  std::vector<Stage> a = step_chain(1), b = step_chain(1);
  std::vector<ScheduleOp> s = pingpong_schedule(static_cast<int>(a.size()));
  EXPECT_TRUE(run_schedule(s, a, b).is_ok());
  std::vector<ScheduleOp> early = pingpong_schedule(static_cast<int>(a.size()));
  // A computes stage 1 before its communication 0 finished.
  auto finish = std::find(early.begin(), early.end(), ScheduleOp{OpKind::kFinish, 0, 0});
  auto compute = std::find(early.begin(), early.end(), ScheduleOp{OpKind::kCompute, 0, 1});
  std::iter_swap(finish, compute);
  EXPECT_FALSE(run_schedule(early, a, b).is_ok());
  std::vector<ScheduleOp> unfinished = pingpong_schedule(static_cast<int>(a.size()));
  unfinished.pop_back();
  EXPECT_FALSE(run_schedule(unfinished, a, b).is_ok());
  std::vector<ScheduleOp> twice = pingpong_schedule(static_cast<int>(a.size()));
  twice.push_back(twice.front());
  EXPECT_FALSE(run_schedule(twice, a, b).is_ok());
}

}  // namespace
}  // namespace distca::runtime
