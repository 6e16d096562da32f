"""Write a Hugging Face checkpoint as GGUF the way llama.cpp's convert_hf_to_gguf.py does (F32).

Conventions followed (read in vendor/llama.cpp/conversion/{base,llama,qwen,phi}.py):
- tensors: what the safetensors file holds (a tied head is not saved, so none is written),
  renamed by gguf-py's own TensorNameMap for the architecture (`blk.N.attn_q.weight`, ...);
  Phi-3's fused `qkv_proj` / `gate_up_proj` become `attn_qkv` / `ffn_up` unsplit;
- llama-arch files (Llama, Mistral: `LlamaModel.undo_permute`): the rows of q_proj and k_proj
  (weights and biases) are permuted from HF's rotate-half order into Meta's interleaved one, per head:
  reshape(n_head, 2, head_dim/2, in).swapaxes(1, 2); qwen2, qwen3 and phi3 are not permuted;
- Llama 3 rope scaling: no metadata key, an extra F32 tensor `rope_freqs.weight` of per-pair
  frequency divisors (`LlamaModel.generate_extra_tensors`); here computed from transformers'
  own llama3 inverse frequencies (default / llama3), an oracle independent of pyml;
- linear scaling: `rope.scaling.type = linear` and `rope.scaling.factor`; yarn: type `yarn`,
  the factor, `rope.scaling.original_context_length`, and yarn_beta_fast / yarn_beta_slow when
  the config sets them (TextModel.set_gguf_parameters);
- metadata: context_length, embedding_length, feed_forward_length, block_count,
  attention.head_count(_kv), attention.layer_norm_rms_epsilon, rope.freq_base; `key_length` /
  `value_length` when config.json has head_dim; llama writes `vocab_size` and
  `rope.dimension_count`; phi3 writes `rope.dimension_count`, `rope.scaling.original_context_length`
  and `attention.sliding_window` (0: none); Mistral's sliding_window is not written (llama arch).
- the tokenizer is a placeholder token list of the vocabulary's size (no real tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
         "qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_divisors(config) -> np.ndarray:
    """What rope_freqs.weight holds: transformers' default inverse frequencies over its llama3 ones."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope_type = config.rope_parameters["rope_type"]
    scaled, _ = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = 1.0 / config.rope_parameters["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return (base / scaled.double().numpy()).astype(np.float32)


def write_gguf(hf_dir: Path, hf_model, path: Path, extra_tensors: dict | None = None, extra_keys: dict | None = None):
    """`hf_dir`'s safetensors as a converter-written F32 GGUF at `path`; `extra_*` for refusal tests."""
    c = hf_model.config
    model_type = c.model_type
    arch = ARCHS[model_type]
    name = gguf.MODEL_ARCH_NAMES[arch]
    n_head, n_kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_head
    w = gguf.GGUFWriter(str(path), name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if "head_dim" in c.to_diff_dict() or model_type == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == gguf.MODEL_ARCH.LLAMA:
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if arch == gguf.MODEL_ARCH.PHI3:
        w.add_rope_dimension_count(head_dim)
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        w.add_sliding_window(c.sliding_window or 0)
    for key, value in (extra_keys or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_float32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    tensors = load_file(str(Path(hf_dir) / "model.safetensors"))
    for hf_name, x in tensors.items():
        x = x.astype(np.float32)
        if arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            x = _permute(x, n_head)
        elif arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            x = _permute(x, n_kv)
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, hf_name
        w.add_tensor(gname, np.ascontiguousarray(x))
    if rope.get("rope_type") == "llama3":
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", llama3_divisors(c))
    for gname, x in (extra_tensors or {}).items():
        w.add_tensor(gname, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
