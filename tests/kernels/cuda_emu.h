// The host warp emulator behind warp.cuh's host build: runs one CUDA block of the attention
// kernels on the CPU, each CUDA thread a fiber (ucontext), one at a time. Block barriers wait for
// every thread; warp collectives (mma, ldmatrix, shuffles) for the 32 lanes of a warp, which then
// exchange data by the PTX fragment layouts. A barrier that not every thread reaches (divergent
// code) is reported as an error instead of hanging.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace distca::kernels::cuda::emu {

// Runs `body` as block `block` of `num_threads` threads (a multiple of 32), with `shared` (bytes
// of it) as the block's shared memory for the sm_90a primitives (hopper.cuh: their shared-memory
// addresses are offsets into it). Returns "" or the error: a deadlock (threads waiting at
// different barriers, or on an mbarrier phase that cannot complete), or wgmma results a thread
// never waited for.
std::string run_block(int64_t block, int num_threads, const std::function<void()>& body, char* shared = nullptr,
                      int64_t shared_bytes = 0);

}  // namespace distca::kernels::cuda::emu
