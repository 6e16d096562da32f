"""Llama family (Llama 2, TinyLlama, SmolLM2): RMSNorm, GQA attention with RoPE, SwiGLU.

From Hugging Face safetensors (LlamaForCausalLM) or GGUF. The GGUF converter
permutes Q/K rows from HF's rotate-half order into Meta's interleaved order, so
GGUF weights use interleaved RoPE and HF weights the half form: the same model
code and the same logits either way.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pyml.core.errors import ModelFormatError, UnsupportedError
from pyml.nlp.models.config_keys import require
from pyml.nlp.models.base import DecoderModel
from pyml.nn import Attention, Embedding, GatedMLP, Linear, RMSNorm, RoPE, TransformerBlock


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ModelFormatError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "LlamaConfig":
        hidden = require(cfg, "hidden_size", int, source)
        n_heads = require(cfg, "num_attention_heads", int, source)
        # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older, `rope_scaling`
        scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default", "linear"):
            raise UnsupportedError(f"{source}: rope_scaling type {kind!r} is not supported")
        return cls(vocab_size=require(cfg, "vocab_size", int, source), hidden_size=hidden,
                   n_layers=require(cfg, "num_hidden_layers", int, source), n_heads=n_heads,
                   n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                   head_dim=cfg.get("head_dim") or hidden // n_heads,
                   intermediate_size=require(cfg, "intermediate_size", int, source),
                   max_positions=require(cfg, "max_position_embeddings", int, source),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(scaling.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                   rope_scaling_factor=float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0,
                   tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    @classmethod
    def from_gguf(cls, f, arch: str = "llama") -> "LlamaConfig":
        hidden = int(f.require(f"{arch}.embedding_length"))
        n_heads = int(f.require(f"{arch}.attention.head_count"))
        vocab = f.get(f"{arch}.vocab_size") or len(f.require("tokenizer.ggml.tokens"))
        return cls(vocab_size=int(vocab), hidden_size=hidden, n_layers=int(f.require(f"{arch}.block_count")),
                   n_heads=n_heads, n_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", n_heads)),
                   head_dim=int(f.get(f"{arch}.rope.dimension_count", hidden // n_heads)),
                   intermediate_size=int(f.require(f"{arch}.feed_forward_length")),
                   max_positions=int(f.require(f"{arch}.context_length")),
                   rms_norm_eps=float(f.require(f"{arch}.attention.layer_norm_rms_epsilon")),
                   rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
                   rope_scaling_factor=float(f.get(f"{arch}.rope.scale_linear", 1.0)),
                   tie_embeddings="output.weight" not in f.tensors)


# GGUF tensor names -> Hugging Face names (per layer "blk.N." -> "model.layers.N.")
GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_name(name: str, table=GGUF_TO_HF) -> str | None:
    m = _BLK.match(name)
    if m:
        i, part, kind = m.groups()
        return f"model.layers.{i}.{table[part]}.{kind}" if part in table else None
    base, _, kind = name.rpartition(".")
    return f"{GGUF_GLOBAL[base]}.{kind}" if base in GGUF_GLOBAL else None


class Llama(DecoderModel):
    arch = "llama"
    gguf_rope_style = "interleaved"
    gguf_name = staticmethod(gguf_name)

    def __init__(self, config: LlamaConfig, store, rope_style: str = "half"):
        c = self.config = config
        d, hd = c.hidden_size, c.head_dim
        self.n_kv_heads, self.head_dim, self.max_positions = c.n_kv_heads, hd, c.max_positions
        self.embed_tokens = Embedding(store.weight("model.embed_tokens.weight", (c.vocab_size, d)),
                                      name="model.embed_tokens")
        rope = RoPE(hd, c.rope_theta, style=rope_style, scaling_factor=c.rope_scaling_factor)

        def linear(name, n_out, n_in):
            bias = f"{name}.bias"
            return Linear(store.weight(f"{name}.weight", (n_out, n_in)),
                          store.vector(bias, (n_out,)) if bias in store else None, name=name)

        def norm(name):
            return RMSNorm(store.vector(f"{name}.weight", (d,)), c.rms_norm_eps, name=name)

        self.blocks = []
        for i in range(c.n_layers):
            p = f"model.layers.{i}"
            q, k, v = (linear(f"{p}.self_attn.{n}_proj", heads * hd, d)
                       for n, heads in (("q", c.n_heads), ("k", c.n_kv_heads), ("v", c.n_kv_heads)))
            qkv = Linear.fuse([q, k, v], name=f"{p}.self_attn.qkv_proj") or (q, k, v)
            attn = Attention(c.n_heads, c.n_kv_heads, hd, qkv, linear(f"{p}.self_attn.o_proj", d, c.n_heads * hd),
                             scale=1.0 / math.sqrt(hd), rope=rope, name=f"{p}.self_attn")
            mlp = GatedMLP(linear(f"{p}.mlp.gate_proj", c.intermediate_size, d),
                           linear(f"{p}.mlp.up_proj", c.intermediate_size, d),
                           linear(f"{p}.mlp.down_proj", d, c.intermediate_size), act="silu", name=f"{p}.mlp")
            self.blocks.append(TransformerBlock(i, norm(f"{p}.input_layernorm"), attn,
                                                norm(f"{p}.post_attention_layernorm"), mlp, name=p))
        self.final_norm = norm("model.norm")
        head = "lm_head.weight" if "lm_head.weight" in store else "model.embed_tokens.weight"
        self.lm_head = Linear(store.weight(head, (c.vocab_size, d)), name="lm_head")
