"""Preallocated key/value cache, one pair of arrays per layer.

Layout [n_kv_heads, max_len, head_dim] keeps each head's keys contiguous over
positions, so a decode step's Q.K^T and P.V stream one contiguous slab per head.
Nothing is reallocated per token.
"""

from __future__ import annotations

import numpy as np

from pyml.core import perf
from pyml.core.errors import PymlError

_perf = perf.get("pyml.nn.kv_cache")


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int):
        self.n_layers, self.n_kv_heads, self.head_dim, self.max_len = n_layers, n_kv_heads, head_dim, max_len
        self.k = [np.zeros((n_kv_heads, max_len, head_dim), np.float32) for _ in range(n_layers)]
        self.v = [np.zeros((n_kv_heads, max_len, head_dim), np.float32) for _ in range(n_layers)]
        self.length = 0  # positions filled (advanced by the model after a forward pass)

    @property
    def nbytes(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.max_len * self.head_dim * 4

    def update(self, layer: int, pos: int, k: np.ndarray, v: np.ndarray):
        """Write k, v [T, n_kv_heads, head_dim] at positions pos .. pos+T-1."""
        T = k.shape[0]
        if pos + T > self.max_len:
            raise PymlError(f"KV cache full: position {pos + T} exceeds its {self.max_len} slots")
        with _perf.trace("kv_cache::update", "layer={} pos={}", layer, pos, layer=layer, op="kv_cache"):
            self.k[layer][:, pos:pos + T] = k.transpose(1, 0, 2)
            self.v[layer][:, pos:pos + T] = v.transpose(1, 0, 2)

    def view(self, layer: int, end: int, start: int = 0):
        """Keys and values of positions start .. end-1: two [n_kv_heads, end-start, head_dim] views."""
        return self.k[layer][:, start:end], self.v[layer][:, start:end]
