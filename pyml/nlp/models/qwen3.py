"""Qwen3 (dense): Llama with a per-head RMSNorm on q and k before RoPE and an explicit head_dim.

HF `model_type` "qwen3" (modeling_qwen3.py): head_dim (128) is not hidden/heads; q_norm and
k_norm weigh head_dim values, eps rms_norm_eps; q/k/v biases only when attention_bias.
GGUF `general.architecture = qwen3` (conversion/qwen.py): `attn_q_norm`/`attn_k_norm`,
`attention.key_length` = head_dim, no Q/K permutation: rotate-half RoPE (llama-arch.cpp:
LLM_ARCH_QWEN3 -> LLAMA_ROPE_TYPE_NEOX).
"""

from __future__ import annotations

from pyml.nlp.models.llama import Llama, gguf_names
from pyml.nlp.models.qwen2 import Qwen2Config


class Qwen3Config(Qwen2Config):
    """The same config.json keys as Qwen2 (use_sliding_window refused; q/k/v biases only with
    attention_bias, which the model honours by the tensors present)."""


class Qwen3(Llama):
    arch = "qwen3"
    gguf_rope_style = "half"
    gguf_name = gguf_names({"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"})

    def _qk_norms(self, p):
        hd = self.config.head_dim
        return self._norm(f"{p}.q_norm", hd), self._norm(f"{p}.k_norm", hd)
