// The driver of the CPU attention: validates, converts bf16 to fp32 working copies, builds the
// work lists, runs the block routines (isa.h) on the thread pool and converts results back.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "distca/core/log.h"
#include "distca/core/thread_pool.h"
#include "distca/kernels/cpu.h"
#include "distca/kernels/registry.h"
#include "isa.h"

namespace distca::kernels {

using cpu_detail::kBlockK;
using cpu_detail::kBlockQ;
// The most floats the backward keeps for per-query-head partial dK/dV sums (256 MiB; a 16K-token
// document with 4 query heads of D 128 per KV head needs 64 MiB).
constexpr int64_t kPartialBudget = int64_t{1} << 26;
constexpr int64_t kSplitShare = 8;

namespace {

// A growable fp32 buffer, 64-byte aligned, that never shrinks.
class Buffer {
 public:
  float* get(int64_t num_floats) {
    if (num_floats > capacity_) {
      data_.reset(static_cast<float*>(::operator new[](
          static_cast<std::size_t>(num_floats) * sizeof(float), std::align_val_t{64})));
      capacity_ = num_floats;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<float[], Free> data_;
  int64_t capacity_ = 0;
};

int64_t num_query_blocks(const AttnTask& t) { return (t.q_len + kBlockQ - 1) / kBlockQ; }

// Whether x[0, n) holds a NaN or an infinity (all exponent bits set; -inf counts unless
// `is_neg_inf_finite`), a chunk per work item; allocates nothing.
bool has_non_finite(ThreadPool& pool, const float* x, int64_t n, bool is_neg_inf_finite = false) {
  constexpr int64_t kChunk = 1 << 16;
  const uint32_t finite_bits = is_neg_inf_finite ? 0xff800000u : 0u;  // 0: no such exception
  typedef uint32_t vu __attribute__((vector_size(16)));  // the baseline's vectors; branch-free
  std::atomic<bool> found{false};
  pool.parallel_for((n + kChunk - 1) / kChunk, [&](int64_t c, int) {
    const int64_t end = std::min(n, (c + 1) * kChunk);
    vu bad{};
    int64_t i = c * kChunk;
    for (; i + 4 <= end; i += 4) {
      vu bits;
      std::memcpy(&bits, x + i, sizeof bits);
      bad |= ((bits & 0x7f800000u) == 0x7f800000u) & (bits != finite_bits);
    }
    uint32_t any = bad[0] | bad[1] | bad[2] | bad[3];
    for (; i < end; ++i) {
      uint32_t bits;
      std::memcpy(&bits, x + i, sizeof bits);
      any |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u && bits != finite_bits);
    }
    if (any != 0) found.store(true, std::memory_order_relaxed);
  });
  return found.load(std::memory_order_relaxed);
}

}  // namespace

static const cpu_detail::BlockRoutines& routines_of(const std::string& isa) {
  const Result<std::string> name = resolve_cpu_isa(isa);
  DISTCA_CHECK(name.is_ok()) << name.status().message();
  return cpu_detail::routines_for(name.value());
}

struct CpuAttention::State {
  explicit State(const CpuAttentionOptions& options)
      : pool(options.num_threads),
        routines(&routines_of(options.isa)),
        poll(options.poll),
        poll_interval(options.poll_interval) {
    scratch_buffers.resize(pool.num_threads());
    scratch.resize(pool.num_threads());
    for (int t = 0; t < pool.num_threads(); ++t) {
      const int64_t n = cpu_detail::kScratchFloats, f = cpu_detail::kFwdScratchFloats;
      float* base = scratch_buffers[t].get(4 * n + 2 * f);
      // s, dp, acc, qt, dk, dv
      scratch[t] = {base, base + n, base + 2 * n, base + 2 * n + f, base + 2 * n + 2 * f, base + 3 * n + 2 * f};
    }
    if (poll) {
      scratch[0].poll = [](void* self) { static_cast<State*>(self)->maybe_poll(0); };
      scratch[0].poll_ctx = this;
    }
  }

  ThreadPool pool;
  const cpu_detail::BlockRoutines* routines;
  std::function<void()> poll;
  std::chrono::microseconds poll_interval;
  std::chrono::steady_clock::time_point last_poll{};
  // CpuAttentionOptions::poll, on the calling thread (thread 0 of the pool), between work items.
  void maybe_poll(int thread) {
    if (!poll || thread != 0) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_poll < poll_interval) return;
    last_poll = now;
    poll();
  }
  std::vector<Buffer> scratch_buffers;
  std::vector<cpu_detail::Scratch> scratch;
  // Working copies (bf16 inputs as fp32, fp32 outputs before rounding to bf16) and packs.
  Buffer q32, k32, v32, o32, do32, lse_out, dq32, dk32, dv32, packed;
  std::vector<cpu_detail::QueryBlock> query_blocks;
  std::vector<int64_t> block_base;
  // The backward's segments and units (build_units).
  struct Segment {
    int64_t r0, r1;            // key rows
    int64_t begin, end;        // its tasks: segment_tasks[begin, end), in task order
    int64_t work;              // causal (query, key) pairs of its tasks, per query head
    int64_t partial = -1;      // split by query head: offset of its partial sums in `partial`
  };
  std::vector<Segment> segments;
  std::vector<int64_t> segment_tasks, segment_of;
  std::vector<cpu_detail::BwdUnit> units;
  std::vector<int64_t> unit_work, unit_order;
  struct ReduceBlock {
    int64_t segment, kv_head, r0, r1;
  };
  std::vector<ReduceBlock> reduce_blocks;  // key rows of the split segments, 64 at a time
  Buffer partial;
  RangeScratch ranges;

  // src as fp32: the pointer itself for float, a converted copy in buf for bf16.
  template <typename T>
  const float* as_f32(const T* src, int64_t n, Buffer& buf) {
    if constexpr (std::is_same_v<T, float>) {
      return src;
    } else {
      float* dst = buf.get(n);
      const int64_t chunk = 1 << 16;
      pool.parallel_for((n + chunk - 1) / chunk, [&](int64_t c, int) {
        for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) dst[i] = to_float(src[i]);
      });
      return dst;
    }
  }
  // Where a routine writes an output: the caller's array for float, fp32 scratch for bf16.
  template <typename T>
  float* out_f32(T* dst, int64_t n, Buffer& buf) {
    if constexpr (std::is_same_v<T, float>) {
      return dst;
    } else {
      return buf.get(n);
    }
  }
  template <typename T>
  void store_out(const float* src, int64_t n, T* dst) {
    if constexpr (!std::is_same_v<T, float>) {
      const int64_t chunk = 1 << 16;
      pool.parallel_for((n + chunk - 1) / chunk, [&](int64_t c, int) {
        for (int64_t i = c * chunk; i < std::min(n, (c + 1) * chunk); ++i) dst[i] = from_float<T>(src[i]);
      });
    }
  }

  // Query blocks of every (task, head), the most expensive first (dynamic scheduling then
  // finishes evenly). Also numbers them for the backward's packed arrays.
  // heads_at_once: the forward's blocks hold up to this many query heads of one KV head; the
  // backward's hold one (its packed arrays are per head).
  int64_t build_query_blocks(const AttnDims& dims, std::span<const AttnTask> tasks, int64_t heads_at_once = 1) {
    const int64_t group = dims.num_q_heads / dims.num_kv_heads;
    query_blocks.clear();
    block_base.assign(tasks.size(), 0);
    int64_t packed_index = 0;
    for (std::size_t ti = 0; ti < tasks.size(); ++ti) {
      const AttnTask& t = tasks[ti];
      block_base[ti] = packed_index;
      const int64_t nb = num_query_blocks(t);
      for (int64_t h = 0; h < dims.num_q_heads;) {
        const int64_t heads = std::min(heads_at_once, group - h % group);
        for (int64_t qb = 0; qb < nb; ++qb) {
          const int64_t q0 = qb * kBlockQ;
          query_blocks.push_back({static_cast<int64_t>(ti), h, q0, std::min(kBlockQ, t.q_len - q0),
                                  packed_index + h * nb + qb, heads});
        }
        h += heads;
      }
      packed_index += nb * dims.num_q_heads;
    }
    auto cost = [&](const cpu_detail::QueryBlock& b) {
      const AttnTask& t = tasks[b.task];
      return (t.is_causal ? t.kv_len - t.q_len + b.q0 + b.rows : t.kv_len) * b.heads;
    };
    // A total order (cost, then position), so the list never depends on the sort's stability
    // and std::sort needs no temporary buffer.
    std::sort(query_blocks.begin(), query_blocks.end(), [&](const auto& a, const auto& b) {
      const int64_t ca = cost(a), cb = cost(b);
      if (ca != cb) return ca > cb;
      return a.packed < b.packed;
    });
    return packed_index;
  }

  // The backward's work: the segments (unions of tasks whose key ranges overlap: their dK/dV
  // rows are sums over all of them) and one unit per (KV head, segment), or per (query head,
  // segment) where GQA would leave too few units to share out. A split segment's heads write
  // partial dK/dV sums, which reduce_partials adds in head order. Every choice depends on the
  // problem alone, never on the thread count, so results are bit-identical for any thread count.
  int64_t build_units(const AttnDims& dims, std::span<const AttnTask> tasks, float scale,
                      float* dk, float* dv) {
    const int64_t n_tasks = static_cast<int64_t>(tasks.size());
    const int64_t D = dims.head_dim;
    const int64_t group = dims.num_q_heads / dims.num_kv_heads;
    // Tasks that read keys, by (first key row, index); merged into segments.
    segment_tasks.clear();
    for (int64_t i = 0; i < n_tasks; ++i)
      if (tasks[i].q_len > 0 && tasks[i].kv_len > 0) segment_tasks.push_back(i);
    std::sort(segment_tasks.begin(), segment_tasks.end(), [&](int64_t a, int64_t b) {
      if (tasks[a].kv_offset != tasks[b].kv_offset) return tasks[a].kv_offset < tasks[b].kv_offset;
      return a < b;
    });
    segments.clear();
    segment_of.assign(tasks.size(), -1);
    for (int64_t i : segment_tasks) {
      const AttnTask& t = tasks[i];
      if (segments.empty() || t.kv_offset >= segments.back().r1) {
        segments.push_back({t.kv_offset, t.kv_offset + t.kv_len, 0, 0, 0});
      }
      Segment& g = segments.back();
      g.r1 = std::max(g.r1, t.kv_offset + t.kv_len);
      g.work += t.is_causal ? t.q_len * (t.kv_len - t.q_len) + t.q_len * (t.q_len + 1) / 2
                            : t.q_len * t.kv_len;
      segment_of[i] = static_cast<int64_t>(segments.size()) - 1;
    }
    // Each segment's tasks in task order.
    std::sort(segment_tasks.begin(), segment_tasks.end(), [&](int64_t a, int64_t b) {
      if (segment_of[a] != segment_of[b]) return segment_of[a] < segment_of[b];
      return a < b;
    });
    for (std::size_t i = 0; i < segment_tasks.size(); ++i) {
      Segment& g = segments[segment_of[segment_tasks[i]]];
      if (i == 0 || segment_of[segment_tasks[i - 1]] != segment_of[segment_tasks[i]]) {
        g.begin = static_cast<int64_t>(i);
      }
      g.end = static_cast<int64_t>(i) + 1;
    }
    // Split by query head: a GQA segment with more than 1/kSplitShare of the work (as one unit
    // per KV head it would cap the speed-up of kSplitShare threads), in key order, while the
    // partial sums (dK and dV of every query head over its rows) fit in kPartialBudget floats.
    // Smaller segments are enough units by themselves and skip the partial sums' traffic.
    int64_t partial_floats = 0;
    if (group > 1) {
      int64_t total_work = 0;
      for (const Segment& g : segments) total_work += g.work;
      for (Segment& g : segments) {
        if (g.work * kSplitShare <= total_work) continue;
        const int64_t need = 2 * dims.num_q_heads * (g.r1 - g.r0) * D;
        if (partial_floats + need > kPartialBudget) break;
        g.partial = partial_floats;
        partial_floats += need;
      }
    }
    float* part = partial_floats > 0 ? partial.get(partial_floats) : nullptr;
    const int64_t kv_stride = dims.num_kv_heads * D;
    units.clear();
    unit_work.clear();
    reduce_blocks.clear();
    for (std::size_t si = 0; si < segments.size(); ++si) {
      const Segment& g = segments[si];
      const int64_t rows = g.r1 - g.r0;
      for (int64_t hk = 0; hk < dims.num_kv_heads; ++hk) {
        cpu_detail::BwdUnit u;
        u.kv_head = hk;
        u.r0 = g.r0;
        u.r1 = g.r1;
        u.tasks = segment_tasks.data() + g.begin;
        u.num_tasks = g.end - g.begin;
        if (g.partial < 0) {
          u.h0 = hk * group;
          u.h1 = (hk + 1) * group;
          u.dk = dk + g.r0 * kv_stride + hk * D;
          u.dv = dv + g.r0 * kv_stride + hk * D;
          u.stride = kv_stride;
          u.dk_scale = scale;
          units.push_back(u);
          unit_work.push_back(g.work * group);
          continue;
        }
        for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          u.h0 = h;
          u.h1 = h + 1;
          u.dk = part + g.partial + h * rows * D;
          u.dv = part + g.partial + (dims.num_q_heads + h) * rows * D;
          u.stride = D;
          u.dk_scale = 1.0f;
          units.push_back(u);
          unit_work.push_back(g.work);
        }
        for (int64_t r0 = g.r0; r0 < g.r1; r0 += cpu_detail::kBlockK) {
          reduce_blocks.push_back({static_cast<int64_t>(si), hk, r0, std::min(g.r1, r0 + kBlockK)});
        }
      }
    }
    // The heaviest units first, so that dynamic scheduling finishes evenly.
    unit_order.resize(units.size());
    for (std::size_t i = 0; i < units.size(); ++i) unit_order[i] = static_cast<int64_t>(i);
    std::sort(unit_order.begin(), unit_order.end(), [&](int64_t a, int64_t b) {
      if (unit_work[a] != unit_work[b]) return unit_work[a] > unit_work[b];
      return a < b;
    });
    return partial_floats;
  }

  // dK/dV rows of the split segments: the sum of the query heads' partial sums, in head order.
  void reduce_partials(const AttnDims& dims, float scale, float* dk, float* dv) {
    const int64_t D = dims.head_dim;
    const int64_t group = dims.num_q_heads / dims.num_kv_heads;
    const int64_t kv_stride = dims.num_kv_heads * D;
    const float* part = partial.get(0);
    pool.parallel_for(static_cast<int64_t>(reduce_blocks.size()), [&](int64_t i, int) {
      const ReduceBlock& b = reduce_blocks[i];
      const Segment& g = segments[b.segment];
      const int64_t hk = b.kv_head;
      const int64_t rows = g.r1 - g.r0;
      for (int64_t r = b.r0; r < b.r1; ++r) {
        float* dk_out = dk + r * kv_stride + hk * D;
        float* dv_out = dv + r * kv_stride + hk * D;
        for (int64_t d = 0; d < D; ++d) {
          float sk = 0.0f, sv = 0.0f;
          for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
            sk += part[g.partial + (h * rows + r - g.r0) * D + d];
            sv += part[g.partial + ((dims.num_q_heads + h) * rows + r - g.r0) * D + d];
          }
          dk_out[d] = sk * scale;
          dv_out[d] = sv;
        }
      }
    });
  }

  cpu_detail::Problem problem(const AttnDims& dims, std::optional<float> scale,
                              std::span<const AttnTask> tasks) const {
    cpu_detail::Problem p;
    p.num_q_heads = dims.num_q_heads;
    p.num_kv_heads = dims.num_kv_heads;
    p.head_dim = dims.head_dim;
    p.scale = softmax_scale(dims, scale);
    p.tasks = tasks.data();
    p.num_tasks = static_cast<int64_t>(tasks.size());
    return p;
  }
};

CpuAttention::CpuAttention(CpuAttentionOptions options)
    : state_(std::make_unique<State>(options)) {}
CpuAttention::~CpuAttention() = default;

int CpuAttention::num_threads() const { return state_->pool.num_threads(); }
std::string CpuAttention::isa() const { return state_->routines->name; }

template <typename T>
Status CpuAttention::forward(const AttnFwdParams<T>& p) {
  DISTCA_RETURN_IF_ERROR(validate(p, &state_->ranges));
  DISTCA_RETURN_IF_ERROR(check_head_dim(kernel_info("cpu"), p.dims.head_dim));  // what blocks.h instantiates
  State& s = *state_;
  const AttnDims& n = p.dims;
  const int64_t nq = n.num_q_rows * n.num_q_heads * n.head_dim;
  const int64_t nkv = n.num_kv_rows * n.num_kv_heads * n.head_dim;
  cpu_detail::Problem prob = s.problem(n, p.scale, p.tasks);
  prob.q = s.as_f32(p.q, nq, s.q32);
  prob.k = s.as_f32(p.k, nkv, s.k32);
  prob.v = s.as_f32(p.v, nkv, s.v32);
  prob.is_careful = has_non_finite(s.pool, prob.q, nq) || has_non_finite(s.pool, prob.k, nkv) ||
                    has_non_finite(s.pool, prob.v, nkv);
  float* o = s.out_f32(p.o, nq, s.o32);
  // Rows no task covers: O = 0, LSE = -inf. Covered rows are overwritten below.
  std::fill(o, o + nq, 0.0f);
  std::fill(p.lse, p.lse + n.num_q_rows * n.num_q_heads, -std::numeric_limits<float>::infinity());
  s.build_query_blocks(n, p.tasks, cpu_detail::fwd_heads_at_once(n.head_dim));
  const auto* r = s.routines;
  s.pool.parallel_for(static_cast<int64_t>(s.query_blocks.size()), [&](int64_t i, int thread) {
    r->forward(prob, s.query_blocks[i], o, p.lse, s.scratch[thread]);
    s.maybe_poll(thread);
  });
  s.store_out(o, nq, p.o);
  return Status::ok();
}

template <typename T>
Status CpuAttention::backward(const AttnBwdParams<T>& p) {
  DISTCA_RETURN_IF_ERROR(validate(p, &state_->ranges));
  DISTCA_RETURN_IF_ERROR(check_head_dim(kernel_info("cpu"), p.dims.head_dim));  // what blocks.h instantiates
  State& s = *state_;
  const AttnDims& n = p.dims;
  const int64_t D = n.head_dim;
  const int64_t nq = n.num_q_rows * n.num_q_heads * D;
  const int64_t nkv = n.num_kv_rows * n.num_kv_heads * D;
  cpu_detail::Problem prob = s.problem(n, p.scale, p.tasks);
  prob.q = s.as_f32(p.q, nq, s.q32);
  prob.k = s.as_f32(p.k, nkv, s.k32);
  prob.v = s.as_f32(p.v, nkv, s.v32);
  prob.o = s.as_f32(p.o, nq, s.o32);
  prob.d_o = s.as_f32(p.d_o, nq, s.do32);
  prob.lse = p.lse;
  // The LSE of a row without keys is -inf, a finite value here.
  prob.is_careful = has_non_finite(s.pool, prob.q, nq) || has_non_finite(s.pool, prob.k, nkv) ||
                    has_non_finite(s.pool, prob.v, nkv) || has_non_finite(s.pool, prob.o, nq) ||
                    has_non_finite(s.pool, prob.d_o, nq) ||
                    has_non_finite(s.pool, p.lse, n.num_q_rows * n.num_q_heads, /*is_neg_inf_finite=*/true);
  float* dq = s.out_f32(p.dq, nq, s.dq32);
  float* dk = s.out_f32(p.dk, nkv, s.dk32);
  float* dv = s.out_f32(p.dv, nkv, s.dv32);
  std::fill(dq, dq + nq, 0.0f);

  // 1. Pack Q^T, dO^T, LSE and rowsum(dO * O) once per query block; zero its dQ^T.
  const int64_t num_packed = s.build_query_blocks(n, p.tasks);
  float* base = s.packed.get(num_packed * (3 * D * kBlockQ + 2 * kBlockQ));
  cpu_detail::Packed pk;
  pk.qt = base;
  pk.dot = pk.qt + num_packed * D * kBlockQ;
  pk.dqt = pk.dot + num_packed * D * kBlockQ;
  pk.lse2 = pk.dqt + num_packed * D * kBlockQ;
  pk.delta = pk.lse2 + num_packed * kBlockQ;
  pk.block_base = s.block_base.data();
  const auto* r = s.routines;
  s.pool.parallel_for(static_cast<int64_t>(s.query_blocks.size()), [&](int64_t i, int thread) {
    r->backward_pack(prob, s.query_blocks[i], pk);
    s.maybe_poll(thread);
  });
  // 2. dK, dV and dQ^T together, one unit (a segment's key rows, a KV or query head) per item:
  //    P and dS are computed once for the three gradients.
  const int64_t partial_floats = s.build_units(n, p.tasks, prob.scale, dk, dv);
  // Key rows outside every segment (no task reads them) get zeros; the units write the others,
  // so a call whose tasks read every key row (distca.torch's server layout) writes them once.
  const int64_t row_floats = n.num_kv_heads * D;
  int64_t next_row = 0;
  for (const auto& g : s.segments) {
    std::fill(dk + next_row * row_floats, dk + g.r0 * row_floats, 0.0f);
    std::fill(dv + next_row * row_floats, dv + g.r0 * row_floats, 0.0f);
    next_row = g.r1;
  }
  std::fill(dk + next_row * row_floats, dk + nkv, 0.0f);
  std::fill(dv + next_row * row_floats, dv + nkv, 0.0f);
  s.pool.parallel_for(static_cast<int64_t>(s.units.size()), [&](int64_t i, int thread) {
    r->backward_unit(prob, s.units[s.unit_order[i]], pk, s.scratch[thread]);
    s.maybe_poll(thread);
  });
  if (partial_floats > 0) s.reduce_partials(n, prob.scale, dk, dv);
  // 3. dQ rows from dQ^T.
  s.pool.parallel_for(static_cast<int64_t>(s.query_blocks.size()), [&](int64_t i, int thread) {
    r->backward_store_dq(prob, s.query_blocks[i], pk, dq);
    s.maybe_poll(thread);
  });
  s.store_out(dq, nq, p.dq);
  s.store_out(dk, nkv, p.dk);
  s.store_out(dv, nkv, p.dv);
  return Status::ok();
}

template Status CpuAttention::forward(const AttnFwdParams<float>&);
template Status CpuAttention::forward(const AttnFwdParams<bf16>&);
template Status CpuAttention::backward(const AttnBwdParams<float>&);
template Status CpuAttention::backward(const AttnBwdParams<bf16>&);

}  // namespace distca::kernels
