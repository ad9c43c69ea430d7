// NcclComm bootstrapped over MpiComm, under mpirun (`-np 2` under ctest, label `gpu`): every rank
// runs the device-buffer checks of nccl_checks.h and rank 0 prints "NcclComm checks passed on N
// ranks". Where NcclComm cannot be made, every rank must still end with a Status (no hang):
// without a CUDA device, or with fewer GPUs on the machine than ranks on it (NCCL takes one rank
// per GPU), rank 0 prints "skipped: <why>" and the job exits 0 (ctest reports it skipped).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include "cuda_device.h"
#include "mpi_test_main.h"
#include "nccl_checks.h"

int main(int argc, char** argv) {
  using namespace distca;
  const comm::testing::MpiTest t = comm::testing::start_mpi_test(&argc, &argv);
  if (!t.comm) return 1;
  comm::MpiComm& mpi = *t.comm;
  auto local_rank = comm::NcclComm::node_local_rank(mpi);
  if (!local_rank.is_ok()) return t.fail(local_rank.status());
  auto created = comm::NcclComm::create(mpi);
  if (!created.is_ok()) {
    // Every rank failed (create agrees on the outcome): a skip when some machine of the job has
    // more ranks than GPUs, else a failure.
    const int devices = ::distca::testing::cuda_device_count();
    float is_short = local_rank.value() >= devices ? 1.0f : 0.0f;
    if (Status st = mpi.all_reduce_sum(&is_short, 1); !st.is_ok()) return t.fail(st);
    if (is_short == 0) return t.fail(created.status());
    if (mpi.rank() == 0) {
      fmt::print("skipped: {} CUDA device(s) for the ranks on one machine (NCCL takes one rank per GPU); "
                 "NcclComm::create said: {}\n",
                 devices, created.status().message());
    }
    return 0;
  }
  comm::NcclComm& c = *created.value();
  if (cudaSetDevice(c.device()) != cudaSuccess) return t.fail(internal_error("cudaSetDevice failed"));
  auto checks = comm::testing::check_nccl_all(c);
  if (!checks.is_ok()) return t.fail(checks.status());
  if (mpi.rank() == 0) fmt::print("NcclComm checks passed on {} ranks ({} checks)\n", c.size(), checks.value());
  return 0;
}
