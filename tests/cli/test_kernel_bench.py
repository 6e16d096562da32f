"""kernel_bench's ceilings and its view of the weights (as a model holds them), and its flags."""

import numpy as np
import pytest

from pyml import quant
from pyml.cli import kernel_bench
from pyml.quant import QuantType


@pytest.mark.deep  # kernel_bench's timed peaks; the kernels they time: tests/quant/test_matmul.py
def test_compute_peaks_are_rates_of_the_right_order():
    fp32, int8 = kernel_bench.compute_peaks(rounds=1, n=200_000)
    # 8 float lanes x 2 FLOP per FMA, at least one FMA per ns on any x86 core of the last decade
    assert 16 < fp32 < 2000
    assert int8 > fp32  # 32 byte products per instruction against 8 float FMAs


@pytest.mark.deep  # kernel_bench's timed peaks; the kernels they time: tests/quant/test_matmul.py
def test_weights_are_measured_in_the_layout_the_model_uses():
    rng = np.random.default_rng(0)
    assert isinstance(kernel_bench._weights(rng, QuantType.Q4_0, 16, 64), quant.Packed)
    assert isinstance(kernel_bench._weights(rng, QuantType.Q6_K, 16, 256), np.ndarray)  # the file's layout
    copy = kernel_bench._copy(kernel_bench._weights(rng, QuantType.Q8_0, 16, 64))
    assert not copy.groups.flags.writeable
    assert kernel_bench.gemm_gflops(QuantType.Q4_0, 16, 64, T=4, rounds=1) > 0


@pytest.mark.deep  # kernel_bench's timed peaks; the kernels they time: tests/quant/test_matmul.py
def test_int8_peak_chains_do_the_products_they_count():
    """compute_peaks counts 12 x 32 byte products per iteration: with every byte 1, each iteration
    must add exactly 384 to the total, on the vpdpbusd chains and on the AVX2 path's vpmaddubsw ones
    (whose inputs change every iteration, so the multiply cannot be hoisted out of the loop)."""
    q = np.ones(896, np.uint8)
    assert kernel_bench._int8_chains(100, q) == 384 * 100
    assert kernel_bench._maddubs_chains(100, q) == 384 * 100


@pytest.mark.deep  # kernel_bench's timed peaks; the kernels they time: tests/quant/test_matmul.py
def test_zmm_float_peak_chains_do_the_fmas_they_count():
    """The avx512 paths' float32 peak counts 12 chains x 16 lanes of FMAs per iteration: with both
    factors 1, each iteration adds exactly 192 to the total (compute_peaks takes the better of it
    and the 8-lane chains, as the float GEMM's panels run on zmm there)."""
    assert kernel_bench._fp32_chains16(100, np.float32(1.0)) == 192 * 100


_SPILL_PROBE = """
import json, numba, numpy as np
from pyml.cli import kernel_bench
fresh = numba.njit(kernel_bench._maddubs_chains.py_func)  # compiled here, so its machine code can be read
assert fresh(100, np.ones(896, np.uint8)) == 384 * 100
lines = "\\n".join(fresh.inspect_asm().values()).splitlines()
madds = [i for i, line in enumerate(lines) if "vpmaddubsw" in line]
print(json.dumps({"madds": len(madds), "stack": sum("rsp" in line for line in lines[madds[0]:madds[-1]])}))
"""


@pytest.mark.deep  # kernel_bench's timed peaks; the kernels they time: tests/quant/test_matmul.py
def test_the_avx2_peak_fits_an_avx2_cpus_registers(say):
    """Compiled as for an AVX2-only CPU (PYML_ISA=avx2 caps LLVM's features, core/isa.py), the peak's
    loop keeps its operands and sums in 16 ymm registers: no stack traffic between its multiplies,
    which would make the peak read low and every kernel's share of it high."""
    from pyml.core import isa
    from tests.core.test_isa import isa_probe
    if "avx2" not in isa.supported(isa.HOST_FEATURES):
        say("the avx2 path is not on this CPU: its peak is not compiled here")
        return
    got = isa_probe(_SPILL_PROBE, "avx2")
    assert got["madds"] >= 12 and got["stack"] == 0, got


@pytest.mark.parametrize("argv, says", [
    (["--types", "Q4_K", "--shapes", "1536x576"], "Q4_K needs columns in a multiple of its block of 256"),
    (["--types", "Q4_9"], "no weight type 'Q4_9'"),
    (["--shapes", "1536"], "expected rows x columns"),
    (["--threads", "two"], "expected counts"),
    (["--T", "0", "--types", "Q4_0", "--shapes", "64x64"], "every count must be >= 1"),
])
def test_bad_flags_get_one_line_before_any_work(capsys, argv, says):
    assert kernel_bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and "internal error" not in err
