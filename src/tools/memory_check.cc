#include "memory_check.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "world.h"

namespace distca::tools {

int64_t available_memory_bytes() {
  const int64_t page = static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
  int64_t available = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * page;
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") {
      available = kib * 1024;
      break;
    }
  }
  // An address-space limit (ulimit -v) caps it: what is left of the limit.
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    int64_t pages = 0;
    std::ifstream statm("/proc/self/statm");
    statm >> pages;  // the process's address space now, in pages
    available = std::min(available, std::max<int64_t>(0, static_cast<int64_t>(limit.rlim_cur) - pages * page));
  }
  return available;
}

int ranks_on_this_machine(int local_ranks) {
  if (!is_under_mpi()) return local_ranks;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    if (const char* v = std::getenv(var)) return std::max(1, std::atoi(v));
  }
  return 1;
}

int world_size(int local_ranks) {
  if (!is_under_mpi()) return local_ranks;
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const char* v = std::getenv(var)) return std::max(1, std::atoi(v));
  }
  return 1;
}

std::string memory_text(int64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1024.0 * 1024 * 1024));
}

Status check_memory(const std::string& what, int64_t bytes, const std::string& parts, double share,
                    const std::string& fix) {
  const int64_t available = available_memory_bytes();
  const auto limit = static_cast<int64_t>(share * static_cast<double>(available));
  if (bytes <= limit) return Status::ok();
  const std::string of = share >= 1 ? fmt::format("and {} is available", memory_text(available))
                                    : fmt::format("more than {:g} % of the {} available ({}{})", 100 * share,
                                                  memory_text(available), memory_text(limit),
                                                  ", what a benchmark keeps to so that the machine stays usable");
  return invalid_argument(
      fmt::format("{} needs about {} of memory on this machine ({}), {}; {}", what, memory_text(bytes), parts, of, fix));
}

}  // namespace distca::tools
