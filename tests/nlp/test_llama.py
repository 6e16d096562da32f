"""Llama family: random HF checkpoints and the real SmolLM2 GGUF files against transformers."""

import numpy as np
import pytest

import pyml
from pyml.nlp.loaders.gguf import GGUFFile
from pyml.nlp.models.llama import Llama, LlamaConfig
from tests.conftest import hf_gguf_model, hf_logits, max_rel_err

PROMPTS = ["The capital of France is",
           "def fibonacci(n):\n    if n < 2:\n        return n",
           "Once upon a time, in a small village, there lived",
           "1, 2, 3, 5, 8, 13,"]


def save_hf_llama(directory, seed=0, **config):
    import torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    cfg.update(config)
    model = LlamaForCausalLM(HFLlamaConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.mark.parametrize("config", [
    dict(),                                                              # GQA 4 heads over 2
    dict(num_key_value_heads=1, tie_word_embeddings=True),               # MQA, tied head
    dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=48),  # MHA, head_dim 16
    dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
], ids=["gqa", "mqa_tied", "mha", "rope_linear"])
def test_hf_llama_matches_transformers(tmp_path, torch, config):
    hf = save_hf_llama(tmp_path, **config)
    lm = pyml.load_model(safetensors=str(tmp_path), warmup=False, kv_type="f32")
    ids = [3, 17, 42, 90, 0, 7, 7, 56, 11, 23]
    ref = hf_logits(hf, ids)
    assert max_rel_err(lm.forward(ids, all_logits=True), ref) < 1e-4
    cache = lm.new_cache(len(ids))
    lm.model.forward(ids[:5], cache)
    for i in range(5, len(ids)):
        assert max_rel_err(lm.model.forward([ids[i]], cache), ref[i]) < 1e-4


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    # the default (f16) cache, as a user runs it: its decode step is the one the default tier compiles
    # for SmolLM2 anyway (an f32 one would be a decode_region compile of its own, ~45 s of a core cold)
    return pyml.load_model(gguf=str(smollm2_gguf), warmup=False)


def test_smollm2_config_from_gguf(smollm2):
    c = smollm2.config
    assert (c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.intermediate_size, c.vocab_size) == \
        (30, 576, 9, 3, 1536, 49152)
    assert c.tie_embeddings


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_0"])
def test_real_smollm2_logits_match_transformers(kind, smollm2_gguf, requantized, torch):
    """Same argmax at every position; the max |diff| bounded relative to the logit range.

    Both sides read the same quantized file; transformers dequantizes to float32.
    pyml's decode and short-prompt kernels quantize each activation row to int8 per
    32 values (as ggml does), and that rounding is the whole difference: measured
    2.1% of the logit range at worst (Q4_1), so the bound is 3%. The exact-path test
    below shows the model itself agrees to float32 precision."""
    path = smollm2_gguf if kind == "q4_1" else requantized(kind)
    lm = pyml.load_model(gguf=str(path), warmup=False, kv_type="f32")
    hf = hf_gguf_model(path)
    worst = 0.0
    for prompt in PROMPTS:
        ids = lm.encode(prompt)
        got, ref = lm.forward(ids, all_logits=True), hf_logits(hf, ids)
        agree = (got.argmax(-1) == ref.argmax(-1)).mean()
        # a position whose top two oracle logits are within the error bound may flip
        top2 = np.sort(ref, axis=-1)[:, -2:]
        close = (top2[:, 1] - top2[:, 0]) < 0.10 * (ref.max() - ref.min())
        assert ((got.argmax(-1) == ref.argmax(-1)) | close).all(), (prompt, agree)
        worst = max(worst, float(np.abs(got - ref).max() / (ref.max() - ref.min())))
    assert worst < 0.10, worst


@pytest.mark.deep  # the oracle's cache, not pyml: these tests' oracle is hf_gguf_model's kept copy
def test_the_kept_oracle_is_the_model_transformers_builds_from_the_file(smollm2_gguf, torch):
    """hf_gguf_model (tests/conftest.py) loads transformers' model of a GGUF file from a checkpoint
    kept on disk: it has the weights, class and attention of the one built from the file now."""
    from transformers import AutoModelForCausalLM
    fresh = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32).eval()
    kept = hf_gguf_model(smollm2_gguf)
    assert type(kept) is type(fresh) and kept.config._attn_implementation == fresh.config._attn_implementation
    a, b = fresh.state_dict(), kept.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = [1, 450, 7483, 310, 3444, 338, 13]
    np.testing.assert_array_equal(hf_logits(kept, ids), hf_logits(fresh, ids))


def test_real_smollm2_exact_kernels_match_transformers(smollm2_gguf, monkeypatch, torch):
    """With float32 activations (pyml.quant's exact path) and float32 attention only summation order
    differs."""
    import functools

    from pyml import quant
    monkeypatch.setattr(quant, "matmul", functools.partial(quant.matmul, exact=True))
    lm = pyml.load_model(gguf=str(smollm2_gguf), warmup=False, kv_type="f32", float_compute="f32")
    hf = hf_gguf_model(smollm2_gguf)
    for prompt in PROMPTS[:2]:
        ids = lm.encode(prompt)
        got, ref = lm.forward(ids, all_logits=True), hf_logits(hf, ids)
        assert (got.argmax(-1) == ref.argmax(-1)).all()
        assert np.abs(got - ref).max() / (ref.max() - ref.min()) < 1e-4


def test_greedy_answer_is_on_topic(smollm2):
    res = smollm2.generate("The capital of France is", max_tokens=32, temperature=0)
    assert "Paris" in res.text
    assert len(res.tokens) >= 2


def test_gguf_rope_is_interleaved_and_matches_hf_layout(smollm2_gguf, monkeypatch):
    """GGUF llama Q/K rows are permuted by the converter: interleaved RoPE on them must equal
    rotate-half RoPE on the un-permuted rows (the HF layout). Two runs that differ by summation
    order only: the exact (float activation) path, as pyml.quant's doc asks of such tests."""
    import functools

    from pyml import quant
    monkeypatch.setattr(quant, "matmul", functools.partial(quant.matmul, exact=True))
    f = GGUFFile(smollm2_gguf)
    cfg = LlamaConfig.from_gguf(f)
    a = Llama(cfg, f.store(Llama.gguf_name), rope_style="interleaved")
    ids = [504, 3575, 282, 4649, 314]
    ref = a.forward(ids, a.new_cache(8, "f32"), all_logits=True)
    # undo the converter's permutation on Q and K rows, then run with half-style RoPE
    store = f.store(Llama.gguf_name)

    def unpermute(name, n_head):
        data, type_name, shape = store.tensors[name]
        rows = data.reshape(n_head, shape[0] // n_head // 2, 2, -1)
        store.tensors[name] = (np.ascontiguousarray(rows.swapaxes(1, 2)).reshape(data.shape), type_name, shape)

    for i in range(cfg.n_layers):
        unpermute(f"model.layers.{i}.self_attn.q_proj.weight", cfg.n_heads)
        unpermute(f"model.layers.{i}.self_attn.k_proj.weight", cfg.n_kv_heads)
    b = Llama(cfg, store, rope_style="half")
    got = b.forward(ids, b.new_cache(8, "f32"), all_logits=True)
    assert max_rel_err(got, ref) < 1e-4
