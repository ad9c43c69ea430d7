// What a memory cgroup leaves a run (core/memory.h), on cgroup folders made here: v2
// (unified, and hybrid's unified/), v1, limits on an ancestor, and a cgroup namespace whose path
// is not under the mount.
#include "distca/core/memory.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

namespace distca {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

// A fresh folder standing for /sys/fs/cgroup.
fs::path fresh_root(const std::string& name) {
  const fs::path root = fs::temp_directory_path() / ("distca_memory_check_test." + std::to_string(getpid())) / name;
  fs::remove_all(root);
  fs::create_directories(root);
  return root;
}

void write(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path) << text;
}

// Issue 72 row 8: a 6 GiB cgroup v2 limit with 1 GiB used, 256 MiB of it inactive file cache,
// leaves 5.25 GiB, however much the machine has.
TEST(MemoryCheck, CgroupV2LimitLessWhatTheCgroupUses) {
  const fs::path root = fresh_root("v2");
  write(root / "job/memory.max", std::to_string(6144 * kMiB) + "\n");
  write(root / "job/memory.current", std::to_string(1024 * kMiB) + "\n");
  write(root / "job/memory.stat", "anon 123\ninactive_file " + std::to_string(256 * kMiB) + "\nactive_file 7\n");
  EXPECT_EQ(cgroup_memory_headroom_bytes("0::/job\n", root.string()), (6144 - 1024 + 256) * kMiB);
  // "max" is no limit; an ancestor's limit still holds.
  write(root / "job/memory.max", "max\n");
  EXPECT_EQ(cgroup_memory_headroom_bytes("0::/job\n", root.string()), kNoLimit);
  write(root / "memory.max", std::to_string(2048 * kMiB));
  write(root / "memory.current", std::to_string(512 * kMiB));
  EXPECT_EQ(cgroup_memory_headroom_bytes("0::/job\n", root.string()), 1536 * kMiB);
}

TEST(MemoryCheck, CgroupV1AndHybridHierarchies) {
  const fs::path root = fresh_root("v1");
  // v1: memory.limit_in_bytes, usage_in_bytes and total_inactive_file; "no limit" is 2^63 rounded.
  write(root / "memory/a/b/memory.limit_in_bytes", std::to_string(4096 * kMiB));
  write(root / "memory/a/b/memory.usage_in_bytes", std::to_string(1000 * kMiB));
  write(root / "memory/a/b/memory.stat", "cache 5\ntotal_inactive_file " + std::to_string(100 * kMiB) + "\n");
  write(root / "memory/a/memory.limit_in_bytes", "9223372036854771712");
  const std::string cgroup = "12:pids:/x\n4:cpu,memory:/a/b\n1:name=systemd:/\n0::/\n";
  EXPECT_EQ(cgroup_memory_headroom_bytes(cgroup, root.string()), (4096 - 1000 + 100) * kMiB);
  // Hybrid: v2 mounted at unified/ beside v1; the lesser headroom counts.
  write(root / "unified/memory.max", std::to_string(1024 * kMiB));
  write(root / "unified/memory.current", "0");
  EXPECT_EQ(cgroup_memory_headroom_bytes(cgroup, root.string()), 1024 * kMiB);
  // Nothing mounted, or no memory controller: no limit.
  EXPECT_EQ(cgroup_memory_headroom_bytes(cgroup, (root / "none").string()), kNoLimit);
  EXPECT_EQ(cgroup_memory_headroom_bytes("3:cpu:/a/b\n", (root / "none").string()), kNoLimit);
}

// In a container the path /proc/self/cgroup names may not exist under the mount: the mount's
// own files are the container's cgroup.
TEST(MemoryCheck, CgroupPathOutsideTheMountCountsTheMountsOwnLimit) {
  const fs::path root = fresh_root("namespace");
  write(root / "memory.max", std::to_string(512 * kMiB));
  write(root / "memory.current", std::to_string(100 * kMiB));
  EXPECT_EQ(cgroup_memory_headroom_bytes("0::/kubepods/pod1/abc\n", root.string()), 412 * kMiB);
  // Usage above the limit leaves nothing, not a negative amount.
  write(root / "memory.current", std::to_string(600 * kMiB));
  EXPECT_EQ(cgroup_memory_headroom_bytes("0::/\n", root.string()), 0);
}

// The machine's own answer is never more than MemAvailable and never negative.
TEST(MemoryCheck, AvailableMemoryIsPositiveAndWithinTheMachine) {
  const int64_t available = available_memory_bytes();
  EXPECT_GT(available, 0);
  EXPECT_LE(available, static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE)));
}

}  // namespace
}  // namespace distca
