"""GPT-2 against transformers' GPT2LMHeadModel on the same random weights (float32)."""

import numpy as np
import pytest

import pyml
from tests.conftest import hf_logits, max_rel_err, save_hf_gpt2

TOL = 1e-4

CONFIGS = {
    "base": dict(n_layer=2, n_embd=64, n_head=4),
    "odd_head_dim": dict(n_layer=3, n_embd=36, n_head=6),      # head_dim 6: no power of two
    "single_head": dict(n_layer=1, n_embd=24, n_head=1, n_inner=40),
    "wide_heads": dict(n_layer=2, n_embd=60, n_head=5, activation_function="gelu_new"),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def gpt2_pair(request, tmp_path_factory, torch):
    d = tmp_path_factory.mktemp(f"gpt2_{request.param}")
    hf = save_hf_gpt2(d, **CONFIGS[request.param])
    lm = pyml.load_model(safetensors=str(d), warmup=False, kv_type="f32")
    return hf, lm


def test_prefill_logits_match(gpt2_pair):
    hf, lm = gpt2_pair
    ids = [3, 17, 42, 99, 0, 7, 7, 56]
    got = lm.forward(ids, all_logits=True)
    assert got.shape == (len(ids), hf.config.vocab_size)
    assert max_rel_err(got, hf_logits(hf, ids)) < TOL


def test_cached_decode_matches_full_forward(gpt2_pair):
    hf, lm = gpt2_pair
    ids = [5, 9, 2, 77, 31, 64, 12, 8, 90, 1]
    ref = hf_logits(hf, ids)
    cache = lm.new_cache(len(ids))
    got = [lm.model.forward(ids[:4], cache)]
    for t in ids[4:]:
        got.append(lm.model.forward([t], cache))
    assert cache.length == len(ids)
    for i, logits in enumerate(got):
        assert max_rel_err(logits, ref[3 + i]) < TOL, f"position {3 + i}"


def test_prompt_of_length_one(gpt2_pair):
    hf, lm = gpt2_pair
    assert max_rel_err(lm.forward([11]), hf_logits(hf, [11])[0]) < TOL


def test_prompt_filling_the_context(tmp_path, torch):
    hf = save_hf_gpt2(tmp_path, n_positions=16, seed=3)
    lm = pyml.load_model(safetensors=str(tmp_path), warmup=False, kv_type="f32")
    ids = list(np.random.default_rng(0).integers(0, 101, 16))
    assert max_rel_err(lm.forward(ids, all_logits=True), hf_logits(hf, ids)) < TOL
    # and one position more does not fit
    with pytest.raises(pyml.PymlError, match="context window"):
        lm.generate(ids + [1], max_tokens=1)


def test_greedy_generation_equals_oracle_argmax_chain(gpt2_pair):
    hf, lm = gpt2_pair
    prompt = [4, 8, 15, 16, 23, 42]
    res = lm.generate(prompt, max_tokens=8, temperature=0)
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(np.argmax(hf_logits(hf, ids)[-1])))
    assert res.tokens == ids[len(prompt):]
