"""Core ops against torch's own (an independent oracle), for one row (decode) and many (prefill)."""

import numba
import numpy as np
import pytest

from pyml.core import ops


@pytest.fixture
def rng():
    return np.random.default_rng(11)


@numba.njit  # not cached: its cache would be stamped with this file only, not with ops.py
def _exp32_all(x, out):
    for i in range(x.size):
        out[i] = ops.exp32(x[i])
    return out


def test_exp32_is_float32_accurate_over_its_range():
    x = np.linspace(-87.0, 88.0, 200_001).astype(np.float32)
    got = _exp32_all(x, np.empty_like(x)).astype(np.float64)
    ref = np.exp(x.astype(np.float64))
    ulp = np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - ref) / ulp) < 1.0
    # clamped outside: tiny and finite below, huge and finite above (callers add 1 or divide)
    edge = _exp32_all(np.array([-1e4, -100, 100, 1e4], np.float32), np.empty(4, np.float32))
    assert 0 < edge[0] == edge[1] < 1e-37 and np.isfinite(edge[2]) and edge[2] == edge[3] > 1e38


@numba.njit  # not cached, as _exp32_all
def _max32_rows(x, widths, out):
    for r in range(x.shape[0]):
        out[r] = ops.max32(x[r], widths[r])
    return out


def test_max32_is_numpys_max(rng):
    x = (rng.standard_normal((400, 70)) * np.logspace(-40, 38, 400)[:, None]).astype(np.float32)
    x[rng.random(x.shape) < 0.2] = -np.inf  # masked scores
    x[::7] = -np.inf
    x[3, :5] = [-0.0, 0.0, -1e-45, 1e-45, -np.float32(3.4e38)]
    widths = rng.integers(1, 71, 400)
    widths[3] = 5
    got = _max32_rows(x, widths, np.empty(400, np.float32))
    want = np.array([x[r, :widths[r]].max() for r in range(400)], np.float32)
    assert np.array_equal(got, want)
    assert got[3] == np.float32(1e-45) and np.all(got[::7] == -np.inf)


@pytest.mark.parametrize("rows", [1, 7])
def test_activations_match_torch(torch, rng, rows):
    x = (rng.standard_normal((rows, 333)) * 4).astype(np.float32)
    t = torch.tensor(x, dtype=torch.float64)
    F = torch.nn.functional
    for got, ref in ((ops.silu(x), F.silu(t)), (ops.gelu_tanh(x), F.gelu(t, approximate="tanh")),
                     (ops.gelu_erf(x), F.gelu(t))):
        assert got.shape == x.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, ref.numpy(), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_matches_torch(torch, rng, rows, act):
    gate_up = (rng.standard_normal((rows, 2 * 129)) * 4).astype(np.float32)
    t = torch.tensor(gate_up, dtype=torch.float64)
    gate, up = t[:, :129], t[:, 129:]
    F = torch.nn.functional
    ref = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
    np.testing.assert_allclose(ops.gated(gate_up, act), ref.numpy(), rtol=2e-6, atol=1e-6)


def test_activations_of_large_inputs_saturate(rng):
    x = np.array([[-200.0, -90.0, 90.0, 200.0]], np.float32)
    np.testing.assert_allclose(ops.silu(x), [[0.0, 0.0, 90.0, 200.0]], atol=1e-30)
    np.testing.assert_allclose(ops.gelu_tanh(x), [[0.0, 0.0, 90.0, 200.0]], atol=1e-30)
    assert np.isnan(ops.silu(np.array([[np.nan]], np.float32))).all()


def test_in_passing_thread_returns_the_result_or_raises_the_error_on_the_caller():
    import threading

    from pyml.core import runtime
    from pyml.core.errors import PymlError
    assert runtime.in_passing_thread(lambda a, b=0: (a + b, threading.current_thread().name), 2, b=3) == (5, "pyml-load")

    def fail():
        raise PymlError("no such model")
    with pytest.raises(PymlError, match="no such model"):
        runtime.in_passing_thread(fail)
