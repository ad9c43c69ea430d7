#include "distca/core/memory.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>


namespace distca {

namespace {

constexpr int64_t kNoCgroupLimit = std::numeric_limits<int64_t>::max();

// The first number in a file, or -1 (missing, unreadable, "max").
int64_t read_number(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word)) return -1;
  int64_t value = 0;
  const auto [end, error] = std::from_chars(word.data(), word.data() + word.size(), value);
  return error == std::errc() && end == word.data() + word.size() ? value : -1;
}

// `key`'s value in a memory.stat file, or 0.
int64_t stat_value(const std::filesystem::path& path, std::string_view key) {
  std::ifstream in(path);
  std::string name;
  int64_t value = 0;
  while (in >> name >> value) {
    if (name == key) return value;
  }
  return 0;
}

// The headroom of one cgroup folder and its ancestors up to `top`: the least of limit - (usage -
// inactive file cache) over those with a limit. v1 reports "no limit" as a page-rounded 2^63 - 1.
int64_t headroom_up_from(std::filesystem::path dir, const std::filesystem::path& top, bool is_v2) {
  int64_t least = kNoCgroupLimit;
  for (;;) {
    const int64_t limit = read_number(dir / (is_v2 ? "memory.max" : "memory.limit_in_bytes"));
    if (limit >= 0 && limit < (int64_t{1} << 62)) {
      const int64_t usage = std::max<int64_t>(0, read_number(dir / (is_v2 ? "memory.current" : "memory.usage_in_bytes")));
      int64_t inactive = stat_value(dir / "memory.stat", is_v2 ? "inactive_file" : "total_inactive_file");
      if (!is_v2 && inactive == 0) inactive = stat_value(dir / "memory.stat", "inactive_file");
      least = std::min(least, std::max<int64_t>(0, limit - std::max<int64_t>(0, usage - inactive)));
    }
    if (dir == top || !dir.has_relative_path() || dir.parent_path() == dir) break;
    dir = dir.parent_path();
  }
  return least;
}

}  // namespace

int64_t cgroup_memory_headroom_bytes(std::string_view proc_self_cgroup, const std::string& root) {
  namespace fs = std::filesystem;
  int64_t least = kNoCgroupLimit;
  std::istringstream lines{std::string(proc_self_cgroup)};
  std::string line;
  while (std::getline(lines, line)) {
    // "hierarchy-id:controllers:path": v2 is "0::/path", v1's memory controller "N:memory:/path"
    // (or with other controllers, "N:cpu,memory:/path").
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? std::string::npos : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    std::vector<std::string> names;
    std::istringstream split(controllers);
    for (std::string name; std::getline(split, name, ',');) names.push_back(name);
    const bool is_v2 = controllers.empty();
    if (!is_v2 && std::find(names.begin(), names.end(), "memory") == names.end()) continue;
    const fs::path relative = fs::path(path).relative_path();
    // v2 at the root (unified) or in unified/ (hybrid); v1 in memory/.
    for (const fs::path& mount : is_v2 ? std::vector<fs::path>{fs::path(root), fs::path(root) / "unified"}
                                       : std::vector<fs::path>{fs::path(root) / "memory"}) {
      std::error_code error;
      if (!fs::is_directory(mount, error)) continue;
      // A cgroup namespace (a container) may show a path that is not under the mount: then the
      // mount's own files are this process's cgroup.
      fs::path dir = relative.empty() ? mount : mount / relative;
      while (dir != mount && !fs::is_directory(dir, error)) dir = dir.parent_path();
      least = std::min(least, headroom_up_from(dir, mount, is_v2));
    }
  }
  return least;
}

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
  // A memory cgroup (a container's, a systemd unit's) caps it: the kernel kills a process that
  // passes the limit, however much the machine has.
  {
    std::ifstream in("/proc/self/cgroup");
    std::stringstream text;
    text << in.rdbuf();
    available = std::min(available, cgroup_memory_headroom_bytes(text.str(), "/sys/fs/cgroup"));
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

bool is_under_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
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

}  // namespace distca
