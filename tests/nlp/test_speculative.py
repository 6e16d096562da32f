"""Speculative decoding (nlp/speculative.py). The oracle for greedy decoding is plain decoding of
the same model (one token per step): with speculation the tokens must be identical, with a prompt
lookup drafter and with a draft model, on every stand-in architecture, on the f32/f16/q8_0 caches
and on sliding-window rings that wrap during the generation. The rejection rule is checked
against hand-made distributions by a chi-square test of the tokens it returns."""

import numpy as np
import pytest

from pyml.cli.bench_spec import PROMPTS as BENCH_PROMPTS
from pyml.cli.standins import write_gemma3, write_gpt2, write_llama_gguf
from pyml.core.errors import PymlError
from pyml.nlp.api import load_model
from pyml.nlp.batch_generator import BatchGenerator
from pyml.nlp.generator import GenerationResult, Generator, PromptCache
from pyml.nlp.sampling import SamplingConfig
from pyml.nlp import speculative
from pyml.nlp.speculative import PromptLookup, SpeculativeConfig, accept_sampled

# a prompt that repeats itself, so lookups hit (and a tiny random model often loops, so they go on hitting)
PROMPTS = [[5, 9, 17, 33, 40, 41, 42, 43, 5, 9, 17, 33, 40, 41, 42],
           [7, 7, 7, 100, 200, 300, 7, 7, 100, 200],
           list(range(60, 90)) + list(range(60, 75))]
LOOKUP = SpeculativeConfig(lookup_ngram=3, draft_max=6, adaptive=False)  # drafts at every step it can


def _llama(d, seed=0):
    return load_model(gguf=str(write_llama_gguf(d / f"m{seed}.gguf", "llama-tiny", "f32", seed=seed)), threads=1).model


def _tiny(arch, d, seed=0):
    if arch == "gpt2":
        return load_model(safetensors=str(write_gpt2(d / f"gpt2-{seed}", "gpt2-tiny", seed=seed)), threads=1).model
    if arch == "llama":
        return _llama(d, seed)
    # a context longer than window + RING_SLACK: the sliding layers keep rings, which wrap below
    return load_model(safetensors=str(write_gemma3(d / f"gemma3-{seed}", "gemma3-tiny", seed=seed,
                                                   max_position_embeddings=1024)), threads=1).model


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma3"])
def model(request, tmp_path_factory):
    return _tiny(request.param, tmp_path_factory.mktemp(request.param))


def _both(model, prompt, n, spec, cache=None, spec_cache=None, sampling=SamplingConfig()):
    plain = Generator(model).generate(prompt, n, sampling, cache=cache)
    res = GenerationResult(list(prompt))
    Generator(model).generate(prompt, n, sampling, cache=spec_cache, result=res, speculative=spec)
    return plain, res


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_lookup_is_token_identical(model, prompt):
    plain, spec = _both(model, prompt, 48, LOOKUP)
    assert spec.tokens == plain.tokens
    assert spec.drafted > 0 and spec.accepted > 0  # the check above saw drafts kept
    assert spec.timings()["draft_n"] == spec.drafted and "accepted" in spec.summary()
    assert len(spec.decode_s) == len(spec.tokens) - 1  # one time per token after the prefill's


@pytest.mark.parametrize("kv_type", ["f32", "f16"])  # q8_0: below (a head_dim of 32)
def test_greedy_lookup_on_every_cache_type(tmp_path, kv_type):
    model = _llama(tmp_path)
    for prompt in PROMPTS:
        plain, spec = _both(model, prompt, 40, LOOKUP, model.new_cache(128, kv_type), model.new_cache(128, kv_type))
        assert spec.tokens == plain.tokens and spec.drafted


def test_q8_0_cache_rollback(tmp_path):
    """head_dim 32: a q8_0 cache (llama-tiny's head_dim 16 cannot hold one)."""
    model = load_model(safetensors=str(write_gemma3(tmp_path, "gemma3-tiny", head_dim=32, query_pre_attn_scalar=32)),
                       threads=1).model
    for prompt in PROMPTS:
        plain, spec = _both(model, prompt, 40, LOOKUP, model.new_cache(128, "q8_0"), model.new_cache(128, "q8_0"))
        assert spec.tokens == plain.tokens and spec.drafted


def test_sliding_window_rings_wrap_during_speculation(tmp_path):
    model = load_model(safetensors=str(write_gemma3(tmp_path, "gemma3-tiny", max_position_embeddings=1024)),
                       threads=1).model
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 512, 250)] + PROMPTS[0]
    plain_kv, spec_kv = model.new_cache(700), model.new_cache(700)
    assert any(spec_kv.is_ring(i) for i in range(spec_kv.n_layers))  # 264 slots: positions 265+ wrap
    plain, spec = _both(model, prompt, 60, LOOKUP, plain_kv, spec_kv)
    assert spec.tokens == plain.tokens and spec.accepted and spec_kv.length > min(spec_kv.slots)  # past a ring


def test_greedy_draft_model_is_token_identical(model, tmp_path):
    target, other = model, _tiny(model.arch, tmp_path, seed=1)
    for draft, kept in ((other, False), (target, True)):  # a poor drafter (rejections) and a perfect one
        spec_config = SpeculativeConfig(draft_model=draft, draft_max=4, adaptive=False)
        for prompt in PROMPTS:
            plain, spec = _both(target, prompt, 40, spec_config)
            assert spec.tokens == plain.tokens and spec.drafted
            if kept:
                assert spec.accepted == spec.drafted


def test_a_refused_lookup_draft_leaves_k_alone_a_draft_models_shrinks(tmp_path, monkeypatch):
    # Prompt lookup's next proposal comes from another match, so a refusal keeps k at draft_max;
    # a draft model's tokens each cost a step of it, so there k follows the kept count (Throttle).
    seen = []
    speculated = speculative.Throttle.speculated

    def spy(self, seconds, produced, drafted, kept):
        speculated(self, seconds, produced, drafted, kept)
        seen.append((self, drafted, kept, self.k))

    def check(shrinks, ignore=None):
        refused = [k for throttle, drafted, kept, k in seen if kept < drafted and throttle is not ignore]
        assert refused  # the rule was put to the test
        assert (min(refused) < 4) == shrinks

    monkeypatch.setattr(speculative.Throttle, "speculated", spy)
    target, other = _llama(tmp_path, 0), _llama(tmp_path, 1)
    for spec_config, shrinks in ((SpeculativeConfig(lookup_ngram=3, draft_max=4), False),
                                 (SpeculativeConfig(draft_model=other, draft_max=4), True)):
        seen.clear()
        for prompt in PROMPTS:
            plain, spec = _both(target, prompt, 40, spec_config)
            assert spec.tokens == plain.tokens
        check(shrinks)
    # a batch's sequences share its verify pass's rows: their k shrinks, unless the batch has one slot
    for slots in (1, 2):
        seen.clear()
        gen = BatchGenerator(target, slots, 64, speculative=SpeculativeConfig(lookup_ngram=3, draft_max=4))
        for prompt in PROMPTS:
            gen.submit(prompt, 40)
        list(gen.run())
        check(slots > 1, ignore=gen.throttle)  # the batch's own throttle times steps; its k sizes nothing


def test_speculation_stops_where_plain_decoding_does(model):
    prompt = PROMPTS[0]
    plain = Generator(model).generate(prompt, 30)
    stop = plain.tokens[7]
    first = plain.tokens.index(stop)
    _, spec = _both(model, prompt, 30, LOOKUP)
    res = GenerationResult(list(prompt))
    Generator(model).generate(prompt, 30, stop_ids=[stop], result=res, speculative=LOOKUP)
    assert res.tokens == plain.tokens[:first + 1] and res.stop_reason == "eos"
    # a full cache: the same tokens and the same stop reason
    res_plain, res_spec = GenerationResult([]), GenerationResult([])
    a = list(Generator(model).stream(prompt, 100, ctx_size=len(prompt) + 20, result=res_plain))
    b = list(Generator(model).stream(prompt, 100, ctx_size=len(prompt) + 20, result=res_spec, speculative=LOOKUP))
    assert a == b and res_spec.stop_reason == res_plain.stop_reason == "context"


def test_prompt_cache_holds_what_was_kept(model):
    kv = PromptCache(model.new_cache(200))
    res = GenerationResult([])
    Generator(model).generate(PROMPTS[0], 30, cache=kv, result=res, speculative=LOOKUP)
    assert kv.tokens == (PROMPTS[0] + res.tokens)[:len(kv.tokens)] and len(kv.tokens) == kv.kv.length
    again = Generator(model).generate(PROMPTS[0] + res.tokens[:10], 20, cache=kv, speculative=LOOKUP)
    fresh = Generator(model).generate(PROMPTS[0] + res.tokens[:10], 20)
    assert again.tokens == fresh.tokens and again.cached_tokens > 0


def test_sampled_speculation_runs_with_penalties(model):
    sampling = SamplingConfig(temperature=0.8, top_k=40, seed=3, repetition_penalty=1.1)
    res = GenerationResult([])
    # one-token matches draft too: sampled text from random weights seldom repeats two tokens
    every_match = SpeculativeConfig(lookup_ngram=1, draft_max=6, adaptive=False)
    tokens = Generator(model).generate(PROMPTS[0], 40, sampling, result=res, speculative=every_match).tokens
    assert len(tokens) == 40 and res.drafted


def test_prompt_lookup_proposes_the_first_continuation():
    lookup = PromptLookup(3)
    assert lookup.propose([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 4) == [9, 1, 2, 3]  # the first earlier match
    assert lookup.propose([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3, 8, 5], 2) == []  # 5 never came before
    assert lookup.propose([4, 5, 6, 4, 5], 3) == [6, 4, 5]  # the index starts again on a shorter text
    assert lookup.propose([4, 5, 6, 4, 5, 7, 5], 3) == []  # one token matched (5): too little to draft on
    assert PromptLookup(1).propose([4, 5, 6, 4, 5, 7, 5], 3) == [6, 4, 5]  # unless N is 1
    assert PromptLookup(2).propose([1], 3) == []


def test_bad_speculative_options_are_one_line_errors(tmp_path):
    with pytest.raises(PymlError, match="--draft-max"):
        SpeculativeConfig(lookup_ngram=2, draft_max=0)
    with pytest.raises(PymlError, match="one drafter"):
        SpeculativeConfig()
    with pytest.raises(PymlError, match="--lookup-ngram"):
        SpeculativeConfig(lookup_ngram=-1)
    target = _llama(tmp_path)
    small = load_model(safetensors=str(write_gpt2(tmp_path, "gpt2-tiny", vocab_size=300)), threads=1).model
    with pytest.raises(PymlError, match="vocabulary"):
        Generator(target).generate([1, 2], 4, speculative=SpeculativeConfig(draft_model=small))


# --- the rejection rule: chi-square against the target's distribution --------------------------

# the 0.999 quantiles of chi-square with 2 and 8 degrees of freedom (any statistics table)
CHI2_999 = {2: 13.816, 8: 26.124}


def _chi2(counts, expected_probs):
    expected = np.asarray(expected_probs) * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft_kind", ["model", "lookup"])
def test_rejection_rule_keeps_the_target_distribution(draft_kind):
    """Two tokens over a 3-token vocabulary: the target's p1(x1) and p2(x2 | x1), a draft q that
    disagrees with it (or a fixed lookup draft). The pairs the rule returns (a pair cut short after
    a rejection is completed from p2, as the next step would) must follow p1(x1) p2(x2 | x1)."""
    rng = np.random.default_rng(11)
    p1 = np.array([0.6, 0.3, 0.1])
    p2 = np.array([[0.2, 0.2, 0.6], [0.7, 0.1, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    q1 = np.array([0.1, 0.3, 0.6])
    q2 = np.array([[0.5, 0.4, 0.1], [0.1, 0.8, 0.1], [0.0, 0.5, 0.5]])
    p3 = np.array([1.0, 0.0, 0.0])  # the bonus row's distribution: not counted
    counts = np.zeros(9)
    for _ in range(30_000):
        if draft_kind == "model":
            d1 = int(rng.choice(3, p=q1))
            d2 = int(rng.choice(3, p=q2[d1]))
            qs = [q1, q2[d1]]
        else:
            d1, d2, qs = 2, 0, [None, None]  # a lookup's draft: certain, and often unlikely under p
        chosen, kept = accept_sampled([p1, p2[d1], p3], [d1, d2], qs, rng)
        assert chosen[:kept] == [d1, d2][:kept] and len(chosen) == kept + 1
        if len(chosen) == 1:
            chosen.append(int(rng.choice(3, p=p2[chosen[0]])))
        counts[3 * chosen[0] + chosen[1]] += 1
    joint = (p1[:, None] * p2).reshape(-1)
    assert _chi2(counts, joint) < CHI2_999[8]


def test_a_draft_that_is_the_target_is_always_kept():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.25, 0.25])
    for _ in range(200):
        d = int(rng.choice(3, p=p))
        assert accept_sampled([p, p], [d], [p], rng)[1] == 1


# --- real models -----------------------------------------------------------------------------

CODE = "def area(radius):\n    return 3.14159 * radius * radius\n\n\ndef perimeter(radius):\n    return 2 * 3.14159 * radius\n"


TEXT = ("The lighthouse at Point Reyes was built in 1870. Its lens, made in France, has 24 panels and "
        "weighs over two tons. Keepers climbed 300 steps each night to wind the clockwork that turned it. "
        "Fog is so common there that the station once logged 2,000 hours of it in a single year.")


# The oracle is plain decoding: the verify pass must give each position the decode step's bits
# (quant/dispatch.py: 2..FEW_TOKENS rows each through its GEMV's arithmetic; nn/attention.py:
# FEW_QUERIES), else greedy output drifts after 10-30 tokens on these files. Gemma 3's steps are
# several times SmolLM2's (its 262,144-row head): the default tier gives it two of the four prompts
# (the code to edit, and the bench's, past 128 positions; each keeps 50-55 drafts of 64 tokens), the
# deep tier the other two ([gemma3-more], covered by [gemma3]: the same model's verify passes).
REAL_TEXTS = {"code": "Rename radius to r in this code:\n\n" + CODE, "summary": "Summarise this text:\n\n" + TEXT,
              "haiku": "Write a haiku about the sea.",
              # pyml-bench --spec's, past 128 positions: the fused step's attention cuts its span in parts
              "bench": BENCH_PROMPTS["summarise-text"]}


@pytest.mark.parametrize("which, texts", [("smollm2", ("code", "summary", "haiku", "bench")),
                                          ("gemma3", ("code", "bench")),
                                          pytest.param("gemma3", ("summary", "haiku"), marks=pytest.mark.deep)],
                         ids=["smollm2", "gemma3", "gemma3-more"])
def test_real_models_greedy_lookup_is_token_identical(which, texts, smollm2_gguf, gemma3_gguf):
    lm = load_model(gguf=str(smollm2_gguf if which == "smollm2" else gemma3_gguf), threads=2)
    drafted = 0
    for text in texts:
        prompt = lm.chat_prompt([{"role": "user", "content": REAL_TEXTS[text]}])
        plain = lm.generate(prompt, 64)
        spec = lm.generate(prompt, 64, speculative=SpeculativeConfig(lookup_ngram=3, adaptive=False))
        assert spec.tokens == plain.tokens, text
        drafted += spec.accepted
    assert drafted > 0


def test_real_draft_model_is_token_identical(smollm2_gguf, requantized):
    """SmolLM2 Q4_1 drafting for its own Q4_0 requantization: the same vocabulary, other weights. (Q4_0:
    its decode step is the block shape of tests/nn/test_fused.py's Q4_0 stand-in and test_batch.py's,
    compiled by the default tier anyway; a Q8_0 target compiled a decode_region of its own, ~47 s cold.)"""
    target = load_model(gguf=str(requantized("q4_0")), threads=2)
    draft = load_model(gguf=str(smollm2_gguf), threads=2)
    prompt = target.chat_prompt([{"role": "user", "content": "List three colours of the rainbow."}])
    plain = target.generate(prompt, 64)
    spec = target.generate(prompt, 64, speculative=SpeculativeConfig(draft_model=draft, draft_max=4, adaptive=False))
    assert spec.tokens == plain.tokens and spec.accepted > 0
