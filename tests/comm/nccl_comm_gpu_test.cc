// NcclComm on device buffers (label `gpu`): one rank; one thread-rank per GPU where a machine has
// several; a given stream; timeouts and abort. Each test skips, with the reason, where there is
// no CUDA device (or too few).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "cuda_device.h"
#include "distca/comm/local_comm.h"
#include "distca/comm/nccl_comm.h"
#include "nccl_checks.h"
#include "rank_status.h"

namespace distca::comm {
namespace {

// Runs body(nccl) on `num_ranks` LocalComm threads, each bootstrapping an NcclComm.
std::vector<Status> run_nccl(int num_ranks, const std::function<Status(NcclComm&)>& body, NcclCommOptions options = {}) {
  return LocalWorld::run(
      num_ranks,
      [&](Communicator& bootstrap) -> Status {
        DISTCA_ASSIGN_OR_RETURN(auto nccl, NcclComm::create(bootstrap, options));
        // The checks allocate their buffers on the current device: this rank's.
        if (cudaSetDevice(nccl->device()) != cudaSuccess) return internal_error("cudaSetDevice failed");
        return body(*nccl);
      },
      std::chrono::seconds(60));
}

using distca::testing::expect_all_ok;

TEST(NcclCommGpu, OneRankMovesEveryByte) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  expect_all_ok(run_nccl(1, [](NcclComm& c) -> Status {
    if (c.size() != 1 || c.rank() != 0 || c.name() != "nccl") return internal_error("wrong rank, size or name");
    return testing::check_nccl_all(c).status();
  }));
}

TEST(NcclCommGpu, OneThreadRankPerGpuMovesEveryByte) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  const int devices = ::distca::testing::cuda_device_count();
  if (devices < 2) GTEST_SKIP() << "needs 2 CUDA devices (NCCL takes one rank per GPU), found " << devices;
  for (int R : {2, std::min(devices, 4)}) {
    SCOPED_TRACE(R);
    std::vector<int> device_of(R, -1);
    expect_all_ok(run_nccl(R, [&device_of](NcclComm& c) -> Status {
      device_of[c.rank()] = c.device();
      return testing::check_nccl_all(c).status();
    }));
    for (int r = 0; r < R; ++r) EXPECT_EQ(device_of[r], r) << "device -1 is the node-local rank";
  }
}

TEST(NcclCommGpu, RunsOnAGivenStream) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  NcclCommOptions options;
  options.device = 0;
  options.stream = stream;
  expect_all_ok(run_nccl(
      1,
      [stream](NcclComm& c) -> Status {
        if (c.stream() != stream) return internal_error("not on the given stream");
        DISTCA_RETURN_IF_ERROR(testing::check_nccl_all_to_all_v(c, 1, false));
        // A group shares the given stream.
        DISTCA_ASSIGN_OR_RETURN(auto group, c.split(0, 0, "all"));
        if (static_cast<NcclComm&>(*group).stream() != stream) return internal_error("the group is not on the given stream");
        return group->barrier();
      },
      options));
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(NcclCommGpu, RefusesWhatNcclCannotTake) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  expect_all_ok(run_nccl(1, [](NcclComm& c) -> Status {
    DISTCA_RETURN_IF_ERROR(testing::check_nccl_refuses_host_memory(c));
    testing::DeviceBytes d(64);
    auto bad_root = c.broadcast_async(d.get(), 64, 1);
    auto bad_tag = c.recv_async(d.get(), 64, 0, Communicator::kMaxTag + 1);
    auto bad_color = c.split(-1, 0, "x");
    const int64_t counts[1] = {64}, other[1] = {32}, offsets[1] = {0};
    auto bad_self = c.all_to_all_v_async({d.get(), counts, offsets, d.get(), other, offsets});
    if (bad_root.is_ok() || bad_tag.is_ok() || bad_color.is_ok() || bad_self.is_ok()) return internal_error("a bad call was accepted");
    return c.barrier();  // still usable
  }));
}

TEST(NcclCommGpu, AbortFailsLaterOperationsWithTheReason) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  expect_all_ok(run_nccl(1, [](NcclComm& c) -> Status {
    c.abort("stopping on purpose (test)");
    Status st = c.barrier();
    if (st.is_ok() || st.message().find("stopping on purpose") == std::string::npos) {
      return internal_error(fmt::format("barrier after abort: {}", st.to_string()));
    }
    return Status::ok();
  }));
}

// Rank 1 never joins rank 0's all-reduce (it waits until rank 0 is done): rank 0's wait ends at
// its timeout, naming the operation, and its communicator is aborted.
TEST(NcclCommGpu, AWaitForARankThatNeverComesTimesOut) {
  DISTCA_SKIP_WITHOUT_CUDA_DEVICE();
  if (::distca::testing::cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  std::string rank0_error;
  std::atomic<bool> is_rank0_done{false};
  expect_all_ok(run_nccl(2, [&](NcclComm& c) -> Status {
    c.set_timeout(std::chrono::seconds(3));
    if (c.rank() == 1) {
      while (!is_rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      c.abort("rank 1 stayed away (test)");
      return Status::ok();
    }
    testing::DeviceBytes d(4096);
    const auto start = std::chrono::steady_clock::now();
    Status st = c.all_reduce_sum(d.get<float>(), 1024);
    const auto waited = std::chrono::steady_clock::now() - start;
    Status after = c.barrier();
    is_rank0_done = true;
    if (st.is_ok()) return internal_error("the all-reduce completed without rank 1");
    if (waited > std::chrono::seconds(20)) return internal_error("the timeout did not end the wait");
    rank0_error = st.message();
    if (after.is_ok() || after.message().find("aborted") == std::string::npos) {
      return internal_error(fmt::format("after the timeout: {}", after.to_string()));
    }
    return Status::ok();
  }));
  EXPECT_NE(rank0_error.find("all_reduce_sum #"), std::string::npos) << rank0_error;
  EXPECT_NE(rank0_error.find("timed out after 3000 ms"), std::string::npos) << rank0_error;
}

}  // namespace
}  // namespace distca::comm
