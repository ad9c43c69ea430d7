// Collective checks shared by the LocalComm test and the MPI test (which runs the same checks
// on each rank under mpirun). Each returns an error describing the first wrong byte.
#pragma once

#include <fmt/format.h>

#include <cstring>
#include <memory>
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

// Point to point around a ring, both directions and two tags at once, posted out of order:
// every message lands whole where its (sender, tag) and posting order say, and a zero-byte
// message completes.
inline Status check_point_to_point(Communicator& c) {
  const int R = c.size(), me = c.rank();
  if (R < 2) return Status::ok();
  const int next = (me + 1) % R, prev = (me + R - 1) % R;
  auto fill = [](int src, int tag, int k, int64_t n) {
    std::vector<std::byte> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((src * 29 + tag * 11 + k * 5 + i) % 253);
    return v;
  };
  const int64_t n = 1000 + 37 * me;
  // Two messages on tag 3 (kept in order), one on tag 9, one empty on tag 0, to `next`.
  std::vector<std::vector<std::byte>> out = {fill(me, 3, 0, n), fill(me, 3, 1, n + 1), fill(me, 9, 0, 17)};
  const int64_t m = 1000 + 37 * prev;
  std::vector<std::vector<std::byte>> in = {std::vector<std::byte>(m), std::vector<std::byte>(m + 1), std::vector<std::byte>(17)};
  std::vector<std::unique_ptr<Work>> works;
  // Receives first for tag 9, then tag 3; the sends in the other order.
  DISTCA_ASSIGN_OR_RETURN(auto r9, c.recv_async(in[2].data(), 17, prev, 9));
  DISTCA_ASSIGN_OR_RETURN(auto r3a, c.recv_async(in[0].data(), m, prev, 3));
  DISTCA_ASSIGN_OR_RETURN(auto r3b, c.recv_async(in[1].data(), m + 1, prev, 3));
  DISTCA_ASSIGN_OR_RETURN(auto r0, c.recv_async(nullptr, 0, prev, 0));
  DISTCA_ASSIGN_OR_RETURN(auto s3a, c.send_async(out[0].data(), n, next, 3));
  DISTCA_ASSIGN_OR_RETURN(auto s3b, c.send_async(out[1].data(), n + 1, next, 3));
  DISTCA_ASSIGN_OR_RETURN(auto s9, c.send_async(out[2].data(), 17, next, 9));
  DISTCA_ASSIGN_OR_RETURN(auto s0, c.send_async(nullptr, 0, next, 0));
  for (auto* w : {r3b.get(), r9.get(), r0.get(), r3a.get(), s3a.get(), s3b.get(), s9.get(), s0.get()}) DISTCA_RETURN_IF_ERROR(w->wait());
  const std::vector<std::vector<std::byte>> want = {fill(prev, 3, 0, m), fill(prev, 3, 1, m + 1), fill(prev, 9, 0, 17)};
  for (size_t k = 0; k < 3; ++k) {
    if (in[k] != want[k]) return internal_error(fmt::format("rank {}: message {} from rank {} is wrong", me, k, prev));
  }
  // The blocking forms, back the other way.
  std::vector<int32_t> token(3, me), got(3, -1);
  if (me % 2 == 0) {
    DISTCA_RETURN_IF_ERROR(c.send(token.data(), 12, prev, 5));
    DISTCA_RETURN_IF_ERROR(c.recv(got.data(), 12, next, 5));
  } else {
    DISTCA_RETURN_IF_ERROR(c.recv(got.data(), 12, next, 5));
    DISTCA_RETURN_IF_ERROR(c.send(token.data(), 12, prev, 5));
  }
  if (got != std::vector<int32_t>(3, next)) return internal_error(fmt::format("rank {}: token from rank {} is wrong", me, next));
  return Status::ok();
}

// Groups as pipeline training makes them: R = pp x dp ranks, rank r in stage r / dp and replica
// r % dp. The stage's DP group all-reduces and the replica's PP group passes a token down the
// stages, at the same time, and each group's ranks and sums are its own.
inline Status check_groups(Communicator& c, int dp) {
  const int R = c.size(), me = c.rank();
  if (R % dp != 0) return invalid_argument("dp must divide the ranks");
  const int stage = me / dp, replica = me % dp, pp = R / dp;
  DISTCA_ASSIGN_OR_RETURN(auto dpg, c.split(stage, replica, "dp"));
  DISTCA_ASSIGN_OR_RETURN(auto ppg, c.split(replica, stage, "pp"));
  if (dpg->size() != dp || dpg->rank() != replica || ppg->size() != pp || ppg->rank() != stage ||
      dpg->world_rank() != c.world_rank() || ppg->world_rank() != c.world_rank()) {
    return internal_error(fmt::format("rank {}: groups dp {}/{} pp {}/{}", me, dpg->rank(), dpg->size(), ppg->rank(), ppg->size()));
  }
  std::vector<float> v(5, static_cast<float>(me));
  DISTCA_ASSIGN_OR_RETURN(auto reduce, dpg->all_reduce_sum_async(v.data(), 5));
  int32_t token = -1;
  if (stage > 0) DISTCA_RETURN_IF_ERROR(ppg->recv(&token, 4, stage - 1, 1));
  token = stage == 0 ? 1000 * replica : token + 1;
  if (stage + 1 < pp) DISTCA_RETURN_IF_ERROR(ppg->send(&token, 4, stage + 1, 1));
  DISTCA_RETURN_IF_ERROR(reduce->wait());
  float sum = 0;
  for (int x = 0; x < dp; ++x) sum += static_cast<float>(stage * dp + x);
  if (v[0] != sum || v[4] != sum) return internal_error(fmt::format("rank {}: dp sum {} not {}", me, v[0], sum));
  if (token != 1000 * replica + stage) return internal_error(fmt::format("rank {}: pp token {} not {}", me, token, 1000 * replica + stage));
  // A collective of the whole world still works beside the groups.
  return c.barrier();
}

}  // namespace distca::comm::testing
