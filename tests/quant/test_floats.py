"""The float GEMM's panels (pyml/quant/floats.py, section "T > 1 with 16 registers"): 16 rows x 6
tokens on ymm, 32 rows (two 16-row halves) x 12 tokens on zmm, whichever this process compiled
(tests/core/test_isa.py runs every path's). The packed layout is the documented one, and the
products match float64 within float32 accumulation's bound."""

import numpy as np
import pytest

from pyml.quant import QuantType, floats
from tests.quant.helpers import make_weights

FLOATS = [QuantType.F32, QuantType.F16, QuantType.BF16]


def _weights(rng, qtype, rows, n_cols):
    """Stored weights as the kernels take them (F16 as its uint16 bits: quant._as_stored)."""
    w = make_weights(rng, qtype, rows, n_cols)
    return w.view(np.uint16) if w.dtype == np.float16 else w


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda q: q.name)
def test_a_panel_holds_16_rows_column_major_with_zeros_past_the_edges(rng, qtype):
    w = _weights(rng, qtype, 21, 37)  # rows 16..20 in the second panel, 11 zero rows; 37 columns -> 48
    panel = np.full(64 * 48, 0xAB, np.uint8)
    floats._pack_panel(int(qtype), w, 16, 21, panel)
    want = np.zeros((48, 16), np.float32)
    want[:37, :5] = floats.to_f32(w[16:21], int(qtype)).T
    np.testing.assert_array_equal(panel.view(np.float32).reshape(48, 16), want)


@pytest.mark.parametrize("qtype", FLOATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows, n_cols, T", [(16, 256, 6), (40, 300, 7), (57, 520, 13), (33, 1000, 64),
                                             (96, 272, 25)])
def test_the_panels_match_float64(rng, qtype, rows, n_cols, T):
    """Edges on every side: rows not a multiple of 16 (nor the 32-row chunks), columns not of 16 or
    of PANEL_K, tokens not of 6 or 12; and full panels on both halves."""
    w = _weights(rng, qtype, rows, n_cols)
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    out = np.full((T, rows), np.nan, np.float32)
    for r_lo in range(0, rows, 32):  # the GEMM's chunks (kernel_set.GEMM_CHUNK)
        floats.gemm_panels(int(qtype), w, x, out, r_lo, min(rows, r_lo + 32))
    w64 = floats.to_f32(w, int(qtype)).astype(np.float64)
    bound = n_cols * float(np.finfo(np.float32).eps) * (np.abs(x).astype(np.float64) @ np.abs(w64).T)
    assert (np.abs(out - x.astype(np.float64) @ w64.T) <= bound).all()
