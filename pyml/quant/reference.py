"""The simple scalar path: decode the whole matrix with the reference loops, then one float64 dot.

Slow and memory-hungry on purpose: it is what the fast kernels are tested against, and the
answer to "is the kernel wrong or the model?" when debugging.
"""

from __future__ import annotations

import numpy as np

from pyml.quant.traits import row_bytes, traits_of


def dequantize_reference(raw: np.ndarray, qtype, n_cols: int) -> np.ndarray:
    """float32 (rows, n_cols) decoded by the scalar reference loops (dequant_rows)."""
    t = traits_of(qtype)
    if not t.is_float and raw.shape[1] != row_bytes(qtype, n_cols):
        raise ValueError(f"{t.name}: rows of {raw.shape[1]} bytes do not hold {n_cols} values")
    out = np.empty((raw.shape[0], n_cols), np.float32)
    return t.kernels.dequant_rows(raw.reshape(raw.shape[0], -1), np.arange(raw.shape[0]), out)


def matmul_reference(x: np.ndarray, raw: np.ndarray, qtype, n_cols: int) -> np.ndarray:
    """float64 x @ W.T with W decoded by the reference loops: [T, n_cols] -> [T, rows]."""
    w = dequantize_reference(raw, qtype, n_cols).astype(np.float64)
    return np.asarray(x, dtype=np.float64) @ w.T
