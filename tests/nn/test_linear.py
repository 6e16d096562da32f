"""Linear: one interface over stored weights; fuse and pack change the layout, never the result."""

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.nn.linear import Linear, Weight
from pyml.quant import QuantType


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def _linear(rng, qtype, rows, n_cols, name=""):
    raw = gguf.quants.quantize(rng.standard_normal((rows, n_cols)).astype(np.float32), qtype)
    raw.flags.writeable = False
    bias = rng.standard_normal(rows).astype(np.float32)
    return Linear(Weight(raw, qtype, (rows, n_cols)), bias, name=name), raw, bias


@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q4_1], ids=lambda q: q.name)
def test_pack_keeps_results_and_rows(rng, qtype):
    lin, raw, bias = _linear(rng, qtype, 40, 64)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    before = lin(x)
    assert lin.pack() and isinstance(lin.weight.data, quant.Packed)
    assert not lin.pack()  # already packed
    after = lin(x)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert np.all(np.abs(after - before) <= 1e-5 * scale)  # the same int8 arithmetic, summed in another order
    assert np.all(np.abs(after - (x.astype(np.float64) @ w.T + bias)) <= 0.02 * scale)
    np.testing.assert_array_equal(lin.weight.rows([3, 39]), gguf.quants.dequantize(raw[[3, 39]], qtype))
    assert lin.weight.nbytes == raw.nbytes


def test_types_without_an_x8_layout_stay_as_stored(rng):
    from tests.quant.helpers import make_weights
    for qtype, n_cols in ((QuantType.Q6_K, 256), (QuantType.F16, 64)):
        raw = make_weights(rng, qtype, 16, n_cols)
        lin = Linear(Weight(raw, qtype, (16, n_cols)))
        assert not lin.pack() and lin.weight.data is raw


def test_fuse_then_pack(rng):
    parts = [_linear(rng, QuantType.Q4_0, rows, 64)[0] for rows in (24, 8, 8)]
    x = rng.standard_normal((1, 64)).astype(np.float32)
    expected = np.concatenate([p(x) for p in parts], axis=1)
    fused = Linear.fuse(parts, "qkv")
    assert fused.pack()
    assert np.allclose(fused(x), expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    parts[0].pack()
    with pytest.raises(ValueError, match="fuse before pack"):
        Linear.fuse(parts, "qkv")
