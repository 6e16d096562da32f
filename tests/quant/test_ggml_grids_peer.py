"""quant.ggml_activations() against ggml itself: one mul_mat of ggml's CPU backend (the libggml that
llama-cpp-python ships, called through ctypes: its plain path, the vec_dot and llamafile kernels the
model's own matmuls take) and pyml's matmul in the mode, on the same weights and x, for every weight type
both have. `-m peer` runs it (pip install ".[bench]").

Equal to float32 sums: the rounding is ggml's, code for code. pyml's own path is not (its int8 per 32
values with float32 scales), which keeps the test able to fail. Q4_1 / Q5_1 (q8_1) add the one rounding
the mode leaves out: ggml keeps a block's d x sum(q) as fp16, for the weights' mins (ggml_grids.py).
The mode's attention (nn/attention_ggml.py) against ggml's mul_mat / soft_max_ext / mul_mat over an f16
cache, as llama.cpp's graph runs it without flash attention."""

import ctypes
from pathlib import Path

import numpy as np
import pytest

from pyml import quant
from pyml.quant import QuantType
from pyml.nn.attention_ggml import attend_as_ggml
from pyml.quant.ggml_grids import round_as_ggml
from tests.quant.helpers import QUANT_TYPES, make_weights

pytestmark = pytest.mark.peer


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _Ggml:
    """ggml's C API (ggml.h, ggml-cpu.h): the few calls a mul_mat and an attention need, each run as a
    graph on one thread in a context of its own."""

    def __init__(self, lib: Path):
        base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        for name, res, args in (("ggml_init", ptr, [_InitParams]), ("ggml_free", None, [ptr]),
                                ("ggml_new_tensor_2d", ptr, [ptr, ctypes.c_int, i64, i64]),
                                ("ggml_get_data", ptr, [ptr]), ("ggml_mul_mat", ptr, [ptr, ptr, ptr]),
                                ("ggml_soft_max_ext", ptr, [ptr, ptr, ptr, ctypes.c_float, ctypes.c_float]),
                                ("ggml_new_graph", ptr, [ptr]), ("ggml_build_forward_expand", None, [ptr, ptr])):
            fn = getattr(base, name)
            fn.restype, fn.argtypes = res, args
        self.cpu.ggml_graph_compute_with_ctx.argtypes = [ptr, ptr, ctypes.c_int]
        self.base = base

    def _run(self, nbytes: int, build) -> np.ndarray:
        """build(ctx, tensor) -> (result tensor, result shape); tensor(qtype, array) puts an array in ctx."""
        base = self.base
        ctx = base.ggml_init(_InitParams(nbytes + (16 << 20), None, False))

        def tensor(qtype, array, n_cols=None):  # [rows, n_cols] (raw blocks: n_cols given)
            array = np.ascontiguousarray(array)  # held while copied: a temporary's address would dangle
            t = base.ggml_new_tensor_2d(ctx, int(qtype), n_cols or array.shape[1], array.shape[0])
            ctypes.memmove(base.ggml_get_data(t), array.ctypes.data, array.nbytes)
            return t

        try:
            y, shape = build(ctx, tensor)
            graph = base.ggml_new_graph(ctx)
            base.ggml_build_forward_expand(graph, y)
            self.cpu.ggml_graph_compute_with_ctx(ctx, graph, 1)
            data = ctypes.cast(base.ggml_get_data(y), ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(data, shape).copy()
        finally:
            base.ggml_free(ctx)

    def mul_mat(self, raw, qtype, n_cols, x):  # ggml's y = x @ W.T: W [rows, row_bytes] as stored, x [T, n_cols]
        x = np.ascontiguousarray(x, np.float32)
        return self._run(raw.nbytes + 2 * x.nbytes + 4 * raw.shape[0] * x.shape[0], lambda ctx, tensor: (
            self.base.ggml_mul_mat(ctx, tensor(qtype, raw, n_cols), tensor(QuantType.F32, x)),
            (x.shape[0], raw.shape[0])))

    def attention(self, q, keys, values, mask, scale):
        """One head as llama.cpp's graph without flash attention runs it (llama-graph.cpp build_attn_mha):
        q [T, hd] float32, keys [S, hd] and values [S, hd] f16 (its cache), mask [T, S] float32 (0 / -inf)."""
        base = self.base

        def build(ctx, tensor):
            kq = base.ggml_mul_mat(ctx, tensor(QuantType.F16, keys), tensor(QuantType.F32, q))
            probs = base.ggml_soft_max_ext(ctx, kq, tensor(QuantType.F32, mask), scale, 0.0)
            return base.ggml_mul_mat(ctx, tensor(QuantType.F16, np.ascontiguousarray(values.T)), probs), q.shape

        return self._run(8 * (q.nbytes + keys.nbytes + values.nbytes + mask.nbytes), build)


@pytest.fixture(scope="module")
def ggml():
    llama_cpp = pytest.importorskip("llama_cpp", reason='llama.cpp is the bench extra\'s peer: pip install ".[bench]"')
    return _Ggml(Path(llama_cpp.__file__).parent / "lib")


@pytest.mark.parametrize("qtype", QUANT_TYPES + [QuantType.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("T", [1, 7, 64])  # a GEMV, and the GEMMs llamafile's kernels take for Q4_0 / Q5_0 / Q8_0 / IQ4_NL
def test_ggml_activations_are_ggmls_mul_mat(ggml, rng, qtype, T):
    rows, n_cols = 64, 1024
    raw = make_weights(rng, qtype, rows, n_cols)
    x = rng.standard_normal((T, n_cols)).astype(np.float32)
    x[:, rng.integers(0, n_cols, 4)] *= 300  # outliers, as real activations have: a block's scale is theirs
    want = ggml.mul_mat(raw, qtype, n_cols, x)
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


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("T", [1, 64])
def test_attention_as_ggml_is_ggmls_attention(ggml, rng, T, window):
    """nn/attention_ggml.py against ggml's mul_mat / soft_max_ext / mul_mat over an f16 cache, head by head
    (Gemma 3's grouped heads, head_dim 256, a cache 100 positions deep): equal to float32 sums' order
    but for a few probabilities rounded to the neighbouring f16, where pyml's own attention (float32 queries
    and probabilities) is not, nearly everywhere."""
    H, n_kv, hd, pos = 4, 1, 256, 100 - T
    start = max(0, pos - window + 1) if window else 0
    S = pos + T - start
    q = (rng.standard_normal((T, H, hd)) * 3).astype(np.float32)
    keys, values = rng.standard_normal((2, n_kv, S, hd)).astype(np.float16)
    qp, kp = np.arange(pos, pos + T)[:, None], np.arange(start, pos + T)[None, :]
    hidden = (kp > qp) | ((kp <= qp - window) if window else False)
    mask = np.where(hidden, -np.inf, 0).astype(np.float32)
    scale = 0.0625
    want = np.stack([ggml.attention(q[:, h], keys[0], values[0], mask, scale) for h in range(H)], axis=1)
    got = attend_as_ggml(q, pos, keys.astype(np.float32), values.astype(np.float32), start, scale, window)
    sums = 1e-6 * np.abs(values[0].astype(np.float32)).max() + 1e-6 * np.abs(want)  # float32 sums' order
    # a probability an ulp (float32) apart from ggml's can round to the other f16 (ggml's sgemm sums the
    # scores in its own order, its expf is its own): a few per thousand, each at most an f16 ulp (2^-10)
    probs = np.stack([_float32_attention(q[:, h], keys[0], np.eye(S, dtype=np.float16), mask, scale)
                      for h in range(H)], axis=1)  # [T, H, S]
    flips = sums + 2.0 ** -10 * probs @ np.abs(values[0].astype(np.float32))
    err = np.abs(got - want)
    assert np.all(err <= flips) and np.mean(err > sums) < 0.05, (err.max(), np.mean(err > sums))
    own = np.stack([_float32_attention(q[:, h], keys[0], values[0], mask, scale) for h in range(H)], axis=1)
    assert np.mean(np.abs(own - want) > sums) > 0.5


def _float32_attention(q, keys, values, mask, scale):
    scores = q @ keys.astype(np.float32).T * np.float32(scale) + mask
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    return (probs / probs.sum(axis=1, keepdims=True)) @ values.astype(np.float32)
