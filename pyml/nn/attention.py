"""Multi-head causal self-attention with grouped-query heads and an optional sliding window."""

from __future__ import annotations

import numpy as np

from pyml.core import ops, perf
from pyml.nn.kv_cache import KVCache
from pyml.nn.linear import Linear

_perf = perf.get("pyml.nn.attention")


class Attention:
    """Query heads share key/value heads in groups: head h reads kv head h // (n_heads / n_kv_heads).

    qkv: one fused Linear producing [q | k | v], or a (q, k, v) tuple of Linears.
    q_norm / k_norm: per-head norms applied before RoPE (Gemma 3); rope: None for GPT-2.
    window: keys at distance >= window from the query are masked (sliding layers).
    """

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

    def __call__(self, x: np.ndarray, pos: int, cache: KVCache, layer: int) -> np.ndarray:
        T = x.shape[0]
        with _perf.trace("attention::forward", "layer={} {} tokens={} pos={}", layer, self.kind, T, pos,
                         module=self.name, op="attention", layer=layer, kind=self.kind):
            q, k, v = self._project(x)
            if self.q_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            if self.rope is not None:
                q = self.rope(np.ascontiguousarray(q), pos)
                k = self.rope(np.ascontiguousarray(k), pos)
            cache.update(layer, pos, k, v)
            end = pos + T
            start = max(0, pos - self.window + 1) if self.window else 0
            if T == 1:  # decode: one fused kernel over all heads
                ctx = ops.attend_one(np.ascontiguousarray(q[0]), cache.k[layer], cache.v[layer], start, end,
                                     self.scale)
                return self.o_proj(ctx.reshape(1, -1))
            keys, values = cache.view(layer, end, start)  # [Hkv, S, hd]
            S, group = end - start, self.n_heads // self.n_kv_heads
            # [T, H, hd] -> [Hkv, group*T, hd]: the query heads of one kv head side by side
            qg = np.ascontiguousarray(q.transpose(1, 0, 2)).reshape(self.n_kv_heads, group * T, self.head_dim)
            qg *= self.scale
            scores = ops.batched_matmul(qg, keys.transpose(0, 2, 1))  # [Hkv, group*T, S]
            if T > 1:
                q_pos = np.arange(pos, end)[:, None]
                k_pos = np.arange(start, end)[None, :]
                masked = k_pos > q_pos
                if self.window:
                    masked |= (q_pos - k_pos) >= self.window
                scores.reshape(self.n_kv_heads, group, T, S)[:, :, masked] = -np.inf
            probs = ops.softmax(scores)
            ctx = ops.batched_matmul(probs, values)  # [Hkv, group*T, hd]
            ctx = ctx.reshape(self.n_heads, T, self.head_dim).transpose(1, 0, 2).reshape(T, -1)
            return self.o_proj(np.ascontiguousarray(ctx))
