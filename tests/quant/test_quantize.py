"""quantize() is bit-exact with gguf.quants.quantize (ggml's reference quantizers)."""

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.quant import QuantType

TYPES = [QuantType.Q8_0, QuantType.Q4_0, QuantType.Q4_1]


def _cases(rng):
    x = rng.standard_normal((9, 256)).astype(np.float32)
    x[0] = 0.0                                   # an all-zero row: d = 0
    x[1, :32] = 0.0                              # an all-zero block
    x[2, 40] = 3e4                               # a large outlier
    x[3] *= 1e-6                                 # tiny values: subnormal fp16 scales
    x[4, 64:96] = 7.0                            # a constant block (Q4_1: d = 0)
    x[5] = np.round(x[5] * 4) / 4                # exact halves: rounding ties
    x[6, :32] = -x[6, :32].max() - 1.0           # ties of |max| between signs
    x[6, 31] = -x[6, 0]
    x[7] = rng.uniform(-1, 1, 256).astype(np.float32) * 127
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_quantize_bit_exact(rng, qtype):
    for x in (_cases(rng), rng.standard_normal((64, 96)).astype(np.float32) * 3):
        got = quant.quantize(x, qtype)
        ref = gguf.quants.quantize(x, qtype)
        assert got.dtype == np.uint8 and got.shape == ref.shape
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_quantize_roundtrip(rng, qtype):
    x = rng.standard_normal((4, 128)).astype(np.float32)
    raw = quant.quantize(x, qtype)
    back = quant.dequantize(raw, qtype, 128)
    step = np.abs(x).reshape(4, -1, 32).max(axis=2, keepdims=True) / (127 if qtype == QuantType.Q8_0 else 7)
    assert np.all(np.abs(back - x).reshape(4, -1, 32) <= step)


def test_quantize_float_types(rng):
    x = _cases(rng)
    np.testing.assert_array_equal(quant.quantize(x, QuantType.F32), x)
    np.testing.assert_array_equal(quant.quantize(x, QuantType.F16), gguf.quants.quantize(x, QuantType.F16))
    bf = quant.quantize(x, QuantType.BF16)
    assert bf.dtype == np.uint16
    np.testing.assert_array_equal(bf.view(np.uint8), gguf.quants.quantize(x, QuantType.BF16))


def test_quantize_rejects_unsupported(rng):
    with pytest.raises(ValueError):
        quant.quantize(np.zeros((2, 256), np.float32), QuantType.Q4_K)
    with pytest.raises(ValueError):
        quant.quantize(np.zeros((2, 100), np.float32), QuantType.Q8_0)
