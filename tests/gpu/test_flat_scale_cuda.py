"""flat_scale_ on the GPU: equal to torch, reads its factor on the device, and captures."""

import pytest
import torch

import nimble_train as nt
from nimble_train import _C

pytestmark = pytest.mark.cuda

SIZES = [1, 3, 8, 113, 278011]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def reference(x, scale):
    # The kernel multiplies in float32 and rounds once to the dtype, as torch does for these.
    return (x.float() * scale.float()).to(x.dtype)


def test_cuda_is_compiled_in():
    assert nt.has_cuda(), nt.build_info()["cuda"]["reason"]


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_matches_torch(n, dtype, offset):
    g = torch.Generator(device="cuda").manual_seed(n * 7 + offset)
    # A view at `offset` elements into a larger buffer exercises the unaligned path.
    flat = torch.randn(n + offset + 5, device="cuda", generator=g).mul_(3).to(dtype)
    x = flat[offset : offset + n]
    scale = torch.rand(1, device="cuda", generator=g) * 4 + 0.1
    before = flat.clone()
    expected = reference(x, scale)
    _C.flat_scale_(x, scale)
    torch.cuda.synchronize()
    assert torch.equal(x, expected)
    # Nothing outside the view is written.
    assert torch.equal(flat[:offset], before[:offset])
    assert torch.equal(flat[offset + n :], before[offset + n :])


def test_runs_on_the_current_stream():
    x = torch.randn(1 << 20, device="cuda")
    expected = reference(x, torch.tensor([3.0], device="cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        scale = torch.full((1,), 3.0, device="cuda")
        _C.flat_scale_(x, scale)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(x, expected)


def test_factor_is_read_on_the_device_at_every_graph_replay():
    x = torch.randn(4099, device="cuda")
    scale = torch.ones(1, device="cuda")
    original = x.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _C.flat_scale_(x, scale)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(original)
    with torch.cuda.graph(graph):
        _C.flat_scale_(x, scale)
    expected = original.clone()
    for factor in (0.5, 2.0, -1.25):
        scale.fill_(factor)  # a new factor, no recapture
        graph.replay()
        expected = reference(expected, torch.tensor([factor], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(x, expected)


def test_rejects_float64_on_cuda():
    with pytest.raises(ValueError, match="float32, float16 or bfloat16; got Double"):
        _C.flat_scale_(torch.ones(4, device="cuda", dtype=torch.float64),
                       torch.ones(1, device="cuda"))


def test_rejects_scale_on_another_device():
    with pytest.raises(ValueError, match=r"scale must be on x's device \(cuda:0\); got cpu"):
        _C.flat_scale_(torch.ones(4, device="cuda"), torch.ones(1))
