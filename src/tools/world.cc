#include "world.h"

#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>

#include <fmt/format.h>

#include "distca/comm/local_comm.h"
#if DISTCA_HAVE_MPI
#include "distca/comm/mpi_comm.h"
#endif

namespace distca::tools {

Result<std::chrono::milliseconds> timeout_from_seconds(double seconds) {
  if (!(seconds >= 1) || seconds > 86400) {
    return invalid_argument(fmt::format("--timeout must be 1..86400 seconds, got {}", seconds));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

bool is_under_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

bool is_primary_process() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const char* v = std::getenv(var)) return std::strcmp(v, "0") == 0;
  }
  return true;
}

void print_usage_error(const std::string& command, const std::string& message) {
  if (!is_primary_process()) return;
  fmt::print(stderr, "distca {}: error: {}\n", command, message);
}

int exit_code(const Status& s) {
  if (s.is_ok()) return kExitOk;
  return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ? kExitBadInput : kExitFailed;
}

namespace {

// How long a failed rank waits for its peers to reach the end too before it concludes that they
// are stuck waiting for it, and aborts.
constexpr std::chrono::seconds kFailedRankGrace{5};

std::string error_line(const std::string& command, int rank, int size, const std::string& message) {
  if (size == 1) return fmt::format("distca {}: error: {}", command, message);
  return fmt::format("distca {}: rank {}: error: {}", command, rank, message);
}

}  // namespace

int run_world(const std::string& command, int local_ranks, const std::function<Status(comm::Communicator&)>& body,
              const WorldOptions& options) {
  if (is_under_mpi()) {
    if (options.is_ranks_given) {
      print_usage_error(command, "--ranks runs ranks as threads in one process; under mpirun the ranks are mpirun's "
                                 "-np: drop --ranks");
      return kExitBadInput;
    }
#if DISTCA_HAVE_MPI
    auto created = comm::MpiComm::create(nullptr, nullptr);
    if (!created.is_ok()) {
      fmt::print(stderr, "distca {}: error: {}\n", command, created.status().message());
      return kExitFailed;
    }
    comm::MpiComm& c = *created.value();
    c.set_timeout(options.timeout);
    Status s;
    try {
      s = body(c);
    } catch (const std::bad_alloc&) {
      s = internal_error("out of memory (the machine could not give this rank the memory it asked for)");
    } catch (const std::exception& e) {
      s = internal_error(fmt::format("exception: {}", e.what()));
    }
    const int code = exit_code(s);
    // A rank that is done waits as long as any collective may; a failed one only briefly.
    auto outcome = c.agree_on_outcome(code, code == 0 ? options.timeout + kFailedRankGrace : kFailedRankGrace);
    if (!outcome.is_ok()) {
      // Some peer never came: it waits in an operation for this rank (or is stuck). Only an
      // abort ends the job; this rank's own error is the one to show.
      c.abort_with(code == 0 ? kExitFailed : code,
                   error_line(command, c.rank(), c.size(), s.is_ok() ? outcome.status().message() : s.message()));
    }
    const comm::MpiComm::Outcome o = outcome.value();
    if (o.first_failed_rank == c.rank()) {
      // Every rank knows; the lowest failing one speaks. A rank-independent error (bad data
      // read by every rank) is shown without a rank.
      fmt::print(stderr, "{}\n", o.first_failed_rank == 0 ? fmt::format("distca {}: error: {}", command, s.message())
                                                            : error_line(command, c.rank(), c.size(), s.message()));
      std::fflush(stderr);
    }
    return o.code;  // MpiComm's destructor finalizes
#else
    fmt::print(stderr, "distca {}: error: started by mpirun, but this build has no MPI (install Open MPI with "
                       "scripts/install-deps.sh and rebuild)\n", command);
    return kExitFailed;
#endif
  }
  if (local_ranks < 1 || local_ranks > 256) {
    fmt::print(stderr, "distca {}: error: --ranks must be 1..256, got {}\n", command, local_ranks);
    return kExitBadInput;
  }
  const auto statuses = comm::LocalWorld::run(local_ranks, body, options.timeout);
  // The first rank's own error (not a peer's report of it) names the cause.
  auto is_peer_report = [](const Status& s) {
    return s.message().starts_with("rank ") && s.message().find(" failed: ") != std::string::npos;
  };
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t r = 0; r < statuses.size(); ++r) {
      if (statuses[r].is_ok() || (pass == 0 && is_peer_report(statuses[r]))) continue;
      const int size = static_cast<int>(statuses.size());
      fmt::print(stderr, "{}\n", r == 0 ? fmt::format("distca {}: error: {}", command, statuses[r].message())
                                        : error_line(command, static_cast<int>(r), size, statuses[r].message()));
      return exit_code(statuses[r]);
    }
  }
  return kExitOk;
}

}  // namespace distca::tools
