#include "cuda_emu.h"

#include <ucontext.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../../src/kernels/cuda/sm90/hopper.cuh"

namespace distca::kernels::cuda::emu {
namespace {

enum class State { kRunnable, kSpinning, kAtBlockBarrier, kAtWarpBarrier, kAtWarpgroupBarrier, kAtNamedBarrier, kDone };

using Op = std::function<void()>;

struct Fiber {
  ucontext_t context{};
  std::unique_ptr<char[]> stack;
  State state = State::kRunnable;
  std::array<uint32_t, 8> slot{};  // this lane's words of the current warp collective
  int named_barrier = -1;          // the named barrier this thread waits at
  std::vector<Op> open_wgmma;               // issued, not yet committed
  std::deque<std::vector<Op>> wgmma_groups;  // committed, not yet waited for (oldest first)
};

// An mbarrier's state: arrivals and transaction bytes still expected in the current phase.
struct MBarrier {
  int arrivals = 0, pending = 0;
  int64_t tx = 0;
  int64_t completed = 0;  // phases completed
};

struct TmaCopy {
  void* smem;
  TmaBox box;
  int x, y;
};

struct Machine {
  int64_t block = 0;
  int current = -1;
  ucontext_t scheduler{};
  std::vector<Fiber> fibers;
  int block_arrived = 0;
  std::vector<int> warp_arrived, warpgroup_arrived;
  std::map<int, std::pair<int, int>> named_arrived;  // id -> (threads arrived, the count they name)
  const std::function<void()>* body = nullptr;
  char* shared = nullptr;
  int64_t shared_bytes = 0;
  std::map<const uint64_t*, MBarrier> barriers;
  std::map<const uint64_t*, std::vector<TmaCopy>> tma_in_flight;  // applied when their mbarrier is waited on
  int64_t events = 0;  // state changes a spinning thread may be waiting for
  bool restart = false;  // the next round starts from thread 0 (after an mbarrier arrival)
  std::string error;   // the first misuse a primitive found
};

constexpr size_t kStackBytes = 256 * 1024;
Machine* g_machine = nullptr;
TmaTiming g_tma_timing = TmaTiming::kLatest;
Schedule g_schedule = Schedule::kRoundRobin;

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

void sync_warpgroup() {
  Machine& m = *g_machine;
  const size_t group = static_cast<size_t>(m.current / 128);
  const int size = std::min(128, static_cast<int>(m.fibers.size()) - static_cast<int>(group) * 128);
  if (++m.warpgroup_arrived[group] == size) {
    m.warpgroup_arrived[group] = 0;
    for (int l = 0; l < size; ++l) {
      Fiber& f = m.fibers[group * 128 + static_cast<size_t>(l)];
      if (f.state == State::kAtWarpgroupBarrier) f.state = State::kRunnable;
    }
    return;
  }
  wait_as(State::kAtWarpgroupBarrier);
}

void named_barrier(int id, int count, bool wait) {
  Machine& m = *g_machine;
  if (id < 0 || id > 15 || count <= 0 || count % 32 != 0 || count > static_cast<int>(m.fibers.size())) {
    if (m.error.empty()) m.error = "a named barrier with a bad id or thread count";
    return;
  }
  auto& [arrived, expected] = m.named_arrived[id];
  if (arrived > 0 && expected != count) {
    if (m.error.empty()) m.error = "named barrier " + std::to_string(id) + " used with two thread counts at once";
    return;
  }
  expected = count;
  if (++arrived == count) {
    arrived = 0;
    for (Fiber& f : m.fibers) {
      if (f.state == State::kAtNamedBarrier && f.named_barrier == id) {
        f.state = State::kRunnable;
        f.named_barrier = -1;
      }
    }
    return;
  }
  if (!wait) return;
  m.fibers[static_cast<size_t>(m.current)].named_barrier = id;
  wait_as(State::kAtNamedBarrier);
}

char* shared_base() { return g_machine->shared; }

void yield_spinning() { wait_as(State::kSpinning); }

namespace {
void fail(const std::string& what) {
  if (g_machine->error.empty()) g_machine->error = what;
}

void complete_if_done(MBarrier& b) {
  if (b.pending == 0 && b.tx == 0) {
    ++b.completed;
    b.pending = b.arrivals;
    ++g_machine->events;
  }
}

MBarrier* barrier_at(const uint64_t* bar) {
  auto it = g_machine->barriers.find(bar);
  if (it == g_machine->barriers.end()) {
    fail("an mbarrier used before mbarrier_init");
    return nullptr;
  }
  return &it->second;
}

// Performs a TMA box copy (the PTX ISA's tiled mode: row after row, swizzled, zeros out of bounds).
void apply_tma(const TmaCopy& c, MBarrier& b) {
  const TmaBox& box = c.box;
  const auto base = static_cast<uint32_t>(static_cast<char*>(c.smem) - g_machine->shared);
  for (int r = 0; r < box.box_y; ++r) {
    for (int e = 0; e < box.box_x; ++e) {
      const int64_t gx = c.x + e, gy = c.y + r;
      uint16_t v = 0;
      if (gx >= 0 && gx < box.dim_x && gy >= 0 && gy < box.dim_y) {
        std::memcpy(&v, static_cast<const char*>(box.global) + gy * box.row_stride_bytes + gx * 2, 2);
      }
      const uint32_t logical = base + static_cast<uint32_t>((r * box.box_x + e) * 2);
      std::memcpy(g_machine->shared + swizzle_address(logical, box.swizzle), &v, 2);
    }
  }
  b.tx -= int64_t{box.box_x} * box.box_y * 2;
  complete_if_done(b);
}
}  // namespace

void mbar_init(uint64_t* bar, int arrivals) {
  if (arrivals < 1) fail("mbarrier_init with fewer than 1 arrival");
  g_machine->barriers[bar] = MBarrier{arrivals, arrivals, 0, 0};
  *bar = 0;
}

void mbar_arrive(uint64_t* bar, uint32_t expect_tx_bytes) {
  MBarrier* b = barrier_at(bar);
  if (!b) return;
  b->tx += expect_tx_bytes;
  --b->pending;
  ++g_machine->events;
  complete_if_done(*b);
  // The waiters run first (threads from 0 on, a producer among them) before the arriving thread
  // goes on: an arrival that releases memory still in use shows.
  g_machine->restart = true;
  wait_as(State::kRunnable);
}

void mbar_wait(uint64_t* bar, int parity) {
  for (;;) {
    MBarrier* b = barrier_at(bar);
    if (!b) return;
    if (auto it = g_machine->tma_in_flight.find(bar); it != g_machine->tma_in_flight.end()) {
      std::vector<TmaCopy> copies = std::move(it->second);
      g_machine->tma_in_flight.erase(it);
      for (const TmaCopy& c : copies) apply_tma(c, *b);
    }
    if ((b->completed & 1) != (parity & 1)) return;  // the phase of this parity has completed
    yield_spinning();
  }
}

void tma_load_2d(void* smem, const TmaDesc& desc, int x, int y, uint64_t* bar) {
  TmaBox box;
  std::memcpy(&box, desc.bytes, sizeof box);
  const auto offset = static_cast<char*>(smem) - g_machine->shared;
  const int64_t bytes = int64_t{box.box_x} * box.box_y * 2;
  const int64_t align = box.swizzle == Swizzle::kNone ? 128 : 8 * static_cast<int64_t>(box.swizzle);
  if (offset < 0 || offset + bytes > g_machine->shared_bytes) {
    fail("a TMA box outside the block's shared memory");
  } else if (offset % align != 0) {
    fail("a TMA destination not aligned to its swizzle pattern");
  } else if (box.swizzle != Swizzle::kNone && box.box_x * 2 > static_cast<int>(box.swizzle)) {
    fail("a TMA box row wider than its swizzle width");
  } else if (MBarrier* b = barrier_at(bar)) {
    if (g_tma_timing == TmaTiming::kEarliest) {
      apply_tma({smem, box, x, y}, *b);
    } else {
      g_machine->tma_in_flight[bar].push_back({smem, box, x, y});
    }
  }
}

void set_tma_timing(TmaTiming timing) { g_tma_timing = timing; }
void set_schedule(Schedule schedule) { g_schedule = schedule; }

void wgmma_issue(std::function<void()> apply) {
  g_machine->fibers[static_cast<size_t>(g_machine->current)].open_wgmma.push_back(std::move(apply));
}

void wgmma_commit() {
  Fiber& f = g_machine->fibers[static_cast<size_t>(g_machine->current)];
  f.wgmma_groups.push_back(std::move(f.open_wgmma));
  f.open_wgmma.clear();
}

void wgmma_wait(int pending) {
  Fiber& f = g_machine->fibers[static_cast<size_t>(g_machine->current)];
  while (static_cast<int>(f.wgmma_groups.size()) > pending) {
    for (const Op& op : f.wgmma_groups.front()) op();
    f.wgmma_groups.pop_front();
  }
}

uint32_t* lane_slot(int lane) {
  return g_machine->fibers[static_cast<size_t>((g_machine->current & ~31) + lane)].slot.data();
}

std::string run_block(int64_t block, int num_threads, const std::function<void()>& body, char* shared,
                      int64_t shared_bytes) {
  if (num_threads <= 0 || num_threads % 32 != 0) return "num_threads must be a positive multiple of 32";
  Machine m;
  m.block = block;
  m.body = &body;
  m.shared = shared;
  m.shared_bytes = shared_bytes;
  m.fibers.resize(static_cast<size_t>(num_threads));
  m.warp_arrived.assign(static_cast<size_t>(num_threads / 32), 0);
  m.warpgroup_arrived.assign(static_cast<size_t>((num_threads + 127) / 128), 0);
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
    bool ran = false, all_done = true, only_spun = true;
    const int64_t events = m.events;
    for (size_t i = 0; i < m.fibers.size(); ++i) {
      if (m.fibers[i].state == State::kDone) continue;
      all_done = false;
      const bool spinning = m.fibers[i].state == State::kSpinning;
      if (m.fibers[i].state != State::kRunnable && !spinning) continue;
      m.current = static_cast<int>(i);
      m.fibers[i].state = State::kRunnable;
      swapcontext(&m.scheduler, &m.fibers[i].context);
      ran = true;
      const bool spun = spinning && m.fibers[i].state == State::kSpinning;
      only_spun = only_spun && spun;
      if (m.restart || (g_schedule == Schedule::kLowestFirst && !spun)) {
        m.restart = false;
        break;
      }
    }
    if (all_done) break;
    if (!ran || (only_spun && m.events == events)) {
      error = ran ? "deadlock: threads wait on an mbarrier phase that cannot complete"
                  : "deadlock: the block's threads wait at different barriers (divergent barrier or collective)";
      break;
    }
  }
  if (error.empty()) error = m.error;
  if (error.empty() && !m.tma_in_flight.empty()) error = "TMA loads whose mbarrier no thread waited on";
  for (const auto& [id, state] : m.named_arrived) {
    if (error.empty() && state.first != 0) {
      error = "named barrier " + std::to_string(id) + " left with " + std::to_string(state.first) + " of " +
              std::to_string(state.second) + " arrivals when the block ended";
    }
  }
  if (error.empty()) {
    for (const Fiber& f : m.fibers) {
      if (!f.open_wgmma.empty() || !f.wgmma_groups.empty()) {
        error = "wgmma results never waited for (wgmma_commit, then wgmma_wait)";
        break;
      }
    }
  }
  g_machine = outer;
  return error;
}

TmaDesc make_tma_desc_for_emulator(const TmaBox& box) {
  TmaDesc d{};
  std::memcpy(d.bytes, &box, sizeof box);
  return d;
}

}  // namespace distca::kernels::cuda::emu

namespace distca::kernels::cuda {
TmaDesc make_tma_desc(const TmaBox& box) { return emu::make_tma_desc_for_emulator(box); }
}  // namespace distca::kernels::cuda
