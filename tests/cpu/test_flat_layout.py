"""Flat-buffer layout from Python: the C++ functions against the Python they replace.

The references below are the layout arithmetic as FusedOptimizer._build_buckets,
FusedOptimizer.shard, plan_buckets and GradientSync.pieces computed it in Python; the bound
functions must give the same answers on any input those accepted.
"""

import math
import random
import re

import pytest

import nimble_train._C as C

# ---------------------------------------------------------------------- references


def ref_offsets(numels, element_size, shard_world):
    align = math.lcm(256 // element_size, shard_world * (16 // element_size))
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + -(-n // align) * align)
    return offsets


def _ref_bucket(members, offsets, ready_rank):
    members = sorted(members)
    return (offsets[members[0]], offsets[members[-1] + 1], members,
            max(ready_rank[i] for i in members))


def ref_plan_buckets(offsets, ready_rank, element_size, bucket_bytes, last_bucket_bytes):
    count = len(offsets) - 1
    if count != len(ready_rank):
        raise ValueError(f"plan_buckets: {count} segments but {len(ready_rank)} ready ranks")
    if bucket_bytes <= 0 or last_bucket_bytes <= 0:
        raise ValueError(f"plan_buckets: bucket_bytes and last_bucket_bytes must be positive; "
                         f"got {bucket_bytes} and {last_bucket_bytes}")
    if count == 0:
        return []
    half = count // 2
    late_first = sum(ready_rank[half:]) < sum(ready_rank[:half]) if half else False
    order = range(count) if late_first else range(count - 1, -1, -1)
    buckets = []
    members = []
    size = 0
    limit = min(bucket_bytes, last_bucket_bytes)
    for i in order:
        seg = (offsets[i + 1] - offsets[i]) * element_size
        if members and size + seg > limit:
            buckets.append(_ref_bucket(members, offsets, ready_rank))
            members, size = [], 0
            limit = min(2 * limit, bucket_bytes)
        members.append(i)
        size += seg
    buckets.append(_ref_bucket(members, offsets, ready_rank))
    return sorted(buckets, key=lambda b: (b[3], b[0]))


def ref_shard_slice(start, stop, world, rank):
    size = stop - start
    if size % world:
        raise ValueError(f"a gradient bucket of {size} elements does not split into {world} "
                         "equal parts")
    part = size // world
    return (start + rank * part, start + (rank + 1) * part, start, size)


def ref_slice_segments(offsets, start, stop, element_size):
    vec = 16 // element_size
    if not 0 <= start <= stop <= offsets[-1] or start % vec or stop % vec:
        raise ValueError(f"slice [{start}, {stop}) is out of range or not cut at 16-byte vectors")
    members = [i for i in range(len(offsets) - 1) if offsets[i] < stop and offsets[i + 1] > start]
    local = [max(offsets[i], start) - start for i in members] + [stop - start]
    return members, local


# ---------------------------------------------------------------------- random inputs

ELEMENT_SIZES = [1, 2, 4, 8]
WORLDS = [1, 2, 3, 4, 6, 8, 24]


def _random_layout(rng):
    element_size = rng.choice(ELEMENT_SIZES)
    world = rng.choice(WORLDS)
    count = rng.randrange(0, 50)
    largest = rng.choice([50, 3000, 300000])
    numels = [0 if rng.random() < 0.1 else rng.randint(1, largest) for _ in range(count)]
    ready = list(range(count))
    kind = rng.randrange(4)
    if kind == 0:
        ready.reverse()  # a backward: the last segments first
    elif kind == 1:
        rng.shuffle(ready)
    elif kind == 2:
        ready = [rng.randint(0, count) for _ in range(count)]  # ties and gaps
    scale = largest * element_size
    bucket_bytes = rng.randint(1, 4 * scale)
    last_bucket_bytes = rng.randint(1, scale if rng.random() < 0.5 else 8 * scale)
    return element_size, world, numels, ready, bucket_bytes, last_bucket_bytes


# ---------------------------------------------------------------------- agreement


@pytest.mark.parametrize("seed", range(200))
def test_layout_matches_the_python_reference(seed):
    rng = random.Random(seed)
    element_size, world, numels, ready, bucket_bytes, last = _random_layout(rng)
    offsets = C.flat_segment_offsets(numels, element_size, world)
    assert offsets == ref_offsets(numels, element_size, world)

    plan = C.plan_flat_buckets(offsets, ready, element_size, bucket_bytes, last)
    assert plan == ref_plan_buckets(offsets, ready, element_size, bucket_bytes, last)

    for start, stop, members, _ in plan:
        for rank in range(world):
            piece = C.shard_slice(start, stop, world, rank)
            assert piece == ref_shard_slice(start, stop, world, rank)
            assert C.slice_segments(offsets, piece[0], piece[1], element_size) == \
                ref_slice_segments(offsets, piece[0], piece[1], element_size)


@pytest.mark.parametrize("seed", range(50))
def test_any_vector_slice_matches_the_python_reference(seed):
    rng = random.Random(1000 + seed)
    element_size, world, numels, *_ = _random_layout(rng)
    offsets = ref_offsets(numels, element_size, world)
    vec = 16 // element_size
    for _ in range(30):
        start, stop = sorted(rng.randrange(offsets[-1] // vec + 1) * vec for _ in range(2))
        assert C.slice_segments(offsets, start, stop, element_size) == \
            ref_slice_segments(offsets, start, stop, element_size)


@pytest.mark.parametrize("seed", range(50))
def test_plans_over_unpadded_offsets_match_the_python_reference(seed):
    # plan_buckets takes any non-decreasing offsets, not only padded ones.
    rng = random.Random(5000 + seed)
    count = rng.randrange(0, 40)
    offsets = [rng.randrange(0, 100)]
    for _ in range(count):
        offsets.append(offsets[-1] + rng.choice([0, rng.randint(1, 3000)]))
    ready = rng.sample(range(2 * count + 1), count)
    element_size = rng.choice([1, 2, 3, 4, 8])
    bucket_bytes, last = rng.randint(1, 20000), rng.randint(1, 20000)
    assert C.plan_flat_buckets(offsets, ready, element_size, bucket_bytes, last) == \
        ref_plan_buckets(offsets, ready, element_size, bucket_bytes, last)


# ---------------------------------------------------------------------- by hand


def test_worked_examples():
    assert C.flat_segment_offsets([1000, 384, 385], 2, 3) == [0, 1152, 1536, 2304]
    assert C.flat_segment_offsets([], 4, 1) == [0]
    assert C.flat_segment_offsets([3_000_000_001], 2, 3) == [0, 3_000_000_384]
    offsets = [100 * i for i in range(11)]
    plan = C.plan_flat_buckets(offsets, list(range(9, -1, -1)), 4, 1600, 400)
    assert [members for _, _, members, _ in plan] == [[7, 8, 9], [3, 4, 5, 6], [1, 2], [0]]
    assert plan[0] == (700, 1000, [7, 8, 9], 2)
    assert C.plan_flat_buckets([0], [], 4, 100, 100) == []
    assert C.shard_slice(1536, 2304, 3, 1) == (1792, 2048, 1536, 768)
    assert C.slice_segments([0, 1152, 1536, 2304], 1024, 1792, 2) == ([0, 1, 2], [0, 128, 512, 768])


def test_keyword_arguments_and_result_types():
    offsets = C.flat_segment_offsets(numels=[10, 20], element_size=4, shard_world=2)
    assert isinstance(offsets, list) and offsets == [0, 64, 128]
    plan = C.plan_flat_buckets(offsets=offsets, ready_rank=[1, 0], element_size=4,
                               bucket_bytes=1 << 20, last_bucket_bytes=1 << 10)
    assert isinstance(plan, list) and isinstance(plan[0], tuple)
    assert plan == [(0, 128, [0, 1], 1)]
    piece = C.shard_slice(bucket_start=0, bucket_stop=128, world=2, rank=1)
    assert isinstance(piece, tuple) and piece == (64, 128, 0, 128)
    members, local = C.slice_segments(offsets=offsets, start=32, stop=96, element_size=4)
    assert (members, local) == ([0, 1], [0, 32, 64])


def test_every_function_has_a_docstring_with_units():
    for name in ("flat_segment_offsets", "plan_flat_buckets", "shard_slice", "slice_segments"):
        doc = getattr(C, name).__doc__
        assert "elements" in doc and "ValueError" in doc, name


# ---------------------------------------------------------------------- errors


def _raises(message):
    return pytest.raises(ValueError, match=re.escape(message))


def test_offsets_reject_bad_input():
    with _raises("element_size must be a divisor of 16 bytes (1, 2, 4, 8 or 16); got 3"):
        C.flat_segment_offsets([1], 3, 1)
    with _raises("shard_world must be >= 1 (1: the state is not sharded); got 0"):
        C.flat_segment_offsets([1], 4, 0)
    with _raises("numels must be >= 0; got numels[1] = -5"):
        C.flat_segment_offsets([1, -5], 4, 1)


def test_bucket_planning_rejects_bad_input_as_the_python_did():
    # The messages plan_buckets raised, word for word.
    with _raises("3 segments but 2 ready ranks"):
        C.plan_flat_buckets([0, 1, 2, 3], [0, 1], 4, 100, 100)
    with _raises("bucket_bytes and last_bucket_bytes must be positive; got 0 and 100"):
        C.plan_flat_buckets([0, 1], [0], 4, 0, 100)
    with _raises("bucket_bytes and last_bucket_bytes must be positive; got 4 and 0"):
        C.plan_flat_buckets([0, 1], [0], 4, 4, 0)
    with _raises("offsets must be non-decreasing; got offsets[1] = 8 > offsets[2] = 4"):
        C.plan_flat_buckets([0, 8, 4], [0, 1], 4, 4, 4)
    with _raises("ready_rank must be >= 0"):
        C.plan_flat_buckets([0, 4, 8], [0, -1], 4, 4, 4)


def test_shard_slice_rejects_a_bucket_that_does_not_split():
    with _raises("a gradient bucket of 1000 elements does not split into 3 equal parts; the "
                 "fused optimizer must be built with shard_world equal to the number of ranks"):
        C.shard_slice(0, 1000, 3, 0)
    with _raises("rank must be in [0, 3); got 3"):
        C.shard_slice(0, 96, 3, 3)


def test_slice_segments_rejects_slices_out_of_range_or_off_vectors():
    offsets = [0, 1152, 1536, 2304]
    with _raises("slice [2048, 2312) must lie within the flat buffer's 2304 elements "
                 "(0 <= start <= stop <= 2304)"):
        C.slice_segments(offsets, 2048, 2312, 2)
    with _raises("slice [4, 64) of the flat buffer's 2304 elements must be cut at 16-byte "
                 "vectors: start and stop multiples of 8 elements of 2 bytes"):
        C.slice_segments(offsets, 4, 64, 2)


@pytest.mark.parametrize("seed", range(100))
def test_rejects_exactly_the_slices_the_python_rejected(seed):
    rng = random.Random(9000 + seed)
    element_size = rng.choice(ELEMENT_SIZES)
    offsets = ref_offsets([rng.randint(0, 500) for _ in range(rng.randrange(0, 6))],
                          element_size, rng.choice(WORLDS))
    start, stop = rng.randint(-20, offsets[-1] + 20), rng.randint(-20, offsets[-1] + 20)
    try:
        expected = ref_slice_segments(offsets, start, stop, element_size)
    except ValueError:
        with pytest.raises(ValueError, match=rf"slice \[{start}, {stop}\)"):
            C.slice_segments(offsets, start, stop, element_size)
    else:
        assert C.slice_segments(offsets, start, stop, element_size) == expected
