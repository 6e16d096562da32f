"""Normalisation layers over the last axis."""

from __future__ import annotations

import numpy as np

from pyml.core import ops


class RMSNorm:
    """x * rsqrt(mean(x^2) + eps) * w; with `unit_offset`, * (1 + w) as Gemma's HF checkpoints store it."""

    def __init__(self, weight: np.ndarray, eps: float, unit_offset: bool = False, name: str = ""):
        self.weight = np.ascontiguousarray(weight, dtype=np.float32)
        self.eps, self.unit_offset, self.name = float(eps), bool(unit_offset), name

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return ops.rms_norm(x, self.weight, self.eps, self.unit_offset)


class LayerNorm:
    """(x - mean) / sqrt(var + eps) * w + b."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, eps: float, name: str = ""):
        self.weight = np.ascontiguousarray(weight, dtype=np.float32)
        self.bias = np.ascontiguousarray(bias, dtype=np.float32)
        self.eps, self.name = float(eps), name

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)
