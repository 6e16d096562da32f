"""Log-probabilities (nlp/logprobs.py): a generation's, a prompt's (echo) and `LanguageModel.score`'s,
against transformers' log_softmax on the same F32 weights and token ids."""

import math

import numpy as np
import pytest

import pyml
from pyml.core.errors import PymlError
from pyml.nlp import logprobs as lp
from tests.conftest import hf_gguf_model, hf_logits

PROMPT = "The three primary colours are red, yellow and"
TOL = 1e-4  # the bound; F32 weights, F32 KV cache: only summation order differs


@pytest.fixture(scope="module")
def f32_pair(requantized, torch):
    """SmolLM2 in F32 (pyml-quantize of the Q4_1 file): pyml's model and transformers' of the file."""
    path = requantized("f32")
    lm = pyml.load_model(gguf=str(path), warmup=False, kv_type="f32", float_compute="f32")
    return lm, hf_gguf_model(path)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return pyml.load_model(gguf=str(smollm2_gguf), warmup=False)


def oracle_logprobs(hf, ids):
    """transformers' log_softmax of every position's logits [T, vocab], float64."""
    import torch
    return torch.log_softmax(torch.from_numpy(hf_logits(hf, ids)).double(), dim=-1).numpy()


def check_against(entry: lp.TokenLogprob, ref_row: np.ndarray, top: int):
    assert abs(entry.logprob - ref_row[entry.token]) < TOL
    assert len(entry.top) == top
    for token, value in entry.top:  # each listed token's value, read at the oracle's same id
        assert abs(value - ref_row[token]) < TOL, (token, value, ref_row[token])
    values = [v for _, v in entry.top]
    assert values == sorted(values, reverse=True)
    if top:  # the oracle's likeliest token is listed (ties within the tolerance may swap places)
        best = int(ref_row.argmax())
        assert best in dict(entry.top) or ref_row[best] - values[0] < TOL


@pytest.mark.parametrize("chunk", [None, 3])
def test_generation_and_echo_match_transformers(f32_pair, chunk, monkeypatch):
    """Greedy generation with top_logprobs=20 and echo: every generated and prompt token's value and
    its top 20 within 1e-4 of transformers' log_softmax (chunk=3: the prompt scored 3 rows at a time)."""
    lm, hf = f32_pair
    if chunk:
        monkeypatch.setattr(lp, "chunk_rows", lambda vocab: chunk)
    ids = lm.encode(PROMPT)
    res = lm.generate(ids, 6, logprobs=20, echo=True, temperature=0)
    assert len(res.logprobs) == len(res.tokens) == 6
    assert len(res.prompt_logprobs) == len(ids) - 1
    ref = oracle_logprobs(hf, ids + res.tokens)
    for i, entry in enumerate(res.prompt_logprobs):  # row i predicts ids[i + 1]
        assert entry.token == ids[i + 1]
        check_against(entry, ref[i], 20)
    for j, entry in enumerate(res.logprobs):  # generated token j is predicted by row len(ids) - 1 + j
        assert entry.token == res.tokens[j]
        check_against(entry, ref[len(ids) - 1 + j], 20)
        assert entry.top[0][0] == entry.token  # greedy: the chosen token is the likeliest


def test_score_matches_transformers(f32_pair):
    lm, hf = f32_pair
    context, continuation = "Question: what is the capital of France? Answer:", " Paris"
    score = lm.score(context, continuation, top_logprobs=5)
    n_ctx = len(lm.encode(context))
    assert score.tokens[:n_ctx] == lm.encode(context) and score.context == n_ctx
    ref = oracle_logprobs(hf, score.tokens)
    want = sum(ref[i - 1, score.tokens[i]] for i in range(n_ctx, len(score.tokens)))
    assert abs(score.logprob - want) < TOL * len(score.continuation)
    assert score.is_greedy == all(ref[i - 1].argmax() == score.tokens[i] for i in range(n_ctx, len(score.tokens)))
    for i, entry in enumerate(score.logprobs):
        check_against(entry, ref[i], 5)


def test_logprobs_with_sampling_are_the_models_not_the_samplers(f32_pair):
    """Temperature, top-k and penalties choose the token; its log-probability is still the model's."""
    lm, hf = f32_pair
    ids = lm.encode(PROMPT)
    res = lm.generate(ids, 4, logprobs=0, temperature=1.5, top_k=3, frequency_penalty=1.0, seed=3)
    ref = oracle_logprobs(hf, ids + res.tokens)
    for j, entry in enumerate(res.logprobs):
        assert entry.top == ()
        assert abs(entry.logprob - ref[len(ids) - 1 + j, entry.token]) < TOL


def test_logprobs_off_leaves_result_empty(smollm2):
    res = smollm2.generate("Hello", 2, temperature=0)
    assert res.logprobs is None and res.prompt_logprobs is None


def test_echo_without_tokens_scores_the_prompt(smollm2):
    ids = smollm2.encode(PROMPT)
    res = smollm2.generate(ids, 0, echo=True, logprobs=1)
    assert res.tokens == [] and res.stop_reason == "max_tokens"
    assert [t.token for t in res.prompt_logprobs] == ids[1:]
    assert all(t.logprob <= 0 and len(t.top) == 1 for t in res.prompt_logprobs)


def test_echo_does_not_reuse_a_prompt_cache(smollm2):
    """A cached position has no logits: echo prefills the whole prompt."""
    cache = smollm2.new_prompt_cache(64)
    ids = smollm2.encode(PROMPT)
    smollm2.generate(ids, 1, cache=cache, temperature=0)
    res = smollm2.generate(ids, 1, cache=cache, echo=True, temperature=0)
    assert res.cached_tokens == 0 and len(res.prompt_logprobs) == len(ids) - 1


def test_echo_one_token_past_a_chunk_generates_as_without_echo(smollm2, monkeypatch):
    """A prompt scored in chunks one token short of its length: the last two tokens are scored in one
    pass, not the last alone (a decode step, whose attention is f32 where the prefill's is bf16 on an
    avx512_bf16 CPU), so the generated tokens' log-probabilities equal those without echo, bit for bit."""
    ids = smollm2.encode(PROMPT)
    assert len(ids) > 4
    plain = smollm2.generate(ids, 4, logprobs=1, temperature=0)
    monkeypatch.setattr(lp, "chunk_rows", lambda vocab: len(ids) - 1)
    echoed = smollm2.generate(ids, 4, logprobs=1, echo=True, temperature=0)
    assert echoed.logprobs == plain.logprobs


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_bad_top_logprobs_is_one_clear_error(smollm2, bad):
    with pytest.raises(PymlError, match="top_logprobs must be an integer in \\[0, 20\\]"):
        smollm2.generate("Hello", 1, logprobs=bad)


def test_top_of_orders_and_breaks_ties_by_id():
    """Against a hand-checked case: ties keep the lower id first."""
    row = np.log(np.array([0.1, 0.3, 0.3, 0.2, 0.1]))
    assert [t for t, _ in lp.top_of(row, 3)] == [1, 2, 3]
    assert lp.top_of(row, 0) == ()
    assert len(lp.top_of(row, 9)) == 5
    assert math.isclose(lp.log_softmax(np.array([0.0, math.log(3.0)]))[1], math.log(0.75))
