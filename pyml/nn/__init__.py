"""Layers: small stateful modules composed from pyml.core ops and pyml.quant kernels."""

from pyml.nn.attention import Attention
from pyml.nn.block import TransformerBlock
from pyml.nn.embedding import Embedding
from pyml.nn.feed_forward import MLP, GatedMLP
from pyml.nn.kv_cache import KVCache
from pyml.nn.linear import Linear, Weight
from pyml.nn.norm import LayerNorm, RMSNorm
from pyml.nn.rope import RoPE

__all__ = ["Attention", "TransformerBlock", "Embedding", "MLP", "GatedMLP", "KVCache",
           "Linear", "Weight", "LayerNorm", "RMSNorm", "RoPE"]
