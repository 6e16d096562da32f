"""RoPE scaling as configs declare it: which kinds pyml computes, and the per-pair frequency divisors.

Hugging Face configs say it in `rope_parameters` (transformers >= 5, with rope_theta inside) or
`rope_scaling` (older); GGUF files in `{arch}.rope.scaling.*` keys, and for Llama 3 as a
`rope_freqs.weight` tensor of per-pair divisors the converter computes from the same
parameters. Every kind is one of: "default" (none), "linear" (positions divided by factor),
"llama3" (long wavelengths divided by factor, short ones kept, a smooth ramp between:
transformers' `_compute_llama3_parameters`). Any other kind (yarn, longrope, dynamic, ...)
is refused with one line naming it: scaling that is not applied changes every logit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyml.core.errors import ModelFormatError, UnsupportedError
from pyml.nlp.models.config_keys import require

KINDS = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0           # llama3: wavelengths above original/low are divided by factor
    high_freq_factor: float = 4.0          # llama3: wavelengths below original/high are kept
    original_max_positions: int = 8192     # llama3: the context the model was trained at

    def divisors(self, theta: float, rotary_dim: int) -> np.ndarray | None:
        """Per rotated pair, what its frequency is divided by (None: unscaled)."""
        if self.kind == "default":
            return None
        if self.kind == "linear":
            return np.full(rotary_dim // 2, self.factor)
        inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
        wavelen = 2 * math.pi / inv_freq
        smooth = (self.original_max_positions / wavelen - self.low_freq_factor) / \
                 (self.high_freq_factor - self.low_freq_factor)
        medium = 1.0 / ((1 - smooth) / self.factor + smooth)
        return np.where(wavelen < self.original_max_positions / self.high_freq_factor, 1.0,
                        np.where(wavelen > self.original_max_positions / self.low_freq_factor, self.factor, medium))

    @classmethod
    def from_hf(cls, cfg: dict, source: str, default_theta: float = 10000.0) -> tuple:
        """(rope_theta, RopeScaling) of a config.json."""
        params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ModelFormatError(f"{source}: rope_parameters must be an object, got {params!r}")
        theta = require({"rope_theta": params.get("rope_theta", cfg.get("rope_theta", default_theta))},
                        "rope_theta", float, source)
        kind = params.get("rope_type", params.get("type")) or "default"
        if kind not in KINDS:
            raise UnsupportedError(f"{source}: rope type {kind!r} is not supported (supported: {', '.join(KINDS)})")
        if kind == "default":
            return theta, cls()
        factor = require(params, "factor", float, source)
        if kind == "linear":
            return theta, cls("linear", factor)
        low, high = (require({k: params.get(k, d)}, k, float, source)
                     for k, d in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0)))
        if high <= low:
            raise ModelFormatError(f"{source}: llama3 rope needs high_freq_factor > low_freq_factor")
        original = require(params, "original_max_position_embeddings", int, source)
        return theta, cls("llama3", factor, low, high, original)

    @classmethod
    def from_gguf(cls, f, arch: str) -> "RopeScaling":
        """`{arch}.rope.scaling.type` (absent: none, or `rope.scale_linear` in older files). Llama 3's
        scaling is not in the metadata but in the rope_freqs tensor, which the model reads."""
        kind = f.get(f"{arch}.rope.scaling.type", "none")
        if kind == "none":
            factor = float(f.get(f"{arch}.rope.scale_linear", 1.0))
            return cls("linear", factor) if factor != 1.0 else cls()
        if kind != "linear":
            raise UnsupportedError(f"{f.path}: rope scaling type {kind!r} is not supported "
                                   f"(supported: none, linear, and llama3 as a rope_freqs tensor)")
        return cls("linear", float(f.require(f"{arch}.rope.scaling.factor")))
