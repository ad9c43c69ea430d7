// NcclComm's checks on device buffers, shared by the gtest (one rank, or a thread per GPU) and
// the MPI program: the byte patterns of collectives.h are copied to the device, moved by the
// operation, copied back and checked byte for byte. Each returns an error naming the first
// wrong byte.
#pragma once

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "collectives.h"
#include "distca/comm/nccl_comm.h"

namespace distca::comm::testing {

// Device memory of the current device, freed at scope exit.
class DeviceBytes {
 public:
  explicit DeviceBytes(int64_t bytes) {
    if (cudaMalloc(&ptr_, static_cast<size_t>(bytes > 0 ? bytes : 1)) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceBytes() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  template <typename T = std::byte>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

inline Status cuda_ok(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status::ok() : internal_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}
template <typename T>
Status to_device(T* device, const std::vector<T>& host) {
  return cuda_ok(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "copy to the device");
}
template <typename T>
Status to_host(std::vector<T>& host, const T* device) {
  return cuda_ok(cudaMemcpy(host.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost), "copy to the host");
}

// Polls test() a while before wait() (which then finds the work done, or waits with the timeout).
inline Status finish(Result<std::unique_ptr<Work>> work, bool is_polled) {
  if (!work.is_ok()) return work.status();
  for (int i = 0; is_polled && i < 1000000; ++i) {
    DISTCA_ASSIGN_OR_RETURN(bool done, work.value()->test());
    if (done) break;
  }
  return work.value()->wait();
}

// One all-to-all-v of collectives.h's pattern (varied counts, some zero, gaps never written).
inline Status check_nccl_all_to_all_v(NcclComm& c, int round, bool is_polled) {
  const int R = c.size(), me = c.rank();
  std::vector<int64_t> sc(R), so(R), rc(R), ro(R);
  int64_t send_total = 0, recv_total = 0;
  for (int p = 0; p < R; ++p) {
    sc[p] = count(me, p, round) * 1000;  // kilobytes, so that NCCL moves them in several chunks
    so[p] = send_total;
    send_total += sc[p] + 3;
    rc[p] = count(p, me, round) * 1000;
    ro[p] = recv_total;
    recv_total += rc[p] + 5;
  }
  std::vector<std::byte> send(send_total, std::byte{0xEE}), recv(recv_total, std::byte{0xAA});
  for (int p = 0; p < R; ++p) {
    for (int64_t i = 0; i < sc[p]; ++i) send[so[p] + i] = pattern(me, p, i, round);
  }
  DeviceBytes d_send(send_total), d_recv(recv_total);
  DISTCA_RETURN_IF_ERROR(to_device(d_send.get(), send));
  DISTCA_RETURN_IF_ERROR(to_device(d_recv.get(), recv));
  DISTCA_RETURN_IF_ERROR(finish(c.all_to_all_v_async({d_send.get(), sc, so, d_recv.get(), rc, ro}), is_polled));
  DISTCA_RETURN_IF_ERROR(to_host(recv, d_recv.get()));
  for (int p = 0; p < R; ++p) {
    for (int64_t i = 0; i < rc[p]; ++i) {
      if (recv[ro[p] + i] != pattern(p, me, i, round)) {
        return internal_error(fmt::format("rank {}: byte {} from rank {} is wrong (round {})", me, i, p, round));
      }
    }
    for (int64_t i = rc[p]; i < rc[p] + 5; ++i) {
      if (recv[ro[p] + i] != std::byte{0xAA}) return internal_error(fmt::format("rank {}: gap after rank {}'s segment overwritten", me, p));
    }
  }
  return Status::ok();
}

// all_reduce_sum (the sum of every rank's values, the same bits everywhere), broadcast from each
// root, barrier.
inline Status check_nccl_reduce_broadcast_barrier(NcclComm& c) {
  const int R = c.size(), me = c.rank();
  constexpr int kCount = 100000;
  std::vector<float> x(kCount);
  for (int i = 0; i < kCount; ++i) x[i] = static_cast<float>(me + 1) * 0.5f + static_cast<float>(i % 1000);
  DeviceBytes d_x(kCount * 4);
  DISTCA_RETURN_IF_ERROR(to_device(d_x.get<float>(), x));
  DISTCA_RETURN_IF_ERROR(c.all_reduce_sum(d_x.get<float>(), kCount));
  DISTCA_RETURN_IF_ERROR(to_host(x, d_x.get<float>()));
  for (int i = 0; i < kCount; ++i) {
    float want = 0;
    for (int p = 0; p < R; ++p) want += static_cast<float>(p + 1) * 0.5f + static_cast<float>(i % 1000);
    if (x[i] != want) {  // small integers and halves: exact in any order
      return internal_error(fmt::format("rank {}: all_reduce element {} is {}, want {}", me, i, x[i], want));
    }
  }
  for (int root = 0; root < R; ++root) {
    std::vector<std::byte> b(3001);
    for (size_t i = 0; i < b.size(); ++i) b[i] = me == root ? pattern(root, 0, static_cast<int64_t>(i), 9) : std::byte{0};
    DeviceBytes d_b(static_cast<int64_t>(b.size()));
    DISTCA_RETURN_IF_ERROR(to_device(d_b.get(), b));
    DISTCA_RETURN_IF_ERROR(c.broadcast(d_b.get(), static_cast<int64_t>(b.size()), root));
    DISTCA_RETURN_IF_ERROR(to_host(b, d_b.get()));
    for (size_t i = 0; i < b.size(); ++i) {
      if (b[i] != pattern(root, 0, static_cast<int64_t>(i), 9)) {
        return internal_error(fmt::format("rank {}: broadcast byte {} from root {} is wrong", me, i, root));
      }
    }
  }
  return c.barrier();
}

// Point to point around a ring, two messages per pair (matched in posting order: NCCL has no
// tags); with one rank, a send to itself is refused.
inline Status check_nccl_point_to_point(NcclComm& c) {
  const int R = c.size(), me = c.rank();
  if (R == 1) {
    DeviceBytes d(8);
    auto self = c.send_async(d.get(), 8, 0, 0);
    if (self.is_ok()) return internal_error("a send to itself was accepted");
    return Status::ok();
  }
  const int next = (me + 1) % R, prev = (me + R - 1) % R;
  const int64_t sizes[2] = {4096 + me, 17};
  std::vector<std::vector<std::byte>> out(2), in(2);
  std::vector<std::unique_ptr<DeviceBytes>> d_out, d_in;
  std::vector<std::unique_ptr<Work>> works;
  for (int m = 0; m < 2; ++m) {
    out[m].resize(sizes[m]);
    for (int64_t i = 0; i < sizes[m]; ++i) out[m][i] = pattern(me, next, i, m);
    in[m].assign(static_cast<size_t>(m == 0 ? 4096 + prev : 17), std::byte{0});
    d_out.push_back(std::make_unique<DeviceBytes>(sizes[m]));
    d_in.push_back(std::make_unique<DeviceBytes>(static_cast<int64_t>(in[m].size())));
    DISTCA_RETURN_IF_ERROR(to_device(d_out[m]->get(), out[m]));
  }
  // Both receives first, then both sends: the group-free ncclRecv/ncclSend progress together.
  for (int m = 0; m < 2; ++m) {
    DISTCA_ASSIGN_OR_RETURN(auto w, c.recv_async(d_in[m]->get(), static_cast<int64_t>(in[m].size()), prev, 5 + m));
    works.push_back(std::move(w));
  }
  for (int m = 0; m < 2; ++m) {
    DISTCA_ASSIGN_OR_RETURN(auto w, c.send_async(d_out[m]->get(), sizes[m], next, 5 + m));
    works.push_back(std::move(w));
  }
  for (auto& w : works) DISTCA_RETURN_IF_ERROR(w->wait());
  for (int m = 0; m < 2; ++m) {
    DISTCA_RETURN_IF_ERROR(to_host(in[m], d_in[m]->get()));
    for (size_t i = 0; i < in[m].size(); ++i) {
      if (in[m][i] != pattern(prev, me, static_cast<int64_t>(i), m)) {
        return internal_error(fmt::format("rank {}: byte {} of message {} from rank {} is wrong", me, i, m, prev));
      }
    }
  }
  return Status::ok();
}

// Groups of the ranks with the same parity, ranked in reverse: sizes, ranks, world ranks, and an
// all-reduce in each group.
inline Status check_nccl_split(NcclComm& c) {
  const int R = c.size(), me = c.rank();
  DISTCA_ASSIGN_OR_RETURN(auto group, c.split(me % 2, R - me, "parity"));
  std::vector<int> members;
  for (int p = R - 1; p >= 0; --p) {
    if (p % 2 == me % 2) members.push_back(p);
  }
  const int want_rank = static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
  if (group->size() != static_cast<int>(members.size()) || group->rank() != want_rank || group->world_rank() != c.world_rank()) {
    return internal_error(fmt::format("rank {}: group rank {} of {} (world rank {}), want {} of {}", me, group->rank(),
                                      group->size(), group->world_rank(), want_rank, members.size()));
  }
  std::vector<float> x = {static_cast<float>(me)};
  DeviceBytes d_x(4);
  DISTCA_RETURN_IF_ERROR(to_device(d_x.get<float>(), x));
  DISTCA_RETURN_IF_ERROR(group->all_reduce_sum(d_x.get<float>(), 1));
  DISTCA_RETURN_IF_ERROR(to_host(x, d_x.get<float>()));
  float want = 0;
  for (int p : members) want += static_cast<float>(p);
  if (x[0] != want) return internal_error(fmt::format("rank {}: the group's all-reduce gave {}, want {}", me, x[0], want));
  return group->barrier();
}

// Host memory is refused with a Status (NCCL would fault on it).
inline Status check_nccl_refuses_host_memory(NcclComm& c) {
  std::vector<float> host(16, 1.0f);
  auto w = c.all_reduce_sum_async(host.data(), 16);
  if (w.is_ok()) return internal_error("all_reduce_sum accepted a host buffer");
  if (w.status().message().find("device memory") == std::string::npos) {
    return internal_error(fmt::format("host buffer refused with an unclear message: {}", w.status().message()));
  }
  return Status::ok();
}

// All of the above; returns the number of checks.
inline Result<int> check_nccl_all(NcclComm& c) {
  int checks = 0;
  for (int round = 0; round < 4; ++round, ++checks) DISTCA_RETURN_IF_ERROR(check_nccl_all_to_all_v(c, round, round % 2 == 1));
  DISTCA_RETURN_IF_ERROR(check_nccl_reduce_broadcast_barrier(c));
  DISTCA_RETURN_IF_ERROR(check_nccl_point_to_point(c));
  DISTCA_RETURN_IF_ERROR(check_nccl_split(c));
  DISTCA_RETURN_IF_ERROR(check_nccl_refuses_host_memory(c));
  return checks + 4;
}

}  // namespace distca::comm::testing
