// The simulated systems (sim/simulate.h): whole iterations on cases whose answer is known.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "distca/plan/model_shape.h"
#include "distca/sim/profile.h"
#include "distca/sim/simulate.h"

namespace distca::sim {
namespace {

SimOptions small(int pp) {
  SimOptions o;
  o.model = plan::model_preset("llama-8b").value();
  o.cluster.gpus = 64;
  o.cluster.pp = pp;
  o.cluster.cp = 2;
  o.context = 128 * 1024;
  o.batch = 4;
  return o;
}

TEST(Simulate, CadBalancesAttentionAndEveryNumberAddsUp) {
  for (int pp : {1, 2}) {
    SCOPED_TRACE(pp);
    auto rs = simulate(default_h200_profile(), small(pp), system_names());
    ASSERT_TRUE(rs.is_ok()) << rs.status().to_string();
    ASSERT_EQ(rs.value().size(), 5u);
    double total_attention = -1;
    for (const SystemResult& r : rs.value()) {
      SCOPED_TRACE(r.system);
      EXPECT_GT(r.seconds, 0);
      EXPECT_NEAR(r.linear + r.attention + r.comm + r.idle, r.seconds, 1e-9 * r.seconds + 1e-12);
      ASSERT_EQ(r.unit_attention.size(), 8u);
      ASSERT_EQ(r.unit_memory.size(), 8u);
      double mx = 0, sum = 0;
      for (double a : r.unit_attention) mx = std::max(mx, a), sum += a;
      if (r.system.starts_with("cad")) {
        EXPECT_LT(mx / (sum / 8), 1.15);
      }
      // Every system does the same attention work, within the cost of short shards.
      if (total_attention < 0) total_attention = sum;
      EXPECT_NEAR(sum, total_attention, 0.1 * total_attention);
    }
    // Same inputs, same answer.
    auto again = simulate(default_h200_profile(), small(pp), {"cad"});
    EXPECT_EQ(again.value()[0].seconds, rs.value()[3].seconds);
  }
}

// WLB on one CP group of every unit: one chunk of all the iteration's tokens, whose exposed
// communication per layer is the all-gather of their K/V and the reduce-scatter of dK/dV.
TEST(Simulate, WlbOnOneCpGroupExposesTheKvAllGatherAndReduceScatter) {
  SimOptions o = small(1);
  o.batch = 1;
  o.wlb_cp = 8;
  const Profile p = default_h200_profile();
  auto rs = simulate(p, o, {"wlb"});
  ASSERT_TRUE(rs.is_ok()) << rs.status().to_string();
  const SystemResult& r = rs.value()[0];
  EXPECT_EQ(r.cp, 8);
  plan::ModelShape m = o.model;
  m.tp = 8;
  const double kv = static_cast<double>(plan::token_bytes(m).kv);
  const double tokens = 4.0 * o.context;  // 4 replicas x one sequence
  const double per_layer = collective_seconds(Collective::kAllGather, tokens * kv, 8, p.inter_node) +
                           collective_seconds(Collective::kReduceScatter, tokens * kv, 8, p.inter_node);
  EXPECT_NEAR(r.comm - r.allreduce, m.num_layers * per_layer, 1e-9);
  // One chunk: every unit does the same work, so nobody waits.
  EXPECT_NEAR(r.idle, 0, 1e-9);
  const double mx = *std::max_element(r.unit_attention.begin(), r.unit_attention.end());
  const double mn = *std::min_element(r.unit_attention.begin(), r.unit_attention.end());
  EXPECT_NEAR(mx, mn, 1e-12);
}

// WLB-ideal is the faster of the two largest CP degrees the paper's sweep allows.
TEST(Simulate, WlbIdealIsTheFasterOfItsSweepsCpDegrees) {
  SimOptions o = small(1);
  o.batch = 1;  // 4 sequences: CP 8 (1 replica) and 4 (2 replicas) qualify
  const Profile p = default_h200_profile();
  const SystemResult ideal = simulate(p, o, {"wlb"}).value()[0];
  double best = 1e300;
  int best_cp = 0;
  for (int cp : {8, 4}) {
    o.wlb_cp = cp;
    const double t = simulate(p, o, {"wlb"}).value()[0].seconds;
    if (t < best) best = t, best_cp = cp;
  }
  EXPECT_EQ(ideal.seconds, best);
  EXPECT_EQ(ideal.cp, best_cp);
  o.wlb_cp = 3;
  auto bad = simulate(p, o, {"wlb"});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("--wlb-cp"), std::string::npos);
}

// Every unit's linear + attention + comm + idle is the iteration time, with no negative idle,
// and the summary's parts are the means over units, adding up to the iteration time too.
TEST(Simulate, EveryUnitsPartsAddUpToTheIterationTime) {
  for (int pp : {1, 2}) {
    for (int iterations : {1, 3}) {
      SCOPED_TRACE(testing::Message() << "pp " << pp << ", iterations " << iterations);
      SimOptions o = small(pp);
      o.iterations = iterations;
      auto rs = simulate(default_h200_profile(), o, system_names());
      ASSERT_TRUE(rs.is_ok()) << rs.status().to_string();
      for (const SystemResult& r : rs.value()) {
        SCOPED_TRACE(r.system);
        ASSERT_EQ(r.unit_linear.size(), 8u);
        ASSERT_EQ(r.unit_comm.size(), 8u);
        const double eps = 1e-9 * r.seconds;
        double lin = 0, attn = 0, comm = 0, idle = 0;
        for (size_t u = 0; u < 8; ++u) {
          EXPECT_GE(r.unit_idle(u), -eps) << "unit " << u;
          EXPECT_GE(r.unit_comm[u], r.allreduce - eps) << "unit " << u;  // every unit pays the all-reduce
          EXPECT_NEAR(r.unit_linear[u] + r.unit_attention[u] + r.unit_comm[u] + r.unit_idle(u), r.seconds, eps);
          lin += r.unit_linear[u] / 8, attn += r.unit_attention[u] / 8, comm += r.unit_comm[u] / 8, idle += r.unit_idle(u) / 8;
        }
        EXPECT_NEAR(lin, r.linear, eps);
        EXPECT_NEAR(attn, r.attention, eps);
        EXPECT_NEAR(comm, r.comm, eps);
        EXPECT_NEAR(idle, r.idle, eps);
        EXPECT_NEAR(r.linear + r.attention + r.comm + r.idle, r.seconds, eps);
        const nlohmann::json j = r.to_json();
        EXPECT_NEAR(j["linear_seconds"].get<double>() + j["attention_seconds"].get<double>() + j["comm_seconds"].get<double>() +
                        j["idle_seconds"].get<double>(),
                    j["seconds"].get<double>(), eps);
        EXPECT_EQ(j["unit_idle_seconds"].size(), 8u);
      }
    }
  }
}

// --iterations n is the mean of the n single iterations of seeds seed .. seed + n - 1.
TEST(Simulate, IterationsAreTheMeanOfTheSampledIterations) {
  const Profile p = default_h200_profile();
  SimOptions o = small(1);
  o.seed = 5;
  o.iterations = 3;
  auto mean = simulate(p, o, {"wlb", "cad"});
  ASSERT_TRUE(mean.is_ok()) << mean.status().to_string();
  for (size_t k = 0; k < 2; ++k) {
    const SystemResult& m = mean.value()[k];
    SCOPED_TRACE(m.system);
    ASSERT_EQ(m.iteration_seconds.size(), 3u);
    ASSERT_EQ(m.iteration_cp.size(), 3u);
    double seconds = 0, attention = 0, unit0 = 0, peak = 0;
    for (int it = 0; it < 3; ++it) {
      SimOptions one = o;
      one.iterations = 1;
      one.seed = 5 + it;
      const SystemResult r = simulate(p, one, {m.system}).value()[0];
      EXPECT_EQ(m.iteration_seconds[it], r.seconds);
      EXPECT_EQ(m.iteration_cp[it], r.cp);
      seconds += r.seconds / 3, attention += r.attention / 3, unit0 += r.unit_attention[0] / 3;
      peak = std::max(peak, r.memory_per_gpu);
    }
    EXPECT_NEAR(m.seconds, seconds, 1e-12 * seconds);
    EXPECT_NEAR(m.attention, attention, 1e-12 * attention);
    EXPECT_NEAR(m.unit_attention[0], unit0, 1e-12 * unit0);
    EXPECT_EQ(m.memory_per_gpu, peak);
  }
  // The seeds differ, so the iterations do.
  EXPECT_NE(mean.value()[1].iteration_seconds[0], mean.value()[1].iteration_seconds[1]);
  for (int bad : {0, -1, 1001}) {
    o.iterations = bad;
    auto r = simulate(p, o, {"cad"});
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_NE(r.status().message().find("--iterations must be 1..1000"), std::string::npos) << r.status().message();
  }
}

// With the tolerance sweep, each CAD iteration runs at one of eps, eps/2, ..., eps/512 and is no
// slower than the same iteration at eps alone (the sweep includes eps); without it, at eps.
TEST(Simulate, TheToleranceSweepKeepsTheFastestOfEpsAndItsHalves) {
  const Profile p = default_h200_profile();
  SimOptions o = small(1);
  o.iterations = 3;
  o.tolerance = 0.04;
  const std::vector<std::string> cads = {"cad-distca", "cad", "cad-minmax"};
  SimOptions fixed = o;
  fixed.tolerance_sweep = false;
  const auto swept = simulate(p, o, cads).value();
  const auto at_eps = simulate(p, fixed, cads).value();
  std::set<double> allowed;
  for (int i = 0; i < 10; ++i) allowed.insert(0.04 / (1 << i));
  bool any_tighter = false;
  for (size_t k = 0; k < cads.size(); ++k) {
    SCOPED_TRACE(cads[k]);
    ASSERT_EQ(swept[k].iteration_tolerance.size(), 3u);
    ASSERT_EQ(at_eps[k].iteration_tolerance, std::vector<double>(3, 0.04));
    for (int it = 0; it < 3; ++it) {
      EXPECT_TRUE(allowed.count(swept[k].iteration_tolerance[it])) << swept[k].iteration_tolerance[it];
      EXPECT_LE(swept[k].iteration_seconds[it], at_eps[k].iteration_seconds[it]);
      any_tighter |= swept[k].iteration_tolerance[it] < 0.04;
    }
  }
  // On this workload, balancing tighter than 4 % pays somewhere (else the sweep is untested).
  EXPECT_TRUE(any_tighter);
  // Systems without a planner carry no tolerance.
  EXPECT_TRUE(simulate(p, o, {"wlb"}).value()[0].iteration_tolerance.empty());
}

// A pipeline step: 1F1B over equal micro-batches takes the textbook (M + P - 1)(f + b); the
// lockstep ticks sum, per tick and layer slot, the slowest rank's linear + attention + exchange.
TEST(Simulate, PipelineStepsArePricedAsTheSchedulesRun) {
  Profile p = default_h200_profile();
  p.inter_node.latency_seconds = 0;
  p.inter_node.bytes_per_second = 1e30;  // a free link: only compute is left
  const plan::ModelShape m = plan::model_preset("llama-8b").value();
  const double lin = 1e-6;  // seconds per token per layer, forward and backward
  PipelineStepInput in;
  in.stages = 4;
  in.dp = 1;
  const plan::Batch one = plan::pack_documents({4096, 4096}, 1, 8192).value();
  in.micro_batches.assign(6, one);
  const StepPrediction col = predict_pipeline_step(p, m, in, lin, 0.5);
  double af = 0, ab = 0;
  for (const plan::Piece& piece : one.pieces) {
    const plan::Task t = plan::causal_task(piece.doc, piece.begin, piece.end, 0);
    af += p.attention_seconds(t.q_len(), t.k1, t.pairs(), m.q_heads_per_rank(), m.head_dim, false);
    ab += p.attention_seconds(t.q_len(), t.k1, t.pairs(), m.q_heads_per_rank(), m.head_dim, true);
  }
  const double layers = m.num_layers / 4.0;
  const double f = layers * (8192 * lin / 3 + af), b = layers * (8192 * 2 * lin / 3 + ab);
  EXPECT_NEAR(col.seconds, (6 + 4 - 1) * (f + b) + 0.5, 1e-9 * col.seconds);
  // Lockstep: one forward tick where stage 0 runs micro-batch 0 alone, all its attention
  // planned onto rank 3 (idle): the slot takes max(rank 0's linear, rank 3's attention).
  PipelineStepInput cad = in;
  PipelineStepInput::Tick tick;
  tick.micro_batch = {0, -1, -1, -1};
  tick.pool = plan::pool_batches({{&one, 0, 0, 0}}, 4, 8192).value().batch;
  for (const plan::Piece& piece : tick.pool.pieces) tick.tasks.push_back(plan::causal_task(piece.doc, piece.begin, piece.end, 3));
  cad.ticks = {tick};
  const StepPrediction c = predict_pipeline_step(p, m, cad, lin, 0);
  EXPECT_NEAR(c.seconds, layers * std::max(8192 * lin / 3, af), 1e-9 * c.seconds);
  EXPECT_NEAR(c.attention, layers * af, 1e-9 * c.attention);
}

// Memory per GPU: the peak activations plus Megatron's distributed-optimizer states, checked
// against the profile's device memory.
TEST(Simulate, MemoryPerGpuIsCheckedAgainstTheDeviceMemory) {
  const Profile p = default_h200_profile();
  SimOptions o = small(1);  // llama-8b, 64 GPUs, tp 8: 8 units, one stage
  const SystemResult r = simulate(p, o, {"cad"}).value()[0];
  // Llama-8B's parameters (32 layers, hidden 4096, 32 / 8 heads of 128, FFN 14336, 128256 tokens):
  // per layer 4096 x 6144 (QKV) + 4096 x 4096 (out) + 3 x 4096 x 14336, and both embeddings.
  const double params = 32 * (4096.0 * 6144 + 4096.0 * 4096 + 3 * 4096.0 * 14336) + 2 * 128256.0 * 4096;
  EXPECT_NEAR(r.state_memory, params / 8 * (4 + 16.0 / 8), 1.0);
  // CAD keeps context / cp = 64K tokens per unit: 34 h / tp bytes per token per layer per GPU.
  const double activations = 65536.0 * 32 * 34 * 4096 / 8;
  EXPECT_NEAR(r.memory_per_gpu, activations + r.state_memory, 1.0);
  EXPECT_EQ(r.device_memory, 141e9);
  EXPECT_TRUE(r.fits_memory());
  EXPECT_EQ(r.to_json()["fits_memory"], true);
  // 2M tokens on one 8-GPU unit: about 1.2 TB of activations per GPU.
  o.cluster.gpus = 8;
  o.cluster.cp = 1;
  o.context = 2 << 20;
  o.batch = 1;
  const SystemResult big = simulate(p, o, {"cad"}).value()[0];
  EXPECT_GT(big.memory_per_gpu, 1e12);
  EXPECT_FALSE(big.fits_memory());
  EXPECT_EQ(big.to_json()["fits_memory"], false);
  EXPECT_EQ(big.to_json()["memory_bytes_per_gpu"].get<double>(), big.memory_per_gpu);
  // A profile without a device memory checks nothing.
  Profile unknown = p;
  unknown.device_memory_bytes = 0;
  const SystemResult unchecked = simulate(unknown, o, {"cad"}).value()[0];
  EXPECT_TRUE(unchecked.fits_memory());
  EXPECT_TRUE(unchecked.to_json()["fits_memory"].is_null());
  EXPECT_TRUE(unchecked.to_json()["device_memory_bytes"].is_null());
}

TEST(Simulate, MessagesNameTheSimulatorsOwnFlags) {
  SimOptions o = small(1);
  o.workload = "skewed";
  auto r = simulate(default_h200_profile(), o, {"cad"});
  ASSERT_FALSE(r.is_ok());
  const std::string m = r.status().message();
  EXPECT_NE(m.find("--workload must be pretrain or prolong, got 'skewed'"), std::string::npos) << m;
  EXPECT_EQ(m.find("--doc-lengths"), std::string::npos) << m;
  o = small(1);
  o.cluster.gpus_per_node = 0;
  r = simulate(default_h200_profile(), o, {"cad"});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("--gpus-per-node must be in [1, 1000000], got 0"), std::string::npos) << r.status().message();
}

// --grad-return bf16 halves what cad and cad-minmax return as dK/dV; cad-distca, the paper's
// system, returns them in the activation dtype either way, so it does not change at all.
TEST(Simulate, Bf16GradReturnMovesFewerBytesForOurSystemsOnly) {
  SimOptions o = small(1);
  const std::vector<std::string> systems = {"cad-distca", "cad", "cad-minmax"};
  auto fp32 = simulate(default_h200_profile(), o, systems);
  o.model.grad_return = plan::GradReturn::kBf16;
  auto bf16 = simulate(default_h200_profile(), o, systems);
  ASSERT_TRUE(fp32.is_ok() && bf16.is_ok());
  EXPECT_EQ(bf16.value()[0].seconds, fp32.value()[0].seconds);
  EXPECT_EQ(bf16.value()[0].bytes, fp32.value()[0].bytes);
  for (size_t k = 1; k < systems.size(); ++k) {
    SCOPED_TRACE(systems[k]);
    EXPECT_LT(bf16.value()[k].bytes, fp32.value()[k].bytes);
  }
}

TEST(Simulate, BadOptionsAreRefused) {
  SimOptions o = small(1);
  o.cluster.gpus = 60;
  EXPECT_FALSE(simulate(default_h200_profile(), o, {"cad"}).is_ok());
  o = small(3);  // 32 layers do not split into 3 stages
  o.cluster.gpus = 48;
  EXPECT_FALSE(simulate(default_h200_profile(), o, {"cad"}).is_ok());
  o = small(1);
  auto r = simulate(default_h200_profile(), o, {"magic"});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("magic"), std::string::npos);
  o.workload = "web";
  EXPECT_FALSE(simulate(default_h200_profile(), o, {"cad"}).is_ok());
  for (double bad : {-0.01, 1.5, std::nan("")}) {
    o = small(1);
    o.tolerance = bad;
    auto t = simulate(default_h200_profile(), o, {"cad"});
    ASSERT_FALSE(t.is_ok()) << bad;
    EXPECT_NE(t.status().message().find("--tolerance must be in [0, 1]"), std::string::npos) << t.status().message();
  }
}

}  // namespace
}  // namespace distca::sim
