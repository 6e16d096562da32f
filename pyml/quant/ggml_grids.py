"""llama.cpp's activation rounding, for figures that compare with its own (pyml-perplexity --activations ggml).

Both engines round a quantized product's float32 activations before the integer dot products, on
different grids: pyml to int8 with a float32 scale per 32 values for every weight type
(activation.py), ggml's CPU backend to its weight type's vec_dot_type (ggml-cpu.c's type_traits_cpu;
Traits.ggml_activation). Each rounding is a step function, so each engine draws its own rounding of the
same model, and the grids differ in what they cost: on Gemma 3's FFN inputs q8_K (one scale per 256
values, the K-quants') puts 1.9% of error into ffn_down's output where pyml's grid puts 0.8%
(docs/perplexity.md, "Activations rounded as ggml rounds them"). Inside `with quant.ggml_activations():`
every quant.matmul rounds x to ggml's grid for its weight type, then dots that x with the decoded
weights in float32 (dispatch's exact path): ggml's own mul_mat up to the order of float sums
(tests/quant/test_ggml_grids_peer.py holds it to ggml's, called through ctypes).

The grids, as llama.cpp (llama-cpp-python 0.3.36's vendor/llama.cpp) computes them on x86:
  q8_0  Q4_0 Q5_0 Q8_0 IQ4_NL   per 32 values: d = amax / 127 kept as fp16; q = rint(x * (127 / amax))
                                (arch/x86/quants.c quantize_row_q8_0: round half to even, 127 / amax);
                                x' = fp16(d) * q
  q8_1  Q4_1 Q5_1               the q8_0 codes and d. ggml also keeps s = fp16(d * sum q) for the
                                weights' mins, where here they meet fp16(d) * sum q: two fp16
                                roundings (2^-10 relative at most) of that one term, not emulated
  q8_K  K-quants, IQ4_XS        per 256 values: m = the value of largest |x| (the first such),
                                iscale = -127 / m, q = min(127, rint(iscale * x)), d = 1 / iscale in
                                float32 (ggml-quants.c quantize_row_q8_K_ref, x86's too); x' = d * q
  f16, bf16                     x rounded to the weight's float type, to nearest even
  f32                           nothing
The mode also rounds a prompt's attention as llama.cpp's does (Q and the probabilities to f16, around
its f16 KV cache: nn/attention_ggml.py). Not emulated: the order of its float sums. The compiled decode
step does not go through quant.matmul: this serves forward passes of prompts (perplexity, scoring), and
its matmuls run on the float path at its speed.
"""

from __future__ import annotations

import threading

import numpy as np

from pyml.core import perf

_perf = perf.get("pyml.quant.ggml_grids")
_mode = threading.local()  # per calling thread: whether matmuls round as ggml (ggml_activations())
_F32 = np.float32


class ggml_activations:
    """`with quant.ggml_activations():` the quant.matmul calls inside round their activations as
    llama.cpp's CPU backend does (module doc), on the float path."""

    def __init__(self, on: bool = True):
        self.on = on

    def __enter__(self):
        self.saved, _mode.on = active(), self.on
        return self

    def __exit__(self, *exc):
        _mode.on = self.saved
        return False


def active() -> bool:
    return getattr(_mode, "on", False)


def round_as_ggml(x: np.ndarray, grid: str) -> np.ndarray:
    """float32 [T, n] -> float32 [T, n]: x on ggml's `grid` (q8_0, q8_1, q8_K, f16, bf16, f32)."""
    if grid == "f32":
        return x
    with _perf.trace("quant::ggml_round", "[{}x{}] {}", *x.shape, grid, op="ggml_round"):
        x = np.ascontiguousarray(x, _F32)
        if grid in ("q8_0", "q8_1"):
            return _round_q8_0(x)
        if grid == "q8_K":
            return _round_q8_k(x)
        if grid == "f16":
            return x.astype(np.float16).astype(_F32)
        if grid == "bf16":
            bits = x.view(np.uint32)
            return ((bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000).view(_F32)
        raise ValueError(f"no ggml activation grid {grid!r}")


def _round_q8_0(x):
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    d = (amax / _F32(127)).astype(np.float16).astype(_F32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, _F32(127) / amax, _F32(0)).astype(_F32)
    return (d * np.rint(blocks * inv)).reshape(x.shape)


def _round_q8_k(x):
    blocks = x.reshape(-1, 256)
    first = np.abs(blocks).argmax(axis=1)[:, None]  # argmax: the first of equal |x|, as ggml's strict `>`
    m = np.take_along_axis(blocks, first, axis=1)
    with np.errstate(divide="ignore"):
        iscale = np.where(m != 0, _F32(-127) / m, _F32(0)).astype(_F32)
        d = np.where(m != 0, _F32(1) / iscale, _F32(0)).astype(_F32)
    return (d * np.minimum(np.rint(iscale * blocks), _F32(127))).reshape(x.shape)
