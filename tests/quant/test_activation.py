"""The activation quantizers against the documented formula (activation.py), bit for bit, whatever
compiled them first."""

import os
import subprocess
import sys
import textwrap

import numpy as np

from pyml.quant.activation import quantize_q8, quantize_rows_q8, quantize_rows_u8, quantize_rows_u8_sums


def _formula(x):
    """(codes int8, d float32) of activation.py's docstring, in NumPy's float32 arithmetic."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=2)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv[:, :, None]).astype(np.int8).reshape(x.shape)
    return q, d


def _activation(rng, T=6, n=512):
    x = rng.standard_normal((T, n)).astype(np.float32) * np.float32(3.0)
    x[1, 32:64] = 0.0                                   # an all-zero block: d = 0, codes 0
    x[2, 64:96] = rng.standard_normal(32) * 1e-30       # tiny magnitudes: 1/d near 1e32
    x[3, 96] = -np.float32(7.0)                         # the maximum on a negative value
    x[4] = np.float32(2.0) ** rng.integers(-8, 8, n)    # powers of two: many blocks share a maximum
    return x


def test_codes_and_scales_are_the_formulas_bit_for_bit():
    x = _activation(np.random.default_rng(0))
    q, d = _formula(x)
    xq, xd, xs, xp = quantize_rows_q8(x)
    assert np.array_equal(xd.view(np.int32), d.view(np.int32))
    assert np.array_equal(xq, q)
    assert np.array_equal(xp, q.reshape(x.shape[0], -1, 2).astype(np.int16).sum(axis=2))
    sums = q.reshape(x.shape[0], -1, 32).astype(np.int32).sum(axis=2)
    assert np.array_equal(xs, (d * sums.astype(np.float32)).astype(np.float32))
    for t in range(x.shape[0]):  # the one-row quantizer the GEMVs use gives the same
        row = quantize_q8(x[t])
        assert np.array_equal(row[0], xq[t]) and np.array_equal(row[1], xd[t])


def test_the_offset_codes_are_the_codes_plus_128():
    x = _activation(np.random.default_rng(1))
    xq, xd, xs, _ = quantize_rows_q8(x)
    y, yd = quantize_rows_u8(x)
    y2, yd2, ys, qs = quantize_rows_u8_sums(x)
    assert np.array_equal(y2, y) and np.array_equal(yd2.view(np.int32), yd.view(np.int32))
    assert y.dtype == np.uint8
    assert np.array_equal(y.astype(np.int16) - 128, xq.astype(np.int16))
    assert np.array_equal(yd.view(np.int32), xd.view(np.int32))
    assert np.array_equal(qs, xq.reshape(x.shape[0], -1, 32).astype(np.int32).sum(axis=2))
    assert np.array_equal(ys.view(np.int32), xs.view(np.int32))


def test_a_nan_poisons_its_block_scale_and_an_infinity_is_the_largest_magnitude():
    x = _activation(np.random.default_rng(2))
    x[0, 5], x[5, 40] = np.nan, -np.inf
    for xd in (quantize_rows_q8(x)[1], quantize_rows_u8(x)[1]):
        assert np.isnan(xd[0, 0]) and xd[5, 1] == np.inf
        assert np.isfinite(np.delete(xd.ravel(), [0, 5 * xd.shape[1] + 1])).all()


_FASTMATH_FIRST = textwrap.dedent("""
    import numba, numpy as np
    from pyml.core.jit import FASTMATH
    from pyml.quant.activation import quantize_q8, quantize_row_q8, quantize_rows_u8

    @numba.njit(fastmath=FASTMATH)
    def kernel(x, xq, xd, xs, xp):  # a fastmath kernel compiles the quantizer first, as gemv does
        quantize_row_q8(x, xq, xd, xs, xp)

    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    xd = np.empty(128, np.float32)
    kernel(x, np.empty(4096, np.int8), xd, np.empty(128, np.float32), np.empty(2048, np.int16))
    amax = np.abs(x.reshape(-1, 32)).max(axis=1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    print(int((xd != d).sum()), int((quantize_q8(x)[1] != d).sum()), int((quantize_rows_u8(x[None])[1][0] != d).sum()))
""")


def test_a_fastmath_kernel_compiling_the_quantizer_first_leaves_its_rounding_exact(tmp_path):
    """Numba compiles a callee without its own fastmath option under its caller's flags, and caches
    that: once a fastmath GEMV compiled quantize_row_q8 first, d became amax x (1/127) everywhere."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))  # nothing compiled yet
    for run in ("compiles", "loads from the cache"):
        done = subprocess.run([sys.executable, "-c", _FASTMATH_FIRST], capture_output=True, text=True, env=env,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["0", "0", "0"], f"{run}: blocks whose d is off: {done.stdout}"
