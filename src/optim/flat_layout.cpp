// Flat-buffer layout: segment offsets, all-reduce buckets and shard slices (see flat_layout.h).
#include "optim/flat_layout.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "common/check.h"

namespace nimble_train::optim {

namespace {

constexpr int64_t kMaxInt64 = std::numeric_limits<int64_t>::max();
constexpr int64_t kSegmentAlignBytes = 256;  // the caching allocator's block alignment
constexpr int64_t kVectorBytes = 16;         // one vector load of the fused update

void check_element_size(int64_t element_size) {
  NT_CHECK(element_size > 0 && kVectorBytes % element_size == 0,
           "element_size must be a divisor of 16 bytes (1, 2, 4, 8 or 16); got ", element_size);
}

// offsets: [num_segments + 1] into one buffer, so at least one entry, none negative, none
// smaller than the one before.
void check_offsets(const std::vector<int64_t>& offsets) {
  NT_CHECK(!offsets.empty(),
           "offsets must have num_segments + 1 entries (at least 1, the buffer's start); got 0");
  NT_CHECK(offsets[0] >= 0, "offsets must be >= 0; got offsets[0] = ", offsets[0]);
  for (size_t i = 1; i < offsets.size(); ++i) {
    NT_CHECK(offsets[i] >= offsets[i - 1], "offsets must be non-decreasing; got offsets[", i - 1,
             "] = ", offsets[i - 1], " > offsets[", i, "] = ", offsets[i]);
  }
}

// ready_rank: [num_segments] positions in the order gradients arrive, so none negative.
void check_ready_ranks(const std::vector<int64_t>& ready_rank) {
  for (size_t i = 0; i < ready_rank.size(); ++i) {
    NT_CHECK(ready_rank[i] >= 0, "ready_rank must be >= 0 (a position in the order gradients "
             "arrive); got ready_rank[", i, "] = ", ready_rank[i]);
  }
}

// Sum of ready ranks over [begin, end), without overflow.
int64_t sum_of_ranks(const std::vector<int64_t>& ready_rank, size_t begin, size_t end) {
  int64_t sum = 0;
  for (size_t i = begin; i < end; ++i) {
    NT_CHECK(ready_rank[i] <= kMaxInt64 - sum,
             "the sum of ready ranks must fit in int64; got ready_rank[", i, "] = ",
             ready_rank[i], " on top of ", sum);
    sum += ready_rank[i];
  }
  return sum;
}

// The first segment cut is at the end whose gradients arrive last: segment 0 when the second
// half's ranks sum to less than the first half's, otherwise segment num_segments - 1.
bool low_end_arrives_last(const std::vector<int64_t>& ready_rank) {
  const size_t half = ready_rank.size() / 2;
  if (half == 0) return false;
  return sum_of_ranks(ready_rank, half, ready_rank.size()) < sum_of_ranks(ready_rank, 0, half);
}

FlatBucket make_bucket(std::vector<int64_t> members, const std::vector<int64_t>& offsets,
                       const std::vector<int64_t>& ready_rank) {
  std::sort(members.begin(), members.end());
  FlatBucket bucket;
  bucket.start = offsets[static_cast<size_t>(members.front())];
  bucket.stop = offsets[static_cast<size_t>(members.back()) + 1];
  for (int64_t i : members) {
    bucket.ready_at = std::max(bucket.ready_at, ready_rank[static_cast<size_t>(i)]);
  }
  bucket.members = std::move(members);
  return bucket;
}

}  // namespace

int64_t flat_segment_alignment(int64_t element_size, int64_t shard_world) {
  check_element_size(element_size);
  NT_CHECK(shard_world >= 1, "shard_world must be >= 1 (1: the state is not sharded); got ",
           shard_world);
  // In bytes the alignment is lcm(256, 16 * shard_world) <= 256 * shard_world; keep it in range.
  NT_CHECK(shard_world <= kMaxInt64 / kSegmentAlignBytes,
           "shard_world must be at most ", kMaxInt64 / kSegmentAlignBytes, "; got ", shard_world);
  const int64_t vector = kVectorBytes / element_size;
  return std::lcm(kSegmentAlignBytes / element_size, shard_world * vector);
}

std::vector<int64_t> flat_segment_offsets(const std::vector<int64_t>& numels,
                                          int64_t element_size, int64_t shard_world) {
  const int64_t align = flat_segment_alignment(element_size, shard_world);
  std::vector<int64_t> offsets;
  offsets.reserve(numels.size() + 1);
  offsets.push_back(0);
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t n = numels[i];
    NT_CHECK(n >= 0, "numels must be >= 0; got numels[", i, "] = ", n);
    const int64_t blocks = n / align + (n % align != 0);  // ceil(n / align), without overflow
    NT_CHECK(blocks <= (kMaxInt64 - offsets.back()) / align,
             "the flat buffer must have at most ", kMaxInt64, " elements; tensor ", i, " of ", n,
             " elements, padded to a multiple of ", align, ", does not fit after ",
             offsets.back());
    offsets.push_back(offsets.back() + blocks * align);
  }
  return offsets;
}

std::vector<FlatBucket> plan_buckets(const std::vector<int64_t>& offsets,
                                     const std::vector<int64_t>& ready_rank, int64_t element_size,
                                     int64_t bucket_bytes, int64_t last_bucket_bytes) {
  check_offsets(offsets);
  const size_t count = offsets.size() - 1;
  NT_CHECK(count == ready_rank.size(), count, " segments but ", ready_rank.size(),
           " ready ranks: ready_rank must have one entry per segment (offsets has ", count,
           " + 1 entries)");
  NT_CHECK(bucket_bytes > 0 && last_bucket_bytes > 0,
           "bucket_bytes and last_bucket_bytes must be positive; got ", bucket_bytes, " and ",
           last_bucket_bytes);
  check_ready_ranks(ready_rank);
  NT_CHECK(element_size > 0, "element_size must be positive (bytes); got ", element_size);
  NT_CHECK(offsets.back() - offsets.front() <= kMaxInt64 / element_size,
           "the buffer's size in bytes must fit in int64; got ", offsets.back() - offsets.front(),
           " elements of ", element_size, " bytes");
  if (count == 0) return {};

  const bool from_low_end = low_end_arrives_last(ready_rank);
  std::vector<FlatBucket> buckets;
  std::vector<int64_t> members;
  int64_t size = 0;  // bytes in members
  int64_t limit = std::min(bucket_bytes, last_bucket_bytes);
  for (size_t step = 0; step < count; ++step) {
    const size_t i = from_low_end ? step : count - 1 - step;
    const int64_t segment = (offsets[i + 1] - offsets[i]) * element_size;
    // size + segment <= the buffer's bytes, which fit in int64.
    if (!members.empty() && size + segment > limit) {
      buckets.push_back(make_bucket(std::move(members), offsets, ready_rank));
      members.clear();
      size = 0;
      limit = limit > bucket_bytes - limit ? bucket_bytes : 2 * limit;  // min(2 limit, cap)
    }
    members.push_back(static_cast<int64_t>(i));
    size += segment;
  }
  buckets.push_back(make_bucket(std::move(members), offsets, ready_rank));
  // Stable: two buckets with the same (ready_at, start) keep the order they were cut in.
  std::stable_sort(buckets.begin(), buckets.end(), [](const FlatBucket& a, const FlatBucket& b) {
    return a.ready_at != b.ready_at ? a.ready_at < b.ready_at : a.start < b.start;
  });
  return buckets;
}

ShardSlice shard_slice(int64_t bucket_start, int64_t bucket_stop, int64_t world, int64_t rank) {
  NT_CHECK(0 <= bucket_start && bucket_start <= bucket_stop,
           "a bucket must satisfy 0 <= start <= stop; got [", bucket_start, ", ", bucket_stop,
           ")");
  NT_CHECK(world >= 1, "world must be >= 1; got ", world);
  NT_CHECK(0 <= rank && rank < world, "rank must be in [0, ", world, "); got ", rank);
  const int64_t size = bucket_stop - bucket_start;
  NT_CHECK(size % world == 0, "a gradient bucket of ", size, " elements does not split into ",
           world, " equal parts; the fused optimizer must be built with shard_world equal to "
           "the number of ranks");
  const int64_t part = size / world;
  return ShardSlice{bucket_start + rank * part, bucket_start + (rank + 1) * part, bucket_start,
                    size};
}

SliceSegments slice_segments(const std::vector<int64_t>& offsets, int64_t start, int64_t stop,
                             int64_t element_size) {
  check_offsets(offsets);
  check_element_size(element_size);
  const int64_t total = offsets.back();
  NT_CHECK(0 <= start && start <= stop && stop <= total, "slice [", start, ", ", stop,
           ") must lie within the flat buffer's ", total, " elements (0 <= start <= stop <= ",
           total, ")");
  const int64_t vector = kVectorBytes / element_size;
  NT_CHECK(start % vector == 0 && stop % vector == 0, "slice [", start, ", ", stop,
           ") of the flat buffer's ", total, " elements must be cut at 16-byte vectors: start "
           "and stop multiples of ", vector, " elements of ", element_size, " bytes");

  // Offsets are sorted, so the members are consecutive: from the first segment that ends
  // after start to the last that begins before stop.
  const auto first_end_after = std::upper_bound(offsets.begin() + 1, offsets.end(), start);
  const auto first_begin_at_stop = std::lower_bound(offsets.begin(), offsets.end() - 1, stop);
  const int64_t first = first_end_after - (offsets.begin() + 1);
  const int64_t last = first_begin_at_stop - offsets.begin();  // one past
  SliceSegments out;
  for (int64_t i = first; i < last; ++i) {
    out.members.push_back(i);
    out.local_offsets.push_back(std::max(offsets[static_cast<size_t>(i)], start) - start);
  }
  out.local_offsets.push_back(stop - start);
  return out;
}

}  // namespace nimble_train::optim
