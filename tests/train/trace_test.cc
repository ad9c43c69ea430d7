// The training timeline (core/trace.h, distca train --trace): a rank's spans of each part add up
// to the step record's part, the exchanges in flight overlap compute under ping-pong and not
// without it, and the document is Chrome trace-event JSON.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "distca/comm/local_comm.h"
#include "distca/core/trace.h"
#include "distca/train/data_parallel.h"

namespace distca::train {
namespace {

struct Traced {
  std::vector<StepRecord> records;  // rank 0's (every rank's parts are in each)
  std::vector<nlohmann::json> ranks;  // trace::to_json of each rank's recorder
};

Traced run(const std::string& pingpong, int64_t steps) {
  auto p = model::find_preset("tiny");
  EXPECT_TRUE(p.is_ok());
  TrainOptions o;
  o.model = p.value().model;
  o.model.num_layers = 3;
  o.optim = p.value().optim;
  o.context = 1024;
  o.workload = "skewed";
  o.steps = steps;
  o.backends = {"colocated", "cad"};
  o.pingpong = pingpong;
  Traced out;
  out.ranks.resize(2);
  const auto statuses = comm::LocalWorld::run(2, [&](comm::Communicator& c) -> Status {
    trace::Recorder recorder(2 * steps);
    trace::set_active(&recorder);
    DISTCA_ASSIGN_OR_RETURN(auto t, DataParallelTrainer::create(c, o));
    for (int64_t i = 0; i < steps; ++i) {
      DISTCA_ASSIGN_OR_RETURN(auto records, t->step());
      if (c.rank() == 0) out.records.insert(out.records.end(), records.begin(), records.end());
    }
    trace::set_active(nullptr);
    out.ranks[static_cast<size_t>(c.rank())] = trace::to_json(recorder);
    return Status::ok();
  });
  for (const Status& s : statuses) EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

using Interval = std::pair<double, double>;

std::vector<Interval> merged(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const Interval& x : v) {
    if (!out.empty() && x.first <= out.back().second) {
      out.back().second = std::max(out.back().second, x.second);
    } else {
      out.push_back(x);
    }
  }
  return out;
}

double overlap(const std::vector<Interval>& a, const std::vector<Interval>& b) {
  double total = 0;
  for (const Interval& x : a) {
    for (const Interval& y : b) total += std::max(0.0, std::min(x.second, y.second) - std::max(x.first, y.first));
  }
  return total;
}

// For each step and rank of the CAD backend: the exchanges' time in flight and its overlap with
// the rank's compute spans (linear and attention); and the parts' sums checked on the way.
std::pair<double, double> check(const Traced& t) {
  double flight = 0, hidden = 0;
  const nlohmann::json doc = trace::chrome_trace(t.ranks, {{"source", "test"}});
  // The document: Chrome trace events, complete ("X") spans with the fields a viewer reads.
  const nlohmann::json parsed = nlohmann::json::parse(doc.dump());
  EXPECT_EQ(parsed["otherData"]["format"], "distca-trace");
  int spans = 0;
  for (const auto& e : parsed["traceEvents"]) {
    EXPECT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("tid") && e.contains("name")) << e.dump();
    if (!e.contains("ph") || e["ph"] != "X") continue;
    ++spans;
    EXPECT_GE(e["ts"].get<double>(), 0.0);
    EXPECT_GE(e["dur"].get<double>(), 0.0);
    EXPECT_TRUE(e["args"].contains("step"));
  }
  EXPECT_GT(spans, 100);
  for (const StepRecord& r : t.records) {
    const std::string label = std::to_string(r.step) + " " + r.backend;
    for (size_t rank = 0; rank < r.ranks.size(); ++rank) {
      std::map<std::string, double> sums;  // self times: a span less the spans inside it
      std::vector<Interval> exchange, compute;
      struct Span {
        int64_t t0, t1;
        std::string part;
      };
      std::vector<Span> main;
      int found = 0;
      for (const auto& s : t.ranks[rank]) {
        if (s["step"] != label) continue;
        ++found;
        for (const auto& e : s["events"]) {
          const std::string part = e[1];
          const int64_t t0 = e[5].get<int64_t>(), t1 = e[6].get<int64_t>();
          if (e[2] == trace::kExchange) {
            exchange.emplace_back(static_cast<double>(t0) * 1e-9, static_cast<double>(t1) * 1e-9);
            continue;
          }
          main.push_back({t0, t1, part});
          // Compute: the linear and attention spans, less the passes that hold the others.
          const std::string name = e[0];
          const bool is_pass = name == "forward pass" || name == "backward pass" || name == "ping-pong schedule";
          if ((part == "linear" || part == "attention") && !is_pass) {
            compute.emplace_back(static_cast<double>(t0) * 1e-9, static_cast<double>(t1) * 1e-9);
          }
        }
      }
      // Nesting: outermost first; each span's time less its direct children's.
      std::sort(main.begin(), main.end(), [](const Span& a, const Span& b) { return a.t0 != b.t0 ? a.t0 < b.t0 : a.t1 > b.t1; });
      std::vector<size_t> open;
      std::vector<double> self(main.size());
      for (size_t i = 0; i < main.size(); ++i) {
        while (!open.empty() && main[open.back()].t1 <= main[i].t0) open.pop_back();
        self[i] = static_cast<double>(main[i].t1 - main[i].t0) * 1e-9;
        if (!open.empty() && main[i].t1 <= main[open.back()].t1) self[open.back()] -= self[i];
        open.push_back(i);
      }
      for (size_t i = 0; i < main.size(); ++i) sums[main[i].part] += self[i];
      if (found == 0) continue;  // a step the recorder dropped
      const StepRecord::Rank& x = r.ranks[rank];
      const double tol = 0.02 * x.step;
      const std::string where = label + " rank " + std::to_string(rank);
      EXPECT_NEAR(sums[""] + sums["linear"] + sums["attention"] + sums["comm"] + sums["wait"] + sums["optimizer"] +
                      sums["other"],
                  x.step, tol)
          << where << ": the step span";
      EXPECT_NEAR(sums["linear"], x.linear, tol) << where;
      EXPECT_NEAR(sums["attention"], x.attention, tol) << where;
      EXPECT_NEAR(sums["comm"], x.comm, tol) << where;
      EXPECT_NEAR(sums["wait"], x.wait, tol) << where;
      EXPECT_NEAR(sums["optimizer"], x.optimizer, tol) << where;
      EXPECT_LE(sums["other"], x.other + tol) << where;  // planning; the rest of `other` is bookkeeping
      if (r.backend != "cad") continue;
      const std::vector<Interval> e = merged(exchange);
      for (const Interval& i : e) flight += i.second - i.first;
      hidden += overlap(e, merged(compute));
    }
  }
  return {flight, hidden};
}

TEST(Trace, SpansAddUpToTheStepPartsAndPingPongHidesTheExchange) {
  const Traced on = run("on", 3);
  const Traced off = run("off", 3);
  ASSERT_EQ(on.records.size(), 6u);
  for (const StepRecord& r : on.records) {
    if (r.backend == "cad") {
      EXPECT_EQ(r.split_micro_batches, 1) << "step " << r.step;  // ping-pong ran
    }
  }
  const auto [on_flight, on_hidden] = check(on);
  const auto [off_flight, off_hidden] = check(off);
  EXPECT_GT(on_flight, 0.0);
  EXPECT_GT(off_flight, 0.0);
  // Ping-pong: the other nano-batch computes while an exchange is in flight; without it a rank
  // posts and waits with nothing in between.
  EXPECT_GT(on_hidden, 0.2 * on_flight) << on_hidden << " of " << on_flight << " s";
  EXPECT_EQ(off_hidden, 0.0) << off_hidden << " of " << off_flight << " s";
}

TEST(Trace, TheRecorderKeepsTheLastSteps) {
  trace::Recorder r(2);
  const auto t = SteadyClock::now();
  for (int s = 1; s <= 4; ++s) {
    r.begin_step(std::to_string(s) + " cad");
    r.add({"x", "linear", trace::kMain, -1, -1, trace::ns(t), trace::ns(t) + s});
  }
  ASSERT_EQ(r.steps().size(), 2u);
  EXPECT_EQ(r.steps().front().first, "3 cad");
  EXPECT_EQ(r.steps().back().second.at(0).end_ns - r.steps().back().second.at(0).start_ns, 4);
  EXPECT_EQ(trace::active(), nullptr);  // off unless set, on every thread
  trace::add("ignored", "linear", t, t);  // no recorder: nothing happens
}

}  // namespace
}  // namespace distca::train
