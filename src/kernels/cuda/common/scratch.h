// Stream-ordered device memory for one call of the CUDA kernels or CudnnAttention: blocks come
// from CUDA's stream-ordered pool and go back to it (on the stream) when the call ends, so calls on
// different streams never share a buffer.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "distca/core/cuda_status.h"
#include "distca/core/status.h"

namespace distca::kernels::cuda {

// Stream-ordered device memory, released (on the stream) when the call ends.
class Scratch {
 public:
  explicit Scratch(cudaStream_t stream) : stream_(stream) {}
  ~Scratch() {
    for (void* p : blocks_) (void)cudaFreeAsync(p, stream_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  cudaStream_t stream() const { return stream_; }

  template <typename T>
  Result<T*> alloc(int64_t count) {
    void* p = nullptr;
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&p, static_cast<size_t>(count > 0 ? count : 1) * sizeof(T), stream_));
    blocks_.push_back(p);
    return static_cast<T*>(p);
  }
  // A copy of `items` in device memory. The source is pageable: cudaMemcpyAsync has staged it
  // when it returns, so `items` may go.
  template <typename Item>
  Result<const Item*> upload(const std::vector<Item>& items) {
    Result<Item*> device = alloc<Item>(static_cast<int64_t>(items.size()));
    if (!device.is_ok()) return device.status();
    DISTCA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device.value(), items.data(), items.size() * sizeof(Item), cudaMemcpyHostToDevice,
                                    stream_));
    return static_cast<const Item*>(device.value());
  }

 private:
  cudaStream_t stream_;
  std::vector<void*> blocks_;
};

}  // namespace distca::kernels::cuda
