"""The K-quant quantizers (Q2_K..Q6_K) and Q5_0/Q5_1, without llama.cpp: gguf-py's dequantize of our
bytes against the input (an error bound per type, hand-checked rows), and Q5_0/Q5_1 bit-exact with
gguf-py's quantizers. Bit-exactness of the K-quants with ggml's own quantizer: test_kquantizers_peer.py."""

import gguf
import numpy as np
import pytest

from pyml.cli.pyml_quantize import quantize_rows
from pyml.quant import QuantType, quantizers
from tests.quant.test_quantize import _cases

K_TYPES = [QuantType.Q2_K, QuantType.Q3_K, QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K]
# relative RMS error on N(0, 1) rows, about 1.2x what ggml's reference quantizer gives (measured:
# Q2_K 0.296, Q3_K 0.151, Q4_K 0.072, Q5_K 0.036, Q6_K 0.018): roughly halving per added bit
RMS_BOUND = {QuantType.Q2_K: 0.36, QuantType.Q3_K: 0.18, QuantType.Q4_K: 0.087, QuantType.Q5_K: 0.044,
             QuantType.Q6_K: 0.022}


def _roundtrip(x, qtype):
    raw = quantize_rows(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (x.shape[0], x.shape[1] // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
    return raw, gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_kquant_error_within_the_types_bound(rng, qtype):
    x = rng.standard_normal((32, 512)).astype(np.float32)
    _, back = _roundtrip(x, qtype)
    rel = np.sqrt(((back - x) ** 2).mean() / (x ** 2).mean())
    assert rel < RMS_BOUND[qtype]
    assert rel > RMS_BOUND[qtype] / 3  # the bound is the type's, not a looser type's


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_kquant_hand_checked_rows(qtype):
    zero = np.zeros((1, 256), np.float32)
    raw, back = _roundtrip(zero, qtype)
    assert not raw.any() and not back.any()  # d = dmin = 0 and every level 0
    outlier = zero.copy()
    outlier[0, 37] = 5.0
    _, back = _roundtrip(outlier, qtype)
    assert not np.delete(back[0], 37).any()  # the zeros stay exactly zero
    assert abs(back[0, 37] - 5.0) <= 5.0 * 3e-4  # the 6-bit scale times the fp16 d
    constant = np.full((2, 256), 0.3, np.float32)
    _, back = _roundtrip(constant, qtype)
    assert np.all(np.abs(back - 0.3) <= 0.3 * 4e-4)  # fp16 rounding of the scale (0.3 -> 0.30005)
    if qtype in (QuantType.Q3_K, QuantType.Q6_K):  # symmetric types: the constant and the outlier are
        np.testing.assert_array_equal(back, np.float16(0.3).astype(np.float32))  # d*sc*q in fp16 steps
        assert _roundtrip(outlier, qtype)[1][0, 37] == 5.0  # max/-32 -> scale -128 * d: 5/32 exactly


@pytest.mark.parametrize("qtype", [QuantType.Q5_0, QuantType.Q5_1], ids=lambda q: q.name)
def test_q5_bit_exact_with_gguf(rng, qtype):
    quantize = {QuantType.Q5_0: quantizers.quantize_q5_0, QuantType.Q5_1: quantizers.quantize_q5_1}[qtype]
    for x in (_cases(rng), rng.standard_normal((64, 96)).astype(np.float32) * 3):
        got = quantize(x, np.empty((x.shape[0], x.shape[1] // 32 * gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8))
        np.testing.assert_array_equal(got, gguf.quants.quantize(x, qtype))
