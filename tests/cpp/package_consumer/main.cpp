// Uses the runtime library as a C++ program would: the staging ring and static inputs on the
// CPU, the flat-buffer layout and the stream planner. Prints one line per check; exit code 0
// when every value is the one expected.
#include <ATen/ATen.h>

#include <cstdio>
#include <vector>

#include <nimble_train/capture/staging_ring.h>
#include <nimble_train/capture/static_inputs.h>
#include <nimble_train/nimble_train/build_config.h>
#include <nimble_train/optim/flat_layout.h>
#include <nimble_train/streams/stream_assignment.h>

namespace nt = nimble_train;

int main() {
  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    std::printf("%s %s\n", ok ? "ok" : "FAILED", what);
    failures += ok ? 0 : 1;
  };

  nt::capture::StagingRing ring(2, at::Device(at::kCPU), 4);
  ring.stage({3.0f, 0.5f});
  ring.launched();
  ring.fetch();
  expect(at::equal(ring.current(), at::tensor({3.0f, 0.5f})), "staging ring fetches its slot");

  nt::capture::LeafSpec leaf;
  leaf.path = "batch[0]";
  leaf.sizes = {4, 2};
  leaf.strides = {2, 1};
  leaf.batched = true;
  nt::capture::StaticInputs inputs({leaf});
  const at::Tensor x = at::randn({3, 2});
  expect(inputs.check({x}) == 3, "static inputs count a short batch");
  inputs.copy_in({x}, 3, /*fill_padding=*/true);
  expect(at::equal(inputs.buffers()[0].narrow(0, 0, 3), x), "static inputs copy it in");

  const std::vector<int64_t> offsets = nt::optim::flat_segment_offsets({10, 100}, 4, 1);
  expect(offsets == std::vector<int64_t>({0, 64, 192}), "flat segments are 256-byte aligned");

  const nt::streams::StreamPlan plan = nt::streams::assign_streams(3, {{0, 1}, {0, 2}});
  expect(plan.num_streams == 2, "two independent operators get two streams");

  std::printf("nimble_train %s, CUDA compiled in: %d\n", NT_VERSION, NT_HAVE_CUDA);
  return failures == 0 ? 0 : 1;
}
