"""Llama family (Llama 2, Llama 3.x, TinyLlama, SmolLM2): RMSNorm, GQA attention with RoPE, SwiGLU.

From Hugging Face safetensors (LlamaForCausalLM) or GGUF. The GGUF converter
permutes Q/K rows from HF's rotate-half order into Meta's interleaved order, so
GGUF weights use interleaved RoPE and HF weights the half form: the same model
code and the same logits either way. Llama 3.x's "llama3" RoPE scaling comes from the config
(HF) or as the converter's `rope_freqs.weight` tensor of per-pair divisors (GGUF).
Mistral, Qwen2, Qwen3 and Phi-3 are this model with its hooks overridden (their own files).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pyml.core.errors import ModelFormatError, UnsupportedError
from pyml.nlp.models.config_keys import require
from pyml.nlp.models.base import DecoderConfig, DecoderModel
from pyml.nlp.models.rope_scaling import RopeScaling
from pyml.nn import Attention, Embedding, GatedMLP, Linear, RMSNorm, RoPE, TransformerBlock


# Keys that would change the math of this block if set; pyml refuses them rather than ignore them.
_HF_REFUSED = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "logits_scaling",
               "attention_multiplier", "embedding_multiplier", "residual_multiplier")
_GGUF_REFUSED = ("attn_logit_softcapping", "final_logit_softcapping", "attention.scale", "logit_scale",
                 "embedding_scale", "residual_scale", "rope.scaling.attn_factor")


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope: RopeScaling = RopeScaling()
    tie_embeddings: bool = False
    sliding_window: int | None = None      # a key at distance >= window is masked (Mistral, Phi-3)
    attention_bias: bool | None = None     # biases on q/k/v/o: True required, False refused, None: as stored
    mlp_bias: bool | None = None           # (GGUF says nothing: the tensors present decide)

    @property
    def rope_scaling_factor(self) -> float:
        return self.rope.factor if self.rope.kind == "linear" else 1.0

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "LlamaConfig":
        hidden = require(cfg, "hidden_size", int, source)
        n_heads = require(cfg, "num_attention_heads", int, source)
        for key in _HF_REFUSED:
            if cfg.get(key) is not None:
                raise UnsupportedError(f"{source}: {key} is set; this architecture in pyml does not implement it")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedError(f"{source}: hidden_act {act!r} is not supported (supported: silu)")
        theta, rope = RopeScaling.from_hf(cfg, source)
        window = cfg.get("sliding_window")
        return cls(vocab_size=require(cfg, "vocab_size", int, source), hidden_size=hidden,
                   n_layers=require(cfg, "num_hidden_layers", int, source), n_heads=n_heads,
                   n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                   head_dim=cfg.get("head_dim") or hidden // n_heads,
                   intermediate_size=require(cfg, "intermediate_size", int, source),
                   max_positions=require(cfg, "max_position_embeddings", int, source),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope=rope,
                   tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                   sliding_window=None if window is None else require(cfg, "sliding_window", int, source),
                   attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)))

    @classmethod
    def from_gguf(cls, f, arch: str = "llama") -> "LlamaConfig":
        for key in _GGUF_REFUSED:
            if f.get(f"{arch}.{key}") is not None:
                raise UnsupportedError(f"{f.path}: metadata {arch}.{key} is set; pyml's {arch} does not implement it")
        if f.get(f"{arch}.attention.causal", True) is False:
            raise UnsupportedError(f"{f.path}: non-causal attention ({arch}.attention.causal) is not supported")
        hidden = int(f.require(f"{arch}.embedding_length"))
        n_heads = int(f.require(f"{arch}.attention.head_count"))
        vocab = f.get(f"{arch}.vocab_size") or len(f.require("tokenizer.ggml.tokens"))
        head_dim = int(f.get(f"{arch}.attention.key_length") or f.get(f"{arch}.rope.dimension_count")
                       or hidden // n_heads)
        if int(f.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
            raise UnsupportedError(f"{f.path}: attention.value_length differs from key_length")
        if int(f.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
            raise UnsupportedError(f"{f.path}: partial RoPE (rope.dimension_count < head dim) is not supported")
        return cls(vocab_size=int(vocab), hidden_size=hidden, n_layers=int(f.require(f"{arch}.block_count")),
                   n_heads=n_heads, n_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", n_heads)),
                   head_dim=head_dim, intermediate_size=int(f.require(f"{arch}.feed_forward_length")),
                   max_positions=int(f.require(f"{arch}.context_length")),
                   rms_norm_eps=float(f.require(f"{arch}.attention.layer_norm_rms_epsilon")),
                   rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
                   rope=RopeScaling.from_gguf(f, arch), tie_embeddings="output.weight" not in f.tensors,
                   sliding_window=int(f.get(f"{arch}.attention.sliding_window") or 0) or None)


# GGUF tensor names -> Hugging Face names (per layer "blk.N." -> "model.layers.N.")
GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
               "rope_freqs": "rope_freqs"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_name(name: str, table=GGUF_TO_HF) -> str | None:
    m = _BLK.match(name)
    if m:
        i, part, kind = m.groups()
        return f"model.layers.{i}.{table[part]}.{kind}" if part in table else None
    base, _, kind = name.rpartition(".")
    return f"{GGUF_GLOBAL[base]}.{kind}" if base in GGUF_GLOBAL else None


def gguf_names(extra: dict) -> staticmethod:
    """The GGUF -> HF name function of a family whose GGUF names are Llama's plus `extra`."""
    table = {**GGUF_TO_HF, **extra}
    return staticmethod(lambda name: gguf_name(name, table))


class Llama(DecoderModel):
    """The Llama block; the families built on it override the hooks (`_qkv`, `_qk_norms`, `_gate_up`)."""

    arch = "llama"
    gguf_rope_style = "interleaved"
    gguf_name = staticmethod(gguf_name)
    known_unused = {r"\.rotary_emb\.inv_freq$": "older checkpoints saved the RoPE buffer; it is computed "
                                                  "from the config"}

    def __init__(self, config: LlamaConfig, store, rope_style: str = "half"):
        c = self.config = config
        self.store = store
        d, hd = c.hidden_size, c.head_dim
        self.n_kv_heads, self.head_dim, self.max_positions = c.n_kv_heads, hd, c.max_positions
        self.embed_tokens = Embedding(store.weight("model.embed_tokens.weight", (c.vocab_size, d)),
                                      name="model.embed_tokens")
        # GGUF Llama 3: the converter stores the llama3 scaling as per-pair divisors (rope_freqs.weight)
        divisors = (store.vector("rope_freqs.weight", (hd // 2,)) if "rope_freqs.weight" in store
                    else c.rope.divisors(c.rope_theta, hd))
        rope = RoPE(hd, c.rope_theta, style=rope_style, freq_divisors=divisors)
        scale = c.rope.attention_factor ** 2 / math.sqrt(hd)  # yarn scales cos/sin, so q.k by its square
        self.blocks = []
        for i in range(c.n_layers):
            p = f"model.layers.{i}"
            q_norm, k_norm = self._qk_norms(f"{p}.self_attn")
            attn = Attention(c.n_heads, c.n_kv_heads, hd, self._qkv(f"{p}.self_attn"),
                             self._linear(f"{p}.self_attn.o_proj", d, c.n_heads * hd, c.attention_bias),
                             scale=scale, rope=rope, q_norm=q_norm, k_norm=k_norm,
                             window=c.sliding_window, name=f"{p}.self_attn")
            mlp = GatedMLP(*self._gate_up(f"{p}.mlp"),
                           self._linear(f"{p}.mlp.down_proj", d, c.intermediate_size, c.mlp_bias),
                           act="silu", name=f"{p}.mlp")
            self.blocks.append(TransformerBlock(i, self._norm(f"{p}.input_layernorm"), attn,
                                                self._norm(f"{p}.post_attention_layernorm"), mlp, name=p))
        self.final_norm = self._norm("model.norm")
        head = "lm_head.weight" if "lm_head.weight" in store else "model.embed_tokens.weight"
        self.lm_head = Linear(store.weight(head, (c.vocab_size, d)), name="lm_head")
        del self.store  # read by the hooks while building; the model keeps only its layers

    def _linear(self, name, n_out, n_in, bias: bool | None = None) -> Linear:
        """bias: True required, False refused, None used when the file has one."""
        store, bias_name = self.store, f"{name}.bias"
        if bias is False and bias_name in store:
            raise ModelFormatError(f"{store.source}: tensor {bias_name!r}: this architecture has no such bias")
        has_bias = bias or (bias is None and bias_name in store)
        return Linear(store.weight(f"{name}.weight", (n_out, n_in)),
                      store.vector(bias_name, (n_out,)) if has_bias else None, name=name)

    def _norm(self, name, dim=None) -> RMSNorm:
        c = self.config
        return RMSNorm(self.store.vector(f"{name}.weight", (dim or c.hidden_size,)), c.rms_norm_eps, name=name)

    def _qkv(self, p):
        return self._fused_qkv(p, self.config.attention_bias)

    def _fused_qkv(self, p, bias):
        """q, k, v projections, fused into one Linear when their storage agrees."""
        c, hd = self.config, self.config.head_dim
        q, k, v = (self._linear(f"{p}.{n}_proj", heads * hd, c.hidden_size, bias)
                   for n, heads in (("q", c.n_heads), ("k", c.n_kv_heads), ("v", c.n_kv_heads)))
        return Linear.fuse([q, k, v], name=f"{p}.qkv_proj") or (q, k, v)

    def _qk_norms(self, p):
        """Per-head norms on q and k before RoPE (none in Llama)."""
        return None, None

    def _gate_up(self, p):
        c = self.config
        return (self._linear(f"{p}.gate_proj", c.intermediate_size, c.hidden_size, c.mlp_bias),
                self._linear(f"{p}.up_proj", c.intermediate_size, c.hidden_size, c.mlp_bias))
