"""Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (none on o_proj).

HF `model_type` "qwen2" (modeling_qwen2.py); the head is tied for the small models
(tie_word_embeddings) and untied for the larger. GGUF `general.architecture = qwen2`
(conversion/qwen.py, Qwen2Model): the llama tensor names plus `attn_{q,k,v}.bias`, no Q/K
row permutation, so RoPE is the rotate-half (NEOX) form in both formats (llama-arch.cpp:
LLM_ARCH_QWEN2 -> LLAMA_ROPE_TYPE_NEOX).
"""

from __future__ import annotations

from pyml.core.errors import UnsupportedError
from pyml.nlp.models.llama import Llama, LlamaConfig


class Qwen2Config(LlamaConfig):
    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json"):
        if cfg.get("use_sliding_window"):  # per-layer windows above max_window_layers: not implemented
            raise UnsupportedError(f"{source}: use_sliding_window is set; pyml does not implement "
                                   f"Qwen's per-layer sliding windows")
        # Qwen configs carry sliding_window even when use_sliding_window is false: it is then unused
        return super().from_hf({**cfg, "sliding_window": None}, source)


class Qwen2(Llama):
    arch = "qwen2"
    gguf_rope_style = "half"

    def _qkv(self, p):
        return self._fused_qkv(p, bias=True)
