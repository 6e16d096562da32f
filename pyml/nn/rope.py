"""Rotary position embeddings.

Two pairings of a head's values are in use: "half" rotates element i with
i + head_dim/2 (Hugging Face `rotate_half`, NeoX; Gemma everywhere), and
"interleaved" rotates 2i with 2i+1 (Meta's layout, which llama GGUF files keep
because the converter permutes Q/K rows back into it).
"""

from __future__ import annotations

import numpy as np

from pyml.core import perf

_perf = perf.get("pyml.nn.rope")


class RoPE:
    def __init__(self, head_dim: int, base: float, style: str = "half",
                 scaling_factor: float = 1.0, rotary_dim: int | None = None):
        if style not in ("half", "interleaved"):
            raise ValueError(f"rope style {style!r}")
        self.head_dim, self.base, self.style = head_dim, base, style
        self.rotary_dim = rotary_dim or head_dim
        half = self.rotary_dim // 2
        inv_freq = 1.0 / (base ** (np.arange(0, self.rotary_dim, 2, dtype=np.float64) / self.rotary_dim))
        self.inv_freq = inv_freq / scaling_factor  # linear scaling stretches positions
        self.half = half
        self._cached = (-1, 0, None, None)  # (pos, T, cos, sin): q and k share one computation

    def _cos_sin(self, pos: int, T: int):
        # Computed per call rather than tabled for the whole window: a 32K-position table
        # costs tens of MB per base, a decode step's few angles cost a microsecond.
        cached = self._cached  # one read: other threads may replace it (each with its own pos)
        if cached[:2] != (pos, T):
            angles = np.arange(pos, pos + T, dtype=np.float64)[:, None] * self.inv_freq  # [T, half]
            cached = self._cached = (pos, T, np.cos(angles).astype(np.float32)[:, None, :],
                                     np.sin(angles).astype(np.float32)[:, None, :])
        return cached[2], cached[3]

    def __call__(self, x: np.ndarray, pos: int) -> np.ndarray:
        """Rotate x [T, n_heads, head_dim] in place for positions pos .. pos+T-1."""
        T = x.shape[0]
        with _perf.trace("rope", "{} pos={} {}", list(x.shape), pos, self.style, op="rope"):
            cos, sin = self._cos_sin(pos, T)  # [T, 1, half]
            h = self.half
            if self.style == "half":
                a, b = x[..., :h].copy(), x[..., h:2 * h]
                x[..., :h] = a * cos - b * sin
                x[..., h:2 * h] = b * cos + a * sin
            else:
                a, b = x[..., 0:2 * h:2].copy(), x[..., 1:2 * h:2]
                x[..., 0:2 * h:2] = a * cos - b * sin
                x[..., 1:2 * h:2] = b * cos + a * sin
            return x
