#include "distca/comm/emulated_link.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <thread>

namespace distca::comm {

namespace {

using Clock = std::chrono::steady_clock;

class DelayedWork final : public Work {
 public:
  DelayedWork(std::unique_ptr<Work> inner, Clock::time_point ready) : inner_(std::move(inner)), ready_(ready) {}

  Result<bool> test() override {
    DISTCA_ASSIGN_OR_RETURN(bool done, inner_->test());
    return done && Clock::now() >= ready_;
  }
  Status wait() override {
    DISTCA_RETURN_IF_ERROR(inner_->wait());
    std::this_thread::sleep_until(ready_);
    return Status::ok();
  }

 private:
  std::unique_ptr<Work> inner_;
  Clock::time_point ready_;
};

}  // namespace

Status LinkOptions::validate() const {
  if (!(latency_seconds >= 0) || !std::isfinite(latency_seconds)) {
    return invalid_argument(fmt::format("link latency must be a finite number >= 0 s, got {}", latency_seconds));
  }
  if (!(bytes_per_second >= 0) || !std::isfinite(bytes_per_second)) {
    return invalid_argument(fmt::format("link bandwidth must be a finite number >= 0 B/s (0: unlimited), got {}",
                                        bytes_per_second));
  }
  return Status::ok();
}

EmulatedLink::EmulatedLink(Communicator& inner, LinkOptions options) : inner_(inner) {
  set_options(options);
  counters_.bytes_sent_to.assign(inner_.size(), 0);
}

void EmulatedLink::set_options(const LinkOptions& options) {
  DISTCA_CHECK(options.validate().is_ok()) << options.validate().to_string();
  options_ = options;
}

std::string EmulatedLink::name() const {
  return fmt::format("{}+link({:.1f} us, {:.3g} GB/s)", inner_.name(), options_.latency_seconds * 1e6,
                     options_.bytes_per_second / 1e9);
}

void EmulatedLink::reset_counters() {
  counters_ = LinkCounters{};
  counters_.bytes_sent_to.assign(inner_.size(), 0);
}

Result<std::unique_ptr<Work>> EmulatedLink::delay(Result<std::unique_ptr<Work>> inner, int64_t bytes_out,
                                                  int64_t bytes_in) {
  if (!inner.is_ok()) return inner.status();
  ++counters_.operations;
  counters_.bytes_sent += bytes_out;
  counters_.bytes_received += bytes_in;
  counters_.wire_bytes += std::max(bytes_out, bytes_in);
  double seconds = options_.latency_seconds;
  if (options_.bytes_per_second > 0) {
    seconds += static_cast<double>(std::max(bytes_out, bytes_in)) / options_.bytes_per_second;
  }
  counters_.busy_seconds += seconds;
  const Clock::time_point start = std::max(Clock::now(), link_free_);
  link_free_ = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  return std::unique_ptr<Work>(new DelayedWork(std::move(inner).value(), link_free_));
}

Result<std::unique_ptr<Work>> EmulatedLink::all_to_all_v_async(const AllToAllV& a) {
  DISTCA_RETURN_IF_ERROR(check(a));
  int64_t out = 0;
  int64_t in = 0;
  for (int p = 0; p < size(); ++p) {
    if (p == rank()) continue;
    out += a.send_counts[p];
    in += a.recv_counts[p];
    counters_.bytes_sent_to[p] += a.send_counts[p];
  }
  return delay(inner_.all_to_all_v_async(a), out, in);
}

Result<std::unique_ptr<Work>> EmulatedLink::all_reduce_sum_async(float* data, int64_t count) {
  const int r = size();
  const auto bytes = static_cast<int64_t>(2.0 * (r - 1) / r * static_cast<double>(count) * sizeof(float));
  return delay(inner_.all_reduce_sum_async(data, count), bytes, bytes);
}

Result<std::unique_ptr<Work>> EmulatedLink::broadcast_async(void* data, int64_t bytes, int root) {
  const int r = size();
  const auto b = static_cast<int64_t>(static_cast<double>(r - 1) / r * static_cast<double>(bytes));
  return delay(inner_.broadcast_async(data, bytes, root), b, b);
}

Result<std::unique_ptr<Work>> EmulatedLink::barrier_async() { return delay(inner_.barrier_async(), 0, 0); }

}  // namespace distca::comm
