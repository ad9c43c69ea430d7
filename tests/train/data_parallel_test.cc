// The training loop over LocalComm: CAD and colocated attention give the same loss curve for
// every planner policy, the loss falls, resuming from a checkpoint reproduces the curve, and
// data sources and checkpoints report bad input precisely.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <cblas.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "distca/comm/local_comm.h"
#include "distca/core/file.h"
#include "distca/model/checkpoint.h"
#include "distca/train/data.h"
#include "distca/train/grad_sync.h"
#include "distca/train/data_parallel.h"
#include "soak.h"
#include "tiny_options.h"

namespace distca::train {
namespace {

namespace fs = std::filesystem;

TrainOptions tiny(int64_t steps) { return testing::tiny_options(steps); }

// Every rank's records (rank 0's are returned; all ranks must agree on the losses).
std::vector<StepRecord> train(int ranks, const TrainOptions& o, int64_t steps) {
  std::vector<std::vector<StepRecord>> per_rank(static_cast<size_t>(ranks));
  const auto statuses = comm::LocalWorld::run(ranks, [&](comm::Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto t, DataParallelTrainer::create(c, o));
    for (int64_t i = 0; i < steps; ++i) {
      DISTCA_ASSIGN_OR_RETURN(auto records, t->step());
      for (auto& r : records) per_rank[c.rank()].push_back(r);
    }
    return Status::ok();
  });
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_TRUE(statuses[r].is_ok()) << "rank " << r << ": " << statuses[r].to_string();
  for (int r = 1; r < ranks; ++r) {
    EXPECT_EQ(per_rank[r].size(), per_rank[0].size());
    for (size_t i = 0; i < std::min(per_rank[r].size(), per_rank[0].size()); ++i) {
      EXPECT_EQ(per_rank[r][i].loss, per_rank[0][i].loss) << "rank " << r << " record " << i;
    }
  }
  return per_rank[0];
}

double mean_loss(const std::vector<StepRecord>& rs, const std::string& backend, size_t from, size_t to) {
  double s = 0;
  size_t n = 0;
  for (const StepRecord& r : rs) {
    if (r.backend == backend && static_cast<size_t>(r.step) >= from && static_cast<size_t>(r.step) < to) s += r.loss, ++n;
  }
  return s / static_cast<double>(n);
}

// minbytes cuts a long document into key-range split blocks; the owners merge the partial
// outputs by the LSE rule. Training on such plans gives the colocated curve.
TEST(Train, KeySplitPlansGiveTheColocatedLossCurve) {
  const int64_t steps = distca::testing::soak<int64_t>(6, 20);
  for (int ranks : {2, 3}) {
    for (const auto mode : {plan::BackwardMode::kStateful, plan::BackwardMode::kStateless}) {
      SCOPED_TRACE(fmt::format("{} ranks, {}", ranks, plan::backward_mode_name(mode)));
      TrainOptions o = tiny(steps);
      o.context = 1024;
      o.workload = "skewed";
      o.backends = {"colocated", "cad"};
      o.policy = "minbytes";
      o.granularity = 32;
      o.backward_mode = mode;
      const auto rs = train(ranks, o, steps);
      ASSERT_EQ(rs.size(), static_cast<size_t>(2 * steps));
      int64_t splits = 0;
      for (size_t i = 0; i < rs.size(); i += 2) {
        ASSERT_EQ(rs[i].backend, "colocated");
        ASSERT_EQ(rs[i + 1].backend, "cad");
        splits += rs[i + 1].split_tasks;
        EXPECT_LE(std::abs(rs[i].loss - rs[i + 1].loss), 1e-5 * std::abs(rs[i].loss)) << "step " << rs[i].step;
      }
      EXPECT_GT(splits, 0);  // the plans really split key ranges
      std::printf("%d ranks %s: %lld key-split tasks over %lld steps\n", ranks, plan::backward_mode_name(mode),
                  static_cast<long long>(splits), static_cast<long long>(steps));
    }
  }
}

// The first layout runs 20 steps, enough to see the loss fall; the others run the soak size (8
// steps, 20 with DISTCA_TEST_LONG=1): the curves must agree from the first step on.
TEST(Train, CadAndColocatedGiveTheSameLossCurveForEveryPolicy) {
  bool first = true;
  for (int ranks : {2, 4}) {
    for (const std::string policy : {"minmax", "minbytes", "distca", "none"}) {
      SCOPED_TRACE(fmt::format("{} ranks, policy {}", ranks, policy));
      const int64_t steps = first ? 20 : distca::testing::soak<int64_t>(4, 20);
      first = false;
      TrainOptions o = tiny(steps);
      o.backends = {"colocated", "cad"};
      o.policy = policy;
      o.backward_mode = policy == "distca" ? plan::BackwardMode::kStateless : plan::BackwardMode::kStateful;
      const auto rs = train(ranks, o, steps);
      ASSERT_EQ(rs.size(), static_cast<size_t>(2 * steps));
      for (size_t i = 0; i < rs.size(); i += 2) {
        ASSERT_EQ(rs[i].backend, "colocated");
        ASSERT_EQ(rs[i + 1].backend, "cad");
        EXPECT_LE(std::abs(rs[i].loss - rs[i + 1].loss), 1e-5 * std::abs(rs[i].loss)) << "step " << rs[i].step;
      }
      // CAD really moved work between ranks (the comparison is not of two identical runs).
      int64_t cad_bytes = 0;
      for (const StepRecord& r : rs) cad_bytes += r.backend == "cad" ? r.attention_bytes : 0;
      if (policy != "none") {
        EXPECT_GT(cad_bytes, 0);
      }
      const nlohmann::json s = summarize(rs, 1);
      EXPECT_LE(s["loss_max_rel_diff"].get<double>(), 1e-5);
      // The loss falls: the last 5 of 20 steps are well below the first 5 (ln 256 = 5.55 at the start).
      if (steps == 20) {
        EXPECT_GT(mean_loss(rs, "cad", 1, 6) - mean_loss(rs, "cad", 16, 21), 0.5);
      }
      // Steps count from 1; every rank's parts add up to its step, the step's time is the
      // straggler's, and the bound is never above the measured step.
      for (size_t i = 0; i < rs.size(); ++i) {
        const StepRecord& r = rs[i];
        EXPECT_EQ(r.step, static_cast<int64_t>(i / 2 + 1));
        ASSERT_FALSE(r.ranks.empty());
        for (const StepRecord::Rank& x : r.ranks) {
          EXPECT_NEAR(x.linear + x.attention + x.comm + x.pipeline_wait + x.idle + x.wait + x.optimizer + x.other, x.step, 1e-9);
          EXPECT_GE(x.other, -1e-6) << "the named parts never exceed the step";
          EXPECT_EQ(x.pipeline_wait + x.idle, 0.0) << "no pipeline";
        }
        EXPECT_EQ(r.step_seconds, r.straggler().step);
        EXPECT_LE(r.straggler().wait, r.wait_max_seconds + 1e-9) << "the straggler waits no longer than any rank";
        EXPECT_GT(r.bound_seconds, 0);
        EXPECT_LE(r.bound_seconds, r.step_seconds) << "step " << r.step << " " << r.backend;
        EXPECT_LE(r.attention_min_seconds, r.attention_max_seconds);
      }
      EXPECT_LE(s["backends"]["cad"]["bound_seconds"].get<double>(), s["backends"]["cad"]["step_seconds"].get<double>());
      EXPECT_EQ(s["backends"]["cad"]["loss_steps"], steps / 2);
    }
  }
}

// The gradient all-reduce overlapped with the backward (grad_sync.h): the buckets partition the
// gradients in the order the backward finishes them; a bucket's all-reduce is posted on its last
// pass's report, before finish(); the sums equal one all-reduce of the whole buffer bit for bit.
TEST(GradientSync, BucketsArePostedOnTheirLastPassAndSumAsOneAllReduce) {
  model::ModelConfig config;
  config.num_layers = 3;
  const model::ModelState<float> layout = model::ModelState<float>::create(config);
  const int64_t size = layout.grads.size();
  const auto statuses = comm::LocalWorld::run(3, [&](comm::Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto sync, GradientSync::create(c, layout.grads));
    EXPECT_EQ(sync->buckets(), 8);
    // The buckets tile the arena: the embedding first, each layer's attention input and then its
    // MLP and output projection in order, the head last.
    EXPECT_EQ(sync->range(7)[0], 0);
    for (int64_t k = 1; k <= 6; ++k) EXPECT_EQ(sync->range(k)[0], sync->range(k == 1 ? 7 : k - 1)[1]) << k;
    EXPECT_EQ(sync->range(0)[0], sync->range(6)[1]);
    EXPECT_EQ(sync->range(0)[1], size);
    std::vector<float> grads(static_cast<size_t>(size)), whole;
    for (int64_t i = 0; i < size; ++i) grads[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + c.rank())) / 3.0f;
    whole = grads;
    DISTCA_RETURN_IF_ERROR(c.all_reduce_sum(whole.data(), size));
    DISTCA_RETURN_IF_ERROR(sync->begin(grads.data(), 2));
    std::vector<model::GradsDone> order = {{model::GradsDone::Kind::kHead, -1}};
    for (int64_t l = 2; l >= 0; --l) {
      order.push_back({model::GradsDone::Kind::kLayerMlp, l});
      order.push_back({model::GradsDone::Kind::kLayerAttention, l});
    }
    order.push_back({model::GradsDone::Kind::kEmbedding, -1});
    for (size_t i = 0; i < order.size(); ++i) {
      sync->done(order[i]);  // the first pass: nothing posted
      EXPECT_EQ(sync->posted(), static_cast<int64_t>(i));
      sync->done(order[i]);  // the second: this bucket's all-reduce is in flight
      EXPECT_EQ(sync->posted(), static_cast<int64_t>(i + 1));
    }
    DISTCA_RETURN_IF_ERROR(sync->finish());
    for (int64_t i = 0; i < size; ++i) {
      if (grads[i] != whole[i]) return internal_error(fmt::format("element {}: {} against {}", i, grads[i], whole[i]));
    }
    // Paced over 10 paces: nothing posts before a pace; each pace posts at most its share of the
    // floats (what earlier paces left unused carries over), in order; finish() posts the rest.
    for (int64_t i = 0; i < size; ++i) grads[i] = static_cast<float>(std::cos(0.11 * static_cast<double>(i) * (c.rank() + 1)));
    whole = grads;
    DISTCA_RETURN_IF_ERROR(c.all_reduce_sum(whole.data(), size));
    DISTCA_RETURN_IF_ERROR(sync->begin(grads.data(), 1, 10));
    // After k paces, min(k shares, the floats ready) have been posted.
    const int64_t share = (size + 9) / 10;
    int64_t ready = 0, paces = 0;
    auto ready_bucket = [&](size_t i) {
      sync->done(order[i]);
      const auto r = sync->range(sync->bucket_of(order[i]));
      ready += r[1] - r[0];
    };
    auto pace = [&] {
      sync->pace();
      ++paces;
      EXPECT_EQ(sync->pending_floats(), ready - std::min(ready, paces * share)) << paces << " paces";
    };
    ready_bucket(1);  // the last layer's MLP: larger than a share
    EXPECT_EQ(sync->posted(), 0);
    EXPECT_EQ(sync->pending_floats(), ready);
    EXPECT_GT(ready, share);
    pace();
    EXPECT_EQ(sync->posted(), 1);
    pace();
    pace();  // the bucket done: the rest of this pace's share waits for the next bucket
    EXPECT_EQ(sync->pending_floats(), 0);
    for (size_t i = 2; i < order.size(); ++i) ready_bucket(i);
    ready_bucket(0);  // (the head last here: the order is the caller's)
    pace();
    pace();
    EXPECT_GT(sync->pending_floats(), 0);
    DISTCA_RETURN_IF_ERROR(sync->finish());
    EXPECT_EQ(sync->pending_floats(), 0);
    for (int64_t i = 0; i < size; ++i) {
      if (grads[i] != whole[i]) return internal_error(fmt::format("paced, element {}: {} against {}", i, grads[i], whole[i]));
    }
    return Status::ok();
  });
  for (const Status& st : statuses) EXPECT_TRUE(st.is_ok()) << st.to_string();

  // Misuse is an error at finish(), naming the bucket (one rank: nothing left unpaired).
  comm::LocalWorld::run(1, [&](comm::Communicator& c) -> Status {
    auto sync = GradientSync::create(c, layout.grads).value();
    std::vector<float> grads(static_cast<size_t>(size), 1.0f);
    EXPECT_TRUE(sync->begin(grads.data(), 2).is_ok());
    EXPECT_FALSE(sync->begin(grads.data(), 2).is_ok()) << "a step begun twice";
    for (int i = 0; i < 3; ++i) sync->done({model::GradsDone::Kind::kHead, -1});
    Status st = sync->finish();
    EXPECT_NE(st.message().find("bucket 0 reported 3 times in a step of 2 passes"), std::string::npos) << st.to_string();
    EXPECT_TRUE(sync->begin(grads.data(), 1).is_ok());
    sync->done({model::GradsDone::Kind::kHead, -1});
    sync->done({model::GradsDone::Kind::kLayerMlp, 7});
    st = sync->finish();
    EXPECT_NE(st.message().find("no bucket for layer 7"), std::string::npos) << st.to_string();
    EXPECT_TRUE(sync->begin(grads.data(), 1).is_ok());
    sync->done({model::GradsDone::Kind::kHead, -1});
    st = sync->finish();
    EXPECT_NE(st.message().find("reported by 0 of the step's 1 passes"), std::string::npos) << st.to_string();
    EXPECT_FALSE(sync->begin(grads.data(), 3).is_ok());
    return Status::ok();
  });
}

// Overlapping the gradient all-reduce with the backward changes when the sums move, not what
// they are: the same losses and gradient norms as one all-reduce after the backward, bit for
// bit, whole and with ping-pong, colocated and CAD.
TEST(Train, OverlappedGradientSyncGivesTheSameCurveAsAfter) {
  for (const std::string pingpong : {"off", "on"}) {
    SCOPED_TRACE("ping-pong " + pingpong);
    std::array<std::vector<StepRecord>, 3> rs;
    const std::array<const char*, 3> modes = {"after", "overlap", "eager"};
    for (size_t i = 0; i < modes.size(); ++i) {
      TrainOptions o = tiny(4);
      o.backends = {"colocated", "cad"};
      o.pingpong = pingpong;
      o.grad_sync = modes[i];
      rs[i] = train(2, o, 4);
    }
    for (size_t i = 1; i < modes.size(); ++i) {
      ASSERT_EQ(rs[i].size(), rs[0].size()) << modes[i];
      for (size_t k = 0; k < rs[0].size(); ++k) {
        EXPECT_EQ(rs[i][k].loss, rs[0][k].loss) << modes[i] << ", " << rs[0][k].backend << " step " << rs[0][k].step;
        EXPECT_EQ(rs[i][k].grad_norm, rs[0][k].grad_norm) << modes[i] << ", " << rs[0][k].backend << " step " << rs[0][k].step;
      }
    }
  }
  TrainOptions o = tiny(1);
  o.grad_sync = "sometimes";
  EXPECT_NE(o.validate(1).message().find("--grad-sync must be overlap, eager or after"), std::string::npos);
}

// A bf16 return of CAD's dK/dV partial sums (the paper's) stays on the fp32 return's loss curve
// and sends exactly its plan's bytes: what the same plan sends with an fp32 return less half of
// the dK/dV (2 bytes an element instead of 4). The plan's own count (the planner's cost model)
// names the same backward-return bytes.
TEST(Train, Bf16GradReturnStaysOnTheFp32CurveAndSendsThePlansBytes) {
  const int64_t steps = 6;
  TrainOptions o = tiny(steps);
  o.context = 1024;
  o.workload = "skewed";
  o.granularity = 32;
  o.pingpong = "off";  // one plan per step: last_plan is the step's whole plan
  struct Step {
    double loss = 0;
    int64_t sent = 0;           // all ranks, all layers and phases (StepRecord::attention_bytes)
    int64_t want = 0;           // the plan's count at this run's return dtype
    int64_t want_fp32 = 0;      // the same plan's count with an fp32 return
    int64_t dkv_elements = 0;   // dK/dV elements returned across ranks, all layers
    int64_t plan_return = 0, want_return = 0;  // one layer's backward return: the plan's, counted here
  };
  std::array<std::vector<Step>, 2> runs;  // fp32, bf16
  const model::ModelConfig& m = o.model;
  for (int i = 0; i < 2; ++i) {
    o.grad_return = i == 0 ? plan::GradReturn::kFp32 : plan::GradReturn::kBf16;
    const auto statuses = comm::LocalWorld::run(2, [&](comm::Communicator& c) -> Status {
      DISTCA_ASSIGN_OR_RETURN(auto t, DataParallelTrainer::create(c, o));
      for (int64_t s = 0; s < steps; ++s) {
        DISTCA_ASSIGN_OR_RETURN(auto records, t->step());
        if (c.rank() != 0) continue;
        const plan::Plan& p = t->last_plan(0);
        auto count = [&](plan::GradReturn g) {
          const plan::TokenBytes tb = plan::token_bytes(m.num_q_heads, m.num_kv_heads, m.head_dim, 4, g);
          return plan::count_traffic(t->last_batch(), tb, p.tasks, o.backward_mode);
        };
        const plan::Traffic mine = count(o.grad_return), fp32 = count(plan::GradReturn::kFp32);
        Step step{records[0].loss, records[0].attention_bytes};
        for (int ph = 0; ph < plan::kNumPhases; ++ph) {
          step.want += m.num_layers * mine.phases[ph].total_bytes;
          step.want_fp32 += m.num_layers * fp32.phases[ph].total_bytes;
        }
        // K/V rows go out in the forward dispatch and their dK/dV come back, 2 x Hkv x D each.
        const int64_t kv_row = 2 * m.num_kv_heads * m.head_dim;
        step.dkv_elements = m.num_layers * mine.forward.kv_bytes / (kv_row * 4) * kv_row;
        const auto ret = static_cast<int>(plan::Phase::kBwdReturn);
        step.plan_return = p.traffic.phases[ret].total_bytes;
        step.want_return = mine.phases[ret].total_bytes;
        runs[i].push_back(step);
      }
      return Status::ok();
    });
    for (const Status& s : statuses) ASSERT_TRUE(s.is_ok()) << s.to_string();
  }
  int64_t returned = 0;
  for (int64_t s = 0; s < steps; ++s) {
    SCOPED_TRACE(fmt::format("step {}", s + 1));
    const Step& fp32 = runs[0][s];
    const Step& bf16 = runs[1][s];
    EXPECT_LE(std::abs(bf16.loss - fp32.loss), 1e-3 * std::abs(fp32.loss));
    for (const Step* r : {&fp32, &bf16}) {
      EXPECT_EQ(r->sent, r->want);
      EXPECT_EQ(r->plan_return, r->want_return);
    }
    EXPECT_EQ(fp32.sent, fp32.want_fp32);
    EXPECT_EQ(bf16.want_fp32 - bf16.sent, bf16.dkv_elements * 2);
    returned += bf16.dkv_elements;
  }
  EXPECT_GT(returned, 0);  // the plans did return dK/dV across ranks
}

TEST(Train, ShortRunsSummarizeTheirLossOverHalfTheSteps) {
  // With 10 steps or fewer the first and last loss means must not cover the same steps.
  for (int steps : {1, 2, 3, 10}) {
    std::vector<StepRecord> rs;
    for (int i = 0; i < steps; ++i) {
      StepRecord r;
      r.step = i + 1;
      r.backend = "cad";
      r.loss = 10.0 - i;
      r.ranks.resize(1);
      r.ranks[0].step = 1;
      r.derive();
      rs.push_back(r);
    }
    const nlohmann::json s = summarize(rs, 1);
    const int64_t k = s["backends"]["cad"]["loss_steps"];
    EXPECT_EQ(k, steps == 1 ? 1 : steps / 2) << steps;
    if (steps > 1) {
      EXPECT_GT(s["loss_first"].get<double>(), s["loss_last"].get<double>()) << steps;
    }
    EXPECT_EQ(s["backends"]["cad"]["timed_steps"], steps == 1 ? 1 : steps - 1);
  }
}

TEST(Train, CadBalancesAttentionWhereColocatedDoesNot) {
  // The skewed workload puts a whole long document on rank 0 and short ones on rank 1: the
  // planner's estimate of colocated attention is far from balanced, CAD's close to it.
  TrainOptions o = tiny(3);
  o.workload = "skewed";
  o.backends = {"colocated", "cad"};
  std::vector<double> est(2);
  const auto statuses = comm::LocalWorld::run(2, [&](comm::Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto t, DataParallelTrainer::create(c, o));
    return t->step().status();
  });
  for (const Status& s : statuses) EXPECT_TRUE(s.is_ok()) << s.to_string();
  auto source = make_synthetic_source("skewed", 256, 1);
  ASSERT_TRUE(source.is_ok());
  Packer packer(std::move(source.value()), 2, 256);
  auto step = packer.next();
  ASSERT_TRUE(step.is_ok());
  const plan::Batch& b = step.value().batch;
  ASSERT_EQ(b.doc_lengths[0], 256);  // rank 0: one whole document
  EXPECT_EQ(b.pieces[0].rank, 0);
  EXPECT_GT(b.num_docs(), 3);
  for (size_t i = 1; i < b.pieces.size(); ++i) EXPECT_EQ(b.pieces[i].rank, 1);
}

// TrainOptions::threads is BLAS's threads too, for every caller of the library (not only distca
// train): OpenBLAS's thread-per-core default made ranks that are threads spin on each other.
TEST(Train, TheTrainerRunsBlasOnItsThreadsOption) {
  for (int threads : {3, 1}) {
    TrainOptions o = tiny(1);
    o.threads = threads;
    const auto statuses = comm::LocalWorld::run(1, [&](comm::Communicator& c) -> Status {
      return DataParallelTrainer::create(c, o).status();
    });
    ASSERT_TRUE(statuses[0].is_ok()) << statuses[0].message();
    EXPECT_EQ(openblas_get_num_threads(), threads);
  }
}

TEST(Train, ResumingFromACheckpointReproducesTheCurve) {
  const std::string path = ::testing::TempDir() + "/distca_resume.ckpt";
  fs::remove(path);
  TrainOptions o = tiny(10);
  o.backends = {"colocated", "cad"};
  const auto whole = train(2, o, 10);
  TrainOptions first = o;
  first.steps = 5;
  first.checkpoint_path = path;
  const auto head = train(2, first, 5);  // saves at its last step
  ASSERT_TRUE(fs::exists(path));
  TrainOptions rest = o;
  rest.resume_path = path;
  const auto tail = train(2, rest, 5);
  ASSERT_EQ(head.size() + tail.size(), whole.size());
  for (size_t i = 0; i < head.size(); ++i) EXPECT_EQ(head[i].loss, whole[i].loss) << i;
  for (size_t i = 0; i < tail.size(); ++i) {
    EXPECT_EQ(tail[i].step, whole[head.size() + i].step);
    EXPECT_EQ(tail[i].loss, whole[head.size() + i].loss) << "resumed record " << i;
  }
  // Resuming with other data is refused: the curve could not continue.
  TrainOptions other = rest;
  other.data_seed = 2;
  const auto statuses = comm::LocalWorld::run(2, [&](comm::Communicator& c) { return DataParallelTrainer::create(c, other).status(); });
  ASSERT_FALSE(statuses[0].is_ok());
  EXPECT_NE(statuses[0].message().find("same data"), std::string::npos) << statuses[0].message();
  fs::remove(path);
}

TEST(Checkpoint, DamagedFilesAreRefusedWithAMessage) {
  const std::string path = ::testing::TempDir() + "/distca_damaged.ckpt";
  auto p = model::find_preset("tiny");
  auto state = model::ModelState<float>::create(p.value().model);
  ASSERT_TRUE(model::save_checkpoint(path, {{"cad", &state}}, {{"note", "test"}}).is_ok());
  auto text = read_text_file(path);
  ASSERT_TRUE(text.is_ok());
  auto fresh = model::ModelState<float>::create(p.value().model);
  auto good = model::load_checkpoint(path, {{"cad", &fresh}});
  ASSERT_TRUE(good.is_ok()) << good.status().to_string();
  EXPECT_EQ(std::vector<float>(fresh.params.data(), fresh.params.data() + fresh.params.size()),
            std::vector<float>(state.params.data(), state.params.data() + state.params.size()));
  struct Damage {
    std::string name, text, expect;
  };
  std::string flipped = text.value();
  flipped[flipped.size() - 3] ^= 0x40;
  std::string version = text.value();
  version.replace(version.find(" 1\n"), 3, " 9\n");
  const std::vector<Damage> damages = {
      {"truncated", text.value().substr(0, text.value().size() - 100), "truncated"},
      {"flipped", flipped, "checksum"},
      {"version", version, "version 9"},
      {"garbage", "hello\nworld\n", "not a distca checkpoint"},
  };
  for (const Damage& d : damages) {
    ASSERT_TRUE(write_file_atomic(path, d.text).is_ok());
    auto r = model::load_checkpoint(path, {{"cad", &fresh}});
    ASSERT_FALSE(r.is_ok()) << d.name;
    EXPECT_NE(r.status().message().find(d.expect), std::string::npos) << d.name << ": " << r.status().message();
    EXPECT_NE(r.status().message().find(path), std::string::npos) << d.name;
  }
  ASSERT_TRUE(write_file_atomic(path, text.value()).is_ok());
  auto missing = model::load_checkpoint(path, {{"colocated", &fresh}});
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("no state 'colocated'"), std::string::npos);
  model::ModelConfig other = p.value().model;
  other.num_layers = 3;
  auto wrong = model::ModelState<float>::create(other);
  EXPECT_FALSE(model::load_checkpoint(path, {{"cad", &wrong}}).is_ok());
  fs::remove(path);
}

TEST(Data, PackerFillsEveryRankWithTargetsAndPositionsOfTheSameDocument) {
  auto source = make_synthetic_source("pretrain", 64, 3);
  ASSERT_TRUE(source.is_ok());
  Packer packer(std::move(source.value()), 3, 64);
  for (int step = 0; step < 5; ++step) {
    auto s = packer.next();
    ASSERT_TRUE(s.is_ok());
    const StepData& d = s.value();
    ASSERT_TRUE(d.batch.validate().is_ok());
    ASSERT_EQ(d.tokens.size(), 3u * 64u);
    EXPECT_EQ(d.batch.total_tokens(), 3 * 64);
    int64_t at = 0, targets = 0;
    for (int32_t doc = 0; doc < d.batch.num_docs(); ++doc) {
      for (int64_t i = 0; i < d.batch.doc_lengths[doc]; ++i, ++at) {
        EXPECT_EQ(d.positions[at], i);
        EXPECT_GE(d.tokens[at], 0);
        EXPECT_LT(d.tokens[at], 256);
        if (i + 1 < d.batch.doc_lengths[doc]) {
          EXPECT_EQ(d.targets[at], d.tokens[at + 1]);
        }
        targets += d.targets[at] >= 0 ? 1 : 0;
      }
    }
    EXPECT_EQ(targets, d.num_targets);
  }
  // The same seed gives the same stream; another seed another.
  auto a = make_synthetic_source("prolong", 128, 9), b = make_synthetic_source("prolong", 128, 9),
       c = make_synthetic_source("prolong", 128, 10);
  EXPECT_EQ(a.value()->next().value(), b.value()->next().value());
  EXPECT_NE(a.value()->next().value(), c.value()->next().value());
}

TEST(Data, JsonlAndDirectorySources) {
  const fs::path dir = fs::path(::testing::TempDir()) / "distca_data_test";
  fs::remove_all(dir);
  fs::create_directories(dir / "texts" / "sub");
  {
    std::ofstream(dir / "good.jsonl") << "{\"text\": \"hello\"}\n\n{\"text\": \"\", \"id\": 2}\n{\"text\": \"ab\"}\n";
    std::ofstream(dir / "texts" / "b.txt") << "bee";
    std::ofstream(dir / "texts" / "sub" / "a.txt") << "ay";
    std::ofstream(dir / "texts" / "empty.txt");
  }
  auto jsonl = open_data_source((dir / "good.jsonl").string());
  ASSERT_TRUE(jsonl.is_ok()) << jsonl.status().to_string();
  const std::vector<int32_t> hello = {'h', 'e', 'l', 'l', 'o'}, ab = {'a', 'b'};
  EXPECT_EQ(jsonl.value()->next().value(), hello);
  EXPECT_EQ(jsonl.value()->next().value(), ab);
  EXPECT_EQ(jsonl.value()->next().value(), hello);  // the next epoch
  auto texts = open_data_source((dir / "texts").string());
  ASSERT_TRUE(texts.is_ok());
  EXPECT_EQ(texts.value()->next().value(), (std::vector<int32_t>{'b', 'e', 'e'}));  // sorted paths: b.txt < sub/a.txt
  EXPECT_EQ(texts.value()->next().value(), (std::vector<int32_t>{'a', 'y'}));
  struct Bad {
    std::string content, expect;
  };
  const std::vector<Bad> bad = {
      {"{\"text\": \"ok\"}\n{\"text\": 5}\n", "bad.jsonl:2: \"text\" must be a string"},
      {"{\"text\": \"ok\"}\n\n{oops\n", "bad.jsonl:3: malformed JSON"},
      {"[1, 2]\n", "bad.jsonl:1: expected an object with a \"text\" field"},
      {"\n\n", "no document"},
  };
  for (const Bad& b : bad) {
    { std::ofstream(dir / "bad.jsonl") << b.content; }
    auto r = open_data_source((dir / "bad.jsonl").string());
    ASSERT_FALSE(r.is_ok()) << b.content;
    EXPECT_NE(r.status().message().find(b.expect), std::string::npos) << r.status().message();
  }
  EXPECT_FALSE(open_data_source((dir / "missing.jsonl").string()).is_ok());
  { std::ofstream(dir / "notes.csv") << "a,b\n"; }
  auto csv = open_data_source((dir / "notes.csv").string());
  ASSERT_FALSE(csv.is_ok());
  EXPECT_NE(csv.status().message().find(".jsonl"), std::string::npos);
  fs::create_directories(dir / "nothing");
  EXPECT_FALSE(open_data_source((dir / "nothing").string()).is_ok());
  fs::remove_all(dir);
}

TEST(Train, TrainsOnAJsonlFile) {
  const fs::path path = fs::path(::testing::TempDir()) / "distca_train.jsonl";
  {
    std::ofstream out(path);
    for (int i = 0; i < 40; ++i) out << "{\"text\": \"the quick brown fox jumps over the lazy dog " << i << "\"}\n";
  }
  TrainOptions o = tiny(15);
  o.context = 64;
  o.data_path = path.string();
  o.backends = {"cad"};
  const auto rs = train(2, o, 15);
  ASSERT_EQ(rs.size(), 15u);
  EXPECT_LT(mean_loss(rs, "cad", 10, 15), mean_loss(rs, "cad", 0, 5) - 0.5);
  fs::remove(path);
}

}  // namespace
}  // namespace distca::train
