// ThreadPool: a fixed set of worker threads that run parallel loops. The calling thread takes
// part, so a pool of N threads uses N - 1 workers. Items are handed out dynamically (an atomic
// counter), so which thread runs an item depends on timing: callers that need deterministic
// results must make each item's arithmetic independent of the others (per-thread scratch is
// indexed by the thread number passed to the body).
//
// Thread safety: one parallel_for at a time per pool (calls from several threads serialize).
// No allocation per call.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace distca {

class ThreadPool {
 public:
  // num_threads <= 0 means one per hardware thread.
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs body(item, thread) for every item in [0, num_items), thread in [0, num_threads()).
  // Returns when all items are done. An exception thrown by body terminates the program
  // (bodies are kernels; they report errors before they are run).
  template <typename Body>
  void parallel_for(int64_t num_items, Body&& body) {
    run(num_items, &body, [](void* ctx, int64_t item, int thread) {
      (*static_cast<std::remove_reference_t<Body>*>(ctx))(item, thread);
    });
  }

  static int hardware_threads();

 private:
  using Trampoline = void (*)(void*, int64_t, int);
  void run(int64_t num_items, void* ctx, Trampoline fn);
  void worker_loop(int thread);
  void drain(int thread);

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // serializes parallel_for calls
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  uint64_t generation_ = 0;
  bool is_stopping_ = false;
  int num_busy_ = 0;
  // The current loop.
  void* ctx_ = nullptr;
  Trampoline fn_ = nullptr;
  int64_t num_items_ = 0;
  std::atomic<int64_t> next_{0};
};

}  // namespace distca
