"""The traits table: one row per weight storage type, as ggml's `type_traits`.

A quantized weight matrix is the raw GGUF tensor data: uint8 (rows, row_bytes) with
row_bytes = n_cols // block_size * type_size, each row a run of blocks. Float weights are
(rows, n_cols) arrays: float32, float16, or uint16 holding bfloat16 bits (block size 1).

Each row of TRAITS says what pyml knows of a type:
    block_size, type_size   values and bytes per block (ggml's numbers, ggml_types.py)
    dtype                   the stored matrix's element type (what loaders and quantize hand out)
    kernels                 its KernelSet (kernel_set.py): dequant_rows (the scalar reference
                            decoding), dequant_tile (vectorised), gemv, gemv_exact, gemm, each with
                            the type id a compile-time constant
    interleaved             the GEMV and GEMM of the 8-row interleaved layout, for the types
                            interleaved.py can re-lay (None: the file's layout only)
    quantize                float32 (rows, n_cols) -> stored, `quantize(x, out)`, or None
    activation              what x becomes on the default path: "q8" (int8 per 32 values with a
                            float32 scale, activation.py: ggml's vec_dot_type) or "f32"
    ggml_activation         what ggml's CPU backend rounds x to for this type (its vec_dot_type:
                            q8_0, q8_1, q8_K, f16, bf16, f32), for quant.ggml_activations()

Adding a type is one row here plus its kernels (a block layout documented beside them, and
the row-level functions kernel_set.py runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from pyml.quant import quantizers
from pyml.quant.floats import float_kernels
from pyml.quant.ggml_types import BLOCK_SIZE, TYPE_SIZE, QuantType
from pyml.quant.interleaved_gemm import InterleavedKernels, interleaved_kernels
from pyml.quant.kernel_set import KernelSet, block_kernels
from pyml.quant.lowbit import lowbit_kernels


@dataclass(frozen=True)
class Traits:
    qtype: QuantType
    kernels: KernelSet
    dtype: np.dtype
    interleaved: InterleavedKernels | None = None
    quantize: Callable | None = None
    activation: str = "q8"
    ggml_activation: str = "q8_K"

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
F32, F16, BF16 = QuantType.F32, QuantType.F16, QuantType.BF16
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q5_1, QuantType.Q8_0
Q4_K, Q5_K, Q6_K = QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K
Q2_K, Q3_K, IQ4_NL, IQ4_XS = QuantType.Q2_K, QuantType.Q3_K, QuantType.IQ4_NL, QuantType.IQ4_XS

TRAITS: dict[QuantType, Traits] = {t.qtype: t for t in (
    Traits(F32, float_kernels(F32), np.dtype(np.float32), quantize=quantizers.cast, activation="f32",
           ggml_activation="f32"),
    Traits(F16, float_kernels(F16), np.dtype(np.float16), quantize=quantizers.cast, activation="f32",
           ggml_activation="f16"),
    Traits(BF16, float_kernels(BF16), np.dtype(np.uint16), quantize=quantizers.to_bf16, activation="f32",
           ggml_activation="bf16"),
    Traits(Q4_0, block_kernels(Q4_0), _U8, interleaved_kernels(Q4_0), quantize=quantizers.quantize_q4_0,
           ggml_activation="q8_0"),
    Traits(Q4_1, block_kernels(Q4_1), _U8, interleaved_kernels(Q4_1), quantize=quantizers.quantize_q4_1,
           ggml_activation="q8_1"),
    Traits(Q5_0, block_kernels(Q5_0), _U8, interleaved_kernels(Q5_0), ggml_activation="q8_0"),
    Traits(Q5_1, block_kernels(Q5_1), _U8, interleaved_kernels(Q5_1), ggml_activation="q8_1"),
    Traits(Q8_0, block_kernels(Q8_0), _U8, interleaved_kernels(Q8_0), quantize=quantizers.quantize_q8_0,
           ggml_activation="q8_0"),
    Traits(Q4_K, block_kernels(Q4_K), _U8, interleaved_kernels(Q4_K)),
    Traits(Q5_K, block_kernels(Q5_K), _U8),
    Traits(Q6_K, block_kernels(Q6_K), _U8),
    Traits(Q2_K, lowbit_kernels(Q2_K), _U8),
    Traits(Q3_K, lowbit_kernels(Q3_K), _U8),
    Traits(IQ4_NL, lowbit_kernels(IQ4_NL), _U8, ggml_activation="q8_0"),
    Traits(IQ4_XS, lowbit_kernels(IQ4_XS), _U8),
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
