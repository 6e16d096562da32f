"""Linear: the one thing a model multiplies through.

It hides how a weight is stored — float32, float16, bfloat16 bits, or ggml quantized
blocks — behind `y = x W^T + b`. Every kind goes to pyml.quant's Numba kernels, which
read the weights in place; not BLAS, even for float32 (docs/performance.md, "No BLAS in a
forward pass").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pyml import quant
from pyml.core import derived, perf
from pyml.core.mapping import release_pages
from pyml.quant import QuantType

_perf = perf.get("pyml.nn.linear")
FORWARD_SPAN = ("linear::forward", "{}->{} {}")  # (x's shape, (in, out), type); the fused step's too
MATMUL_FMT = "[{}x{}]x[{}x{}]"  # quant::matmul_f32_<type>: T, in, out, in
_SLAB_ROWS = 8192  # rows converted at a time by requantize: 8192 x 1152 float32 = 38 MB in flight


@dataclass(frozen=True, eq=False)
class Weight:
    """A 2-D weight as stored in the model file; its logical shape is (out, in).

    data: float32 / float16 (out, in); uint16 bfloat16 bits (out, in); uint8 ggml blocks
    (out, row_bytes) for quant types, or those blocks re-laid by quant.pack (a quant.Packed,
    after Linear.pack). Usually a read-only view into a memory-mapped file.
    """

    data: np.ndarray | quant.Packed
    qtype: QuantType
    shape: tuple

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def type_name(self) -> str:
        return self.qtype.name

    def rows(self, ids) -> np.ndarray:
        """float32 rows `ids` of the (out, in) matrix: embedding lookups."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.qtype == QuantType.F32:
            return np.ascontiguousarray(self.data[ids], dtype=np.float32)
        return quant.dequantize_rows(self.data, self.qtype, self.shape[1], ids)

    def row(self, i: int) -> np.ndarray:
        """float32 [1, in]: rows([i]) without its per-call array checks (quant.row_reader)."""
        if self.qtype == QuantType.F32:
            return np.array(self.data[i:i + 1], np.float32)
        read = self.__dict__.get("_row_reader")  # made on first use (the dataclass is frozen)
        if read is None:
            read = self.__dict__["_row_reader"] = quant.row_reader(self.data, self.qtype, self.shape[1])
        return read(i)

    def dense(self) -> np.ndarray:
        """The whole matrix as float32 (out, in): for tests and small tensors only."""
        if self.qtype == QuantType.F32:
            return np.ascontiguousarray(self.data)
        return quant.dequantize(self.data, self.qtype, self.shape[1])


class Linear:
    """y = x @ W^T + b for x [T, in] -> [T, out]."""

    def __init__(self, weight: Weight, bias: np.ndarray | None = None, name: str = ""):
        self.weight, self.bias, self.name = weight, bias, name
        self.prefill_weight = None  # bf16 blocks of float weights for T > 1 (pack, --float-compute bf16)
        self.out_features, self.in_features = weight.shape
        self.matmul_event = f"quant::matmul_f32_{weight.qtype.name.lower()}"  # for the spans
        self.dims, self.type_name = (self.in_features, self.out_features), weight.qtype.name

    def __call__(self, x: np.ndarray) -> np.ndarray:  # [T, in] -> [T, out]
        w = self.weight
        with _perf.trace(*FORWARD_SPAN, x.shape, self.dims, self.type_name,
                         module=self.name, op="linear", dtype=self.type_name):
            with _perf.trace(self.matmul_event, MATMUL_FMT, x.shape[0], x.shape[1],
                             self.out_features, self.in_features, module=self.name, op="quant_matmul"):
                y = self._matmul(x)
            if self.bias is not None:
                y += self.bias
            return y

    def _matmul(self, x: np.ndarray) -> np.ndarray:
        """Decode rows (quant.decode_rows(): the leading rows of a batched pass, one token of a sequence
        each) take the stored weights, their GEMV's bits; the rest (a prompt's rows) the GEMM, on the
        bf16 blocks if there are any. A pass holding both runs the two as two matmuls."""
        w, T = self.weight, x.shape[0]
        n = quant.decode_row_count(T)
        prefill = w.data if self.prefill_weight is None else self.prefill_weight
        if n == 0 or n == T:
            return quant.matmul(x, w.data if n else prefill, w.qtype, self.in_features)
        y = np.empty((T, self.out_features), np.float32)
        with quant.decode_rows(True):
            quant.matmul(x[:n], w.data, w.qtype, self.in_features, out=y[:n])
        with quant.decode_rows(False):
            quant.matmul(x[n:], prefill, w.qtype, self.in_features, out=y[n:])
        return y

    def requantize(self, qtype) -> "Linear":
        """The same matrix re-stored as `qtype` (a type with a quantizer: Q8_0, Q4_0, Q4_1, ...),
        converted through float32 a slab of rows at a time, so no float32 copy of the whole
        matrix is ever held (Gemma 3's 262144 x 1152 head is 1.21 GB in float32)."""
        w = self.weight
        n_rows, n_cols = w.shape
        blocks = None
        for r0 in range(0, n_rows, _SLAB_ROWS):
            r1 = min(n_rows, r0 + _SLAB_ROWS)
            slab = quant.quantize(w.rows(np.arange(r0, r1)), qtype)
            if blocks is None:
                blocks = np.empty((n_rows, slab.shape[1]), slab.dtype)
            blocks[r0:r1] = slab
        blocks.flags.writeable = False
        return Linear(Weight(blocks, qtype, (n_rows, n_cols)), self.bias, name=self.name)

    def pack(self, float_compute: str = "f32") -> bool:
        """Re-lay quantized weights 8 rows at a time where pyml.quant has that layout (Q4_0, Q4_1,
        Q5_0, Q5_1, Q8_0, Q4_K: 1.2-3.8x the matmul speed); quant.pack gives the file's pages of
        the original back as it copies. Float weights whose `float_compute` (quant.FLOAT_COMPUTE)
        resolves to bf16 get bf16 blocks for the prefill beside them (quant/bf16_gemm.py); a decode step
        (T == 1) keeps streaming the stored weights. Call after fuse. Returns whether it packed."""
        w = self.weight
        if isinstance(w.data, quant.Packed) or self.prefill_weight is not None:
            return False
        if quant.float_compute(float_compute, w.qtype) == "bf16":
            self.prefill_weight = quant.pack_bf16(w.data, w.qtype, self.in_features, key=self.name or None)
            return True
        packed = quant.pack(w.data, w.qtype, self.in_features, key=self.name or None)
        if packed is None:
            return False
        self.weight = Weight(packed, w.qtype, w.shape)  # a tied embedding reads its rows from the file
        return True

    @staticmethod
    def fuse(linears: list["Linear"], name: str) -> "Linear | None":
        """One Linear computing the concatenation of several outputs (QKV, gate+up).

        Fewer, larger matmuls mean fewer calls per layer — what small models are
        bound by. Returns None when the weights cannot share one kernel (different
        storage types or input sizes). The concatenation is a derived array
        (core/derived.py): a packed-weights cache keeps it, or, for a type that pack() will
        re-lay, keeps the packed form instead, and then nothing is concatenated at all.
        """
        ws = [lin.weight for lin in linears]
        if any(isinstance(w.data, quant.Packed) for w in ws):
            raise ValueError("Linear.fuse takes weights as stored: fuse before pack")
        if len({w.qtype for w in ws}) != 1 or len({w.shape[1] for w in ws}) != 1:
            return None
        qtype, out = ws[0].qtype, sum(w.shape[0] for w in ws)
        shape = (out, ws[0].shape[1])
        data = quant.packed_from_cache(name, qtype, shape) if name else None
        if data is None:
            def concatenate(into):
                np.concatenate([w.data for w in ws], axis=0, out=into)

            stored = (out, *ws[0].data.shape[1:])
            if quant.packs(qtype, out):  # only pack() reads it: a temporary, the packed copy is kept
                data = np.empty(stored, ws[0].data.dtype)
                concatenate(data)
            else:
                data = derived.array(f"{name}.weight" if name else None, stored, ws[0].data.dtype, concatenate)
        for w in ws:  # the file's pages of the parts are not read again: give them back
            release_pages(w.data)
        biases = [lin.bias for lin in linears]
        if any(b is not None for b in biases):
            biases = [np.zeros(lin.out_features, np.float32) if b is None else b
                      for lin, b in zip(linears, biases)]
            bias = np.concatenate(biases)
        else:
            bias = None
        return Linear(Weight(data, qtype, shape), bias, name)
