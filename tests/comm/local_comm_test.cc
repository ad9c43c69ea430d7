// LocalComm: collectives over R threads, for every R the runtime tests use, and the failure
// paths: a timeout names the missing peer, a failing rank makes every peer fail, mismatched
// calls are errors, and nothing hangs.
#include "distca/comm/local_comm.h"

#include <gtest/gtest.h>
#include <utility>
#include <thread>

#include <fmt/format.h>

#include <chrono>
#include <stdexcept>

#include "collectives.h"
#include "rank_status.h"

namespace distca::comm {
namespace {

using namespace std::chrono_literals;

using distca::testing::expect_all_ok;

TEST(LocalComm, AllToAllVDeliversEveryByteToItsPlace) {
  for (int R : {1, 2, 3, 4, 7}) {
    expect_all_ok(LocalWorld::run(R, [](Communicator& c) -> Status {
      for (int round = 0; round < 5; ++round) DISTCA_RETURN_IF_ERROR(testing::check_all_to_all_v(c, round, round % 2 == 1));
      return Status::ok();
    }));
  }
}

TEST(LocalComm, AllReduceBroadcastAndBarrier) {
  for (int R : {1, 2, 3, 4, 7}) expect_all_ok(LocalWorld::run(R, testing::check_all_reduce));
}

TEST(LocalComm, TwoOperationsInFlightCompleteInAnyOrder) {
  expect_all_ok(LocalWorld::run(3, [](Communicator& c) -> Status {
    std::vector<float> a(10, 1.0f), b(10, 2.0f);
    DISTCA_ASSIGN_OR_RETURN(auto wa, c.all_reduce_sum_async(a.data(), 10));
    DISTCA_ASSIGN_OR_RETURN(auto wb, c.all_reduce_sum_async(b.data(), 10));
    DISTCA_RETURN_IF_ERROR(wb->wait());
    DISTCA_RETURN_IF_ERROR(wa->wait());
    if (a[0] != 3.0f || b[9] != 6.0f) return internal_error("wrong sums");
    return Status::ok();
  }));
}

TEST(LocalComm, TimeoutNamesTheMissingPeer) {
  const auto t0 = std::chrono::steady_clock::now();
  auto statuses = LocalWorld::run(3, [](Communicator& c) -> Status {
    if (c.rank() == 2) {
      std::this_thread::sleep_for(600ms);  // late, and then it skips the barrier
      return Status::ok();
    }
    return c.barrier();
  }, 200ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  for (int r : {0, 1}) {
    ASSERT_FALSE(statuses[r].is_ok());
    const std::string& m = statuses[r].message();
    EXPECT_TRUE(m.find("timed out") != std::string::npos || m.find("failed") != std::string::npos) << m;
  }
  EXPECT_NE(statuses[0].message() + statuses[1].message(), "");
  const std::string first = statuses[0].message().find("timed out") != std::string::npos ? statuses[0].message() : statuses[1].message();
  EXPECT_NE(first.find("rank 2"), std::string::npos) << first;
}

TEST(LocalComm, ARankThatThrowsFailsEveryPeerWithItsReason) {
  const auto t0 = std::chrono::steady_clock::now();
  auto statuses = LocalWorld::run(4, [](Communicator& c) -> Status {
    if (c.rank() == 1) throw std::runtime_error("disk on fire");
    std::vector<float> x(4, 1.0f);
    DISTCA_RETURN_IF_ERROR(c.all_reduce_sum(x.data(), 4));
    return c.barrier();
  }, 30s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << "peers must not wait for the timeout";
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(statuses[r].is_ok()) << r;
    EXPECT_NE(statuses[r].message().find("disk on fire"), std::string::npos) << statuses[r].message();
  }
  EXPECT_NE(statuses[0].message().find("rank 1 failed"), std::string::npos) << statuses[0].message();
}

TEST(LocalComm, MismatchedCallsAndCountsAreErrors) {
  auto kinds = LocalWorld::run(2, [](Communicator& c) -> Status {
    if (c.rank() == 0) return c.barrier();
    std::vector<float> x(2);
    return c.all_reduce_sum(x.data(), 2);
  }, 2s);
  EXPECT_FALSE(kinds[0].is_ok() && kinds[1].is_ok());
  auto counts = LocalWorld::run(2, [](Communicator& c) -> Status {
    std::vector<int64_t> sc = {0, 8}, so = {0, 0}, rc = {0, c.rank() == 0 ? int64_t{4} : int64_t{8}}, ro = {0, 0};
    std::vector<std::byte> buf(16);
    return c.all_to_all_v({buf.data(), sc, so, buf.data() + 8, rc, ro});
  }, 2s);
  const std::string all = counts[0].message() + counts[1].message();
  EXPECT_NE(all.find("expects"), std::string::npos) << all;
}

TEST(LocalComm, BadArgumentsAreRejectedUpFront) {
  LocalWorld world(2);
  Communicator& c = world.comm(0);
  std::vector<int64_t> one = {0};
  EXPECT_EQ(c.all_to_all_v_async({nullptr, one, one, nullptr, one, one}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.broadcast_async(nullptr, 0, 5).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.all_reduce_sum_async(nullptr, 3).status().code(), StatusCode::kInvalidArgument);
}

TEST(LocalComm, PointToPointMatchesBySenderTagAndOrder) {
  for (int R : {2, 3, 4, 7}) expect_all_ok(LocalWorld::run(R, testing::check_point_to_point));
}

TEST(LocalComm, GroupsOfStagesAndReplicasWorkSideBySide) {
  for (auto [R, dp] : {std::pair{2, 1}, {3, 1}, {4, 1}, {4, 2}, {8, 2}, {6, 3}}) {
    SCOPED_TRACE(fmt::format("{} ranks, dp {}", R, dp));
    expect_all_ok(LocalWorld::run(R, [dp](Communicator& c) { return testing::check_groups(c, dp); }));
  }
}

TEST(LocalComm, PointToPointErrorsNameThePeer) {
  // A receive of another size than the send: both ends fail, naming each other.
  auto statuses = LocalWorld::run(2, [](Communicator& c) -> Status {
    std::vector<std::byte> b(64);
    return c.rank() == 0 ? c.send(b.data(), 64, 1, 4) : c.recv(b.data(), 32, 0, 4);
  }, 2s);
  for (int r : {0, 1}) {
    ASSERT_FALSE(statuses[r].is_ok()) << r;
    EXPECT_NE(statuses[r].message().find("send of 64 bytes (tag 4) from rank 0 to rank 1, which receives 32 bytes"), std::string::npos)
        << statuses[r].message();
  }
  // A receive nobody sends: the timeout names the sender it waits for, in its group.
  const auto t0 = std::chrono::steady_clock::now();
  statuses = LocalWorld::run(4, [](Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto pp, c.split(c.rank() % 2, c.rank(), "pp"));
    int32_t x = 0;
    if (c.rank() == 3) return pp->recv(&x, 4, 0, 2);  // rank 0 of pp is world rank 1, which never sends
    return Status::ok();
  }, 300ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  ASSERT_FALSE(statuses[3].is_ok());
  EXPECT_NE(statuses[3].message().find("recv of 4 bytes (tag 2) on rank 1 of pp (world rank 3): timed out after 300 ms waiting for "
                                       "rank 0 of pp (world rank 1)"),
            std::string::npos)
      << statuses[3].message();
  // Bad calls are refused before anything is posted.
  expect_all_ok(LocalWorld::run(2, [](Communicator& c) -> Status {
    int32_t x = 0;
    auto refused = [](const Result<std::unique_ptr<Work>>& r) { return !r.is_ok() && r.status().code() == StatusCode::kInvalidArgument; };
    if (!refused(c.send_async(&x, 4, 2, 0)) || !refused(c.send_async(&x, 4, c.rank(), 0)) ||
        !refused(c.recv_async(&x, 4, 1 - c.rank(), -1)) || !refused(c.recv_async(&x, 4, 1 - c.rank(), Communicator::kMaxTag + 1)) ||
        !refused(c.send_async(nullptr, 4, 1 - c.rank(), 0))) {
      return internal_error("a bad call was accepted");
    }
    if (c.split(-1, 0, "x").is_ok() || c.split(0, 0, "").is_ok()) return internal_error("a bad split was accepted");
    return Status::ok();
  }));
}

TEST(LocalComm, ARankThatFailsInOneGroupEndsThePeersOfAnother) {
  // 4 ranks: DP groups {0, 1} and {2, 3}. Rank 3 fails; rank 0 waits in its own group's
  // all-reduce for rank 1, which waits for a message from rank 3: all end with rank 3's reason.
  const auto t0 = std::chrono::steady_clock::now();
  auto statuses = LocalWorld::run(4, [](Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto dp, c.split(c.rank() / 2, c.rank(), "dp"));
    if (c.rank() == 3) return internal_error("stage 1 ran out of memory");
    if (c.rank() == 1) {
      int32_t x = 0;
      DISTCA_RETURN_IF_ERROR(c.recv(&x, 4, 3, 0));
    }
    float v = 1;
    return dp->all_reduce_sum(&v, 1);
  }, 20s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(statuses[r].is_ok()) << r;
    EXPECT_NE(statuses[r].message().find("stage 1 ran out of memory"), std::string::npos) << r << ": " << statuses[r].message();
  }
}

}  // namespace
}  // namespace distca::comm
