"""Arrays a model build derives from its file, and where they live.

Loading a model copies some weights into another layout: GPT-2's Conv1D matrices transposed,
Q/K/V and gate/up concatenated, the legacy quant types re-laid 8 rows at a time. The layers
that make those copies ask for each one here, by a key that names it within the model
(`model.layers.0.self_attn.qkv_proj.x8`), with a `fill` that writes it. Where the array lives
is the provider's business: by default process memory (fill runs every load); while
`pyml.nlp.api.load_model` builds a model it is the packed-weights cache
(nlp/loaders/packed_cache.py), which fills the array straight into a cache file on the first
load and hands back a read-only view of that file on later ones without calling `fill` at all
(zero copies, pages shared between processes).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

Fill = Callable[[np.ndarray], None]


class InMemory:
    """The default provider: every derived array is made in process memory, every time."""

    def array(self, key: str | None, shape: tuple, dtype, fill: Fill) -> np.ndarray:
        out = np.empty(shape, dtype)
        fill(out)
        out.flags.writeable = False  # derived weights are read like the file's: one array kind
        return out

    def lookup(self, key: str, shape: tuple, dtype) -> np.ndarray | None:
        return None


_provider: contextvars.ContextVar = contextvars.ContextVar("pyml_derived", default=InMemory())


@contextmanager
def using(provider):
    """Derived arrays come from `provider` inside the block (the model builder's)."""
    token = _provider.set(provider)
    try:
        yield provider
    finally:
        _provider.reset(token)


def array(key: str | None, shape, dtype, fill: Fill) -> np.ndarray:
    """The read-only array `key` of `shape` and `dtype`: made by `fill(out)` unless the provider
    already holds it. A key of None is never kept (a copy nothing can find again)."""
    return _provider.get().array(key, tuple(int(n) for n in shape), np.dtype(dtype), fill)


def lookup(key: str, shape, dtype) -> np.ndarray | None:
    """The array `key` if the provider already holds it with this shape and dtype, else None:
    lets a layer skip the work that only feeds a derived array (a concatenation before a re-layout)."""
    return _provider.get().lookup(key, tuple(int(n) for n in shape), np.dtype(dtype))
