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
        if ids.size == 1:  # a decode step: checked and read with no array operation (Weight.row),
            one = lo = hi = int(ids[0])  # which cost 60-100 µs on the caches its weights just flushed
        else:
            one = None
            lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
        if lo < 0 or hi >= self.num_embeddings:  # numpy would wrap a -1
            raise PymlError(f"{self.name or 'embedding'}: token id {lo if lo < 0 else hi} is outside the "
                            f"vocabulary of {self.num_embeddings} tokens")
        with _perf.trace("embedding::lookup", "tokens={} dim={} {}", len(ids), self.dim,
                         self.weight.type_name, module=self.name, op="gather"):
            x = self.weight.row(one) if one is not None else self.weight.rows(ids)
            if self.scale is not None:
                x *= np.float32(self.scale)
            return x
