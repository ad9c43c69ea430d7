// The Dispatcher with a GPU server kernel against the CPU kernels on the same plan, run by every
// rank with its own communicator (LocalComm threads in the gtest, MpiComm under mpirun).
//
// Tolerance, derived from a same-precision reference (as flash-attention's tests do): inputs are
// bf16 values (so staging them to bf16 is exact); A is the Dispatcher with the fp32 CPU kernel,
// B the Dispatcher with the CPU kernel storing bf16 (Bf16CpuKernel), which rounds only what it
// reads and writes. For each output tensor, the GPU run's largest difference from A may be at
// most four times B's (the tensor cores also round P and dS to bf16 inside the kernel, about as
// much error again as B's rounding of the outputs, twice over in the backward), plus
// 1e-4 (1 + max |A|) for tensors B computes in fp32 (LSE). A wrong softmax scale, a misrouted
// row or an unwritten output (the outputs start as NaN) is off by far more (cuda_server_kernel_test
// checks that the bound rejects such kernels).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "distca/core/bf16.h"
#include "distca/kernels/cpu.h"
#include "harness.h"

namespace distca::runtime::testing {

// The CPU kernel with bf16 storage behind the fp32 ServerKernel interface: inputs and outputs
// rounded to bf16 (dK/dV too), LSE fp32.
class Bf16CpuKernel final : public ServerKernel {
 public:
  Status forward(const kernels::AttnFwdParams<float>& p) override {
    const kernels::AttnDims& d = p.dims;
    const int64_t q_elems = d.num_q_rows * d.num_q_heads * d.head_dim, kv_elems = d.num_kv_rows * d.num_kv_heads * d.head_dim;
    const auto q = round(p.q, q_elems), k = round(p.k, kv_elems), v = round(p.v, kv_elems);
    std::vector<bf16> o(q_elems);
    DISTCA_RETURN_IF_ERROR(cpu_.forward(kernels::AttnFwdParams<bf16>{d, q.data(), k.data(), v.data(), p.tasks, p.scale,
                                                                     o.data(), p.lse}));
    widen(o, p.o);
    return Status::ok();
  }
  Status backward(const kernels::AttnBwdParams<float>& p) override {
    const kernels::AttnDims& d = p.dims;
    const int64_t q_elems = d.num_q_rows * d.num_q_heads * d.head_dim, kv_elems = d.num_kv_rows * d.num_kv_heads * d.head_dim;
    const auto q = round(p.q, q_elems), k = round(p.k, kv_elems), v = round(p.v, kv_elems), o = round(p.o, q_elems),
               d_o = round(p.d_o, q_elems);
    std::vector<bf16> dq(q_elems), dk(kv_elems), dv(kv_elems);
    DISTCA_RETURN_IF_ERROR(cpu_.backward(kernels::AttnBwdParams<bf16>{d, q.data(), k.data(), v.data(), o.data(), p.lse,
                                                                      d_o.data(), p.tasks, p.scale, dq.data(), dk.data(),
                                                                      dv.data()}));
    widen(dq, p.dq);
    widen(dk, p.dk);
    widen(dv, p.dv);
    return Status::ok();
  }

 private:
  static std::vector<bf16> round(const float* x, int64_t n) {
    std::vector<bf16> out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = bf16(x[i]);
    return out;
  }
  static void widen(const std::vector<bf16>& x, float* out) {
    for (size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(x[i]);
  }
  kernels::CpuAttention cpu_{kernels::CpuAttentionOptions{.num_threads = 1}};
};

// The largest |a - b| (NaN anywhere: infinity); equal infinities (LSE of a row with no key) agree.
inline double max_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    if (std::isinf(a[i]) && a[i] == b[i]) continue;
    m = std::max(m, std::abs(double{a[i]} - double{b[i]}));
  }
  return m;
}

inline double max_magnitude(const std::vector<float>& a) {
  double m = 0;
  for (float x : a) {
    if (std::isfinite(x)) m = std::max(m, std::abs(double{x}));
  }
  return m;
}

// Checks one tensor of this rank against the bound above.
inline Status compare_to_bf16_bound(const char* what, int rank, const std::vector<float>& got, const std::vector<float>& fp32,
                                    const std::vector<float>& bf16_ref) {
  const double err = max_difference(got, fp32), ref_err = max_difference(bf16_ref, fp32);
  const double bound = 4 * ref_err + 1e-4 * (1 + max_magnitude(fp32));
  if (!(err <= bound)) {
    return internal_error(fmt::format("rank {}: {} differs from the fp32 CPU result by up to {:.3g}; the bf16 CPU result by "
                                      "{:.3g} (bound {:.3g})",
                                      rank, what, err, ref_err, bound));
  }
  return Status::ok();
}

// Runs this rank's rows of the batch forward and backward through the Dispatcher three times (the
// fp32 CPU kernel, Bf16CpuKernel, `kernel`) and compares every output.
inline Status check_kernel_against_cpu(comm::Communicator& comm, const plan::Batch& batch, const plan::Plan& plan,
                                       plan::BackwardMode mode, ServerKernel& kernel, uint64_t seed) {
  const int rank = comm.rank();
  DispatchCase c;
  c.seed = seed;
  c.heads = {4, 2, 64};  // the CUDA kernels take head dims 64 and 128
  c.mode = mode;
  const GlobalLayout g = global_layout(batch);
  GlobalInputs in = random_inputs(g, c);
  for (std::vector<float>* t : {&in.q, &in.k, &in.v, &in.d_o}) {
    for (float& x : *t) x = static_cast<float>(bf16(x));
  }
  const std::vector<int64_t>& rows = g.local_rows[rank];
  auto run = [&](ServerKernel* server_kernel) -> Result<LocalOutputs> {
    DispatchOptions options;
    options.backward_mode = mode;
    options.num_threads = 1;
    options.kernel = server_kernel;
    DISTCA_ASSIGN_OR_RETURN(auto dispatcher, Dispatcher::create(comm, batch, plan, c.heads, options));
    return run_local(*dispatcher, rows, in);
  };
  Bf16CpuKernel bf16_kernel;
  DISTCA_ASSIGN_OR_RETURN(const LocalOutputs fp32, run(nullptr));
  DISTCA_ASSIGN_OR_RETURN(const LocalOutputs bf16_ref, run(&bf16_kernel));
  DISTCA_ASSIGN_OR_RETURN(const LocalOutputs got, run(&kernel));
  DISTCA_RETURN_IF_ERROR(compare_to_bf16_bound("O", rank, got.o, fp32.o, bf16_ref.o));
  DISTCA_RETURN_IF_ERROR(compare_to_bf16_bound("LSE", rank, got.lse, fp32.lse, bf16_ref.lse));
  DISTCA_RETURN_IF_ERROR(compare_to_bf16_bound("dQ", rank, got.dq, fp32.dq, bf16_ref.dq));
  DISTCA_RETURN_IF_ERROR(compare_to_bf16_bound("dK", rank, got.dk, fp32.dk, bf16_ref.dk));
  DISTCA_RETURN_IF_ERROR(compare_to_bf16_bound("dV", rank, got.dv, fp32.dv, bf16_ref.dv));
  return Status::ok();
}

// Every policy (and a plan that splits key ranges), both backward modes: the checks a GPU run
// makes of the Dispatcher with `kernel`. Returns the number of checks.
inline Result<int> check_kernel_on_plans(comm::Communicator& comm, const plan::Batch& batch, ServerKernel& kernel) {
  int checks = 0;
  std::vector<plan::Plan> plans;
  for (const std::string policy : {"none", "distca", "minmax", "minbytes"}) {
    DISTCA_ASSIGN_OR_RETURN(plan::Plan p, make_plan(batch, policy));
    plans.push_back(std::move(p));
  }
  DISTCA_ASSIGN_OR_RETURN(plan::Plan split, split_key_ranges(batch, plans[2], 17));
  plans.push_back(std::move(split));
  for (const plan::Plan& p : plans) {
    for (auto mode : {plan::BackwardMode::kStateless, plan::BackwardMode::kStateful}) {
      if (Status st = check_kernel_against_cpu(comm, batch, p, mode, kernel, 1000 + checks); !st.is_ok()) {
        return Status(st.code(), fmt::format("plan {} ({} backward): {}", p.policy, plan::backward_mode_name(mode), st.message()));
      }
      ++checks;
    }
  }
  return checks;
}

}  // namespace distca::runtime::testing
