"""A generation's `cancelled()` check: asked once per decode step, it ends the generation there."""

import pytest

from pyml.cli.standins import write_gpt2
from pyml.nlp.api import load_model


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(safetensors=str(write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny")), threads=1)


@pytest.mark.parametrize("after", [0, 1, 5])
def test_cancelled_ends_the_generation_at_the_next_decode_step(lm, after):
    asked = []

    def cancelled():
        asked.append(True)
        return len(asked) > after

    events = list(lm.stream("Hello world", max_tokens=50, temperature=0, cancelled=cancelled))
    result = events[-1].result
    # the prefill chose the first token; each check that said "go on" let one more decode step run
    assert result.stop_reason == "cancelled"
    assert len(result.tokens) == after + 1 and len(result.decode_s) == after
    full = lm.generate("Hello world", max_tokens=after + 1, temperature=0)
    assert result.tokens == full.tokens  # the same text up to the cut: the check changes nothing else


def test_never_cancelled_runs_to_max_tokens(lm):
    result = lm.generate("Hello world", max_tokens=7, cancelled=lambda: False)
    assert result.stop_reason == "max_tokens" and len(result.tokens) == 7
