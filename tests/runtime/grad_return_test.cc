// The bf16 return of dK/dV partial sums (DispatchOptions::grad_return) over LocalComm: against
// the fp32 return its dK/dV are within one bf16 rounding of each partial that crosses ranks (and
// everything else is bit for bit the same); it is the fp32 result exactly when every partial is a
// bf16 value; only the backward return's bytes change, by half of their dK/dV share; and a value
// that is neither fp32 nor bf16 is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>

#include "distca/comm/local_comm.h"
#include "distca/core/bf16.h"
#include "distca/plan/plan.h"
#include "harness.h"
#include "rank_status.h"

namespace distca::runtime {
namespace {

using comm::Communicator;
using comm::LocalWorld;
using plan::BackwardMode;
using plan::GradReturn;

using distca::testing::expect_all_ok;

// Documents of 1 to 3 T tokens packed into R ranks of T: most of them span ranks, so K/V rows
// have partial sums on several servers.
plan::Batch spanning_batch(uint64_t seed, int R, int64_t T) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> lengths;
  int64_t total = 0;
  while (total < R * T) {
    lengths.push_back(std::uniform_int_distribution<int64_t>(8, 3 * T)(rng));
    total += lengths.back();
  }
  auto batch = plan::pack_documents(lengths, R, T);
  EXPECT_TRUE(batch.is_ok()) << batch.status().to_string();
  return batch.value();
}

// A key-split plan: minbytes' own splits, then more (harness.h), so that many K/V rows get
// partial sums from several servers.
plan::Plan key_split_plan(const plan::Batch& batch, uint64_t seed) {
  auto base = testing::make_plan(batch, "minbytes");
  EXPECT_TRUE(base.is_ok()) << base.status().to_string();
  auto split = testing::split_key_ranges(batch, base.value(), seed);
  EXPECT_TRUE(split.is_ok()) << split.status().to_string();
  return split.value();
}

// CpuAttention whose backward then rewrites the server's dK/dV partial sums: kRound to the
// nearest bf16 value (a bf16 return then carries them exactly), kAbs to their magnitudes (the
// owner's sum is then the sum of |partial|, the scale of the rounding bound).
class PartialKernel final : public ServerKernel {
 public:
  enum class Rewrite { kNone, kRound, kAbs };
  explicit PartialKernel(Rewrite rewrite) : rewrite_(rewrite) {}
  Status forward(const kernels::AttnFwdParams<float>& p) override { return attention_.forward(p); }
  Status backward(const kernels::AttnBwdParams<float>& p) override {
    DISTCA_RETURN_IF_ERROR(attention_.backward(p));
    const int64_t n = p.dims.num_kv_rows * p.dims.num_kv_heads * p.dims.head_dim;
    for (float* t : {p.dk, p.dv}) {
      for (int64_t i = 0; i < n; ++i) {
        if (rewrite_ == Rewrite::kRound) t[i] = static_cast<float>(bf16(t[i]));
        if (rewrite_ == Rewrite::kAbs) t[i] = std::abs(t[i]);
      }
    }
    return Status::ok();
  }

 private:
  kernels::CpuAttention attention_{kernels::CpuAttentionOptions{.num_threads = 1}};
  Rewrite rewrite_;
};

struct Outcome {
  testing::LocalOutputs out;
  std::array<int64_t, plan::kNumPhases> sent{};  // bytes this rank sent per phase
};

// One forward and backward of this rank's rows with the given return and server kernel.
Result<Outcome> run_once(Communicator& comm, const plan::Batch& batch, const plan::Plan& plan, const testing::DispatchCase& c,
                     const testing::GlobalInputs& in, GradReturn grad_return, PartialKernel::Rewrite rewrite) {
  PartialKernel kernel(rewrite);
  DispatchOptions options;
  options.backward_mode = c.mode;
  options.grad_return = grad_return;
  options.kernel = &kernel;
  DISTCA_ASSIGN_OR_RETURN(auto d, Dispatcher::create(comm, batch, plan, c.heads, options));
  Outcome run;
  DISTCA_ASSIGN_OR_RETURN(run.out, testing::run_local(*d, testing::global_layout(batch).local_rows[comm.rank()], in));
  for (int p = 0; p < plan::kNumPhases; ++p) run.sent[p] = d->stats(static_cast<plan::Phase>(p)).bytes_sent;
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The owner sums n <= R partials p_i in fp32, the same order either way; bf16 rounds each remote
// one, |bf16(p) - p| <= 2^-8 |p| (8 significant bits, to nearest) + 2^-134 (below bf16's normal
// range). With the two fp32 sums' own errors (gamma_{n-1} each, about (n-1) 2^-24 of sum |p_i|):
//   |bf16 return - fp32 return| <= (2^-8 + 3 R 2^-24) sum |p_i| + R 2^-134.
TEST(GradReturn, Bf16IsWithinOneRoundingOfEachPartial) {
  double worst = 0;  // the largest error over its bound, every case
  int64_t rounded = 0;  // elements whose bf16 return differs from the fp32 one
  for (int R : {2, 3, 4}) {
    for (BackwardMode mode : {BackwardMode::kStateless, BackwardMode::kStateful}) {
      SCOPED_TRACE(fmt::format("R={} mode={}", R, plan::backward_mode_name(mode)));
      const plan::Batch batch = spanning_batch(30 + R, R, 96);
      const plan::Plan plan = key_split_plan(batch, 60 + R);
      testing::DispatchCase c;
      c.seed = 5 * R + 2;
      c.mode = mode;
      const testing::GlobalInputs in = testing::random_inputs(testing::global_layout(batch), c);
      std::vector<double> worst_of(R, 0.0);
      std::vector<int64_t> rounded_of(R, 0);
      expect_all_ok(LocalWorld::run(R, [&](Communicator& comm) -> Status {
        using Rewrite = PartialKernel::Rewrite;
        DISTCA_ASSIGN_OR_RETURN(const Outcome exact, run_once(comm, batch, plan, c, in, GradReturn::kFp32, Rewrite::kNone));
        DISTCA_ASSIGN_OR_RETURN(const Outcome half, run_once(comm, batch, plan, c, in, GradReturn::kBf16, Rewrite::kNone));
        DISTCA_ASSIGN_OR_RETURN(const Outcome scale, run_once(comm, batch, plan, c, in, GradReturn::kFp32, Rewrite::kAbs));
        const int rank = comm.rank();
        if (!same_bits(exact.out.o, half.out.o) || !same_bits(exact.out.lse, half.out.lse) ||
            !same_bits(exact.out.dq, half.out.dq)) {
          return internal_error(fmt::format("rank {}: O, LSE or dQ changed with the bf16 return", rank));
        }
        const double u = std::ldexp(1.0, -8), u32 = std::ldexp(1.0, -24), eta = std::ldexp(1.0, -134);
        for (auto [a, b, s] : {std::tuple{&exact.out.dk, &half.out.dk, &scale.out.dk},
                               std::tuple{&exact.out.dv, &half.out.dv, &scale.out.dv}}) {
          for (size_t i = 0; i < a->size(); ++i) {
            const double err = std::abs(double{(*a)[i]} - double{(*b)[i]});
            const double bound = (u + 3 * R * u32) * double{(*s)[i]} + R * eta;
            rounded_of[rank] += err > 0;
            worst_of[rank] = std::max(worst_of[rank], err / bound);
            if (!(err <= bound)) {
              return internal_error(fmt::format("rank {}: element {} of dK/dV: bf16 return {} vs fp32 {}, error {:.3g} > "
                                                "bound {:.3g}", rank, i, (*b)[i], (*a)[i], err, bound));
            }
          }
        }
        return Status::ok();
      }));
      for (int r = 0; r < R; ++r) worst = std::max(worst, worst_of[r]), rounded += rounded_of[r];
    }
  }
  // The bound is tight enough to matter: the rounding happened, and came near it.
  EXPECT_GT(rounded, 1000);
  EXPECT_GT(worst, 0.3);
}

// Partials that are bf16 values travel exactly, and the owner sums them in fp32 in the same
// order as the fp32 return: the same bits.
TEST(GradReturn, Bf16EqualsFp32WhenEveryPartialIsABf16Value) {
  int64_t returned = 0;  // backward-return bytes sent, every case: the exchange did carry partials
  for (int R : {2, 3, 4}) {
    for (BackwardMode mode : {BackwardMode::kStateless, BackwardMode::kStateful}) {
      SCOPED_TRACE(fmt::format("R={} mode={}", R, plan::backward_mode_name(mode)));
      const plan::Batch batch = spanning_batch(40 + R, R, 96);
      const plan::Plan plan = key_split_plan(batch, 70 + R);
      testing::DispatchCase c;
      c.seed = 3 * R + 1;
      c.mode = mode;
      const testing::GlobalInputs in = testing::random_inputs(testing::global_layout(batch), c);
      std::vector<int64_t> returned_of(R, 0);
      expect_all_ok(LocalWorld::run(R, [&](Communicator& comm) -> Status {
        using Rewrite = PartialKernel::Rewrite;
        DISTCA_ASSIGN_OR_RETURN(const Outcome exact, run_once(comm, batch, plan, c, in, GradReturn::kFp32, Rewrite::kRound));
        DISTCA_ASSIGN_OR_RETURN(const Outcome half, run_once(comm, batch, plan, c, in, GradReturn::kBf16, Rewrite::kRound));
        returned_of[comm.rank()] = half.sent[static_cast<int>(plan::Phase::kBwdReturn)];
        if (!same_bits(exact.out.dk, half.out.dk) || !same_bits(exact.out.dv, half.out.dv)) {
          return internal_error(fmt::format("rank {}: dK/dV of bf16-valued partials differ between the returns", comm.rank()));
        }
        return Status::ok();
      }));
      for (int64_t b : returned_of) returned += b;
    }
  }
  EXPECT_GT(returned, 0);
}

// The backward return carries Q rows' dQ (fp32) and K/V rows' dK/dV: bf16 halves the second
// part and nothing else. Counted from the forward dispatch's rows, not from the plan's byte
// counter, which must agree with the dispatcher too.
TEST(GradReturn, OnlyTheBackwardReturnShrinksByHalfItsDkDvShare) {
  const int R = 4;
  const plan::Batch batch = spanning_batch(51, R, 128);
  const plan::Plan plan = key_split_plan(batch, 52);
  testing::DispatchCase c;
  c.mode = BackwardMode::kStateful;
  const int64_t qw = c.heads.num_q_heads * c.heads.head_dim, kw = c.heads.num_kv_heads * c.heads.head_dim;
  const testing::GlobalInputs in = testing::random_inputs(testing::global_layout(batch), c);
  std::vector<std::array<Outcome, 2>> runs(R);  // [rank][fp32, bf16]
  expect_all_ok(LocalWorld::run(R, [&](Communicator& comm) -> Status {
    int i = 0;
    for (GradReturn g : {GradReturn::kFp32, GradReturn::kBf16}) {
      DISTCA_ASSIGN_OR_RETURN(runs[comm.rank()][i++], run_once(comm, batch, plan, c, in, g, PartialKernel::Rewrite::kNone));
    }
    return Status::ok();
  }));
  const plan::Traffic fp32 = plan::count_traffic(batch, plan::token_bytes(4, 2, 32, 4, GradReturn::kFp32), plan.tasks, c.mode);
  const plan::Traffic bf16 = plan::count_traffic(batch, plan::token_bytes(4, 2, 32, 4, GradReturn::kBf16), plan.tasks, c.mode);
  const int64_t q_rows = fp32.forward.q_bytes / (qw * 4), kv_rows = fp32.forward.kv_bytes / (2 * kw * 4);
  ASSERT_GT(kv_rows, 0);
  std::array<std::array<int64_t, plan::kNumPhases>, 2> total{};
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < plan::kNumPhases; ++p) {
      total[0][p] += runs[r][0].sent[p];
      total[1][p] += runs[r][1].sent[p];
      EXPECT_EQ(runs[r][0].sent[p], fp32.phases[p].send_bytes[r]) << "rank " << r << ", phase " << p;
      EXPECT_EQ(runs[r][1].sent[p], bf16.phases[p].send_bytes[r]) << "rank " << r << ", phase " << p;
    }
  }
  const auto ret = static_cast<int>(plan::Phase::kBwdReturn);
  for (int p = 0; p < plan::kNumPhases; ++p) {
    if (p != ret) EXPECT_EQ(total[0][p], total[1][p]) << "phase " << p;
  }
  EXPECT_EQ(total[0][ret], q_rows * qw * 4 + kv_rows * 2 * kw * 4);
  EXPECT_EQ(total[1][ret], q_rows * qw * 4 + kv_rows * 2 * kw * 2);
}

TEST(GradReturn, AValueThatIsNeitherFp32NorBf16IsRefused) {
  const plan::Batch batch = spanning_batch(61, 2, 64);
  const plan::Plan plan = key_split_plan(batch, 62);
  expect_all_ok(LocalWorld::run(2, [&](Communicator& comm) -> Status {
    DispatchOptions options;
    options.grad_return = static_cast<GradReturn>(7);
    auto d = Dispatcher::create(comm, batch, plan, {4, 2, 32}, options);
    if (d.is_ok() || d.status().message().find("neither fp32 nor bf16") == std::string::npos) {
      return internal_error("want a refusal naming fp32 and bf16, got " + d.status().to_string());
    }
    return Status::ok();
  }));
  for (const char* text : {"fp16", "BF16", "", "bf16 "}) {
    const auto g = plan::parse_grad_return(text);
    ASSERT_FALSE(g.is_ok()) << "'" << text << "'";
    EXPECT_NE(g.status().message().find("--grad-return must be bf16 or fp32"), std::string::npos) << g.status().message();
  }
  EXPECT_EQ(plan::parse_grad_return("bf16").value(), GradReturn::kBf16);
  EXPECT_EQ(plan::parse_grad_return("fp32").value(), GradReturn::kFp32);
}

}  // namespace
}  // namespace distca::runtime
