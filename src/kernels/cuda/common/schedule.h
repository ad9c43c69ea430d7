// The CUDA kernels' tile schedule: the work items of one call, built on the host from the task
// list and uploaded with it. Plain C++ (no CUDA), shared by the launcher, the kernels and the
// host tests.
//
// Forward: one item per 64-row query tile of a task; a block serves one (item, query head).
// Backward (sm_80): one item per 64-key tile of a task; a block serves one (item, query head) and
// loops over the query rows that see its keys.
// Backward (sm_90a), K/V-owning: one item per 64-row tile of the K/V rows the tasks read; a block
// serves one (item, K/V head) and walks every query head of the head's group and every task that
// reads the tile, so tasks sharing K/V rows (the shards of one document) sum their dK/dV in the
// block instead of in global memory.
// Items are ordered heaviest first (most keys, or most query rows), ties in task order, so the
// long items of a call start first and short ones fill in.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "distca/kernels/attention.h"

#if defined(__CUDACC__)
#define DISTCA_HOST_DEVICE __host__ __device__
#else
#define DISTCA_HOST_DEVICE
#endif

namespace distca::kernels::cuda {

struct FwdItem {
  int64_t q_row = 0;    // first Q row of the tile (absolute)
  int64_t kv_row = 0;   // the task's first K/V row (absolute)
  int32_t rows = 0;     // query rows in the tile, 1..64
  int32_t kv_len = 0;   // the task's keys
  int32_t shift = 0;    // causal: tile row r sees task keys j <= r + shift; non-causal: kv_len
  int32_t is_causal = 0;
};

struct BwdItem {
  int64_t q_row = 0;    // the task's first Q row (absolute)
  int64_t kv_row = 0;   // the first K/V row of the tile (absolute)
  int32_t q_len = 0;    // the task's queries
  int32_t key0 = 0;     // the tile's first key, within the task
  int32_t cols = 0;     // keys in the tile, 1..64
  int32_t kv_len = 0;   // the task's keys
  int32_t is_causal = 0;
  int32_t q_begin = 0;  // the first task query that sees a key of the tile
};
static_assert(sizeof(FwdItem) == 32 && sizeof(BwdItem) == 40);

// A tile of K/V rows [kv_row, kv_row + rows) and the tasks that read it: entries [first_entry,
// first_entry + num_entries) of the schedule. Tiles never overlap, so one block writes each dK/dV
// row. A tile is cut from a run of rows that overlapping tasks read, from the run's first row: the
// shards of one document, which read prefixes of its keys, share all their tiles.
struct KvTileItem {
  int64_t kv_row = 0;
  int32_t rows = 0;  // 1..block_n
  int32_t first_entry = 0;
  int32_t num_entries = 0;
  int32_t queries = 0;  // the query rows the walk visits for one query head (the item's cost)
};

// One task's share of a tile: the tile rows [col_begin, col_end) are its keys key0 + col.
struct KvTileEntry {
  int64_t q_row = 0;      // the task's first Q row (absolute)
  int32_t q_len = 0;      // the task's queries
  int32_t key0 = 0;       // the task key at tile row 0 (negative when the task starts inside the tile)
  int32_t col_begin = 0;  // the first tile row the task reads
  int32_t col_end = 0;    // one past the last
  int32_t kv_len = 0;     // the task's keys
  int32_t is_causal = 0;
  int32_t q_begin = 0;    // the first task query that sees a key of [col_begin, col_end)
  int32_t unused = 0;
};
static_assert(sizeof(KvTileItem) == 24 && sizeof(KvTileEntry) == 40);

struct KvTileSchedule {
  std::vector<KvTileItem> items;  // heaviest first
  std::vector<KvTileEntry> entries;
};

// Keys a forward item reads (a prefix of its task's keys).
DISTCA_HOST_DEVICE inline int64_t fwd_item_keys(const FwdItem& it) {
  if (!it.is_causal) return it.kv_len;
  const int64_t last = static_cast<int64_t>(it.rows) - 1 + it.shift + 1;
  return last < it.kv_len ? last : it.kv_len;
}

// REQUIRES: tasks passed kernels::validate; every length fits in int32.
std::vector<FwdItem> fwd_schedule(std::span<const AttnTask> tasks, int block_m);
std::vector<BwdItem> bwd_schedule(std::span<const AttnTask> tasks, int block_n);
KvTileSchedule kv_tile_schedule(std::span<const AttnTask> tasks, int block_n);

// The Q row ranges [begin, end) no task covers, in order (their O = 0 and LSE = -inf).
std::vector<std::pair<int64_t, int64_t>> uncovered_rows(int64_t num_q_rows, std::span<const AttnTask> tasks);

}  // namespace distca::kernels::cuda
