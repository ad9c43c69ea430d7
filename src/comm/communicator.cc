#include "distca/comm/communicator.h"

#include <fmt/format.h>

namespace distca::comm {

namespace {
Status wait_for(Result<std::unique_ptr<Work>> work) {
  if (!work.is_ok()) return work.status();
  return work.value()->wait();
}
}  // namespace

Status Communicator::all_to_all_v(const AllToAllV& a) { return wait_for(all_to_all_v_async(a)); }
Status Communicator::all_reduce_sum(float* data, int64_t count) {
  return wait_for(all_reduce_sum_async(data, count));
}
Status Communicator::broadcast(void* data, int64_t bytes, int root) {
  return wait_for(broadcast_async(data, bytes, root));
}
Status Communicator::barrier() { return wait_for(barrier_async()); }
Status Communicator::send(const void* data, int64_t bytes, int peer, int tag) {
  return wait_for(send_async(data, bytes, peer, tag));
}
Status Communicator::recv(void* data, int64_t bytes, int peer, int tag) {
  return wait_for(recv_async(data, bytes, peer, tag));
}

Status Communicator::check_p2p(const char* what, const void* data, int64_t bytes, int peer, int tag) const {
  if (peer < 0 || peer >= size()) return invalid_argument(fmt::format("{}: peer {} is not a rank of {}", what, peer, size()));
  if (peer == rank()) return invalid_argument(fmt::format("{}: rank {} cannot {} itself", what, peer, what));
  if (tag < 0 || tag > kMaxTag) return invalid_argument(fmt::format("{}: tag {} is not in [0, {}]", what, tag, kMaxTag));
  if (bytes < 0 || (bytes > 0 && data == nullptr)) return invalid_argument(fmt::format("{}: bad buffer ({} bytes)", what, bytes));
  return Status::ok();
}

Status Communicator::check(const AllToAllV& a) const {
  const auto r = static_cast<std::size_t>(size());
  if (a.send_counts.size() != r || a.send_offsets.size() != r || a.recv_counts.size() != r ||
      a.recv_offsets.size() != r) {
    return invalid_argument(fmt::format("all_to_all_v: counts and offsets need {} entries (one per rank)", r));
  }
  for (std::size_t i = 0; i < r; ++i) {
    if (a.send_counts[i] < 0 || a.recv_counts[i] < 0 || a.send_offsets[i] < 0 || a.recv_offsets[i] < 0) {
      return invalid_argument(fmt::format("all_to_all_v: negative count or offset for rank {}", i));
    }
    if ((a.send_counts[i] > 0 && a.send == nullptr) || (a.recv_counts[i] > 0 && a.recv == nullptr)) {
      return invalid_argument("all_to_all_v: null buffer with a non-zero count");
    }
  }
  return Status::ok();
}

}  // namespace distca::comm
