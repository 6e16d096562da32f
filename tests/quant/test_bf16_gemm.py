"""--float-compute bf16: the vdpbf16ps GEMM (quant/bf16_gemm.py) against NumPy on inputs rounded to bf16 by
torch (an independent rounding), and the mode's fallback on a CPU without AVX-512 BF16.

Bound, per output element y[t, r]: the products of two bf16 values are exact in float32, so the
only error left is the float32 accumulation over n_cols terms: |y - ref| <= n_cols * 2^-24 * S,
S = sum_j |w_rj| |x_tj| of the rounded inputs (measured: well under it).
"""

import json
import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

from pyml import quant
from pyml.core import isa
from pyml.quant import QuantType, bf16_gemm

FLOATS = (QuantType.F32, QuantType.F16, QuantType.BF16)

needs_bf16 = pytest.mark.skipif(not quant.BF16_AVAILABLE, reason=f"no avx512_bf16 on ISA path {isa.ISA}: the bf16 "
                                                                   "GEMM cannot run (test_unavailable_* covers it)")


def _bf16(torch, a) -> np.ndarray:
    """float32 -> the nearest bf16 (torch's round to nearest even), back as float64."""
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16).to(torch.float64).numpy()


@needs_bf16
@pytest.mark.parametrize("qtype", FLOATS, ids=lambda q: q.name)
@pytest.mark.parametrize("T,rows,n_cols", [(2, 1, 1), (3, 17, 5), (8, 32, 2), (9, 33, 31), (7, 16, 64),
                                           (65, 45, 33), (70, 64, 130), (13, 100, 577)])
def test_bf16_gemm_matches_numpy_on_rounded_inputs(torch, rng, qtype, T, rows, n_cols):
    w32 = rng.standard_normal((rows, n_cols)).astype(np.float32)
    stored = quant.quantize(w32, qtype)  # the file's type: F16 / BF16 round once more here
    w = quant.dequantize(stored, qtype, n_cols)  # what the stored weights hold, as float32
    x = (rng.standard_normal((T, n_cols)) * 3).astype(np.float32)
    packed = quant.pack_bf16(stored, qtype, n_cols)
    y = quant.matmul(x, packed, qtype, n_cols)
    wb, xb = _bf16(torch, w), _bf16(torch, x)
    ref, scale = xb @ wb.T, np.abs(xb) @ np.abs(wb).T
    assert y.shape == (T, rows) and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= n_cols * 2.0**-24 * scale + 1e-30)


@needs_bf16
def test_activation_rounding_is_round_to_nearest_even(torch):
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0x00000001, 0x80000000,
                     0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001, 0x477FF000], np.uint32)
    x = bits.view(np.float32).reshape(1, -1)
    got = bf16_gemm.round_rows(x, np.empty((1, x.shape[1] + 1), np.uint16))
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(got[:, :-1][~nan], want[~nan])
    assert np.all((got[:, :-1][nan] & 0x7F80) == 0x7F80) and np.all(got[:, :-1][nan] & 0x7F)  # still NaN
    assert got[0, -1] == 0  # the padding column of an odd K


@numba.njit  # not cached: its cache would be stamped with this file only
def _round_each(x, values, bits):
    for i in range(x.size):
        values[i] = bf16_gemm.round_f32(x[i])
        bits[i] = bf16_gemm.high_bits(values[i])


def test_probability_rounding_is_round_to_nearest_even(torch, rng):
    """round_f32 / high_bits (the attention's probabilities; plain integer ops, on every path)."""
    ties = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0x00000001, 0x80000000,
                     0x7F800000, 0xFF800000, 0x477FF000, 0x00008000, 0x00018000], np.uint32).view(np.float32)
    x = np.concatenate([ties, rng.random(10_000, np.float32), rng.standard_normal(10_000).astype(np.float32)])
    values, bits = np.empty_like(x), np.empty(x.size, np.uint16)
    _round_each(x, values, bits)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16)
    assert np.array_equal(bits, want.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(values, want.to(torch.float32).numpy())


@needs_bf16
def test_linear_packs_float_weights_as_the_mode_says(rng):
    from pyml.nn.linear import Linear, Weight
    w = quant.quantize(rng.standard_normal((40, 24)).astype(np.float32), QuantType.F16)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    exact = Linear(Weight(w, QuantType.F16, (40, 24)))(x)
    for mode, packs in (("f32", False), ("auto", True), ("bf16", True)):
        lin = Linear(Weight(w, QuantType.F16, (40, 24)))
        assert lin.pack(mode) is packs and (lin.prefill_weight is not None) is packs
        y = lin(x)
        assert np.abs(y - exact).max() <= (0.0 if not packs else 2e-2 * np.abs(exact).max())
        assert np.array_equal(lin(x[:1]), exact[:1])  # T == 1 streams the stored weights in every mode
    f32 = Linear(Weight(rng.standard_normal((40, 24)).astype(np.float32), QuantType.F32, (40, 24)))
    assert not f32.pack("auto") and f32.pack("bf16")  # auto keeps F32 weights in f32


_PROBE = textwrap.dedent("""
    import json, logging, io
    import numpy as np
    from pyml import quant
    from pyml.core import isa
    from pyml.nlp.api import check_float_compute
    from pyml.nn.linear import Linear, Weight
    from pyml.quant import QuantType
    log = io.StringIO()
    logging.getLogger("pyml").addHandler(logging.StreamHandler(log))
    mode = check_float_compute("bf16")
    w = quant.quantize(np.ones((32, 16), np.float32), QuantType.F16)
    lin = Linear(Weight(w, QuantType.F16, (32, 16)))
    packed = lin.pack(mode)
    y = lin(np.ones((3, 16), np.float32))
    print(json.dumps({"isa": isa.ISA, "available": quant.BF16_AVAILABLE, "packed": packed,
                      "compute": quant.float_compute("bf16", QuantType.F16), "y": float(y.max()),
                      "log": log.getvalue()}))
""")


def test_unavailable_bf16_is_named_and_runs_f32(say):
    """A CPU without AVX-512 BF16 (forced with PYML_ISA: the best path below avx512_bf16 this CPU has):
    --float-compute bf16 is said to be unavailable, by name, and every float GEMM runs in f32."""
    below = next(p for p in isa.supported(isa.HOST_FEATURES) if p != "avx512_bf16")
    say(f"--float-compute bf16 checked as unavailable on ISA path {below} "
        f"(this CPU: {'has' if 'avx512_bf16' in isa.supported(isa.HOST_FEATURES) else 'lacks'} avx512_bf16)")
    env = dict(os.environ, PYML_ISA=below)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["isa"] == below and not got["available"] and not got["packed"] and got["compute"] == "f32"
    assert got["y"] == 16.0  # computed, in f32
    assert "--float-compute bf16 is unavailable" in got["log"] and "avx512_bf16" in got["log"] and below in got["log"]
