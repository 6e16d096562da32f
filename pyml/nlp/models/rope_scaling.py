"""RoPE scaling as configs declare it: which kinds pyml computes, and the per-pair frequency divisors.

Hugging Face configs say it in `rope_parameters` (transformers >= 5, with rope_theta inside) or
`rope_scaling` (older); GGUF files in `{arch}.rope.scaling.*` keys, and for Llama 3 as a
`rope_freqs.weight` tensor of per-pair divisors the converter computes from the same
parameters. Every kind is one of: "default" (none), "linear" (positions divided by factor),
"llama3" (long wavelengths divided by factor, short ones kept, a smooth ramp between:
transformers' `_compute_llama3_parameters`), "yarn" (interpolated and extrapolated frequencies
mixed by a linear ramp over the pair index, and cos/sin scaled by an attention factor:
transformers' `_compute_yarn_parameters`, ggml's `rope_yarn` with ext_factor 1; the factor
scales both q and k, so pyml folds its square into the attention scale). Any other kind
(longrope, dynamic, ...) is refused with one line naming it: scaling that is not applied
changes every logit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyml.core.errors import ModelFormatError, UnsupportedError
from pyml.nlp.models.config_keys import require

KINDS = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0           # llama3: wavelengths above original/low are divided by factor
    high_freq_factor: float = 4.0          # llama3: wavelengths below original/high are kept
    original_max_positions: int = 8192     # llama3, yarn: the context the model was trained at
    beta_fast: float = 32.0                # yarn: rotations bounding the ramp
    beta_slow: float = 1.0
    attention_factor: float = 1.0          # yarn: cos and sin are multiplied by it
    truncate: bool = True                  # yarn: the ramp bounds are rounded to whole pairs

    def divisors(self, theta: float, rotary_dim: int) -> np.ndarray | None:
        """Per rotated pair, what its frequency is divided by (None: unscaled)."""
        if self.kind == "default":
            return None
        if self.kind == "linear":
            return np.full(rotary_dim // 2, self.factor)
        inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
        if self.kind == "yarn":
            def pair(rotations):  # the pair index whose wavelength fits `rotations` times in the context
                return rotary_dim * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / \
                    (2 * math.log(theta))
            low, high = pair(self.beta_fast), pair(self.beta_slow)
            if self.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, rotary_dim - 1)
            ramp = np.clip((np.arange(rotary_dim // 2) - low) / max(high - low, 0.001), 0, 1)
            extrapolated = 1 - ramp  # 1: the pair keeps its frequency; 0: divided by factor
            return 1.0 / ((1 - extrapolated) / self.factor + extrapolated)
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
        if kind == "yarn":
            return theta, cls.yarn(params, factor, source)
        low, high = (require({k: params.get(k, d)}, k, float, source)
                     for k, d in (("low_freq_factor", 1.0), ("high_freq_factor", 4.0)))
        if high <= low:
            raise ModelFormatError(f"{source}: llama3 rope needs high_freq_factor > low_freq_factor")
        original = require(params, "original_max_position_embeddings", int, source)
        return theta, cls("llama3", factor, low, high, original)

    @classmethod
    def yarn(cls, params: dict, factor: float, source: str) -> "RopeScaling":
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise UnsupportedError(f"{source}: yarn with mscale / mscale_all_dim (DeepSeek style) is not supported")
        original = require(params, "original_max_position_embeddings", int, source)
        attention = params.get("attention_factor")
        attention = (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0) if attention is None \
            else require(params, "attention_factor", float, source)
        beta_fast, beta_slow = (require({k: params.get(k) or d}, k, float, source)
                                for k, d in (("beta_fast", 32.0), ("beta_slow", 1.0)))
        return cls("yarn", factor, original_max_positions=original, beta_fast=beta_fast, beta_slow=beta_slow,
                   attention_factor=attention, truncate=bool(params.get("truncate", True)))

    @classmethod
    def from_gguf(cls, f, arch: str, allow_yarn: bool = True) -> "RopeScaling":
        """`{arch}.rope.scaling.type` (absent: none, or `rope.scale_linear` in older files). Llama 3's
        scaling is not in the metadata but in the rope_freqs tensor, which the model reads."""
        kind = f.get(f"{arch}.rope.scaling.type", "none")
        if kind == "none":
            factor = float(f.get(f"{arch}.rope.scale_linear", 1.0))
            return cls("linear", factor) if factor != 1.0 else cls()
        if kind not in ("linear", "yarn") or (kind == "yarn" and not allow_yarn):
            raise UnsupportedError(f"{f.path}: rope scaling type {kind!r} is not supported "
                                   f"(supported: none, linear, {'yarn, ' if allow_yarn else ''}and llama3 as a "
                                   f"rope_freqs tensor)")
        factor = float(f.require(f"{arch}.rope.scaling.factor"))
        if kind == "linear":
            return cls("linear", factor)
        key = f"{arch}.rope.scaling."
        for extra in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier"):
            # llama.cpp combines these with its own mscale in ways that moved between versions
            if f.get(key + extra) is not None:
                raise UnsupportedError(f"{f.path}: metadata {key + extra} is not supported")
        return cls.yarn({"original_max_position_embeddings": f.require(key + "original_context_length"),
                         "beta_fast": f.get(key + "yarn_beta_fast"), "beta_slow": f.get(key + "yarn_beta_slow")},
                        factor, str(f.path))
