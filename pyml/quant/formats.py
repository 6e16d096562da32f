"""The traits table: one row per weight storage type, as ggml's `type_traits`.

A quantized weight matrix is the raw GGUF tensor data: uint8 (rows, row_bytes) with
row_bytes = n_cols // block_size * type_size, each row a run of blocks. Float weights are
(rows, n_cols) arrays: float32, float16, or uint16 holding bfloat16 bits (block size 1).

Each row of TRAITS says what pyml knows of a type:
    block_size, type_size   values and bytes per block (ggml's numbers, ggml_types.py)
    dtype                   the stored matrix's element type (what loaders and quantize hand out)
    kernels                 the module reading it: dequant_rows (the scalar reference decoding),
                            gemv, gemv_exact, gemm; block types also dequant_tile (vectorised)
    interleaved             whether interleaved.py can re-lay it 8 rows at a time
    quantize                float32 (rows, n_cols) -> stored, `quantize(x, out)`, or None
    activation              what x becomes on the default path: "q8" (int8 per 32 values with a
                            float32 scale, activation.py: ggml's vec_dot_type) or "f32"

Adding a type is one row here plus its kernels (a block layout documented beside them).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import numpy as np

from pyml.quant import blocks32, floats, kquants, quantizers
from pyml.quant.ggml_types import BLOCK_SIZE, TYPE_SIZE, QuantType


@dataclass(frozen=True)
class Traits:
    qtype: QuantType
    kernels: ModuleType
    dtype: np.dtype
    interleaved: bool = False
    quantize: Callable | None = None
    activation: str = "q8"

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE[self.qtype]

    @property
    def type_size(self) -> int:
        return TYPE_SIZE[self.qtype]

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    @property
    def is_float(self) -> bool:
        return self.activation == "f32"


_U8 = np.dtype(np.uint8)

TRAITS: dict[QuantType, Traits] = {t.qtype: t for t in (
    Traits(QuantType.F32, floats, np.dtype(np.float32), quantize=quantizers.cast, activation="f32"),
    Traits(QuantType.F16, floats, np.dtype(np.float16), quantize=quantizers.cast, activation="f32"),
    Traits(QuantType.BF16, floats, np.dtype(np.uint16), quantize=quantizers.to_bf16, activation="f32"),
    Traits(QuantType.Q4_0, blocks32, _U8, interleaved=True, quantize=quantizers.quantize_q4_0),
    Traits(QuantType.Q4_1, blocks32, _U8, interleaved=True, quantize=quantizers.quantize_q4_1),
    Traits(QuantType.Q5_0, blocks32, _U8, interleaved=True),
    Traits(QuantType.Q5_1, blocks32, _U8, interleaved=True),
    Traits(QuantType.Q8_0, blocks32, _U8, interleaved=True, quantize=quantizers.quantize_q8_0),
    Traits(QuantType.Q4_K, kquants, _U8, interleaved=True),
    Traits(QuantType.Q5_K, kquants, _U8),
    Traits(QuantType.Q6_K, kquants, _U8),
)}

FLOAT_TYPES = frozenset(q for q, t in TRAITS.items() if t.is_float)


def is_supported(qtype) -> bool:
    return qtype in TRAITS


def traits_of(qtype) -> Traits:
    try:
        return TRAITS[qtype]
    except KeyError:
        raise ValueError(f"unsupported weight type {getattr(qtype, 'name', qtype)}; "
                         f"supported: {', '.join(t.name for t in TRAITS.values())}") from None


def row_bytes(qtype, n_cols: int) -> int:
    """Bytes of one stored row of n_cols values (for float types: bytes of the row's elements)."""
    t = traits_of(qtype)
    if n_cols % t.block_size:
        raise ValueError(f"{t.name} rows hold whole blocks of {t.block_size} values; got {n_cols} columns")
    return n_cols // t.block_size * t.type_size
