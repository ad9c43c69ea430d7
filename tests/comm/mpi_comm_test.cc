// MpiComm under mpirun: the same collective, point-to-point and group checks as the LocalComm test, on every rank
// (`mpirun -np 2` and `-np 4` under ctest). With --fault, rank 1 fails mid-job: the job must end
// with a non-zero exit, every rank gone, well before the timeout (ctest's TIMEOUT guards it).
#include <fmt/format.h>

#include <chrono>
#include <cstring>

#include "collectives.h"
#include "mpi_test_main.h"

int main(int argc, char** argv) {
  using namespace distca;
  const comm::testing::MpiTest t = comm::testing::start_mpi_test(&argc, &argv);
  if (!t.comm) return 1;
  comm::MpiComm& c = *t.comm;
  if (t.is_fault) {
    if (c.rank() == 1) c.abort("rank 1 fails on purpose (fault test)");
    Status st = c.barrier();  // the others wait here until the job is torn down
    fmt::print(stderr, "rank {}: barrier returned: {}\n", c.rank(), st.to_string());
    return st.is_ok() ? 0 : 1;
  }
  for (int round = 0; round < 6; ++round) {
    if (Status st = comm::testing::check_all_to_all_v(c, round, round % 2 == 1); !st.is_ok()) {
      fmt::print(stderr, "rank {}: {}\n", c.rank(), st.message());
      return 1;
    }
  }
  if (Status st = comm::testing::check_all_reduce(c); !st.is_ok()) {
    fmt::print(stderr, "rank {}: {}\n", c.rank(), st.message());
    return 1;
  }
  if (Status st = comm::testing::check_point_to_point(c); !st.is_ok()) {
    fmt::print(stderr, "rank {}: point to point: {}\n", c.rank(), st.message());
    return 1;
  }
  for (int dp : {1, 2}) {
    if (c.size() % dp != 0) continue;
    if (Status st = comm::testing::check_groups(c, dp); !st.is_ok()) {
      fmt::print(stderr, "rank {}: groups (dp {}): {}\n", c.rank(), dp, st.message());
      return 1;
    }
  }
  if (c.rank() == 0) fmt::print("MpiComm checks passed on {} ranks\n", c.size());
  return 0;
}
