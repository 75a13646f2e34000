// Programmatic dependent launch (sm_90 on): a chain of kernels on one stream whose next kernel
// starts while the one before it finishes, so that the GPU's launch latency between dependent
// kernels leaves the critical path. A kernel launched early (launch_kernel) may be scheduled once
// every block of the kernel before it on the stream has called let_next_start() (or ended), and
// must call wait_for_previous() before it reads or writes global memory: that returns once the
// kernel before it has ended and its writes are visible (at once where it was not launched
// early, or before sm_90). In a CUDA graph the pair becomes a programmatic dependency edge.
//
// A block waiting in wait_for_previous() holds its SM's registers and threads; let_next_start()
// is called where the next kernel's blocks may take them without starving this one's.
#pragma once

#include <cuda_runtime.h>

#include "common/cuda_check.h"

namespace nimble_train {

__device__ __forceinline__ void wait_for_previous() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void let_next_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, 0, stream>>>(args...), checked; where `early`, allowed to start before
// the kernel ahead of it on `stream` ends (the kernel calls wait_for_previous() before it touches
// global memory).
template <typename... Params, typename... Args>
void launch_kernel(bool early, void (*kernel)(Params...), dim3 grid, dim3 block,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = early ? &attribute : nullptr;
  config.numAttrs = early ? 1 : 0;
  NT_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

}  // namespace nimble_train
