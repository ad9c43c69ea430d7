#include "distca/core/thread_pool.h"

#include <algorithm>

namespace distca {

int ThreadPool::hardware_threads() {
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(num_threads > 0 ? num_threads : hardware_threads()) {
  workers_.reserve(num_threads_ - 1);
  for (int t = 1; t < num_threads_; ++t) workers_.emplace_back([this, t] { worker_loop(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    is_stopping_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::drain(int thread) {
  for (int64_t item = next_.fetch_add(1, std::memory_order_relaxed); item < num_items_;
       item = next_.fetch_add(1, std::memory_order_relaxed)) {
    fn_(ctx_, item, thread);
  }
}

void ThreadPool::run(int64_t num_items, void* ctx, Trampoline fn) {
  if (num_items <= 0) return;
  std::lock_guard run_lock(run_mu_);
  if (workers_.empty() || num_items == 1) {
    for (int64_t i = 0; i < num_items; ++i) fn(ctx, i, 0);
    return;
  }
  {
    std::lock_guard lock(mu_);
    ctx_ = ctx;
    fn_ = fn;
    num_items_ = num_items;
    next_.store(0, std::memory_order_relaxed);
    num_busy_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  drain(0);
  std::unique_lock lock(mu_);
  done_.wait(lock, [this] { return num_busy_ == 0; });
}

void ThreadPool::worker_loop(int thread) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return is_stopping_ || generation_ != seen; });
      if (is_stopping_) return;
      seen = generation_;
    }
    drain(thread);
    {
      std::lock_guard lock(mu_);
      if (--num_busy_ == 0) done_.notify_one();
    }
  }
}

}  // namespace distca
