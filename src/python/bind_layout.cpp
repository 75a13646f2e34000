// Bindings for src/optim/flat_layout.h: segment offsets, all-reduce buckets and shard slices.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "optim/flat_layout.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace nimble_train {

namespace {

using Ints = std::vector<int64_t>;

// (start, stop, members, ready_at) per bucket: plain tuples, which Python compares and hashes.
std::vector<std::tuple<int64_t, int64_t, Ints, int64_t>> plan_flat_buckets(
    const Ints& offsets, const Ints& ready_rank, int64_t element_size, int64_t bucket_bytes,
    int64_t last_bucket_bytes) {
  std::vector<std::tuple<int64_t, int64_t, Ints, int64_t>> out;
  for (optim::FlatBucket& b : optim::plan_buckets(offsets, ready_rank, element_size,
                                                  bucket_bytes, last_bucket_bytes)) {
    out.emplace_back(b.start, b.stop, std::move(b.members), b.ready_at);
  }
  return out;
}

std::tuple<int64_t, int64_t, int64_t, int64_t> shard_slice(int64_t bucket_start,
                                                           int64_t bucket_stop, int64_t world,
                                                           int64_t rank) {
  const optim::ShardSlice s = optim::shard_slice(bucket_start, bucket_stop, world, rank);
  return {s.start, s.stop, s.range_start, s.range_count};
}

std::pair<Ints, Ints> slice_segments(const Ints& offsets, int64_t start, int64_t stop,
                                     int64_t element_size) {
  optim::SliceSegments s = optim::slice_segments(offsets, start, stop, element_size);
  return {std::move(s.members), std::move(s.local_offsets)};
}

}  // namespace

void bind_layout(py::module_& m) {
  // The GIL is released around the C++ call alone, as in the other bindings: the arguments
  // are converted to std::vector before it, and the results to lists and tuples after it.
  m.def("flat_segment_offsets", &optim::flat_segment_offsets, py::arg("numels"),
        py::arg("element_size"), py::arg("shard_world"),
        py::call_guard<py::gil_scoped_release>(),
        "Segment offsets of a flat buffer of one dtype holding tensors of these sizes, in "
        "order.\n\n"
        "numels: list[int] [num_tensors], elements, each >= 0.\n"
        "element_size: bytes per element, a divisor of 16 (1, 2, 4, 8 or 16).\n"
        "shard_world: the number of ranks the optimizer state is sharded over (1: none).\n\n"
        "Returns list[int] [num_tensors + 1], elements: offsets[0] = 0 and each tensor's\n"
        "segment rounded up to lcm(256, 16 * shard_world) bytes, so every segment starts on\n"
        "a 256-byte boundary and splits into shard_world parts of whole 16-byte vectors.\n"
        "Raises ValueError on bad input.");

  m.def("plan_flat_buckets", &plan_flat_buckets, py::arg("offsets"), py::arg("ready_rank"),
        py::arg("element_size"), py::arg("bucket_bytes"), py::arg("last_bucket_bytes"),
        py::call_guard<py::gil_scoped_release>(),
        "Cuts a flat buffer into all-reduce buckets of whole segments.\n\n"
        "offsets: list[int] [num_segments + 1], non-decreasing, elements (segment i is\n"
        "[offsets[i], offsets[i + 1])).\n"
        "ready_rank: list[int] [num_segments], >= 0: segment i's gradient is the\n"
        "ready_rank[i]-th to arrive.\n"
        "element_size: bytes per element. bucket_bytes, last_bucket_bytes: byte limits, > 0.\n\n"
        "Buckets are cut from the end whose gradients arrive last (the first half when its\n"
        "ready ranks sum higher than the second half's), the first with a limit of\n"
        "min(bucket_bytes, last_bucket_bytes), each next one with twice the limit before,\n"
        "up to bucket_bytes; a segment over its limit is a bucket alone.\n\n"
        "Returns list[tuple[int, int, list[int], int]]: (start, stop, members, ready_at) per\n"
        "bucket, start and stop in elements, members ascending, ready_at the largest ready\n"
        "rank of its members; sorted by (ready_at, start). Raises ValueError on bad input.");

  m.def("shard_slice", &shard_slice, py::arg("bucket_start"), py::arg("bucket_stop"),
        py::arg("world"), py::arg("rank"), py::call_guard<py::gil_scoped_release>(),
        "One rank's part of a bucket whose optimizer state is sharded over world ranks.\n\n"
        "bucket_start, bucket_stop: the bucket [bucket_start, bucket_stop), elements; its\n"
        "length must be divisible by world. rank: in [0, world).\n\n"
        "Returns (start, stop, range_start, range_count), elements: the rank-th of world\n"
        "equal parts, as NCCL's reduce-scatter and all-gather cut them, and the whole bucket\n"
        "(bucket_start, bucket_stop - bucket_start). Raises ValueError on bad input.");

  m.def("slice_segments", &slice_segments, py::arg("offsets"), py::arg("start"),
        py::arg("stop"), py::arg("element_size"), py::call_guard<py::gil_scoped_release>(),
        "The segments that the slice [start, stop) of a flat buffer touches.\n\n"
        "offsets: list[int] [num_segments + 1], non-decreasing, elements.\n"
        "start, stop: elements, 0 <= start <= stop <= offsets[-1], both multiples of\n"
        "16 // element_size (whole 16-byte vectors). element_size: bytes, a divisor of 16.\n\n"
        "Returns (members, local_offsets): members list[int] [k], the segments i with\n"
        "offsets[i] < stop and offsets[i + 1] > start, ascending; local_offsets list[int]\n"
        "[k + 1], elements within the slice: max(offsets[i], start) - start per member, then\n"
        "stop - start. Raises ValueError on bad input.");
}

}  // namespace nimble_train
