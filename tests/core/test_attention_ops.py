"""Decode attention (ops.attend_one) against a float64 NumPy softmax(q K^T s) V, written out here:
grouped query heads, long and short spans, windows that start mid-cache."""

import numpy as np
import pytest

from pyml.core import ops


def reference(q, keys, values, start, end, scale):
    H, Hkv = q.shape[0], keys.shape[0]
    out = np.empty(q.shape, np.float64)
    for h in range(H):
        kv = h // (H // Hkv)
        k, v = keys[kv, start:end].astype(np.float64), values[kv, start:end].astype(np.float64)
        s = k @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = p @ v / p.sum()
    return out


C = 128  # spans of cached positions the cases start and end inside


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize("start,end", [(0, 1), (0, 7), (0, C), (0, C + 1), (3, 2 * C + 5), (C - 1, 3 * C), (500, 4 * C)])
def test_matches_the_float64_softmax(heads, kv_heads, start, end):
    rng = np.random.default_rng(heads * 1000 + end)
    hd, max_len = 64, 4 * C + 8
    q = rng.standard_normal((heads, hd), np.float32)
    keys = rng.standard_normal((kv_heads, max_len, hd), np.float32)
    values = rng.standard_normal((kv_heads, max_len, hd), np.float32)
    keys[:, end:] = np.nan  # positions past the end must never be read
    got = ops.attend_one(q, keys, values, start, end, 0.125)
    np.testing.assert_allclose(got, reference(q, keys, values, start, end, 0.125), rtol=2e-5, atol=2e-6)


def test_large_scores_stay_finite():
    """Scores of a few hundred: the softmax subtracts the max before exponentiating."""
    rng = np.random.default_rng(0)
    q = 20 * rng.standard_normal((2, 16), np.float32)
    keys = 20 * rng.standard_normal((1, 3 * C, 16), np.float32)
    values = rng.standard_normal((1, 3 * C, 16), np.float32)
    got = ops.attend_one(q, keys, values, 0, 3 * C, 1.0)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference(q, keys, values, 0, 3 * C, 1.0), rtol=1e-4, atol=1e-5)
