// A per-rank byte budget, shared by the planners that keep one (minmax, minbytes): the forward
// dispatch + return bytes each rank sends and receives, and whether adding flows breaks it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "distca/plan/plan.h"

namespace distca::plan {

// Each rank's forward dispatch + return bytes, sent and received, of a task list.
inline void forward_rank_bytes(const Batch& batch, const TokenBytes& bytes, const std::vector<Task>& tasks,
                               std::vector<int64_t>& send, std::vector<int64_t>& recv) {
  const Traffic t = count_traffic(batch, bytes, tasks);
  const auto& d = t.phases[static_cast<int>(Phase::kFwdDispatch)];
  const auto& r = t.phases[static_cast<int>(Phase::kFwdReturn)];
  send.assign(batch.num_ranks, 0);
  recv.assign(batch.num_ranks, 0);
  for (int32_t k = 0; k < batch.num_ranks; ++k) {
    send[k] = d.send_bytes[k] + r.send_bytes[k];
    recv[k] = d.recv_bytes[k] + r.recv_bytes[k];
  }
}

// Whether base[rank] + the sum of `adds` for that rank exceeds `budget` for any rank (adds are
// (rank, bytes), one rank possibly several times; sorted in place).
inline bool exceeds_budget(std::vector<std::pair<int32_t, int64_t>>& adds, const std::vector<int64_t>& base,
                           int64_t budget) {
  std::sort(adds.begin(), adds.end());
  for (size_t i = 0; i < adds.size();) {
    int64_t sum = 0;
    size_t j = i;
    for (; j < adds.size() && adds[j].first == adds[i].first; ++j) sum += adds[j].second;
    if (base[adds[i].first] + sum > budget) return true;
    i = j;
  }
  return false;
}

}  // namespace distca::plan
