"""tests/margins.py, the report of how close each test's comparisons came to failing, against
torch.testing.assert_close itself."""

import json

import pytest
import torch

import margins

pytest_plugins = ("pytester",)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _passes(actual, expected, **tolerances) -> bool:
    try:  # at the tolerance on purpose: not a margin for a report
        margins.unmeasured()(actual, expected, **tolerances)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("explicit", [False, True], ids=["default", "explicit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_closeness_of_one_or_less_is_what_assert_close_passes(dtype, explicit):
    """Random pairs moved by random amounts around their tolerance: closeness <= 1 exactly
    where assert_close passes (with its default tolerances, or given ones)."""
    g = torch.Generator().manual_seed(DTYPES.index(dtype))
    tolerances = {"rtol": 3e-3, "atol": 1e-4} if explicit else {}
    rtol, atol = ((tolerances["rtol"], tolerances["atol"]) if explicit
                  else margins.default_tolerances(dtype))
    agreed = 0
    for _ in range(200):
        expected = (torch.randn(64, generator=g, dtype=torch.float64)
                    * 10 ** torch.randint(-3, 3, (1,), generator=g).item()).to(dtype)
        e = expected.double()
        scale = 10 ** (torch.rand(1, generator=g, dtype=torch.float64).item() * 2 - 1)  # 0.1-10
        step = (torch.rand(64, generator=g, dtype=torch.float64) * 2 - 1) * scale
        actual = (e + step * (atol + rtol * e.abs())).to(dtype)
        c = margins.closeness(actual, expected, **tolerances)
        assert c is not None
        if abs(c - 1) < 1e-3:  # the two may round the last bit of the bound differently
            continue
        assert (c <= 1) == _passes(actual, expected, **tolerances), (c, dtype)
        agreed += 1
    assert agreed > 150


def test_closeness_over_containers_and_what_it_leaves_out():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.001])
    one = margins.closeness(a, b, rtol=1e-3, atol=0.0)  # |diff| 1e-3 against 2.001e-3
    assert one == pytest.approx(1e-3 / 2.001e-3, rel=1e-3)  # 2.001 in float32
    assert margins.closeness([a, {"x": a}], [b, {"x": b}], rtol=1e-3, atol=0.0) == one
    assert margins.closeness((a, a * 0), (b, b * 0), rtol=1e-3, atol=0.0) == one
    # bit for bit, integers, and non-finite elements have no margin to measure
    assert margins.closeness(a, a.clone(), rtol=0.0, atol=0.0) is None
    assert margins.closeness(torch.arange(3), torch.arange(3)) is None
    inf = torch.tensor([float("inf"), 1.0], dtype=torch.float64)
    moved = inf + torch.tensor([0.0, 1e-6], dtype=torch.float64)
    assert margins.closeness(inf, moved, rtol=0.0, atol=1e-5) == pytest.approx(0.1)
    assert margins.closeness(2.0, 2.001, rtol=1e-3, atol=0.0) == pytest.approx(1e-3 / 2.001e-3)


def test_a_session_reports_each_test_s_closest_comparison(pytester, tmp_path, monkeypatch):
    """An inner pytest session with the recorder: per test its closest comparison and where
    it was made; assert_close is torch's own again afterwards."""
    # (under a recorder of the outer session, the inner one's comparisons stay out of it)
    monkeypatch.setattr(torch.testing, "assert_close", margins.unmeasured())
    original = torch.testing.assert_close
    out = tmp_path / "margins.json"
    pytester.makeconftest(f"""
import margins

def pytest_configure(config):
    margins.register(config, {str(out)!r})
""")
    pytester.makepyfile(test_inner="""
import torch

def test_near():
    torch.testing.assert_close(torch.tensor([1.0]), torch.tensor([1.1]), rtol=0.0, atol=0.2)
    torch.testing.assert_close(torch.tensor([1.0]), torch.tensor([1.01]), rtol=0.0, atol=0.2)

def test_far_and_exact():
    torch.testing.assert_close(torch.tensor([1.0]), torch.tensor([1.0001]), rtol=0.0, atol=0.2)
    torch.testing.assert_close(torch.tensor([3.0]), torch.tensor([3.0]), rtol=0.0, atol=0.0)

def test_only_exact():
    torch.testing.assert_close(torch.tensor([3.0]), torch.tensor([3.0]), rtol=0.0, atol=0.0)
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*1 of 2 tests came within 3x of a tolerance*",
                                 "*0.500*test_inner.py::test_near"])
    assert torch.testing.assert_close is original
    assert margins.unmeasured() is original
    report = json.loads(out.read_text())
    assert set(report) == {"test_inner.py::test_near", "test_inner.py::test_far_and_exact"}
    near = report["test_inner.py::test_near"]
    assert near["closeness"] == pytest.approx(0.5, rel=1e-5)
    assert (near["rtol"], near["atol"], near["where"]) == (0.0, 0.2, "test_inner.py:4")
    assert report["test_inner.py::test_far_and_exact"]["closeness"] == \
        pytest.approx(0.0005, rel=1e-3)
