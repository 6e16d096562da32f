"""Fused matmul kernels against float64 `dequantized @ x.T`.

Tolerances, per output element y[t, r] with S = sum_j |w_rj| |x_tj|:
  exact paths (exact=True; float weights): |y - ref| <= 1e-5 * S
      (float32 accumulation over <= 768 terms)
  int8-activation path (quantized weights, the default): |y - ref(x_q8)| <= 1e-5 * S,
      where x_q8 is x quantized exactly as the kernels do (helpers.q8_activation); and against the
      true x, |y - ref| <= E + 1e-5 * S with E = sum_j |w_rj| * d_j / 2 the largest possible int8
      rounding error (d_j: the scale of x's block holding j).
"""

import numba
import numpy as np
import pytest

from pyml import quant
from pyml.quant import QuantType
from pyml.quant.interleaved_rows import ROWS_MAX
from tests.quant.helpers import FLOAT_TYPES, QUANT_TYPES, make_weights, odd_cols, q8_activation

RTOL = 1e-5


def _ref(x, raw, qtype, n_cols):
    w = quant.dequantize_reference(raw, qtype, n_cols).astype(np.float64)
    return x.astype(np.float64) @ w.T, np.abs(x).astype(np.float64) @ np.abs(w).T, w


def _q8_error_bound(x, w):
    d = np.abs(x.astype(np.float32)).reshape(x.shape[0], -1, 32).max(axis=2) / np.float32(127.0)
    half_step = np.repeat(d.astype(np.float64) / 2, 32, axis=1)  # [T, n_cols]
    return half_step @ np.abs(w).T


@pytest.mark.parametrize("qtype", QUANT_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [7, 33, 257])
@pytest.mark.parametrize("T", [1, 5, ROWS_MAX, 38])  # 38: the GEMM's tiles of 8, 4, 1
def test_matmul(rng, qtype, rows, T):
    n_cols = odd_cols(qtype) if qtype not in FLOAT_TYPES else 77
    raw = make_weights(rng, qtype, rows, n_cols)
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    ref, scale, w = _ref(x, raw, qtype, n_cols)
    exact = quant.matmul(x, raw, qtype, n_cols, exact=True)
    assert exact.shape == (T, rows) and exact.dtype == np.float32
    assert np.all(np.abs(exact - ref) <= RTOL * scale)
    y = quant.matmul(x, raw, qtype, n_cols)
    if qtype in FLOAT_TYPES:
        assert np.all(np.abs(y - ref) <= RTOL * scale)
        return
    ref_q8 = q8_activation(x) @ w.T
    assert np.all(np.abs(y - ref_q8) <= RTOL * scale)
    assert np.all(np.abs(y - ref) <= _q8_error_bound(x, w) + RTOL * scale)


@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q6_K, QuantType.F16], ids=lambda q: q.name)
def test_matmul_writes_out(rng, qtype):
    n_cols = odd_cols(qtype)
    raw = make_weights(rng, qtype, 9, n_cols)
    for T in (1, 3):
        x = rng.standard_normal((T, n_cols)).astype(np.float32)
        out = np.full((T, 9), np.nan, np.float32)
        y = quant.matmul(x, raw, qtype, n_cols, out=out)
        assert y is out
        np.testing.assert_array_equal(out, quant.matmul(x, raw, qtype, n_cols))
        with pytest.raises(ValueError):
            quant.matmul(x, raw, qtype, n_cols, out=np.empty((T, 8), np.float32))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_gemm_rows_equal_gemv(rng, qtype):
    """The T > 1 tiles quantize each activation row as the T == 1 path does: the same dot products
    up to float32 summation order."""
    n_cols = odd_cols(qtype)
    raw = make_weights(rng, qtype, 13, n_cols)
    T = ROWS_MAX + 4  # the GEMM's tiles
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    y = quant.matmul(x, raw, qtype, n_cols)
    _, scale, _ = _ref(x, raw, qtype, n_cols)
    for t in range(T):
        yt = quant.matmul(x[t:t + 1], raw, qtype, n_cols)[0]
        assert np.all(np.abs(y[t] - yt) <= RTOL * scale[t])


@pytest.mark.parametrize("qtype", QUANT_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("T", [2, 7, ROWS_MAX])
def test_a_few_rows_give_each_row_the_gemv_bits(rng, qtype, T):
    """2 .. ROWS_MAX decode rows (inside quant.decode_rows(): a batched decode step) go through
    KernelSet.gemv_rows: each row the bits of the GEMV alone, so a sequence decoded in a batch gets
    the logits it gets alone; and within the float64 oracle's bound, as every path."""
    n_cols = odd_cols(qtype) if qtype not in FLOAT_TYPES else 77
    raw = make_weights(rng, qtype, 13, n_cols)
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    with quant.decode_rows():
        y = quant.matmul(x, raw, qtype, n_cols)
    for t in range(T):
        np.testing.assert_array_equal(y[t], quant.matmul(x[t:t + 1], raw, qtype, n_cols)[0], err_msg=f"row {t}")
    ref, scale, w = _ref(x, raw, qtype, n_cols)
    assert np.all(np.abs(y - (ref if qtype in FLOAT_TYPES else q8_activation(x) @ w.T)) <= RTOL * scale)


@pytest.mark.parametrize("qtype", QUANT_TYPES + FLOAT_TYPES, ids=lambda q: q.name)
def test_one_and_two_threads_agree(rng, qtype):
    n_cols = odd_cols(qtype) if qtype not in FLOAT_TYPES else 96
    raw = make_weights(rng, qtype, 61, n_cols)
    x1 = rng.standard_normal((1, n_cols)).astype(np.float32)
    x4 = rng.standard_normal((4, n_cols)).astype(np.float32)  # gemv_rows (decode rows), and the GEMM
    x20 = rng.standard_normal((ROWS_MAX + 4, n_cols)).astype(np.float32)  # the GEMM
    saved = numba.get_num_threads()
    try:
        results = []
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            with quant.decode_rows():
                rows = quant.matmul(x4, raw, qtype, n_cols)
            results.append([quant.matmul(x1, raw, qtype, n_cols), quant.matmul(x1, raw, qtype, n_cols, exact=True),
                            rows, quant.matmul(x4, raw, qtype, n_cols), quant.matmul(x20, raw, qtype, n_cols)])
    finally:
        numba.set_num_threads(saved)
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_writable_and_readonly_weights_agree(rng):
    raw = make_weights(rng, QuantType.Q5_0, 10, 96)
    x = rng.standard_normal((1, 96)).astype(np.float32)
    np.testing.assert_array_equal(quant.matmul(x, raw.copy(), QuantType.Q5_0, 96),
                                  quant.matmul(x, raw, QuantType.Q5_0, 96))


def test_zero_and_outlier_activations(rng):
    """All-zero activation blocks (scale 0) and a huge outlier in a block."""
    raw = make_weights(rng, QuantType.Q4_K, 8, 256)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[0, :64] = 0.0
    x[1, 5] = 1e4
    ref, scale, w = _ref(x, raw, QuantType.Q4_K, 256)
    y = quant.matmul(x, raw, QuantType.Q4_K, 256)
    assert np.all(np.abs(y - q8_activation(x) @ w.T) <= RTOL * scale)
    for t in range(2):
        yt = quant.matmul(x[t:t + 1], raw, QuantType.Q4_K, 256)
        assert np.all(np.abs(yt - ref[t]) <= _q8_error_bound(x[t:t + 1], w) + RTOL * scale[t])


def test_matmul_rejects_bad_shapes(rng):
    raw = make_weights(rng, QuantType.Q8_0, 4, 64)
    with pytest.raises(ValueError):
        quant.matmul(np.zeros((1, 96), np.float32), raw, QuantType.Q8_0, 64)
    with pytest.raises(ValueError):
        quant.matmul(np.zeros((1, 64), np.float32), raw, QuantType.Q8_0, 96)
    k_raw = make_weights(rng, QuantType.Q4_K, 4, 512)[:, :288]  # 576 columns would be 2.25 superblocks
    with pytest.raises(ValueError, match="576 columns: not a multiple of its block of 256"):
        quant.matmul(np.zeros((1, 576), np.float32), np.ascontiguousarray(k_raw), QuantType.Q4_K, 576)


def test_matmul_accepts_float64_and_readonly_x(rng):
    raw = make_weights(rng, QuantType.Q8_0, 4, 64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    ro = x.copy()
    ro.flags.writeable = False
    expected = quant.matmul(x, raw, QuantType.Q8_0, 64)
    np.testing.assert_array_equal(quant.matmul(ro, raw, QuantType.Q8_0, 64), expected)
    np.testing.assert_array_equal(quant.matmul(x.astype(np.float64), raw, QuantType.Q8_0, 64), expected)


@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q4_K, QuantType.F16], ids=lambda q: q.name)
def test_nan_and_inf_in_x_stay_visible(rng, qtype):
    """A NaN or inf in the activation must not vanish in the int8 quantization."""
    n_cols = odd_cols(qtype)
    raw = make_weights(rng, qtype, 5, n_cols)
    for bad in (np.nan, np.inf):
        x = rng.standard_normal((1, n_cols)).astype(np.float32)
        x[0, 3] = bad
        for exact in (False, True):
            assert not np.isfinite(quant.matmul(x, raw, qtype, n_cols, exact=exact)).any()
