#include "cuda_emu.h"

#include <ucontext.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "../../src/kernels/cuda/warp.cuh"

namespace distca::kernels::cuda::emu {
namespace {

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  ucontext_t context{};
  std::unique_ptr<char[]> stack;
  State state = State::kRunnable;
  std::array<uint32_t, 8> slot{};  // this lane's words of the current warp collective
};

struct Machine {
  int64_t block = 0;
  int current = -1;
  ucontext_t scheduler{};
  std::vector<Fiber> fibers;
  int block_arrived = 0;
  std::vector<int> warp_arrived;
  const std::function<void()>* body = nullptr;
};

constexpr size_t kStackBytes = 256 * 1024;
Machine* g_machine = nullptr;

void fiber_main() {
  (*g_machine->body)();
  g_machine->fibers[static_cast<size_t>(g_machine->current)].state = State::kDone;
  // Returning resumes uc_link: the scheduler.
}

void wait_as(State state) {
  Fiber& f = g_machine->fibers[static_cast<size_t>(g_machine->current)];
  f.state = state;
  swapcontext(&f.context, &g_machine->scheduler);
}

}  // namespace

int thread_index() { return g_machine->current; }
int64_t block_index() { return g_machine->block; }

void sync_block() {
  Machine& m = *g_machine;
  if (++m.block_arrived == static_cast<int>(m.fibers.size())) {
    m.block_arrived = 0;
    for (Fiber& f : m.fibers) {
      if (f.state == State::kAtBlockBarrier) f.state = State::kRunnable;
    }
    return;
  }
  wait_as(State::kAtBlockBarrier);
}

void sync_warp() {
  Machine& m = *g_machine;
  const int warp = m.current / 32;
  if (++m.warp_arrived[static_cast<size_t>(warp)] == 32) {
    m.warp_arrived[static_cast<size_t>(warp)] = 0;
    for (int l = 0; l < 32; ++l) {
      Fiber& f = m.fibers[static_cast<size_t>(warp * 32 + l)];
      if (f.state == State::kAtWarpBarrier) f.state = State::kRunnable;
    }
    return;
  }
  wait_as(State::kAtWarpBarrier);
}

uint32_t* lane_slot(int lane) {
  return g_machine->fibers[static_cast<size_t>((g_machine->current & ~31) + lane)].slot.data();
}

std::string run_block(int64_t block, int num_threads, const std::function<void()>& body) {
  if (num_threads <= 0 || num_threads % 32 != 0) return "num_threads must be a positive multiple of 32";
  Machine m;
  m.block = block;
  m.body = &body;
  m.fibers.resize(static_cast<size_t>(num_threads));
  m.warp_arrived.assign(static_cast<size_t>(num_threads / 32), 0);
  Machine* outer = g_machine;
  g_machine = &m;
  for (Fiber& f : m.fibers) {
    f.stack = std::make_unique<char[]>(kStackBytes);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &m.scheduler;
    makecontext(&f.context, fiber_main, 0);
  }
  std::string error;
  for (;;) {
    bool ran = false, all_done = true;
    for (size_t i = 0; i < m.fibers.size(); ++i) {
      if (m.fibers[i].state == State::kDone) continue;
      all_done = false;
      if (m.fibers[i].state != State::kRunnable) continue;
      m.current = static_cast<int>(i);
      swapcontext(&m.scheduler, &m.fibers[i].context);
      ran = true;
    }
    if (all_done) break;
    if (!ran) {
      error = "deadlock: the block's threads wait at different barriers (divergent barrier or collective)";
      break;
    }
  }
  g_machine = outer;
  return error;
}

}  // namespace distca::kernels::cuda::emu
