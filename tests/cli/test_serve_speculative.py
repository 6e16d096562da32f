"""pyml-serve --lookup-ngram N: every request's generation drafts by prompt lookup (server-wide), one
generation at a time (--parallel 1) or several verified in one batched step (--parallel N). The oracle
is the same requests on a server without it in the same mode (greedy: the same text); llama-server's
draft counters appear in `timings` and /metrics; a request speculation cannot serve (logprobs, a
grammar) runs plainly rather than failing; --draft-model with --parallel > 1 is refused by name."""

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pyml.cli.pyml_serve import build_parser, check_limits
from pyml.cli.standins import write_gpt2
from tests.cli.test_serve import SERVE, serve_env, start_server, stop_server

# text that repeats, so a random stand-in's reply (which loops) and the prompt share n-grams
PROMPTS = ["one two three four one two three four one two", "the cat sat on the mat and the cat sat on",
           "a b c d e f a b c d e f a b c"]


@pytest.fixture(scope="module", params=["1", "4"], ids=["one-at-a-time", "parallel"])
def servers(request, tmp_path_factory):
    model = write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny", n_positions=256)
    plain = start_server(model, "--parallel", request.param)  # the same mode: the same arithmetic
    try:
        spec = start_server(model, "--parallel", request.param, "--lookup-ngram", "2")
    except BaseException:
        stop_server(plain)
        raise
    yield plain, spec
    stop_server(spec)
    stop_server(plain)


def _client(served):
    return openai.OpenAI(base_url=served.base + "/v1", api_key="none", timeout=60, max_retries=0)


def test_speculation_gives_the_plain_servers_text_and_counts_its_drafts(servers):
    plain, spec = servers
    drafted = 0
    for prompt in PROMPTS:
        want = _client(plain).completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
        got = _client(spec).completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens
        timings = got.model_extra["timings"]
        drafted += timings.get("draft_n", 0)
        assert 0 <= timings.get("draft_n_accepted", 0) <= timings.get("draft_n", 0)
        assert "draft_n" not in want.model_extra["timings"]
    assert drafted > 0  # the replies loop: lookups found something to draft
    metrics = spec.request("GET", "/metrics")[1].decode()
    total = float(re.search(r"^pyml_draft_tokens_total (\S+)$", metrics, re.M).group(1))
    kept = float(re.search(r"^pyml_draft_tokens_accepted_total (\S+)$", metrics, re.M).group(1))
    assert total >= drafted and 0 <= kept <= total


def test_streamed_speculation_equals_the_whole_reply(servers):
    _, spec = servers
    client = _client(spec)
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0, stream=True))
    assert streamed == whole.choices[0].text


def test_a_request_with_logprobs_runs_plainly(servers):
    plain, spec = servers
    got = _client(spec).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=2)
    want = _client(plain).completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                            logprobs=2)
    assert got.choices[0].text == want.choices[0].text and "draft_n" not in got.model_extra["timings"]
    assert got.choices[0].logprobs.token_logprobs == want.choices[0].logprobs.token_logprobs


def test_concurrent_requests_each_get_the_plain_servers_text(servers):
    """With --parallel 4 the requests decode together, each drafting from its own text: one pass
    verifies every sequence's drafts."""
    plain, spec = servers
    ask = [dict(model="tiny", prompt=p, max_tokens=40, temperature=0) for p in PROMPTS * 2]
    with ThreadPoolExecutor(len(ask)) as pool:
        got = list(pool.map(lambda a: _client(spec).completions.create(**a).choices[0].text, ask))
    assert got == [_client(plain).completions.create(**a).choices[0].text for a in ask]


def test_a_draft_model_with_parallel_slots_is_refused_by_name(tmp_path):
    done = subprocess.run([*SERVE, "-m", str(tmp_path / "any.gguf"), "--port", "0", "--parallel", "2",
                           "--draft-model", str(tmp_path / "draft.gguf")], env=serve_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["pyml-serve: error: --draft-model with --parallel 2 is not implemented: a "
                                        "draft model drafts for one sequence at a time (--parallel 1); "
                                        "--lookup-ngram drafts for a batch"]


@pytest.mark.parametrize("flags, slots", [([], 4), (["--parallel", "2"], 2), (["--lookup-ngram", "3"], 4),
                                          (["--draft-model", "x.gguf"], 1)])
def test_slots_default_to_four_and_to_one_for_a_draft_model(flags, slots):
    """llama-server's default -np 4; a draft model drafts for one sequence, so its default is 1."""
    args = build_parser().parse_args(["-m", "x.gguf", *flags])
    assert check_limits(args).parallel == slots
