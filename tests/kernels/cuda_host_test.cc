// The CUDA tile algorithms, tested without a GPU: the sm_80 ones (flash_fwd.cuh, flash_bwd.cuh)
// and the sm_90a ones (hopper_fwd.cuh, hopper_bwd.cuh, hopper_bwd_dq.cuh), compiled as host C++,
// run block by block on the host warp emulator (cuda_emu.h), whose mma/ldmatrix/shuffle move data
// by the PTX fragment layouts, against the plain-loop reference. Tolerances follow from the storage
// type's rounding (eps = 2^-8 for bf16, 2^-11 for fp16), as each test says.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <random>
#include <vector>

#include "../../src/kernels/cuda/common/schedule.h"
#include "../../src/kernels/cuda/sm80/flash_bwd.cuh"
#include "../../src/kernels/cuda/sm80/flash_fwd.cuh"
#include "../../src/kernels/cuda/sm90/hopper_bwd.cuh"
#include "../../src/kernels/cuda/sm90/hopper_bwd_dq.cuh"
#include "../../src/kernels/cuda/sm90/hopper_fwd.cuh"
#include "cuda_emu.h"
#include "distca/kernels/cuda.h"
#include "distca/kernels/ref.h"
#include "test_util.h"

namespace distca::kernels {
namespace {

using cuda::Bf16;
using cuda::Fp16;

// ---- the tile algorithms on the emulator --------------------------------------------------

template <typename Elt>
constexpr double kEps = std::is_same_v<Elt, Bf16> ? 1.0 / 256 : 1.0 / 2048;  // unit roundoff x 2

template <typename Elt>
uint16_t to_bits(float x) {
  return static_cast<uint16_t>(cuda::pack2(x, 0.f, Elt{}) & 0xffffu);
}

// Random values stored in the 16-bit type, with their exact float values beside them.
template <typename Elt>
struct Stored {
  std::vector<uint16_t> bits;
  std::vector<float> values;
};
template <typename Elt>
Stored<Elt> random_stored(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<float> dist(0.f, 1.f);
  Stored<Elt> s;
  s.bits.resize(static_cast<size_t>(n));
  s.values.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    s.bits[static_cast<size_t>(i)] = to_bits<Elt>(dist(rng));
    s.values[static_cast<size_t>(i)] = cuda::to_float(s.bits[static_cast<size_t>(i)], Elt{});
  }
  return s;
}

// Shared memory of one block, filled with 0xff (a NaN in both types) before each block, so a read
// of something the block did not load shows up in its results.
struct Smem {
  explicit Smem(int bytes) : words(static_cast<size_t>(bytes + 15) / 8) {}
  char* fresh() {
    std::memset(words.data(), 0xff, words.size() * 8);
    return reinterpret_cast<char*>(words.data());
  }
  std::vector<uint64_t> words;
};

struct Problem {
  AttnDims dims;
  std::vector<AttnTask> tasks;
};

// Documents cut into shards sharing K/V (lengths 1, primes, a full tile, several tiles), a
// non-causal key-split piece of a document against an earlier key range, a non-causal task with
// no keys, uncovered Q rows, and GQA 2:1.
Problem mixed_problem(int64_t head_dim, std::vector<int64_t> docs = {1, 37, 64, 131}, int64_t num_q_heads = 2) {
  std::mt19937_64 rng(7);
  testing::TaskSet set = testing::shard_documents(rng, docs, 70, num_q_heads, 1, head_dim, 3);
  Problem p{set.dims, set.tasks};
  // A key-split piece: 20 new query rows against the first 64 keys of the 131-token document,
  // and a task with no keys.
  const int64_t doc_start = 1 + 37 + 64;
  p.tasks.push_back({p.dims.num_q_rows, 20, doc_start, 64, false});
  p.tasks.push_back({p.dims.num_q_rows + 20, 3, 0, 0, false});
  p.dims.num_q_rows += 23 + 5;  // and 5 uncovered rows at the end
  return p;
}

// What launch_fill_rows does before a forward: O = 0 and LSE = -inf on the rows no task covers.
void fill_uncovered_rows(const Problem& pr, int64_t head_dim, uint16_t* o, float* lse) {
  const int64_t row_elems = pr.dims.num_q_heads * head_dim, heads = pr.dims.num_q_heads;
  for (const auto& [begin, end] : cuda::uncovered_rows(pr.dims.num_q_rows, pr.tasks)) {
    std::fill(o + begin * row_elems, o + end * row_elems, uint16_t{0});
    std::fill(lse + begin * heads, lse + end * heads, -std::numeric_limits<float>::infinity());
  }
}

// The fields the sm_80 and sm_90a forward kernels' parameters share.
template <typename Params>
void set_forward_outputs(Params& p, const Problem& pr, uint16_t* o, float* lse, const std::vector<cuda::FwdItem>& items,
                         float scale) {
  p.o = o;
  p.lse = lse;
  p.items = items.data();
  p.num_items = static_cast<int64_t>(items.size());
  p.num_q_heads = static_cast<int>(pr.dims.num_q_heads);
  p.num_kv_heads = static_cast<int>(pr.dims.num_kv_heads);
  p.scale_log2 = scale * 1.4426950408889634f;
}

template <int D, typename Elt>
void emulate_forward(const Problem& pr, const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* o, float* lse,
                     float scale) {
  const std::vector<cuda::FwdItem> items = cuda::fwd_schedule(pr.tasks, kCudaFwdBlockM);
  fill_uncovered_rows(pr, D, o, lse);
  cuda::FwdKernelParams p;
  p.q = q;
  p.k = k;
  p.v = v;
  set_forward_outputs(p, pr, o, lse, items, scale);
  Smem smem(cuda::FwdShape<D>::kSmemBytes);
  for (int64_t b = 0; b < p.num_items * p.num_q_heads; ++b) {
    char* s = smem.fresh();
    const std::string error = cuda::emu::run_block(b, kCudaThreads, [&] { cuda::fwd_block<D, Elt>(p, s); });
    ASSERT_EQ(error, "") << "block " << b;
  }
}

// The emulator's TMA descriptor of a 2-D view [rows, cols] of a packed tensor, boxes of 64 x box_rows,
// 128-byte swizzle (what sm90/launch.cu encodes on a GPU).
cuda::TmaDesc tma_view(const uint16_t* base, int64_t rows, int64_t cols, int box_rows) {
  cuda::TmaBox b;
  b.global = base;
  b.dim_x = cols;
  b.dim_y = rows;
  b.row_stride_bytes = cols * 2;
  b.box_x = 64;
  b.box_y = box_rows;
  b.swizzle = cuda::Swizzle::k128B;
  return cuda::make_tma_desc(b);
}

// Runs an emulated sm_90a block the way item `work` asks (hopper.cuh): even items with TMA copies
// at the wait, odd ones at issue; every fourth from 1 with the lowest thread first (slower: many
// more fiber switches), the others in turn. A race either way (a read before a wait, a stage reused
// too early, a missing barrier) shows.
std::string run_adversarially(int64_t work, const std::function<std::string()>& run) {
  cuda::emu::set_tma_timing(work % 2 ? cuda::emu::TmaTiming::kEarliest : cuda::emu::TmaTiming::kLatest);
  cuda::emu::set_schedule(work % 4 == 1 ? cuda::emu::Schedule::kLowestFirst : cuda::emu::Schedule::kRoundRobin);
  std::string error = run();
  cuda::emu::set_tma_timing(cuda::emu::TmaTiming::kLatest);
  cuda::emu::set_schedule(cuda::emu::Schedule::kRoundRobin);
  return error;
}

// The same problem through the sm_90a tile algorithm (hopper_fwd.cuh): 128-row items, TMA views
// of [rows, heads x D] with 64 x 128 boxes, 128-byte swizzle, one emulated block of 384 threads each.
// Runs `works` emulated sm_90a blocks of `threads` threads, each on fresh, 1024-byte-aligned shared
// memory of `smem_bytes` (run_adversarially's schedules), as the persistent grid's items; block(s,
// work) is the tile algorithm. Returns the first error, naming its item, or "".
std::string run_hopper_blocks(int64_t works, int threads, int smem_bytes,
                              const std::function<void(char*, int64_t)>& block) {
  Smem smem(smem_bytes + 1024);
  for (int64_t work = 0; work < works; ++work) {
    char* raw = smem.fresh();
    char* s = raw + (1024 - reinterpret_cast<uintptr_t>(raw) % 1024) % 1024;
    const std::string error = run_adversarially(
        work, [&] { return cuda::emu::run_block(work, threads, [&] { block(s, work); }, s, smem_bytes); });
    if (!error.empty()) return "work item " + std::to_string(work) + ": " + error;
  }
  return "";
}

template <int D, typename Elt>
void emulate_forward_hopper(const Problem& pr, const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* o,
                            float* lse, float scale) {
  using Shape = cuda::HopperFwdShape<D>;
  const std::vector<cuda::FwdItem> items = cuda::fwd_schedule(pr.tasks, Shape::kBlockM);
  fill_uncovered_rows(pr, D, o, lse);
  auto view = [](const uint16_t* base, int64_t rows, int64_t heads) { return tma_view(base, rows, heads * D, 128); };
  cuda::HopperFwdParams p;
  p.q_desc = view(q, pr.dims.num_q_rows, pr.dims.num_q_heads);
  p.k_desc = view(k, pr.dims.num_kv_rows, pr.dims.num_kv_heads);
  p.v_desc = view(v, pr.dims.num_kv_rows, pr.dims.num_kv_heads);
  set_forward_outputs(p, pr, o, lse, items, scale);
  ASSERT_EQ(run_hopper_blocks(p.num_items * p.num_q_heads, Shape::kThreads, Shape::kSmemBytes,
                              [&](char* s, int64_t work) { cuda::hopper_fwd_block<D, Elt>(p, s, work); }),
            "");
}

template <int D, typename Elt, bool kHopper = false>
void check_forward() {
  // The sm_90a kernel's tiles are 128 keys: a 400-token document takes its two-stage ring round
  // twice.
  const Problem pr = kHopper ? mixed_problem(D, {1, 37, 64, 131, 400}) : mixed_problem(D);
  const AttnDims& d = pr.dims;
  std::mt19937_64 rng(11);
  const auto q = random_stored<Elt>(rng, d.num_q_rows * d.num_q_heads * D);
  const auto k = random_stored<Elt>(rng, d.num_kv_rows * d.num_kv_heads * D);
  const auto v = random_stored<Elt>(rng, d.num_kv_rows * d.num_kv_heads * D);
  const float scale = softmax_scale(d, std::nullopt);

  std::vector<uint16_t> o(q.bits.size(), 0x7fff);  // NaN: every element must be written
  std::vector<float> lse(static_cast<size_t>(d.num_q_rows * d.num_q_heads), std::nanf(""));
  if constexpr (kHopper) {
    emulate_forward_hopper<D, Elt>(pr, q.bits.data(), k.bits.data(), v.bits.data(), o.data(), lse.data(), scale);
  } else {
    emulate_forward<D, Elt>(pr, q.bits.data(), k.bits.data(), v.bits.data(), o.data(), lse.data(), scale);
  }

  std::vector<float> o_ref(q.bits.size()), lse_ref(lse.size());
  AttnFwdParams<float> rp;
  rp.dims = d;
  rp.q = q.values.data();
  rp.k = k.values.data();
  rp.v = v.values.data();
  rp.tasks = pr.tasks;
  rp.o = o_ref.data();
  rp.lse = lse_ref.data();
  ASSERT_TRUE(ref::attention_forward(rp).is_ok());

  // O = sum_j p_j v_j / l: P rounded to the storage type (eps/2 relative each) and O rounded once
  // (eps/2 relative) bound the error by eps max|v|.
  const double max_v = testing::max_abs(v.values);
  const double tol_o = kEps<Elt> * max_v;
  double worst_o = 0, worst_lse = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    const double x = cuda::to_float(o[i], Elt{});
    ASSERT_TRUE(std::isfinite(x)) << "O element " << i << " not written or not finite";
    worst_o = std::max(worst_o, std::abs(x - o_ref[i]));
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(lse_ref[i])) {
      ASSERT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "LSE " << i << " should be -inf, is " << lse[i];
      continue;
    }
    ASSERT_TRUE(std::isfinite(lse[i])) << "LSE " << i;
    // Scores are sums of exact products in fp32: relative error ~ D 2^-24, far below 1e-5.
    worst_lse = std::max(worst_lse, std::abs(static_cast<double>(lse[i]) - lse_ref[i]) / (1 + std::abs(lse_ref[i])));
  }
  EXPECT_LE(worst_o, tol_o) << "max |O - ref| with tolerance eps max|v|";
  EXPECT_LE(worst_lse, 1e-5);
  EXPECT_GT(worst_o, 0) << "the comparison compared something";
}

TEST(CudaTileEmulated, ForwardMatchesTheReferenceBf16D64) { check_forward<64, Bf16>(); }
TEST(CudaTileEmulated, ForwardMatchesTheReferenceBf16D128) { check_forward<128, Bf16>(); }
TEST(CudaTileEmulated, ForwardMatchesTheReferenceFp16D64) { check_forward<64, Fp16>(); }
TEST(HopperTileEmulated, ForwardMatchesTheReferenceBf16D64) { check_forward<64, Bf16, true>(); }
TEST(HopperTileEmulated, ForwardMatchesTheReferenceBf16D128) { check_forward<128, Bf16, true>(); }

// Per-element error bounds of the backward: the sums of |terms| whose factors the kernel rounds
// to the storage type (P for dV, dS for dK and dQ), in double.
struct GradBounds {
  std::vector<double> dq, dk, dv;
};
GradBounds grad_bounds(const Problem& pr, const std::vector<float>& q, const std::vector<float>& k,
                       const std::vector<float>& v, const std::vector<float>& d_o, const std::vector<float>& o,
                       const std::vector<float>& lse, float scale) {
  const AttnDims& d = pr.dims;
  const int64_t D = d.head_dim, hq = d.num_q_heads, hkv = d.num_kv_heads, group = hq / hkv;
  GradBounds b{std::vector<double>(q.size()), std::vector<double>(k.size()), std::vector<double>(v.size())};
  for (const AttnTask& t : pr.tasks) {
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < t.q_len; ++i) {
        const int64_t qi = ((t.q_offset + i) * hq + h) * D;
        double delta = 0;
        for (int64_t x = 0; x < D; ++x) delta += static_cast<double>(d_o[qi + x]) * o[qi + x];
        const int64_t last = t.is_causal ? i + t.kv_len - t.q_len : t.kv_len - 1;
        for (int64_t j = 0; j <= last; ++j) {
          const int64_t kj = ((t.kv_offset + j) * hkv + hk) * D;
          double s = 0, dp = 0;
          for (int64_t x = 0; x < D; ++x) {
            s += static_cast<double>(q[qi + x]) * k[kj + x];
            dp += static_cast<double>(d_o[qi + x]) * v[kj + x];
          }
          const double p = std::exp(s * scale - lse[static_cast<size_t>((t.q_offset + i) * hq + h)]);
          const double ds = std::abs(p * (dp - delta));
          for (int64_t x = 0; x < D; ++x) {
            b.dv[kj + x] += p * std::abs(d_o[qi + x]);
            b.dk[kj + x] += scale * ds * std::abs(q[qi + x]);
            b.dq[qi + x] += scale * ds * std::abs(k[kj + x]);
          }
        }
      }
    }
  }
  return b;
}

// The backward through the sm_90a tile algorithm (hopper_bwd.cuh): K/V tiles from
// kv_tile_schedule, the sm_80 kernel's sums, TMA views with 64 x 64 boxes, one emulated block of 256
// threads a tile and K/V head.
template <int D, typename Elt>
void emulate_backward_hopper(const Problem& pr, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                             const uint16_t* d_o, const std::vector<float>& lse, const std::vector<float>& delta,
                             std::vector<float>& dq_acc, std::vector<float>& dk_acc, std::vector<float>& dv_acc,
                             float scale, bool dq_pass) {
  const cuda::KvTileSchedule schedule = cuda::kv_tile_schedule(pr.tasks, cuda::HopperBwdShape<D>::kBlockN);
  using Shape = cuda::HopperBwdShape<D>;
  auto view = [](const uint16_t* base, int64_t rows, int64_t heads) { return tma_view(base, rows, heads * D, 64); };
  cuda::HopperBwdParams p;
  p.q_desc = view(q, pr.dims.num_q_rows, pr.dims.num_q_heads);
  p.do_desc = view(d_o, pr.dims.num_q_rows, pr.dims.num_q_heads);
  p.k_desc = view(k, pr.dims.num_kv_rows, pr.dims.num_kv_heads);
  p.v_desc = view(v, pr.dims.num_kv_rows, pr.dims.num_kv_heads);
  p.lse = lse.data();
  p.delta = delta.data();
  p.dq_acc = dq_pass ? nullptr : dq_acc.data();
  p.dk_acc = dk_acc.data();
  p.dv_acc = dv_acc.data();
  p.items = schedule.items.data();
  p.entries = schedule.entries.data();
  p.num_items = static_cast<int64_t>(schedule.items.size());
  p.num_q_heads = static_cast<int>(pr.dims.num_q_heads);
  p.num_kv_heads = static_cast<int>(pr.dims.num_kv_heads);
  p.scale_log2 = scale * 1.4426950408889634f;
  ASSERT_EQ(run_hopper_blocks(p.num_items * p.num_kv_heads, Shape::kThreads, Shape::kSmemBytes,
                              [&](char* s, int64_t work) {
                                if (dq_pass) {
                                  cuda::hopper_bwd_block<D, Elt, false>(p, s, work);
                                } else {
                                  cuda::hopper_bwd_block<D, Elt>(p, s, work);
                                }
                              }),
            "");
  if (!dq_pass) return;
  // dQ in its own pass: 64-row query tiles, one block a tile and query head.
  using DqShape = cuda::HopperBwdDqShape<D>;
  const std::vector<cuda::FwdItem> items = cuda::fwd_schedule(pr.tasks, DqShape::kBlockM);
  cuda::HopperBwdDqParams dp;
  dp.q_desc = p.q_desc;
  dp.do_desc = p.do_desc;
  dp.k_desc = p.k_desc;
  dp.v_desc = p.v_desc;
  dp.lse = lse.data();
  dp.delta = delta.data();
  dp.dq_acc = dq_acc.data();
  dp.items = items.data();
  dp.num_items = static_cast<int64_t>(items.size());
  dp.num_q_heads = p.num_q_heads;
  dp.num_kv_heads = p.num_kv_heads;
  dp.scale_log2 = p.scale_log2;
  ASSERT_EQ(run_hopper_blocks(dp.num_items * dp.num_q_heads, DqShape::kThreads, DqShape::kSmemBytes,
                              [&](char* s, int64_t work) { cuda::hopper_bwd_dq_block<D, Elt>(dp, s, work); }),
            "") << "the dQ pass";
}

template <int D, typename Elt, bool kHopper = false>
void check_backward(int64_t num_q_heads = 2, bool dq_pass = false) {
  // The sm_90a kernel walks queries 64 at a time through a two-stage ring, over K/V tiles that
  // several tasks read, and every query head of a K/V head's group (GQA 2:1, and 4:1 below).
  Problem pr = mixed_problem(D, {1, 37, 64, 131}, num_q_heads);
  if (kHopper) {
    // A 300-token document in shards of 77 rows sharing its K/V (a tile read by up to 4 shards, the
    // ring taken round many times), and a causal key-split piece of 30 queries over its keys 50..249
    // (its tiles start inside the document's).
    const int64_t doc = pr.dims.num_kv_rows;
    for (int64_t at = 0; at < 300; at += 77) {
      const int64_t rows = std::min<int64_t>(77, 300 - at);
      pr.tasks.push_back({pr.dims.num_q_rows, rows, doc, at + rows, true});
      pr.dims.num_q_rows += rows;
    }
    pr.tasks.push_back({pr.dims.num_q_rows, 30, doc + 50, 200, true});
    pr.dims.num_q_rows += 30;
    pr.dims.num_kv_rows += 300;
  }
  const AttnDims& d = pr.dims;
  std::mt19937_64 rng(13);
  const auto q = random_stored<Elt>(rng, d.num_q_rows * d.num_q_heads * D);
  const auto k = random_stored<Elt>(rng, d.num_kv_rows * d.num_kv_heads * D);
  const auto v = random_stored<Elt>(rng, d.num_kv_rows * d.num_kv_heads * D);
  const auto d_o = random_stored<Elt>(rng, d.num_q_rows * d.num_q_heads * D);
  const float scale = softmax_scale(d, std::nullopt);

  // The forward's O and LSE from the reference, O rounded to the storage type as a kernel has it.
  std::vector<float> o_ref(q.values.size()), lse(static_cast<size_t>(d.num_q_rows * d.num_q_heads));
  AttnFwdParams<float> fp;
  fp.dims = d;
  fp.q = q.values.data();
  fp.k = k.values.data();
  fp.v = v.values.data();
  fp.tasks = pr.tasks;
  fp.o = o_ref.data();
  fp.lse = lse.data();
  ASSERT_TRUE(ref::attention_forward(fp).is_ok());
  std::vector<uint16_t> o_bits(o_ref.size());
  std::vector<float> o(o_ref.size());
  for (size_t i = 0; i < o.size(); ++i) {
    o_bits[i] = to_bits<Elt>(o_ref[i]);
    o[i] = cuda::to_float(o_bits[i], Elt{});
  }

  // The launcher's steps on the host: delta (launch_delta), zeroed sums, the tile blocks, and
  // the rounding with the scale (launch_finalize).
  std::vector<float> delta(lse.size());
  for (size_t r = 0; r < delta.size(); ++r) {
    float sum = 0;
    for (int64_t x = 0; x < D; ++x) sum += d_o.values[r * D + static_cast<size_t>(x)] * o[r * D + static_cast<size_t>(x)];
    delta[r] = sum;
  }
  std::vector<float> dq_acc(q.values.size(), 0.f), dk_acc(k.values.size(), 0.f), dv_acc(v.values.size(), 0.f);
  if constexpr (kHopper) {
    emulate_backward_hopper<D, Elt>(pr, q.bits.data(), k.bits.data(), v.bits.data(), d_o.bits.data(), lse, delta,
                                    dq_acc, dk_acc, dv_acc, scale, dq_pass);
  } else {
  const std::vector<cuda::BwdItem> items = cuda::bwd_schedule(pr.tasks, kCudaBwdBlockN);
  cuda::BwdKernelParams p;
  p.q = q.bits.data();
  p.k = k.bits.data();
  p.v = v.bits.data();
  p.d_o = d_o.bits.data();
  p.lse = lse.data();
  p.delta = delta.data();
  p.dq_acc = dq_acc.data();
  p.dk_acc = dk_acc.data();
  p.dv_acc = dv_acc.data();
  p.items = items.data();
  p.num_items = static_cast<int64_t>(items.size());
  p.num_q_heads = static_cast<int>(d.num_q_heads);
  p.num_kv_heads = static_cast<int>(d.num_kv_heads);
  p.scale_log2 = scale * 1.4426950408889634f;
  Smem smem(cuda::BwdShape<D>::kSmemBytes);
  for (int64_t b = 0; b < p.num_items * p.num_q_heads; ++b) {
    char* s = smem.fresh();
    const std::string error = cuda::emu::run_block(b, kCudaThreads, [&] { cuda::bwd_block<D, Elt>(p, s); });
    ASSERT_EQ(error, "") << "block " << b;
  }
  }
  auto rounded = [](const std::vector<float>& acc, float factor) {
    std::vector<float> out(acc.size());
    for (size_t i = 0; i < acc.size(); ++i) out[i] = cuda::to_float(to_bits<Elt>(acc[i] * factor), Elt{});
    return out;
  };
  const std::vector<float> dq = rounded(dq_acc, scale), dk = rounded(dk_acc, scale), dv = rounded(dv_acc, 1.f);

  std::vector<float> dq_ref(dq.size()), dk_ref(dk.size()), dv_ref(dv.size());
  AttnBwdParams<float> bp;
  bp.dims = d;
  bp.q = q.values.data();
  bp.k = k.values.data();
  bp.v = v.values.data();
  bp.o = o.data();
  bp.lse = lse.data();
  bp.d_o = d_o.values.data();
  bp.tasks = pr.tasks;
  bp.dq = dq_ref.data();
  bp.dk = dk_ref.data();
  bp.dv = dv_ref.data();
  ASSERT_TRUE(ref::attention_backward(bp, /*is_using_given_output=*/true).is_ok());

  // Each gradient element is a sum of products one of whose factors the kernel rounds (eps/2
  // relative), plus the final rounding (eps/2 of the value): |err| <= eps (bound + |ref|) / 2,
  // doubled for the fp32 sums and the rounded dP and delta inside dS.
  const GradBounds bounds = grad_bounds(pr, q.values, k.values, v.values, d_o.values, o, lse, scale);
  // Where dS is 0 in exact arithmetic (a row whose one key gives O = V), dP - delta is the difference
  // of two fp32 sums of D products taken in different orders: at most D 2^-24 max|dO| max|V| each,
  // times a key's or query's largest element in dQ or dK.
  const double largest_qk = std::max(testing::max_abs(k.values), testing::max_abs(q.values));
  const double floor =
      1e-6 + 2.0 * D * std::ldexp(1.0, -24) * testing::max_abs(d_o.values) * testing::max_abs(v.values) * largest_qk;
  auto check = [floor](const char* name, const std::vector<float>& got, const std::vector<float>& want,
                       const std::vector<double>& bound) {
    double worst = 0;  // the largest error as a fraction of its tolerance
    size_t at = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << name << " element " << i;
      const double tol = kEps<Elt> * (bound[i] + std::abs(want[i])) + floor;
      const double ratio = std::abs(got[i] - want[i]) / tol;
      if (ratio > worst) {
        worst = ratio;
        at = i;
      }
    }
    EXPECT_LE(worst, 1.0) << name << " element " << at << ": " << got[at] << " vs " << want[at] << " (bound "
                          << bound[at] << ")";
  };
  check("dq", dq, dq_ref, bounds.dq);
  check("dk", dk, dk_ref, bounds.dk);
  check("dv", dv, dv_ref, bounds.dv);
  EXPECT_GT(testing::max_abs(dk_ref), 0.0);
}

TEST(CudaTileEmulated, BackwardMatchesTheReferenceBf16D64) { check_backward<64, Bf16>(); }
TEST(CudaTileEmulated, BackwardMatchesTheReferenceBf16D128) { check_backward<128, Bf16>(); }
TEST(CudaTileEmulated, BackwardMatchesTheReferenceFp16D64) { check_backward<64, Fp16>(); }
TEST(HopperTileEmulated, BackwardMatchesTheReferenceBf16D64) { check_backward<64, Bf16, true>(); }
TEST(HopperTileEmulated, BackwardMatchesTheReferenceBf16D128) { check_backward<128, Bf16, true>(); }
TEST(HopperTileEmulated, BackwardMatchesTheReferenceFp16D64) { check_backward<64, Fp16, true>(); }
TEST(HopperTileEmulated, BackwardMatchesTheReferenceGqa4Bf16D64) { check_backward<64, Bf16, true>(4); }
// dQ in a pass of its own (hopper_bwd_dq.cuh) instead of the K/V blocks' atomic adds.
TEST(HopperTileEmulated, BackwardWithTheDqPassMatchesTheReferenceBf16D64) { check_backward<64, Bf16, true>(2, true); }
TEST(HopperTileEmulated, BackwardWithTheDqPassMatchesTheReferenceFp16D128) { check_backward<128, Fp16, true>(2, true); }

// The emulator itself: a barrier that not every thread reaches is an error, not a hang.
TEST(CudaTileEmulated, TheEmulatorReportsADivergentBarrier) {
  const std::string error = cuda::emu::run_block(0, 64, [] {
    if (cuda::thread_index() < 32) cuda::sync_block();
  });
  EXPECT_NE(error.find("deadlock"), std::string::npos);
}

}  // namespace
}  // namespace distca::kernels
