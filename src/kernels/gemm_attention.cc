#include "distca/kernels/gemm_attention.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/isa.h"
#include "distca/core/thread_pool.h"

namespace distca::kernels {

namespace {
constexpr int64_t kGemmBlockQ = 128;  // query rows per materialized score block
}

struct GemmAttention::State {
  explicit State(int num_threads)
      : pool(num_threads), scores(pool.num_threads()), inv_sums(pool.num_threads(), std::vector<float>(kGemmBlockQ)) {}
  ThreadPool pool;
  std::vector<std::vector<float>> scores;    // per thread: [kGemmBlockQ, keys]
  std::vector<std::vector<float>> inv_sums;  // per thread: [kGemmBlockQ]
  struct Block {
    int64_t task, head, q0, rows;
  };
  std::vector<Block> blocks;
};

GemmAttention::GemmAttention(int num_threads) : state_(std::make_unique<State>(num_threads)) {}
GemmAttention::~GemmAttention() = default;
int GemmAttention::num_threads() const { return state_->pool.num_threads(); }

Status GemmAttention::forward(const AttnFwdParams<float>& p) {
  DISTCA_RETURN_IF_ERROR(validate(p));
  State& s = *state_;
  const AttnDims& n = p.dims;
  const int64_t D = n.head_dim;
  const int64_t q_stride = n.num_q_heads * D;
  const int64_t kv_stride = n.num_kv_heads * D;
  const int64_t group = n.num_q_heads / n.num_kv_heads;
  const float scale = softmax_scale(n, p.scale);
  std::fill(p.o, p.o + n.num_q_rows * q_stride, 0.0f);
  std::fill(p.lse, p.lse + n.num_q_rows * n.num_q_heads, -std::numeric_limits<float>::infinity());
  s.blocks.clear();
  for (std::size_t ti = 0; ti < p.tasks.size(); ++ti) {
    for (int64_t h = 0; h < n.num_q_heads; ++h) {
      for (int64_t q0 = 0; q0 < p.tasks[ti].q_len; q0 += kGemmBlockQ) {
        s.blocks.push_back({static_cast<int64_t>(ti), h, q0, std::min(kGemmBlockQ, p.tasks[ti].q_len - q0)});
      }
    }
  }
  const cpu_detail::BlockRoutines& routines = cpu_detail::default_routines();
  blas_set_num_threads(1);
  s.pool.parallel_for(static_cast<int64_t>(s.blocks.size()), [&](int64_t bi, int thread) {
    const State::Block& b = s.blocks[bi];
    const AttnTask& t = p.tasks[b.task];
    const int64_t off = t.kv_len - t.q_len;
    const int64_t end = t.is_causal ? off + b.q0 + b.rows : t.kv_len;  // keys any row sees
    if (end <= 0) return;
    std::vector<float>& S = s.scores[thread];  // [rows, end]
    if (static_cast<int64_t>(S.size()) < b.rows * end) S.resize(b.rows * end);
    const float* q = p.q + (t.q_offset + b.q0) * q_stride + b.head * D;
    const int64_t hk = b.head / group;
    const float* k = p.k + t.kv_offset * kv_stride + hk * D;
    const float* v = p.v + t.kv_offset * kv_stride + hk * D;
    float* o = p.o + (t.q_offset + b.q0) * q_stride + b.head * D;
    // 1. S = scale * Q K^T over keys [0, end).
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(b.rows),
                static_cast<int>(end), static_cast<int>(D), scale, q, static_cast<int>(q_stride),
                k, static_cast<int>(kv_stride), 0.0f, S.data(), static_cast<int>(end));
    // 2. Row softmax over each row's visible keys; keys past them get probability 0.
    float* inv_sum = s.inv_sums[thread].data();
    for (int64_t i = 0; i < b.rows; ++i) {
      float* row = S.data() + i * end;
      const int64_t visible = t.is_causal ? off + b.q0 + i + 1 : t.kv_len;
      float row_max = 0, row_sum = 0;
      routines.softmax_row(row, visible, &row_max, &row_sum);
      std::fill(row + visible, row + end, 0.0f);
      inv_sum[i] = 1.0f / row_sum;
      p.lse[(t.q_offset + b.q0 + i) * n.num_q_heads + b.head] = row_max + std::log(row_sum);
    }
    // 3. O = P V, then normalize rows.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(b.rows),
                static_cast<int>(D), static_cast<int>(end), 1.0f, S.data(), static_cast<int>(end),
                v, static_cast<int>(kv_stride), 0.0f, o, static_cast<int>(q_stride));
    for (int64_t i = 0; i < b.rows; ++i)
      for (int64_t d = 0; d < D; ++d) o[i * q_stride + d] *= inv_sum[i];
  });
  return Status::ok();
}

void blas_set_num_threads(int num_threads) { openblas_set_num_threads(num_threads); }
std::string blas_core_name() { return openblas_get_corename(); }

}  // namespace distca::kernels
