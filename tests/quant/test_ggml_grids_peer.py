"""quant.ggml_activations() against ggml itself: one mul_mat of ggml's CPU backend (the libggml that
llama-cpp-python ships, called through ctypes: its plain path, the vec_dot and llamafile kernels the
model's own matmuls take) and pyml's matmul in the mode, on the same weights and x, for every weight type
both have. `-m peer` runs it (pip install ".[bench]").

Equal to float32 sums: the rounding is ggml's, code for code. pyml's own path is not (its int8 per 32
values with float32 scales), which keeps the test able to fail. Q4_1 / Q5_1 (q8_1) add the one rounding
the mode leaves out: ggml keeps a block's d x sum(q) as fp16, for the weights' mins (ggml_grids.py)."""

import ctypes
from pathlib import Path

import numpy as np
import pytest

from pyml import quant
from pyml.quant import QuantType
from pyml.quant.ggml_grids import round_as_ggml
from tests.quant.helpers import QUANT_TYPES, make_weights

pytestmark = pytest.mark.peer


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@pytest.fixture(scope="module")
def ggml():
    """ggml's C API (ggml.h, ggml-cpu.h), the few calls a mul_mat needs."""
    llama_cpp = pytest.importorskip("llama_cpp", reason='llama.cpp is the bench extra\'s peer: pip install ".[bench]"')
    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    ptr = ctypes.c_void_p
    for name, res, args in (("ggml_init", ptr, [_InitParams]), ("ggml_free", None, [ptr]),
                            ("ggml_new_tensor_2d", ptr, [ptr, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
                            ("ggml_get_data", ptr, [ptr]), ("ggml_mul_mat", ptr, [ptr, ptr, ptr]),
                            ("ggml_new_graph", ptr, [ptr]), ("ggml_build_forward_expand", None, [ptr, ptr])):
        fn = getattr(base, name)
        fn.restype, fn.argtypes = res, args
    cpu.ggml_graph_compute_with_ctx.argtypes = [ptr, ptr, ctypes.c_int]

    def mul_mat(raw, qtype, n_cols, x):  # ggml's y = x @ W.T: W [rows, row_bytes] as stored, x [T, n_cols]
        rows, T = raw.shape[0], x.shape[0]
        ctx = base.ggml_init(_InitParams(raw.nbytes + 2 * x.nbytes + 4 * rows * T + (16 << 20), None, False))
        try:
            w = base.ggml_new_tensor_2d(ctx, int(qtype), n_cols, rows)
            a = base.ggml_new_tensor_2d(ctx, int(QuantType.F32), n_cols, T)
            ctypes.memmove(base.ggml_get_data(w), np.ascontiguousarray(raw).ctypes.data, raw.nbytes)
            ctypes.memmove(base.ggml_get_data(a), np.ascontiguousarray(x, np.float32).ctypes.data, 4 * x.size)
            y = base.ggml_mul_mat(ctx, w, a)
            graph = base.ggml_new_graph(ctx)
            base.ggml_build_forward_expand(graph, y)
            cpu.ggml_graph_compute_with_ctx(ctx, graph, 1)
            data = ctypes.cast(base.ggml_get_data(y), ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(data, (T, rows)).copy()
        finally:
            base.ggml_free(ctx)

    return mul_mat


@pytest.mark.parametrize("qtype", QUANT_TYPES + [QuantType.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("T", [1, 7, 64])  # a GEMV, and the GEMMs llamafile's kernels take for Q4_0 / Q5_0 / Q8_0 / IQ4_NL
def test_ggml_activations_are_ggmls_mul_mat(ggml, rng, qtype, T):
    rows, n_cols = 64, 1024
    raw = make_weights(rng, qtype, rows, n_cols)
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    x[:, rng.integers(0, n_cols, 4)] *= 300  # outliers, as real activations have: a block's scale is theirs
    want = ggml(raw, qtype, n_cols, x)
    scale = np.abs(x) @ np.abs(quant.dequantize(raw, qtype, n_cols)).T
    bound = 2e-6 * scale
    # Q4_1 / Q5_1: ggml's s = fp16(d x sum q) from the float32 d, where the mode's x sums to fp16(d) x sum q:
    # two fp16 roundings apart, each at most 2^-11 relative, times the weights' mins
    if qtype in (QuantType.Q4_1, QuantType.Q5_1):
        mins = np.abs(raw.reshape(rows, n_cols // 32, -1)[:, :, 2:4].copy().view(np.float16)[..., 0]).astype(np.float64)
        sums = np.abs(round_as_ggml(x, "q8_1").reshape(T, -1, 32).sum(axis=2, dtype=np.float64))
        bound = bound + 2.0 ** -10 * sums @ mins.T
    with quant.ggml_activations():
        got = quant.matmul(x, raw, qtype, n_cols)
    assert np.all(np.abs(got - want) <= bound)
    if qtype != QuantType.F16:
        own = quant.matmul(x, raw, qtype, n_cols)
        assert not np.all(np.abs(own - want) <= bound)
