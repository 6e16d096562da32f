"""logit_bias (OpenAI's): token id -> a bias added to its logit before anything else samples; -100
bans. Hand-checked cases: the biased distribution is softmax(logits + bias), written out."""

import math

import numpy as np
import pytest

from pyml.core.errors import PymlError
from pyml.nlp.generator import Generator
from pyml.nlp.sampling import Sampler, SamplingConfig


def test_greedy_follows_the_bias():
    logits = np.array([3.0, 1.0, 2.0], np.float32)
    assert Sampler(SamplingConfig())(logits) == 0
    assert Sampler(SamplingConfig(logit_bias={1: 2.5}))(logits) == 1  # 1 + 2.5 > 3
    assert Sampler(SamplingConfig(logit_bias={0: -100}))(logits) == 2


def test_the_biased_distribution_is_softmax_of_logits_plus_bias():
    """Two equal logits, +ln 3 on token 1: P(1) = 3 / (1 + 3) = 0.75 (4 sigma over 4,000 draws)."""
    sampler = Sampler(SamplingConfig(temperature=1.0, seed=7, logit_bias={1: math.log(3.0)}))
    logits = np.zeros(2, np.float32)
    draws = np.array([sampler(logits) for _ in range(4000)])
    assert abs(draws.mean() - 0.75) < 4 * math.sqrt(0.75 * 0.25 / 4000)


def test_minus_100_bans_even_the_likeliest_token():
    sampler = Sampler(SamplingConfig(temperature=2.0, seed=1, logit_bias={0: -100}))
    logits = np.array([500.0, 0.0, 0.0], np.float32)  # -100 alone would leave token 0 the likeliest
    assert 0 not in {sampler(logits) for _ in range(200)}


def test_the_callers_logits_are_not_changed():
    logits = np.array([1.0, 2.0], np.float32)
    Sampler(SamplingConfig(logit_bias={0: 5}))(logits)
    assert logits.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("bias, match", [({-1: 1}, "not a token id"), ({True: 1}, "not a token id"),
                                         ({"5": 1}, "not a token id"), ({5: 101}, r"\[-100, 100\]"),
                                         ({5: "1"}, r"\[-100, 100\]"), ({5: float("nan")}, r"\[-100, 100\]")])
def test_bad_logit_bias_is_one_clear_error(bias, match):
    with pytest.raises(PymlError, match=match):
        SamplingConfig(logit_bias=bias)


def test_ids_outside_the_vocabulary_and_banning_everything_are_refused():
    with pytest.raises(PymlError, match="token id 7 is outside the model's vocabulary of 3"):
        SamplingConfig(logit_bias={7: 1, 1: 1}).check_vocab(3)
    with pytest.raises(PymlError, match="bans every token"):
        SamplingConfig(logit_bias={0: -100, 1: -100}).check_vocab(2)


class _Vocab3:
    """A model stand-in of 3 tokens: the generator checks logit_bias before it runs anything."""
    class config:
        vocab_size = 3
    max_positions = 8


def test_the_generator_refuses_an_out_of_vocabulary_bias_before_running():
    with pytest.raises(PymlError, match="outside the model's vocabulary"):
        Generator(_Vocab3()).stream([1], 2, SamplingConfig(logit_bias={3: 1.0}))
