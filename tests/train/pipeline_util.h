// Shared by the pipeline tests (LocalComm and mpirun): a data file whose packing is the same for
// D ranks of T tokens and one rank of D x T, the small model, and one rank's reference run.
#pragma once
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "distca/comm/local_comm.h"
#include "distca/train/pipeline.h"

namespace distca::train::testing {

// A JSONL file of 400 documents of varied lengths, written once per process to `path`.
inline std::string write_pipeline_data(const std::string& path) {
  std::ofstream out(path);
  uint64_t x = 12345;
  for (int d = 0; d < 400; ++d) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const int len = 4 + static_cast<int>((x >> 33) % 150) + (d % 7 == 0 ? 120 : 0);
    std::string text;
    for (int i = 0; i < len; ++i) text += static_cast<char>('a' + (x >> (i % 40)) % 26);
    out << "{\"text\": \"" << text << "\"}\n";
  }
  return path;
}

// The data file of one process of an mpirun test: named by its pid (concurrent test runs share
// /tmp), written at construction, removed at destruction.
class ProcessDataFile {
 public:
  explicit ProcessDataFile(const std::string& prefix)
      : path_(write_pipeline_data(fmt::format("/tmp/{}_{}.jsonl", prefix, ::getpid()))) {}
  ~ProcessDataFile() { std::remove(path_.c_str()); }
  ProcessDataFile(const ProcessDataFile&) = delete;
  ProcessDataFile& operator=(const ProcessDataFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// 2 layers per stage of d 64, 2/1 heads of 32; AdamW at the preset's defaults.
inline TrainOptions pipeline_options(const std::string& data, int pp, int M, const std::string& schedule,
                                        const std::string& policy, int64_t context, int steps, int64_t layers) {
  TrainOptions o;
  o.model.num_layers = layers;
  o.model.d_model = 64;
  o.model.num_q_heads = 2;
  o.model.num_kv_heads = 1;
  o.model.head_dim = 32;
  o.model.ffn_dim = 64;
  o.context = context;
  o.steps = steps;
  o.data_path = data;
  o.policy = policy;
  o.granularity = 16;
  o.pp = pp;
  o.micro_batches = M;
  o.backends = {schedule};
  return o;
}

// A model tensor parallelism can split up to 8 ways: 8 query heads over 2 key/value heads of
// 32 (tp 2 slices the key/value heads, tp 4 and 8 share each between 2 and 4 ranks), FFN 64.
inline model::ModelConfig tp_model(int64_t layers) {
  model::ModelConfig m;
  m.num_layers = layers;
  m.d_model = 64;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 32;
  m.ffn_dim = 64;
  return m;
}

// The largest relative difference of two loss curves (of the same length).
inline double worst_relative(const std::vector<double>& got, const std::vector<double>& want) {
  double w = got.size() == want.size() ? 0 : 1e30;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) w = std::max(w, std::abs(got[i] - want[i]) / std::abs(want[i]));
  return w;
}

struct Curve {
  std::vector<double> losses;
  std::vector<float> gradient;  // step 1, the whole arena (each stage's owned range, from its first replica)
  int split_micro_batches = 0;  // over the steps: run as two nano-batches (ping-pong)
};

// The same model on one rank (a one-rank LocalComm world), each micro-batch D x T tokens.
inline Result<Curve> one_rank_curve(const TrainOptions& o) {
  Curve c;
  Status status = Status::ok();
  auto statuses = comm::LocalWorld::run(1, [&](comm::Communicator& world) -> Status {
    DISTCA_ASSIGN_OR_RETURN(auto t, PipelineTrainer::create(world, o));
    for (int64_t s = 0; s < o.steps; ++s) {
      DISTCA_ASSIGN_OR_RETURN(std::vector<StepRecord> records, t->step());
      const StepRecord& r = records.at(0);
      c.losses.push_back(r.loss);
      if (s == 0) c.gradient = t->last_gradient(0);
    }
    return Status::ok();
  });
  if (!statuses[0].is_ok()) return statuses[0];
  return c;
}

// The largest relative loss difference, and the largest gradient difference over the largest
// reference gradient, of `got` (losses; gradient over [begin, end)) against `want`.
struct Difference {
  double loss = 0, gradient = 0;
};
inline Difference difference(const std::vector<double>& losses, const std::vector<float>& gradient, int64_t begin,
                             const Curve& want) {
  Difference d;
  for (size_t s = 0; s < want.losses.size() && s < losses.size(); ++s) {
    d.loss = std::max(d.loss, std::abs(losses[s] - want.losses[s]) / std::abs(want.losses[s]));
  }
  float scale = 0, worst = 0;
  for (float g : want.gradient) scale = std::max(scale, std::abs(g));
  for (size_t i = 0; i < gradient.size(); ++i) worst = std::max(worst, std::abs(gradient[i] - want.gradient[begin + i]));
  d.gradient = scale > 0 ? worst / scale : worst;
  return d;
}

}  // namespace distca::train::testing
