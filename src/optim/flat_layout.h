// Where tensors sit in a flat buffer, how the buffer is cut into all-reduce buckets, and which
// part of a bucket each rank updates when the optimizer state is sharded.
//
// Segments. The parameters (gradients, optimizer state) of one dtype live in one flat buffer;
// tensor i owns the segment [offsets[i], offsets[i + 1]) and the rest of its segment is zero
// padding. Every segment starts on a 256-byte boundary:
//  - the fused update loads 16-byte vectors everywhere, with no scalar prologue;
//  - a parameter is a view into the flat buffer, and cuDNN keys its algorithm cache by the
//    pointer's alignment: a weight less aligned than the caching allocator's 256-byte blocks
//    misses the cache, and a miss inside a graph capture cannot be benchmarked.
// With the state sharded over W ranks (shard_world = W), every segment also splits into W
// parts of whole 16-byte vectors, so any run of whole segments does too. A segment's length is
// therefore a multiple of lcm(256, 16 W) bytes, whatever the dtype: 256 bytes for W a power of
// two up to 16, 512 for W = 32, 768 for W = 3, 6, 12 or 24. Worked number: float16 (2 bytes),
// W = 3: lcm(128, 3 * 8) = 384 elements; tensors of 1000, 384 and 385 elements take 1152, 384
// and 768, so offsets = {0, 1152, 1536, 2304}. Padding is under one alignment per tensor:
// with W = 3, under 768 bytes each, so under 0.16 MB over BERT-base's ~200 tensors.
//
// Buckets. The gradient buffer is all-reduced in buckets of whole segments, each launched as
// soon as its last gradient has been accumulated, so the communication hides behind the rest
// of the backward. The backward reaches the first layers last; the last bucket's all-reduce
// has no backward left to hide behind, so it is small (last_bucket_bytes, 1 MiB by default),
// and each bucket before it holds at most twice the one after, up to bucket_bytes (25 MiB by
// default): 1, 2, 4, 8, 16, 25, 25, ... MiB. Five growing buckets reach the full size, so the
// small tail adds few collective launches. Worked number: with 100 GB/s of bus bandwidth over
// 8 ranks, an all-reduce moves 2 (8 - 1) / 8 = 1.75 bytes per byte of bucket: 0.46 ms for
// 25 MiB, 18 us for 1 MiB. That is the step time an exposed last bucket of each size adds.
//
// Shards (ZeRO stage 1). Rank r of W updates the r-th of W equal parts of every bucket, as
// NCCL's reduce-scatter and all-gather cut them. Built with shard_world = W, a bucket's length
// is a multiple of 16 W bytes, so each part is whole 16-byte vectors and starts on a 16-byte
// boundary: the fused update's vector loads stay aligned in every shard. A part may straddle
// segments; slice_segments gives the tensors it touches and where they start within it.
//
// All counts and offsets are elements of the buffer's dtype unless named *_bytes. Bad input
// throws nimble_train::InvalidArgument (ValueError in Python) saying what was required and
// what was seen. Everything here is host arithmetic, run once when the buffers are built.
#pragma once

#include <cstdint>
#include <vector>

namespace nimble_train::optim {

// The segment alignment in elements: lcm(256 / element_size, shard_world * (16 / element_size)).
// element_size: bytes, a divisor of 16 (1, 2, 4, 8 or 16); shard_world >= 1.
int64_t flat_segment_alignment(int64_t element_size, int64_t shard_world);

// Segment offsets of a flat buffer holding tensors of these sizes, in order.
// numels: [num_tensors] elements, each >= 0. Returns [num_tensors + 1] offsets, elements:
// offsets[0] = 0, offsets[i + 1] = offsets[i] + numels[i] rounded up to the alignment.
// A tensor of no elements has an empty segment.
std::vector<int64_t> flat_segment_offsets(const std::vector<int64_t>& numels,
                                          int64_t element_size, int64_t shard_world);

struct FlatBucket {
  int64_t start = 0;             // offset of its first element, elements
  int64_t stop = 0;              // one past its last element, elements
  std::vector<int64_t> members;  // its segments, ascending and consecutive
  int64_t ready_at = 0;          // max ready_rank over its members: when its last gradient lands
};

// Cuts the buffer [offsets[0], offsets[num_segments]) into buckets of whole segments.
// offsets: [num_segments + 1] non-decreasing, >= 0, elements; ready_rank: [num_segments], >= 0,
// segment i's gradient is the ready_rank[i]-th to arrive; element_size: bytes, > 0;
// bucket_bytes, last_bucket_bytes: > 0.
//
// Which end arrives last: the first half of the segments when the sum of ready ranks over the
// second half (segments num_segments / 2 onwards) is smaller than over the first; otherwise,
// and always with fewer than two segments, the second. Buckets are cut walking from that end:
// a segment joins the current bucket unless that would take the bucket past its limit; the
// first limit is min(bucket_bytes, last_bucket_bytes) and each new bucket's limit is twice the
// previous one's, capped at bucket_bytes. A segment larger than its limit is a bucket alone.
// Empty segments join the bucket being filled (or open one after an oversized segment).
//
// Returns the buckets sorted by (ready_at, start); no buckets for no segments. Together they
// cover the buffer exactly once. Worked example: ten float32 segments of 100 elements (400
// bytes), ready_rank = {9, 8, ..., 0} (segment 0 arrives last), bucket_bytes = 1600,
// last_bucket_bytes = 400: cut from segment 0 with limits 400, 800, 1600, 1600 into {0},
// {1, 2}, {3, 4, 5, 6}, {7, 8, 9}; returned as {7, 8, 9} (ready_at 2), {3, 4, 5, 6} (6),
// {1, 2} (8), {0} (9).
std::vector<FlatBucket> plan_buckets(const std::vector<int64_t>& offsets,
                                     const std::vector<int64_t>& ready_rank, int64_t element_size,
                                     int64_t bucket_bytes, int64_t last_bucket_bytes);

struct ShardSlice {
  int64_t start = 0;        // this rank's part [start, stop), elements
  int64_t stop = 0;
  int64_t range_start = 0;  // the whole bucket, which the all-gather fills: its first element
  int64_t range_count = 0;  // and its length, elements
};

// Rank `rank`'s part of the bucket [bucket_start, bucket_stop) sharded over `world` ranks: the
// rank-th of world equal parts. Requires 0 <= bucket_start <= bucket_stop, world >= 1,
// 0 <= rank < world, and the bucket's length divisible by world (it is when the buffer was
// laid out with shard_world = world). Worked example: bucket [1536, 2304), world 3, rank 1:
// parts of 256, so [1792, 2048) with range (1536, 768).
ShardSlice shard_slice(int64_t bucket_start, int64_t bucket_stop, int64_t world, int64_t rank);

struct SliceSegments {
  std::vector<int64_t> members;        // [k] the segments i with offsets[i] < stop and
                                       // offsets[i + 1] > start, ascending
  std::vector<int64_t> local_offsets;  // [k + 1] max(offsets[i], start) - start per member,
                                       // then stop - start: elements, within the slice
};

// The segments that the slice [start, stop) of the buffer touches, and where each begins
// within the slice (a segment cut by start begins at 0). offsets: [num_segments + 1]
// non-decreasing, elements; element_size: bytes, a divisor of 16. Requires
// 0 <= start <= stop <= offsets[num_segments], with start and stop on 16-byte vectors
// (multiples of 16 / element_size). Worked example: offsets {0, 1152, 1536, 2304}, float16,
// slice [1024, 1792): members {0, 1, 2}, local_offsets {0, 128, 512, 768}.
SliceSegments slice_segments(const std::vector<int64_t>& offsets, int64_t start, int64_t stop,
                             int64_t element_size);

}  // namespace nimble_train::optim
