"""A matmul of 2 .. FEW_TOKENS rows gives each row the bits a one-row matmul (the decode step's GEMV)
gives it, for every weight type and layout: a speculative verify pass must see the numbers of the
decode steps it stands for (nlp/speculative.py), or greedy output drifts. The oracle is the one-row
kernel itself, row by row (bit-equality), and the float64 reference within the int8 bound."""

import numpy as np
import pytest

from pyml import quant
from tests.quant.helpers import FLOAT_TYPES, QUANT_TYPES, make_weights, odd_cols
from tests.quant.test_matmul import RTOL, _q8_error_bound, _ref


ROWS = 33  # 4 groups of 8 and a tail row
CASES = [(q, "stored") for q in QUANT_TYPES + FLOAT_TYPES] + [(q, "x8") for q in QUANT_TYPES if quant.packs(q, ROWS)]


@pytest.mark.parametrize("qtype,layout", CASES, ids=lambda c: getattr(c, "name", c))
@pytest.mark.parametrize("T", [2, 5, quant.FEW_TOKENS])
def test_each_row_has_its_gemv_bits(rng, qtype, layout, T):
    n_cols = odd_cols(qtype)
    raw = make_weights(rng, qtype, ROWS, n_cols)
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    want, mag, w = _ref(x, raw, qtype, n_cols)
    weights = raw if layout == "stored" else quant.pack(raw.copy(), qtype, n_cols)  # pack gives a copy's pages back
    got = quant.matmul(x, weights, qtype, n_cols)
    for i in range(T):
        np.testing.assert_array_equal(got[i], quant.matmul(x[i:i + 1], weights, qtype, n_cols)[0])
    bound = RTOL * mag + (0 if qtype in FLOAT_TYPES else _q8_error_bound(x, w))
    assert np.all(np.abs(got - want) <= bound + 1e-6)
