"""The K-quant quantizers bit-exact with ggml's own (ggml_quantize_chunk from llama-cpp-python's
libggml-base through ctypes, no imatrix: the path llama-quantize takes), on random rows, hand-made
hard rows and SmolLM2's real weights. `-m peer` runs them."""

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.cli.pyml_quantize import quantize_rows
from tests.quant.test_quantize import _cases

pytestmark = pytest.mark.peer
TYPES = [quant.QuantType.Q2_K, quant.QuantType.Q3_K, quant.QuantType.Q4_K, quant.QuantType.Q5_K,
         quant.QuantType.Q6_K, quant.QuantType.Q5_0, quant.QuantType.Q5_1]


@pytest.fixture(scope="module")
def ggml_quantize():
    # imported here, not at the module's top: a skip there would show in the default tier's summary
    llama_cpp = pytest.importorskip("llama_cpp", reason='llama.cpp is the bench extra\'s peer: pip install ".[bench]"')
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def run(x, qtype):
        x = np.ascontiguousarray(x, np.float32)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        out = np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8)
        lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
        return out
    return run


def _hard_rows(rng):
    x = np.tile(_cases(rng), (1, 2))                   # 9 rows of 512: zeros, outliers, ties, tiny values
    x[8, :256] = 0.3                                    # a constant super-block
    x[8, 256:] = np.where(np.arange(256) % 17 == 0, 4.0, 0.0)  # sparse outliers in zeros
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_bit_exact_with_ggml_on_random_and_hard_rows(rng, ggml_quantize, qtype):
    for x in (_hard_rows(rng), (rng.standard_normal((48, 768)) * 0.05).astype(np.float32),
              rng.standard_t(2, (16, 256)).astype(np.float32)):  # heavy tails
        np.testing.assert_array_equal(quantize_rows(x, qtype), ggml_quantize(x, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_bit_exact_with_ggml_on_real_rows(smollm2_gguf, ggml_quantize, qtype):
    tensors = {t.name: t for t in gguf.GGUFReader(smollm2_gguf).tensors}
    for name in ("blk.0.ffn_down.weight", "blk.7.ffn_down.weight"):  # 1536 columns: six super-blocks
        t = tensors[name]
        x = quant.dequantize(np.asarray(t.data)[:96], quant.QuantType(int(t.tensor_type)), int(t.shape[0]))
        np.testing.assert_array_equal(quantize_rows(x, qtype), ggml_quantize(x, qtype))
