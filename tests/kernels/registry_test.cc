// The kernel registry (registry.h) against the kernels themselves: for every CPU entry, supports()
// answers what running the kernel on a small task list does (accepted runs, refused is refused
// with the same message); the head dims an entry lists are exactly the ones its kernel accepts;
// built() is what the build has; the CUDA entries are CudaAttention's implementations.
#include "distca/kernels/registry.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "distca/kernels/cpu.h"
#include "distca/kernels/cuda.h"
#include "distca/kernels/cudnn.h"
#include "distca/kernels/gemm_attention.h"
#include "distca/kernels/ref.h"
#include "test_util.h"

namespace distca::kernels {
namespace {

// A small problem of `d` head dims over `tasks`, with room for every output.
template <typename T>
struct Problem {
  AttnDims dims;
  std::vector<AttnTask> tasks;
  std::vector<T> q, k, v, o, d_o, dq, dk, dv;
  std::vector<float> lse;

  Problem(int64_t d, std::vector<AttnTask> list, int64_t q_rows = 12, int64_t kv_rows = 12)
      : dims{q_rows, kv_rows, 2, 1, d}, tasks(std::move(list)) {
    std::mt19937_64 rng(static_cast<uint64_t>(d));
    const int64_t nq = q_rows * 2 * d, nkv = kv_rows * d;
    q = testing::random_values<T>(rng, nq);
    k = testing::random_values<T>(rng, nkv);
    v = testing::random_values<T>(rng, nkv);
    d_o = testing::random_values<T>(rng, nq);
    o.resize(nq);
    dq.resize(nq);
    dk.resize(nkv);
    dv.resize(nkv);
    lse.resize(q_rows * 2);
  }
  AttnFwdParams<T> fwd() { return {dims, q.data(), k.data(), v.data(), tasks, {}, o.data(), lse.data()}; }
  AttnBwdParams<T> bwd() {
    return {dims, q.data(), k.data(), v.data(), o.data(), lse.data(), d_o.data(), tasks, {}, dq.data(), dk.data(),
            dv.data()};
  }
};

const std::vector<AttnTask> kGood{{0, 5, 0, 5, true}, {5, 3, 0, 8, true}, {8, 4, 2, 6, false}};
const std::vector<AttnTask> kOverlapping{{0, 5, 0, 5, true}, {3, 3, 0, 8, true}};
const std::vector<AttnTask> kWideCausal{{0, 6, 0, 4, true}};

// What a CPU entry's kernel answers for one pass: its Status (the same call as supports()).
template <typename T>
Status run_cpu(std::string_view name, Problem<T>& p, Pass pass) {
  if (name == "reference") {
    if (pass == Pass::kForward) return ref::attention_forward(p.fwd());
    // The backward recomputes the forward: the given O and LSE are only inputs.
    if (Status st = ref::attention_forward(p.fwd()); !st.is_ok()) return st;
    return ref::attention_backward(p.bwd());
  }
  if (name == "cpu") {
    CpuAttention attention(CpuAttentionOptions{.num_threads = 2});
    if (pass == Pass::kForward) return attention.forward(p.fwd());
    if (Status st = attention.forward(p.fwd()); !st.is_ok()) return st;
    return attention.backward(p.bwd());
  }
  if constexpr (std::is_same_v<T, float>) {
    if (name == "gemm" && pass == Pass::kForward) return GemmAttention(2).forward(p.fwd());
  }
  ADD_FAILURE() << "no way to run " << name << " here";
  return internal_error("unreachable");
}

template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, float> ? DType::kFloat32 : DType::kBfloat16;
}

// The kernel runs T (its C++ API has that entry point) for `pass`.
template <typename T>
bool has_entry_point(std::string_view name, Pass pass) {
  if (name == "gemm") return std::is_same_v<T, float> && pass == Pass::kForward;
  return true;
}

template <typename T>
void expect_supports_agrees_with_running(const KernelInfo& info) {
  for (int64_t d : {16, 32, 48, 64, 96, 128, 256}) {
    for (const std::vector<AttnTask>* tasks : {&kGood, &kOverlapping, &kWideCausal}) {
      for (Pass pass : {Pass::kForward, Pass::kBackward}) {
        Problem<T> p(d, *tasks);
        const Status said = supports(info, p.dims, p.tasks, dtype_of<T>(), pass);
        const std::string what = fmt::format("{} D = {} {} tasks, {}", info.name, d,
                                             tasks == &kGood ? "good" : tasks == &kOverlapping ? "overlapping" : "wide causal",
                                             pass == Pass::kForward ? "forward" : "backward");
        if (!has_entry_point<T>(info.name, pass)) {
          EXPECT_FALSE(said.is_ok()) << what << ": the kernel has no such entry point, supports() must say no";
          continue;
        }
        const Status ran = run_cpu<T>(info.name, p, pass);
        EXPECT_EQ(said.is_ok(), ran.is_ok()) << what << ": supports() " << said.to_string() << ", ran "
                                             << ran.to_string();
        if (!said.is_ok() && !ran.is_ok()) {
          EXPECT_EQ(said.message(), ran.message()) << what;
          EXPECT_EQ(said.code(), StatusCode::kInvalidArgument) << what;
        }
        if (ran.is_ok()) {
          for (float x : p.lse) EXPECT_FALSE(std::isnan(x)) << what << ": an accepted run writes every LSE";
        }
      }
    }
  }
}

TEST(KernelRegistry, NamesAreUniqueAndFindable) {
  std::set<std::string_view> names;
  for (const KernelInfo& k : kKernels) {
    EXPECT_TRUE(names.insert(k.name).second) << k.name;
    ASSERT_TRUE(find_kernel(k.name).is_ok());
    EXPECT_EQ(find_kernel(k.name).value(), &k);
    EXPECT_EQ(&kernel_info(k.name), &k);
    EXPECT_FALSE(k.dtypes.empty()) << k.name;
    EXPECT_FALSE(k.summary.empty()) << k.name;
  }
  EXPECT_EQ(names, (std::set<std::string_view>{"reference", "cpu", "gemm", "distca", "hopper", "cudnn"}));
  const Result<const KernelInfo*> unknown = find_kernel("flash");
  ASSERT_FALSE(unknown.is_ok());
  EXPECT_NE(unknown.status().message().find("reference, cpu, gemm, distca, cudnn, hopper"), std::string::npos)
      << unknown.status().to_string();
}

TEST(KernelRegistry, DTypeNamesRoundTrip) {
  for (DType d : {DType::kFloat32, DType::kBfloat16, DType::kFloat16}) EXPECT_EQ(parse_dtype(dtype_name(d)).value(), d);
  EXPECT_FALSE(parse_dtype("float64").is_ok());
}

TEST(KernelRegistry, CpuEntriesSupportWhatTheirKernelsRun) {
  for (const KernelInfo& k : kKernels) {
    if (k.device != KernelDevice::kCpu) continue;
    EXPECT_TRUE(built(k).is_ok()) << k.name;
    SCOPED_TRACE(std::string(k.name));
    expect_supports_agrees_with_running<float>(k);
    expect_supports_agrees_with_running<bf16>(k);
    EXPECT_FALSE(supports(k, {12, 12, 2, 1, 64}, kGood, DType::kFloat16).is_ok()) << "no CPU kernel takes float16";
  }
}

TEST(KernelRegistry, TheCpuKernelsAcceptExactlyTheListedHeadDims) {
  const KernelInfo& cpu = kernel_info("cpu");
  const std::vector<AttnTask> one{{0, 3, 0, 3, true}};
  std::vector<int64_t> accepted;
  for (int64_t d = 1; d <= 300; ++d) {
    Problem<float> p(d, one, 3, 3);
    CpuAttention attention(CpuAttentionOptions{.num_threads = 1});
    const bool ran = attention.forward(p.fwd()).is_ok() && attention.backward(p.bwd()).is_ok();
    EXPECT_EQ(ran, supports(cpu, p.dims, one, DType::kFloat32, Pass::kBackward).is_ok()) << "D = " << d;
    if (ran) accepted.push_back(d);
  }
  EXPECT_EQ(accepted, std::vector<int64_t>(cpu.head_dims.begin(), cpu.head_dims.end()));
  EXPECT_EQ(check_head_dim(cpu, 16).message(), "the CPU attention kernels are built for head dims 32, 64, 128 and 256, got D = 16");
  EXPECT_EQ(head_dims_text(kernel_info("reference")), "any");
}

// The CUDA implementations share one contract: one set of dtypes and head dims, which their host
// checks (validate, run before any launch by all three) accept and nothing else.
TEST(KernelRegistry, TheCudaEntriesAreCudaAttentionsImplementationsAndShareItsChecks) {
  const KernelInfo& distca = kernel_info("distca");
  for (CudaKernel kernel : {CudaKernel::kDistca, CudaKernel::kHopper, CudaKernel::kCudnn}) {
    const KernelInfo& k = kernel_info(cuda_kernel_name(kernel));
    EXPECT_EQ(k.device, KernelDevice::kCuda);
    EXPECT_EQ(parse_cuda_kernel(k.name).value(), kernel);
    EXPECT_TRUE(std::ranges::equal(k.dtypes, distca.dtypes)) << k.name;
    EXPECT_TRUE(std::ranges::equal(k.head_dims, distca.head_dims)) << k.name;
    EXPECT_TRUE(k.has_backward);
  }
  int cuda_entries = 0;
  for (const KernelInfo& k : kKernels) cuda_entries += k.device == KernelDevice::kCuda;
  EXPECT_EQ(cuda_entries, 3);

  alignas(16) static uint16_t buffer[12 * 2 * 300];
  static float lse[24];
  std::vector<int64_t> accepted;
  for (int64_t d = 1; d <= 300; ++d) {
    CudaFwdArgs a;
    a.dims = {12, 12, 2, 1, d};
    a.q = a.k = a.v = a.o = buffer;
    a.lse = lse;
    a.tasks = kGood;
    const Status checked = validate(a);
    if (checked.is_ok()) accepted.push_back(d);
    EXPECT_EQ(checked.is_ok(), validate_cuda_tasks(a.dims, a.tasks).is_ok()) << "D = " << d;
    if (built(distca).is_ok()) {
      EXPECT_EQ(checked.is_ok(), supports(distca, a.dims, a.tasks, DType::kBfloat16).is_ok()) << "D = " << d;
    }
  }
  EXPECT_EQ(accepted, std::vector<int64_t>(distca.head_dims.begin(), distca.head_dims.end()));
  EXPECT_EQ(check_head_dim(distca, 96).message(), "the CUDA kernels are built for head dims 64 and 128, got D = 96");
}

TEST(KernelRegistry, BuiltIsWhatThisBuildHas) {
  EXPECT_EQ(built(kernel_info("distca")).is_ok(), cuda_kernels_built());
  EXPECT_EQ(built(kernel_info("cudnn")).is_ok(), cudnn_built());
  EXPECT_EQ(built(kernel_info("hopper")).is_ok(),
            cuda_kernels_built() && cuda_kernels_archs().find("90a") != std::string::npos);
  // What is not built is refused for every call, with the reason, and so is creating it.
  for (const KernelInfo& k : kKernels) {
    const Status b = built(k);
    if (b.is_ok()) continue;
    EXPECT_EQ(b.code(), StatusCode::kNotFound) << k.name;
    const Status said = supports(k, {12, 12, 2, 1, 64}, kGood, DType::kBfloat16);
    EXPECT_EQ(said.message(), b.message()) << k.name;
  }
  if (!cuda_kernels_built()) {
    EXPECT_EQ(CudaAttention::create(-1, CudaKernel::kDistca).status().message(), built(kernel_info("distca")).message());
  }
  if (!cudnn_built()) {
    EXPECT_EQ(CudnnAttention::create().status().message(), built(kernel_info("cudnn")).message());
  }
}

TEST(KernelRegistry, CudaEntriesRefuseWhatTheirChecksRefuse) {
  for (const KernelInfo& k : kKernels) {
    if (k.device != KernelDevice::kCuda || !built(k).is_ok()) continue;
    const AttnDims dims{12, 12, 2, 1, 64};
    EXPECT_TRUE(supports(k, dims, kGood, DType::kFloat16, Pass::kBackward).is_ok()) << k.name;
    EXPECT_FALSE(supports(k, dims, kGood, DType::kFloat32).is_ok()) << k.name << ": the CUDA kernels store 16 bits";
    EXPECT_EQ(supports(k, dims, kOverlapping, DType::kBfloat16).message(), validate(dims, kOverlapping).message());
    const std::vector<AttnTask> huge{{0, int64_t{1} << 31, 0, int64_t{1} << 31, true}};
    const AttnDims huge_dims{int64_t{1} << 31, int64_t{1} << 31, 1, 1, 64};
    EXPECT_NE(supports(k, huge_dims, huge, DType::kBfloat16).message().find("2^31-1 rows per task"), std::string::npos);
  }
}

}  // namespace
}  // namespace distca::kernels
