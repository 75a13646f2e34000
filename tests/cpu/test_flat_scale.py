"""flat_scale_ on the CPU against torch, and its errors."""

import pytest
import torch

from nimble_train import _C

SIZES = [1, 3, 8, 113, 278011]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_matches_torch(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    scale = torch.rand(1, generator=g) * 4 + 0.1
    # Reference: the product in float32 (float64 for float64), rounded once to the dtype.
    accum = torch.float64 if dtype == torch.float64 else torch.float32
    expected = (x.to(accum) * scale.to(accum)).to(dtype)
    _C.flat_scale_(x, scale)
    assert torch.equal(x, expected)


def test_works_on_a_view_into_a_flat_buffer():
    flat = torch.randn(100)
    before = flat.clone()
    _C.flat_scale_(flat[10:37], torch.tensor([0.5]))
    assert torch.equal(flat[10:37], before[10:37] * 0.5)
    assert torch.equal(flat[:10], before[:10]) and torch.equal(flat[37:], before[37:])


def test_rejects_non_contiguous():
    with pytest.raises(ValueError, match=r"must be contiguous.*strides \[1, 4\]"):
        _C.flat_scale_(torch.randn(4, 4).t(), torch.tensor([1.0]))


def test_rejects_bad_scale():
    with pytest.raises(ValueError, match="one-element float32 tensor; got 2 elements"):
        _C.flat_scale_(torch.randn(4), torch.ones(2))
    with pytest.raises(ValueError, match="got 1 elements of Double"):
        _C.flat_scale_(torch.randn(4), torch.ones(1, dtype=torch.float64))


def test_rejects_integer_tensor():
    with pytest.raises(ValueError, match="floating-point tensor; got Int"):
        _C.flat_scale_(torch.ones(4, dtype=torch.int32), torch.ones(1))


def test_error_names_the_source_place_not_a_machine_path():
    with pytest.raises(ValueError) as info:
        _C.flat_scale_(torch.ones(4, dtype=torch.int32), torch.ones(1))
    assert "[src/optim/boundary.cpp:" in str(info.value)
