"""A prompt's attention rounded as llama.cpp's CPU backend rounds it (pyml-perplexity --activations ggml).

llama.cpp without flash attention (llama-cpp-python's default; llama-graph.cpp build_attn_mha) runs a
layer's attention as two ggml mul_mats around a softmax, over its f16 KV cache:
    kq   = mul_mat(K, Q)                  K f16: ggml rounds Q to f16 (F16's vec_dot_type), then dots the
                                          f16 pairs in float32
    kq   = soft_max_ext(kq, mask, scale)  float32: exp(x - max) / sum, the sum in double
    kqv  = mul_mat(V^T, kq)               V f16: the probabilities rounded to f16, dotted in float32
pyml's own kernels (attention_prefill.attend_tiled) keep Q and the probabilities in float32. Two
roundings of 2^-11 relative each: small, but a perplexity drawn through one engine's roundings is
compared with the other's (docs/perplexity.md). Over an f32 cache (kv_type="f32") ggml's vec_dot_type
is f32 and nothing is rounded; a q8_0 V cache llama.cpp runs only with flash attention, not emulated
here (refused). Gemma scales Q before the attention (kq scale 1):
rounding Q then scaling is the same for its power-of-two scales (1/16 for the 270M's head_dim 256).

NumPy, unfused, the scores of a piece formed whole ([T, S] per head): for evaluating prompts in the
mode, not for speed."""

from __future__ import annotations

import numpy as np

from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.quant.ggml_grids import round_as_ggml

_perf = perf.get("pyml.nn.attention_ggml")
_F32 = np.float32


def attend_as_ggml(q: np.ndarray, pos: int, keys: np.ndarray, values: np.ndarray, start: int,
                   scale: float, window: int = 0, kv_type: str = "f16") -> np.ndarray:
    """q [T, H, hd] float32 at positions pos .. pos+T-1; keys, values [Hkv, S, hd] float32 (the cache's
    positions start .. start+S-1, as stored in kv_type) -> [T, H, hd] float32, causal (and windowed if
    window)."""
    if kv_type not in ("f16", "f32"):
        raise PymlError(f"llama.cpp's attention over a {kv_type} KV cache needs its flash attention, which "
                        "--activations ggml does not emulate: use an f16 or f32 cache")
    T, H, hd = q.shape
    n_kv, S = keys.shape[0], keys.shape[1]
    with _perf.trace("attention::sdpa", "q=[{}, {}, {}] kv=[{}, {}, {}] ggml", T, H, hd, n_kv, S, hd, op="sdpa"):
        query_pos = np.arange(pos, pos + T)[:, None]
        key_pos = np.arange(start, start + S)[None, :]
        hidden = key_pos > query_pos
        if window:
            hidden |= key_pos <= query_pos - window
        mask = np.where(hidden, -np.inf, 0).astype(_F32)
        q16 = round_as_ggml(q.reshape(T, H * hd), kv_type).reshape(T, H, hd)
        out = np.empty((T, H, hd), _F32)
        group = H // n_kv
        for h in range(H):
            scores = (q16[:, h] @ keys[h // group].T) * _F32(scale) + mask
            exps = np.exp(scores - scores.max(axis=1, keepdims=True))
            probs = exps * (1.0 / exps.sum(axis=1, dtype=np.float64, keepdims=True)).astype(_F32)
            out[:, h] = round_as_ggml(probs, kv_type) @ values[h // group]
        return out
