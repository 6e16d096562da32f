"""Rotary position embeddings.

Two pairings of a head's values are in use: "half" rotates element i with
i + head_dim/2 (Hugging Face `rotate_half`, NeoX; Gemma everywhere), and
"interleaved" rotates 2i with 2i+1 (Meta's layout, which llama GGUF files keep
because the converter permutes Q/K rows back into it).
"""

from __future__ import annotations

import numpy as np

from pyml.core import ops, perf
from pyml.core.errors import ModelFormatError

_perf = perf.get("pyml.nn.rope")
SPAN = ("rope", "{} pos={} {}")  # x's shape, pos, style


class RoPE:
    def __init__(self, head_dim: int, base: float, style: str = "half",
                 scaling_factor: float = 1.0, rotary_dim: int | None = None, freq_divisors=None):
        if style not in ("half", "interleaved"):
            raise ValueError(f"rope style {style!r}")
        self.head_dim, self.base, self.style = head_dim, base, style
        self.rotary_dim = rotary_dim or head_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ModelFormatError(f"RoPE rotates pairs of a head's values: {self.rotary_dim} rotary dims "
                                   f"in a head of {head_dim} cannot be")
        inv_freq = 1.0 / (base ** (np.arange(0, self.rotary_dim, 2, dtype=np.float64) / self.rotary_dim))
        self.inv_freq = inv_freq / scaling_factor  # linear scaling stretches positions
        if freq_divisors is not None:  # per-pair scaling (Llama 3: long wavelengths stretched, short kept)
            freq_divisors = np.asarray(freq_divisors, dtype=np.float64).reshape(-1)
            if freq_divisors.shape != inv_freq.shape or not np.all(np.isfinite(freq_divisors)) \
                    or np.any(freq_divisors <= 0):
                raise ModelFormatError(f"RoPE frequency divisors must be {inv_freq.size} positive numbers, "
                                       f"got {freq_divisors.size}")
            self.inv_freq = self.inv_freq / freq_divisors
        self._table = (0, 0, None, None)  # the last prefill's (pos, T, cos, sin): its layers share it
        self._rows_table = (None, None, None)  # the last batched step's (positions, cos, sin)

    def table(self, pos: int, T: int):
        """cos, sin [T, rotary_dim / 2] of positions pos .. pos+T-1, made once for every layer of a
        forward pass that shares this RoPE (and for both its q and k)."""
        last = self._table
        if last[0] != pos or last[1] != T:
            last = (pos, T, *ops.rope_table(np.arange(pos, pos + T), self.inv_freq))
            self._table = last
        return last[2], last[3]

    def rotate_rows(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate x [T, n_heads, head_dim] in place, row t at positions[t] (a batched step's rows,
        each of its own sequence); the table is made once for the step's layers, q and k."""
        last = self._rows_table
        if last[0] is not positions:  # the step's one positions array: an identity check suffices
            last = self._rows_table = (positions, *ops.rope_table(positions, self.inv_freq))
        with _perf.trace(*SPAN, x.shape, "rows", self.style, op="rope"):
            return ops.rope_by_table(x, last[1], last[2], self.style == "interleaved")

    def __call__(self, x: np.ndarray, pos: int) -> np.ndarray:
        """Rotate x [T, n_heads, head_dim] in place for positions pos .. pos+T-1."""
        with _perf.trace(*SPAN, x.shape, pos, self.style, op="rope"):
            if x.shape[0] == 1:  # a decode step: one position's angles, on the calling thread
                return ops.rope(x, pos, self.inv_freq, self.style == "interleaved")
            return ops.rope_by_table(x, *self.table(pos, x.shape[0]), self.style == "interleaved")
