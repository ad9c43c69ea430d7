// The fast CPU attention against the reference: random task lists (documents cut into shards
// that share K/V, non-causal pieces, uncovered rows), fp32 and bf16, every instruction-set build
// this CPU runs (avx512, avx2, portable), builds agreeing with each other, bit-identical results
// across thread counts per build, NaN and infinities where the reference puts them, and the
// choice of build (DISTCA_CPU_ISA).
#include "distca/kernels/cpu.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>

#include "distca/kernels/ref.h"
#include "test_util.h"

namespace distca::kernels {
namespace {

using testing::expect_close;
using testing::TaskSet;
using testing::to_floats;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

template <typename T>
struct Inputs {
  std::vector<T> q, k, v, d_o;
};

template <typename T>
Inputs<T> random_inputs(std::mt19937_64& rng, const AttnDims& n) {
  const int64_t nq = n.num_q_rows * n.num_q_heads * n.head_dim;
  const int64_t nkv = n.num_kv_rows * n.num_kv_heads * n.head_dim;
  return {testing::random_values<T>(rng, nq), testing::random_values<T>(rng, nkv),
          testing::random_values<T>(rng, nkv), testing::random_values<T>(rng, nq)};
}

struct Outputs {
  std::vector<float> o, lse, dq, dk, dv;
};

// Runs forward then backward; the backward gets this forward's O and LSE, or those of `given`.
// Outputs start as NaN, so an element a kernel forgets to write shows up.
template <typename T, typename Fwd, typename Bwd>
Outputs run(const TaskSet& set, const Inputs<T>& in, Fwd&& fwd, Bwd&& bwd,
            const Outputs* given = nullptr) {
  const AttnDims& n = set.dims;
  const int64_t nq = n.num_q_rows * n.num_q_heads * n.head_dim;
  const int64_t nkv = n.num_kv_rows * n.num_kv_heads * n.head_dim;
  std::vector<T> o(nq, from_float<T>(kNaN)), dq(nq, from_float<T>(kNaN));
  std::vector<T> dk(nkv, from_float<T>(kNaN)), dv(nkv, from_float<T>(kNaN));
  std::vector<float> lse(n.num_q_rows * n.num_q_heads, kNaN);
  AttnFwdParams<T> fp{n, in.q.data(), in.k.data(), in.v.data(), set.tasks, {}, o.data(), lse.data()};
  EXPECT_TRUE(fwd(fp).is_ok());
  const std::vector<float> fwd_o = to_floats(o), fwd_lse = lse;
  if (given != nullptr) {
    for (std::size_t i = 0; i < o.size(); ++i) o[i] = from_float<T>(given->o[i]);
    lse = given->lse;
  }
  AttnBwdParams<T> bp{n, in.q.data(), in.k.data(), in.v.data(), o.data(), lse.data(), in.d_o.data(),
                      set.tasks, {}, dq.data(), dk.data(), dv.data()};
  EXPECT_TRUE(bwd(bp).is_ok());
  return {fwd_o, fwd_lse, to_floats(dq), to_floats(dk), to_floats(dv)};
}

// The reference; with `given`, its backward takes rowsum(dO * O) from given->o.
template <typename T, typename Acc>
Outputs run_ref(const TaskSet& set, const Inputs<T>& in, const Outputs* given = nullptr) {
  return run(
      set, in, [](const AttnFwdParams<T>& p) { return ref::attention_forward<T, Acc>(p); },
      [&](const AttnBwdParams<T>& p) { return ref::attention_backward<T, Acc>(p, given != nullptr); },
      given);
}

template <typename T>
Outputs run_cpu(CpuAttention& cpu, const TaskSet& set, const Inputs<T>& in,
                const Outputs* given = nullptr) {
  return run(
      set, in, [&](const AttnFwdParams<T>& p) { return cpu.forward(p); },
      [&](const AttnBwdParams<T>& p) { return cpu.backward(p); }, given);
}

// Compares fast outputs with the double reference. The tolerance of each tensor is derived from
// the error of the same reference loops run with float accumulators: a kernel may be up to 4x
// less accurate than naive fp32 (different summation order), plus a bf16 rounding step.
void expect_matches_reference(const std::string& what, const Outputs& got, const Outputs& ref64,
                              const Outputs& ref32, const AttnDims& n, double rtol) {
  auto check = [&](const char* name, const std::vector<float>& g, const std::vector<float>& w,
                   const std::vector<float>& w32, int64_t heads, int64_t inner) {
    const double atol = 4.0 * testing::max_abs_diff(w32, w) + 1e-6 * testing::max_abs(w) + 1e-30;
    expect_close(what + " " + name, g, w, heads, inner, atol, rtol);
  };
  check("O", got.o, ref64.o, ref32.o, n.num_q_heads, n.head_dim);
  check("LSE", got.lse, ref64.lse, ref32.lse, n.num_q_heads, 1);
  check("dQ", got.dq, ref64.dq, ref32.dq, n.num_q_heads, n.head_dim);
  check("dK", got.dk, ref64.dk, ref32.dk, n.num_kv_heads, n.head_dim);
  check("dV", got.dv, ref64.dv, ref32.dv, n.num_kv_heads, n.head_dim);
}

struct Shape {
  friend void PrintTo(const Shape& s, std::ostream* os) { *os << s.name; }
  const char* name;
  int64_t d, hq, hkv;
  std::vector<int64_t> docs;
  int64_t max_shard;
  int64_t gap;            // uncovered Q rows after each task
  int num_noncausal;      // extra non-causal tasks over random K/V ranges (some empty)
};

std::vector<Shape> shapes() {
  return {
      {"tiny_docs_d64", 64, 1, 1, {1, 2, 3, 7, 13}, 5, 0, 2},
      {"primes_gqa4_d128", 128, 4, 1, {97, 131, 257}, 61, 1, 3},
      {"shards128_mha8_d128", 128, 8, 8, {128, 256, 61}, 128, 0, 1},
      {"gqa8_d64", 64, 8, 1, {200, 1, 17}, 40, 2, 2},
      {"d32", 32, 2, 2, {100, 3}, 33, 0, 1},
      {"d256", 256, 2, 1, {70}, 70, 0, 1},
  };
}

// Appends non-causal tasks (new Q rows, random K/V range, kv_len may be 0).
void add_noncausal(std::mt19937_64& rng, TaskSet& set, int count) {
  for (int c = 0; c < count; ++c) {
    const int64_t q_len = std::uniform_int_distribution<int64_t>(1, 70)(rng);
    const int64_t kv_len = c == 0 ? 0 : std::uniform_int_distribution<int64_t>(1, std::max<int64_t>(1, set.dims.num_kv_rows))(rng);
    const int64_t kv_offset = std::uniform_int_distribution<int64_t>(0, set.dims.num_kv_rows - std::min(kv_len, set.dims.num_kv_rows))(rng);
    set.tasks.push_back({set.dims.num_q_rows, q_len, kv_offset, std::min(kv_len, set.dims.num_kv_rows), false});
    set.dims.num_q_rows += q_len;
  }
}

TaskSet make_set(std::mt19937_64& rng, const Shape& s) {
  TaskSet set = testing::shard_documents(rng, s.docs, s.max_shard, s.hq, s.hkv, s.d, s.gap);
  add_noncausal(rng, set, s.num_noncausal);
  return set;
}

class CpuVsReference : public ::testing::TestWithParam<Shape> {};

// Every build this CPU runs, fastest first.
std::vector<std::string> isas() { return cpu_isas_supported(); }

TEST_P(CpuVsReference, Fp32MatchesDoubleReference) {
  std::mt19937_64 rng(7);
  const TaskSet set = make_set(rng, GetParam());
  const auto in = random_inputs<float>(rng, set.dims);
  const Outputs ref64 = run_ref<float, double>(set, in), ref32 = run_ref<float, float>(set, in);
  for (const std::string& isa : isas()) {
    CpuAttention cpu({.isa = isa});
    ASSERT_EQ(cpu.isa(), isa);
    expect_matches_reference(isa, run_cpu(cpu, set, in), ref64, ref32, set.dims, 0.0);
  }
}

TEST_P(CpuVsReference, Bf16MatchesDoubleReference) {
  std::mt19937_64 rng(11);
  const TaskSet set = make_set(rng, GetParam());
  const auto in = random_inputs<bf16>(rng, set.dims);
  // Every backward gets the reference forward's O, rounded to bf16 as the kernel's own would be
  // (so the same rounded rowsum(dO * O) enters all of them). Both sides round their results to
  // bf16 (8 significant bits): allow two roundings.
  const Outputs ref64 = run_ref<bf16, double>(set, in);
  const Outputs given64 = run_ref<bf16, double>(set, in, &ref64), given32 = run_ref<bf16, float>(set, in, &ref64);
  for (const std::string& isa : isas()) {
    CpuAttention cpu({.isa = isa});
    expect_matches_reference(isa + " bf16", run_cpu(cpu, set, in, &ref64), given64, given32, set.dims, 1.0 / 128);
  }
}

// The builds compute the same function in different orders (vector widths, register tiles):
// they agree with each other as closely as each agrees with the double reference.
TEST_P(CpuVsReference, BuildsAgreeWithinFp32Rounding) {
  if (isas().size() < 2) GTEST_SKIP() << "this CPU runs one build only: " << isas().front();
  std::mt19937_64 rng(13);
  const TaskSet set = make_set(rng, GetParam());
  const auto in = random_inputs<float>(rng, set.dims);
  const Outputs ref64 = run_ref<float, double>(set, in), ref32 = run_ref<float, float>(set, in);
  const std::vector<std::string> names = isas();
  CpuAttention first({.isa = names.front()});
  const Outputs base = run_cpu(first, set, in);
  for (std::size_t i = 1; i < names.size(); ++i) {
    CpuAttention other({.isa = names[i]});
    const Outputs got = run_cpu(other, set, in);
    const AttnDims& n = set.dims;
    auto check = [&](const char* name, const std::vector<float>& g, const std::vector<float>& b,
                     const std::vector<float>& w64, const std::vector<float>& w32, int64_t heads, int64_t inner) {
      // Each is within 4x the naive fp32 error of the truth, so within 8x of each other.
      const double atol = 8.0 * testing::max_abs_diff(w32, w64) + 2e-6 * testing::max_abs(w64) + 1e-30;
      expect_close(names[i] + " vs " + names.front() + " " + name, g, b, heads, inner, atol, 0.0);
    };
    check("O", got.o, base.o, ref64.o, ref32.o, n.num_q_heads, n.head_dim);
    check("LSE", got.lse, base.lse, ref64.lse, ref32.lse, n.num_q_heads, 1);
    check("dQ", got.dq, base.dq, ref64.dq, ref32.dq, n.num_q_heads, n.head_dim);
    check("dK", got.dk, base.dk, ref64.dk, ref32.dk, n.num_kv_heads, n.head_dim);
    check("dV", got.dv, base.dv, ref64.dv, ref32.dv, n.num_kv_heads, n.head_dim);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuVsReference, ::testing::ValuesIn(shapes()),
                         [](const auto& info) { return std::string(info.param.name); });

// 4096-token lengths: the last two 128-query shards of a 4096-token document (keys 3968 and
// 4096) and one whole 4096-token task. fp32 only: the reference over every shard of such a
// document would dominate the suite, and bf16 and the portable build share this code path.
TEST(CpuVsReferenceLong, QueriesAndKeysOf4096Tokens) {
  std::mt19937_64 rng(19);
  TaskSet set;
  set.tasks = {{0, 128, 0, 3968, true}, {128, 128, 0, 4096, true}, {256, 4096, 0, 4096, true}};
  set.dims = {256 + 4096, 4096, 1, 1, 128};
  const auto in = random_inputs<float>(rng, set.dims);
  const Outputs ref64 = run_ref<float, double>(set, in), ref32 = run_ref<float, float>(set, in);
  for (const std::string& isa : isas()) {
    CpuAttention cpu({.isa = isa});
    expect_matches_reference(isa, run_cpu(cpu, set, in), ref64, ref32, set.dims, 0.0);
  }
}

TEST(CpuAttention, BitIdenticalForAnyThreadCount) {
  std::mt19937_64 rng(3);
  // About 24 tasks of 1..45 rows (more than any thread count below), a quarter of the pairs of
  // documents twice as long: under qemu (scripts/test-aarch64.sh) this test took 37 s at that size.
  TaskSet set = testing::shard_documents(rng, {150, 45, 350}, 45, 4, 2, 64, 1);
  add_noncausal(rng, set, 2);
  const auto in = random_inputs<float>(rng, set.dims);
  for (const std::string& isa : isas()) {
    CpuAttention one({.num_threads = 1, .isa = isa});
    const Outputs base = run_cpu(one, set, in);
    for (int threads : {2, 3, 5}) {
      CpuAttention many({.num_threads = threads, .isa = isa});
      const Outputs got = run_cpu(many, set, in);
      for (auto [a, b] : {std::pair{&got.o, &base.o}, {&got.lse, &base.lse}, {&got.dq, &base.dq},
                          {&got.dk, &base.dk}, {&got.dv, &base.dv}}) {
        ASSERT_EQ(a->size(), b->size());
        EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->size() * sizeof(float)))
            << isa << ": " << threads << " threads differ from one";
      }
    }
  }
}

// What an element is, for the NaN/inf propagation test: finite, NaN, +inf or -inf.
char kind(float x) { return std::isnan(x) ? 'n' : x == std::numeric_limits<float>::infinity() ? '+' : std::isinf(x) ? '-' : 'f'; }

// Issue 72 row 2: one NaN, +inf or -inf element in Q, K, V or dO gives NaN and infinities exactly
// where the reference puts them, element for element, in O, LSE, dQ, dK and dV, forward and
// backward, on every build this CPU runs; a NaN is never hidden as 0 (before: exp2 read a NaN
// score as 2^-127, a NaN row sum as "no keys") and never reaches a pair the causal mask hides
// (0 * inf). Causal shards sharing K/V, with the mask inside 64-key blocks, GQA and non-causal
// tasks; positions in the first row of a document (one key), a middle row and the last.
TEST(CpuAttention, NonFiniteInputsPropagateExactlyAsTheReference) {
  std::mt19937_64 rng(72);
  TaskSet set = testing::shard_documents(rng, {130, 40, 1}, 45, 2, 1, 64, 1);
  add_noncausal(rng, set, 2);
  const Inputs<float> clean = random_inputs<float>(rng, set.dims);
  const AttnDims& n = set.dims;
  const int64_t q_row = n.num_q_heads * n.head_dim, kv_row = n.num_kv_heads * n.head_dim;
  struct Where {
    const char* tensor;
    int64_t row;  // Q/dO rows for q and d_o, K/V rows for k and v
  };
  // K/V row 0 is key 0 of the first document (every query of it sees it); 129 its last key; 130
  // the first key of the 40-token document. Q row 0 is that document's first query.
  const Where wheres[] = {{"q", 0}, {"q", 70}, {"k", 0}, {"k", 100}, {"k", 129}, {"v", 0}, {"v", 120},
                          {"v", 130}, {"d_o", 3}, {"d_o", n.num_q_rows - 1}};
  const float values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()};
  std::vector<std::unique_ptr<CpuAttention>> kernels;
  for (const std::string& isa : isas()) kernels.push_back(std::make_unique<CpuAttention>(CpuAttentionOptions{.isa = isa}));
  int non_finite_outputs = 0;
  for (const Where& w : wheres) {
    for (const float value : values) {
      Inputs<float> in = clean;
      std::vector<float>& t = w.tensor == std::string("q") ? in.q : w.tensor == std::string("k") ? in.k
                              : w.tensor == std::string("v") ? in.v : in.d_o;
      const int64_t stride = (t.size() == in.q.size()) ? q_row : kv_row;
      t[w.row * stride + 5] = value;  // head 0, d 5
      const Outputs want = run_ref<float, double>(set, in);
      for (const auto& cpu : kernels) {
        const Outputs got = run_cpu(*cpu, set, in);
        const std::string what = fmt::format("{}: {}[{}] = {}", cpu->isa(), w.tensor, w.row, value);
        for (auto [name, g, r] : {std::tuple{"O", &got.o, &want.o}, {"LSE", &got.lse, &want.lse},
                                  {"dQ", &got.dq, &want.dq}, {"dK", &got.dk, &want.dk}, {"dV", &got.dv, &want.dv}}) {
          ASSERT_EQ(g->size(), r->size());
          int mismatches = 0;
          std::size_t first = 0;
          for (std::size_t i = 0; i < g->size(); ++i) {
            if (kind((*g)[i]) != kind((*r)[i]) && mismatches++ == 0) first = i;
            non_finite_outputs += kind((*r)[i]) != 'f' && !(std::string(name) == "LSE" && (*r)[i] < 0);
          }
          EXPECT_EQ(mismatches, 0) << what << ": " << name << " differs in " << mismatches << " elements, first at "
                                   << first << ": got " << (*g)[first] << ", the reference " << (*r)[first];
        }
      }
    }
  }
  EXPECT_GT(non_finite_outputs, 0);  // the cases reach the outputs at all
}

// CpuAttentionOptions::poll (ping-pong's MPI progress while a server computes) runs on the
// calling thread only, during the forward and the backward, and changes no result.
TEST(CpuAttention, PollRunsOnTheCallingThreadBetweenWorkItemsAndChangesNothing) {
  std::mt19937_64 rng(5);
  TaskSet set = testing::shard_documents(rng, {150, 45, 350}, 45, 4, 2, 64, 1);
  const auto in = random_inputs<float>(rng, set.dims);
  CpuAttention plain({.num_threads = 3});
  const Outputs base = run_cpu(plain, set, in);
  const std::thread::id caller = std::this_thread::get_id();
  int polls = 0, elsewhere = 0;
  CpuAttention polled({.num_threads = 3,
                       .poll = [&] { std::this_thread::get_id() == caller ? ++polls : ++elsewhere; },
                       .poll_interval = std::chrono::microseconds(0)});
  const Outputs got = run_cpu(polled, set, in);
  EXPECT_GE(polls, 1) << "one forward and one backward of " << set.tasks.size() << " tasks";
  EXPECT_EQ(elsewhere, 0) << "a pool thread polled: MPI_THREAD_SERIALIZED allows the caller only";
  for (auto [a, b] : {std::pair{&got.o, &base.o}, {&got.lse, &base.lse}, {&got.dq, &base.dq},
                      {&got.dk, &base.dk}, {&got.dv, &base.dv}}) {
    ASSERT_EQ(a->size(), b->size());
    EXPECT_EQ(0, std::memcmp(a->data(), b->data(), a->size() * sizeof(float)));
  }
  // The interval holds the polls back: none more often than it allows.
  int rare = 0;
  CpuAttention throttled({.num_threads = 1, .poll = [&] { ++rare; }, .poll_interval = std::chrono::hours(1)});
  (void)run_cpu(throttled, set, in);
  EXPECT_LE(rare, 1);
}

// A backward work item can be long (a unit is a segment's key rows for one head: about 0.1 s on
// the demo), so the calling thread also polls inside it, once per query block of a key sweep.
TEST(CpuAttention, PollRunsInsideALongBackwardUnit) {
  std::mt19937_64 rng(6);
  // A causal document of 2048 rows in at most 3 shards, one head, D 64.
  TaskSet set = testing::shard_documents(rng, {2048}, 2048, 1, 1, 64);
  ASSERT_LE(set.tasks.size(), 3u);
  const auto in = random_inputs<float>(rng, set.dims);
  int polls = 0;
  CpuAttention cpu({.num_threads = 1, .poll = [&] { ++polls; }, .poll_interval = std::chrono::microseconds(0)});
  (void)run_cpu(cpu, set, in);
  // Between work items alone: at most 34 query blocks (32 and one per cut), polled after the
  // forward, the pack and the dQ store, and the units (at most one per 64 key rows: 32): 134.
  // Inside the units: a poll per query block of each 256-row key sweep, about 140 more.
  EXPECT_GT(polls, 134);
}

// Sets an environment variable for one scope and restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(CpuIsa, BuildsAreListedFastestFirstAndPortableAlwaysRuns) {
  const std::vector<std::string> built = cpu_isas_built(), runs = cpu_isas_supported();
  ASSERT_FALSE(runs.empty());
  EXPECT_EQ(built.back(), "portable");
  EXPECT_EQ(runs.back(), "portable");
#if defined(__x86_64__)
  EXPECT_EQ(built, (std::vector<std::string>{"avx512", "avx2", "portable"}));
#endif
  for (const std::string& isa : runs) EXPECT_NE(std::find(built.begin(), built.end(), isa), built.end()) << isa;
}

TEST(CpuIsa, EmptyAndAutoPickTheFastestAndTheEnvironmentForcesABuild) {
  ScopedEnv unset(kCpuIsaEnv, "");
  EXPECT_EQ(resolve_cpu_isa("").value(), cpu_isas_supported().front());
  EXPECT_EQ(resolve_cpu_isa("auto").value(), cpu_isas_supported().front());
  EXPECT_EQ(CpuAttention().isa(), cpu_isas_supported().front());
  for (const std::string& isa : cpu_isas_supported()) {
    ScopedEnv forced(kCpuIsaEnv, isa.c_str());
    EXPECT_EQ(resolve_cpu_isa("").value(), isa);
    EXPECT_EQ(CpuAttention().isa(), isa);
    EXPECT_EQ(resolve_cpu_isa("portable").value(), "portable") << "an explicit choice beats the environment";
  }
}

TEST(CpuIsa, UnknownOrUnrunnableBuildsAreRefusedWithTheChoices) {
  const Status st = check_cpu_isa("avx9000");
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("portable"), std::string::npos) << st.message();
  {
    ScopedEnv bad(kCpuIsaEnv, "avx9000");
    const Result<std::string> r = resolve_cpu_isa("");
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("DISTCA_CPU_ISA=avx9000"), std::string::npos) << r.status().message();
  }
  // A build compiled in that this CPU cannot run (avx512 on an AVX2-only CPU, say).
  const std::vector<std::string> runs = cpu_isas_supported();
  for (const std::string& isa : cpu_isas_built()) {
    if (std::find(runs.begin(), runs.end(), isa) != runs.end()) continue;
    const Status no = check_cpu_isa(isa);
    EXPECT_EQ(no.code(), StatusCode::kInvalidArgument) << isa;
    EXPECT_NE(no.message().find("cannot run"), std::string::npos) << no.message();
  }
}

TEST(CpuAttention, EmptyTaskListWritesZerosAndNegInf) {
  TaskSet set;
  set.dims = {5, 7, 2, 1, 64};
  std::mt19937_64 rng(1);
  const auto in = random_inputs<float>(rng, set.dims);
  CpuAttention cpu;
  const Outputs got = run_cpu(cpu, set, in);
  for (float x : got.o) EXPECT_EQ(x, 0.0f);
  for (float x : got.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  for (const auto* g : {&got.dq, &got.dk, &got.dv})
    for (float x : *g) EXPECT_EQ(x, 0.0f);
}

TEST(CpuAttention, ZeroRowsAndZeroTasksAreFine) {
  TaskSet set;
  set.dims = {0, 0, 1, 1, 128};
  Inputs<float> in;
  CpuAttention cpu;
  const Outputs got = run_cpu(cpu, set, in);
  EXPECT_TRUE(got.o.empty());
}

TEST(CpuAttention, RejectsHeadDimsThatAreNotBuilt) {
  TaskSet set;
  set.dims = {4, 4, 1, 1, 48};
  set.tasks = {{0, 4, 0, 4, true}};
  std::vector<float> q(4 * 48, 1.0f), o(4 * 48), lse(4);
  CpuAttention cpu;
  const Status st = cpu.forward(AttnFwdParams<float>{set.dims, q.data(), q.data(), q.data(), set.tasks, {}, o.data(), lse.data()});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("D = 48"), std::string::npos) << st.message();
}

TEST(CpuAttention, RejectsInvalidTasksBeforeTouchingOutputs) {
  AttnDims dims{8, 8, 1, 1, 64};
  std::vector<float> buf(8 * 64, 1.0f), o(8 * 64, 5.0f), lse(8, 5.0f);
  CpuAttention cpu;
  const std::vector<AttnTask> overlapping = {{0, 4, 0, 4, true}, {3, 2, 0, 8, true}};
  const Status st = cpu.forward(AttnFwdParams<float>{dims, buf.data(), buf.data(), buf.data(), overlapping, {}, o.data(), lse.data()});
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(o[0], 5.0f);
}

TEST(CpuAttention, ScaleOverridesTheDefault) {
  std::mt19937_64 rng(5);
  const TaskSet set = testing::shard_documents(rng, {50}, 20, 1, 1, 64);
  const auto in = random_inputs<float>(rng, set.dims);
  auto with_scale = [&](auto&& fwd) {
    std::vector<float> o(in.q.size()), lse(set.dims.num_q_rows);
    AttnFwdParams<float> p{set.dims, in.q.data(), in.k.data(), in.v.data(), set.tasks, 0.3f, o.data(), lse.data()};
    EXPECT_TRUE(fwd(p).is_ok());
    return o;
  };
  CpuAttention cpu;
  const auto got = with_scale([&](const AttnFwdParams<float>& p) { return cpu.forward(p); });
  const auto want = with_scale([](const AttnFwdParams<float>& p) { return ref::attention_forward(p); });
  expect_close("O at scale 0.3", got, want, 1, 64, 1e-5);
}

}  // namespace
}  // namespace distca::kernels
