#include "world.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "distca/core/json.h"

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

bool is_primary_process() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const char* v = std::getenv(var)) return std::strcmp(v, "0") == 0;
  }
  return true;
}

void print_error_line(const std::string& line) {
  if (!is_primary_process()) {
    // Rank 0 found the same error and said so, unless this rank was started differently (another
    // command line): then rank 0 waits in MPI_Init and only this rank knows. Wait long enough for
    // mpirun to end this process if rank 0 failed too, then speak.
    std::this_thread::sleep_for(std::chrono::seconds(3));
    std::string rank = "?";
    for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
      if (const char* v = std::getenv(var)) rank = v;
    }
    const size_t colon = line.find(": error: ");
    fmt::print(stderr, "{}\n", colon == std::string::npos ? line : line.substr(0, colon) + ": rank " + rank + line.substr(colon));
    std::fflush(stderr);
    return;
  }
  fmt::print(stderr, "{}\n", line);
}

void print_usage_error(const std::string& command, const std::string& message) {
  print_error_line(fmt::format("distca {}: error: {}", command, message));
}

int exit_code(const Status& s) {
  if (s.is_ok()) return kExitOk;
  return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ? kExitBadInput : kExitFailed;
}

namespace {

// How long a failed rank waits for its peers to reach the end too before it concludes that they
// are stuck waiting for it, and aborts.
constexpr std::chrono::seconds kFailedRankGrace{5};

// The grace under mpirun. Where ORTE's TCP keepalive is set short (OMPI_MCA_oob_tcp_keepalive_*,
// as scripts/hosts.py's flags do), a host whose link dropped is declared lost by mpirun, and its
// daemon loses mpirun, within keepalive_time + keepalive_intvl x keepalive_probes seconds of the
// last packet, and the job ends on every host. Only while a daemon's connection carries no unsent
// data, though: MPI_Abort (or an error line) before then makes mpirun (or the cut-off daemon)
// send to the unreachable end, and then TCP retransmits for a quarter of an hour instead (mpirun
// hangs in "abort is already in progress", the cut-off daemon and its ranks stay). So a failed
// rank, which may be failing because a link dropped, stays silent that long (plus a margin)
// before it speaks and aborts. Open MPI's defaults (300 + 20 x 9 s) are too long to wait for.
std::chrono::milliseconds failed_rank_grace() {
  auto mca = [](const char* name, long fallback) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return fallback;
    char* end = nullptr;
    const long x = std::strtol(v, &end, 10);
    return *end == '\0' ? x : fallback;
  };
  const long time = mca("OMPI_MCA_oob_tcp_keepalive_time", 300);
  const long intvl = mca("OMPI_MCA_oob_tcp_keepalive_intvl", 20);
  const long probes = mca("OMPI_MCA_oob_tcp_keepalive_probes", 9);
  constexpr long kMargin = 3, kMostToWait = 60;
  if (time <= 0 || intvl < 0 || probes < 0 || time > kMostToWait || intvl > kMostToWait || probes > kMostToWait) {
    return kFailedRankGrace;
  }
  const long window = time + intvl * probes + kMargin;
  if (window > kMostToWait) return kFailedRankGrace;
  return std::max<std::chrono::milliseconds>(kFailedRankGrace, std::chrono::seconds(window));
}

std::string& run_settings() {
  static std::string settings;
  return settings;
}

// "name=value" lines in order, under their [section]s, as (section.name, value).
std::vector<std::pair<std::string, std::string>> settings_lines(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::string section;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    if (line.empty()) continue;
    if (line.front() == '[' && line.back() == ']') {
      section = line.substr(1, line.size() - 2);
      continue;
    }
    const size_t eq = line.find('=');
    const std::string key = eq == std::string::npos ? line : line.substr(0, eq);
    out.emplace_back(section.empty() ? key : section + "." + key, eq == std::string::npos ? "" : line.substr(eq + 1));
  }
  return out;
}

std::string error_line(const std::string& command, int rank, int size, const std::string& message) {
  if (size == 1) return fmt::format("distca {}: error: {}", command, message);
  return fmt::format("distca {}: rank {}: error: {}", command, rank, message);
}

}  // namespace

void set_run_settings(std::string settings) { run_settings() = std::move(settings); }

std::string first_difference(const std::string& a, int rank_a, const std::string& b, int rank_b) {
  const auto la = settings_lines(a), lb = settings_lines(b);
  auto flag = [](const std::string& key) {
    // "bench.step.steps" -> "--steps": the option's own name is what the user typed.
    const size_t dot = key.rfind('.');
    return "--" + (dot == std::string::npos ? key : key.substr(dot + 1));
  };
  auto shown = [](std::string v) {
    if (v.size() >= 2 && v.front() == '"' && v.back() == '"') v = v.substr(1, v.size() - 2);  // CLI11 quotes strings
    return v.empty() ? std::string("unset") : text_excerpt(v);
  };
  for (size_t i = 0; i < std::max(la.size(), lb.size()); ++i) {
    if (i < la.size() && i < lb.size() && la[i] == lb[i]) continue;
    if (i < la.size() && i < lb.size() && la[i].first == lb[i].first) {
      return fmt::format("{} is {} on rank {} and {} on rank {}", flag(la[i].first), shown(la[i].second), rank_a,
                         shown(lb[i].second), rank_b);
    }
    const auto& [key, value] = i < la.size() ? la[i] : lb[i];
    return fmt::format("{} is set on rank {} only", flag(key), i < la.size() ? rank_a : rank_b);
  }
  return a == b ? "" : fmt::format("rank {} and rank {} were started differently", rank_a, rank_b);
}

Status check_same_settings(comm::Communicator& c, const std::string& settings) {
  const int size = c.size();
  const auto n = static_cast<size_t>(size);
  // Every rank's length, then every rank's text, to every rank.
  std::vector<int64_t> eight(n, sizeof(int64_t)), offsets(n), lengths(n);
  for (size_t r = 0; r < n; ++r) offsets[r] = static_cast<int64_t>(r * sizeof(int64_t));
  const std::vector<int64_t> mine(n, static_cast<int64_t>(settings.size()));
  DISTCA_RETURN_IF_ERROR(c.all_to_all_v({reinterpret_cast<const std::byte*>(mine.data()), eight, offsets,
                                         reinterpret_cast<std::byte*>(lengths.data()), eight, offsets}));
  std::vector<int64_t> send_counts(n, static_cast<int64_t>(settings.size())), send_offsets(n), recv_offsets(n);
  std::string send, recv;
  for (size_t r = 0; r < n; ++r) {
    send_offsets[r] = static_cast<int64_t>(send.size());
    send += settings;
    recv_offsets[r] = static_cast<int64_t>(recv.size());
    if (lengths[r] < 0 || lengths[r] > (int64_t{1} << 24)) return internal_error("settings exchange: a bad length");
    recv.resize(recv.size() + static_cast<size_t>(lengths[r]));
  }
  DISTCA_RETURN_IF_ERROR(c.all_to_all_v({reinterpret_cast<const std::byte*>(send.data()), send_counts, send_offsets,
                                         reinterpret_cast<std::byte*>(recv.data()), lengths, recv_offsets}));
  const std::string first = recv.substr(0, static_cast<size_t>(lengths[0]));
  for (size_t r = 1; r < n; ++r) {
    const std::string other = recv.substr(static_cast<size_t>(recv_offsets[r]), static_cast<size_t>(lengths[r]));
    if (other != first) {
      return invalid_argument(fmt::format("the ranks were started with different settings: {}; start every rank with "
                                          "the same command line",
                                          first_difference(first, 0, other, static_cast<int>(r))));
    }
  }
  return Status::ok();
}

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
      s = check_same_settings(c, run_settings());
      if (s.is_ok()) s = body(c);
    } catch (const std::bad_alloc&) {
      s = internal_error("out of memory (the machine could not give this rank the memory it asked for)");
    } catch (const std::exception& e) {
      s = internal_error(fmt::format("exception: {}", e.what()));
    }
    const int code = exit_code(s);
    // A rank that is done waits as long as any collective may; a failed one only briefly.
    const std::chrono::milliseconds grace = failed_rank_grace();
    auto outcome = c.agree_on_outcome(code, code == 0 ? options.timeout + grace : grace);
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
  // A rank out of memory says so in words (LocalWorld reports any other exception by its what()).
  auto guarded = [&body](comm::Communicator& c) -> Status {
    try {
      return body(c);
    } catch (const std::bad_alloc&) {
      return internal_error("out of memory (the machine could not give this rank the memory it asked for)");
    }
  };
  const auto statuses = comm::LocalWorld::run(local_ranks, guarded, options.timeout);
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
