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

GPT2_CONFIGS = {
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
    "gpt2-tiny": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128),
}


def _bytes_to_unicode() -> dict:
    """GPT-2's printable stand-in character for each byte (as in its encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_byte_tokenizer(directory: Path, vocab_size: int, eos: str = "<|endoftext|>"):
    """tokenizer.json: byte-level BPE with no merges; ids 0-255 are bytes, the last id is EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab[eos] = vocab_size - 1  # the config's EOS id; ids 256 .. vocab_size-2 stay unused
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eos])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": eos}))


def write_gpt2(directory, name: str = "gpt2", seed: int = 0, **overrides) -> Path:
    """A GPT2LMHeadModel-layout checkpoint with random weights (std 0.02, as GPT-2 initialises)."""
    from safetensors.numpy import save_file
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
