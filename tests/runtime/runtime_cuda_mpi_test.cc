// The CAD runtime with CudaServerKernel under mpirun (`-np 2` under ctest, label `gpu`; the ranks
// may share one GPU): on every rank, the Dispatcher over MpiComm with the GPU kernel matches the
// CPU kernels on the same plans (cuda_harness.h), for every policy and a plan that splits key
// ranges, in both backward modes. Rank 0 prints "runtime CUDA checks passed on N ranks"; without
// a CUDA device it prints "skipped: <why>" and the job exits 0 (ctest reports it skipped).
#include <fmt/format.h>

#include "../comm/cuda_device.h"
#include "../comm/mpi_test_main.h"
#include "cuda_harness.h"
#include "distca/runtime/cuda_server_kernel.h"

int main(int argc, char** argv) {
  using namespace distca;
  const comm::testing::MpiTest t = comm::testing::start_mpi_test(&argc, &argv);
  if (!t.comm) return 1;
  comm::MpiComm& c = *t.comm;
  c.set_timeout(std::chrono::seconds(120));  // the CPU references of the other ranks take a while
  // Every rank sees the same machine kind; a rank without a device skips with the others.
  float has_device = ::distca::testing::cuda_device_count() > 0 ? 1.0f : 0.0f;
  if (Status st = c.all_reduce_sum(&has_device, 1); !st.is_ok()) return t.fail(st);
  if (has_device < static_cast<float>(c.size())) {
    if (c.rank() == 0) fmt::print("skipped: {}\n", ::distca::testing::no_cuda_device_reason());
    return has_device == 0 ? 0 : t.fail(internal_error("some ranks have a CUDA device and some do not"));
  }
  auto kernel = runtime::CudaServerKernel::create();
  if (!kernel.is_ok()) return t.fail(kernel.status());
  const int R = c.size();
  auto batch = plan::pack_documents({300, 1, 17, 90, 2, 500, 33, 1, 64, 250}, R, 1260 / R);
  if (!batch.is_ok()) return t.fail(batch.status());
  auto checks = runtime::testing::check_kernel_on_plans(c, batch.value(), *kernel.value());
  if (!checks.is_ok()) return t.fail(checks.status());
  if (c.rank() == 0) {
    fmt::print("runtime CUDA checks passed on {} ranks ({} checks, {})\n", R, checks.value(), kernel.value()->device_name());
  }
  return 0;
}
