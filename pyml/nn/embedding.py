"""Token (and learned position) embedding lookups."""

from __future__ import annotations

import numpy as np

from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.nn.linear import Weight

_perf = perf.get("pyml.nn.embedding")


class Embedding:
    """ids [T] -> [T, d]; only the looked-up rows are read (or dequantized)."""

    def __init__(self, weight: Weight, name: str = "", scale: float | None = None):
        self.weight, self.name, self.scale = weight, name, scale
        self.num_embeddings, self.dim = weight.shape

    def __call__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):  # numpy would wrap a -1
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise PymlError(f"{self.name or 'embedding'}: token id {bad} is outside the vocabulary "
                            f"of {self.num_embeddings} tokens")
        with _perf.trace("embedding::lookup", "tokens={} dim={} {}", len(ids), self.dim,
                         self.weight.type_name, module=self.name, op="gather"):
            x = self.weight.rows(ids)
            if self.scale is not None:
                x *= np.float32(self.scale)
            return x
