"""Phi-3 / Phi-3.5 mini: the Llama block with fused projections and a sliding window.

HF `model_type` "phi3" (modeling_phi3.py): `qkv_proj` holds [q | k | v] rows and
`gate_up_proj` [gate | up] rows (SwiGLU over the two halves); `sliding_window` (2047 in
Phi-3 mini) masks far keys. GGUF `general.architecture = phi3` (conversion/phi.py,
Phi3MiniModel): `attn_qkv` and `ffn_up` keep those fused layouts, no Q/K permutation, so
RoPE is rotate-half (llama-arch.cpp: LLM_ARCH_PHI3 -> LLAMA_ROPE_TYPE_NEOX); the window is
`phi3.attention.sliding_window` (0: none). The 128k variants' LongRoPE ("longrope"/"su"
rope_scaling; GGUF rope_factors_long/short tensors) and partial rotary are refused.
"""

from __future__ import annotations

from pyml.core.errors import UnsupportedError
from pyml.nlp.models.llama import Llama, LlamaConfig, gguf_names
from pyml.nn import Linear
from pyml.nn.linear import Weight

_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")


class Phi3Config(LlamaConfig):
    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json"):
        rotary = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
        if rotary != 1.0:
            raise UnsupportedError(f"{source}: partial_rotary_factor {rotary!r} is not supported")
        return super().from_hf(cfg, source)


class Phi3(Llama):
    arch = "phi3"
    gguf_rope_style = "half"
    gguf_name = gguf_names({"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"})

    def __init__(self, config, store, rope_style: str = "half"):
        for name in _LONGROPE:
            if name in store:
                raise UnsupportedError(f"{store.source}: tensor {name!r}: LongRoPE (Phi-3 128k) is not supported")
        super().__init__(config, store, rope_style)

    def _qkv(self, p):
        c = self.config
        return self._linear(f"{p}.qkv_proj", (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.hidden_size, bias=False)

    def _gate_up(self, p):
        """The fused [gate | up] rows as two row views; GatedMLP fuses them back when it can."""
        c, f = self.config, self.config.intermediate_size
        w = self._linear(f"{p}.gate_up_proj", 2 * f, c.hidden_size, bias=False).weight
        return (Linear(Weight(w.data[:f], w.qtype, (f, c.hidden_size)), name=f"{p}.gate_proj"),
                Linear(Weight(w.data[f:], w.qtype, (f, c.hidden_size)), name=f"{p}.up_proj"))
