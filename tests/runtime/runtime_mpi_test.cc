// The CAD runtime under mpirun (`-np 2` and `-np 4` under ctest): distributed equals colocated
// and exact routing for every policy, and for a plan that splits key ranges, in both backward
// modes, on MpiComm. With --fault, rank 1 exits in the middle of a pass: the job must end with
// a non-zero exit well before the timeout (ctest's TIMEOUT guards it).
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "../comm/mpi_test_main.h"
#include "harness.h"

int main(int argc, char** argv) {
  using namespace distca;
  const comm::testing::MpiTest t = comm::testing::start_mpi_test(&argc, &argv);
  if (!t.comm) return 1;
  comm::MpiComm& c = *t.comm;
  const int R = c.size();
  auto fail = [&t](const Status& st) { return t.fail(st); };
  auto batch = plan::pack_documents({300, 1, 17, 90, 2, 500, 33, 1, 64, 250}, R, 1260 / R);
  if (!batch.is_ok()) return fail(batch.status());
  if (t.is_fault) {
    auto plan = runtime::testing::make_plan(batch.value(), "minmax");
    if (!plan.is_ok()) return fail(plan.status());
    if (c.rank() == 1) std::exit(3);  // gone without a word, mid-job
    Status st = runtime::testing::check_routing(c, batch.value(), plan.value(), plan::BackwardMode::kStateless);
    fmt::print(stderr, "rank {}: returned: {}\n", c.rank(), st.to_string());
    return st.is_ok() ? 0 : 1;
  }
  int checks = 0;
  for (const std::string policy : {"none", "distca", "minmax", "minbytes"}) {
    auto plan = runtime::testing::make_plan(batch.value(), policy);
    if (!plan.is_ok()) return fail(plan.status());
    for (auto mode : {plan::BackwardMode::kStateless, plan::BackwardMode::kStateful}) {
      runtime::testing::DispatchCase dc;
      dc.mode = mode;
      dc.seed = 1000 + checks;
      if (Status st = runtime::testing::check_against_colocated(c, batch.value(), plan.value(), dc); !st.is_ok()) {
        return fail(st);
      }
      if (Status st = runtime::testing::check_routing(c, batch.value(), plan.value(), mode); !st.is_ok()) return fail(st);
      checks += 2;
    }
  }
  // Key-range splits of a causal plan: partial results from several servers merged at the owners.
  auto causal = runtime::testing::make_plan(batch.value(), "minmax");
  if (!causal.is_ok()) return fail(causal.status());
  auto split = runtime::testing::split_key_ranges(batch.value(), causal.value(), 17);
  if (!split.is_ok()) return fail(split.status());
  for (auto mode : {plan::BackwardMode::kStateless, plan::BackwardMode::kStateful}) {
    runtime::testing::DispatchCase dc;
    dc.mode = mode;
    dc.seed = 1000 + checks;
    if (Status st = runtime::testing::check_against_colocated(c, batch.value(), split.value(), dc); !st.is_ok()) {
      return fail(st);
    }
    if (Status st = runtime::testing::check_routing(c, batch.value(), split.value(), mode); !st.is_ok()) return fail(st);
    checks += 2;
  }
  if (c.rank() == 0) fmt::print("runtime checks passed on {} ranks ({} checks)\n", R, checks);
  return 0;
}
