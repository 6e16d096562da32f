"""Context shift: a full cache keeps its first n_keep tokens and the newer half of the rest
(llama.cpp's rule: n_discard = (n_past - n_keep) // 2), and generation goes on as if the model
had been given exactly the kept tokens. The oracle is a fresh forward pass over that list."""

import pytest

from pyml.cli.standins import write_gemma3, write_gpt2, write_llama_gguf
from pyml.core.errors import PymlError
from pyml.nlp.api import load_model
from pyml.nlp.generator import GenerationResult, Generator, PromptCache
from pyml.nlp.sampling import Sampler, SamplingConfig

# Sampled, not greedy: a tiny random GPT-2 repeats one token under argmax, which would hide a wrong shift.
SAMPLING = SamplingConfig(temperature=1.5, seed=7)


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma3"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt2":
        return load_model(safetensors=str(write_gpt2(d, "gpt2-tiny")), threads=1).model
    if request.param == "llama":
        return load_model(gguf=str(write_llama_gguf(d / "m.gguf", "llama-tiny", "f32")), threads=1).model
    # sliding-window layers (window 4 here) hold fewer positions than the shifted context
    return load_model(safetensors=str(write_gemma3(d, "gemma3-tiny", sliding_window=4)), threads=1).model


def expected_tokens(model, prompt, n_new, ctx, n_keep):
    """The generation with the shift done by hand: after each shift the next logits come from a
    fresh cache holding exactly the kept tokens."""
    sampler, history = Sampler(SAMPLING), list(prompt)
    cached, out = list(prompt), []
    cache = model.new_cache(ctx)
    token = sampler(model.forward(cached, cache), history)
    for _ in range(n_new - 1):
        out.append(token)
        history.append(token)
        if len(cached) >= ctx:
            n_discard = (len(cached) - n_keep) // 2
            cached = cached[:n_keep] + cached[n_keep + n_discard:]
            cache = model.new_cache(ctx)
            model.forward(cached, cache)
        logits = model.forward([token], cache, pos=len(cached))
        cached.append(token)
        token = sampler(logits, history)
    out.append(token)
    return out


@pytest.mark.parametrize("n_keep", [0, 2])
def test_generation_goes_on_past_a_full_cache(model, n_keep):
    prompt, ctx, n_new = [5, 9, 17, 33], 10, 24  # 4 or 5 shifts
    res = GenerationResult([])
    tokens = list(Generator(model).stream(prompt, n_new, SAMPLING, ctx_size=ctx, context_shift=True, n_keep=n_keep,
                                          result=res))
    assert len(tokens) == n_new and res.context_shifts == (4 if n_keep == 0 else 5)
    assert len(set(tokens)) > 3  # the check below can tell a wrong shift apart
    assert tokens == expected_tokens(model, prompt, n_new, ctx, n_keep)


def test_without_context_shift_a_full_cache_stops(model):
    gen = Generator(model)
    res = GenerationResult([])
    tokens = list(gen.stream([5, 9, 17, 33], 24, ctx_size=10, result=res))
    assert res.stop_reason == "context" and len(tokens) == 7  # 10 positions: 4 prompt + 6 fed + the last chosen


def test_shift_counts_and_prompt_cache_tokens(model):
    kv = PromptCache(model.new_cache(10))
    res = GenerationResult([])
    list(Generator(model).stream([5, 9, 17, 33], 24, cache=kv, result=res, context_shift=True, n_keep=1))
    assert res.context_shifts == 5 and res.stop_reason == "max_tokens"
    assert len(kv.tokens) == kv.kv.length and kv.tokens[0] == 5  # the kept first token, then the newest ones


def test_bad_context_options_are_one_line_errors(model):
    with pytest.raises(PymlError, match="--ctx-size"):
        list(Generator(model).stream([1, 2], 4, ctx_size=0))
    with pytest.raises(PymlError, match="--keep"):
        list(Generator(model).stream([1, 2], 4, context_shift=True, n_keep=-1))
    with pytest.raises(PymlError, match="longer than the context size of 3"):
        list(Generator(model).stream([1, 2, 3, 4], 4, ctx_size=3))
