"""Gemma 3 text models (270M, 1B, and the text stack of the larger ones): Llama with Gemma's changes.

Against Llama (HF `modeling_gemma3.py`, llama.cpp `src/models/gemma3.cpp`):
- the token embedding is scaled by sqrt(hidden_size), in float32;
- every RMSNorm multiplies by (1 + w) in Hugging Face checkpoints, while the GGUF
  converter bakes the +1 into the stored weight; `Gemma3Config.norm_unit_offset` says which;
- four norms per block: the attention and the feed-forward outputs are normalised before
  their residual adds; Q and K get a per-head RMSNorm before RoPE;
- GeGLU feed-forward (tanh GELU), attention scale query_pre_attn_scalar**-0.5;
- sliding-window (local) and global layers interleave, five local then one global, each
  kind with its own RoPE base (10k local, 1M global; linear scaling on global layers only);
- the output head is tied to the embedding; an optional final logit softcap.
RoPE is rotate-half in both formats: the GGUF converter does not permute Gemma's Q/K.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pyml.core.errors import ModelFormatError, UnsupportedError
from pyml.nlp.models.config_keys import require
from pyml.nlp.models.base import DecoderConfig, DecoderModel
from pyml.nlp.models.llama import gguf_name as llama_gguf_name
from pyml.nlp.models.rope_scaling import RopeScaling
from pyml.nn import Attention, Embedding, GatedMLP, Linear, RMSNorm, RoPE, TransformerBlock

SLIDING, FULL = "sliding_attention", "full_attention"  # HF `layer_types` values
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")


@dataclass(frozen=True)
class Gemma3Config(DecoderConfig):
    layer_types: tuple                       # per layer: SLIDING or FULL
    sliding_window: int                      # a key at distance >= window is masked (local layers)
    query_pre_attn_scalar: float = 256.0     # attention scale = query_pre_attn_scalar**-0.5
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0          # global layers
    rope_scaling_factor: float = 1.0         # linear, global layers
    rope_local_base_freq: float = 10_000.0   # sliding layers
    rope_local_scaling_factor: float = 1.0
    final_logit_softcapping: float | None = None
    norm_unit_offset: bool = True            # norms compute x*(1+w): HF storage; GGUF stores 1+w

    def __post_init__(self):
        super().__post_init__()
        if self.head_dim % 2:
            raise ModelFormatError(f"head_dim={self.head_dim} is odd (RoPE rotates pairs of values)")

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "Gemma3Config":
        """From a Gemma3TextConfig config.json: transformers 5 keys (`layer_types`, `rope_parameters`)
        or the released checkpoints' older ones (`sliding_window_pattern`, `rope_theta`,
        `rope_local_base_freq`, `rope_scaling`). Missing optional keys take Gemma3TextConfig's defaults."""
        if cfg.get("vision_config") is not None or "text_config" in cfg:
            raise _multimodal(source)
        if cfg.get("attn_logit_softcapping") is not None:
            raise UnsupportedError(f"{source}: attn_logit_softcapping is set (Gemma 2 style); Gemma 3 has none "
                                   f"and pyml does not implement it")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedError(f"{source}: use_bidirectional_attention (EmbeddingGemma) is not supported")
        act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in _GELU_TANH:
            raise UnsupportedError(f"{source}: hidden_activation {act!r} is not supported "
                                   f"(supported: {', '.join(_GELU_TANH)})")
        n_layers = require(cfg, "num_hidden_layers", int, source)
        types = cfg.get("layer_types")
        if types is None:
            pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
            if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
                raise ModelFormatError(f"{source}: sliding_window_pattern must be a positive integer, "
                                       f"got {pattern!r}")
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
        if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {SLIDING, FULL}:
            raise ModelFormatError(f"{source}: layer_types must list {n_layers} entries of "
                                   f"{SLIDING!r} / {FULL!r}, got {types!r}")
        # HF builds no sliding mask without a window, so a sliding layer needs one
        window = _number(cfg, "sliding_window", 4096, int, source) if SLIDING in types else 0
        (theta, factor), (local_theta, local_factor) = _rope_parameters(cfg, source)
        softcap = cfg.get("final_logit_softcapping")  # None: off
        return cls(vocab_size=require(cfg, "vocab_size", int, source),
                   hidden_size=require(cfg, "hidden_size", int, source), n_layers=n_layers,
                   n_heads=require(cfg, "num_attention_heads", int, source),
                   n_kv_heads=_number(cfg, "num_key_value_heads", 4, int, source),
                   head_dim=_number(cfg, "head_dim", 256, int, source),
                   intermediate_size=require(cfg, "intermediate_size", int, source),
                   max_positions=_number(cfg, "max_position_embeddings", 131_072, int, source),
                   layer_types=tuple(types), sliding_window=window,
                   query_pre_attn_scalar=_number(cfg, "query_pre_attn_scalar", 256, float, source),
                   rms_norm_eps=_number(cfg, "rms_norm_eps", 1e-6, float, source),
                   rope_theta=theta, rope_scaling_factor=factor,
                   rope_local_base_freq=local_theta, rope_local_scaling_factor=local_factor,
                   final_logit_softcapping=None if softcap is None
                   else require(cfg, "final_logit_softcapping", float, source),
                   norm_unit_offset=True)

    @classmethod
    def from_gguf(cls, f, arch: str = "gemma3") -> "Gemma3Config":
        """From `gemma3.*` metadata. What the file does not say, llama.cpp hard-codes for this
        architecture (llama-model.cpp): five local layers then one global, local RoPE base 10000
        unscaled, and the attention scale 1/sqrt(head_dim) (27B: 1/sqrt(hidden/heads))."""
        hidden = int(f.require(f"{arch}.embedding_length"))
        n_heads = int(f.require(f"{arch}.attention.head_count"))
        n_layers = int(f.require(f"{arch}.block_count"))
        head_dim = int(f.get(f"{arch}.attention.key_length", hidden // n_heads))
        if int(f.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
            raise UnsupportedError(f"{f.path}: attention.value_length differs from key_length")
        if f.get(f"{arch}.attn_logit_softcapping"):
            raise UnsupportedError(f"{f.path}: attn_logit_softcapping is set; Gemma 3 has none")
        rope = RopeScaling.from_gguf(f, arch, allow_yarn=False)  # linear or none; anything else refused
        softcap = f.get(f"{arch}.final_logit_softcapping")
        return cls(vocab_size=len(f.require("tokenizer.ggml.tokens")),  # the converter trims token_embd to it
                   hidden_size=hidden, n_layers=n_layers, n_heads=n_heads,
                   n_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", n_heads)), head_dim=head_dim,
                   intermediate_size=int(f.require(f"{arch}.feed_forward_length")),
                   max_positions=int(f.require(f"{arch}.context_length")),
                   layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)),
                   sliding_window=int(f.require(f"{arch}.attention.sliding_window")),
                   query_pre_attn_scalar=float(hidden // n_heads if n_layers == 62 else head_dim),
                   rms_norm_eps=float(f.require(f"{arch}.attention.layer_norm_rms_epsilon")),
                   rope_theta=float(f.get(f"{arch}.rope.freq_base", 1_000_000.0)),
                   rope_scaling_factor=rope.factor,
                   final_logit_softcapping=float(softcap) if softcap else None,
                   norm_unit_offset=False)


class Gemma3MultimodalConfig:
    """model_type "gemma3" (Gemma3ForConditionalGeneration: 4B-27B with a vision tower): refused clearly."""

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json"):
        raise _multimodal(source)


def _multimodal(where: str) -> UnsupportedError:
    return UnsupportedError(f"{where}: Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration, with a "
                            f"vision tower) are not supported; use a text-only one (model_type 'gemma3_text') "
                            f"or a GGUF file")


def _number(cfg: dict, key: str, default, kind: type, source: str):
    """cfg[key], or Gemma3TextConfig's default when absent, checked like a required key."""
    return require({key: cfg.get(key, default)}, key, kind, source)


def _rope_parameters(cfg: dict, source: str):
    """((theta, linear factor) of global layers, (theta, factor) of sliding layers)."""
    def table(key, value):
        if not isinstance(value, dict):
            raise ModelFormatError(f"{source}: {key} must be an object, got {value!r}")
        return dict(value)

    params = table("rope_parameters", cfg.get("rope_parameters") or {})
    if FULL in params or SLIDING in params:  # transformers 5: one entry per layer type
        full = table(f"rope_parameters.{FULL}", params.get(FULL) or {})
        local = table(f"rope_parameters.{SLIDING}", params.get(SLIDING) or {})
    else:  # released checkpoints: rope_scaling applies to global layers only
        full, local = params, {}
        full.update(table("rope_scaling", cfg.get("rope_scaling") or {}))
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    out = []
    for p in (full, local):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ("default", "linear"):
            raise UnsupportedError(f"{source}: rope type {kind!r} is not supported (supported: default, linear)")
        theta = require(p, "rope_theta", float, source)
        factor = require(p, "factor", float, source) if kind == "linear" else 1.0
        if theta <= 0 or factor <= 0:
            raise ModelFormatError(f"{source}: rope_theta and the scaling factor must be positive")
        out.append((theta, factor))
    return out


# GGUF tensor names -> Hugging Face names (per layer "blk.N." -> "model.layers.N.")
GGUF_TO_HF = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_name(name: str) -> str:
    # Unknown names pass through unchanged, so the model reports them rather than dropping them.
    return llama_gguf_name(name, GGUF_TO_HF) or name


# Tensors of the multimodal layouts: HF Gemma3ForConditionalGeneration (transformers 4 and 5), GGUF mmproj.
_MULTIMODAL = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|language_model)\.|^(v|mm)\.")


class Gemma3(DecoderModel):
    arch = "gemma3"
    gguf_rope_style = "half"
    gguf_name = staticmethod(gguf_name)

    def __init__(self, config: Gemma3Config, store, rope_style: str = "half"):
        c = self.config = config
        for name in store.names():
            if _MULTIMODAL.match(name):
                raise _multimodal(f"{store.source}: tensor {name!r}")
        d, hd = c.hidden_size, c.head_dim
        self.n_kv_heads, self.head_dim, self.max_positions = c.n_kv_heads, hd, c.max_positions
        self.logit_softcap = c.final_logit_softcapping
        self.embed_tokens = Embedding(store.weight("model.embed_tokens.weight", (c.vocab_size, d)),
                                      name="model.embed_tokens", scale=math.sqrt(d))
        ropes = {SLIDING: RoPE(hd, c.rope_local_base_freq, style=rope_style,
                               scaling_factor=c.rope_local_scaling_factor),
                 FULL: RoPE(hd, c.rope_theta, style=rope_style, scaling_factor=c.rope_scaling_factor)}

        def linear(name, n_out, n_in):
            bias = f"{name}.bias"
            return Linear(store.weight(f"{name}.weight", (n_out, n_in)),
                          store.vector(bias, (n_out,)) if bias in store else None, name=name)

        def norm(name, dim=d):
            return RMSNorm(store.vector(f"{name}.weight", (dim,)), c.rms_norm_eps,
                           unit_offset=c.norm_unit_offset, name=name)

        self.blocks = []
        for i, kind in enumerate(c.layer_types):
            p = f"model.layers.{i}"
            q, k, v = (linear(f"{p}.self_attn.{n}_proj", heads * hd, d)
                       for n, heads in (("q", c.n_heads), ("k", c.n_kv_heads), ("v", c.n_kv_heads)))
            qkv = Linear.fuse([q, k, v], name=f"{p}.self_attn.qkv_proj") or (q, k, v)
            attn = Attention(c.n_heads, c.n_kv_heads, hd, qkv, linear(f"{p}.self_attn.o_proj", d, c.n_heads * hd),
                             scale=c.query_pre_attn_scalar ** -0.5, rope=ropes[kind],
                             q_norm=norm(f"{p}.self_attn.q_norm", hd), k_norm=norm(f"{p}.self_attn.k_norm", hd),
                             window=c.sliding_window if kind == SLIDING else None, name=f"{p}.self_attn")
            mlp = GatedMLP(linear(f"{p}.mlp.gate_proj", c.intermediate_size, d),
                           linear(f"{p}.mlp.up_proj", c.intermediate_size, d),
                           linear(f"{p}.mlp.down_proj", d, c.intermediate_size), act="gelu_tanh", name=f"{p}.mlp")
            self.blocks.append(TransformerBlock(i, norm(f"{p}.input_layernorm"), attn,
                                                norm(f"{p}.pre_feedforward_layernorm"), mlp,
                                                post_attn_norm=norm(f"{p}.post_attention_layernorm"),
                                                post_ffn_norm=norm(f"{p}.post_feedforward_layernorm"), name=p))
        self.final_norm = norm("model.norm")
        head = "lm_head.weight" if "lm_head.weight" in store else "model.embed_tokens.weight"
        self.lm_head = Linear(store.weight(head, (c.vocab_size, d)), name="lm_head")
