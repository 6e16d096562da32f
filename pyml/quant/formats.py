"""The traits table of weight storage types: how many values a block holds and how many bytes it takes.

A quantized weight matrix is the raw GGUF tensor data: uint8 (rows, row_bytes) with
row_bytes = n_cols // block_size * type_size, each row a run of blocks. Float weights are
(rows, n_cols) arrays: float32, float16, or uint16 holding bfloat16 bits (block_size 1).
The byte layout of each block is documented beside its kernels (legacy.py, kquants.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

QuantType = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class BlockFormat:
    name: str
    block_size: int      # values per block
    type_size: int       # bytes per block
    dtype: np.dtype      # element type of the stored matrix
    bits_per_weight: float


def _fmt(qtype: QuantType, dtype=np.uint8) -> BlockFormat:
    block_size, type_size = gguf.constants.GGML_QUANT_SIZES[qtype]
    return BlockFormat(qtype.name, block_size, type_size, np.dtype(dtype), 8.0 * type_size / block_size)


FORMATS: dict[QuantType, BlockFormat] = {
    QuantType.F32: _fmt(QuantType.F32, np.float32),
    QuantType.F16: _fmt(QuantType.F16, np.float16),
    QuantType.BF16: _fmt(QuantType.BF16, np.uint16),
    QuantType.Q4_0: _fmt(QuantType.Q4_0),
    QuantType.Q4_1: _fmt(QuantType.Q4_1),
    QuantType.Q5_0: _fmt(QuantType.Q5_0),
    QuantType.Q5_1: _fmt(QuantType.Q5_1),
    QuantType.Q8_0: _fmt(QuantType.Q8_0),
    QuantType.Q4_K: _fmt(QuantType.Q4_K),
    QuantType.Q5_K: _fmt(QuantType.Q5_K),
    QuantType.Q6_K: _fmt(QuantType.Q6_K),
}

# Block sizes in bytes as ggml-common.h asserts them (candle's size_of checks).
_EXPECTED_TYPE_SIZE = {QuantType.Q4_0: 18, QuantType.Q4_1: 20, QuantType.Q5_0: 22, QuantType.Q5_1: 24,
                       QuantType.Q8_0: 34, QuantType.Q4_K: 144, QuantType.Q5_K: 176, QuantType.Q6_K: 210}
assert all(FORMATS[q].type_size == n for q, n in _EXPECTED_TYPE_SIZE.items())

FLOAT_TYPES = frozenset({QuantType.F32, QuantType.F16, QuantType.BF16})


def is_supported(qtype) -> bool:
    return qtype in FORMATS


def format_of(qtype) -> BlockFormat:
    try:
        return FORMATS[qtype]
    except KeyError:
        raise ValueError(f"unsupported weight type {getattr(qtype, 'name', qtype)}; "
                         f"supported: {', '.join(f.name for f in FORMATS.values())}") from None


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one stored row of n_cols values (for float types: bytes of the row's elements)."""
    fmt = format_of(qtype)
    if n_cols % fmt.block_size:
        raise ValueError(f"{fmt.name} rows hold whole blocks of {fmt.block_size} values; got {n_cols} columns")
    return n_cols // fmt.block_size * fmt.type_size
