// Flat-buffer layout: hand-computed examples, and random layouts checked against definitions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/check.h"
#include "optim/flat_layout.h"

namespace nimble_train::optim {
namespace {

using Ints = std::vector<int64_t>;

// ---------------------------------------------------------------------------------------------
// Oracles: plain loops, written from the definitions in flat_layout.h.

// The segments that [start, stop) touches, by testing every segment.
Ints touched_segments(const Ints& offsets, int64_t start, int64_t stop) {
  Ints members;
  for (size_t i = 0; i + 1 < offsets.size(); ++i) {
    if (offsets[i] < stop && offsets[i + 1] > start) members.push_back(static_cast<int64_t>(i));
  }
  return members;
}

int64_t segment_bytes(const Ints& offsets, int64_t i, int64_t element_size) {
  return (offsets[static_cast<size_t>(i) + 1] - offsets[static_cast<size_t>(i)]) * element_size;
}

int64_t bucket_bytes_of(const FlatBucket& b, int64_t element_size) {
  return (b.stop - b.start) * element_size;
}

// Cut order: from segment 0 when the second half's ready ranks sum to less than the first's.
bool cut_from_segment_zero(const Ints& ready_rank) {
  const size_t half = ready_rank.size() / 2;
  int64_t first = 0, second = 0;
  for (size_t i = 0; i < ready_rank.size(); ++i) (i < half ? first : second) += ready_rank[i];
  return half > 0 && second < first;
}

std::string members_text(const FlatBucket& b) {
  std::string s = "{";
  for (size_t k = 0; k < b.members.size(); ++k) {
    s += (k ? ", " : "") + std::to_string(b.members[k]);
  }
  return s + "}";
}

// Every documented property of a plan; together they determine the plan (greedy cuts are
// the only ones where each bucket fits its limit, or is one segment, and could not take the
// next segment).
void expect_valid_plan(const Ints& offsets, const Ints& ready_rank, int64_t element_size,
                       int64_t bucket_bytes, int64_t last_bucket_bytes,
                       const std::vector<FlatBucket>& plan) {
  const int64_t count = static_cast<int64_t>(offsets.size()) - 1;
  if (count == 0) {
    EXPECT_TRUE(plan.empty());
    return;
  }
  ASSERT_FALSE(plan.empty());
  for (size_t k = 1; k < plan.size(); ++k) {
    const bool sorted = plan[k - 1].ready_at < plan[k].ready_at ||
                        (plan[k - 1].ready_at == plan[k].ready_at &&
                         plan[k - 1].start <= plan[k].start);
    EXPECT_TRUE(sorted) << "buckets " << k - 1 << " and " << k << " out of (ready_at, start) order";
  }
  for (const FlatBucket& b : plan) {
    ASSERT_FALSE(b.members.empty());
    for (size_t k = 1; k < b.members.size(); ++k) {
      ASSERT_EQ(b.members[k], b.members[k - 1] + 1) << "members " << members_text(b);
    }
    EXPECT_EQ(b.start, offsets[static_cast<size_t>(b.members.front())]);
    EXPECT_EQ(b.stop, offsets[static_cast<size_t>(b.members.back()) + 1]);
    int64_t ready = -1;
    for (int64_t i : b.members) ready = std::max(ready, ready_rank[static_cast<size_t>(i)]);
    EXPECT_EQ(b.ready_at, ready) << "bucket " << members_text(b);
  }

  // Partition: in segment order the buckets cover 0 .. count - 1 once, and the buffer exactly.
  std::vector<FlatBucket> cut = plan;
  std::sort(cut.begin(), cut.end(), [](const FlatBucket& a, const FlatBucket& b) {
    return a.members.front() < b.members.front();
  });
  int64_t next = 0;
  for (const FlatBucket& b : cut) {
    ASSERT_EQ(b.members.front(), next) << "bucket " << members_text(b);
    next = b.members.back() + 1;
  }
  ASSERT_EQ(next, count);
  EXPECT_EQ(cut.front().start, offsets.front());
  EXPECT_EQ(cut.back().stop, offsets.back());
  for (size_t k = 1; k < cut.size(); ++k) EXPECT_EQ(cut[k].start, cut[k - 1].stop);

  // Sizes, in the order the buckets were cut: limits double from the last bucket's.
  if (!cut_from_segment_zero(ready_rank)) std::reverse(cut.begin(), cut.end());
  int64_t limit = std::min(bucket_bytes, last_bucket_bytes);
  for (size_t k = 0; k < cut.size(); ++k) {
    const FlatBucket& b = cut[k];
    const int64_t bytes = bucket_bytes_of(b, element_size);
    EXPECT_TRUE(bytes <= limit || b.members.size() == 1)
        << "bucket " << members_text(b) << " of " << bytes << " bytes over its limit " << limit;
    if (k + 1 < cut.size()) {
      const FlatBucket& after = cut[k + 1];
      const int64_t following =
          cut_from_segment_zero(ready_rank) ? after.members.front() : after.members.back();
      EXPECT_GT(bytes + segment_bytes(offsets, following, element_size), limit)
          << "bucket " << members_text(b) << " could have taken segment " << following;
    }
    limit = std::min(2 * limit, bucket_bytes);
  }
}

// Rank parts of a bucket: equal, in rank order, tiling it, on 16-byte vectors; and what each
// touches agrees with the definition.
void expect_slices_tile(const Ints& offsets, const FlatBucket& b, int64_t world,
                        int64_t element_size) {
  const int64_t vector = 16 / element_size;
  int64_t at = b.start;
  Ints touched;
  for (int64_t r = 0; r < world; ++r) {
    const ShardSlice s = shard_slice(b.start, b.stop, world, r);
    EXPECT_EQ(s.start, at);
    EXPECT_EQ((s.stop - s.start) * world, b.stop - b.start);
    EXPECT_EQ(s.start % vector, 0) << "rank " << r << " starts off a 16-byte vector";
    EXPECT_EQ(s.range_start, b.start);
    EXPECT_EQ(s.range_count, b.stop - b.start);
    at = s.stop;

    const SliceSegments seg = slice_segments(offsets, s.start, s.stop, element_size);
    EXPECT_EQ(seg.members, touched_segments(offsets, s.start, s.stop));
    ASSERT_EQ(seg.local_offsets.size(), seg.members.size() + 1);
    for (size_t k = 0; k < seg.members.size(); ++k) {
      EXPECT_EQ(s.start + seg.local_offsets[k],
                std::max(offsets[static_cast<size_t>(seg.members[k])], s.start));
      touched.push_back(seg.members[k]);
    }
    EXPECT_EQ(seg.local_offsets.back(), s.stop - s.start);
  }
  EXPECT_EQ(at, b.stop);
  // Every non-empty segment of the bucket is touched by some rank, and nothing outside it.
  for (int64_t i : touched) {
    EXPECT_TRUE(i >= b.members.front() && i <= b.members.back()) << "segment " << i;
  }
  for (int64_t i : b.members) {
    if (segment_bytes(offsets, i, element_size) == 0) continue;
    EXPECT_NE(std::find(touched.begin(), touched.end(), i), touched.end()) << "segment " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Segment alignment: lcm(256, 16 * world) bytes, hand-computed per dtype and world.

struct AlignCase {
  std::string name;
  int64_t element_size;
  int64_t world;
  int64_t align;  // elements
};

void PrintTo(const AlignCase& c, std::ostream* os) { *os << c.name; }

class SegmentAlignment : public testing::TestWithParam<AlignCase> {};

TEST_P(SegmentAlignment, IsLcmOf256BytesAndWorldVectors) {
  const AlignCase& c = GetParam();
  EXPECT_EQ(flat_segment_alignment(c.element_size, c.world), c.align);
  // Every segment of a random layout starts on that alignment and holds its tensor.
  std::mt19937_64 rng(static_cast<uint64_t>(c.element_size * 1000 + c.world));
  Ints numels(40);
  for (int64_t& n : numels) n = static_cast<int64_t>(rng() % 5000);
  numels[3] = 0;
  numels[7] = c.align;
  numels[8] = c.align + 1;
  const Ints offsets = flat_segment_offsets(numels, c.element_size, c.world);
  ASSERT_EQ(offsets.size(), numels.size() + 1);
  EXPECT_EQ(offsets[0], 0);
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t length = offsets[i + 1] - offsets[i];
    EXPECT_EQ(offsets[i] * c.element_size % 256, 0);
    EXPECT_EQ(length % (c.world * 16 / c.element_size), 0);
    EXPECT_GE(length, numels[i]);
    EXPECT_LT(length, numels[i] + c.align);
  }
  EXPECT_EQ(offsets[8] - offsets[7], c.align);
  EXPECT_EQ(offsets[9] - offsets[8], 2 * c.align);
}

INSTANTIATE_TEST_SUITE_P(
    FlatLayout, SegmentAlignment,
    testing::Values(AlignCase{"fp8_world1", 1, 1, 256}, AlignCase{"fp8_world3", 1, 3, 768},
                    AlignCase{"fp8_world24", 1, 24, 768}, AlignCase{"fp16_world1", 2, 1, 128},
                    AlignCase{"fp16_world2", 2, 2, 128}, AlignCase{"fp16_world3", 2, 3, 384},
                    AlignCase{"fp16_world8", 2, 8, 128}, AlignCase{"fp16_world32", 2, 32, 256},
                    AlignCase{"fp32_world1", 4, 1, 64}, AlignCase{"fp32_world3", 4, 3, 192},
                    AlignCase{"fp32_world6", 4, 6, 192}, AlignCase{"fp32_world16", 4, 16, 64},
                    AlignCase{"fp64_world1", 8, 1, 32}, AlignCase{"fp64_world3", 8, 3, 96},
                    AlignCase{"fp64_world8", 8, 8, 32}, AlignCase{"complex128_world5", 16, 5, 80}),
    [](const testing::TestParamInfo<AlignCase>& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------
// Segment offsets, by hand.

TEST(FlatSegmentOffsets, Float32RoundsEachTensorUpTo64Elements) {
  // 1000 -> 1024, 1 -> 64, 0 -> 0, 64 -> 64.
  EXPECT_EQ(flat_segment_offsets({1000, 1, 0, 64}, 4, 1), (Ints{0, 1024, 1088, 1088, 1152}));
}

TEST(FlatSegmentOffsets, Float16OverThreeRanksRoundsTo384Elements) {
  // The header's worked example: lcm(128, 3 * 8) = 384.
  EXPECT_EQ(flat_segment_offsets({1000, 384, 385}, 2, 3), (Ints{0, 1152, 1536, 2304}));
}

TEST(FlatSegmentOffsets, NoTensorsGiveOneOffset) {
  EXPECT_EQ(flat_segment_offsets({}, 4, 1), (Ints{0}));
  EXPECT_EQ(flat_segment_offsets({}, 2, 7), (Ints{0}));
}

TEST(FlatSegmentOffsets, EmptyTensorsHaveEmptySegments) {
  EXPECT_EQ(flat_segment_offsets({0, 0, 0}, 2, 3), (Ints{0, 0, 0, 0}));
  EXPECT_EQ(flat_segment_offsets({0, 5, 0}, 2, 1), (Ints{0, 0, 128, 128}));
}

TEST(FlatSegmentOffsets, TensorOver2To31ElementsKeepsExactOffsets) {
  // 3'000'000'001 float16 elements over 3 ranks: 7'812'501 blocks of 384.
  EXPECT_EQ(flat_segment_offsets({3'000'000'001, 1}, 2, 3),
            (Ints{0, 3'000'000'384, 3'000'000'768}));
}

// ---------------------------------------------------------------------------------------------
// Buckets, by hand.

struct BucketCase {
  std::string name;
  Ints offsets;
  Ints ready_rank;
  int64_t element_size;
  int64_t bucket_bytes;
  int64_t last_bucket_bytes;
  std::vector<Ints> members;  // expected, in the returned order
  Ints ready_at;              // expected, in the returned order
};

void PrintTo(const BucketCase& c, std::ostream* os) { *os << c.name; }

Ints even_offsets(int64_t count, int64_t size) {
  Ints offsets(static_cast<size_t>(count) + 1);
  for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = static_cast<int64_t>(i) * size;
  return offsets;
}

std::vector<BucketCase> bucket_cases() {
  const Ints backward = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0};  // segment 0 arrives last
  const Ints forward = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};   // segment 9 arrives last
  return {
      // The header's worked example: ten 400-byte segments, limits 400, 800, 1600, 1600.
      {"limits_double_from_the_segment_that_arrives_last", even_offsets(10, 100), backward, 4,
       1600, 400, {{7, 8, 9}, {3, 4, 5, 6}, {1, 2}, {0}}, {2, 6, 8, 9}},
      {"cut_from_the_high_end_when_it_arrives_last", even_offsets(10, 100), forward, 4, 1600,
       400, {{0, 1, 2}, {3, 4, 5, 6}, {7, 8}, {9}}, {2, 6, 8, 9}},
      // bucket_bytes under last_bucket_bytes: every limit is bucket_bytes (1000 bytes).
      {"bucket_bytes_caps_the_last_bucket_too", even_offsets(10, 100), backward, 4, 1000, 4000,
       {{8, 9}, {6, 7}, {4, 5}, {2, 3}, {0, 1}}, {1, 3, 5, 7, 9}},
      // Segment 1 (20000 bytes) exceeds every limit: it is a bucket alone, and so are its
      // neighbours, which do not fit beside it.
      {"segment_over_every_limit_is_a_bucket_alone", {0, 10, 5010, 5020}, {2, 1, 0}, 4, 1000,
       400, {{2}, {1}, {0}}, {0, 1, 2}},
      // Empty segment 1 joins segment 0 (256 + 0 bytes fit the first limit of 256).
      {"empty_segment_joins_the_bucket_being_filled", {0, 64, 64, 128}, {2, 1, 0}, 4, 1024, 256,
       {{2}, {0, 1}}, {0, 2}},
      // After an oversized segment, an empty one cannot join it (that bucket is over its
      // limit) and opens the next bucket, which segment 2 joins under the limit of 400.
      {"empty_segment_after_an_oversized_one_opens_a_bucket", {0, 64, 64, 128}, {2, 1, 0}, 4,
       1024, 200, {{1, 2}, {0}}, {1, 2}},
      // Limits 100, 200: segment 2 (256 bytes) does not fit beside the empty segment 1 either,
      // which is left a bucket of its own, [64, 64).
      {"empty_segment_between_oversized_ones_is_an_empty_bucket", {0, 64, 64, 128}, {2, 1, 0},
       4, 1024, 100, {{2}, {1}, {0}}, {0, 1, 2}},
      // Equal ranks cut from segment 2 into {2} = [64, 128), {1} = [64, 64), {0}: the first
      // two tie on (ready_at, start) and keep the order they were cut in.
      {"ties_in_ready_at_and_start_keep_the_cut_order", {0, 64, 64, 128}, {0, 0, 0}, 4, 1024,
       100, {{0}, {2}, {1}}, {0, 0, 0}},
      {"one_segment_is_one_bucket", {0, 4096}, {0}, 2, 100, 100, {{0}}, {0}},
      {"whole_buffer_fits_one_bucket", even_offsets(5, 64), {4, 3, 2, 1, 0}, 4, 1 << 20, 1 << 20,
       {{0, 1, 2, 3, 4}}, {4}},
      // All ranks equal: the halves tie, so cutting starts at the high end; ready_at ties
      // are broken by start.
      {"equal_ready_ranks_sort_by_start", even_offsets(4, 100), {0, 0, 0, 0}, 4, 400, 400,
       {{0}, {1}, {2}, {3}}, {0, 0, 0, 0}},
      // Odd count: the middle segment belongs to the second half. Ranks {4, 2, 3, 0, 1} sum
      // to 6 over segments 0-1 and to 4 over segments 2-4, so cutting starts at segment 0.
      {"odd_count_puts_the_middle_segment_in_the_second_half", even_offsets(5, 100),
       {4, 2, 3, 0, 1}, 4, 800, 400, {{3, 4}, {1, 2}, {0}}, {1, 3, 4}},
      {"no_segments_no_buckets", {0}, {}, 4, 100, 100, {}, {}},
  };
}

class HandBuckets : public testing::TestWithParam<BucketCase> {};

TEST_P(HandBuckets, MatchHandComputedPlan) {
  const BucketCase& c = GetParam();
  const std::vector<FlatBucket> plan =
      plan_buckets(c.offsets, c.ready_rank, c.element_size, c.bucket_bytes, c.last_bucket_bytes);
  std::vector<Ints> members;
  Ints ready_at;
  for (const FlatBucket& b : plan) {
    members.push_back(b.members);
    ready_at.push_back(b.ready_at);
  }
  EXPECT_EQ(members, c.members);
  EXPECT_EQ(ready_at, c.ready_at);
  expect_valid_plan(c.offsets, c.ready_rank, c.element_size, c.bucket_bytes,
                    c.last_bucket_bytes, plan);
}

INSTANTIATE_TEST_SUITE_P(FlatLayout, HandBuckets, testing::ValuesIn(bucket_cases()),
                         [](const testing::TestParamInfo<BucketCase>& info) {
                           return info.param.name;
                         });

TEST(PlanBuckets, BucketsCarryTheirElementRanges) {
  const std::vector<FlatBucket> plan =
      plan_buckets({0, 64, 64, 128}, {2, 1, 0}, 4, 1024, 256);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].start, 64);
  EXPECT_EQ(plan[0].stop, 128);
  EXPECT_EQ(plan[1].start, 0);
  EXPECT_EQ(plan[1].stop, 64);
}

TEST(PlanBuckets, OffsetsNeedNotStartAtZero) {
  // A bucket plan over part of a buffer: the same cuts, shifted.
  const std::vector<FlatBucket> plan = plan_buckets({1000, 1100, 1200, 1300}, {2, 1, 0}, 4, 800,
                                                    400);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].members, (Ints{1, 2}));
  EXPECT_EQ(plan[0].start, 1100);
  EXPECT_EQ(plan[1].members, (Ints{0}));
  EXPECT_EQ(plan[1].stop, 1100);
}

// ---------------------------------------------------------------------------------------------
// Shard slices and the segments they touch, by hand.

TEST(ShardSlice, RanksTakeEqualPartsInOrder) {
  // The header's worked example: bucket [1536, 2304) over 3 ranks, parts of 256.
  const ShardSlice s0 = shard_slice(1536, 2304, 3, 0);
  const ShardSlice s1 = shard_slice(1536, 2304, 3, 1);
  const ShardSlice s2 = shard_slice(1536, 2304, 3, 2);
  EXPECT_EQ(s0.start, 1536);
  EXPECT_EQ(s0.stop, 1792);
  EXPECT_EQ(s1.start, 1792);
  EXPECT_EQ(s1.stop, 2048);
  EXPECT_EQ(s2.start, 2048);
  EXPECT_EQ(s2.stop, 2304);
  for (const ShardSlice& s : {s0, s1, s2}) {
    EXPECT_EQ(s.range_start, 1536);
    EXPECT_EQ(s.range_count, 768);
  }
}

TEST(ShardSlice, OneRankTakesTheWholeBucketAndEmptyBucketsGiveEmptyParts) {
  const ShardSlice whole = shard_slice(128, 640, 1, 0);
  EXPECT_EQ(whole.start, 128);
  EXPECT_EQ(whole.stop, 640);
  const ShardSlice empty = shard_slice(64, 64, 4, 3);
  EXPECT_EQ(empty.start, 64);
  EXPECT_EQ(empty.stop, 64);
  EXPECT_EQ(empty.range_count, 0);
}

TEST(SliceSegments, SliceStraddlingThreeSegments) {
  // The header's worked example: float16 offsets {0, 1152, 1536, 2304}, slice [1024, 1792).
  const SliceSegments s = slice_segments({0, 1152, 1536, 2304}, 1024, 1792, 2);
  EXPECT_EQ(s.members, (Ints{0, 1, 2}));
  EXPECT_EQ(s.local_offsets, (Ints{0, 128, 512, 768}));
}

TEST(SliceSegments, SliceOnSegmentBoundariesTakesOnlyWholeSegments) {
  const SliceSegments s = slice_segments({0, 1152, 1536, 2304}, 1152, 1536, 2);
  EXPECT_EQ(s.members, (Ints{1}));
  EXPECT_EQ(s.local_offsets, (Ints{0, 384}));
  const SliceSegments all = slice_segments({0, 1152, 1536, 2304}, 0, 2304, 2);
  EXPECT_EQ(all.members, (Ints{0, 1, 2}));
  EXPECT_EQ(all.local_offsets, (Ints{0, 1152, 1536, 2304}));
}

TEST(SliceSegments, SliceInsideOneSegment) {
  const SliceSegments s = slice_segments({0, 1152, 1536, 2304}, 1600, 1608, 2);
  EXPECT_EQ(s.members, (Ints{2}));
  EXPECT_EQ(s.local_offsets, (Ints{0, 8}));
}

TEST(SliceSegments, EmptySegmentsCountOnlyStrictlyInside) {
  // Empty segments 1 and 2 sit at 64: inside [0, 128), on the edge of [64, 128).
  const Ints offsets = {0, 64, 64, 64, 128};
  EXPECT_EQ(slice_segments(offsets, 0, 128, 4).members, (Ints{0, 1, 2, 3}));
  EXPECT_EQ(slice_segments(offsets, 0, 128, 4).local_offsets, (Ints{0, 64, 64, 64, 128}));
  EXPECT_EQ(slice_segments(offsets, 64, 128, 4).members, (Ints{3}));
  EXPECT_EQ(slice_segments(offsets, 0, 64, 4).members, (Ints{0}));
}

TEST(SliceSegments, EmptySlicesTouchOnlyTheSegmentAroundThem) {
  const Ints offsets = {0, 1152, 1536, 2304};
  EXPECT_EQ(slice_segments(offsets, 8, 8, 2).members, (Ints{0}));
  EXPECT_EQ(slice_segments(offsets, 8, 8, 2).local_offsets, (Ints{0, 0}));
  EXPECT_TRUE(slice_segments(offsets, 1152, 1152, 2).members.empty());
  EXPECT_EQ(slice_segments(offsets, 2304, 2304, 2).local_offsets, (Ints{0}));
  EXPECT_TRUE(slice_segments({0}, 0, 0, 4).members.empty());
}

// ---------------------------------------------------------------------------------------------
// Random layouts: offsets, plans and shards against the definitions.

struct RandomCase {
  std::string name;
  int64_t element_size;
  int64_t world;
};

void PrintTo(const RandomCase& c, std::ostream* os) { *os << c.name; }

class RandomLayouts : public testing::TestWithParam<RandomCase> {};

constexpr int kSeeds = 150;

struct RandomInput {
  Ints numels;
  Ints ready_rank;
  int64_t bucket_bytes = 0;
  int64_t last_bucket_bytes = 0;
};

RandomInput random_input(uint64_t seed, int64_t element_size) {
  std::mt19937_64 rng(seed);
  auto uniform = [&rng](int64_t lo, int64_t hi) {  // in [lo, hi]
    return lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(hi - lo + 1));
  };
  RandomInput in;
  const int64_t count = uniform(0, 60);
  const int64_t largest = uniform(0, 2) == 0 ? 100 : 200000;
  for (int64_t i = 0; i < count; ++i) {
    in.numels.push_back(uniform(0, 9) == 0 ? 0 : uniform(1, largest));
  }
  in.ready_rank.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) in.ready_rank[static_cast<size_t>(i)] = i;
  switch (uniform(0, 3)) {
    case 0:  // a backward: the last segments first
      std::reverse(in.ready_rank.begin(), in.ready_rank.end());
      break;
    case 1:
      std::shuffle(in.ready_rank.begin(), in.ready_rank.end(), rng);
      break;
    case 2:  // ties and gaps, as several dtypes' buffers share one order
      for (int64_t& r : in.ready_rank) r = uniform(0, count);
      break;
    default:
      break;
  }
  // From limits below one segment (every segment alone) to above the whole buffer.
  const int64_t scale = largest * element_size;
  in.bucket_bytes = uniform(1, 4 * scale);
  in.last_bucket_bytes = uniform(0, 1) ? uniform(1, scale) : uniform(1, 8 * scale);
  return in;
}

TEST_P(RandomLayouts, PlansPartitionTheBufferIntoWholeSegmentsWithinTheirLimits) {
  const RandomCase& c = GetParam();
  for (int seed = 0; seed < kSeeds; ++seed) {
    SCOPED_TRACE("seed=" + std::to_string(seed));
    const RandomInput in = random_input(static_cast<uint64_t>(seed) * 7919 + 17, c.element_size);
    const Ints offsets = flat_segment_offsets(in.numels, c.element_size, c.world);
    const std::vector<FlatBucket> plan = plan_buckets(offsets, in.ready_rank, c.element_size,
                                                      in.bucket_bytes, in.last_bucket_bytes);
    expect_valid_plan(offsets, in.ready_rank, c.element_size, in.bucket_bytes,
                      in.last_bucket_bytes, plan);
    if (testing::Test::HasFatalFailure()) return;
  }
}

TEST_P(RandomLayouts, RankSlicesTileEveryBucketOnWholeVectors) {
  const RandomCase& c = GetParam();
  for (int seed = 0; seed < kSeeds; ++seed) {
    SCOPED_TRACE("seed=" + std::to_string(seed));
    const RandomInput in = random_input(static_cast<uint64_t>(seed) * 104729 + 3, c.element_size);
    const Ints offsets = flat_segment_offsets(in.numels, c.element_size, c.world);
    for (const FlatBucket& b : plan_buckets(offsets, in.ready_rank, c.element_size,
                                            in.bucket_bytes, in.last_bucket_bytes)) {
      expect_slices_tile(offsets, b, c.world, c.element_size);
      if (testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST_P(RandomLayouts, AnyVectorSliceTouchesTheSegmentsItOverlaps) {
  const RandomCase& c = GetParam();
  const int64_t vector = 16 / c.element_size;
  for (int seed = 0; seed < kSeeds; ++seed) {
    SCOPED_TRACE("seed=" + std::to_string(seed));
    const RandomInput in = random_input(static_cast<uint64_t>(seed) * 31 + 5, c.element_size);
    const Ints offsets = flat_segment_offsets(in.numels, c.element_size, c.world);
    std::mt19937_64 rng(static_cast<uint64_t>(seed));
    const uint64_t vectors = static_cast<uint64_t>(offsets.back() / vector) + 1;
    for (int trial = 0; trial < 20; ++trial) {
      int64_t start = static_cast<int64_t>(rng() % vectors) * vector;
      int64_t stop = static_cast<int64_t>(rng() % vectors) * vector;
      if (start > stop) std::swap(start, stop);
      const SliceSegments s = slice_segments(offsets, start, stop, c.element_size);
      const Ints members = touched_segments(offsets, start, stop);
      ASSERT_EQ(s.members, members) << "slice [" << start << ", " << stop << ")";
      Ints local;
      for (int64_t i : members) {
        local.push_back(std::max(offsets[static_cast<size_t>(i)], start) - start);
      }
      local.push_back(stop - start);
      ASSERT_EQ(s.local_offsets, local) << "slice [" << start << ", " << stop << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    FlatLayout, RandomLayouts,
    testing::Values(RandomCase{"fp8_world1", 1, 1}, RandomCase{"fp8_world3", 1, 3},
                    RandomCase{"fp16_world1", 2, 1}, RandomCase{"fp16_world2", 2, 2},
                    RandomCase{"fp16_world3", 2, 3}, RandomCase{"fp16_world8", 2, 8},
                    RandomCase{"fp32_world1", 4, 1}, RandomCase{"fp32_world3", 4, 3},
                    RandomCase{"fp32_world4", 4, 4}, RandomCase{"fp32_world24", 4, 24},
                    RandomCase{"fp64_world1", 8, 1}, RandomCase{"fp64_world5", 8, 5}),
    [](const testing::TestParamInfo<RandomCase>& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------
// Bad input.

struct ErrorCase {
  std::string name;
  std::function<void()> call;
  std::string message;  // must appear in what()
};

void PrintTo(const ErrorCase& c, std::ostream* os) { *os << c.name; }

class BadLayoutInput : public testing::TestWithParam<ErrorCase> {};

TEST_P(BadLayoutInput, ThrowsInvalidArgumentSayingWhatWasWrong) {
  const ErrorCase& c = GetParam();
  try {
    c.call();
    FAIL() << "expected nimble_train::InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos) << e.what();
  }
}

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

INSTANTIATE_TEST_SUITE_P(
    FlatLayout, BadLayoutInput,
    testing::Values(
        ErrorCase{"offsets_element_size_3", [] { flat_segment_offsets({1}, 3, 1); },
                  "element_size must be a divisor of 16 bytes (1, 2, 4, 8 or 16); got 3"},
        ErrorCase{"offsets_element_size_0", [] { flat_segment_offsets({1}, 0, 1); },
                  "element_size must be a divisor of 16 bytes (1, 2, 4, 8 or 16); got 0"},
        ErrorCase{"offsets_element_size_32", [] { flat_segment_offsets({1}, 32, 1); },
                  "element_size must be a divisor of 16 bytes (1, 2, 4, 8 or 16); got 32"},
        ErrorCase{"offsets_shard_world_0", [] { flat_segment_offsets({1}, 4, 0); },
                  "shard_world must be >= 1 (1: the state is not sharded); got 0"},
        ErrorCase{"offsets_negative_numel", [] { flat_segment_offsets({4, -1}, 4, 1); },
                  "numels must be >= 0; got numels[1] = -1"},
        ErrorCase{"offsets_past_int64", [] { flat_segment_offsets({64, kMax - 100}, 4, 1); },
                  "tensor 1 of 9223372036854775707 elements, padded to a multiple of 64, does "
                  "not fit after 64"},
        ErrorCase{"plan_count_mismatch", [] { plan_buckets({0, 1, 2, 3}, {0, 1}, 4, 100, 100); },
                  "3 segments but 2 ready ranks"},
        ErrorCase{"plan_no_offsets", [] { plan_buckets({}, {}, 4, 100, 100); },
                  "offsets must have num_segments + 1 entries (at least 1, the buffer's start); "
                  "got 0"},
        ErrorCase{"plan_zero_bucket_bytes", [] { plan_buckets({0, 1}, {0}, 4, 0, 100); },
                  "bucket_bytes and last_bucket_bytes must be positive; got 0 and 100"},
        ErrorCase{"plan_zero_last_bucket_bytes", [] { plan_buckets({0, 1}, {0}, 4, 4, 0); },
                  "bucket_bytes and last_bucket_bytes must be positive; got 4 and 0"},
        ErrorCase{"plan_decreasing_offsets", [] { plan_buckets({0, 8, 4}, {0, 1}, 4, 4, 4); },
                  "offsets must be non-decreasing; got offsets[1] = 8 > offsets[2] = 4"},
        ErrorCase{"plan_negative_offset", [] { plan_buckets({-4, 8}, {0}, 4, 4, 4); },
                  "offsets must be >= 0; got offsets[0] = -4"},
        ErrorCase{"plan_negative_ready_rank", [] { plan_buckets({0, 4, 8}, {0, -1}, 4, 4, 4); },
                  "ready_rank must be >= 0 (a position in the order gradients arrive); got "
                  "ready_rank[1] = -1"},
        ErrorCase{"plan_element_size_0", [] { plan_buckets({0, 4}, {0}, 0, 4, 4); },
                  "element_size must be positive (bytes); got 0"},
        ErrorCase{"plan_bytes_past_int64", [] { plan_buckets({0, kMax / 2}, {0}, 4, 4, 4); },
                  "the buffer's size in bytes must fit in int64; got 4611686018427387903 "
                  "elements of 4 bytes"},
        ErrorCase{"plan_ranks_sum_past_int64",
                  [] { plan_buckets({0, 1, 2, 3, 4}, {kMax, 1, 0, 0}, 4, 4, 4); },
                  "the sum of ready ranks must fit in int64"},
        ErrorCase{"shard_bucket_not_divisible", [] { shard_slice(0, 1000, 3, 0); },
                  "a gradient bucket of 1000 elements does not split into 3 equal parts; the "
                  "fused optimizer must be built with shard_world equal to the number of ranks"},
        ErrorCase{"shard_rank_past_world", [] { shard_slice(0, 96, 3, 3); },
                  "rank must be in [0, 3); got 3"},
        ErrorCase{"shard_negative_rank", [] { shard_slice(0, 96, 3, -1); },
                  "rank must be in [0, 3); got -1"},
        ErrorCase{"shard_world_0", [] { shard_slice(0, 96, 0, 0); }, "world must be >= 1; got 0"},
        ErrorCase{"shard_reversed_bucket", [] { shard_slice(96, 0, 1, 0); },
                  "a bucket must satisfy 0 <= start <= stop; got [96, 0)"},
        ErrorCase{"slice_past_the_end",
                  [] { slice_segments({0, 1152, 1536, 2304}, 2048, 2312, 2); },
                  "slice [2048, 2312) must lie within the flat buffer's 2304 elements "
                  "(0 <= start <= stop <= 2304)"},
        ErrorCase{"slice_reversed", [] { slice_segments({0, 1152}, 64, 32, 2); },
                  "slice [64, 32) must lie within the flat buffer's 1152 elements"},
        ErrorCase{"slice_negative_start", [] { slice_segments({0, 1152}, -8, 32, 2); },
                  "slice [-8, 32) must lie within the flat buffer's 1152 elements"},
        ErrorCase{"slice_start_off_vector", [] { slice_segments({0, 1152}, 4, 64, 2); },
                  "slice [4, 64) of the flat buffer's 1152 elements must be cut at 16-byte "
                  "vectors: start and stop multiples of 8 elements of 2 bytes"},
        ErrorCase{"slice_stop_off_vector", [] { slice_segments({0, 64}, 0, 62, 4); },
                  "slice [0, 62) of the flat buffer's 64 elements must be cut at 16-byte "
                  "vectors: start and stop multiples of 4 elements of 4 bytes"},
        ErrorCase{"slice_element_size_6", [] { slice_segments({0, 64}, 0, 48, 6); },
                  "element_size must be a divisor of 16 bytes (1, 2, 4, 8 or 16); got 6"},
        ErrorCase{"slice_decreasing_offsets", [] { slice_segments({0, 64, 32}, 0, 16, 4); },
                  "offsets must be non-decreasing; got offsets[1] = 64 > offsets[2] = 32"}),
    [](const testing::TestParamInfo<ErrorCase>& info) { return info.param.name; });

}  // namespace
}  // namespace nimble_train::optim
