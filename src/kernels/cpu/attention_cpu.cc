// The driver of the CPU attention: validates, converts bf16 to fp32 working copies, builds the
// work lists, runs the block routines (isa.h) on the thread pool and converts results back.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "distca/core/log.h"
#include "distca/core/thread_pool.h"
#include "distca/kernels/cpu.h"
#include "isa.h"

namespace distca::kernels {

using cpu_detail::kBlockK;
using cpu_detail::kBlockQ;

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

}  // namespace

struct CpuAttention::State {
  explicit State(const CpuAttentionOptions& options)
      : pool(options.num_threads),
        routines(&cpu_detail::best_routines(options.is_portable)) {
    scratch_buffers.resize(pool.num_threads());
    scratch.resize(pool.num_threads());
    for (int t = 0; t < pool.num_threads(); ++t) {
      float* base = scratch_buffers[t].get(6 * cpu_detail::kScratchFloats);
      const int64_t n = cpu_detail::kScratchFloats;
      scratch[t] = {base, base + n, base + 2 * n, base + 3 * n, base + 4 * n, base + 5 * n};
    }
  }

  ThreadPool pool;
  const cpu_detail::BlockRoutines* routines;
  std::vector<Buffer> scratch_buffers;
  std::vector<cpu_detail::Scratch> scratch;
  // Working copies (bf16 inputs as fp32, fp32 outputs before rounding to bf16) and packs.
  Buffer q32, k32, v32, o32, do32, lse_out, dq32, dk32, dv32, packed;
  std::vector<cpu_detail::QueryBlock> query_blocks;
  std::vector<cpu_detail::KvBlock> kv_blocks;
  std::vector<int64_t> block_base;
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
  int64_t build_query_blocks(const AttnDims& dims, std::span<const AttnTask> tasks) {
    query_blocks.clear();
    block_base.assign(tasks.size(), 0);
    int64_t packed_index = 0;
    for (std::size_t ti = 0; ti < tasks.size(); ++ti) {
      const AttnTask& t = tasks[ti];
      block_base[ti] = packed_index;
      const int64_t nb = num_query_blocks(t);
      for (int64_t h = 0; h < dims.num_q_heads; ++h) {
        for (int64_t qb = 0; qb < nb; ++qb) {
          const int64_t q0 = qb * kBlockQ;
          query_blocks.push_back({static_cast<int64_t>(ti), h, q0, std::min(kBlockQ, t.q_len - q0),
                                  packed_index + h * nb + qb});
        }
      }
      packed_index += nb * dims.num_q_heads;
    }
    auto cost = [&](const cpu_detail::QueryBlock& b) {
      const AttnTask& t = tasks[b.task];
      return t.is_causal ? t.kv_len - t.q_len + b.q0 + b.rows : t.kv_len;
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

namespace {
Status check_head_dim(const AttnDims& dims) {
  if (!cpu_detail::supports_head_dim(dims.head_dim)) {
    return invalid_argument(fmt::format(
        "the CPU attention kernels are built for head dims 32, 64, 128 and 256, got D = {}",
        dims.head_dim));
  }
  return Status::ok();
}
}  // namespace

template <typename T>
Status CpuAttention::forward(const AttnFwdParams<T>& p) {
  DISTCA_RETURN_IF_ERROR(validate(p, &state_->ranges));
  DISTCA_RETURN_IF_ERROR(check_head_dim(p.dims));
  State& s = *state_;
  const AttnDims& n = p.dims;
  const int64_t nq = n.num_q_rows * n.num_q_heads * n.head_dim;
  const int64_t nkv = n.num_kv_rows * n.num_kv_heads * n.head_dim;
  cpu_detail::Problem prob = s.problem(n, p.scale, p.tasks);
  prob.q = s.as_f32(p.q, nq, s.q32);
  prob.k = s.as_f32(p.k, nkv, s.k32);
  prob.v = s.as_f32(p.v, nkv, s.v32);
  float* o = s.out_f32(p.o, nq, s.o32);
  // Rows no task covers: O = 0, LSE = -inf. Covered rows are overwritten below.
  std::fill(o, o + nq, 0.0f);
  std::fill(p.lse, p.lse + n.num_q_rows * n.num_q_heads, -std::numeric_limits<float>::infinity());
  s.build_query_blocks(n, p.tasks);
  const auto* r = s.routines;
  s.pool.parallel_for(static_cast<int64_t>(s.query_blocks.size()), [&](int64_t i, int thread) {
    r->forward(prob, s.query_blocks[i], o, p.lse, s.scratch[thread]);
  });
  s.store_out(o, nq, p.o);
  return Status::ok();
}

template <typename T>
Status CpuAttention::backward(const AttnBwdParams<T>& p) {
  DISTCA_RETURN_IF_ERROR(validate(p, &state_->ranges));
  DISTCA_RETURN_IF_ERROR(check_head_dim(p.dims));
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
  float* dq = s.out_f32(p.dq, nq, s.dq32);
  float* dk = s.out_f32(p.dk, nkv, s.dk32);
  float* dv = s.out_f32(p.dv, nkv, s.dv32);
  std::fill(dq, dq + nq, 0.0f);

  // 1. Pack Q^T, dO^T, LSE and rowsum(dO * O) once per query block.
  const int64_t num_packed = s.build_query_blocks(n, p.tasks);
  float* base = s.packed.get(num_packed * (2 * D * kBlockQ + 2 * kBlockQ));
  cpu_detail::Packed pk;
  pk.qt = base;
  pk.dot = pk.qt + num_packed * D * kBlockQ;
  pk.lse2 = pk.dot + num_packed * D * kBlockQ;
  pk.delta = pk.lse2 + num_packed * kBlockQ;
  pk.block_base = s.block_base.data();
  const auto* r = s.routines;
  s.pool.parallel_for(static_cast<int64_t>(s.query_blocks.size()),
                      [&](int64_t i, int) { r->backward_pack(prob, s.query_blocks[i], pk); });
  // 2. dQ, one query block per item.
  s.pool.parallel_for(static_cast<int64_t>(s.query_blocks.size()), [&](int64_t i, int thread) {
    r->backward_dq(prob, s.query_blocks[i], pk, dq, s.scratch[thread]);
  });
  // 3. dK, dV, one block of K/V rows per item; every row is written (zeros where unread).
  s.kv_blocks.clear();
  for (int64_t hk = 0; hk < n.num_kv_heads; ++hk) {
    for (int64_t r0 = 0; r0 < n.num_kv_rows; r0 += kBlockK) {
      s.kv_blocks.push_back({hk, r0, std::min(n.num_kv_rows, r0 + kBlockK)});
    }
  }
  s.pool.parallel_for(static_cast<int64_t>(s.kv_blocks.size()), [&](int64_t i, int thread) {
    r->backward_dkdv(prob, s.kv_blocks[i], pk, dk, dv, s.scratch[thread]);
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
