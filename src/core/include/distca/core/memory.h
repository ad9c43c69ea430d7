// What this machine can give a run, for the commands that allocate by their flags (train, plan,
// bench step, bench link): each estimates its memory from the flags and checks it here before it
// allocates anything large, so that a run too big for the machine is refused with one line
// (exit 2) instead of ending in std::bad_alloc or the kernel's OOM killer.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

#include "distca/core/status.h"

namespace distca {

// MemAvailable (what the kernel can give without swapping), else the machine's physical memory;
// in a memory cgroup, at most what is left of its limit (cgroup_memory_headroom_bytes); under an
// address-space limit (ulimit -v), at most what is left of it.
int64_t available_memory_bytes();
// What the memory cgroups this process is in leave it: over its own cgroup and every ancestor
// that has a limit (cgroup v2 memory.max, v1 memory.limit_in_bytes), the least of the limit less
// what the cgroup uses, not counting its inactive file cache (which the kernel reclaims before it
// kills). `proc_self_cgroup` is /proc/self/cgroup's text, `root` where the hierarchies are
// mounted (/sys/fs/cgroup; v2 there or in its unified/, v1 in memory/). INT64_MAX without a limit.
int64_t cgroup_memory_headroom_bytes(std::string_view proc_self_cgroup, const std::string& root);
// Under an MPI launcher (mpirun, srun): its variables are in the environment.
bool is_under_mpi();
// Processes of this job on this machine: the threads of one process, or mpirun's local ranks.
int ranks_on_this_machine(int local_ranks);
// Ranks of the job: `local_ranks` threads, or mpirun's world.
int world_size(int local_ranks);
// "12.52 GiB".
std::string memory_text(int64_t bytes);

// A benchmark keeps to this share of the available memory, leaving the rest to the system and
// whatever else runs (a training run may take all of it: that is what it is for).
inline constexpr double kBenchMemoryShare = 0.5;

// OK when `bytes` fit in `share` of the available memory; else kInvalidArgument:
// "<what> needs about <bytes> of memory on this machine (<parts>), more than <limit>; <fix>".
Status check_memory(const std::string& what, int64_t bytes, const std::string& parts, double share,
                    const std::string& fix);

}  // namespace distca
