// The cuBLAS workspaces a step's captures use (see blas_workspaces.h).
#include "capture/blas_workspaces.h"

#include <ATen/cuda/CUDAContextLight.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <tuple>
#include <type_traits>
#include <utility>

namespace nimble_train::capture {
namespace {

using Map = at::cuda::WorkspaceMapWithMutex;
using Key = std::tuple<void*, void*>;  // (handle, stream)
// The map's value: the workspace (older torch) or (workspace, size).
using Value = std::decay_t<decltype(std::declval<Map&>().map)>::mapped_type;

c10::DataPtr& data_of(c10::DataPtr& value) { return value; }
template <typename Size>
c10::DataPtr& data_of(std::pair<c10::DataPtr, Size>& value) { return value.first; }

Map& map_of(int map) {
  return map == 0 ? at::cuda::cublas_handle_stream_to_workspace()
                  : at::cuda::cublaslt_handle_stream_to_workspace();
}

bool in_capture(void* stream, unsigned long long capture_id) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  if (cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, &id) != cudaSuccess) {
    (void)cudaGetLastError();  // a stream the map outlived: not ours
    return false;
  }
  return status == cudaStreamCaptureStatusActive && id == capture_id;
}

}  // namespace

struct BlasWorkspaces::Held {
  int map;  // 0: cuBLAS's, 1: cuBLASLt's
  Key key;
  Value value;
  void* data = nullptr;  // where the workspace lies (to find it again once lent)
  bool lent = false;
};

BlasWorkspaces::BlasWorkspaces() = default;
BlasWorkspaces::~BlasWorkspaces() = default;

void BlasWorkspaces::clear() { held_.clear(); }

std::vector<void*> BlasWorkspaces::addresses() const {
  std::vector<void*> out;
  out.reserve(held_.size());
  for (const auto& h : held_) out.push_back(h->data);
  return out;
}

void BlasWorkspaces::lend() {
  for (auto& h : held_) {
    if (h->lent) continue;
    Map& map = map_of(h->map);
    std::unique_lock<std::shared_mutex> lock(map.mutex);
    if (map.map.count(h->key) == 0) {
      map.map.emplace(h->key, std::move(h->value));
      h->lent = true;
    }
  }
}

void BlasWorkspaces::take_from(int which, const unsigned long long* capture_id) {
  Map& map = map_of(which);
  std::unique_lock<std::shared_mutex> lock(map.mutex);
  for (auto it = map.map.begin(); it != map.map.end();) {
    void* data = data_of(it->second).get();
    auto lent = std::find_if(held_.begin(), held_.end(), [&](const std::unique_ptr<Held>& h) {
      return h->lent && h->map == which && h->key == it->first && h->data == data;
    });
    if (lent != held_.end()) {
      (*lent)->value = std::move(it->second);
      (*lent)->lent = false;
    } else if (capture_id != nullptr && in_capture(std::get<1>(it->first), *capture_id)) {
      held_.push_back(std::make_unique<Held>(Held{which, it->first, std::move(it->second), data,
                                                  false}));
    } else {
      ++it;
      continue;
    }
    it = map.map.erase(it);
  }
}

void BlasWorkspaces::take(unsigned long long capture_id) {
  take_from(0, &capture_id);
  take_from(1, &capture_id);
  forget_lost();
}

void BlasWorkspaces::take_lent() {
  take_from(0, nullptr);
  take_from(1, nullptr);
  forget_lost();
}

// A workspace still lent after a take is no longer in its map: torch cleared the map while it
// was lent (during a capture) and freed it.
void BlasWorkspaces::forget_lost() {
  held_.erase(std::remove_if(held_.begin(), held_.end(),
                             [](const std::unique_ptr<Held>& h) { return h->lent; }),
              held_.end());
}

}  // namespace nimble_train::capture
