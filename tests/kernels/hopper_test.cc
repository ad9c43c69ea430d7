// The sm_90a primitives (src/kernels/cuda/sm90/hopper.cuh) on the host warp emulator: swizzle and
// descriptor encodings, mbarrier phases, TMA box loads, and wgmma from shared memory (K-major and
// MN-major operands, 128-byte swizzle and none) and from registers, each against a float
// reference; then the bugs a Hopper tile algorithm can have (a wrong descriptor offset, a read
// before the mbarrier wait, shared memory overwritten before wgmma_wait, a wgmma never waited for,
// a wait on a phase that cannot complete): the emulator must make each one visible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../../src/kernels/cuda/sm90/hopper.cuh"
#include "cuda_emu.h"
#include "distca/core/bf16.h"

namespace distca::kernels::cuda {
namespace {

// A row-major matrix of bf16 values (exactly representable floats kept beside the bits).
struct Matrix {
  int rows = 0, cols = 0;
  std::vector<uint16_t> bits;
  std::vector<float> values;
  Matrix(int r, int c, uint64_t seed) : rows(r), cols(c), bits(static_cast<size_t>(r) * c), values(bits.size()) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (size_t i = 0; i < bits.size(); ++i) {
      bits[i] = distca::bf16::round_bits(u(rng));
      values[i] = to_float(bits[i], Bf16{});
    }
  }
  float at(int r, int c) const { return values[static_cast<size_t>(r) * cols + c]; }
};

// Shared memory for a block: 1024-byte aligned, filled with 0xff (stale) bytes.
struct Shared {
  explicit Shared(int64_t bytes) : raw(static_cast<size_t>(bytes) + 1024, '\xff') {
    auto p = reinterpret_cast<uintptr_t>(raw.data());
    base = raw.data() + ((1024 - p % 1024) % 1024);
    size = bytes;
  }
  std::vector<char> raw;
  char* base;
  int64_t size;
};

TmaDesc box_of(const Matrix& m, int box_x, int box_y, Swizzle s) {
  TmaBox b;
  b.global = m.bits.data();
  b.dim_x = m.cols;
  b.dim_y = m.rows;
  b.row_stride_bytes = int64_t{m.cols} * 2;
  b.box_x = box_x;
  b.box_y = box_y;
  b.swizzle = s;
  return make_tma_desc(b);
}

TEST(HopperEmulated, SwizzleXorsThe16ByteChunkWithTheRowWithin1024Bytes) {
  // 128 B: chunk c of 128-byte row r (mod 8) lands in chunk c ^ r; 64 B and 32 B use 2 and 1 bits.
  EXPECT_EQ(swizzle_address(0 * 128 + 3 * 16, Swizzle::k128B), 0u * 128 + 3 * 16);
  EXPECT_EQ(swizzle_address(5 * 128 + 3 * 16 + 7, Swizzle::k128B), 5u * 128 + (3 ^ 5) * 16 + 7);
  EXPECT_EQ(swizzle_address(1024 + 5 * 128 + 3 * 16, Swizzle::k128B), 1024u + 5 * 128 + (3 ^ 5) * 16);
  EXPECT_EQ(swizzle_address(5 * 128 + 3 * 16, Swizzle::k64B), 5u * 128 + (3 ^ 1) * 16);
  EXPECT_EQ(swizzle_address(5 * 128 + 3 * 16, Swizzle::k32B), 5u * 128 + (3 ^ 1) * 16);
  EXPECT_EQ(swizzle_address(5 * 128 + 3 * 16, Swizzle::kNone), 5u * 128 + 3 * 16);
  for (Swizzle s : {Swizzle::kNone, Swizzle::k32B, Swizzle::k64B, Swizzle::k128B}) {  // a permutation of each 1 KB
    std::vector<int> hits(1024, 0);
    for (uint32_t a = 0; a < 1024; ++a) ++hits[swizzle_address(2048 + a, s) - 2048];
    for (int h : hits) ASSERT_EQ(h, 1);
  }
}

TEST(HopperEmulated, TheMatrixDescriptorHasThePtxBitLayout) {
  EXPECT_EQ(make_smem_desc(0x400, Swizzle::k128B, 16, 1024), 0x4000004000010040ull);
  EXPECT_EQ(make_smem_desc(0x400, Swizzle::k64B, 16, 1024) >> 62, 2u);
  EXPECT_EQ(make_smem_desc(0x400, Swizzle::k32B, 16, 1024) >> 62, 3u);
  EXPECT_EQ(make_smem_desc(0x400, Swizzle::kNone, 16, 1024) >> 62, 0u);
  const emu::SmemDesc d = emu::decode_smem_desc(make_smem_desc(0x3fff0, Swizzle::k64B, 0x20, 0x3fff0));
  EXPECT_EQ(d.start, 0x3fff0u);
  EXPECT_EQ(d.lbo, 0x20u);
  EXPECT_EQ(d.sbo, 0x3fff0u);
  EXPECT_EQ(d.swizzle, Swizzle::k64B);
}

TEST(HopperEmulated, AnMbarrierCompletesAPhaseOnItsArrivalsAndItsBytes) {
  Shared shared(2048);
  std::vector<int> seen(64, -1);
  const std::string error = emu::run_block(
      0, 64,
      [&] {
        auto* bar = reinterpret_cast<uint64_t*>(shared.base);
        auto* flag = reinterpret_cast<int*>(shared.base + 64);
        const int tid = thread_index();
        if (tid == 0) {
          mbarrier_init(bar, 2);
          *flag = 0;
        }
        sync_block();
        // Phase 0: threads 0 and 1 arrive, thread 1 only after writing the flag.
        if (tid == 1) *flag = 7;
        if (tid < 2) mbarrier_arrive(bar);
        mbarrier_wait(bar, 0);
        seen[static_cast<size_t>(tid)] = *flag;
        sync_block();
        // Phase 1: parity flips.
        if (tid < 2) mbarrier_arrive(bar);
        mbarrier_wait(bar, 1);
      },
      shared.base, shared.size);
  EXPECT_EQ(error, "");
  for (int v : seen) EXPECT_EQ(v, 7) << "a thread passed the wait before the phase completed";

  // Nobody arrives: the wait is reported, not a hang.
  const std::string stuck = emu::run_block(
      0, 32,
      [&] {
        auto* bar = reinterpret_cast<uint64_t*>(shared.base);
        if (thread_index() == 0) mbarrier_init(bar, 1);
        sync_block();
        mbarrier_wait(bar, 0);
      },
      shared.base, shared.size);
  EXPECT_NE(stuck.find("mbarrier"), std::string::npos) << stuck;
}

TEST(HopperEmulated, ATmaBoxLandsSwizzledWithZerosOutsideTheTensorAndOnlyAfterTheWait) {
  const Matrix g(100, 80, 1);
  for (Swizzle s : {Swizzle::k128B, Swizzle::k64B, Swizzle::kNone}) {
    const int box_x = s == Swizzle::k64B ? 32 : 64, box_y = 8;
    const TmaDesc desc = box_of(g, box_x, box_y, s);
    Shared shared(4096);
    char* tile = shared.base + 1024;
    uint16_t before = 0, after = 0;
    const std::string error = emu::run_block(
        0, 32,
        [&] {
          auto* bar = reinterpret_cast<uint64_t*>(shared.base);
          if (thread_index() == 0) {
            mbarrier_init(bar, 1);
            mbarrier_arrive_expect_tx(bar, box_x * box_y * 2);
            tma_load_2d(tile, &desc, 40, 96, bar);   // rows 96..103 (100+ are outside), columns 40..
            std::memcpy(&before, tile, 2);            // not yet: the load is in flight
          }
          mbarrier_wait(bar, 0);
          if (thread_index() == 0) std::memcpy(&after, tile, 2);
        },
        shared.base, shared.size);
    ASSERT_EQ(error, "");
    EXPECT_EQ(before, 0xffff) << "the box was visible before the mbarrier wait";
    EXPECT_EQ(after, g.bits[96 * 80 + 40]);
    for (int r = 0; r < box_y; ++r) {
      for (int e = 0; e < box_x; ++e) {
        const uint32_t logical = 1024u + static_cast<uint32_t>((r * box_x + e) * 2);
        uint16_t got;
        std::memcpy(&got, shared.base + swizzle_address(logical, s), 2);
        const int gy = 96 + r, gx = 40 + e;
        const uint16_t want = gy < 100 && gx < 80 ? g.bits[static_cast<size_t>(gy) * 80 + gx] : 0;
        ASSERT_EQ(got, want) << "row " << r << " element " << e;
      }
    }
  }
}

// What one wgmma test runs: D[64 x N] = A[64 x K] B (B as N x K, K-major, or K x N, MN-major),
// A and B loaded by TMA with 128-byte swizzle (64 elements a row), K in steps of 16.
struct Gemm {
  int n = 64, k = 64;
  bool b_mn_major = false;
  bool a_in_registers = false;
  // Bugs to plant.
  uint32_t sbo = 1024;           // the stride between 8-row groups
  bool skip_tma_wait = false;
  bool clobber_before_wait = false;
  bool never_wait = false;
};

struct GemmResult {
  std::string error;
  double max_error = 0;  // largest |D - reference| over the largest |reference|
};

template <int N>
GemmResult run_gemm(const Gemm& c) {
  const Matrix a(64, c.k, 11), b = c.b_mn_major ? Matrix(c.k, N, 12) : Matrix(N, c.k, 12);
  // Tiles: A at 1024 (64 rows x 128 B per 64 k), B after it; each 64-element-wide column block of
  // a tile is one TMA box of 128-byte rows.
  Shared shared(1024 + 64 * c.k * 2 + N * c.k * 2 + 1024);
  char* sa = shared.base + 1024;
  char* sb = sa + 64 * c.k * 2;
  const TmaDesc da = box_of(a, 64, 64, Swizzle::k128B);
  const TmaDesc db = c.b_mn_major ? box_of(b, 64, c.k, Swizzle::k128B) : box_of(b, 64, N, Swizzle::k128B);
  std::vector<float> d_out(64 * N, 0.f);
  GemmResult result;
  result.error = emu::run_block(
      0, 128,
      [&] {
        auto* bar = reinterpret_cast<uint64_t*>(shared.base);
        const int tid = thread_index();
        const int a_boxes = c.k / 64, b_boxes = c.b_mn_major ? N / 64 : c.k / 64;
        const int a_box_bytes = 64 * 64 * 2, b_box_bytes = (c.b_mn_major ? c.k : N) * 64 * 2;
        if (tid == 0) {
          mbarrier_init(bar, 1);
          mbarrier_arrive_expect_tx(bar, static_cast<uint32_t>(a_boxes * a_box_bytes + b_boxes * b_box_bytes));
          for (int i = 0; i < a_boxes; ++i) tma_load_2d(sa + i * a_box_bytes, &da, 64 * i, 0, bar);
          for (int i = 0; i < b_boxes; ++i) tma_load_2d(sb + i * b_box_bytes, &db, 64 * i, 0, bar);
        }
        sync_block();
        if (!c.skip_tma_wait) mbarrier_wait(bar, 0);
        float d[N / 2] = {};
        const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
        wgmma_fence();
        for (int kk = 0; kk < c.k / 16; ++kk) {
          // K-major B: k-step kk is 32 bytes into the row (within a 64-wide box) or the next box.
          // MN-major B: 16 rows (two 8-row groups of 1024 B) per k-step; N blocks of 64 at LBO.
          const uint32_t b_start = c.b_mn_major ? smem_address(sb) + static_cast<uint32_t>(kk) * 16 * 128
                                                : smem_address(sb) + static_cast<uint32_t>(kk / 4 * b_box_bytes + kk % 4 * 32);
          const uint64_t desc_b = make_smem_desc(b_start, Swizzle::k128B, c.b_mn_major ? b_box_bytes : 16, c.sbo);
          if (c.a_in_registers) {
            uint32_t frag[4];
            const int rows[4] = {16 * w + g, 16 * w + g + 8, 16 * w + g, 16 * w + g + 8};
            for (int i = 0; i < 4; ++i) {
              const int k0 = 16 * kk + 2 * t + (i >= 2 ? 8 : 0);
              const size_t at = static_cast<size_t>(rows[i]) * c.k + k0;
              frag[i] = static_cast<uint32_t>(a.bits[at]) | (static_cast<uint32_t>(a.bits[at + 1]) << 16);
            }
            if (c.b_mn_major) {
              wgmma_rs<1, N>(d, frag, desc_b, kk > 0 ? 1 : 0, Bf16{});
            } else {
              wgmma_rs<0, N>(d, frag, desc_b, kk > 0 ? 1 : 0, Bf16{});
            }
          } else {
            const uint32_t a_start = smem_address(sa) + static_cast<uint32_t>(kk / 4 * a_box_bytes + kk % 4 * 32);
            const uint64_t desc_a = make_smem_desc(a_start, Swizzle::k128B, 16, c.sbo);
            if (c.b_mn_major) {
              wgmma_ss<1, N>(d, desc_a, desc_b, kk > 0 ? 1 : 0, Bf16{});
            } else {
              wgmma_ss<0, N>(d, desc_a, desc_b, kk > 0 ? 1 : 0, Bf16{});
            }
          }
        }
        wgmma_commit();
        sync_block();
        if (c.clobber_before_wait && tid == 0) std::memset(sb, 0, 64);
        sync_block();
        if (c.never_wait) return;
        wgmma_wait<0>();
        for (int j = 0; j < N / 8; ++j) {
          for (int i = 0; i < 4; ++i) {
            d_out[static_cast<size_t>(16 * w + g + 8 * (i / 2)) * N + 8 * j + 2 * t + i % 2] = d[4 * j + i];
          }
        }
      },
      shared.base, shared.size);
  double worst = 0, scale = 0;
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < N; ++n) {
      double want = 0;
      for (int k = 0; k < c.k; ++k) want += double{a.at(m, k)} * (c.b_mn_major ? b.at(k, n) : b.at(n, k));
      const double got = d_out[static_cast<size_t>(m) * N + n];
      worst = std::isfinite(got) ? std::max(worst, std::abs(want - got)) : INFINITY;  // NaN is wrong too
      scale = std::max(scale, std::abs(want));
    }
  }
  result.max_error = worst / scale;
  return result;
}

TEST(HopperEmulated, WgmmaFromTmaLoadedSwizzledTilesMatchesTheReference) {
  for (bool registers : {false, true}) {
    for (bool mn_major : {false, true}) {
      Gemm c;
      c.b_mn_major = mn_major;
      c.a_in_registers = registers;
      c.k = 128;
      const GemmResult r64 = run_gemm<64>(c);
      EXPECT_EQ(r64.error, "");
      EXPECT_LT(r64.max_error, 1e-5) << "N 64, A in registers " << registers << ", B MN-major " << mn_major;
      const GemmResult r128 = run_gemm<128>(c);
      EXPECT_EQ(r128.error, "");
      EXPECT_LT(r128.max_error, 1e-5) << "N 128, A in registers " << registers << ", B MN-major " << mn_major;
    }
  }
}

TEST(HopperEmulated, WgmmaWithoutSwizzleReadsCoreMatricesAtLboAndSbo) {
  // Core matrices (8 rows x 16 bytes) of A (64 x 16, K-major) and B (64 x 16, K-major) placed by
  // hand: matrix (i along rows, j along k) at i * 256 + j * 128, so SBO 256 and LBO 128.
  const Matrix a(64, 16, 21), b(64, 16, 22);
  Shared shared(8192);
  auto place = [&](char* tile, const Matrix& m) {
    for (int r = 0; r < 64; ++r) {
      for (int k = 0; k < 16; ++k) {
        std::memcpy(tile + (r / 8) * 256 + (k / 8) * 128 + (r % 8) * 16 + (k % 8) * 2,
                    &m.bits[static_cast<size_t>(r) * 16 + k], 2);
      }
    }
  };
  place(shared.base, a);
  place(shared.base + 4096, b);
  std::vector<float> d_out(64 * 64);
  const std::string error = emu::run_block(
      0, 128,
      [&] {
        float d[32] = {};
        wgmma_fence();
        wgmma_ss<0, 64>(d, make_smem_desc(smem_address(shared.base), Swizzle::kNone, 128, 256),
                        make_smem_desc(smem_address(shared.base + 4096), Swizzle::kNone, 128, 256), 0, Bf16{});
        wgmma_commit();
        wgmma_wait<0>();
        const int tid = thread_index(), w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
        for (int j = 0; j < 8; ++j) {
          for (int i = 0; i < 4; ++i) d_out[static_cast<size_t>(16 * w + g + 8 * (i / 2)) * 64 + 8 * j + 2 * t + i % 2] = d[4 * j + i];
        }
      },
      shared.base, shared.size);
  ASSERT_EQ(error, "");
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < 64; ++n) {
      double want = 0;
      for (int k = 0; k < 16; ++k) want += double{a.at(m, k)} * b.at(n, k);
      ASSERT_NEAR(d_out[static_cast<size_t>(m) * 64 + n], want, 1e-5) << m << "," << n;
    }
  }
}

// FlashAttention-3's ping-pong on named barriers, as hopper_fwd.cuh takes turns: each of two
// warpgroups waits on its own barrier before its "wgmma" and arrives on the other's after it;
// warpgroup 0 starts and takes warpgroup 1's last pass. The turns must alternate strictly, whichever
// thread the emulator runs first; without the barriers the lowest-first schedule runs warpgroup 0's
// turns all before warpgroup 1's; and the barriers must be left empty, or the emulator says so.
std::vector<int> take_turns(int rounds, bool with_barriers, bool skip_last_pass, std::string& error) {
  std::vector<int> order;
  emu::set_schedule(emu::Schedule::kLowestFirst);
  error = emu::run_block(0, 256, [&] {
    const int c = warpgroup_index();
    if (with_barriers && c == 0) named_barrier_arrive(4, 256);
    for (int r = 0; r < rounds; ++r) {
      if (with_barriers) named_barrier_sync(4 + c, 256);
      if (thread_index() % 128 == 0) order.push_back(c);  // the warpgroup's elected issuing thread
      if (with_barriers) named_barrier_arrive(5 - c, 256);
    }
    if (with_barriers && c == 0 && !skip_last_pass) named_barrier_sync(4, 256);
  });
  emu::set_schedule(emu::Schedule::kRoundRobin);
  return order;
}

TEST(HopperEmulated, NamedBarriersMakeTwoWarpgroupsTakeTurns) {
  std::string error;
  const std::vector<int> order = take_turns(5, true, false, error);
  EXPECT_EQ(error, "");
  EXPECT_EQ(order, (std::vector<int>{0, 1, 0, 1, 0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(take_turns(5, false, false, error), (std::vector<int>{0, 0, 0, 0, 0, 1, 1, 1, 1, 1}));
  EXPECT_EQ(error, "");
  take_turns(5, true, true, error);
  EXPECT_EQ(error, "named barrier 4 left with 128 of 256 arrivals when the block ended");
  // A barrier every thread waits at but too few reach is a deadlock, not a hang.
  error = emu::run_block(0, 128, [&] { if (thread_index() < 64) named_barrier_sync(6, 128); });
  EXPECT_NE(error.find("deadlock"), std::string::npos) << error;
}

// The planted bugs: each must give a wrong result or an error.
TEST(HopperEmulated, PlantedBugsAreCaught) {
  Gemm wrong_sbo;
  wrong_sbo.sbo = 512;  // 8-row groups are 1024 bytes apart in a 128-byte-swizzled tile
  EXPECT_GT(run_gemm<64>(wrong_sbo).max_error, 0.1) << "a wrong stride byte offset went unnoticed";

  Gemm no_wait;
  no_wait.skip_tma_wait = true;  // reads the tiles before the TMA loads complete
  const GemmResult early = run_gemm<64>(no_wait);
  EXPECT_GT(early.max_error, 0.1) << "a read before the mbarrier wait went unnoticed";
  EXPECT_NE(early.error.find("TMA"), std::string::npos) << early.error;

  Gemm clobber;
  clobber.clobber_before_wait = true;  // B's shared memory changes while the wgmma is in flight
  EXPECT_GT(run_gemm<64>(clobber).max_error, 1e-3) << "shared memory reused before wgmma_wait went unnoticed";

  Gemm never;
  never.never_wait = true;
  EXPECT_NE(run_gemm<64>(never).error.find("never waited"), std::string::npos);
}

}  // namespace
}  // namespace distca::kernels::cuda
