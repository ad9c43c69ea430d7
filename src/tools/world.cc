#include "world.h"

#include <cstdlib>

#include <fmt/format.h>

#include "distca/comm/local_comm.h"
#if DISTCA_HAVE_MPI
#include "distca/comm/mpi_comm.h"
#endif

namespace distca::tools {

bool is_under_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

namespace {
int exit_code(const Status& s) {
  if (s.is_ok()) return 0;
  return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ? 2 : 1;
}
}  // namespace

int run_world(const std::string& command, int local_ranks, const std::function<Status(comm::Communicator&)>& body) {
  if (is_under_mpi()) {
#if DISTCA_HAVE_MPI
    auto created = comm::MpiComm::create(nullptr, nullptr);
    if (!created.is_ok()) {
      fmt::print(stderr, "distca {}: error: {}\n", command, created.status().message());
      return 1;
    }
    comm::MpiComm& c = *created.value();
    const Status s = body(c);
    if (!s.is_ok()) {
      fmt::print(stderr, "distca {}: rank {}: error: {}\n", command, c.rank(), s.message());
      std::fflush(stderr);
      c.abort(s.message());  // the other ranks may be inside a collective: end the whole job
    }
    return exit_code(s);
#else
    fmt::print(stderr, "distca {}: error: started by mpirun, but this build has no MPI (install Open MPI with "
                       "scripts/install-deps.sh and rebuild)\n", command);
    return 1;
#endif
  }
  if (local_ranks < 1 || local_ranks > 256) {
    fmt::print(stderr, "distca {}: error: --ranks must be 1..256, got {}\n", command, local_ranks);
    return 2;
  }
  const auto statuses = comm::LocalWorld::run(local_ranks, body);
  // The first rank's own error (not a peer's report of it) names the cause.
  for (size_t r = 0; r < statuses.size(); ++r) {
    const bool is_peer_report = statuses[r].message().starts_with("rank ") && statuses[r].message().find(" failed: ") != std::string::npos;
    if (!statuses[r].is_ok() && !is_peer_report) {
      fmt::print(stderr, "distca {}: rank {}: error: {}\n", command, r, statuses[r].message());
      return exit_code(statuses[r]);
    }
  }
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].is_ok()) {
      fmt::print(stderr, "distca {}: rank {}: error: {}\n", command, r, statuses[r].message());
      return exit_code(statuses[r]);
    }
  }
  return 0;
}

}  // namespace distca::tools
