// The ping-pong schedules, run through real dispatchers on the trainer's nano-batch splits
// (layout/step_split.h; same results as one pass at a time, held K/V included), and the overlap
// itself over an emulated link.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <thread>

#include <fmt/format.h>

#include "distca/comm/local_comm.h"
#include "distca/layout/step_split.h"
#include "distca/plan/model_shape.h"
#include "distca/plan/verify.h"
#include "distca/plan/workload.h"
#include "distca/runtime/pingpong.h"
#include "harness.h"

namespace distca::runtime {
namespace {

using comm::Communicator;
using comm::LocalWorld;

// Held K/V through real dispatchers: the plan split with hold_kv (tasks cut, B's servers taking
// A's K/V rows from A's buffers), run A's forward, B's, B's backward, A's, gives the whole
// plan's O, LSE, dQ, dK and dV on every rank; and B's backward after A's is refused.
TEST(HeldKv, SplitPlanThroughDispatchersGivesTheWholePlansResults) {
  const int R = 2;
  const plan::Batch b = plan::pack_documents({600, 70, 120, 30, 250, 90, 54}, R, 600).value();
  for (const char* policy : {"minlink", "distca"}) {
    const plan::Plan whole = testing::make_plan(b, policy, 64).value();
    const plan::CostModel cost(plan::model_preset("llama-8b").value(), plan::ThroughputProfile{});
    const layout::NanoSplit split = layout::split_step(b, whole, cost, {.hold_kv = true}).value();
    ASSERT_FALSE(split.held_kv.empty()) << policy;
    ASSERT_GT(split.plans[0].tasks.size() + split.plans[1].tasks.size(), whole.tasks.size()) << policy << ": nothing cut";
    for (const bool wrong_order : {false, true}) {
      auto statuses = LocalWorld::run(R, [&](Communicator& comm) -> Status {
        const layout::HeadShape heads{4, 2, 32};
        const int64_t qr = 128, kr = 64, lr = 4;
        const int r = comm.rank();
        DispatchOptions options;
        options.backward_mode = plan::BackwardMode::kStateful;
        options.num_threads = 1;
        // The micro-batch's tensors and the whole plan's results.
        DISTCA_ASSIGN_OR_RETURN(auto d, Dispatcher::create(comm, b, whole, heads, options));
        const int64_t rows = d->num_local_rows();
        std::mt19937_64 rng(r + 7);
        std::normal_distribution<float> normal;
        std::vector<float> q(rows * qr), k(rows * kr), v(rows * kr), d_o(rows * qr);
        for (auto* t : {&q, &k, &v, &d_o}) {
          for (float& x : *t) x = normal(rng);
        }
        std::vector<float> o(rows * qr), lse(rows * lr), dq(rows * qr), dk(rows * kr), dv(rows * kr);
        ServerBuffers ws;
        DISTCA_RETURN_IF_ERROR(d->forward({q.data(), k.data(), v.data(), o.data(), lse.data()}, ws));
        DISTCA_RETURN_IF_ERROR(d->backward({nullptr, nullptr, nullptr, o.data(), lse.data(), d_o.data(), dq.data(), dk.data(), dv.data()}, ws));
        // Each nano-batch's layout: A's rows; B's = the context rows (A's last ones), then its own.
        struct Nano {
          std::vector<int64_t> rows;
          std::vector<float> q, k, v, d_o, o, lse, dq, dk, dv;
          std::unique_ptr<Dispatcher> d;
          ServerBuffers s;
        };
        std::array<Nano, 2> nano;
        const auto& own = split.nano.rows;
        const int64_t ctx = split.nano.context_rows[r];
        nano[0].rows = own[0][r];
        nano[1].rows.assign(own[0][r].end() - ctx, own[0][r].end());
        nano[1].rows.insert(nano[1].rows.end(), own[1][r].begin(), own[1][r].end());
        auto gather = [](const std::vector<float>& from, const std::vector<int64_t>& at, int64_t width) {
          std::vector<float> out;
          for (int64_t row : at) out.insert(out.end(), from.begin() + row * width, from.begin() + (row + 1) * width);
          return out;
        };
        for (int n = 0; n < 2; ++n) {
          Nano& x = nano[n];
          DispatchOptions o2 = options;
          o2.is_part = n == 1;
          if (n == 1) o2.held_kv = split.held_kv;
          DISTCA_ASSIGN_OR_RETURN(x.d, Dispatcher::create(comm, split.nano.batches[n], split.plans[n], heads, o2));
          if (x.d->num_local_rows() != static_cast<int64_t>(x.rows.size())) return internal_error("nano-batch rows");
          x.q = gather(q, x.rows, qr), x.k = gather(k, x.rows, kr), x.v = gather(v, x.rows, kr), x.d_o = gather(d_o, x.rows, qr);
          x.o.resize(x.q.size()), x.lse.resize(x.rows.size() * lr), x.dq.resize(x.q.size());
          x.dk.resize(x.k.size()), x.dv.resize(x.k.size());
        }
        nano[1].s.held = &nano[0].s;
        auto fwd = [](Nano& x) { return x.d->forward({x.q.data(), x.k.data(), x.v.data(), x.o.data(), x.lse.data()}, x.s); };
        auto bwd = [](Nano& x) {
          return x.d->backward({nullptr, nullptr, nullptr, x.o.data(), x.lse.data(), x.d_o.data(), x.dq.data(), x.dk.data(), x.dv.data()}, x.s);
        };
        DISTCA_RETURN_IF_ERROR(fwd(nano[0]));
        DISTCA_RETURN_IF_ERROR(fwd(nano[1]));
        if (wrong_order) {
          DISTCA_RETURN_IF_ERROR(bwd(nano[0]));
          return bwd(nano[1]);
        }
        DISTCA_RETURN_IF_ERROR(bwd(nano[1]));
        DISTCA_RETURN_IF_ERROR(bwd(nano[0]));
        // Compare row by row: A's rows from A (context rows' dK/dV: A's plus B's), B's own from B.
        double worst = 0;
        auto check = [&](const std::vector<float>& want, int64_t row, const float* got, int64_t width) {
          for (int64_t i = 0; i < width; ++i) {
            worst = std::max(worst, static_cast<double>(std::abs(want[row * width + i] - got[i])) /
                                        (1.0 + std::abs(want[row * width + i])));
          }
        };
        const int64_t a_rows = static_cast<int64_t>(nano[0].rows.size());
        for (int64_t i = 0; i < a_rows; ++i) {
          const int64_t row = nano[0].rows[i];
          const Nano& x = nano[0];
          check(o, row, &x.o[i * qr], qr), check(lse, row, &x.lse[i * lr], lr), check(dq, row, &x.dq[i * qr], qr);
          std::vector<float> gk(x.dk.begin() + i * kr, x.dk.begin() + (i + 1) * kr), gv(x.dv.begin() + i * kr, x.dv.begin() + (i + 1) * kr);
          const int64_t j = i - (a_rows - ctx);  // its row in B's layout, if a context row
          for (int64_t e = 0; j >= 0 && e < kr; ++e) gk[e] += nano[1].dk[j * kr + e], gv[e] += nano[1].dv[j * kr + e];
          check(dk, row, gk.data(), kr), check(dv, row, gv.data(), kr);
        }
        for (size_t i = static_cast<size_t>(ctx); i < nano[1].rows.size(); ++i) {
          const int64_t row = nano[1].rows[i];
          const Nano& x = nano[1];
          check(o, row, &x.o[i * qr], qr), check(lse, row, &x.lse[i * lr], lr), check(dq, row, &x.dq[i * qr], qr);
          check(dk, row, &x.dk[i * kr], kr), check(dv, row, &x.dv[i * kr], kr);
        }
        if (worst > 1e-4) return internal_error(fmt::format("rank {}: held K/V results differ from the whole plan's by {}", r, worst));
        return Status::ok();
      });
      for (int r = 0; r < R; ++r) {
        if (!wrong_order) {
          EXPECT_TRUE(statuses[r].is_ok()) << policy << ": " << statuses[r].to_string();
        } else if (!statuses[r].is_ok()) {
          EXPECT_NE(statuses[r].message().find("must compute before"), std::string::npos) << statuses[r].to_string();
        }
      }
      if (wrong_order) {  // the rank that serves held rows refuses
        EXPECT_TRUE(!statuses[0].is_ok() || !statuses[1].is_ok()) << policy;
      }
    }
  }
}

// From stage b_leads_from on, B computes first; every communication is still in flight over the
// other nano-batch's compute but the one at the turn; the sequential order runs B's later
// stages before A's.
TEST(PingPong, BLeadsFromTheTurn) {
  const auto ops = pingpong_schedule(4, 2);
  std::vector<std::pair<int, int>> computes;
  for (const ScheduleOp& op : ops) {
    if (op.kind == OpKind::kCompute) computes.emplace_back(op.nano, op.stage);
  }
  const std::vector<std::pair<int, int>> want = {{0, 0}, {1, 0}, {0, 1}, {1, 1}, {1, 2}, {0, 2}, {1, 3}, {0, 3}};
  EXPECT_EQ(computes, want);
  // The exchanges no compute runs under: B's just before the turn (B waits for it at once), and
  // the last one.
  auto unhidden = [](const std::vector<ScheduleOp>& schedule) {
    std::vector<std::pair<int, int>> out;
    for (size_t i = 0; i < schedule.size(); ++i) {
      if (schedule[i].kind != OpKind::kStart) continue;
      bool covered = false;
      for (size_t j = i + 1; j < schedule.size(); ++j) {
        if (schedule[j].kind == OpKind::kFinish && schedule[j].nano == schedule[i].nano && schedule[j].stage == schedule[i].stage) break;
        covered |= schedule[j].kind == OpKind::kCompute;
      }
      if (!covered) out.emplace_back(schedule[i].nano, schedule[i].stage);
    }
    return out;
  };
  EXPECT_EQ(unhidden(ops), (std::vector<std::pair<int, int>>{{1, 1}, {0, 3}}));
  EXPECT_EQ(unhidden(pingpong_schedule(4)), (std::vector<std::pair<int, int>>{{1, 3}}));
  std::vector<std::pair<int, int>> seq;
  for (const ScheduleOp& op : sequential_schedule(4, 2)) {
    if (op.kind == OpKind::kCompute) seq.emplace_back(op.nano, op.stage);
  }
  const std::vector<std::pair<int, int>> want_seq = {{0, 0}, {0, 1}, {1, 0}, {1, 1}, {1, 2}, {1, 3}, {0, 2}, {0, 3}};
  EXPECT_EQ(seq, want_seq);
  EXPECT_EQ(pingpong_schedule(4, -1), pingpong_schedule(4));
}

// Ping-pong forward + backward of both nano-batches through dispatchers gives bit-identical
// results to running each pass whole.
TEST(PingPong, SameResultsAsOnePassAtATime) {
  const int R = 3;
  auto batch = plan::pack_documents({200, 30, 1, 150, 260, 70, 15, 90}, R, 272);
  ASSERT_TRUE(batch.is_ok());
  auto split = layout::split_step_by_documents(batch.value());
  ASSERT_TRUE(split.is_ok());
  std::array<plan::Plan, 2> plans;
  for (int n = 0; n < 2; ++n) {
    auto p = testing::make_plan(split.value().batches[n], "minmax");
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    plans[n] = p.value();
  }
  for (auto mode : {plan::BackwardMode::kStateless, plan::BackwardMode::kStateful}) {
    auto statuses = LocalWorld::run(R, [&](Communicator& comm) -> Status {
      const layout::HeadShape heads{4, 2, 32};
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
