"""Random-weight stand-ins in real model configurations.

The real GPT-2 and Gemma 3 1B weights are not reachable from our machines, so
benchmarks and CLI tests use checkpoints with the real shapes and random values,
written here in the Hugging Face layout (config.json + model.safetensors) with a
byte-level tokenizer.json (every byte one token, so any text encodes). Numerics
are proven elsewhere against transformers on the same weights; these exist for
speed and plumbing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tokenizers
from gguf import GGUFValueType, GGUFWriter
from safetensors.numpy import save_file

from pyml import quant
from pyml.quant.ggml_types import QuantType
from pyml.cli.pyml_quantize import FILE_TYPES, TARGETS, quantize_rows
from pyml.nlp.models.gemma3 import GGUF_TO_HF
from pyml.nlp.tokenizer import BYTE_OF_CHAR

U32, F32, STR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING  # metadata value types

GPT2_CONFIGS = {
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
    "gpt2-tiny": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128),
}


def write_byte_tokenizer(directory: Path, vocab_size: int, eos: str = "<|endoftext|>"):
    """tokenizer.json: byte-level BPE with no merges; ids 0-255 are bytes, the last id is EOS."""
    vocab = dict(BYTE_OF_CHAR)
    vocab[eos] = vocab_size - 1  # the config's EOS id; ids 256 .. vocab_size-2 stay unused
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([eos])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": eos}))


def write_gpt2(directory, name: str = "gpt2", seed: int = 0, **overrides) -> Path:
    """A GPT2LMHeadModel-layout checkpoint with random weights (std 0.02, as GPT-2 initialises)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = dict(GPT2_CONFIGS[name], **overrides)
    d, L, V, P = c["n_embd"], c["n_layer"], c["vocab_size"], c["n_positions"]
    rng = np.random.default_rng(seed)

    def randn(*shape, std=0.02):
        return (rng.standard_normal(shape, dtype=np.float32) * std)

    t = {"wte.weight": randn(V, d), "wpe.weight": randn(P, d, std=0.01),
         "ln_f.weight": np.ones(d, np.float32), "ln_f.bias": np.zeros(d, np.float32)}
    for i in range(L):
        p = f"h.{i}"
        t.update({
            f"{p}.ln_1.weight": np.ones(d, np.float32), f"{p}.ln_1.bias": np.zeros(d, np.float32),
            f"{p}.ln_2.weight": np.ones(d, np.float32), f"{p}.ln_2.bias": np.zeros(d, np.float32),
            f"{p}.attn.c_attn.weight": randn(d, 3 * d), f"{p}.attn.c_attn.bias": np.zeros(3 * d, np.float32),
            f"{p}.attn.c_proj.weight": randn(d, d), f"{p}.attn.c_proj.bias": np.zeros(d, np.float32),
            f"{p}.mlp.c_fc.weight": randn(d, 4 * d), f"{p}.mlp.c_fc.bias": np.zeros(4 * d, np.float32),
            f"{p}.mlp.c_proj.weight": randn(4 * d, d), f"{p}.mlp.c_proj.bias": np.zeros(d, np.float32),
        })
    save_file(t, str(directory / "model.safetensors"))
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "activation_function": "gelu_new",
              "layer_norm_epsilon": 1e-5, "bos_token_id": V - 1, "eos_token_id": V - 1, **c}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_byte_tokenizer(directory, V)
    return directory


# --- Gemma 3 ---------------------------------------------------------------------

GEMMA3_CONFIGS = {
    "gemma3-1b": dict(num_hidden_layers=26, hidden_size=1152, num_attention_heads=4, num_key_value_heads=1,
                      head_dim=256, intermediate_size=6912, vocab_size=262144, sliding_window=512,
                      query_pre_attn_scalar=256, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                      max_position_embeddings=32768),
    "gemma3-tiny": dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=16, intermediate_size=128, vocab_size=512, sliding_window=8,
                        query_pre_attn_scalar=16, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        max_position_embeddings=256),
}
_SAFETENSORS_DTYPES = {"float32": ("F32", np.float32), "float16": ("F16", np.float16),
                       "bfloat16": ("BF16", np.uint16)}


def _stream_safetensors(path: Path, specs: list, make, dtype: str):
    """Write a safetensors file one tensor at a time: specs [(name, shape)], make(name, shape) -> float32.

    Not safetensors.numpy.save_file: NumPy has no bfloat16, and save_file wants every tensor in
    memory at once (4 GB for the 1B in float32). The format is simple enough to stream: an 8-byte
    header length, a JSON header of names, dtypes, shapes and byte ranges, then the raw data.
    """
    st_dtype, np_dtype = _SAFETENSORS_DTYPES[dtype]
    size = np.dtype(np_dtype).itemsize
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in specs:
        n = int(np.prod(shape)) * size
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in specs:
            x = make(name, shape)
            f.write((quant.to_bf16_bits(x) if dtype == "bfloat16" else x.astype(np_dtype, copy=False)).tobytes())


def _gemma3_specs(c: dict) -> list:
    """[(HF tensor name, shape)] of a Gemma3ForCausalLM with config `c`."""
    d, hd, f, V = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["vocab_size"]
    nq, nkv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    specs = [("model.embed_tokens.weight", (V, d))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        specs += [(f"{p}.input_layernorm.weight", (d,)), (f"{p}.self_attn.q_proj.weight", (nq, d)),
                  (f"{p}.self_attn.k_proj.weight", (nkv, d)), (f"{p}.self_attn.v_proj.weight", (nkv, d)),
                  (f"{p}.self_attn.q_norm.weight", (hd,)), (f"{p}.self_attn.k_norm.weight", (hd,)),
                  (f"{p}.self_attn.o_proj.weight", (d, nq)), (f"{p}.post_attention_layernorm.weight", (d,)),
                  (f"{p}.pre_feedforward_layernorm.weight", (d,)), (f"{p}.mlp.gate_proj.weight", (f, d)),
                  (f"{p}.mlp.up_proj.weight", (f, d)), (f"{p}.mlp.down_proj.weight", (d, f)),
                  (f"{p}.post_feedforward_layernorm.weight", (d,))]
    return specs + [("model.norm.weight", (d,))]


def write_gemma3(directory, name: str = "gemma3-1b", seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """A Gemma3ForCausalLM-layout checkpoint (config.json as the released gemma-3-1b has it) with random
    weights: std 0.02 matrices and norm weights near zero (HF stores w for a (1 + w) scale)."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(_SAFETENSORS_DTYPES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = dict(GEMMA3_CONFIGS[name], **overrides)
    V = c["vocab_size"]
    specs = _gemma3_specs(c)
    rng = np.random.default_rng(seed)

    def make(tensor, shape):
        std = 0.1 if tensor.endswith("norm.weight") else 0.02
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    _stream_safetensors(directory / "model.safetensors", specs, make, dtype)
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "sliding_window_pattern": 6,
              "rope_scaling": None, "final_logit_softcapping": None, "attn_logit_softcapping": None,
              "attention_bias": False, "tie_word_embeddings": True, "pad_token_id": 0,
              "bos_token_id": V - 1, "eos_token_id": V - 1, "torch_dtype": dtype, **c}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_byte_tokenizer(directory, V, eos="<eos>")
    return directory


# --- GGUF stand-ins ------------------------------------------------------------------

LLAMA_CONFIGS = {
    "tinyllama-1.1b": dict(n_layers=22, d=2048, n_heads=32, n_kv_heads=4, ffn=5632, vocab=32000, ctx=2048,
                           rope_base=10000.0),
    "llama-tiny": dict(n_layers=2, d=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=512, ctx=256, rope_base=10000.0),
    # rows of whole 256-value superblocks, so llama-quantize's K-quant mixes keep their low-bit types
    "llama-256": dict(n_layers=2, d=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=512, ctx=256, rope_base=10000.0),
}


def _sentencepiece_vocab(n: int):
    """A llama-style vocabulary: <unk> <s> </s>, the 256 byte-fallback pieces, then filler words."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256                       # unknown, control, byte
    tokens += [f"\u2581w{i}" for i in range(n - len(tokens))]
    types += [1] * (n - len(types))                     # normal
    return tokens, np.linspace(0, -n / 100, n, dtype=np.float32).tolist(), types


def _write_gguf(path, arch: str, meta: dict, specs: list, make, target: str):
    """A GGUF file: `meta` keys, a SentencePiece-style vocabulary, tensors [(gguf name, shape)]
    from make(name, shape) -> float32, 2-D ones quantized to `target`, 1-D ones kept float32."""
    qtype = TARGETS.get(target) or QuantType[target.upper()]  # or a type pyml-quantize writes in its mixes
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        w.add_key_value(key, value[0], value[1])
    tokens, scores, types = _sentencepiece_vocab(meta[f"{arch}.vocab_size"][0])
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if qtype in FILE_TYPES:  # the single-type files' ftype; a file of one mix type says none
        w.add_file_type(FILE_TYPES[qtype])
    for name, shape in specs:
        x = make(name, shape)
        if len(shape) == 2:
            data = quantize_rows(x, qtype)
            w.add_tensor(name, data, raw_dtype=None if qtype in (QuantType.F32, QuantType.F16) else qtype)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_llama_gguf(path, name: str = "tinyllama-1.1b", target: str = "q4_0", seed: int = 0) -> Path:
    """A llama GGUF with random weights in a real configuration (TinyLlama 1.1B by default), as
    llama.cpp's converter lays it out, so that llama.cpp loads it too."""
    c = LLAMA_CONFIGS[name]
    d, hd = c["d"], c["d"] // c["n_heads"]
    meta = {"llama.vocab_size": (c["vocab"], U32), "llama.context_length": (c["ctx"], U32),
            "llama.embedding_length": (d, U32), "llama.block_count": (c["n_layers"], U32),
            "llama.feed_forward_length": (c["ffn"], U32), "llama.attention.head_count": (c["n_heads"], U32),
            "llama.attention.head_count_kv": (c["n_kv_heads"], U32),
            "llama.rope.dimension_count": (hd, U32), "llama.rope.freq_base": (c["rope_base"], F32),
            "llama.attention.layer_norm_rms_epsilon": (1e-5, F32), "general.name": (name, STR)}
    specs = [("token_embd.weight", (c["vocab"], d))]
    for i in range(c["n_layers"]):
        p = f"blk.{i}"
        specs += [(f"{p}.attn_norm.weight", (d,)), (f"{p}.attn_q.weight", (d, d)),
                  (f"{p}.attn_k.weight", (c["n_kv_heads"] * hd, d)), (f"{p}.attn_v.weight", (c["n_kv_heads"] * hd, d)),
                  (f"{p}.attn_output.weight", (d, d)), (f"{p}.ffn_norm.weight", (d,)),
                  (f"{p}.ffn_gate.weight", (c["ffn"], d)), (f"{p}.ffn_up.weight", (c["ffn"], d)),
                  (f"{p}.ffn_down.weight", (d, c["ffn"]))]
    specs += [("output_norm.weight", (d,)), ("output.weight", (c["vocab"], d))]
    rng = np.random.default_rng(seed)

    def make(tensor, shape):
        if tensor.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    return _write_gguf(path, "llama", meta, specs, make, target)


def write_gemma3_gguf(path, name: str = "gemma3-1b", target: str = "q8_0", seed: int = 0) -> Path:
    """The Gemma 3 stand-in as a GGUF file (llama.cpp's layout: norms store 1 + w)."""
    c = GEMMA3_CONFIGS[name]
    hf_to_gguf = {v: k for k, v in GGUF_TO_HF.items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}

    def gguf_name(hf):
        if hf in names:
            return names[hf]
        _, _, i, rest = hf.split(".", 3)
        return f"blk.{i}.{hf_to_gguf[rest.rsplit('.', 1)[0]]}.weight"

    meta = {"gemma3.vocab_size": (c["vocab_size"], U32),
            "gemma3.context_length": (c["max_position_embeddings"], U32),
            "gemma3.embedding_length": (c["hidden_size"], U32),
            "gemma3.block_count": (c["num_hidden_layers"], U32),
            "gemma3.feed_forward_length": (c["intermediate_size"], U32),
            "gemma3.attention.head_count": (c["num_attention_heads"], U32),
            "gemma3.attention.head_count_kv": (c["num_key_value_heads"], U32),
            "gemma3.attention.key_length": (c["head_dim"], U32),
            "gemma3.attention.value_length": (c["head_dim"], U32),
            "gemma3.attention.sliding_window": (c["sliding_window"], U32),
            "gemma3.rope.freq_base": (c["rope_theta"], F32),
            "gemma3.attention.layer_norm_rms_epsilon": (1e-6, F32), "general.name": (name, STR)}
    rng = np.random.default_rng(seed)

    def make(tensor, shape):
        if tensor.endswith("norm.weight"):
            return np.float32(1.0) + rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    specs = [(gguf_name(n), shape) for n, shape in _gemma3_specs(c)]
    return _write_gguf(path, "gemma3", meta, specs, make, target)
