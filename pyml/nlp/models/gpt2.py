"""GPT-2 (Hugging Face GPT2LMHeadModel layout).

Learned position embeddings, pre-LayerNorm blocks with biases, fused c_attn,
GELU (tanh form, `gelu_new`) MLP, output head tied to wte. HF stores the four
Conv1D weights as (in, out); the loader copies each once into the (out, in) layout
every kernel reads (and gives the file's pages back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pyml.core.errors import ModelFormatError, UnsupportedError
from pyml.nlp.models.config_keys import require
from pyml.nlp.models.base import DecoderModel
from pyml.nn import MLP, Attention, Embedding, LayerNorm, Linear, TransformerBlock


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_new"

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "GPT2Config":
        n_embd = require(cfg, "n_embd", int, source)
        n_head = require(cfg, "n_head", int, source)
        if n_embd % n_head:
            raise ModelFormatError(f"{source}: n_embd={n_embd} is not divisible by n_head={n_head}")
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise UnsupportedError(f"{source}: activation_function {act!r} is not supported")
        return cls(vocab_size=require(cfg, "vocab_size", int, source),
                   n_positions=require(cfg, "n_positions", int, source),
                   n_embd=n_embd, n_layer=require(cfg, "n_layer", int, source), n_head=n_head,
                   n_inner=cfg.get("n_inner") or 4 * n_embd,
                   layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)), activation=act)


def hf_name(name: str) -> str:
    """Checkpoint names with or without the `transformer.` prefix."""
    return name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}"


class GPT2(DecoderModel):
    arch = "gpt2"
    known_unused = {r"\.attn\.(bias|masked_bias)$": "causal-mask buffers older transformers saved; the mask is "
                                                      "built from positions"}

    def __init__(self, config: GPT2Config, store):
        c = self.config = config
        d, hd = c.n_embd, c.n_embd // c.n_head
        store.rename(hf_name)
        self.n_kv_heads, self.head_dim, self.max_positions = c.n_head, hd, c.n_positions
        self.embed_tokens = Embedding(store.weight("transformer.wte.weight", (c.vocab_size, d)),
                                      name="transformer.wte")
        self.wpe = store.weight("transformer.wpe.weight", (c.n_positions, d))
        act = "gelu" if c.activation == "gelu" else "gelu_tanh"

        def linear(prefix, n_in, n_out):  # Conv1D: stored (in, out)
            return Linear(store.weight(f"{prefix}.weight", (n_out, n_in), transposed=True),
                          store.vector(f"{prefix}.bias", (n_out,)), name=prefix)

        def layer_norm(prefix):
            return LayerNorm(store.vector(f"{prefix}.weight", (d,)), store.vector(f"{prefix}.bias", (d,)),
                             c.layer_norm_epsilon, name=prefix)

        self.blocks = []
        for i in range(c.n_layer):
            p = f"transformer.h.{i}"
            attn = Attention(c.n_head, c.n_head, hd, linear(f"{p}.attn.c_attn", d, 3 * d),
                             linear(f"{p}.attn.c_proj", d, d), scale=1.0 / math.sqrt(hd),
                             name=f"{p}.attn")
            mlp = MLP(linear(f"{p}.mlp.c_fc", d, c.n_inner), linear(f"{p}.mlp.c_proj", c.n_inner, d),
                      act=act, name=f"{p}.mlp")
            self.blocks.append(TransformerBlock(i, layer_norm(f"{p}.ln_1"), attn, layer_norm(f"{p}.ln_2"),
                                                mlp, name=p))
        self.final_norm = layer_norm("transformer.ln_f")
        head = "lm_head.weight" if "lm_head.weight" in store else "transformer.wte.weight"
        self.lm_head = Linear(store.weight(head, (c.vocab_size, d)), name="lm_head")

    def embed(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        x = self.embed_tokens(tokens)
        x += self.wpe.rows(positions)
        return x
