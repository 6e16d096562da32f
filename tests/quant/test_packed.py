"""The x8 layout (pyml/quant/packed.py): packing is lossless, the layout is the documented one, and
the packed kernels match the gguf package's dequantize + float64 matmul like the file-layout ones."""

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.quant import QuantType
from tests.quant.helpers import make_weights, q8_activation
from tests.quant.test_matmul import RTOL, _q8_error_bound, _ref

PACKABLE = [QuantType.Q4_0, QuantType.Q4_1]


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [8, 9, 33, 257])
def test_pack_is_lossless(rng, qtype, rows):
    raw = make_weights(rng, qtype, rows, 96)
    packed = quant.pack(raw, qtype, 96)
    assert packed.rows == rows and packed.nbytes == raw.nbytes
    assert packed.groups.shape[0] == rows // 8 and packed.tail.shape[0] == rows % 8
    np.testing.assert_array_equal(packed.unpack(), raw)
    np.testing.assert_array_equal(quant.dequantize(packed, qtype, 96), gguf.quants.dequantize(raw, qtype))
    ids = [0, rows - 1, rows // 2]
    np.testing.assert_array_equal(quant.dequantize_rows(packed, qtype, 96, ids),
                                  gguf.quants.dequantize(raw[ids], qtype))


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_layout_is_the_documented_one(qtype):
    """Code byte j of row r of a group sits at 32 * (j // 4) + 4 * r + j % 4 after the fp16 fields."""
    ts = 18 if qtype == QuantType.Q4_0 else 20
    head = ts - 16
    raw = np.zeros((8, 2 * ts), np.uint8)  # 8 rows, 2 blocks
    for r in range(8):
        for b in range(2):
            raw[r, b * ts:b * ts + head] = np.arange(head) + 10 * r + 100 * b  # the fp16 fields, as bytes
            raw[r, b * ts + head:(b + 1) * ts] = (np.arange(16) + 16 * r + 128 * b) % 256
    sb = quant.pack(raw, qtype, 64).groups.reshape(2, 8 * ts)  # one group: superblocks of blocks 0, 1
    for b in range(2):
        for r in range(8):
            for f in range(0, head, 2):  # field f // 2 of row r at 8 * f + 2 * r
                assert list(sb[b, 8 * f + 2 * r:8 * f + 2 * r + 2]) == [f + 10 * r + 100 * b, f + 1 + 10 * r + 100 * b]
            for j in range(16):
                assert sb[b, 8 * head + 32 * (j // 4) + 4 * r + j % 4] == (j + 16 * r + 128 * b) % 256


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [8, 33, 257])
@pytest.mark.parametrize("T", [1, 3, 4, 5, 34])
def test_packed_matmul(rng, qtype, rows, T):
    n_cols = 96
    raw = make_weights(rng, qtype, rows, n_cols)
    packed = quant.pack(raw, qtype, n_cols)
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    ref, scale, w = _ref(x, raw, qtype, n_cols)
    y = quant.matmul(x, packed, qtype, n_cols)
    assert y.shape == (T, rows) and y.dtype == np.float32
    assert np.all(np.abs(y - q8_activation(x) @ w.T) <= RTOL * scale)
    assert np.all(np.abs(y - ref) <= _q8_error_bound(x, w) + RTOL * scale)
    np.testing.assert_array_equal(quant.matmul(x, packed, qtype, n_cols, exact=True),
                                  quant.matmul(x, raw, qtype, n_cols, exact=True))


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda q: q.name)
def test_largest_codes_and_activations_do_not_overflow(qtype):
    """Every code 15 against every activation +-127: the 16-bit lane sums reach their bound (30480)."""
    ts = 18 if qtype == QuantType.Q4_0 else 20
    raw = np.full((16, 8 * ts), 0xFF, np.uint8)  # 256 columns
    for b in range(8):
        raw[:, b * ts:b * ts + 2] = np.array([0.01], np.float16).view(np.uint8)
        if qtype == QuantType.Q4_1:
            raw[:, b * ts + 2:b * ts + 4] = np.array([-0.05], np.float16).view(np.uint8)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    for sign in (1.0, -1.0):
        x = np.full((5, 256), sign, np.float32)  # every block quantizes to +-127 exactly
        y = quant.matmul(x, quant.pack(raw, qtype, 256), qtype, 256)
        np.testing.assert_allclose(y, x.astype(np.float64) @ w.T, rtol=1e-6)


def test_only_the_x8_types_with_8_rows_pack(rng):
    assert quant.pack(make_weights(rng, QuantType.Q4_0, 7, 96), QuantType.Q4_0, 96) is None
    assert quant.pack(make_weights(rng, QuantType.Q8_0, 16, 96), QuantType.Q8_0, 96) is None
    assert quant.pack(make_weights(rng, QuantType.Q4_K, 16, 768), QuantType.Q4_K, 768) is None


def test_packed_weights_must_be_used_as_packed(rng):
    packed = quant.pack(make_weights(rng, QuantType.Q4_0, 8, 96), QuantType.Q4_0, 96)
    with pytest.raises(ValueError, match="packed Q4_0"):
        quant.matmul(np.zeros((1, 96), np.float32), packed, QuantType.Q4_1, 96)
    with pytest.raises(ValueError, match="columns"):
        quant.matmul(np.zeros((1, 64), np.float32), packed, QuantType.Q4_0, 96)
