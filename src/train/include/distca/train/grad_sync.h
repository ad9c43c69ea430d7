// The data-parallel gradient all-reduce, overlapped with the backward (as PyTorch's DDP buckets
// its parameters): the model's gradient blocks fall into buckets in the order the backward
// finishes them (the head: final norm and LM head; per layer from the last, its MLP and output
// projection, then its norm and Q/K/V projections; the embedding),
// and each bucket's all-reduce is posted as soon as the last pass adding to it this step (one
// whole pass, or both ping-pong nano-batches) has finished it. So layer l's sums move over the
// link while the backward of its attention and of the layers below computes; finish() waits for whatever is still in
// flight. Every rank posts the same buckets in the same order (the passes' phases run in the
// same order everywhere), so the collectives pair.
//
// Paced (begin's `paced_posts` > 0): a bucket's all-reduce is not posted when it is ready but in
// slices, the pace() calls so far posting up to their share (1/paced_posts each) of the
// gradients' floats from the ready buckets in order. The caller paces right after it posts an attention exchange, so that the
// sums queue behind that exchange on the link (TCP delivers in order) and fill the time until the
// next, rather than delaying it; finish() posts what is left. The same calls on every rank post
// the same slices in the same order.
//
// The sums are the same as one all-reduce of the whole buffer's: a bucket is a contiguous range
// of it, reduced element-wise. The transfers advance inside communicator calls: the caller's
// poll between GEMMs or a progress thread (TrainOptions::progress) keeps them moving during
// compute.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "distca/comm/communicator.h"
#include "distca/core/status.h"
#include "distca/model/arena.h"
#include "distca/model/model.h"

namespace distca::train {

class GradientSync {
 public:
  // `layout`: the gradient arena's (ModelState::grads) blocks, named as ModelState names them;
  // every block must fall in one bucket, and each bucket's blocks must be contiguous.
  static Result<std::unique_ptr<GradientSync>> create(comm::Communicator& dp, const model::Arena<float>& layout);

  // A new step: `passes` passes (1 or 2) will each report every bucket once (done), adding their
  // gradients into `grads` (the arena's size) before they do; with paced_posts > 0 the caller
  // will call pace() that many times. REQUIRES: the last step finished.
  Status begin(float* grads, int passes, int64_t paced_posts = 0);
  // A pass has finished adding to a bucket; on its last pass the bucket's all-reduce is posted.
  // An error (a bucket reported too often, a failed post) is kept for finish(): the model's
  // phases call this and carry on.
  void done(model::GradsDone part);
  // Paced: posts the next slice of the ready buckets (nothing when none is ready).
  void pace();
  // Waits for every bucket's all-reduce. A bucket some pass never reported is an error (a pass
  // skipped a phase): its sum would be missing. Returns the first error of the step.
  Status finish();

  int64_t buckets() const { return static_cast<int64_t>(ranges_.size()); }
  // All-reduces posted so far this step (tests: they are posted before finish()).
  int64_t posted() const { return posted_; }
  // Seconds this step spent posting all-reduces (a post may wait for the peers: LocalComm), the
  // trainers' comm (inside a pass they are not linear work).
  double post_seconds() const { return post_seconds_; }
  // Paced: floats ready but not yet posted.
  int64_t pending_floats() const;
  // [begin, end) of a bucket in the arena: the head is bucket 0, layer l's attention input
  // 1 + 2l and its MLP and output projection 2 + 2l, the embedding the last.
  std::array<int64_t, 2> range(int64_t bucket) const { return ranges_.at(static_cast<size_t>(bucket)); }
  int64_t bucket_of(model::GradsDone part) const;

 private:
  GradientSync(comm::Communicator& dp, std::vector<std::array<int64_t, 2>> ranges, int64_t size)
      : dp_(dp), ranges_(std::move(ranges)), size_(size) {}
  comm::Communicator& dp_;
  std::vector<std::array<int64_t, 2>> ranges_;
  int64_t size_ = 0;
  float* grads_ = nullptr;
  int passes_ = 0;
  std::vector<int> reported_;  // per bucket, this step
  std::vector<std::unique_ptr<comm::Work>> works_;
  int64_t slice_ = 0;                           // paced: floats a pace() posts; 0: unpaced
  std::vector<std::array<int64_t, 2>> ready_;   // paced: ranges ready, not yet posted, in order
  size_t next_ready_ = 0;
  int64_t allowance_ = 0;                       // paced: floats the paces so far may still post
  void post(int64_t lo, int64_t hi);
  int64_t posted_ = 0;
  double post_seconds_ = 0;
  Status error_ = Status::ok();
  bool is_open_ = false;
};

}  // namespace distca::train
