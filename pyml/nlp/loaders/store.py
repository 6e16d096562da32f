"""TensorStore: a model file's tensors under one naming scheme, with shape checks.

Loaders fill it with (array, type name[, logical shape]) entries — zero-copy views
into the mapped file — and models take their weights from it by Hugging Face
name, stating the shape the config implies. A mismatch is a clear error naming
the tensor, never a broadcast or a crash later in a kernel.
"""

from __future__ import annotations

import re

import numpy as np

from pyml import quant
from pyml.core import derived
from pyml.core.errors import ModelFormatError
from pyml.core.mapping import release_pages
from pyml.nn.linear import Weight
from pyml.quant import QuantType


class TensorStore:
    def __init__(self, tensors: dict, source: str):
        # name -> (data, type_name, logical_shape); logical_shape defaults to data.shape
        self.tensors = {n: (e[0], e[1], tuple(e[2]) if len(e) > 2 else tuple(e[0].shape))
                        for n, e in tensors.items()}
        self.source = source
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self):
        return list(self.tensors)

    def shape(self, name: str) -> tuple:
        return self._entry(name)[2]

    def type_name(self, name: str) -> str:
        return self._entry(name)[1]

    def rename(self, mapping):
        """Apply `mapping(name) -> new name or None`. None keeps the file's name: nothing is dropped
        here, so a tensor no model asks for is still there for `check_all_used` to name."""
        renamed, origin = {}, {}
        for name, entry in self.tensors.items():
            new = mapping(name) or name
            if new in renamed:
                raise ModelFormatError(f"{self.source}: tensors {origin[new]!r} and {name!r} are both {new!r}")
            renamed[new], origin[new] = entry, name
        self.tensors = renamed

    def check_all_used(self, known_unused: dict):
        """Every tensor was taken by the model or matches a `known_unused` pattern (regex -> the reason
        it is safe to ignore); anything else is one error naming it: a tensor the model does not
        understand may change the math (the Llama 3 `rope_freqs` did, while it was dropped)."""
        unknown = [name for name in self.tensors
                   if name not in self.used and not any(re.search(p, name) for p in known_unused)]
        if unknown:
            raise ModelFormatError(f"{self.source}: {len(unknown)} tensor(s) the config does not account for, "
                                   f"first {unknown[0]!r} (not used by this architecture, and not on its list "
                                   f"of tensors known to be safe to ignore)")

    def _entry(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.source}: required tensor {name!r} is missing") from None

    def _check(self, name: str, shape, expected):
        if tuple(shape) != tuple(expected):
            raise ModelFormatError(f"{self.source}: tensor {name!r} has shape {list(shape)}, "
                                   f"the config implies {list(expected)}")

    def weight(self, name: str, shape, transposed: bool = False) -> Weight:
        """A 2-D weight of logical shape (out, in) = `shape`.

        `transposed`: the file stores it (in, out) (GPT-2's Conv1D): it is copied once into
        (out, in), the layout every kernel reads, and the file's pages are given back.
        """
        data, type_name, stored = self._entry(name)
        self._check(name, stored, tuple(shape)[::-1] if transposed else shape)
        self.used.add(name)
        qtype = QuantType[type_name]
        if transposed:  # a derived array (core/derived.py): the packed-weights cache keeps it
            file_data = data
            data = derived.array(f"{name}.T", file_data.shape[::-1], file_data.dtype,
                                 lambda out: np.copyto(out, file_data.T))
            release_pages(file_data)
        return Weight(data, qtype, tuple(shape))

    def vector(self, name: str, shape) -> np.ndarray:
        """A small tensor (norm weight, bias) as float32."""
        data, type_name, stored = self._entry(name)
        self._check(name, stored, shape)
        self.used.add(name)
        if type_name in ("F32", "F16", "F64"):
            return np.ascontiguousarray(data, dtype=np.float32)
        return quant.dequantize(data.reshape(1, -1), QuantType[type_name], int(np.prod(shape))).reshape(shape)
