"""pyml-serve's logprobs, top_logprobs, echo and logit_bias, through raw HTTP and the real openai client,
against transformers' log_softmax of the same random GPT-2 checkpoint (the values' 1e-4 on a real model
is tests/nlp/test_logprobs.py's). The server is a real process on 127.0.0.1; every loop is bounded."""

import concurrent.futures
import json

import numpy as np
import openai
import pytest

from pyml.cli.standins import write_gpt2
from tests.cli.test_serve import HOST, serving, start_server, stop_server
from tests.conftest import hf_logits

TOL = 1e-4
PROMPT = "Hello there, general"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_gpt2(tmp_path_factory.mktemp("tiny"), "gpt2-tiny", n_positions=256, seed=3)


@pytest.fixture(scope="module", params=["1", "3"], ids=["one-at-a-time", "parallel"])
def server(checkpoint, request):
    """Every test on both workers: one generation at a time, and batched steps (--parallel), whose
    prompt chunks and decode rows share a forward."""
    served = start_server(checkpoint, "--kv-type", "f32", "--parallel", request.param)  # f32 cache: only summation order differs
    yield served
    stop_server(served)


@pytest.fixture(scope="module")
def oracle(checkpoint, torch):
    """ids -> transformers' log_softmax of every position [T, vocab]."""
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained(checkpoint).eval()
    return lambda ids: torch.log_softmax(torch.from_numpy(hf_logits(hf, ids)).double(), -1).numpy()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from pyml.nlp.tokenizer import Tokenizer
    return Tokenizer.from_file(checkpoint / "tokenizer.json")


def post(server, path, body):
    status, data = server.request("POST", path, body)
    return status, json.loads(data)


def sse_events(server, path, body) -> list:
    status, data = server.request("POST", path, {**body, "stream": True})
    assert status == 200, data
    return [json.loads(line[6:]) for line in data.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_completions_echo_gives_the_prompts_logprobs_first_null(server, oracle, tokenizer):
    """lm-evaluation-harness's request: echo, logprobs 1, max_tokens 1, temperature 0."""
    status, body = post(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 5,
                                                    "max_tokens": 1, "temperature": 0})
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    ids = tokenizer.encode(PROMPT)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][:len(ids)]) == PROMPT and choice["text"].startswith(PROMPT)
    assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
    ref = oracle(ids)
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]]) < TOL
        assert 1 <= len(lp["top_logprobs"][i]) <= 5  # a dict by token text: two tokens of one text are one key
    last = lp["top_logprobs"][-1]  # the generated token is the greedy one: the likeliest of its top 5
    assert lp["token_logprobs"][-1] == max(last.values())
    assert abs(lp["token_logprobs"][-1] - ref[-1].max()) < TOL  # the last prompt row chose it


def test_concurrent_echoed_prompts_score_as_transformers_does(server, oracle, tokenizer):
    """lm-eval sends many scoring requests at once: on the parallel server their prompts share
    batched steps (chunks beside other sequences' rows); every value is still transformers'."""
    prompts = [f"{PROMPT} number {i}" + " and more" * i for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        bodies = list(pool.map(lambda p: post(server, "/v1/completions", {
            "prompt": p, "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0}), prompts))
    for prompt, (status, body) in zip(prompts, bodies):
        assert status == 200, body
        ids, got = tokenizer.encode(prompt), body["choices"][0]["logprobs"]["token_logprobs"]
        ref = oracle(ids)
        assert got[0] is None and len(got) == len(ids) + 2
        assert np.allclose(got[1:len(ids)], [ref[i - 1, ids[i]] for i in range(1, len(ids))], atol=TOL)


def test_a_prompt_of_token_ids_scores_as_its_text(server, tokenizer):
    ids = tokenizer.encode(PROMPT)
    ask = {"echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    by_text = post(server, "/v1/completions", {**ask, "prompt": PROMPT})[1]["choices"][0]
    for prompt in (ids, [ids]):
        by_ids = post(server, "/v1/completions", {**ask, "prompt": prompt})[1]["choices"][0]
        assert by_ids["logprobs"]["token_logprobs"] == by_text["logprobs"]["token_logprobs"]
        assert by_ids["text"] == by_text["text"] == PROMPT  # max_tokens 0: the prompt alone
    status, body = post(server, "/v1/completions", {**ask, "prompt": [1, 10**9]})
    assert status == 400 and "outside the model's vocabulary" in body["error"]["message"]


def test_a_list_of_prompts_scores_each_as_transformers_does(server, oracle, tokenizer):
    """lm-evaluation-harness's batched request (local-completions with batch_size > 1): several
    prompts as token ids in one request, each choice its prompt's scores, choice i prompt i."""
    prompts = [tokenizer.encode(f"{PROMPT} number {i}" + " and more" * i) for i in range(3)]
    status, body = post(server, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1,
                                                    "max_tokens": 0, "temperature": 0})
    assert status == 200, body
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for ids, choice in zip(prompts, choices):
        got, ref = choice["logprobs"]["token_logprobs"], oracle(ids)
        assert got[0] is None and len(got) == len(ids) and choice["text"] == tokenizer.decode(ids)
        assert np.allclose(got[1:], [ref[i - 1, ids[i]] for i in range(1, len(ids))], atol=TOL)
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 0


def test_chat_logprobs_whole_and_streamed_through_the_openai_client(server, oracle, tokenizer):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
               logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert 1 <= len(content) <= 6
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy: the likeliest each time
    assert all(bytes(c.bytes).decode("utf-8", "replace") == c.token or c.token.startswith("bytes:") for c in content)
    streamed = [c for chunk in client.chat.completions.create(**ask, stream=True) for choice in chunk.choices
                if choice.logprobs for c in choice.logprobs.content]
    # the second request prefills only what the first did not cache: the same values but for rounding
    assert [c.token for c in streamed] == [c.token for c in content]
    assert np.allclose([c.logprob for c in streamed], [c.logprob for c in content], atol=TOL)


def test_streamed_completions_carry_their_tokens_logprobs_and_the_echoed_prompt_first(server):
    ask = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True}
    whole = post(server, "/v1/completions", ask)[1]["choices"][0]
    events = sse_events(server, "/v1/completions", ask)
    assert events[0]["choices"][0]["text"] == PROMPT
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    lps = [e["choices"][0]["logprobs"] for e in events if e.get("choices") and e["choices"][0]["logprobs"]]
    assert text == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for lp in lps for v in lp[key]] == whole["logprobs"][key]


def test_logprobs_off_is_null(server):
    body = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})[1]
    assert body["choices"][0]["logprobs"] is None
    body = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True})[1]
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["text"].startswith(PROMPT)


def test_logit_bias_steers_and_bans(server, tokenizer):
    ask = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1}
    plain = post(server, "/v1/completions", ask)[1]["choices"][0]["logprobs"]
    forced = post(server, "/v1/completions", {**ask, "logit_bias": {"65": 100}})[1]["choices"][0]["logprobs"]
    assert forced["tokens"] == ["A", "A", "A"]  # byte tokenizer: id 65 is "A"
    first = tokenizer.encode(plain["tokens"][0], add_special_tokens=False)[0]
    banned = post(server, "/v1/completions", {**ask, "logit_bias": {str(first): -100}})[1]["choices"][0]["logprobs"]
    assert banned["tokens"][0] != plain["tokens"][0]
    # the reported values are the model's, not the biased ones: A's first logprob is its plain one
    assert forced["token_logprobs"][0] < 0


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "1"}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": [5]}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
])
def test_bad_logprobs_fields_are_400_naming_the_field(server, path, extra, param):
    base = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": PROMPT}
    status, body = post(server, path, {**base, "max_tokens": 2, **extra})
    assert status == 400, body
    assert body["error"]["param"] == param


@pytest.mark.parametrize("bias", [{"5": 101}, {"99999": 1}])
def test_logit_bias_values_and_ids_out_of_range_are_400(server, bias):
    status, body = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logit_bias": bias})
    assert status == 400 and "logit_bias" in body["error"]["message"], body


def test_parallel_server_gives_the_logprobs_of_one_at_a_time(checkpoint):
    with serving(checkpoint, "--parallel", "2", "--kv-type", "f32") as served, \
            serving(checkpoint, "--kv-type", "f32") as single:
        ask = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 3}
        batched = post(served, "/v1/completions", ask)[1]["choices"][0]["logprobs"]
        alone = post(single, "/v1/completions", ask)[1]["choices"][0]["logprobs"]
        assert batched["tokens"] == alone["tokens"]
        assert np.allclose(batched["token_logprobs"], alone["token_logprobs"], atol=TOL)
        streamed = [e["choices"][0]["logprobs"] for e in sse_events(served, "/v1/completions", ask)
                    if e.get("choices") and e["choices"][0]["logprobs"]]
        assert [t for lp in streamed for t in lp["tokens"]] == batched["tokens"]
        echoed = [post(s, "/v1/completions", {**ask, "echo": True})[1]["choices"][0]["logprobs"] for s in (served, single)]
        assert echoed[0]["tokens"] == echoed[1]["tokens"] and echoed[0]["token_logprobs"][0] is None
        assert np.allclose(echoed[0]["token_logprobs"][1:], echoed[1]["token_logprobs"][1:], atol=TOL)
        assert post(served, "/v1/completions", {**ask, "echo": True, "logprobs": None})[0] == 200
