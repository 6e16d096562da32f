"""Llama 3.x, Mistral, Qwen2/2.5, Qwen3 and Phi-3 against transformers, from safetensors and from GGUF.

Each case is a random checkpoint in the architecture's real config shape (small dims) written by
transformers, and the same weights as llama.cpp's converter writes them (tests/nlp/hf_to_gguf.py).
pyml's logits, prompt and KV-cached decode one token at a time, must be within 1e-4 of the
logit range of transformers' in float32, from both formats. Every architecture also refuses a
file with one unexpected tensor and a config with an unsupported RoPE type, in one line.
"""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import pyml
from pyml.core.errors import ModelFormatError, UnsupportedError
from pyml.nlp.api import build_gguf
from tests.conftest import hf_logits
from tests.nlp.hf_to_gguf import write_gguf

IDS = [3, 17, 42, 90, 0, 7, 7, 56, 11, 23, 64, 5]
TOL = 1e-4
BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)

# name -> (transformers model_type, config changes): each a real family's config shape, small
CASES = {
    "llama3": ("llama", dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama3_tied": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1, rope_scaling=dict(
        rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "llama_linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("mistral", dict(sliding_window=None, rope_theta=1_000_000.0)),
    "mistral_window": ("mistral", dict(sliding_window=4)),
    "qwen2": ("qwen2", dict(rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "qwen2_untied": ("qwen2", dict(rope_theta=1_000_000.0)),
    "qwen2_yarn": ("qwen2", dict(rope_theta=1_000_000.0, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16))),
    "qwen3_yarn": ("qwen3", dict(head_dim=32, rope_scaling=dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=8, beta_fast=16.0, beta_slow=2.0))),
    "qwen3": ("qwen3", dict(head_dim=32, rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "phi3": ("phi3", dict(num_key_value_heads=4, sliding_window=5, original_max_position_embeddings=32,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
NO_WINDOW_IN_GGUF = {"mistral_window"}  # the converter writes no sliding_window for llama-arch files


def hf_classes(model_type):
    import transformers
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3"}[model_type]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForCausalLM")


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(name, directory, transformers model) of one random checkpoint."""
    import torch
    name = request.param
    model_type, changes = CASES[name]
    config_cls, model_cls = hf_classes(model_type)
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**BASE, **changes})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.2)
            elif pname.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.5)
    directory = tmp_path_factory.mktemp(name)
    model.save_pretrained(directory, safe_serialization=True)
    return name, directory, model


def range_err(got, ref) -> float:
    """max |pyml - transformers| over the range of transformers' logits."""
    return float(np.abs(np.asarray(got) - ref).max() / (ref.max() - ref.min()))


def errors(model, ref, prompt: int = 5):
    """(prompt error, worst KV-cached decode error): the whole prompt at once, then a prefix and
    one token at a time against each position's logits."""
    full = range_err(model.forward(IDS, model.new_cache(len(IDS), "f32"), all_logits=True), ref)
    cache = model.new_cache(len(IDS), "f32")
    model.forward(IDS[:prompt], cache)
    decode = max(range_err(model.forward([t], cache), ref[prompt + i]) for i, t in enumerate(IDS[prompt:]))
    return full, decode


def test_safetensors_matches_transformers(case, torch):
    name, directory, hf = case
    lm = pyml.load_model(safetensors=str(directory), warmup=False, kv_type="f32")
    assert lm.model.arch == hf.config.model_type
    full, decode = errors(lm.model, hf_logits(hf, IDS))
    print(f"\n[{name} safetensors] prompt {full:.2e} decode {decode:.2e} of the logit range")
    assert full <= TOL and decode <= TOL


def test_gguf_matches_transformers(case, torch, tmp_path):
    name, directory, hf = case
    path = write_gguf(directory, hf, tmp_path / f"{name}.gguf")
    model = build_gguf(path, with_tokenizer=False).model
    if name in NO_WINDOW_IN_GGUF:
        hf = type(hf)(type(hf.config)(**{**hf.config.to_dict(), "sliding_window": None})).eval()
        hf.load_state_dict(case[2].state_dict())
    full, decode = errors(model, hf_logits(hf, IDS))
    print(f"\n[{name} gguf] prompt {full:.2e} decode {decode:.2e} of the logit range")
    assert full <= TOL and decode <= TOL


def test_a_batch_equals_each_sequence_alone(case):
    """Each architecture's batched pass (forward_batch over a KVPool): every sequence's logits are
    those it gets alone, bit for bit, sequences of different lengths, a prompt joining mid-run."""
    from tests.nlp.test_batch import check_batch_equals_alone
    lm = pyml.load_model(safetensors=str(case[1]), threads=2, kv_type="f32", float_compute="f32")
    prompts = [IDS[:7], IDS[7:9], [5, 60, 3, 91, 12, 8, 33, 2, 70, 44, 9], IDS[2:8]]
    check_batch_equals_alone(lm.model, prompts, kv_type="f32", join_at=1, max_len=64)


def test_greedy_speculation_equals_plain_decoding(case, tmp_path):
    """Each architecture's speculative decoding (its verify pass a batched step of one sequence,
    nlp/speculative.py), with prompt lookup and with a draft model of the same architecture whose
    weights are the target's perturbed by 30%: the tokens of plain greedy decoding, with drafts made
    (kept always, sometimes or never, by architecture: `-s` prints the counts)."""
    from pyml.nlp.generator import GenerationResult, Generator
    from pyml.nlp.speculative import SpeculativeConfig
    lm = pyml.load_model(safetensors=str(case[1]), threads=2, kv_type="f32", float_compute="f32")
    draft_dir = tmp_path / "draft"
    shutil.copytree(case[1], draft_dir)
    rng = np.random.default_rng(1)
    tensors = load_file(str(draft_dir / "model.safetensors"))
    save_file({k: (v * (1 + 0.3 * rng.standard_normal(v.shape))).astype(v.dtype) for k, v in tensors.items()},
              str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    draft = pyml.load_model(safetensors=str(draft_dir), threads=2, kv_type="f32", float_compute="f32")
    prompt = IDS + IDS[:8] + IDS + IDS[:6]  # repeats; one-token matches draft too, so every reply drafts
    plain = Generator(lm.model).generate(prompt, 40)
    for drafter in (dict(lookup_ngram=1), dict(draft_model=draft.model)):
        res = GenerationResult(list(prompt))
        spec = Generator(lm.model).generate(prompt, 40, result=res, speculative=SpeculativeConfig(
            **drafter, draft_max=6, adaptive=False))
        assert spec.tokens == plain.tokens and res.drafted > 0, drafter
        print(f"\n[{case[0]}] {drafter}: kept {res.accepted} of {res.drafted}")


def test_greedy_batched_speculation_equals_plain_batch(case):
    """Prompt lookup for several sequences at once (BatchGenerator's verify pass: every sequence's
    last token and drafts as decode rows of one compiled batched step): each sequence's tokens are
    those of the batch without drafts, with drafts of several sequences verified in one pass."""
    from pyml.nlp.batch_generator import BatchGenerator
    from pyml.nlp.sampling import SamplingConfig
    from pyml.nlp.speculative import SpeculativeConfig
    lm = pyml.load_model(safetensors=str(case[1]), threads=2, kv_type="f32", float_compute="f32")
    prompts = [IDS + IDS[:8] + IDS + IDS[:6], IDS[3:9] * 3, [5, 60, 3, 91, 12, 8, 33, 5, 60, 3]]
    greedy = SamplingConfig(temperature=0.0)

    def run(speculative):
        gen = BatchGenerator(lm.model, 3, 96, speculative=speculative)
        requests = [gen.submit(p, 30, greedy) for p in prompts]
        passes = 0
        while gen.busy:
            steps = gen.steps
            gen.step()
            passes += gen.steps > steps and gen.last_shape[0] > gen.last_shape[1] >= 2  # drafts of a batch
        return [r.result for r in requests], passes

    plain, _ = run(None)
    spec, verified = run(SpeculativeConfig(lookup_ngram=1, draft_max=6, adaptive=False))
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert verified > 0 and all(r.drafted > 0 for r in spec)


def test_unexpected_tensor_is_refused_in_both_formats(case, tmp_path):
    name, directory, hf = case
    stray = np.zeros(4, np.float32)
    path = write_gguf(directory, hf, tmp_path / "extra.gguf", extra_tensors={"blk.0.attn_stray.weight": stray})
    with pytest.raises(ModelFormatError, match=r"'blk\.0\.attn_stray\.weight'") as e:
        build_gguf(path, with_tokenizer=False)
    assert "\n" not in str(e.value)
    copy = tmp_path / "extra"
    shutil.copytree(directory, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    save_file({**tensors, "model.layers.0.self_attn.stray.weight": stray}, str(copy / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"'model\.layers\.0\.self_attn\.stray\.weight'") as e:
        pyml.load_model(safetensors=str(copy), warmup=False, kv_type="f32")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("rope", [dict(rope_type="dynamic", factor=2.0), dict(type="longrope", factor=2.0),
                                  dict(rope_type="ntk_by_parts", factor=2.0)],
                         ids=["dynamic", "longrope", "unknown"])
def test_unsupported_rope_type_is_refused(case, tmp_path, rope):
    name, directory, hf = case
    copy = tmp_path / "rope"
    shutil.copytree(directory, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {**rope, "rope_theta": 10000.0}
    (copy / "config.json").write_text(json.dumps(cfg))
    kind = rope.get("rope_type", rope.get("type"))
    with pytest.raises(UnsupportedError, match=f"rope type '{kind}' is not supported") as e:
        pyml.load_model(safetensors=str(copy), warmup=False, kv_type="f32")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key, value, match", [
    ("rope.scaling.type", "longrope", "rope scaling type 'longrope' is not supported"),
    ("attn_logit_softcapping", 30.0, "attn_logit_softcapping is set"),
    ("attention.scale", 0.125, "attention.scale is set"),
], ids=["longrope", "softcap", "attention_scale"])
def test_math_changing_gguf_key_is_refused(case, tmp_path, key, value, match):
    name, directory, hf = case
    arch = "llama" if hf.config.model_type == "mistral" else hf.config.model_type
    path = write_gguf(directory, hf, tmp_path / "bad.gguf", extra_keys={f"{arch}.{key}": value})
    with pytest.raises(UnsupportedError, match=match):
        build_gguf(path, with_tokenizer=False)


def test_math_changing_hf_key_is_refused(case, tmp_path):
    name, directory, hf = case
    copy = tmp_path / "softcap"
    shutil.copytree(directory, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "final_logit_softcapping": 30.0}))
    with pytest.raises(UnsupportedError, match="final_logit_softcapping is set"):
        pyml.load_model(safetensors=str(copy), warmup=False, kv_type="f32")


def test_bias_presence_follows_the_config(case, tmp_path):
    """A bias the config rules out is refused; one it requires must be in the file."""
    name, directory, hf = case
    copy = tmp_path / "bias"
    shutil.copytree(directory, copy)
    tensors = load_file(str(copy / "model.safetensors"))
    biases = [n for n in tensors if n.endswith("_proj.bias")]
    if biases:  # drop one the config requires
        del tensors[biases[0]]
        match = "required tensor .* is missing"
    else:  # add one the config rules out
        tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(hf.config.hidden_size, np.float32)
        match = "'model.layers.0.self_attn.o_proj.bias'"
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=match):
        pyml.load_model(safetensors=str(copy), warmup=False, kv_type="f32")


def test_llama3_divisors_match_transformers(torch):
    """pyml's llama3 divisors from config.json equal transformers' inverse frequencies."""
    from transformers import LlamaConfig
    from pyml.nlp.models.llama import LlamaConfig as PymlLlama
    from tests.nlp.hf_to_gguf import llama3_divisors
    hf = LlamaConfig(**{**BASE, **CASES["llama3"][1]})
    ours = PymlLlama.from_hf(hf.to_dict())
    np.testing.assert_allclose(ours.rope.divisors(ours.rope_theta, ours.head_dim), llama3_divisors(hf), rtol=1e-6)
