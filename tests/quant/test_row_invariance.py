"""The GEMMs are row-invariant: row t of a product has the same bits whatever the call's row count
and wherever t lands in it (a tile of 4 tokens, the rows left over, one row alone). A prompt's
prefill then gives the same bits alone and in a batch beside other sequences' rows (issue 37):
forward_batch hands the GEMM a sequence's rows together with others'.

Every weight type in every layout the models use: the file's layout (blocks32.py, kquants.py,
lowbit.py, floats.py's tiles and panels), the x8 layout of the packable types (interleaved*.py,
41 rows: groups in pairs, an odd group and a tail row in the file's layout) and float weights as
bf16 blocks (bf16_gemm.py, where the CPU has AVX-512 BF16). Each row is also within the usual
bound of a float64 oracle (the gguf package's dequantization), so the rows are right, not only
equal. T == 1 parts call the GEMM kernels directly: quant.matmul sends one row to the GEMV.
"""

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.core.isa import BF16 as BF16_AVAILABLE
from pyml.quant import QuantType
from pyml.quant.bf16_gemm import BF16Packed
from pyml.quant.dispatch import kernel_view
from pyml.quant.interleaved import Packed
from pyml.quant.traits import traits_of
from tests.quant.helpers import FLOAT_TYPES, QUANT_TYPES, make_weights, odd_cols, q8_activation

PACKABLE = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0, QuantType.Q4_K]
SPLITS = [(7, 2, 11), (4, 4, 4, 4), (8, 1), (1, 2, 3, 4, 5, 6)]  # 20, 16, 9, 21 rows
RTOL = 1e-5


def _gemm(x, weight, qtype, n_cols):
    """The GEMM path of quant.matmul for any T, T == 1 included."""
    T = x.shape[0]
    if T > 1 or isinstance(weight, BF16Packed):
        return quant.matmul(x, weight, qtype, n_cols)
    t = traits_of(qtype)
    if isinstance(weight, Packed):
        out = np.empty((1, weight.rows), np.float32)
        t.interleaved.gemm(weight.groups, x, out)
        head = 8 * weight.groups.shape[0]
        if weight.tail.shape[0]:
            out[:, head:] = t.kernels.gemm(weight.tail, x, np.empty((1, weight.rows - head), np.float32))
        return out
    w = kernel_view(weight, qtype, n_cols)
    return t.kernels.gemm(w, x, np.empty((1, w.shape[0]), np.float32))


def _layouts():
    for q in QUANT_TYPES + FLOAT_TYPES:
        yield pytest.param(q, "file", id=f"{q.name}-file")
    for q in PACKABLE:
        yield pytest.param(q, "x8", id=f"{q.name}-x8")
    for q in FLOAT_TYPES:
        yield pytest.param(q, "bf16", id=f"{q.name}-bf16",
                           marks=pytest.mark.skipif(not BF16_AVAILABLE, reason="no AVX-512 BF16 on this CPU"))


def _oracle(raw, qtype, n_cols):  # float64 [rows, n_cols]
    if qtype == QuantType.F32:
        return raw.astype(np.float64)
    if qtype == QuantType.F16:
        return raw.view(np.float16).astype(np.float64)
    if qtype == QuantType.BF16:
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(raw.shape[0], n_cols)


def _bf16_round(a):  # float64 of a rounded to bf16, to nearest even (bf16_gemm.py's rounding)
    b = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("qtype, layout", list(_layouts()))
def test_a_row_has_the_same_bits_whatever_the_rows_beside_it(rng, qtype, layout):
    n_cols = odd_cols(qtype) if qtype not in FLOAT_TYPES else 96
    rows = 41
    raw = make_weights(rng, qtype, rows, n_cols)
    weight = {"file": raw, "x8": lambda: quant.pack(raw, qtype, n_cols),
              "bf16": lambda: quant.pack_bf16(raw, qtype, n_cols)}[layout]
    weight = weight() if callable(weight) else weight
    w = _oracle(raw, qtype, n_cols)
    for split in SPLITS:
        T = sum(split)
        x = rng.standard_normal((T, n_cols)).astype(np.float32) * rng.uniform(0.1, 10, (T, 1)).astype(np.float32)
        whole = _gemm(x, weight, qtype, n_cols)
        cuts = np.cumsum((0,) + split)
        parts = np.concatenate([_gemm(x[a:b], weight, qtype, n_cols) for a, b in zip(cuts[:-1], cuts[1:])])
        np.testing.assert_array_equal(whole, parts, err_msg=f"{T} rows vs {split}")
        scale = np.abs(x).astype(np.float64) @ np.abs(w).T
        if layout == "bf16":
            want, tol = _bf16_round(x) @ _bf16_round(w).T, RTOL * scale
        elif qtype in FLOAT_TYPES:
            want, tol = x.astype(np.float64) @ w.T, RTOL * scale
        else:
            want, tol = q8_activation(x) @ w.T, RTOL * scale
        assert np.all(np.abs(whole - want) <= tol), f"{T} rows: off the float64 oracle"
