// Attention backends: where the model's core attention runs. The model hands a backend each
// layer's Q, K, V in the linear layout (this rank's rows, after RoPE) and gets O and LSE back;
// the backward mirrors it. Backends:
//   LocalAttention    this rank's documents, attended here with no communication; every
//                     document must be whole on the rank (one rank, or a test). float runs the
//                     CPU kernels, double the dense reference (gradient checks).
//   DispatchAttention (train/dispatch_attention.h) plan -> dispatch -> attention servers ->
//                     return, fp32, through the CAD runtime: with the planner "none" it is
//                     colocated attention (each rank attends its own pieces; only a document
//                     that spans ranks moves its key prefix), with any other planner CAD.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "distca/core/status.h"
#include "distca/kernels/attention.h"
#include "distca/kernels/cpu.h"
#include "distca/model/config.h"
#include "distca/plan/batch.h"

namespace distca::model {

// Seconds a backend spent, accumulated until reset.
struct AttentionTimes {
  double compute = 0;  // the attention kernels (on this rank, as a server)
  double comm = 0;     // packing, exchanging and unpacking, waits for peers included
};

template <typename T>
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual std::string name() const = 0;
  // Once per step, before layer 0's forward, with the step's layout (the same on every rank).
  virtual Status begin_step(const plan::Batch& batch) = 0;
  // q [n, Hq, D], k/v [n, Hkv, D]; o [n, Hq, D] and lse [n, Hq] out.
  virtual Status forward(int layer, const T* q, const T* k, const T* v, T* o, float* lse) = 0;
  // The forward's inputs and outputs of `layer`, and dO; dQ, dK, dV out (overwritten).
  virtual Status backward(int layer, const T* q, const T* k, const T* v, const T* o, const float* lse,
                          const T* d_o, T* dq, T* dk, T* dv) = 0;
  AttentionTimes times;
};

template <typename T>
class LocalAttention final : public AttentionBackend<T> {
 public:
  // rank: whose pieces to attend; threads: CPU kernel threads (float).
  LocalAttention(const ModelConfig& config, int rank, int threads = 1);
  std::string name() const override { return "local"; }
  Status begin_step(const plan::Batch& batch) override;
  Status forward(int layer, const T* q, const T* k, const T* v, T* o, float* lse) override;
  Status backward(int layer, const T* q, const T* k, const T* v, const T* o, const float* lse, const T* d_o,
                  T* dq, T* dk, T* dv) override;

 private:
  ModelConfig config_;
  int rank_ = 0;
  int64_t rows_ = 0;
  std::vector<kernels::AttnTask> tasks_;  // one causal task per local document
  std::unique_ptr<kernels::CpuAttention> cpu_;
  std::vector<double> lse_;  // the dense reference's LSE (double path)
};

}  // namespace distca::model
