"""Decoding matches gguf.quants.dequantize exactly, for every type, on random and quantizer-made blocks."""

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.quant import QuantType
from tests.quant.helpers import FLOAT_TYPES, GGUF_QUANTIZES, QUANT_TYPES, make_weights, odd_cols, quantized_blocks


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_gguf_exactly(rng, qtype):
    n_cols = odd_cols(qtype)
    raw = make_weights(rng, qtype, 19, n_cols)
    ref = gguf.quants.dequantize(raw, qtype)
    got = quant.dequantize(raw, qtype, n_cols)
    assert got.dtype == np.float32 and got.shape == (19, n_cols)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(quant.dequantize_reference(raw, qtype, n_cols), ref)


@pytest.mark.parametrize("qtype", sorted(GGUF_QUANTIZES), ids=lambda q: q.name)
def test_dequantize_quantizer_made_blocks(rng, qtype):
    raw = quantized_blocks(rng, qtype, 5, 256)
    np.testing.assert_array_equal(quant.dequantize(raw, qtype, 256), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", QUANT_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
def test_dequantize_rows_reads_only_those_rows(rng, qtype):
    n_cols = odd_cols(qtype)
    raw = make_weights(rng, qtype, 23, n_cols)
    ids = [22, 0, 7, 7]
    full = quant.dequantize(raw, qtype, n_cols)
    np.testing.assert_array_equal(quant.dequantize_rows(raw, qtype, n_cols, ids), full[ids])
    np.testing.assert_array_equal(quant.dequantize_rows(raw, qtype, n_cols, np.array([3])), full[[3]])
    with pytest.raises(IndexError):
        quant.dequantize_rows(raw, qtype, n_cols, [23])


def test_float_weights_decode(rng):
    w = rng.standard_normal((4, 40)).astype(np.float32)
    np.testing.assert_array_equal(quant.dequantize(w, QuantType.F32, 40), w)
    np.testing.assert_array_equal(quant.dequantize(w.astype(np.float16), QuantType.F16, 40),
                                  w.astype(np.float16).astype(np.float32))
    bf16 = quant.quantize(w, QuantType.BF16)
    np.testing.assert_array_equal(quant.dequantize(bf16, QuantType.BF16, 40),
                                  gguf.quants.dequantize(bf16.view(np.uint8), QuantType.BF16).reshape(4, 40))
    # a GGUF reader gives BF16 as raw bytes (rows, 2 * n_cols)
    np.testing.assert_array_equal(quant.dequantize(bf16.view(np.uint8), QuantType.BF16, 40),
                                  quant.dequantize(bf16, QuantType.BF16, 40))


def test_shape_errors(rng):
    raw = make_weights(rng, QuantType.Q4_0, 3, 64)
    with pytest.raises(ValueError):
        quant.dequantize(raw, QuantType.Q4_0, 96)
    with pytest.raises(ValueError):
        quant.dequantize(raw[:, :18], QuantType.Q4_0, 64)  # not C-contiguous


@pytest.mark.parametrize("qtype", QUANT_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
def test_row_reader_reads_one_row_as_dequantize(rng, qtype):
    """The embedding's decode-step lookup (quant.row_reader) against dequantize (held to gguf's above)."""
    n_cols = odd_cols(qtype)
    raw = make_weights(rng, qtype, 23, n_cols)
    read = quant.row_reader(raw, qtype, n_cols)
    full = quant.dequantize(raw, qtype, n_cols)
    for i in (0, 7, 22):
        np.testing.assert_array_equal(read(i), full[i:i + 1])
    for bad in (-1, 23):
        with pytest.raises(IndexError):
            read(bad)
