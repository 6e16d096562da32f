"""The streaming Python API: lm.stream / generate / chat, stop strings, min-p, the prompt cache."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyml.cli.standins import write_gpt2
from pyml.nlp.api import load_model
from pyml.core.errors import PymlError
from pyml.nlp.generator import MAX_STOP_CHARS, StopStrings
from pyml.nlp.sampling import Sampler, SamplingConfig


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(safetensors=str(write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny")), threads=1)


def shown(stops, pieces):
    s = StopStrings(stops)
    out = [s.push(p) for p in pieces]
    return out, s


def test_stop_string_split_across_pieces_is_never_shown():
    out, s = shown(["END"], ["abc E", "N", "D tail"])
    assert out == ["abc ", "", ""] and s.hit


def test_a_partial_match_is_held_then_released():
    out, s = shown(["END"], ["abc E", "N", "x"])
    assert out == ["abc ", "", "ENx"] and not s.hit
    out, s = shown(["END"], ["ab EN"])
    assert out == ["ab "] and s.flush() == "EN"


def test_the_earliest_of_several_stop_strings_wins():
    out, s = shown(["zz", "b"], ["a b zz"])
    assert out == ["a "] and s.hit


def test_overlapping_stop_string_is_found_after_a_false_start():
    # "aaa" ends with "aa", a prefix of "aab": the first "a" is shown, the match starts at the second
    out, s = shown(["aab"], ["a", "a", "a", "b tail"])
    assert out == ["", "", "a", ""] and s.hit


def test_a_held_prefix_of_one_stop_string_releases_when_another_completes():
    out, s = shown(["abcd", "bc"], ["ab", "c"])
    assert out == ["", "a"] and s.hit  # "bc" starts at 1, "abcd" has not completed yet
    out, s = shown(["abcd", "bc"], ["abcd"])
    assert out == [""] and s.hit  # one piece: the earliest start wins, "abcd" at 0


def test_flush_starts_the_matching_again():
    s = StopStrings(["END"])
    assert s.push("x EN") == "x " and s.flush() == "EN"
    assert s.push("D") == "D" and not s.hit


def naive_shown(stops, pieces):
    """The rule stated plainly: hold the longest tail that begins some stop string; cut at the
    earliest stop string found in what is held plus the new piece."""
    pending, out = "", []
    for piece in pieces:
        pending += piece
        found = [i for i in (pending.find(s) for s in stops) if i >= 0]
        if found:
            out.append(pending[:min(found)])
            return out, True
        held = max((k for s in stops for k in range(1, len(s)) if pending.endswith(s[:k])), default=0)
        out.append(pending[:len(pending) - held])
        pending = pending[len(pending) - held:]
    return out, False


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=3),
       st.lists(st.text("abc", max_size=6), max_size=8))
def test_stop_strings_match_the_plain_rule(stops, pieces):
    s = StopStrings(stops)
    out = []
    for p in pieces:
        out.append(s.push(p))
        if s.hit:
            break
    assert (out, s.hit) == naive_shown(stops, pieces)


def test_a_300000_character_stop_string_costs_linear_time():
    stop = "x" * 299_999 + "y"  # every piece is a prefix of it: the worst case for slicing prefixes
    t0 = time.perf_counter()
    s = StopStrings([stop])
    out = [s.push("x" * 1000) for _ in range(8)] + [s.push("z")]
    elapsed = time.perf_counter() - t0
    assert out == [""] * 8 + ["x" * 8000 + "z"] and not s.hit
    assert elapsed < 3.0, elapsed  # the bound; ~0.1 s here, 8.8 s before for 4 tokens


def test_a_stop_string_over_the_limit_is_refused_by_its_length():
    with pytest.raises(PymlError, match="stop string of 1,000,001 characters .* limit of 1,000,000"):
        StopStrings(["a" * (MAX_STOP_CHARS + 1)])


def test_stream_events_make_the_generated_text(lm):
    events = list(lm.stream("Hello world", max_tokens=12))
    result = events[-1].result
    assert result is not None and all(e.result is None for e in events[:-1])
    assert "".join(e.text for e in events) == result.text
    assert result.text == lm.decode(result.tokens)
    assert len(result.tokens) == 12 and result.stop_reason == "max_tokens"
    pieces = []
    assert lm.generate("Hello world", max_tokens=12, on_text=pieces.append).text == "".join(pieces) == result.text


def test_stop_string_ends_the_text(lm):
    full = lm.generate("The cat", max_tokens=24).text
    stop = full[6:9]
    cut = full.find(stop)
    res = lm.generate("The cat", max_tokens=24, stop=[stop])
    assert res.stop_reason == "stop"
    assert res.text == full[:cut]
    streamed = "".join(e.text for e in lm.stream("The cat", max_tokens=24, stop=[stop]))
    assert streamed == full[:cut]


def test_closing_the_stream_early_keeps_a_partial_result(lm):
    from pyml.nlp.generator import GenerationResult
    ids = lm.encode("Hello world")
    res = GenerationResult(ids)
    it = lm.stream(ids, max_tokens=50, result=res)
    next(it)
    it.close()
    assert 1 <= len(res.tokens) < 50


def test_prompt_cache_prefills_only_the_new_tokens(lm):
    cache = lm.new_prompt_cache(128)
    first = lm.generate("Hello world", max_tokens=6, cache=cache)
    follow = lm.encode("Hello world") + first.tokens + lm.encode(" and more")
    again = lm.generate(follow, max_tokens=6, cache=cache)
    assert again.cached_tokens == len(lm.encode("Hello world")) + len(first.tokens) - 1
    assert again.tokens == lm.generate(follow, max_tokens=6).tokens  # same as without the cache
    other = lm.generate("Something else", max_tokens=6, cache=cache)
    assert other.tokens == lm.generate("Something else", max_tokens=6).tokens


def test_chat_is_generate_on_the_template(lm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    prompt = lm.tokenizer.apply_chat_template(messages, template=lm.chat_template)
    assert prompt.endswith("<|im_start|>assistant\n")  # ChatML, written out by hand
    assert lm.chat(messages, max_tokens=5).tokens == lm.generate(prompt, max_tokens=5).tokens
    assert "".join(e.text for e in lm.chat(messages, max_tokens=5, stream=True)) == lm.chat(messages, 5).text


def test_decode_inverts_encode(lm):
    assert lm.decode(lm.encode("Hello, world!")) == "Hello, world!"


def test_min_p_of_one_keeps_only_the_likeliest():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    sampler = Sampler(SamplingConfig(temperature=1.0, min_p=1.0, seed=0))
    assert {sampler(logits) for _ in range(50)} == {1}
    sampler = Sampler(SamplingConfig(temperature=1.0, min_p=0.5, seed=0))  # p(2)/p(1) = e^-0.1, p(0)/p(1) = e^-2.9
    assert {sampler(logits) for _ in range(200)} == {1, 2}


def test_frequency_and_presence_penalties_as_openai_defines_them():
    logits = np.array([1.0, 1.5, 1.2], np.float32)
    # token 1 seen twice: 1.5 - 2 * 0.2 - 0.05 = 1.05 < 1.2, so greedy picks token 2
    assert Sampler(SamplingConfig(frequency_penalty=0.2, presence_penalty=0.05))(logits, [1, 1]) == 2
    assert Sampler(SamplingConfig(frequency_penalty=0.1))(logits, [1, 1]) == 1  # 1.3 > 1.2


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(frequency_penalty=3.0), dict(presence_penalty=-2.5)])
def test_bad_sampling_options_are_refused(bad):
    from pyml.core.errors import PymlError
    with pytest.raises(PymlError):
        SamplingConfig(**bad)


@pytest.mark.parametrize("bad", ["hi \ud800", "hi \udcff"])
def test_a_prompt_that_is_not_text_is_refused_by_the_library(lm, bad):
    with pytest.raises(PymlError, match="the text to tokenize holds"):
        lm.generate(bad, max_tokens=1)
    with pytest.raises(PymlError, match="a stop string holds"):
        lm.generate("hi", max_tokens=1, stop=[bad])


def test_a_negative_seed_is_refused_by_the_library(lm):
    with pytest.raises(PymlError, match="^seed must be an integer >= 0, got -1"):  # the argument, not a flag
        lm.generate("hi", max_tokens=1, temperature=1.0, seed=-1)
