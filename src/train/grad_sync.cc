#include "distca/train/grad_sync.h"

#include <algorithm>
#include <charconv>
#include <string_view>

#include <fmt/format.h>

#include "distca/core/stopwatch.h"
#include "distca/core/trace.h"

namespace distca::train {

namespace {

// The bucket of a block name (ModelState's names): 0 the head, 1 + 2l layer l's attention input
// (attn_norm, wq, wk, wv), 2 + 2l its MLP and output projection, 2 layers + 1 the embedding; -1
// an unknown name.
int64_t bucket_of_block(std::string_view name, int64_t layers) {
  if (name == "final_norm" || name == "lm_head") return 0;
  if (name == "embed") return 2 * layers + 1;
  constexpr std::string_view kLayers = "layers.";
  if (!name.starts_with(kLayers)) return -1;
  name.remove_prefix(kLayers.size());
  int64_t l = -1;
  const auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), l);
  if (ec != std::errc{} || end == name.data() + name.size() || *end != '.' || l < 0 || l >= layers) return -1;
  const std::string_view block(end + 1, static_cast<size_t>(name.data() + name.size() - end - 1));
  if (block == "attn_norm" || block == "wq" || block == "wk" || block == "wv") return 1 + 2 * l;
  if (block == "wo" || block == "mlp_norm" || block == "w_gate" || block == "w_up" || block == "w_down") return 2 + 2 * l;
  return -1;
}

}  // namespace

Result<std::unique_ptr<GradientSync>> GradientSync::create(comm::Communicator& dp, const model::Arena<float>& layout) {
  int64_t layers = 0;
  for (const auto& b : layout.blocks()) {
    if (b.name.starts_with("layers.")) {
      const auto dot = b.name.find('.', 7);
      int64_t l = -1;
      const std::string_view digits(b.name.data() + 7, dot == std::string::npos ? 0 : dot - 7);
      std::from_chars(digits.data(), digits.data() + digits.size(), l);
      layers = std::max(layers, l + 1);
    }
  }
  std::vector<std::array<int64_t, 2>> ranges(static_cast<size_t>(2 * layers + 2), {layout.size(), 0});
  std::vector<int64_t> counted(ranges.size(), 0);
  for (const auto& b : layout.blocks()) {
    const int64_t k = bucket_of_block(b.name, layers);
    if (k < 0) return invalid_argument(fmt::format("gradient sync: no bucket for the gradient block '{}'", b.name));
    auto& r = ranges[static_cast<size_t>(k)];
    r[0] = std::min(r[0], b.offset);
    r[1] = std::max(r[1], b.offset + b.count);
    counted[static_cast<size_t>(k)] += b.count;
  }
  for (size_t k = 0; k < ranges.size(); ++k) {
    if (counted[k] == 0) {
      ranges[k] = {0, 0};
      continue;
    }
    if (ranges[k][1] - ranges[k][0] != counted[k]) {
      return invalid_argument(fmt::format("gradient sync: the blocks of bucket {} are not contiguous in the gradients", k));
    }
  }
  return std::unique_ptr<GradientSync>(new GradientSync(dp, std::move(ranges), layout.size()));
}

int64_t GradientSync::bucket_of(model::GradsDone part) const {
  switch (part.kind) {
    case model::GradsDone::Kind::kHead: return 0;
    case model::GradsDone::Kind::kEmbedding: return buckets() - 1;
    case model::GradsDone::Kind::kLayerAttention:
    case model::GradsDone::Kind::kLayerMlp: {
      if (part.layer < 0 || 2 * part.layer + 2 >= buckets()) return -1;
      return (part.kind == model::GradsDone::Kind::kLayerAttention ? 1 : 2) + 2 * part.layer;
    }
  }
  return -1;
}

Status GradientSync::begin(float* grads, int passes, int64_t paced_posts) {
  if (is_open_) return internal_error("gradient sync: a step began before the last one finished");
  if (grads == nullptr && size_ > 0) return invalid_argument("gradient sync: no gradient buffer");
  if (passes < 1 || passes > 2) return invalid_argument(fmt::format("gradient sync: 1 or 2 passes a step, got {}", passes));
  if (paced_posts < 0) return invalid_argument(fmt::format("gradient sync: {} paced posts", paced_posts));
  slice_ = paced_posts > 0 ? std::max<int64_t>(1, (size_ + paced_posts - 1) / paced_posts) : 0;
  post_seconds_ = 0;
  ready_.clear();
  next_ready_ = 0;
  allowance_ = 0;
  grads_ = grads;
  passes_ = passes;
  reported_.assign(ranges_.size(), 0);
  works_.clear();
  posted_ = 0;
  error_ = Status::ok();
  is_open_ = true;
  return Status::ok();
}

void GradientSync::done(model::GradsDone part) {
  if (!is_open_ || !error_.is_ok()) return;
  const int64_t k = bucket_of(part);
  if (k < 0) {
    error_ = internal_error(fmt::format("gradient sync: no bucket for layer {}", part.layer));
    return;
  }
  int& n = reported_[static_cast<size_t>(k)];
  if (++n > passes_) {
    error_ = internal_error(fmt::format("gradient sync: bucket {} reported {} times in a step of {} passes", k, n, passes_));
    return;
  }
  if (n < passes_) return;
  const auto [lo, hi] = ranges_[static_cast<size_t>(k)];
  if (hi <= lo) return;
  if (slice_ > 0) {
    ready_.push_back({lo, hi});
  } else {
    post(lo, hi);
  }
}

void GradientSync::post(int64_t lo, int64_t hi) {
  const auto t = SteadyClock::now();
  auto work = dp_.all_reduce_sum_async(grads_ + lo, hi - lo);
  const auto e = SteadyClock::now();
  post_seconds_ += std::chrono::duration<double>(e - t).count();
  trace::add("gradient all-reduce post", "comm", t, e);
  if (!work.is_ok()) {
    error_ = work.status();
    return;
  }
  works_.push_back(std::move(work).value());
  ++posted_;
}

void GradientSync::pace() {
  if (!is_open_ || !error_.is_ok()) return;
  allowance_ += slice_;  // a pace with less ready leaves its share to the next
  while (allowance_ > 0 && next_ready_ < ready_.size() && error_.is_ok()) {
    auto& [lo, hi] = ready_[next_ready_];
    const int64_t take = std::min(allowance_, hi - lo);
    post(lo, lo + take);
    lo += take;
    allowance_ -= take;
    if (lo == hi) ++next_ready_;
  }
}

int64_t GradientSync::pending_floats() const {
  int64_t n = 0;
  for (size_t i = next_ready_; i < ready_.size(); ++i) n += ready_[i][1] - ready_[i][0];
  return n;
}

Status GradientSync::finish() {
  if (!is_open_) return internal_error("gradient sync: finish without begin");
  // Paced: what the backward left unposted (the last buckets), then every wait.
  for (; next_ready_ < ready_.size() && error_.is_ok(); ++next_ready_) post(ready_[next_ready_][0], ready_[next_ready_][1]);
  is_open_ = false;
  // Every posted all-reduce is waited for, even after an error: the buffers stay the caller's.
  for (auto& w : works_) {
    const Status st = w->wait();
    if (error_.is_ok() && !st.is_ok()) error_ = st;
  }
  works_.clear();
  if (!error_.is_ok()) return error_;
  for (size_t k = 0; k < ranges_.size(); ++k) {
    if (reported_[k] != passes_ && ranges_[k][1] > ranges_[k][0]) {
      return internal_error(fmt::format("gradient sync: bucket {} was reported by {} of the step's {} passes", k,
                                        reported_[k], passes_));
    }
  }
  return Status::ok();
}

}  // namespace distca::train
