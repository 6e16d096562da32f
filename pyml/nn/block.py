"""A transformer block: pre-norm attention and feed-forward, each with a residual."""

from __future__ import annotations

import numpy as np

from pyml.core import perf
from pyml.nn.fused import FusedBlock, can_fuse
from pyml.nn.kv_cache import KVCache

_perf = perf.get("pyml.nn.block")


class TransformerBlock:
    """x + attn(norm(x)), then + ffn(norm(x)).

    post_attn_norm / post_ffn_norm, when given, normalise each branch before its
    residual add (Gemma 3's four-norm "sandwich").
    """

    def __init__(self, index: int, attn_norm, attn, ffn_norm, ffn, post_attn_norm=None,
                 post_ffn_norm=None, name: str = ""):
        self.index, self.attn_norm, self.attn, self.ffn_norm, self.ffn = index, attn_norm, attn, ffn_norm, ffn
        self.post_attn_norm, self.post_ffn_norm, self.name = post_attn_norm, post_ffn_norm, name
        self.span_name = f"transformer[{index}]::forward"  # the fused step's block span too
        # a decode step (T == 1) runs through the block's FusedBlock (nn/fused.py), made on the first
        # one, after load has packed the weights. False: always the layer-by-layer path (the reference).
        self.fused_decode = True
        self._fused = None

    def fused(self):
        """The block's FusedBlock (made on first use, after load has packed the weights), or None
        when its layers are not ones the fused kernels implement."""
        if self._fused is None:
            if not can_fuse(self):
                self.fused_decode = False
                return None
            self._fused = FusedBlock(self)
        return self._fused

    def linears(self) -> list:
        """Every Linear of the block, in the order a forward pass runs them."""
        return self.attn.linears() + self.ffn.linears()

    def __call__(self, x: np.ndarray, pos: int, cache) -> np.ndarray:
        if x.shape[0] == 1 and self.fused_decode and isinstance(cache, KVCache) and self.fused() is not None:
            return self._fused(x, pos, cache)
        with _perf.debug(self.span_name, "", module=self.name, op="block", layer=self.index,
                         kind=self.attn.kind) as span:
            with span.part("attn"):
                h = self.attn(self.attn_norm(x), pos, cache, self.index)
                if self.post_attn_norm is not None:
                    h = self.post_attn_norm(h)
                x = x + h
            with span.part("ffn"):
                h = self.ffn(self.ffn_norm(x))
                if self.post_ffn_norm is not None:
                    h = self.post_ffn_norm(h)
                x += h
            return x
