// The fetch kernel (see fetch.h).
#include <algorithm>

#include "capture/fetch.h"
#include "common/cuda_check.h"

namespace nimble_train::capture {
namespace {

__global__ void fetch_slot_kernel(FetchArgs a) {
  // The launch count lives in device memory (read once, cheaply); the host sees a published
  // copy in mapped memory.
  const int64_t launch = a.device_counts[0];
  const std::byte* slot = a.slots + (launch % a.capacity) * slot_bytes(a.num_values);
  const float* values = reinterpret_cast<const float*>(slot + sizeof(SlotHeader));
  for (int64_t i = threadIdx.x; i < a.num_values; i += blockDim.x) a.current[i] = values[i];
  __syncthreads();  // every thread has read `launch` and its values before the count moves
  if (threadIdx.x == 0) {
    const int64_t seq = reinterpret_cast<const volatile SlotHeader*>(slot)->seq;
    const int64_t stale = a.device_counts[1] + (seq != launch ? 1 : 0);
    a.device_counts[0] = launch + 1;
    a.device_counts[1] = stale;
    volatile RingCounters* out = a.published;
    out->stale = stale;
    __threadfence_system();  // the stale count is visible before the consumed count moves
    out->consumed = launch + 1;
    __threadfence_system();
  }
}

}  // namespace

void fetch_slot_cuda(const FetchArgs& args, cudaStream_t stream) {
  const int threads = static_cast<int>(std::clamp<int64_t>((args.num_values + 31) / 32 * 32, 32,
                                                           256));
  // With unified addressing a mapped host pointer is valid on the device as it is.
  fetch_slot_kernel<<<1, threads, 0, stream>>>(args);
  NT_CHECK_LAUNCH();
}

}  // namespace nimble_train::capture
