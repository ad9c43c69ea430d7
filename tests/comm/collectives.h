// Collective checks shared by the LocalComm test and the MPI test (which runs the same checks
// on each rank under mpirun). Each returns an error describing the first wrong byte.
#pragma once

#include <fmt/format.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "distca/comm/communicator.h"

namespace distca::comm::testing {

// Bytes from rank `src` to rank `dst` in operation `round`: (src*31 + dst*7 + i + round) % 251.
inline std::byte pattern(int src, int dst, int64_t i, int round) {
  return static_cast<std::byte>((src * 31 + dst * 7 + i + round) % 251);
}
// How many bytes src sends dst in `round`: varied, zero for some pairs.
inline int64_t count(int src, int dst, int round) { return ((src + 2 * dst + round) % 4 == 0) ? 0 : (src * 13 + dst * 5 + round * 17) % 97 + 1; }

// One all-to-all-v in which every byte names its source, destination and position.
inline Status check_all_to_all_v(Communicator& c, int round, bool is_async) {
  const int R = c.size(), me = c.rank();
  std::vector<int64_t> sc(R), so(R), rc(R), ro(R);
  int64_t send_total = 0, recv_total = 0;
  for (int p = 0; p < R; ++p) {
    sc[p] = count(me, p, round);
    so[p] = send_total;
    send_total += sc[p] + 3;  // gaps between segments are never sent
    rc[p] = count(p, me, round);
    ro[p] = recv_total;
    recv_total += rc[p] + 5;
  }
  std::vector<std::byte> send(send_total, std::byte{0xEE}), recv(recv_total, std::byte{0xAA});
  for (int p = 0; p < R; ++p)
    for (int64_t i = 0; i < sc[p]; ++i) send[so[p] + i] = pattern(me, p, i, round);
  AllToAllV a{send.data(), sc, so, recv.data(), rc, ro};
  if (is_async) {
    DISTCA_ASSIGN_OR_RETURN(std::unique_ptr<Work> w, c.all_to_all_v_async(a));
    for (;;) {
      DISTCA_ASSIGN_OR_RETURN(bool done, w->test());
      if (done) break;
    }
  } else {
    DISTCA_RETURN_IF_ERROR(c.all_to_all_v(a));
  }
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

inline Status check_all_reduce(Communicator& c) {
  const int R = c.size(), me = c.rank();
  std::vector<float> x(1000);
  for (int i = 0; i < 1000; ++i) x[i] = static_cast<float>(me + 1) * 0.1f + static_cast<float>(i);
  DISTCA_RETURN_IF_ERROR(c.all_reduce_sum(x.data(), static_cast<int64_t>(x.size())));
  for (int i = 0; i < 1000; ++i) {
    float want = 0;
    for (int p = 0; p < R; ++p) want += static_cast<float>(p + 1) * 0.1f + static_cast<float>(i);
    if (std::abs(x[i] - want) > 1e-3f * std::abs(want)) {
      return internal_error(fmt::format("rank {}: all_reduce element {} is {}, want {}", me, i, x[i], want));
    }
  }
  // Every rank holds bit-identical sums: broadcast rank 0's and compare.
  std::vector<float> root = x;
  DISTCA_RETURN_IF_ERROR(c.broadcast(root.data(), static_cast<int64_t>(root.size() * sizeof(float)), 0));
  if (std::memcmp(root.data(), x.data(), x.size() * sizeof(float)) != 0) {
    return internal_error(fmt::format("rank {}: all_reduce result differs from rank 0's", me));
  }
  return c.barrier();
}

}  // namespace distca::comm::testing
