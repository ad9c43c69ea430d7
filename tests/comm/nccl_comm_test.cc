// NcclComm where it cannot run: create() returns a Status on every rank (never a crash or a
// hang), the one that names the cause on the rank that has it. Runs on any machine; the checks
// that need a GPU are in nccl_comm_gpu_test.cc.
#include <gtest/gtest.h>

#include <chrono>

#include "cuda_device.h"
#include "distca/comm/local_comm.h"
#include "distca/comm/nccl_comm.h"

namespace distca::comm {
namespace {

TEST(NcclComm, CreateWithoutCudaDeviceFailsWithTheReason) {
  if (::distca::testing::cuda_device_count() > 0) GTEST_SKIP() << "this machine has a CUDA device (the GPU tests create NcclComm)";
  const auto statuses = LocalWorld::run(1, [](Communicator& bootstrap) -> Status {
    auto c = NcclComm::create(bootstrap);
    if (c.is_ok()) return internal_error("created without a CUDA device");
    return c.status();
  });
  ASSERT_EQ(statuses.size(), 1u);
  EXPECT_FALSE(statuses[0].is_ok());
  EXPECT_NE(statuses[0].message().find("NcclComm on rank 0: no CUDA device: cudaGetDeviceCount failed"), std::string::npos)
      << statuses[0].to_string();
}

// Rank 1 asks for a device that does not exist: every rank fails, ranks 0 and 2 naming rank 1
// (without a GPU each rank fails with its own "no CUDA device").
TEST(NcclComm, EveryRankFailsWhenOneCannotTakePart) {
  const bool has_device = ::distca::testing::cuda_device_count() > 0;
  const auto statuses = LocalWorld::run(
      3,
      [](Communicator& bootstrap) -> Status {
        NcclCommOptions options;
        options.device = bootstrap.rank() == 1 ? 1000 : -1;
        auto c = NcclComm::create(bootstrap, options);
        return c.is_ok() ? internal_error("created") : c.status();
      },
      std::chrono::seconds(20));
  ASSERT_EQ(statuses.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE(r);
    ASSERT_FALSE(statuses[r].is_ok());
    const std::string& m = statuses[r].message();
    if (!has_device) {
      EXPECT_NE(m.find("no CUDA device"), std::string::npos) << m;
    } else if (r == 1) {
      EXPECT_NE(m.find("CUDA device 1000 does not exist"), std::string::npos) << m;
    } else {
      EXPECT_NE(m.find("rank 1 failed"), std::string::npos) << m;
    }
  }
}

TEST(NcclComm, CreateRejectsANegativeDevice) {
  const auto statuses = LocalWorld::run(1, [](Communicator& bootstrap) -> Status {
    NcclCommOptions options;
    options.device = -7;
    auto c = NcclComm::create(bootstrap, options);
    return c.is_ok() ? internal_error("created") : c.status();
  });
  EXPECT_EQ(statuses[0].code(), StatusCode::kInvalidArgument) << statuses[0].to_string();
  EXPECT_NE(statuses[0].message().find("CUDA device -7"), std::string::npos) << statuses[0].to_string();
}

TEST(NcclComm, NodeLocalRankCountsTheRanksOnThisHost) {
  std::vector<int> local(4, -1);
  const auto statuses = LocalWorld::run(4, [&local](Communicator& comm) -> Status {
    DISTCA_ASSIGN_OR_RETURN(local[comm.rank()], NcclComm::node_local_rank(comm));
    return Status::ok();
  });
  for (const Status& st : statuses) EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(local, (std::vector<int>{0, 1, 2, 3}));  // threads: one host
}

}  // namespace
}  // namespace distca::comm
