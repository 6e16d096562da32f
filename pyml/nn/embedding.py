"""Token (and learned position) embedding lookups."""

from __future__ import annotations

import numpy as np

from pyml.core import perf
from pyml.nn.linear import Weight

_perf = perf.get("pyml.nn.embedding")


class Embedding:
    """ids [T] -> [T, d]; only the looked-up rows are read (or dequantized)."""

    def __init__(self, weight: Weight, name: str = "", scale: float | None = None):
        self.weight, self.name, self.scale = weight, name, scale
        self.num_embeddings, self.dim = weight.shape

    def __call__(self, ids) -> np.ndarray:
        with _perf.trace("embedding::lookup", "tokens={} dim={} {}", len(ids), self.dim,
                         self.weight.type_name, module=self.name, op="gather"):
            x = self.weight.rows(ids)
            if self.scale is not None:
                x *= np.float32(self.scale)
            return x
