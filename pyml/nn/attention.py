"""Multi-head causal self-attention with grouped-query heads and an optional sliding window."""

from __future__ import annotations

import numpy as np

from pyml import quant
from pyml.core import perf
from pyml.nn import attention_kernels, attention_prefill
from pyml.nn.attention_ggml import attend_as_ggml
from pyml.nn.batch import Batch
from pyml.nn.kv_cache import KVCache
from pyml.nn.linear import Linear
from pyml.quant import ggml_grids

_perf = perf.get("pyml.nn.attention")
FORWARD_SPAN = ("attention::forward", "layer={} {} tokens={} pos={}")  # layer, kind, T, pos
# Up to this many queries of a speculative verify pass (quant.decode_rows() with no count) attend as
# their decode steps do, all in one call (attention_kernels.attend_queries): each query gets a decode
# step's bits, and the tiled prefill kernel (and its bf16 copy of the whole span) cost ~1 ms a layer
# for 4 queries at depth 744 (SmolLM2, 1 thread), 4 decode calls ~0.3 ms. A prompt that short still
# takes the tiled kernel.
FEW_QUERIES = 8


class Attention:
    """Query heads share key/value heads in groups: head h reads kv head h // (n_heads / n_kv_heads).

    qkv: one fused Linear producing [q | k | v], or a (q, k, v) tuple of Linears.
    q_norm / k_norm: per-head norms applied before RoPE (Gemma 3, Qwen3); rope: None for GPT-2.
    window: keys at distance >= window from the query are masked (sliding layers).
    prefill_bf16: a prefill's QK^T and PV on vdpbf16ps (attention_prefill.attend_tiled; set by the model's
    float compute, quant.attention_compute), else float32.
    """

    prefill_bf16 = False

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, qkv, o_proj: Linear,
                 scale: float, rope=None, q_norm=None, k_norm=None, window: int | None = None,
                 name: str = ""):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.qkv, self.o_proj, self.scale, self.rope = qkv, o_proj, np.float32(scale), rope
        self.q_norm, self.k_norm, self.window, self.name = q_norm, k_norm, window, name
        self.kind = "sliding" if window else "global"

    def linears(self) -> list:
        """The projections, in the order a forward pass runs them."""
        qkv = [self.qkv] if isinstance(self.qkv, Linear) else list(self.qkv)
        return qkv + [self.o_proj]

    def _project(self, x):  # [T, d] -> q [T, H, hd], k, v [T, Hkv, hd]
        T, hd = x.shape[0], self.head_dim
        nq, nkv = self.n_heads * hd, self.n_kv_heads * hd
        if isinstance(self.qkv, Linear):
            qkv = self.qkv(x)
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
        else:
            q, k, v = (lin(x) for lin in self.qkv)
        return (q.reshape(T, self.n_heads, hd), k.reshape(T, self.n_kv_heads, hd),
                v.reshape(T, self.n_kv_heads, hd))

    def decode(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: int, cache: KVCache, layer: int,
               out: np.ndarray | None = None) -> np.ndarray:
        """KV write + attention of one token: q [H, hd] (contiguous), k, v [1, Hkv, hd] -> [H, hd].
        The layer-by-layer path's decode step; the fused step (nn/fused.py) calls the same kernel,
        attention_kernels.decode_into, from compiled code."""
        cache.update(layer, pos, k, v)
        start = max(0, pos + 1 - self.window) if self.window else 0
        out = out if out is not None else np.empty((self.n_heads, self.head_dim), np.float32)
        return attention_kernels.attend_decode(q, *cache.layer(layer), start, pos + 1, self.scale, out)

    def _rotate(self, q, k, pos):
        """q/k norms and RoPE: `pos` a sequence's first position, or a batched pass's row positions."""
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.rope is not None:
            rotate = self.rope.rotate_rows if isinstance(pos, np.ndarray) else self.rope
            q = rotate(np.ascontiguousarray(q), pos)
            k = rotate(np.ascontiguousarray(k), pos)
        return np.ascontiguousarray(q), k

    def _prefill(self, q, k, v, pos: int, cache: KVCache, layer: int, out: np.ndarray) -> np.ndarray:
        """KV write + causal attention of T > 1 positions pos .. of one sequence, into out [T, H, hd]."""
        T = q.shape[0]
        if T <= FEW_QUERIES and quant.every_row_decodes():  # a verify pass: each query as its decode step attends
            cache.update(layer, pos, k, v)
            return attention_kernels.attend_queries(q, *cache.layer(layer), pos, self.window or 0, self.scale, out)
        # a ring keeps window + slack positions: write and attend in pieces that fit beside the window
        piece = cache.slots[layer] - self.window + 1 if cache.is_ring(layer) else T
        for t0 in range(0, T, piece):
            t1 = min(T, t0 + piece)
            cache.update(layer, pos + t0, k[t0:t1], v[t0:t1])
            if ggml_grids.active():  # pyml-perplexity --activations ggml: llama.cpp's roundings
                start = max(0, pos + t0 - self.window + 1) if self.window else 0
                out[t0:t1] = attend_as_ggml(q[t0:t1], pos + t0, *cache.view(layer, pos + t1, start), start,
                                            self.scale, self.window or 0, cache.kv_type)
                continue
            out[t0:t1] = attention_prefill.attend_tiled(q[t0:t1], pos + t0, *cache.layer(layer), self.scale,
                                                        self.window or 0, self.prefill_bf16)
        return out

    def __call__(self, x: np.ndarray, pos: int, cache: KVCache | Batch, layer: int) -> np.ndarray:
        if isinstance(cache, Batch):
            return self._batched(x, cache, layer)
        T = x.shape[0]
        with _perf.trace(*FORWARD_SPAN, layer, self.kind, T, pos,
                         module=self.name, op="attention", layer=layer, kind=self.kind):
            q, k, v = self._project(x)
            q, k = self._rotate(q, k, pos)
            if T == 1:  # decode: one fused kernel over all heads
                return self.o_proj(self.decode(q[0], k, v, pos, cache, layer).reshape(1, -1))
            ctx = self._prefill(q, k, v, pos, cache, layer, np.empty((T, self.n_heads, self.head_dim), np.float32))
            return self.o_proj(ctx.reshape(T, -1))

    def _batched(self, x: np.ndarray, batch: Batch, layer: int) -> np.ndarray:
        """A batched pass (nn/batch.py): the projections over every row at once, the attention per
        sequence - the one-token rows in one call (attend_decode_batch), the longer ones as prefills."""
        R = x.shape[0]
        with _perf.trace(*FORWARD_SPAN, layer, self.kind, R, "rows", module=self.name, op="attention",
                         layer=layer, kind=self.kind, batch=len(batch.segments)):
            q, k, v = self._project(x)
            q, k = self._rotate(q, k, batch.positions)
            ctx = np.empty((R, self.n_heads, self.head_dim), np.float32)
            d = batch.n_decode
            if d:
                attention_kernels.attend_decode_batch(q[:d], np.ascontiguousarray(k[:d]), np.ascontiguousarray(v[:d]),
                                                      batch.pool.layer(layer), batch.decode_seqs, batch.decode_ends,
                                                      self.window or 0, self.scale, ctx[:d])
            for row, seq, pos, n in batch.prefill:
                self._prefill(q[row:row + n], k[row:row + n], v[row:row + n], pos, batch.cache(seq), layer,
                              ctx[row:row + n])
            return self.o_proj(ctx.reshape(R, -1))
