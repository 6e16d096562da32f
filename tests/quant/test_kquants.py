"""Q6_K's GEMM without VNNI (pyml/quant/kquants.py, section "T > 1 without VNNI"): three 8-row tiles
per activation quad, the codes as vpmaddubsw's signed operand. It runs here on any CPU: against the
GEMM this CPU dispatches to, bit for bit, and at the ends of its 16-bit range against gguf's
dequantize."""

import gguf
import numpy as np
import pytest

from pyml.quant import QuantType, kquants
from pyml.quant.activation import quantize_rows_u8
from pyml.quant.kernel_set import block_kernels
from tests.quant.helpers import make_weights

Q6_K = QuantType.Q6_K


def _triples(w, x, rows):
    """out [T, rows] from the triples' units of 24 rows, as the AVX2 GEMM runs them."""
    y, xd = quantize_rows_u8(x)
    out = np.full((x.shape[0], rows), np.nan, np.float32)
    for r0 in range(0, rows, 24):
        kquants.gemm_rows_q6k_triple(w, r0, y, xd, out)
    return out


@pytest.mark.parametrize("rows", [8, 24, 57])  # one tile; one unit; two units and a partial third
def test_the_q6k_triples_give_the_same_bits_as_the_dispatched_gemm(rng, rows):
    n_cols = 768  # 24 blocks: more than one pass of Q6K_CHUNK
    assert n_cols // 32 > kquants.Q6K_CHUNK
    w = make_weights(rng, Q6_K, rows, n_cols)
    for T in (1, 4, 19):
        x = rng.standard_normal((T, n_cols)).astype(np.float32) * rng.uniform(0.1, 10, (T, 1)).astype(np.float32)
        want = np.zeros((T, rows), np.float32)
        block_kernels(int(Q6_K)).gemm(w, x, want)
        np.testing.assert_array_equal(_triples(w, x, rows), want)


@pytest.mark.parametrize("code", [0x00, 0xFF])  # every code 0 (value -32) or 63 (value 31)
def test_the_q6k_triples_largest_lane_sums_are_exact(code):
    """Every 16-bit lane at the end of its range: 8 products of +-127 x -32 is +-32512, which must
    come out neither saturated nor wrapped."""
    n_cols, rows = 512, 24
    raw = np.full((rows, n_cols // 256, 210), code, np.uint8)
    raw[:, :, 192:208] = 127  # the 16-value scales
    raw[:, :, 208:210] = np.array([0.001], np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).astype(np.float64)
    for sign in (1.0, -1.0):
        x = np.full((3, n_cols), sign, np.float32)  # every block quantizes to +-127 exactly
        np.testing.assert_allclose(_triples(raw, x, rows), x.astype(np.float64) @ w.T, rtol=1e-6)
